"""KV memory of the quantized stores at the LLaDA-8B layer shape: bytes held per method and bits, and block peaks.

For every method (kivi, dllm_kvq with p = 1 on every layer, kvquant) and bits (4, 2) this writes one block's
reused K/V (default: 32 layers x 32 kv heads x head_dim 128, a 1,024-token reused context, bf16) into the
quantized store, layer by layer as the engine's block-initial pass does, and prints:

* bytes held (K and V together, with every scale, zero point, index and outlier) and their ratio to bf16;
* the format's own minimum (codes + fp16 scale and zero point per group of 32 for KIVI; the same plus p = 1
  protected bf16 token per K group for dLLM-KVQ; codes + outliers as bf16 value and int32 index + fp32 per-token
  V range for KVQuant, with this run's outlier count) and how far above it the store is (target: < 3%);
* nominal and storage effective bits (the `KVReport` figures);
* with ``--peak``, the peak resident memory of one block in a fresh process, above the process's baseline: the
  block-initial pass (one layer's full-sequence bf16 K/V at a time, as the engine hands them over, plus the
  quantizer's temporaries and the packed layers so far) and then one later step (each layer read and dropped in
  turn), next to the unquantized store (`FullPrecisionKVStore`) in the same run.

Data are random normal tensors: the bytes do not depend on the values except KVQuant's outlier count.

Usage: ``python benchmarks/kv_memory.py [--layers 32] [--peak]``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.artifacts.base import Provenance
from service.artifacts.kvquant_state import KVQuantState
from service.artifacts.policy import LayerPolicy, PolicyTable
from service.engine.kv_store import FullPrecisionKVStore, Segments
from service.engine.spec import ModelSpec
from service.quant.config import KVQuantConfig
from service.quant.kvquant import fit_state
from service.quant.store import make_kv_store

PROV = Provenance(data="random normal tensors", code="benchmarks/kv_memory.py")
METHODS = ("kivi", "dllm_kvq", "kvquant")


def make_spec(args) -> ModelSpec:
    return ModelSpec(
        arch="llada", model_id="llada-8b-shape", fingerprint="benchmark", num_layers=args.layers,
        num_heads=args.heads, num_kv_heads=args.heads, head_dim=args.head_dim, vocab_size=126464,
        mask_id=126336, eos_ids=(126081,), pad_id=126081, max_length=4096,
    )


def make_store(method: str, bits: int, spec: ModelSpec, keep: bool = False):
    """The store of one configuration (dllm_kvq: attention score, p = 1 on every layer; kvquant: a state fitted
    on one random layer, repeated for every layer)."""
    if method == "none":
        return FullPrecisionKVStore()
    if method == "dllm_kvq":
        table = PolicyTable(
            model_id=spec.model_id, weights_fingerprint=spec.fingerprint, cache_mode="prefix", bits=bits,
            k_group_size=32, v_group_size=32, k_bit_cap=16.0, provenance=PROV,
            layers=[LayerPolicy(score_type="attention", p=1)] * spec.num_layers,
        )
        cfg = KVQuantConfig(method=method, bits=bits, policy_id=table.id, keep_dequantized=keep)
        return make_kv_store(cfg, spec, artifact=table)
    if method == "kvquant":
        gen = torch.Generator().manual_seed(1)
        sample = torch.randn(1, spec.num_kv_heads, 256, spec.head_dim, generator=gen)
        one = fit_state([sample], [sample], bits, dataclasses.replace(spec, num_layers=1), PROV)
        state = KVQuantState(
            one.meta.model_copy(update={"num_layers": spec.num_layers}),
            *(t.expand(spec.num_layers, -1).contiguous() for t in (one.k_upper, one.k_lower, one.k_lut, one.v_lut)),
        )
        cfg = KVQuantConfig(method=method, bits=bits, kvquant_state_id=state.id, keep_dequantized=keep)
        return make_kv_store(cfg, spec, artifact=state)
    return make_kv_store(KVQuantConfig(method=method, bits=bits, keep_dequantized=keep), spec)


def block(args) -> tuple[Segments, int]:
    seq = args.tokens + args.block_length
    return Segments((0,), block_start=args.tokens, block_end=seq, seq_len=seq, cache_mode="prefix"), seq


def layer_kv(spec: ModelSpec, seq: int, layer: int, device: str = "cpu"):
    gen = torch.Generator().manual_seed(layer)
    shape = (1, spec.num_kv_heads, seq, spec.head_dim)
    k, v = torch.randn(shape, generator=gen).bfloat16(), torch.randn(shape, generator=gen).bfloat16()
    return k.to(device), v.to(device)


def run_block(store, spec: ModelSpec, args):
    """Write every layer (block-initial pass) then read every layer once (a later step); returns timings."""
    segments, seq = block(args)
    scores = torch.rand(1, seq, generator=torch.Generator().manual_seed(7)).to(args.device)
    write_s = read_s = 0.0
    for layer in range(spec.num_layers):
        k, v = layer_kv(spec, seq, layer, args.device)
        t0 = time.perf_counter()
        store.write(layer, k, v, segments, scores)
        write_s += time.perf_counter() - t0
        del k, v
    for layer in range(spec.num_layers):
        t0 = time.perf_counter()
        k, v = store.read(layer)
        read_s += time.perf_counter() - t0
        del k, v
    return write_s, read_s


def format_minimum_bits(method: str, bits: int, report, elements: int, outliers: int) -> float:
    """Bits per element (K and V together) of the format's own minimum."""
    if method == "kivi":
        return bits + 32 / 32  # fp16 scale + zero point per group of 32, on K and on V
    if method == "dllm_kvq":
        k = (bits * 31 + 16 + 32) / 32  # 31 codes, one protected 16-bit token, scale + zero point per group
        return (k + bits + 1) / 2
    # kvquant: codes, outliers as (bf16 value, int32 index), fp32 offset + half range per token for V
    tokens = elements // (report["channels"])
    return bits + outliers * 48 / (2 * elements) + tokens * 64 / (2 * elements)


def sizes(args) -> None:
    spec = make_spec(args)
    bf16_total = None
    print(f"shape: {spec.num_layers} layers x {spec.num_kv_heads} kv heads x head_dim {spec.head_dim}, "
          f"{args.tokens} reused tokens, bf16 model dtype")
    header = (f"{'method':9} {'bits':>4} {'held MiB':>9} {'/bf16':>7} {'min/bf16':>8} {'over min':>9} "
              f"{'K nom':>6} {'V nom':>6} {'K sto':>6} {'V sto':>6} {'write s/L':>9} {'read ms/L':>9}")
    print(header)
    for bits in args.bits:
        for method in args.methods:
            store = make_store(method, bits, spec)
            write_s, read_s = run_block(store, spec, args)
            report = store.report()
            held = store.bytes_held
            bf16_total = report.bf16_bytes
            elements = bf16_total // 4  # per tensor (K or V), all layers
            outliers = 0
            if method == "kvquant":
                outliers = sum(
                    p.k.tensors["outlier_index"].numel() + p.v.tensors["outlier_index"].numel()
                    for p in store._packed.values()
                )
            minimum = format_minimum_bits(
                method, bits, {"channels": spec.num_kv_heads * spec.head_dim}, elements, outliers
            ) / 16
            ratio = held / bf16_total
            print(f"{method:9} {bits:>4} {held / 2**20:9.2f} {ratio:7.4f} {minimum:8.4f} "
                  f"{100 * (ratio / minimum - 1):8.3f}% {report.k_nominal_bits:6.3f} {report.v_nominal_bits:6.3f} "
                  f"{report.k_storage_bits:6.3f} {report.v_storage_bits:6.3f} "
                  f"{write_s / spec.num_layers:9.3f} {1000 * read_s / spec.num_layers:9.1f}")
    print(f"bf16 bytes of the same K/V: {bf16_total / 2**20:.2f} MiB")


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_child(args) -> None:
    """In a fresh process: the peak RSS of one block above the baseline (JSON on stdout)."""
    spec = make_spec(args)
    store = make_store(args.child_method, args.child_bits, spec, keep=args.child_keep)
    baseline = _rss_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS (Linux >= 4.0)
    run_block(store, spec, args)
    peak = _rss_kib("VmHWM")
    print(json.dumps({"peak_mib": (peak - baseline) / 1024, "held_mib": held_bytes(store) / 2**20}))


def held_bytes(store) -> int:
    """Bytes a store holds (the unquantized store: its reused K/V tensors)."""
    if isinstance(store, FullPrecisionKVStore):
        return sum(t.numel() * t.element_size() for kv in store._layers.values() for t in kv)
    return store.bytes_held


def peaks(args) -> None:
    spec = make_spec(args)
    layer_bf16 = 2 * spec.num_kv_heads * (args.tokens + args.block_length) * spec.head_dim * 2
    print(f"\npeak RSS of one block above baseline (block-initial pass + one later step), fresh process each; "
          f"one layer's full-sequence bf16 K/V = {layer_bf16 / 2**20:.1f} MiB")
    rows = [("none", 16, False)] + [(m, b, keep) for b in args.bits for m in args.methods for keep in (False, True)]
    base = None
    for method, bits, keep in rows:
        cmd = [sys.executable, __file__, "--child", method, str(bits), str(int(keep)),
               "--layers", str(args.layers), "--heads", str(args.heads), "--head-dim", str(args.head_dim),
               "--tokens", str(args.tokens)]
        # glibc keeps freed heap pages resident; with every allocation >= 64 KiB mmapped (and unmapped on free)
        # the resident set follows the live tensors, so the high-water mark is the block's real peak.
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
        out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout)
        base = out["peak_mib"] if method == "none" else base
        mode = "keep-copies" if keep else "per-layer"
        print(f"{method:9} {bits:>4} {mode:12} peak {out['peak_mib']:9.1f} MiB  ({out['peak_mib'] / base:6.3f} x "
              f"unquantized)  held at end {out['held_mib']:8.1f} MiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=1024, help="reused context length")
    ap.add_argument("--block-length", type=int, default=32)
    ap.add_argument("--bits", type=int, nargs="+", default=[4, 2])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--device", default="cpu", help="where the K/V and the store live (bytes-held table)")
    ap.add_argument("--peak", action="store_true", help="also measure block peaks in fresh processes")
    ap.add_argument("--no-sizes", action="store_true", help="skip the bytes-held table (with --peak)")
    ap.add_argument("--child", nargs=3, metavar=("METHOD", "BITS", "KEEP"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.child:
        args.child_method, args.child_bits, args.child_keep = args.child[0], int(args.child[1]), args.child[2] == "1"
        peak_child(args)
        return
    if not args.no_sizes:
        sizes(args)
    if args.peak:
        peaks(args)


if __name__ == "__main__":
    main()
