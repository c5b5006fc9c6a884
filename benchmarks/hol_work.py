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

With ``--model`` another checkpoint (e.g. the tiny LLaDA2, tests/data/llada2/llada2-tiny): prompts are token
ids, ``ignore_eos`` is set only where the family serves it, and the layer split only where its decoder declares
it (`Capabilities.layer_split`; LLaDA2's does not).

Usage: ``OMP_NUM_THREADS=1 python benchmarks/hol_work.py [--every 3] [--split 512] [--model DIR]``.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=int, default=3, help="a short request joins every this many iterations")
    parser.add_argument("--split", type=int, default=512,
                        help="the layer split's tokens of work a piece (DLLM_LAYER_SPLIT_TOKENS's default)")
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    args = parser.parse_args()
    from service.engine import Engine
    from service.engine.families import settings_rules

    torch.set_num_threads(1)
    engine = Engine.load(args.model, threads=1)
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
