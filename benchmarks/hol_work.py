"""Head-of-line in counts (issue 34): the work a short request waits on beside a long one, over the plan with and
without the head-of-line rule (`service.runtime.scheduler.first_passes_first`), in one run.

The embedded default model decodes a long request (300-token prompt, 256 tokens: eight blocks of 32, threshold
0.9, dual cache) in the running batch; a short one (100-token prompt, 32 tokens) joins at every ``--every``-th
iteration of it, as ``benchmarks/serve_load.py --mixed --hol-only`` sends it. For each short request the script
counts the forwards of the iterations it took part in (from the iteration it joined to the one it finished) and
their arithmetic (`service.engine.forward_cost.ForwardCost.flops`, every forward's rows x input columns x keys; a
layer's worth, the same factor for every forward), and divides by the same counts of the short request decoded
alone: the head-of-line ratio in work, which on a machine where time follows arithmetic is the ratio in time.
Its tokens are checked to be those it decodes alone; the long request's iterations show what the rule costs it
(it waits one iteration for each arrival).

The third plan adds the layer split (`service.runtime.scheduler.split_by_layers`, ``--split`` tokens of work a
piece): the long request's block-initial passes run piece by piece. ``arrival wait`` is the arithmetic of the
largest forward the long request runs alone, over the short request's own (what a request that arrives as that
forward starts waits for before its first pass: no plan cuts into a running forward); ``worst`` adds it to the
largest ``work x``: the worst case of a short request in work, to hold against the 2x target.

**Likelihood beside a short request** (``--likelihood``, issue 45 items 7-8): the reproduction of item 8 through
the server's worker (`service.runtime.loop.Worker`, in process, the forward reserve measured as ``serve`` does):
one or four likelihood requests of a 2,200-token prompt (``mc_num`` 5, ``logprobs`` 5, as lm-eval's multiple
choice sends them) run, and a 32-token request (100-token prompt) arrives ``--repeats`` times, each after the one
before finished. Two plans in one run: before issue 45 (the likelihood ran after the decoding forwards, each task
one whole forward of at least one batch per iteration, outside the head-of-line rule: `_BeforeWorker`, the loop's
``_step_tasks`` of issue 34) and now (rows fixed per task, pieces of layers or of a layer, the head-of-line rule, turns). For
each: the likelihood calls and work that ran while the short request was in the server (tokens' worth, the unit
of the layer split: one token through every layer's projections and MLP, a piece's attention counted in it,
`ForwardCost.layer_stages`; and arithmetic, over the short request's own), the
largest single likelihood call, and the short request's wall time over its time alone (same run, same worker
settings, the median of ``--repeats``).

With ``--model`` another checkpoint (e.g. the tiny LLaDA2, tests/data/llada2/llada2-tiny): prompts are token
ids, ``ignore_eos`` is set only where the family serves it, and the layer split only where its decoder declares
it (`Capabilities.layer_split`; LLaDA2's does not).

Usage: ``OMP_NUM_THREADS=1 python benchmarks/hol_work.py [--every 3] [--split 512] [--model DIR]``;
``OMP_NUM_THREADS=1 python benchmarks/hol_work.py --likelihood [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

from service.engine.forward_cost import ForwardCost
from service.engine.params import DecodeParams
from service.runtime.scheduler import Hold, first_passes_first, forward_plan

TASK = ROOT / "service" / "assets" / "embedded" / "task" / "test.jsonl"


#: Whether the served family decodes past an EOS (`service.engine.families.settings_rules`; set in :func:`main`).
IGNORE_EOS = [True]


def _params(tokens: int) -> DecodeParams:
    return DecodeParams(gen_length=tokens, block_length=32, cache_mode="dual", threshold=0.9,
                        ignore_eos=IGNORE_EOS[0])


def _work(cost: ForwardCost, forwards, num_layers: int) -> float:
    """The forwards' arithmetic, a layer's worth (`ForwardCost.flops`); a piece of a pass split by layers counts
    its share of the layers."""
    total = 0.0
    for group in forwards:
        width = max(p.width for p in group)
        keys = width if group[0].kind == "full" else max(p.seq_len for p in group) + 1
        start, stop = group[0].layers or (0, num_layers)
        total += cost.flops(sum(len(p.rows) for p in group), width, keys) * (stop - start) / num_layers
    return total


def run(engine, ids: list[int], every: int, rule: bool, split: int = 0,
        ) -> tuple[list[tuple[int, float, list[int]]], int, float]:
    """(forwards, flops, tokens) per short request joining at every ``every``-th iteration of the long one, the
    long one's iterations, and the arithmetic of the largest forward the long one ran alone (what a request
    arriving while it runs waits for before its own first pass can start)."""
    cost = ForwardCost.of(engine.model)
    layers = engine.spec.num_layers
    plan, hold = forward_plan(split_tokens=split, num_layers=layers), Hold()
    batch = engine.batch()
    long = engine.cohort([ids[100:400]], _params(256))
    batch.join(long)
    shorts: dict = {}  # cohort -> [forwards, flops]
    iteration, largest = 0, 0.0
    with torch.inference_mode():
        while long in batch.cohorts:
            if iteration % every == every - 1:
                short = engine.cohort([ids[:100]], _params(32))
                batch.join(short)
                shorts[short] = [0, 0]
            passes = batch.passes(batch.cohorts)
            if rule:
                passes, hold = first_passes_first(passes, hold)
            forwards = plan(passes)
            for short, counts in shorts.items():
                if short in batch.cohorts:
                    counts[0] += len(forwards)
                    counts[1] += _work(cost, forwards, layers)
            largest = max([largest] + [_work(cost, [g], layers) for g in forwards
                                       if all(p.cohort is long for p in g)])
            batch.run(forwards)
            iteration += 1
    return [(f, w, engine.report(s).rows[0].generated_ids) for s, (f, w) in shorts.items()
            if s not in batch.cohorts], iteration, largest


def prompt_ids(engine) -> list[int]:
    """The token ids the requests' prompts are cut from: the embedded task's prompts, joined."""
    text = " ".join(json.loads(line)["prompt"] for line in TASK.read_text().splitlines() if line)
    return engine.tokenizer(text)["input_ids"]


def alone_counts(engine, ids: list[int]) -> tuple[int, int, list[int]]:
    """(forwards, flops, tokens) of the short request decoded alone."""
    cost = ForwardCost.of(engine.model)
    batch = engine.batch()
    short = engine.cohort([ids[:100]], _params(32))
    batch.join(short)
    forwards = work = 0
    with torch.inference_mode():
        while short in batch.cohorts:
            groups = [[p] for p in batch.passes(batch.cohorts)]
            forwards, work = forwards + len(groups), work + _work(cost, groups, engine.spec.num_layers)
            batch.run(groups)
    return forwards, work, engine.report(short).rows[0].generated_ids


# ---- likelihood beside a short request (issue 45 items 7-8) ------------------------------------------------------
def _before_worker():
    """The worker with the likelihood plan of issue 34 (before issue 45), for the comparison in one run: every task
    runs one whole forward of at least one batch per iteration after the decoding forwards, its rows from what
    those left of the token budget, outside the head-of-line rule."""
    from service.runtime.loop import Worker, is_device_fault

    class _BeforeWorker(Worker):
        def _step_tasks(self, due, tokens_left):
            for job in [j for j in self._running.values() if j.task is not None]:
                t = job.cohort.seq_len
                try:
                    # at least one whole batch, then whole batches while the budget left holds them
                    rows = max(job.cohort.mc_batch_size, tokens_left // t)
                    more = job.cohort.step(rows, max(job.cost.transient, self.forward_bytes))
                    tokens_left -= job.cohort.last_rows * t
                except Exception as exc:
                    if is_device_fault(exc):
                        raise
                    with self._cond:
                        self._fail_running(job, exc)
                    continue
                if not more:
                    self._finished(job.cohort)
            return 0, 0

    return _BeforeWorker


def _watch_calls(task, calls: list[tuple[float, float]], cost: ForwardCost, num_layers: int) -> None:
    """Record each call of ``task`` as (tokens' worth, flops per layer) in ``calls`` (its ``step`` wrapped). A
    token's worth is one token through every layer's projections and MLP
    (`service.engine.forward_cost.ForwardCost.layer_stages`), so a call's arithmetic, a layer's worth as the
    short request's is counted, is its tokens' worth times ``flops(1, 1, 0)``."""
    step = task.step

    def watched(*args, **kwargs):
        work = task.work
        more = step(*args, **kwargs)
        if task.work > work:
            calls.append((task.work - work, (task.work - work) * cost.flops(1, 1, 0)))
        return more

    task.step = watched


def likelihood_beside(engine, before: bool, tasks: int, repeats: int, split: int) -> dict:
    """The short request beside ``tasks`` 2,200-token likelihood requests on one worker (module doc): its wall
    times, the likelihood calls (tokens' worth, flops) that ran while it was in the server, its own forwards."""
    import time as clock

    from service.engine.likelihood import LikelihoodTask
    from service.engine.params import RowOptions
    from service.quant.config import KVQuantConfig
    from service.runtime.loop import Job, Worker
    from service.runtime.memory import MemoryModel
    from service.runtime.scheduler import DEFAULT_MAX_BATCHED_TOKENS
    from service.store.active import ConfigSnapshot
    from service.telemetry import Telemetry

    ids = prompt_ids(engine)
    cost, layers = ForwardCost.of(engine.model), engine.spec.num_layers
    memory = MemoryModel.for_engine(engine)
    forward = memory.measure_forward(engine, DEFAULT_MAX_BATCHED_TOKENS)
    kind = _before_worker() if before else Worker
    worker = kind(engine, lambda snap: None, Telemetry(), memory, 1 << 34, max_rows=8, forward_bytes=forward,
                  layer_split_tokens=split)
    snapshot = ConfigSnapshot(KVQuantConfig(), "dual", "request")
    lparams = DecodeParams(gen_length=1, block_length=1, cache_mode="none", threshold=None, steps=1)
    likelihoods = [Job(ids[i: i + 2200], lparams, RowOptions(), snapshot,
                       task=LikelihoodTask(tuple(ids[i: i + 2200]), 5, 5, 1234, 5)) for i in range(tasks)]
    calls: list[tuple[float, float]] = []  # appended on the worker thread
    worker.start()
    out = {"latency": [], "calls": [], "work": [], "flops": [], "largest": 0.0, "largest_flops": 0.0, "nfe": []}
    try:
        for job in likelihoods:
            worker.submit(job)
        while not all(j.cohort is not None and j.cohort.calls >= 1 for j in likelihoods):
            clock.sleep(0.01)
        for job in likelihoods:
            _watch_calls(job.cohort, calls, cost, layers)
        for _ in range(repeats):
            small = Job(ids[:100], _params(32), RowOptions(), snapshot)
            mark = len(calls)
            t0 = clock.perf_counter()
            worker.submit(small)
            result = small.future.result()
            out["latency"].append(clock.perf_counter() - t0)
            # the call in flight when it arrived ends after ``mark``: counted, as the short request waited on it
            during = calls[mark:]
            out["calls"].append(len(during))
            out["work"].append(sum(w for w, _ in during))
            out["flops"].append(sum(f for _, f in during))
            out["nfe"].append(result.row.nfe)
        out["largest"] = max(w for w, _ in calls)
        out["largest_flops"] = max(f for _, f in calls)
    finally:
        for job in likelihoods:
            job.cancel()
        worker.stop()
        worker._thread.join()  # a forward of the plan before may outlast stop's wait; let it end before exit
    return out


def shape_counts(cost: ForwardCost, layers: int, split: int, nfe: int) -> tuple[float, float, float]:
    """At a model shape, from the plans' rules (no run): the short request's arithmetic (a full pass over its 132
    tokens, then ``nfe - 1`` window passes over its 32-token block), the largest likelihood call of the plan before
    (one whole forward of a 5-row batch of the 2,200-token prompt) and of the plan now (the largest piece of a
    forward of `likelihood_rows` rows, `likelihood_piece`), each a layer's worth."""
    from service.engine.forward_cost import likelihood_work
    from service.runtime.scheduler import DEFAULT_MAX_BATCHED_TOKENS, likelihood_piece, likelihood_rows

    own = layers * (cost.flops(1, 132, 132) + (nfe - 1) * cost.flops(1, 32, 133))
    before = layers * cost.flops(5, 2200, 2200)
    rows = likelihood_rows(2200, DEFAULT_MAX_BATCHED_TOKENS, split, layers)
    stages = cost.layer_stages(2200, layers)
    at, end, largest = 0, 2 * rows * 2200 * layers, 0.0
    while at < end:
        piece = likelihood_piece(rows, 2200, at, split, layers, stages) or (at, end)
        largest = max(largest, likelihood_work(rows * 2200, piece, stages))
        at = piece[1]
    return own, before, largest * cost.flops(1, 1, 0) * layers


def small_alone(engine, repeats: int, split: int) -> tuple[float, float, float]:
    """(median wall time, tokens' worth, flops per layer, forwards) of the short request alone on a worker of the same settings."""
    import time as clock

    from service.engine.params import RowOptions
    from service.quant.config import KVQuantConfig
    from service.runtime.loop import Job, Worker
    from service.runtime.memory import MemoryModel
    from service.runtime.scheduler import DEFAULT_MAX_BATCHED_TOKENS
    from service.store.active import ConfigSnapshot
    from service.telemetry import Telemetry

    ids = prompt_ids(engine)
    memory = MemoryModel.for_engine(engine)
    worker = Worker(engine, lambda snap: None, Telemetry(), memory, 1 << 34, max_rows=8,
                    forward_bytes=memory.measure_forward(engine, DEFAULT_MAX_BATCHED_TOKENS), layer_split_tokens=split)
    worker.start()
    times = []
    try:
        for _ in range(repeats + 1):  # the first warms up
            small = Job(ids[:100], _params(32), RowOptions(), ConfigSnapshot(KVQuantConfig(), "dual", "request"))
            t0 = clock.perf_counter()
            worker.submit(small)
            small.future.result()
            times.append(clock.perf_counter() - t0)
    finally:
        worker.stop()
    # its work: a full pass over its 132 tokens, then window passes over its 32-token block (dual cache)
    nfe = small.future.result().row.nfe
    cost, tokens = ForwardCost.of(engine.model), 132
    work = tokens + (nfe - 1) * 32
    flops = cost.flops(1, tokens, tokens) + (nfe - 1) * cost.flops(1, 32, tokens + 1)
    return statistics.median(times[1:]), work, flops, nfe


def likelihood_main(engine, repeats: int, split: int) -> None:
    solo, own_work, own_flops, nfe = small_alone(engine, repeats, split)
    print(f"a 32-token request (100-token prompt) beside 2,200-token likelihood requests (mc_num 5, logprobs 5), "
          f"layer split {split}; alone: {solo:.3f} s (median of {repeats}), {own_work} tokens' worth, "
          f"{own_flops / 1e6:,.0f} MFLOP per layer")
    print(f"{'plan':>18} {'tasks':>5} {'calls waited':>12} {'work waited':>11} {'x own':>6} {'flops x own':>11} "
          f"{'largest call':>12} {'x own':>6} {'wall x alone':>12}")
    for tasks in (1, 4):
        for name, before in (("before issue 45", True), ("planned (now)", False)):
            got = likelihood_beside(engine, before, tasks, repeats, split)
            print(f"{name:>18} {tasks:5d} {max(got['calls']):12d} {max(got['work']):11,.0f} "
                  f"{max(got['work']) / own_work:6.1f} {max(got['flops']) / own_flops:11.1f} "
                  f"{got['largest']:12,.0f} {got['largest_flops'] / own_flops:6.1f} "
                  f"{statistics.median(got['latency']) / solo:12.1f}")
    # The embedded model is 128 wide: attention over 2,200 keys outweighs its projections, so one row of one layer
    # is many times a short request's arithmetic: its pieces are parts of a layer (a row's projections, stretches
    # of query columns), each within the split counted with its attention.
    llada8b = ForwardCost.dense(4096, 12288, 32, 128, 126464, 2)
    for name, cost, layers in (("embedded (4 layers, width 128)", ForwardCost.of(engine.model), engine.spec.num_layers),
                               ("LLaDA-8B shape (32 layers, width 4096)", llada8b, 32)):
        own, before, now = shape_counts(cost, layers, split, nfe)
        print(f"largest likelihood call over the short request's arithmetic, {name}, counted from the rules: "
              f"before {before / own:.1f}x, now {now / own:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=int, default=3, help="a short request joins every this many iterations")
    parser.add_argument("--split", type=int, default=512,
                        help="the layer split's tokens of work a piece (DLLM_LAYER_SPLIT_TOKENS's default)")
    parser.add_argument("--likelihood", action="store_true",
                        help="the short request beside 2,200-token likelihood requests, before and now (issue 45)")
    parser.add_argument("--repeats", type=int, default=3, help="short requests per plan with --likelihood")
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    args = parser.parse_args()
    from service.engine import Engine
    from service.engine.families import settings_rules

    torch.set_num_threads(1)
    engine = Engine.load(args.model, threads=1)
    if args.likelihood:
        likelihood_main(engine, args.repeats, args.split)
        return
    IGNORE_EOS[0] = not settings_rules(engine.spec.arch)["ignore_eos"].refuses(True)
    ids = prompt_ids(engine) if args.model is None else [5 + i % 40 for i in range(400)]
    split_tokens = args.split if engine.capabilities.layer_split else 0
    forwards, work, alone = alone_counts(engine, ids)
    print(f"head-of-line in counts: a 32-token request (100-token prompt) joining every {args.every} iterations of "
          f"a 256-token one (300-token prompt); alone it takes {forwards} forward(s), {work:,.0f} flops per layer")
    print(f"{'plan':>26} {'shorts':>6} {'fwd x mean':>10} {'fwd x max':>9} {'work x mean':>11} {'work x max':>10} "
          f"{'arrival wait x':>14} {'worst x':>7} {'tokens as alone':>15} {'long iterations':>15}")
    for name, rule, split in (("without the rule", False, 0), ("first passes first", True, 0),
                              (f"+ layer split at {split_tokens}", True, split_tokens)):
        got, long_iterations, largest = run(engine, ids, args.every, rule, split)
        f = [g[0] / forwards for g in got]
        w = [g[1] / work for g in got]
        same = all(g[2] == alone for g in got)
        # The worst case a short request meets: it arrives as the long request's largest forward starts.
        print(f"{name:>26} {len(got):6d} {statistics.mean(f):10.2f} {max(f):9.2f} {statistics.mean(w):11.2f} "
              f"{max(w):10.2f} {largest / work:14.2f} {max(w) + largest / work:7.2f} {same!s:>15} "
              f"{long_iterations:15d}")


if __name__ == "__main__":
    main()
