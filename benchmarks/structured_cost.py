"""What the constrained reveal costs (issue 26), ratios measured in one run on the embedded model.

1. **Quality and parallelism on the digit-ledger.** The held-out questions (``--split test``: 192) decoded
   unconstrained and constrained by the answer format's regex ``( [0-9]){48}``, in batches of ``--batch``: exact
   match of each, tokens per forward call (response tokens / forward calls, a count) and CPU time per request.
   The constrained run should keep the exact match (within 1 point) and at least half the tokens per forward.
2. **A constrained request among unconstrained ones.** 16 requests decoded as the server batches them (one
   cohort each in one running batch, `service.engine.batch`): all unconstrained, then one of them (a ``sum``
   question, the most calls and mask work) constrained;
   the process's CPU time until the 15 unconstrained ones are done (wall time on a shared machine measures the
   other jobs), the median of ``--repeat`` alternating runs, as a ratio.
3. **Compiling a 200-property schema**, the median of ``--repeat`` compiles (cache off), against the 1 s bound.
4. **Closing within max_tokens** (issue 45): forced calls whose arguments have free ints, strings, arrays and nested
   objects (the tool-call grammar of `service.engine.tool_format`), on 8 digit-ledger prompts at the least
   ``max_tokens`` that fits, a little above it and 64: complete outputs (``stop``) with the closing rule and
   without it (the grammar decoded unbounded, as before), tokens per forward, and what the rule costs in grammar
   operations per revealed token (closing walks, the masks they compute, ``validate_tokens`` checks of an old
   path), against the one mask per revealed token the constrained reveal computes anyway. Counts, not times.

Usage: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/structured_cost.py [--split test] [--batch 16]
[--cache-mode dual] [--repeat 5] [--closing-only]`` (about two minutes on one CPU core; ``--closing-only``: part 4
alone, about a minute).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from evaluation.embedded_task import BLOCK_LENGTH, GEN_LENGTH, load_split, score
from service.engine import Engine
from service.engine.grammar import CompiledGrammar, GrammarCompiler, GrammarSpec
from service.engine.params import DecodeParams, RowOptions
from service.engine.prompts import encode_chat
from service.engine.tool_format import Function, call_grammar
from service.runtime.scheduler import forward_plan

LEDGER_REGEX = r"( [0-9]){48}"
#: Part 4's argument schemas: nothing bounds a value's length.
FREE_SCHEMAS = {
    "int": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"]},
    "str": {"type": "object", "properties": {"city": {"type": "string"}, "temp": {"type": "integer"}},
            "required": ["city", "temp"]},
    "arrays": {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer"}},
                                                "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2}},
               "required": ["xs", "tags"]},
    "nested": {"type": "object", "properties": {"order": {"type": "object", "properties": {
        "id": {"type": "string"}, "lines": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer"}}, "required": ["sku", "qty"]}}},
        "required": ["id", "lines"]}}, "required": ["order"]},
}


def ledger_run(engine: Engine, prompts, answers, params: DecodeParams, rows: RowOptions, batch: int) -> dict:
    """Exact match, tokens per forward and CPU seconds per request of ``prompts`` decoded in batches."""
    matched = tokens = forwards = 0
    started = time.process_time()
    for i in range(0, len(prompts), batch):
        report = engine.generate(prompts[i:i + batch], params, [rows] * len(prompts[i:i + batch]))
        for row, answer in zip(report.rows, answers[i:i + batch]):
            matched += score(row.text, answer)
            tokens += len(row.generated_ids)
            forwards += row.nfe
    seconds = time.process_time() - started
    return {"exact_match": 100.0 * matched / len(prompts), "tokens_per_forward": tokens / forwards,
            "s_per_request": seconds / len(prompts)}


def mixed_batch(engine: Engine, prompts, params: DecodeParams, grammar) -> float:
    """CPU seconds of this process (all its threads: torch's and the grammar engine's) until the unconstrained
    cohorts of 16 (the first one constrained when ``grammar``) are done: on a shared machine wall time mostly
    measures the other jobs."""
    batch = engine.batch(forward_plan())
    cohorts = [engine.cohort([p], params, [RowOptions(grammar=grammar if i == 0 else None)])
               for i, p in enumerate(prompts)]
    for c in cohorts:
        batch.join(c)
    watched = set(cohorts[1:])
    started = time.process_time()
    with torch.inference_mode():
        while watched & set(batch.cohorts):
            batch.step()
    return time.process_time() - started


def closing_run(engine: Engine, compiler: GrammarCompiler, prompts, cache_mode: str) -> None:
    """Part 4 (module doc): a markdown table of forced calls with free arguments, closed and unbounded."""
    print("| arguments | max_tokens | complete, closing | complete, unbounded | tokens / forward, closing | "
          "unbounded | walks / token | walk masks / token | path checks / token |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    block = 32
    for name, schema in FREE_SCHEMAS.items():
        grammar = compiler.compile(GrammarSpec.lark(call_grammar([Function("f", None, schema)], False, False),
                                                    "tools"))
        unbounded = CompiledGrammar(grammar.spec, grammar._matcher, compiler)  # no start path: as before issue 45
        least = max(1, grammar.min_tokens - 1)
        for max_tokens in sorted({least, least + 16, max(64, least)}):
            params = DecodeParams(cache_mode=cache_mode, block_length=block, gen_length=-(-max_tokens // block) * block)
            out = {}
            for label, g in (("closing", grammar), ("unbounded", unbounded)):
                before = (compiler.closing_walks, compiler.closing_masks, compiler.closing_checks)
                report = engine.generate(prompts, params, [RowOptions(max_tokens=max_tokens, grammar=g)] * len(prompts))
                tokens = sum(len(r.generated_ids) for r in report.rows)
                out[label] = {
                    "complete": sum(r.finish_reason == "stop" for r in report.rows),
                    "per_forward": tokens / sum(r.nfe for r in report.rows),
                    "ops": [(now - was) / tokens for now, was in zip(
                        (compiler.closing_walks, compiler.closing_masks, compiler.closing_checks), before)]}
            c, u = out["closing"], out["unbounded"]
            walks, masks, checks = c["ops"]
            print(f"| {name} | {max_tokens} | {c['complete']}/{len(prompts)} | {u['complete']}/{len(prompts)} | "
                  f"{c['per_forward']:.2f} | {u['per_forward']:.2f} | {walks:.3f} | {masks:.3f} | {checks:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--split", default="test")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--cache-mode", default="dual")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--closing-only", action="store_true", help="part 4 alone")
    args = parser.parse_args()
    engine = Engine.load(None, threads=args.threads)
    compiler = GrammarCompiler(engine.tokenizer, engine.spec.vocab_size, engine.spec.eos_ids)
    questions = load_split(args.split)
    prompts = [encode_chat(engine.tokenizer, [{"role": "user", "content": q.prompt}], "embedded") for q in questions]
    print(f"forced calls with free arguments, 8 questions of {args.split}, cache {args.cache_mode}, block 32:")
    closing_run(engine, compiler, prompts[:8], args.cache_mode)
    if args.closing_only:
        return
    print()
    ledger = compiler.compile(GrammarSpec.regex(LEDGER_REGEX, "structured_outputs.regex"))
    answers = [q.answer for q in questions]
    params = DecodeParams(cache_mode=args.cache_mode, block_length=BLOCK_LENGTH, gen_length=GEN_LENGTH)

    free = ledger_run(engine, prompts, answers, params, RowOptions(), args.batch)
    bound = ledger_run(engine, prompts, answers, params, RowOptions(grammar=ledger), args.batch)
    print(f"digit-ledger {args.split} ({len(prompts)} questions, cache {args.cache_mode}, batches of {args.batch}):")
    print("| decoding | exact match % | tokens / forward | CPU s / request |")
    print("|---|---:|---:|---:|")
    for name, r in (("unconstrained", free), (f"regex {LEDGER_REGEX}", bound)):
        print(f"| {name} | {r['exact_match']:.2f} | {r['tokens_per_forward']:.2f} | {r['s_per_request']:.3f} |")
    print(f"constrained / unconstrained: exact match {bound['exact_match'] - free['exact_match']:+.2f} points, "
          f"tokens per forward x{bound['tokens_per_forward'] / free['tokens_per_forward']:.2f}, "
          f"time per request x{bound['s_per_request'] / free['s_per_request']:.2f}")

    # The constrained request is a "sum" question: revealed about one position per call, the most calls and the
    # most mask work of the task; the 15 others are the first questions of the split.
    first_sum = next(i for i, q in enumerate(questions) if q.op == "sum")
    sixteen = [prompts[first_sum]] + [p for i, p in enumerate(prompts) if i != first_sum][:15]
    alone, mixed = [], []
    mixed_batch(engine, sixteen, params, None)  # warm-up (the forward-overhead probe, the mask executor)
    mixed_batch(engine, sixteen, params, ledger)
    for i in range(args.repeat):  # alternating, and which goes first alternates too
        for grammar in ((None, ledger) if i % 2 == 0 else (ledger, None)):
            (alone if grammar is None else mixed).append(mixed_batch(engine, sixteen, params, grammar))
    a, m = statistics.median(alone), statistics.median(mixed)
    print(f"\n16 requests in one running batch: 15 unconstrained done in {a:.3f} CPU s with 16 unconstrained, "
          f"{m:.3f} CPU s with one constrained (median of {args.repeat}): x{m / a:.3f}")

    wide = {"type": "object", "additionalProperties": False, "required": [f"field_{i}" for i in range(200)],
            "properties": {f"field_{i}": {"type": ["integer", "string", "boolean"]} for i in range(200)}}
    times = []
    for i in range(args.repeat):
        fresh = GrammarCompiler(engine.tokenizer, engine.spec.vocab_size, engine.spec.eos_ids, cache_size=0)
        fresh.ll_tokenizer  # noqa: B018 -- the tokenizer trie is built once per server, not per compile
        started = time.perf_counter()
        fresh.compile(GrammarSpec.json_schema({**wide, "description": str(i)}, "schema"))
        times.append(time.perf_counter() - started)
    print(f"200-property schema: compiled in {statistics.median(times) * 1e3:.1f} ms (median of {args.repeat}; "
          f"bound 1000 ms: x{statistics.median(times):.3f} of it)")


if __name__ == "__main__":
    main()
