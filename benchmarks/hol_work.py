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
(it waits one iteration for each arrival). Not counted: the rest of an iteration already running when
a request arrives (no plan can cut into a forward that has started).

Usage: ``OMP_NUM_THREADS=1 python benchmarks/hol_work.py [--every 3]``.
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


def _params(tokens: int) -> DecodeParams:
    return DecodeParams(gen_length=tokens, block_length=32, cache_mode="dual", threshold=0.9, ignore_eos=True)


def _work(cost: ForwardCost, forwards) -> int:
    total = 0
    for group in forwards:
        width = max(p.width for p in group)
        keys = width if group[0].kind == "full" else max(p.seq_len for p in group) + 1
        total += cost.flops(sum(len(p.rows) for p in group), width, keys)
    return total


def run(engine, ids: list[int], every: int, rule: bool) -> tuple[list[tuple[int, int, list[int]]], int]:
    """(forwards, flops, tokens) per short request joining at every ``every``-th iteration of the long one, and
    the long one's iterations."""
    cost = ForwardCost.of(engine.model)
    plan, hold = forward_plan(), Hold()
    batch = engine.batch()
    long = engine.cohort([ids[100:400]], _params(256))
    batch.join(long)
    shorts: dict = {}  # cohort -> [forwards, flops]
    iteration = 0
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
                    counts[1] += _work(cost, forwards)
            batch.run(forwards)
            iteration += 1
    return [(f, w, engine.report(s).rows[0].generated_ids) for s, (f, w) in shorts.items()
            if s not in batch.cohorts], iteration


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
            forwards, work = forwards + len(groups), work + _work(cost, groups)
            batch.run(groups)
    return forwards, work, engine.report(short).rows[0].generated_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=int, default=3, help="a short request joins every this many iterations")
    args = parser.parse_args()
    from service.engine import Engine

    torch.set_num_threads(1)
    engine = Engine.load(None, threads=1)
    ids = prompt_ids(engine)
    forwards, work, alone = alone_counts(engine, ids)
    print(f"head-of-line in counts: a 32-token request (100-token prompt) joining every {args.every} iterations of "
          f"a 256-token one (300-token prompt); alone it takes {forwards} forward(s), {work:,} flops per layer")
    print(f"{'plan':>22} {'shorts':>6} {'fwd x mean':>10} {'fwd x max':>9} {'work x mean':>11} {'work x max':>10} "
          f"{'tokens as alone':>15} {'long iterations':>15}")
    for rule in (False, True):
        got, long_iterations = run(engine, ids, args.every, rule)
        f = [g[0] / forwards for g in got]
        w = [g[1] / work for g in got]
        same = all(g[2] == alone for g in got)
        name = "first passes first" if rule else "without the rule"
        print(f"{name:>22} {len(got):6d} {statistics.mean(f):10.2f} {max(f):9.2f} {statistics.mean(w):11.2f} "
              f"{max(w):10.2f} {same!s:>15} {long_iterations:15d}")


if __name__ == "__main__":
    main()
