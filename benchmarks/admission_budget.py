"""Admission by memory: how many rows a KV budget admits, and the throughput that buys, unquantized vs 2-bit KIVI.

Builds the ``small`` random preset of `benchmarks/decode_speed.py` (LLaDA-shaped, d_model 512, 8 layers), sets the
budget to exactly what two unquantized ``--dtype`` (bf16) rows of a ``--context``-token sequence need (their KV at
the longest plus one row's largest forward, `service.runtime.memory`), and sends the same ``--rows`` requests (prompt
``context - gen`` tokens, ``--gen`` response tokens, dual cache, fixed schedule of 2 steps per block) through the
server's continuous scheduler (`service.runtime.loop.Worker`), once per configuration. Prints the rows the
budget fits by its arithmetic, the rows in flight at once (most, from the scheduler), generated tokens/s and the
ratio of the 2-bit row to the unquantized one. Targets (issue #14): 2-bit KIVI admits >= 5 rows at once and its
throughput is >= 1.8x the unquantized rows'.

CPU: a bf16 forward over 2,048 tokens of this preset takes ~74 s on a loaded 2-core machine (float32: ~18 s), so
``--compute-dtype float32`` runs the model in float32 while admission counts bytes as ``--dtype`` (bf16) rows:
the rows in flight are exactly the bf16 arithmetic's; and the default response is one block (``--gen 32``: one
block-initial pass and one cached step per row) instead of the issue's longer responses.

Usage: ``python benchmarks/admission_budget.py [--context 2048] [--gen 32] [--rows 6] [--dtype bfloat16]
[--compute-dtype float32]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: benchmarks/ is not a package

from benchmarks.decode_speed import random_engine
from service.engine.params import DecodeParams, RowOptions
from service.quant.config import KVQuantConfig
from service.quant.store import make_kv_store
from service.runtime.loop import Job, Worker
from service.runtime.memory import MemoryModel
from service.store.active import ConfigSnapshot
from service.telemetry import Telemetry

CONFIGS = {"unquantized": KVQuantConfig(), "kivi 2-bit": KVQuantConfig(method="kivi", bits=2)}


def run(engine, memory: MemoryModel, budget: int, config: KVQuantConfig, prompts, params) -> dict:
    telemetry = Telemetry()
    worker = Worker(engine, lambda snap: make_kv_store(snap.config, engine.spec), telemetry, memory,
                    budget, max_rows=64, max_queue=256)
    snapshot = ConfigSnapshot(config, "dual", "request")
    worker.start()
    t0 = time.perf_counter()
    jobs = [worker.submit(Job(p, params, RowOptions(), snapshot)) for p in prompts]
    results = [j.future.result() for j in jobs]
    wall = time.perf_counter() - t0
    worker.stop()
    tokens = sum(len(r.row.generated_ids) for r in results)
    return {"rows": max(r.batch_size for r in results), "tok_s": tokens / wall, "wall": wall}


def fits(budget: int, kv: int, transient: int) -> int:
    """Rows of one cost the budget admits at once (their KV plus one largest forward)."""
    return max(0, (budget - transient) // kv) if kv else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=2048, help="prompt + response tokens per row")
    parser.add_argument("--gen", type=int, default=32, help="response tokens per row (multiple of 32)")
    parser.add_argument("--rows", type=int, default=6, help="requests sent at once per configuration")
    parser.add_argument("--dtype", default="bfloat16", help="the rows admission counts (KV and activations)")
    parser.add_argument("--compute-dtype", default=None, help="the model's dtype (default: --dtype)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--preset", default="small")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    compute = args.compute_dtype or args.dtype
    engine = random_engine(args.preset, getattr(torch, compute), "cpu", 10.0)
    config = engine.model.config
    memory = MemoryModel.dense(engine.spec, config.width, config.mlp_hidden, getattr(torch, args.dtype).itemsize)
    params = DecodeParams(gen_length=args.gen, block_length=32, cache_mode="dual", threshold=None,
                          steps=2 * (args.gen // 32), ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, engine.spec.vocab_size - 1, (args.context - args.gen,), generator=gen).tolist()
               for _ in range(args.rows)]
    costs = {}
    for name, config in CONFIGS.items():
        per_token = memory.kv_bytes_per_token(name, lambda c=config: make_kv_store(c, engine.spec))
        costs[name] = memory.cost(len(prompts[0]), params, per_token)
    base = costs["unquantized"]
    budget = 2 * base.kv + base.transient
    print(f"admission_budget: preset {args.preset} (admission counts {args.dtype} rows, model runs in {compute}), "
          f"context {args.context} (prompt {args.context - args.gen} + response {args.gen}), {args.rows} requests "
          f"per configuration, budget {budget:,} bytes = 2 unquantized rows")
    print(f"{'configuration':>14} {'KV/row B':>12} {'forward B':>12} {'fit':>4} {'rows at once':>13} {'tok/s':>8} "
          f"{'x unq':>6}")
    out = {}
    for name, config in CONFIGS.items():
        out[name] = run(engine, memory, budget, config, prompts, params)
        c, r = costs[name], out[name]
        print(f"{name:>14} {c.kv:12,} {c.transient:12,} {fits(budget, c.kv, c.transient):4d} {r['rows']:13d} "
              f"{r['tok_s']:8.1f} "
              f"{r['tok_s'] / out['unquantized']['tok_s']:6.2f}")
    q = out["kivi 2-bit"]
    ratio = q["tok_s"] / out["unquantized"]["tok_s"]
    print(f"target: 2-bit admits >= 5 rows: {q['rows']} {'met' if q['rows'] >= 5 else 'NOT met'}; "
          f"throughput >= 1.8x: {ratio:.2f}x {'met' if ratio >= 1.8 else 'NOT met'}")


if __name__ == "__main__":
    main()
