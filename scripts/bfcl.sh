#!/usr/bin/env bash
# The Berkeley Function Calling Leaderboard harness (bfcl-eval, PyPI), unchanged, against `dllm-kvq serve` over
# HTTP (docs/evaluation.md, "Tool calls with bfcl-eval"). It installs bfcl-eval in a virtual environment of its own
# (it pins numpy 1.x and pulls several vendors' SDKs), starts a server on the embedded model, generates the first
# BFCL_PER_CATEGORY entries of each category in BFCL_CATEGORIES, scores them and prints the scores.
#
# The handler: bfcl-eval's OpenAI function-calling models use the Responses API; its one entry that sends
# `tools` through chat completions (OpenAICompletionsHandler, which honours OPENAI_BASE_URL) is
# `openbmb/MiniCPM-SALA-FC`, so the server is started under that name (--served-model-name).
#
#   bash scripts/bfcl.sh     # env: BFCL_VENV, BFCL_PROJECT_ROOT, BFCL_PORT, BFCL_CATEGORIES, BFCL_PER_CATEGORY
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${BFCL_VENV:-.dllm-kvq/bfcl-venv}
ROOT=$(realpath -m "${BFCL_PROJECT_ROOT:-.dllm-kvq/bfcl-results}")
PORT=${BFCL_PORT:-8731}
CATEGORIES=${BFCL_CATEGORIES:-simple_python,multiple,parallel,irrelevance}
PER_CATEGORY=${BFCL_PER_CATEGORY:-2}
MODEL=openbmb/MiniCPM-SALA-FC

if [ ! -x "$VENV/bin/bfcl" ]; then
    .venv/bin/python -m venv "$VENV"
    # torch first, as scripts/setup.sh does (sentence-transformers would pull a CUDA build); soundfile: qwen-agent
    # imports it and does not declare it (without it `bfcl` stops with "No module named 'soundfile'").
    "$VENV/bin/pip" install -q torch==2.13.0
    "$VENV/bin/pip" install -q bfcl-eval==2026.3.23 soundfile
fi

# The entries to run: bfcl's --run-ids reads test_case_ids_to_generate.json in its project root.
rm -rf "$ROOT/result" "$ROOT/score"
mkdir -p "$ROOT"
BFCL_PROJECT_ROOT=$ROOT "$VENV/bin/python" - "$CATEGORIES" "$PER_CATEGORY" <<'PY'
import json, sys
from bfcl_eval.constants.eval_config import TEST_IDS_TO_GENERATE_PATH
from bfcl_eval.utils import load_dataset_entry

categories, count = sys.argv[1].split(","), int(sys.argv[2])
ids = {c: [e["id"] for e in load_dataset_entry(c)[:count]] for c in categories}
TEST_IDS_TO_GENERATE_PATH.write_text(json.dumps(ids, indent=1))
print(f"entries: {ids}")
PY

OMP_NUM_THREADS=1 .venv/bin/python -m service serve --served-model-name "$MODEL" --port "$PORT" --threads 1 \
    --default-max-tokens 32 >"$ROOT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 120); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    kill -0 $SERVER 2>/dev/null || { echo "the server stopped: $ROOT/server.log" >&2; exit 1; }
    sleep 1
done

export BFCL_PROJECT_ROOT=$ROOT OPENAI_BASE_URL=http://127.0.0.1:$PORT/v1 OPENAI_API_KEY=unused
"$VENV/bin/bfcl" generate --model "$MODEL" --run-ids --num-threads 1
"$VENV/bin/bfcl" evaluate --model "$MODEL" --test-category "$CATEGORIES" --partial-eval
echo "requests answered: $(grep -c 'POST /v1/chat/completions HTTP/1.1" 200' "$ROOT/server.log") of" \
     "$(grep -c 'POST /v1/chat/completions' "$ROOT/server.log")"
for f in "$ROOT"/score/*/*/*_score.json; do
    echo "$(basename "$f" _score.json): $(head -1 "$f")"
done
cat "$ROOT/score/data_non_live.csv"
