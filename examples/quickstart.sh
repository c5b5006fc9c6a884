#!/usr/bin/env bash
# The Quickstart (docs/quickstart.md) as one script: the embedded default model served with Redis as the store, calibrated,
# a 2-bit dLLM-KVQ dual-cache policy activated from the command line (`policies activate --server`: the admin
# endpoint), questions through the official openai client, the Prometheus metrics, a swap to KIVI and back, lm-eval
# over HTTP on the model's task, and the paper-style table. Each step is the page's command; what they print and
# write lands in $RUNS.
#
# Run from the repository root after `bash scripts/setup.sh`:
#   bash examples/quickstart.sh
# Settings (environment): PY (.venv/bin/python), PORT (8000), STORE (a Redis URL; default: a redis-server of the
# script's own on a free port, stopped at the end: one already answering on 6379 may be someone else's), RUNS
# (runs/quickstart), DLLM_ADMIN_KEY, CALIBRATION_ARGS (extra `calibration all` flags, e.g. "--samples 2 --rounds 1
# --cache-modes dual --bits 2 --kvquant-bits 2"), ASK_QUESTIONS (8), LIMIT (32), MATRIX_ARGS (extra `evaluation matrix`
# flags after the page's, which they override, e.g. "--cache-modes prefix,dual --bits 4,2"). tests/e2e runs this
# script with small settings and checks what it wrote.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PORT=${PORT:-8000}
RUNS=${RUNS:-runs/quickstart}
export DLLM_ADMIN_KEY=${DLLM_ADMIN_KEY:-quickstart-admin-key-0123456789}
URL=http://127.0.0.1:$PORT
mkdir -p "$RUNS"
step() { printf '\n== %s\n' "$*"; }
SERVER=
REDIS_PID_FILE=
stop() {
  if [ -n "$SERVER" ]; then kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true; fi
  if [ -n "$REDIS_PID_FILE" ] && [ -s "$REDIS_PID_FILE" ]; then kill "$(cat "$REDIS_PID_FILE")" 2>/dev/null || true; fi
}
trap stop EXIT

if [ -z "${STORE:-}" ]; then
  step "start a Redis of our own on a free port (docs/quickstart.md, step 2)"
  REDIS_PORT=$($PY -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  REDIS_PID_FILE=$(cd "$RUNS" && pwd)/redis.pid
  redis-server --daemonize yes --bind 127.0.0.1 --port "$REDIS_PORT" --save "" --appendonly no --pidfile "$REDIS_PID_FILE"
  for _ in $(seq 100); do redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && break; sleep 0.1; done
  STORE=redis://127.0.0.1:$REDIS_PORT/0
fi

step "start the server on the embedded default model, Redis as the store, every quantized request re-decoded unquantized (agreement)"
$PY -m service serve --store-url "$STORE" --shadow-rate 1 --threads 1 --port "$PORT" > "$RUNS/server.log" 2>&1 &
SERVER=$!
curl -sS --fail-with-body --retry 180 --retry-delay 1 --retry-all-errors "$URL/health/ready"; echo

step "calibrate the embedded model on its own training split (policies and KVQuant states go to Redis)"
# shellcheck disable=SC2086  # CALIBRATION_ARGS is a list of flags
$PY -m calibration all --store "$STORE" --out "$RUNS/calibration" --no-progress ${CALIBRATION_ARGS:-}

step "activate the 2-bit dLLM-KVQ policy for the dual cache"
$PY -m service policies activate dual "$RUNS/calibration/activate/dllm_kvq-dual-2bit.json" --server "$URL" --json \
  | tee "$RUNS/activate-dllm_kvq.json"
$PY examples/kv_metrics.py --url "$URL" --save "$RUNS/metrics-before.txt"

step "ask questions with the openai client (chat, streamed chat, completions; tokens/s per cache mode)"
$PY examples/ask.py --url "$URL" --questions "${ASK_QUESTIONS:-8}" --json "$RUNS/ask-dllm_kvq.json"

step "read the metrics: effective bits, bytes held against bf16, agreement with the unquantized cache"
$PY examples/kv_metrics.py --url "$URL" --save "$RUNS/metrics-dllm_kvq.txt"

step "swap the dual cache to 2-bit KIVI, ask again, read the metrics"
$PY -m service policies activate dual '{"method": "kivi", "bits": 2}' --server "$URL" --json \
  | tee "$RUNS/activate-kivi.json"
$PY examples/ask.py --url "$URL" --questions 4 --json "$RUNS/ask-kivi.json"
$PY examples/kv_metrics.py --url "$URL" --save "$RUNS/metrics-kivi.txt"

step "and back to the dLLM-KVQ policy"
$PY -m service policies activate dual "$RUNS/calibration/activate/dllm_kvq-dual-2bit.json" --server "$URL" --json \
  | tee "$RUNS/activate-back.json"

step "lm-eval over HTTP on the embedded model's task (the first ${LIMIT:-32} held-out questions)"
$PY -m evaluation lm-eval --model local-chat-completions \
  --model_args "model=embedded,base_url=$URL/v1/chat/completions" --tasks digit_ledger --apply_chat_template \
  --limit "${LIMIT:-32}" --output_path "$RUNS/lm-eval" --log_samples

step "the paper-style table for the same slice (in-process lm-eval; scores also pushed to the server)"
# shellcheck disable=SC2086  # MATRIX_ARGS is a list of flags
$PY -m evaluation matrix --tasks digit_ledger --limit "${LIMIT:-32}" --threads 1 --store "$STORE" \
  --from-calibration latest --server "$URL" --out "$RUNS/matrix" --cache-modes dual --bits 2 ${MATRIX_ARGS:-}
$PY examples/kv_metrics.py --url "$URL" --save "$RUNS/metrics-end.txt" > /dev/null
