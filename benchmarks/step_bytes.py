"""Bytes one later step reads at LLaDA-8B's shape: the weights once plus every row's reused K/V at every layer,
as each cache holds them (issue 41, item 5's CPU half: the ratio of bytes; the time ratio is measured on a GPU).

A later step of the dual cache is memory bound on a GPU: it reads the weights once for every row in flight and
each row's reused K/V once per layer. This benchmark counts those bytes for the dual cache unquantized (bf16 K/V)
and for the quantized stores (`service.quant`: KIVI, dLLM-KVQ with p = 1 on every layer, at ``--bits``) on the
fused kernel's path, which reads the packed layer as it is held (`service.quant.kernels.attention`): code
streams, group statistics, protected tokens, plus the index maps the kernel reads at every layer (``slot_of``,
``group_of_slot``, dLLM-KVQ's ``k_row``; `service.quant.kernels.operands`).

Counted, not assumed: one layer of one row at the full head layout (32 kv heads x head dim 128, bf16) with
``--reused`` reused tokens (a dual cache's prefix and suffix: ``--reused - --suffix`` and ``--suffix``) is
written through the method's real store (random K/V; dLLM-KVQ with random block-initial scores), and its held
bytes are read from the packed tensors (`PackedLayer.nbytes`, the kernel operands' maps); every layer and row of
LLaDA-8B holds the same format at the same length, so a step's K/V bytes are that x layers x rows. Weights:
LLaDA-8B in bf16 (`benchmarks.iteration_cost.llada_8b_bytes`). Not counted (the same for every cache, and small
beside these): the fresh window's K/V and the activations.

Usage: ``python benchmarks/step_bytes.py [--rows 8] [--reused 4096] [--suffix 224] [--bits 4,2]
[--methods kivi,dllm_kvq] [--json]``. ``--json`` prints one JSON object instead of the table (for
``benchmarks/gpu_check.sh``): ``{"rows", "reused", "weights_bytes", "caches": [{"cache", "bits", "kv_bytes",
"step_bytes", "ratio"}]}``, ``ratio`` the step's bytes over the unquantized dual cache's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: benchmarks/ is not a package
from benchmarks.decode_speed import quantized_store
from benchmarks.iteration_cost import LLADA_8B, llada_8b_bytes
from service.engine.kv_store import Segments
from service.engine.spec import ModelSpec

#: LLaDA-8B's attention: MHA, 32 heads of 128 channels.
HEADS, HEAD_DIM = LLADA_8B["num_heads"], LLADA_8B["width"] // LLADA_8B["num_heads"]
BLOCK = 32


def spec(layers: int = LLADA_8B["num_layers"], heads: int = HEADS, head_dim: int = HEAD_DIM) -> ModelSpec:
    """A spec of LLaDA-8B's attention layout, or ``heads`` x ``head_dim`` (what the quantizers read of a model)."""
    return ModelSpec(arch="llada", model_id="llada-8b-shape", fingerprint="0" * 64, num_layers=layers,
                     num_heads=heads, num_kv_heads=heads, head_dim=head_dim, vocab_size=LLADA_8B["vocab_size"],
                     mask_id=LLADA_8B["vocab_size"] - 1, eos_ids=(1,), pad_id=2, max_length=1 << 20)


def layer_bytes(method: str, bits: int, reused: int, suffix: int, heads: int = HEADS, head_dim: int = HEAD_DIM,
                seed: int = 0) -> int:
    """Bytes one row's layer holds and the fused kernel reads at a later step: ``2 x reused x H x D x 2`` for the
    unquantized cache (bf16 K and V); for a quantized method its packed layer plus the kernel's index maps of the
    block (module doc), written from random bf16 K/V ``[1, H, reused + 32, D]``."""
    if method == "none":
        return 2 * reused * heads * head_dim * 2
    store = quantized_store(method, keep=False, bits=bits)(SimpleNamespace(spec=spec(1, heads, head_dim)))
    seq_len = reused + BLOCK
    start = seq_len - suffix - BLOCK
    segments = Segments((0,), start, start + BLOCK, seq_len, "dual")
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(1, heads, seq_len, head_dim, generator=gen).to(torch.bfloat16) for _ in range(2))
    scores = torch.rand(1, seq_len, generator=gen).softmax(-1) if store.needs_scores else None
    store.write(0, k, v, segments, scores)
    ops, maps = store._kernel_inputs(0)
    held = [maps.slot_of, maps.group_of_slot] + ([ops.k_row] if ops.k_row is not None else [])
    return store._packed[0].nbytes + sum(t.numel() * t.element_size() for t in held)


def measure(rows: int, reused: int, suffix: int, methods: list[str], bits: list[int]) -> dict:
    """The counts of the module doc: per cache, its K/V bytes over all layers and rows, the step's bytes (weights
    + K/V) and their ratio to the unquantized dual cache's."""
    weights, _ = llada_8b_bytes()
    layers = LLADA_8B["num_layers"]
    caches = [("none", 16)] + [(m, b) for b in bits for m in methods]
    out, base = [], None
    for method, b in caches:
        kv = layer_bytes(method, b, reused, suffix) * layers * rows
        step = weights + kv
        base = step if base is None else base
        out.append({"cache": "dual" if method == "none" else f"dual+{method}", "bits": b, "kv_bytes": kv,
                    "step_bytes": step, "ratio": step / base})
    return {"rows": rows, "reused": reused, "weights_bytes": weights, "caches": out}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--reused", type=int, default=4096, help="reused tokens per row (prefix + suffix)")
    parser.add_argument("--suffix", type=int, default=224, help="of them, the reused suffix (dual cache)")
    parser.add_argument("--bits", default="4,2")
    parser.add_argument("--methods", default="kivi,dllm_kvq")
    parser.add_argument("--json", action="store_true", help="one JSON object (module doc) instead of the table")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = measure(args.rows, args.reused, args.suffix, args.methods.split(","),
                     [int(b) for b in args.bits.split(",")])
    if args.json:
        print(json.dumps(result))
        return result
    print(f"bytes one later step reads: LLaDA-8B (bf16 weights {result['weights_bytes'] / 1e9:.2f} GB, 32 layers, "
          f"{HEADS} kv heads x {HEAD_DIM}), {args.rows} rows x {args.reused} reused tokens, dual cache")
    print(f"{'cache':<16}{'bits':>5}{'K/V GB':>9}{'step GB':>9}{'vs dual':>9}")
    for c in result["caches"]:
        print(f"{c['cache']:<16}{c['bits']:>5}{c['kv_bytes'] / 1e9:>9.2f}{c['step_bytes'] / 1e9:>9.2f}"
              f"{c['ratio']:>8.3f}x")
    return result


if __name__ == "__main__":
    main()
