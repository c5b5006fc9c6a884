"""Structured output is always valid (issue 26): the 50 cases of ``tests/data/structured/cases.json`` (JSON schemas
with nested objects, bounded arrays, enums, numbers and string patterns; regexes; choices) x 4 prompts, decoded
by the embedded model in-process under every cache mode and a quantized KV cache: every output that did not run
out of ``max_tokens`` parses and validates (jsonschema) or matches in full. The embedded model only knows digits,
so most of each output comes from the grammar: this checks the constraint, not the model.

All 200 rows of a configuration decode as one batch (each row with its own grammar), which also checks that
constrained rows with different grammars share forwards; unconstrained rows ride along in one configuration.
"""

from __future__ import annotations

import pytest

from service.engine.params import DecodeParams, RowOptions
from service.engine.prompts import encode_chat
from service.quant.config import KVQuantConfig
from service.quant.store import make_kv_store
from tests.support.structured import CASES, PROMPTS, spec_of, violation

MAX_TOKENS = 96


def _decode(engine, compiler, cache_mode, kv_quant=None, extra_unconstrained=0, threshold=0.9, steps=None,
            temperature=0.0):
    prompts, rows, cases = [], [], []
    for case in CASES:
        grammar = compiler.compile(spec_of(case))
        for text in PROMPTS:
            prompts.append(encode_chat(engine.tokenizer, [{"role": "user", "content": text}], "embedded"))
            rows.append(RowOptions(max_tokens=MAX_TOKENS, grammar=grammar, temperature=temperature, seed=len(rows)))
            cases.append(case)
    for i in range(extra_unconstrained):
        prompts.append(encode_chat(engine.tokenizer, [{"role": "user", "content": PROMPTS[i % 4]}], "embedded"))
        rows.append(RowOptions(max_tokens=MAX_TOKENS))
    schedule = {"threshold": None, "steps": steps} if steps else {"threshold": threshold}
    params = DecodeParams(cache_mode=cache_mode, block_length=32, gen_length=MAX_TOKENS, **schedule)
    store = make_kv_store(kv_quant, engine.spec) if kv_quant is not None else None
    report = engine.generate(prompts, params, rows, kv_store=store)
    return report, cases, prompts, params


def _check(report, cases, compiler=None):
    """Every finished output valid; with ``compiler``, every output whose grammar's shortest end fits ``max_tokens``
    finished (issue 45: the closing rule, `service.engine.grammar`)."""
    finished = 0
    for row, case in zip(report.rows, cases):  # the unconstrained tail has no case
        assert row.finish_reason in ("stop", "length")
        if compiler is not None:
            need = compiler.compile(spec_of(case)).min_tokens
            if need is not None and need <= MAX_TOKENS + 1:
                assert row.finish_reason == "stop", f"{case['name']}: cut at max_tokens though {need} positions fit"
        if row.finish_reason == "stop":
            finished += 1
            problem = violation(case, row.text)
            assert problem is None, f"{case['name']}: {problem}"
    return finished


@pytest.mark.parametrize("cache_mode,kv_quant", [
    ("none", None), ("prefix", None), ("dual", None),
    ("dual", KVQuantConfig(method="kivi", bits=2, k_group_size=32)),
], ids=["none", "prefix", "dual", "dual-kivi2"])
def test_every_finished_output_is_valid(engine, compiler, cache_mode, kv_quant):
    report, cases, prompts, params = _decode(engine, compiler, cache_mode, kv_quant, extra_unconstrained=1)
    finished = _check(report, cases, compiler)
    # Not a vacuous pass: most outputs end inside max_tokens (the rest hit the length and say so).
    assert finished >= 0.7 * len(cases), f"only {finished} of {len(cases)} outputs finished"
    # The unconstrained row shared every forward with 200 constrained ones and decoded as it does alone.
    store = make_kv_store(kv_quant, engine.spec) if kv_quant is not None else None
    alone = engine.generate(prompts[-1:], params, [RowOptions(max_tokens=MAX_TOKENS)], kv_store=store)
    assert report.rows[-1].generated_ids == alone.rows[0].generated_ids


def test_fixed_schedule_and_sampling(engine, compiler):
    """A fixed schedule (steps) reveals at least its count per step; sampling draws among allowed tokens only."""
    report, cases, _, _ = _decode(engine, compiler, "dual", steps=MAX_TOKENS // 4, temperature=1.0)
    assert _check(report, cases, compiler) >= 0.7 * len(cases)
    assert all(row.nfe <= MAX_TOKENS // 4 for row in report.rows)
