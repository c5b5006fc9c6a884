#!/usr/bin/env bash
# Set up and run the whole suite. The suite starts its own redis-server on a free port in a temporary directory
# (tests/conftest.py) and never touches a Redis you run; this script only makes sure redis-server is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if ! command -v redis-server >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null
  else
    echo "test.sh: redis-server is not installed; install it (e.g. sudo apt-get install redis-server)" >&2
    exit 1
  fi
fi
# Debian's prometheus (promtool and the server) for tests/deploy, installed only when absent; that needs root
# or sudo and apt. Where it cannot be installed, those tests are skipped with this reason (CI runs as root).
if ! bash scripts/install_tools.sh prometheus; then
  export DLLM_TEST_MISSING_PROMETHEUS="scripts/install_tools.sh could not install prometheus/promtool here"
  echo "test.sh: $DLLM_TEST_MISSING_PROMETHEUS; the tests that need them are skipped" >&2
fi
# Lint first (ruff's version is pinned in pyproject's test extra, its rules and line length configured there).
.venv/bin/ruff check .
# pytest exits 5 when it collects nothing; that fails this script as any other non-zero exit does.
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
.venv/bin/python -m pytest
# The container tier, after the suite and only for the whole suite: scripts/container_smoke.sh builds the CPU
# image and runs it and the compose stack (tests/deploy/test_container_smoke.py; minutes when the layer cache
# holds the dependencies, tens of minutes cold). Unless a docker daemon answers, podman (with runc and
# debootstrap) is installed when absent; where it cannot be, the tier is skipped with this reason.
# DLLM_CONTAINER_SMOKE=0 leaves the tier out.
if [ "${DLLM_CONTAINER_SMOKE:-1}" = 0 ]; then
  echo "test.sh: DLLM_CONTAINER_SMOKE=0: the container tier is left out" >&2
  exit 0
fi
if ! docker info >/dev/null 2>&1 && ! bash scripts/install_tools.sh containers; then
  export DLLM_TEST_MISSING_CONTAINER_ENGINE="scripts/install_tools.sh could not install podman here"
fi
export DLLM_CONTAINER_SMOKE=1
exec .venv/bin/python -m pytest tests/deploy/test_container_smoke.py -s
