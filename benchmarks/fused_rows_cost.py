"""Host cost of one layer of a later step on the fused kernel's path, per request against one launch for the rows
of many requests (issue 21), in machine-independent counts.

For ``stores`` requests (one row each, prompts of different lengths, dual cache) whose quantized stores are on the
kernel's path (``attention="triton"``), one layer's attention is made twice: each store's own launch
(`QuantizedKVStore.attend`, what a running batch did before) and one launch for all their rows
(`QuantizedKVStore.attend_batch`, `service.quant.kernels.attention.fused_reuse_attention_rows`). Counted: the
kernel launches and the host's dispatched tensor operations and syncs around them (`benchmarks/iteration_cost.py`'s
``Counter``), for the block's first later step (the set's maps are concatenated then) and a later one. The kernel
itself is not run (its launches are recorded instead: the counts are the host's, on any machine); its values are
tested in tests/quant/test_fused_rows.py. Shapes: LLaDA-8B's head layout (32 heads, MHA) with the head dim shrunk
to ``--head-dim`` (counts do not depend on it).

Usage: ``python benchmarks/fused_rows_cost.py [--stores 1,8,32] [--methods kivi,dllm_kvq] [--head-dim 4]``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors pass the kernel's check; the kernel is not run
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: benchmarks/ is not a package

import torch

from benchmarks.iteration_cost import Counter
from service.artifacts.base import Provenance, default_v_group_size
from service.artifacts.policy import LayerPolicy, PolicyTable
from service.engine.kv_store import Segments
from service.engine.models.layers import RotaryEmbedding
from service.engine.spec import ModelSpec
from service.quant.config import KVQuantConfig
from service.quant.kernels import attention
from service.quant.store import make_kv_store

BLOCK = 32


class Launches:
    """Stands in for the kernel: records each launch (``kernel[grid](...)``) and runs nothing."""

    def __init__(self) -> None:
        self.count = 0

    def __getitem__(self, grid):
        self.count += 1
        return lambda *args, **kwargs: None


def _store(method: str, spec: ModelSpec):
    prov = Provenance(data="none", code="benchmarks/fused_rows_cost.py")
    if method == "dllm_kvq":
        table = PolicyTable(
            model_id=spec.model_id, weights_fingerprint=spec.fingerprint, cache_mode="dual", bits=4,
            k_group_size=32, v_group_size=default_v_group_size(spec.head_dim), k_bit_cap=16.0, provenance=prov,
            layers=[LayerPolicy(score_type="attention", p=1)],
        )
        config = KVQuantConfig(method=method, bits=4, k_group_size=32, policy_id=table.id)
        return make_kv_store(config, spec, artifact=table, attention="triton")
    return make_kv_store(KVQuantConfig(method=method, bits=4, k_group_size=32), spec, attention="triton")


def measure(method: str, n: int, head_dim: int) -> dict[str, tuple[int, int, int]]:
    """(tensor ops, host syncs, kernel launches) of one layer for ``n`` stores: each alone and all together, at
    the block's first later step and a later one (module doc)."""
    spec = ModelSpec(arch="llada", model_id="fused-rows-cost", fingerprint="random", num_layers=1, num_heads=32,
                     num_kv_heads=32, head_dim=head_dim, vocab_size=64, mask_id=63, eos_ids=(1,), pad_id=2,
                     max_length=4096)
    gen = torch.Generator().manual_seed(0)
    stores = []
    for i in range(n):
        prompt = 100 + (100 * i) // max(n - 1, 1)  # 100 to 200 tokens, different per request
        seq = prompt + 256
        seg = Segments((0,), block_start=prompt + BLOCK, block_end=prompt + 2 * BLOCK, seq_len=seq, cache_mode="dual")
        k, v = (torch.randn(1, 32, seq, head_dim, generator=gen) for _ in range(2))
        store = _store(method, spec)
        store.write(0, k, v, seg, torch.rand(1, seq, generator=gen))
        stores.append(store)
    q = torch.randn(n, 32, BLOCK, head_dim, generator=gen)
    k, v = (torch.randn(n, 32, BLOCK, head_dim, generator=gen) for _ in range(2))
    rope = RotaryEmbedding(head_dim, 10000.0, True)
    launches = Launches()
    kernel, attention._fused_reuse_attention = attention._fused_reuse_attention, launches
    counts: dict[str, tuple[int, int, int]] = {}
    try:
        for step in ("first", "later"):
            with Counter() as count:
                for i, store in enumerate(stores):
                    store.attend(0, q[i:i + 1], k[i:i + 1], v[i:i + 1], None, None, rope)
            counts[f"alone {step}"] = (count.ops, count.syncs, launches.count)
            launches.count = 0
        for store in stores:  # the maps and operands again, as at a new block
            store._maps = None
            store._operands.clear()
        for step in ("first", "later"):
            with Counter() as count:
                stores[0].attend_batch(stores, 0, q, k, v, [BLOCK] * n)
            counts[f"together {step}"] = (count.ops, count.syncs, launches.count)
            launches.count = 0
    finally:
        attention._fused_reuse_attention = kernel
        for store in stores:
            store.clear()
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stores", default="1,8,32")
    parser.add_argument("--methods", default="kivi,dllm_kvq")
    parser.add_argument("--head-dim", type=int, default=4)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print("one layer of a later step; per column: tensor ops / host syncs / kernel launches")
    print(f"{'method':<10}{'stores':>7}{'alone, first':>16}{'alone, later':>16}{'together, first':>18}"
          f"{'together, later':>18}")
    for method in args.methods.split(","):
        for n in (int(x) for x in args.stores.split(",")):
            c = measure(method, n, args.head_dim)
            cells = ["/".join(str(x) for x in c[key]) for key in
                     ("alone first", "alone later", "together first", "together later")]
            print(f"{method:<10}{n:>7}{cells[0]:>16}{cells[1]:>16}{cells[2]:>18}{cells[3]:>18}")


if __name__ == "__main__":
    main()
