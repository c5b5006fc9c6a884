#!/usr/bin/env bash
# Set up, make sure Redis answers on 127.0.0.1:6379 (start one if not), run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Debian's prometheus (promtool and the server) for tests/deploy, installed only when absent.
bash scripts/install_tools.sh
if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no
  for _ in $(seq 50); do redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && break; sleep 0.1; done
fi
# pytest exits 5 when it collects nothing; that fails this script as any other non-zero exit does.
exec .venv/bin/python -m pytest "$@"
