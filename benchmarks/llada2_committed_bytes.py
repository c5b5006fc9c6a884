"""Bytes LLaDA2's committed K/V take in the running batch, unquantized and in each packed committed store.

The model has LLaDA2.0-mini's attention shape (20 layers, 16 query / 4 KV heads of 128, partial RoPE over 64
channels) and expert layout (256 experts, top 8), other widths shrunk (width 128, expert hidden 16, vocabulary
4096); float32. ``--rows`` requests (a 200-token prompt each, 128 generated, block 32, 4 steps per block, cache
mode ``block``) decode together; after every iteration it reads the bytes held: the batch's cache
(`CommittedKV.nbytes`: per-layer buffers of full-precision rows, the one-layer scratch of packed rows) plus the
requests' stores (`QuantizedKVStore.bytes_held`: the packed committed blocks), and prints the peak, the committed
tokens and the bytes per committed token of the stores alone. Before the packed store (commit 34219b2) a
quantized request held what the unquantized one holds (its blocks were quantized-dequantized in place in the
full-precision cache): the ``none`` line is that "before" for every method.

``--admission`` prints instead what admission counts per token for each store at LLaDA2.0-mini's K/V shape in bf16
(`MemoryModel.kv_bytes_per_token`: the bytes a store holds after a 256-token probe) and for 32 rows x 32k tokens.

Usage: ``python benchmarks/llada2_committed_bytes.py [--rows 4] [--admission]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: benchmarks/ is not a package
from benchmarks.llada2_iteration_cost import mini_layout, spec_of
from service.engine.block_causal import BlockCausalParams
from service.engine.block_causal_batch import BlockCausalBatch, BlockCausalCohort
from service.engine.models.llada2 import LLaDA2Model
from service.engine.spec import ModelSpec
from service.quant.config import KVQuantConfig
from service.quant.store import make_kv_store
from tests.support.artifacts import kvquant_state_for, policy_for


def store_for(name: str, spec: ModelSpec):
    """None (unquantized) or a 4/2-bit store of the method named ``method-bits``."""
    if name == "none":
        return None
    method, bits = name.split("-")[0], int(name.split("-")[1])
    artifact = {"dllm_kvq": lambda: policy_for(spec, bits=bits, p=1),
                "kvquant": lambda: kvquant_state_for(spec, bits=bits)}.get(method, lambda: None)()
    config = KVQuantConfig(method=method, bits=bits, artifact_id=artifact.id if artifact else None)
    return make_kv_store(config, spec, artifact, attention="torch")


def measure(model: LLaDA2Model, rows: int, name: str) -> tuple[int, int, int]:
    """(peak bytes of cache + stores, peak bytes of the stores, committed tokens at the end)."""
    spec, gen = spec_of(model), torch.Generator().manual_seed(0)
    settings = BlockCausalParams(gen_length=128, block_length=32, steps=4, threshold=float("inf"))
    batch, stores, cohorts = BlockCausalBatch(model), [], []
    for _ in range(rows):
        prompt = torch.randint(0, spec.vocab_size - 8, (200,), generator=gen).tolist()
        stores.append(store_for(name, spec))
        cohorts.append(BlockCausalCohort(model, [prompt], [settings], spec.mask_id, spec.eos_ids,
                                         kv_store=stores[-1]))
        batch.join(cohorts[-1])
    peak = peak_stores = committed = 0
    with torch.inference_mode():
        while batch.cohorts:
            held = sum(s.bytes_held for s in stores if s is not None)
            committed = max(committed, sum(c.rows[0].committed for c in cohorts))
            batch.step()
            peak = max(peak, held + (batch._cache.nbytes if batch._cache is not None else 0))
            peak_stores = max(peak_stores, sum(s.bytes_held for s in stores if s is not None))
    return peak, peak_stores, sum(c.rows[0].committed for c in cohorts)


NAMES = ("kivi-8", "kivi-4", "kivi-2", "dllm_kvq-4", "dllm_kvq-2", "kvquant-4", "kvquant-2")


def admission() -> None:
    """Admission's bytes per token at mini's K/V shape in bf16, and for 32 rows x 32k tokens (module doc)."""
    from service.runtime.memory import MemoryModel

    spec = spec_of(mini_layout(20, 4096, head_dim=128))
    memory = MemoryModel.dense(spec, 128, 256, element_size=2)
    print("| store | bytes per token | GiB at 32 rows x 32k tokens |")
    print("|---|---:|---:|")
    for name in NAMES:
        per_token = memory.kv_bytes_per_token(name, lambda name=name: store_for(name, spec))
        print(f"| {name} | {per_token:.1f} | {per_token * 32 * 32768 / 2**30:.2f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4, help="requests decoding together (default 4)")
    parser.add_argument("--admission", action="store_true", help="admission's bytes per token at mini's shape")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.admission:
        admission()
        return 0
    model = mini_layout(20, 4096, head_dim=128)
    print("| store | peak bytes (cache + stores) | stores' bytes | committed tokens | store bytes / token |")
    print("|---|---:|---:|---:|---:|")
    for name in ("none", *NAMES[1:]):
        peak, stores, tokens = measure(model, args.rows, name)
        per_token = f"{stores / tokens:.0f}" if stores else ""
        print(f"| {name} | {peak} | {stores} | {tokens} | {per_token} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
