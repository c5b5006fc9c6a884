#!/usr/bin/env bash
# One-command GPU check (issues 15, 21 and 41): at most 5 minutes on one H200 (each step has its own timeout; the
# sum of the timeouts is 295 s, the model builds included); ends with ONE table: each target of issue 41's
# "Targets on one H200" and item 5's ratios, the measured figure, PASS or FAIL.
#
#   bash benchmarks/gpu_check.sh              # from the repository root, on a host with CUDA torch and Triton
#   bash benchmarks/gpu_check.sh --dry-run    # every step at a tiny shape on the CPU, in well under a minute
#                                             # (tests/benchmarks/test_gpu_check.py runs it: the script cannot rot)
#
# Exit status 0 when every step ran to its end (the verdicts are the table's), 1 naming those that did not.
# Raw outputs go into one folder, OUT (default runs/gpu_check): device.txt, tests.txt, iteration_cost.txt,
# decode_4k_8.txt, later_step.json (+ .txt), llada2.json (+ .txt), fastdllm_reference.json (+ .txt; with
# FASTDLLM_DIR), table.txt.
#
# Steps (PYTHON, default the checkout's .venv/bin/python, else python3; nothing is downloaded):
# 1. tests on CUDA (a dry run only collects them: the table says "collected N"): the fused quantized-attention kernels compiled (tests/quant/test_fused_attention.py,
#    tests/quant/test_fused_rows.py; tests/conftest.py lets Triton's ldconfig/cc through) and the CUDA-graph tests
#    (tests/engine/test_graphs.py -k cuda: capture, replay equal to eager, new requests replaying the graphs of
#    earlier ones from the K/V pool, the goldens token-identical; LLaDA2's later steps the same,
#    tests/engine/test_llada2_graphs.py);
# 2. benchmarks/iteration_cost.py (counts per iteration, its own command line, unchanged here) at LLaDA-8B's shape;
# 3. benchmarks/decode_speed.py at 4k reused tokens, batch 8, 8 fixed steps per block: the dual cache, KIVI and
#    dLLM-KVQ at 4 and 2 bits, with the HBM share (PEAK_GBS, default 4800 GB/s for an H200). The model's context
#    is 4,096 tokens: prompt 3,936 + 128 generated (4 blocks of 32) = 4,064; every later step reuses 4,032;
# 4. benchmarks/gpu_steps.py later-step: a later-step iteration's time at 1, 8, 32, 64 rows, unquantized (CUDA
#    graphs on, and off) and KIVI, against its roofline;
# 5. benchmarks/gpu_steps.py llada2: LLaDA2.0-mini's shape, block mode, tokens/s at 1 and 32 rows (no target), the
#    unquantized later steps replayed from CUDA graphs (service/engine/block_causal_graphs.py);
# 6. with FASTDLLM_DIR (a checkout of NVlabs/Fast-dLLM at commit 24cc59e, carried like the wheels below: its
#    llada/generate.py and llada/model/ are read; it needs einops, which the device image has), benchmarks/
#    gpu_steps.py reference: batch 1, our decode against the reference's own generate_with_dual_cache on the same
#    random weights, tokens/s and token identity (the reference's code is not in this repository; without
#    FASTDLLM_DIR that row says NOT RUN);
# 7. benchmarks/gpu_steps.py table: the table.
#
# The device image (docs/gpu-host.md) has CUDA torch, Triton and transformers but lacks packages the server
# needs; the check's steps import only the engine and the quantized store, which need pydantic (and its
# pydantic-core, annotated-types, typing-inspection) and llguidance, never fastapi, uvicorn, pydantic-settings,
# redis or opentelemetry-api (the dry run refuses those imports: benchmarks/absent/sitecustomize.py). Carry the
# wheels from a machine with pip and a network, for the device's Python (3.12, x86-64), into a folder that
# travels with the checkout:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 llguidance==1.9.1
# and on the device, before this script:
#   python3 -m pip install --no-index --find-links .whl --target /tmp/site pydantic pydantic-core \
#     annotated-types typing-inspection llguidance && export PYTHONPATH=/tmp/site
# (versions: those scripts/setup.sh installs; pip download without --no-deps fetches their dependencies too).
# The Fast-dLLM reference travels the same way: from a clone of https://github.com/NVlabs/Fast-dLLM,
#   mkdir -p .fastdllm && git -C Fast-dLLM archive 24cc59e llada/generate.py llada/model | tar -x -C .fastdllm
# then FASTDLLM_DIR=.fastdllm on the device (name .whl and .fastdllm in .git/info/exclude and in the run's carry).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
# The checkout's virtual environment (scripts/setup.sh makes it) when there is one, else python3 (a device image);
# PYTHON=... overrides either.
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
PEAK_GBS=${PEAK_GBS:-4800}
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

if [ "$DRY" = 1 ]; then
  # A CPU at tiny shapes; the packages the device lacks are refused, so a step that starts needing one fails here.
  export PYTHONPATH="$PWD/benchmarks/absent:$PYTHONPATH" DLLM_ABSENT="fastapi,uvicorn,pydantic_settings,redis,opentelemetry"
  export OMP_NUM_THREADS=1
  DEV=(--device cpu --dtype float32)
  echo "dry run: CPU, tiny shapes" > "$OUT/device.txt"
  TESTS=(--collect-only -q)
  ITER=(--rows 1,2 --layers 2 --width 64 --vocab 256 --prompt-length 24 --gen-length 16 --block-length 8
        --steps-per-block 2)
  DECODE=(--preset tiny --prompt-length 24 --gen-length 16 --block-length 8 --steps-per-block 2 --batch 2
          --threads 1)
  STEPS=(--tiny)
else
  DEV=(--device cuda --dtype bfloat16)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/device.txt" 2>&1
  date -u +%Y-%m-%dT%H:%MZ >> "$OUT/device.txt"
  TESTS=(-q -p no:cacheprovider)
  ITER=(--rows 1,8,32,64 --width 4096 --vocab 126464)
  DECODE=(--preset 8b --prompt-length 3936 --gen-length 128 --block-length 32 --steps-per-block 8 --batch 8
          --threads 4)
  STEPS=()
fi
echo "python: $PYTHON" >> "$OUT/device.txt"
cat "$OUT/device.txt"

step() {  # step NAME SECONDS COMMAND...: run, tee into OUT/NAME.txt, go on whatever it returns
  local name=$1 seconds=$2
  shift 2
  echo "== $name (at most ${seconds} s)"
  timeout "$seconds" "$@" 2>&1 | tee "$OUT/$name.txt"
  local rc=${PIPESTATUS[0]}
  if [ "$rc" != 0 ]; then
    local why=""  # timeout(1) exits 124 when the step ran out of time, 137 when it had to kill it
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then why=": it ran past its timeout of ${seconds} s"; fi
    echo "   $name ended with status $rc$why" | tee -a "$OUT/$name.txt"
    FAILED="$FAILED $name"
  fi
}
FAILED=""

step tests 50 "$PYTHON" -m pytest tests/quant/test_fused_attention.py tests/quant/test_fused_rows.py \
  tests/engine/test_graphs.py::test_cuda_graphs_replay_token_identical_to_eager \
  tests/engine/test_llada2_graphs.py::test_cuda_graphs_replay_llada2_token_identical_to_eager "${TESTS[@]}"
step iteration_cost 40 "$PYTHON" benchmarks/iteration_cost.py "${DEV[@]}" "${ITER[@]}" --caches dual \
  --methods none,kivi
step decode_4k_8 80 "$PYTHON" benchmarks/decode_speed.py "${DEV[@]}" "${DECODE[@]}" --bits 4,2 \
  --schedules fixed --repeats 1 --peak-bandwidth "$PEAK_GBS" \
  --methods "dual+kivi 4b,dual+dllm_kvq 4b,dual+kivi 2b,dual+dllm_kvq 2b"
step later_step 45 "$PYTHON" benchmarks/gpu_steps.py later-step "${DEV[@]}" "${STEPS[@]}" --json "$OUT/later_step.json"
step llada2 35 "$PYTHON" benchmarks/gpu_steps.py llada2 "${DEV[@]}" "${STEPS[@]}" --json "$OUT/llada2.json"
if [ -n "${FASTDLLM_DIR:-}" ]; then
  step fastdllm_reference 45 "$PYTHON" benchmarks/gpu_steps.py reference --fastdllm "$FASTDLLM_DIR" "${DEV[@]}" \
    "${STEPS[@]}" --json "$OUT/fastdllm_reference.json"
fi
"$PYTHON" benchmarks/gpu_steps.py table --out "$OUT" $([ "$DRY" = 1 ] && echo --dry-run) | tee "$OUT/table.txt"
# The status: 0 when every step ran to its end (whatever the verdicts), 1 naming the steps that did not.
if [ -n "$FAILED" ]; then echo "steps that did not finish:$FAILED"; exit 1; fi
