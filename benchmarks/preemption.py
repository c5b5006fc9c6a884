"""Preemption by recompute (issue 36 item 5): a small request arriving while a large one holds the memory budget.

The reproduction of item 5 on the embedded default model, through the server's scheduler
(`service.runtime.loop.Worker`, the forward reserve of ``--max-batched-tokens`` measured as `serve` measures it):
the budget is just above one large request (``--prompt`` tokens, ``--gen`` response tokens, dual cache), so a
small request (``--small-gen`` tokens) does not fit beside it. The large request runs; half a block after it
commits its first block the small one arrives. Measured in one run:

* the small request alone (its solo latency, the median of ``--repeats``);
* one block of the large request alone (its decode time over its blocks);
* the small request's latency beside the large one with preemption (``max_preemptions`` 4, the default) and
  without (0: it waits for the large one's whole run, item 5);
* whether the large one's output is the same with and without preemption.

Prints each latency and its ratio to the solo latency and to one block of the large request; target: with
preemption, at most 3 x solo + one block of the large request.

**Past the cap** (``--after-cap N``, issue 45 item 9): N small requests arrive one after another while the large
one runs (each as the one before finishes), so the large one is preempted again and again. Each small request's
latency and the blocks the large one committed meanwhile, under the rule before issue 45 (no preemption past
``max_preemptions``: the next small request waits for the large one's whole run) and now (the ``(cap + k)``-th
preemption waits for ``k`` blocks of the large one's progress, `service.runtime.preemption.may_preempt`), in one
run.

With ``--model`` another checkpoint (e.g. the tiny LLaDA2, tests/data/llada2/llada2-tiny, ``--cache-mode block``;
prompts are then token ids, and ``ignore_eos`` is set only where the family serves it).

Usage: ``python benchmarks/preemption.py [--prompt 3500] [--gen 512] [--small-gen 32] [--repeats 3]
[--after-cap 0] [--model DIR --cache-mode MODE]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: benchmarks/ is not a package

from service.engine import Engine
from service.engine.families import settings_rules
from service.engine.loading import EMBEDDED_DIR
from service.engine.params import DecodeParams, RowOptions
from service.quant.config import KVQuantConfig
from service.quant.store import make_kv_store
from service.runtime.loop import Job, Worker
from service.runtime.memory import MemoryModel
from service.runtime.scheduler import DEFAULT_MAX_BATCHED_TOKENS, kv_held
from service.store.active import ConfigSnapshot
from service.telemetry import Telemetry


def _worker(engine, memory: MemoryModel, budget: int, forward: int, max_preemptions: int) -> Worker:
    return Worker(engine, lambda snap: make_kv_store(snap.config, engine.spec), Telemetry(), memory, budget,
                  max_rows=32, forward_bytes=forward, backfill_s=2.0, max_preemptions=max_preemptions)


def _alone(worker: Worker, job: Job) -> float:
    t0 = time.perf_counter()
    worker.submit(job)
    job.future.result()
    return time.perf_counter() - t0


def _contended(worker: Worker, large: Job, small: Job, delay_s: float) -> tuple[float, list[int], int]:
    """The large job running, the small one submitted ``delay_s`` after the large one's first block: the small
    one's latency, the large one's tokens, its preemptions."""
    first_block = threading.Event()
    large.on_block = lambda block, ids: first_block.set()
    worker.submit(large)
    first_block.wait()
    time.sleep(delay_s)
    t0 = time.perf_counter()
    worker.submit(small)
    small.future.result()
    latency = time.perf_counter() - t0
    result = large.future.result()
    return latency, result.row.generated_ids, large.preemptions


def _in_turn(worker: Worker, large: Job, smalls: list[Job]) -> list[tuple[float, int]]:
    """The large job running, the small ones submitted one after another from its first block on (each as the
    one before finishes): each small one's latency and the blocks the large one committed while it was in."""
    out: list[tuple[float, int]] = []

    def submit(i: int) -> None:  # on the worker thread, between iterations
        at, t0 = large.blocks, time.perf_counter()
        smalls[i].future.add_done_callback(lambda _: out.append((time.perf_counter() - t0, large.blocks - at)))
        if i + 1 < len(smalls):
            smalls[i].future.add_done_callback(lambda _: submit(i + 1))
        worker.submit(smalls[i])

    large.on_block = lambda block, ids: submit(0) if block == 0 else None
    worker.submit(large)
    large.future.result()
    for job in smalls:
        job.future.result()
    return out


def after_cap(engine, memory: MemoryModel, budget: int, forward: int, large, small, count: int, cap: int,
              block: float) -> None:
    """``--after-cap``: the small requests in turn beside the large one, the rule before issue 45 and now."""
    from service.runtime import preemption

    rule = preemption.may_preempt
    print(f"{count} small requests in turn beside the large one, max_preemptions {cap}:")
    for name, may in (("before issue 45 (none past the cap)", lambda h, m: 0 < m and h.preemptions < m),
                      ("now (past the cap, k blocks for the cap + k-th)", rule)):
        preemption.may_preempt = may  # the rule as it was, for the comparison in one run
        try:
            worker = _worker(engine, memory, budget, forward, cap)
            worker.start()
            got = _in_turn(worker, large(), [small() for _ in range(count)])
            worker.stop()
        finally:
            preemption.may_preempt = rule
        print(f"  {name}: " + ", ".join(f"{s:.2f} s / {b} blocks" for s, b in got)
              + f" (one block of the large one alone: {block:.3f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=3500, help="prompt tokens of the large request")
    parser.add_argument("--gen", type=int, default=512, help="response tokens of the large request (blocks of 32; a canvas for DiffusionGemma)")
    parser.add_argument("--small-gen", type=int, default=32, help="response tokens of the small request")
    parser.add_argument("--repeats", type=int, default=3, help="solo runs of the small request (median)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--after-cap", type=int, default=0,
                        help="small requests in turn past the preemption cap (issue 45 item 9); 0: not run")
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    parser.add_argument("--cache-mode", default="dual", help="cache mode of both requests")
    parser.add_argument("--max-denoising-steps", type=int, default=None,
                        help="a renoising family's (DiffusionGemma) decoder passes per canvas at most")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine.load(args.model or EMBEDDED_DIR)
    memory = MemoryModel.for_engine(engine)
    forward = memory.measure_forward(engine, DEFAULT_MAX_BATCHED_TOKENS)
    if args.model is None:
        digits = engine.tokenizer.encode(" 4 1 4 4 2 9 7 4 3 2 8 3" * (args.prompt // 12 + 1))
        large_prompt, small_prompt = digits[: args.prompt], engine.tokenizer.encode("next: 4 1 4 4 2 9 7 4")
    else:  # token ids: a checkpoint of the tests may have no tokenizer
        large_prompt, small_prompt = [5 + i % 40 for i in range(args.prompt)], [5 + i % 7 for i in range(9)]
    ignore_eos = not settings_rules(engine.spec.arch)["ignore_eos"].refuses(True)
    # A renoising family's block is its canvas (docs/diffusion_gemma.md), and its rows sample: seeded, so that
    # "output identical" compares one draw with itself.
    width = getattr(engine.model.config, "canvas_length", 32)
    renoising = {"max_denoising_steps": args.max_denoising_steps} if args.max_denoising_steps else {}
    large_params = DecodeParams(gen_length=args.gen, block_length=width, threshold=0.9, ignore_eos=ignore_eos,
                                cache_mode=args.cache_mode, **renoising)
    small_params = DecodeParams(gen_length=args.small_gen, block_length=width, threshold=0.9, ignore_eos=ignore_eos,
                                cache_mode=args.cache_mode, **renoising)
    snapshot = ConfigSnapshot(KVQuantConfig(), "prefix" if args.cache_mode == "block" else args.cache_mode,
                              "request")

    def large() -> Job:
        return Job(large_prompt, large_params, RowOptions(seed=1), snapshot)

    def small() -> Job:
        return Job(small_prompt, small_params, RowOptions(seed=2), snapshot)

    probe = _worker(engine, memory, 1 << 40, forward, 0)
    large_cost, small_cost = probe._cost(large()), probe._cost(small())
    # Just above one large request: the small one does not fit beside it.
    # (KV as the family holds it: LLaDA2's rows share caches as wide as their longest row, `scheduler.kv_held`)
    large_kv, small_kv = kv_held([large_cost]), kv_held([large_cost, small_cost]) - kv_held([large_cost])
    budget = large_kv + max(large_cost.transient, forward) + small_kv // 2
    print(f"large: {len(large_prompt):,}-token prompt, {args.gen} tokens (KV {large_kv:,} B); small: "
          f"{len(small_prompt)}-token prompt, {args.small_gen} tokens (KV {small_kv:,} B beside it); budget {budget:,} B "
          f"(forward reserve {forward:,} B)")

    worker = _worker(engine, memory, budget, forward, 4)
    worker.start()
    _alone(worker, small())  # warm-up
    solo = statistics.median(_alone(worker, small()) for _ in range(args.repeats))
    alone_job = large()
    large_s = _alone(worker, alone_job)
    blocks = args.gen // width
    block = large_s / blocks
    alone_ids = alone_job.future.result().row.generated_ids
    delay = block / 2
    with_p = _contended(worker, large(), small(), delay)
    worker.stop()
    without_worker = _worker(engine, memory, budget, forward, 0)
    without_worker.start()
    without = _contended(without_worker, large(), small(), delay)
    without_worker.stop()

    target = 3 * solo + block
    print(f"small alone: {solo:.3f} s (median of {args.repeats}); large alone: {large_s:.2f} s, one block "
          f"{block:.3f} s ({blocks} blocks)")
    for name, (latency, ids, preempted) in (("with preemption", with_p), ("without preemption", without)):
        print(f"{name:>19}: small {latency:.3f} s = {latency / solo:.1f} x solo = {latency / block:.2f} blocks of "
              f"the large one = {latency / target:.2f} x the target (3 x solo + one block); large preempted "
              f"{preempted} time(s), output {'identical' if ids == alone_ids else 'DIFFERENT'}")
    print(f"target met: {with_p[0] <= target}")
    if args.after_cap:
        after_cap(engine, memory, budget, forward, large, small, args.after_cap, 4, block)


if __name__ == "__main__":
    main()
