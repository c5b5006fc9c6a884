#!/usr/bin/env bash
# One-command GPU check of the fused quantized attention (issue 15); about 6-8 minutes on one H200.
#
#   bash benchmarks/gpu_check.sh            # from the repository root, with the project installed (+ triton)
#
# 1. the kernel exactness tests on CUDA (tests/quant/test_fused_attention.py: compiled kernels, not the
#    interpreter; tests/conftest.py sets TRITON_INTERPRET only where no GPU is present), and the one launch for the
#    rows of several stores against each store's own (tests/quant/test_fused_rows.py, issue 21);
# 2. benchmarks/kv_memory.py on the device (bytes held per method and bits at the 8B layer shape);
# 3. benchmarks/decode_speed.py --preset 8b --device cuda --dtype bfloat16 at about 1k and 4k reused tokens, batch
#    1 and 8, 8 fixed steps per block: the dual cache unquantized and KIVI / dLLM-KVQ / KVQuant at 4 and 2 bits,
#    whose later steps run the fused Triton kernel (--kv-attention auto on CUDA);
# 4. benchmarks/iteration_cost.py on the device (issue 21): tensor ops, host syncs, forwards and the measured
#    time of one later-step iteration of 1-64 requests, LLaDA-8B random weights in bf16 (unquantized and KIVI;
#    KIVI's rows attend in one fused-kernel launch per layer, service/quant/kernels/attention.py);
# then prints ONE table: tokens/s per configuration, method and bits, time vs the unquantized dual cache, the KV
# bytes a later step reads, the bytes a forward reads (weights + KV) and the bandwidth that implies against the
# device's peak (PEAK_GBS, default 4800 GB/s for an H200; a lower bound: block-initial forwards are counted too).
# Targets (issue 15): at 4k, 4-bit KIVI and dLLM-KVQ <= 0.8x the dual cache's time, 2-bit <= 0.6x, >= 60% of peak.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
PEAK_GBS=${PEAK_GBS:-4800}
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
date -u +%Y-%m-%dT%H:%MZ >> "$OUT/device.txt"

echo "== kernel tests on CUDA"
timeout 180 "$PYTHON" -m pytest tests/quant/test_fused_attention.py tests/quant/test_fused_rows.py -q \
  -p no:cacheprovider 2>&1 | tail -3 \
  | tee "$OUT/kernel_tests.txt"

echo "== kv_memory on the device"
timeout 60 "$PYTHON" benchmarks/kv_memory.py --device cuda --tokens 4096 | tee "$OUT/kv_memory.txt"

METHODS="dual+kivi 4b,dual+dllm_kvq 4b,dual+kvquant 4b,dual+kivi 2b,dual+dllm_kvq 2b,dual+kvquant 2b"
# reused tokens = prompt + generated - block: 800 + 256 - 32 = 1024; 3872 + 256 - 32 = 4096
for prompt in 800 3872; do
  for batch in 1 8; do
    echo "== decode_speed: reused $((prompt + 224)) tokens, batch $batch"
    timeout 150 "$PYTHON" benchmarks/decode_speed.py --preset 8b --device cuda --dtype bfloat16 --threads 4 \
      --prompt-length "$prompt" --batch "$batch" --bits 4,2 --schedules fixed --repeats 1 \
      --methods "$METHODS" --peak-bandwidth "$PEAK_GBS" | tee "$OUT/decode_${prompt}_${batch}.txt"
  done
done

echo "== iteration cost (issue 21): LLaDA-8B random weights, bf16, measured later-step time per iteration"
# Counts (ops, syncs, forwards) are dispatch-level, as on the CPU; the last column is wall time on the device. Eager only
# (CUDA graphs are not built). Not run yet on a GPU: no device was lent to the session that wrote it.
timeout 240 "$PYTHON" benchmarks/iteration_cost.py --device cuda --dtype bfloat16 --width 4096 --vocab 126464 \
  --rows 1,8,32,64 --caches dual --methods none,kivi | tee "$OUT/iteration_cost.txt"

"$PYTHON" - "$OUT" "$PEAK_GBS" <<'PY'
"""Collect the decode_speed tables into one."""
import pathlib
import re
import sys

out, peak = pathlib.Path(sys.argv[1]), float(sys.argv[2])
print(f"\nGPU check ({(out / 'device.txt').read_text().strip()}); kernel tests: "
      f"{(out / 'kernel_tests.txt').read_text().strip().splitlines()[-1]}; peak {peak:.0f} GB/s")
print(f"{'reused':>7}{'batch':>6}  {'method':<20}{'tokens/s':>10}{'vs dual':>9}{'KV read MiB':>13}"
      f"{'MiB/forward':>13}{'GB/s':>8}{'of peak':>9}")
for path in sorted(out.glob("decode_*.txt"), key=lambda p: [int(x) for x in re.findall(r"\d+", p.name)]):
    prompt, batch = (int(x) for x in re.findall(r"\d+", path.name))
    for line in path.read_text().splitlines():
        match = re.match(r"\s+(dual[^\d]*?(?: \d+b)?(?: keep)?)\s{2,}(\S+)\s+\S+\s+\S+\s+\S+\s+\S+\s+(\S+)\s+\S+"
                         r"\s+\S+\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)", line)
        if match:
            name, tps, vs_dual, kv_read, per_forward, gbs, share = match.groups()
            print(f"{prompt + 224:>7}{batch:>6}  {name:<20}{tps:>10}{vs_dual:>9}{kv_read:>13}{per_forward:>13}"
                  f"{gbs:>8}{share:>9}")
PY
