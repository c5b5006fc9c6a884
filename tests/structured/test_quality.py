"""Where the grammar allows the model's natural answer it costs neither quality nor parallelism (issue 26): the
digit-ledger answer regex on held-out questions gives the exact match of unconstrained decoding (within 1 point)
and keeps at least half of its tokens per forward call (a count; the full split and the timings are in
`benchmarks/structured_cost.py`)."""

from __future__ import annotations

import pytest
import torch

from evaluation.embedded_task import BLOCK_LENGTH, GEN_LENGTH, load_split, score
from service.engine import Engine
from service.engine.grammar import GrammarCompiler, GrammarSpec
from service.engine.params import DecodeParams, RowOptions
from service.engine.prompts import encode_chat

LEDGER_REGEX = r"( [0-9]){48}"
QUESTIONS = 48


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    return Engine.load(None)


@pytest.mark.parametrize("cache_mode", ["prefix", "dual"])
def test_ledger_regex_keeps_exact_match_and_parallelism(engine, cache_mode):
    compiler = GrammarCompiler(engine.tokenizer, engine.spec.vocab_size, engine.spec.eos_ids)
    ledger = compiler.compile(GrammarSpec.regex(LEDGER_REGEX, "structured_outputs.regex"))
    questions = load_split("test")[:QUESTIONS]
    prompts = [encode_chat(engine.tokenizer, [{"role": "user", "content": q.prompt}], "embedded") for q in questions]
    params = DecodeParams(cache_mode=cache_mode, block_length=BLOCK_LENGTH, gen_length=GEN_LENGTH)
    runs = {}
    for name, grammar in (("free", None), ("bound", ledger)):
        report = engine.generate(prompts, params, [RowOptions(grammar=grammar)] * len(prompts))
        runs[name] = {
            "exact": 100.0 * sum(score(r.text, q.answer) for r, q in zip(report.rows, questions)) / len(questions),
            "per_forward": sum(len(r.generated_ids) for r in report.rows) / sum(r.nfe for r in report.rows),
        }
    assert runs["bound"]["exact"] >= runs["free"]["exact"] - 1.0, runs
    assert runs["bound"]["per_forward"] >= 0.5 * runs["free"]["per_forward"], runs
