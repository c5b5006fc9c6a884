"""What a forced tool call costs (issue 35), as ratios measured in one run on the embedded model.

The digit-ledger's held-out questions (``--split test``, the first ``--limit``), each prompt listing one tool
``answer`` whose argument is the answer in the task's own format (a string matching ``^( [0-9]){48}$``) (and, for
reference, the question alone: the digit model never saw a system turn), decoded

* unconstrained (the model writes what it writes), and
* as a forced call (``tool_choice`` naming ``answer``: the grammar of `service.engine.tool_format.call_grammar`),

in batches of ``--batch``: tokens per forward call (response tokens / forward calls, a count, not a time), the
exact match of the answer (the call's argument, the unconstrained text) and CPU seconds per request. The call's
marker, name, keys and punctuation are forced tokens, revealed without forwards of their own; the target is a
forced call keeping at least half the tokens per forward of unconstrained decoding on the same prompts.

Usage: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/tool_call_cost.py [--limit 64] [--batch 16]
[--cache-mode dual]``.
"""

from __future__ import annotations

import argparse
import json
import time

from evaluation.embedded_task import BLOCK_LENGTH, GEN_LENGTH, load_split, score
from service.engine import Engine
from service.engine.grammar import GrammarCompiler, GrammarSpec
from service.engine.params import DecodeParams, RowOptions
from service.engine.prompts import encode_chat
from service.engine.tool_format import Function, call_grammar, generic_turns, parse_calls

ANSWER = Function("answer", "the answer to the question", {
    "type": "object", "properties": {"digits": {"type": "string", "pattern": "^( [0-9]){48}$"}},
    "required": ["digits"], "additionalProperties": False})


def run(engine: Engine, prompts, answers, params: DecodeParams, rows: RowOptions, batch: int, call: bool) -> dict:
    """Tokens per forward, exact match and CPU seconds per request of ``prompts`` decoded in batches."""
    matched = tokens = forwards = calls = 0
    started = time.process_time()
    for i in range(0, len(prompts), batch):
        report = engine.generate(prompts[i:i + batch], params, [rows] * len(prompts[i:i + batch]))
        for row, answer in zip(report.rows, answers[i:i + batch]):
            tokens += len(row.generated_ids)
            forwards += row.nfe
            text = row.text
            if call:
                made, _ = parse_calls(text)
                calls += bool(made)
                text = json.loads(made[0].arguments)["digits"] if made else ""
            matched += score(text, answer)
    seconds = time.process_time() - started
    return {"exact_match": 100.0 * matched / len(prompts), "tokens_per_forward": tokens / forwards,
            "s_per_request": seconds / len(prompts), "calls": calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--split", default="test")
    parser.add_argument("--limit", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--cache-mode", default="dual")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    engine = Engine.load(None, threads=args.threads)
    compiler = GrammarCompiler(engine.tokenizer, engine.spec.vocab_size, engine.spec.eos_ids)
    forced = compiler.compile(GrammarSpec.lark(call_grammar([ANSWER], False, False), "tools"))
    questions = load_split(args.split)[:args.limit]
    listed = [encode_chat(engine.tokenizer, generic_turns([{"role": "user", "content": q.prompt}], [ANSWER]),
                          "embedded") for q in questions]
    plain = [encode_chat(engine.tokenizer, [{"role": "user", "content": q.prompt}], "embedded") for q in questions]
    answers = [q.answer for q in questions]
    # The task's response length unconstrained (the model was trained on it); the call wraps the 48-digit answer
    # in about 30 tokens of format, so two more blocks for it.
    free_params = DecodeParams(cache_mode=args.cache_mode, block_length=BLOCK_LENGTH, gen_length=GEN_LENGTH)
    call_params = DecodeParams(cache_mode=args.cache_mode, block_length=BLOCK_LENGTH,
                               gen_length=GEN_LENGTH + 2 * BLOCK_LENGTH)
    results = {}
    for prompt_name, prompts in (("tool listed", listed), ("plain", plain)):
        results[prompt_name, "unconstrained"] = run(engine, prompts, answers, free_params, RowOptions(), args.batch,
                                                    False)
        results[prompt_name, "forced call"] = run(engine, prompts, answers, call_params, RowOptions(grammar=forced),
                                                  args.batch, True)
    print(f"digit-ledger {args.split} (first {len(questions)} questions, cache {args.cache_mode}, batches of "
          f"{args.batch}; prompt: the tool listed in a system turn (the generic format), or the question alone):")
    print("| prompt | decoding | calls | exact match % | tokens / forward | CPU s / request |")
    print("|---|---|---:|---:|---:|---:|")
    for (prompt_name, name), r in results.items():
        print(f"| {prompt_name} | {name} | {r['calls']} | {r['exact_match']:.2f} | {r['tokens_per_forward']:.2f} | "
              f"{r['s_per_request']:.3f} |")
    for prompt_name in ("tool listed", "plain"):
        free, bound = results[prompt_name, "unconstrained"], results[prompt_name, "forced call"]
        print(f"{prompt_name}: forced call / unconstrained tokens per forward "
              f"x{bound['tokens_per_forward'] / free['tokens_per_forward']:.2f} (target >= 0.5), time per request "
              f"x{bound['s_per_request'] / free['s_per_request']:.2f}")


if __name__ == "__main__":
    main()
