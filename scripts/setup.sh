#!/usr/bin/env bash
# Create .venv and install the project. torch==2.13.0 goes first so that nothing pulls a multi-GB CUDA build
# on a CPU host (the GPU image installs the CUDA build of torch instead, see Dockerfile).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[test]"
# The project's lm-eval tasks (digit_ledger, gsm8k_local, humaneval_local) where plain lm-eval finds them:
# `lm_eval --include_path .dllm-kvq/lm-eval-tasks --tasks digit_ledger ...` (docs/evaluation.md).
.venv/bin/dllm-kvq evaluate tasks --out .dllm-kvq/lm-eval-tasks >/dev/null
# matplotlib lists the system fonts (fc-list) the first time it is imported and keeps the list: done here, once,
# not inside whichever command or test imports it first (the suite refuses unmarked subprocesses).
.venv/bin/python -c "import matplotlib.font_manager" >/dev/null 2>&1 || true
cat <<'NEXT'

Set up. Next, start the server on the embedded default model (CPU, no download):
  .venv/bin/dllm-kvq serve
and, from a second shell, send it the request of README.md ("Ask it"). The tests: bash scripts/test.sh
NEXT
