"""Tool calls are always valid (issue 35): 40 tool sets (the object schemas of ``tests/data/structured/cases.json``
as functions: nested objects, arrays, enums, bounded numbers, optional fields; 20 sets of one tool and 20 of three)
x 2 prompts, under ``required`` (one call, or parallel calls), a named function and ``auto``, decoded by the
embedded model in-process under every cache mode and a quantized KV cache. Every response that is not cut by
``max_tokens`` is whole calls (or, under ``auto``, text) whose names are offered and whose arguments validate
against their function's schema (jsonschema); a response cut by ``max_tokens`` is read as ``length`` with only
whole, valid calls. The embedded model only knows digits: this checks the contract, not the model's choices.

All 80 rows of a configuration decode as one batch (each with its own grammar), with an unconstrained row riding
along that must decode as it does alone (rows with tools share forwards)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from service.api.tools import read_answer
from service.engine.grammar import GrammarSpec
from service.engine.params import DecodeParams, RowOptions
from service.engine.prompts import encode_chat
from service.engine.tool_format import CALL_OPEN, Function, call_grammar, generic_turns, parse_calls
from service.quant.config import KVQuantConfig
from service.quant.store import make_kv_store
from tests.support.structured import CASES

pytestmark = pytest.mark.slow  # four configurations of 81 rows: minutes on one core
MAX_TOKENS = 96
PROMPTS = ["copy: 4 1 4 4 2 9 7 4", "Call a tool."]
OBJECTS = [c for c in CASES if c["kind"] == "json_schema" and isinstance(c["schema"], dict)
           and c["schema"].get("type") == "object"]


def tool_sets() -> list[tuple[list[Function], str, bool]]:
    """40 (functions, mode, parallel): modes cycle through required (one call), required (parallel), named, auto."""
    sets = []
    for i in range(40):
        picks = [i % len(OBJECTS)] + ([(i + 7) % len(OBJECTS), (i + 13) % len(OBJECTS)] if i >= 20 else [])
        functions = [Function(f"{OBJECTS[j]['name']}_{k}", f"tool {k}", OBJECTS[j]["schema"])
                     for k, j in enumerate(picks)]
        mode, parallel = [("required", False), ("required", True), ("named", False), ("auto", True)][i % 4]
        sets.append((functions, mode, parallel))
    return sets


SETS = tool_sets()


def _decode(engine, compiler, cache_mode, kv_quant=None):
    prompts, rows, cases = [], [], []
    for functions, mode, parallel in SETS:
        called = functions[:1] if mode == "named" else functions
        grammar = compiler.compile(GrammarSpec.lark(call_grammar(called, parallel, mode == "auto"), "tools"))
        for text in PROMPTS:
            turns = generic_turns([{"role": "user", "content": text}], functions)
            prompts.append(encode_chat(engine.tokenizer, turns, "embedded"))
            rows.append(RowOptions(max_tokens=MAX_TOKENS, grammar=grammar, seed=len(rows)))
            cases.append((called, mode, parallel))
    prompts.append(encode_chat(engine.tokenizer, [{"role": "user", "content": PROMPTS[0]}], "embedded"))
    rows.append(RowOptions(max_tokens=MAX_TOKENS))
    params = DecodeParams(cache_mode=cache_mode, block_length=32, gen_length=MAX_TOKENS, threshold=0.9)
    store = make_kv_store(kv_quant, engine.spec) if kv_quant is not None else None
    return engine.generate(prompts, params, rows, kv_store=store), cases, prompts, params


def _problem(called: list[Function], mode: str, parallel: bool, text: str, finish: str) -> str | None:
    """Why a response breaks the contract (None when it keeps it)."""
    answer = read_answer(text, finish)
    schemas = {f.name: f.parameters for f in called}
    for _, call in answer.calls:
        if call.name not in schemas:
            return f"{call.name!r} was not offered"
        try:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
            return f"{call.arguments!r} does not validate: {exc}"
    if finish != "stop":
        return None if answer.finish_reason == "length" else f"a {finish} cut read as {answer.finish_reason}"
    if mode == "auto" and not text.startswith(CALL_OPEN):
        return None if answer.content == text and not answer.calls else "text read as calls"
    calls, complete = parse_calls(text)
    if not complete or answer.finish_reason != "tool_calls":
        return f"a finished response that is not whole calls: {text!r}"
    if not parallel and len(calls) != 1:
        return f"{len(calls)} calls without parallel_tool_calls"
    return None


@pytest.mark.parametrize("cache_mode,kv_quant", [
    ("none", None), ("prefix", None), ("dual", None),
    ("dual", KVQuantConfig(method="kivi", bits=2, k_group_size=32)),
], ids=["none", "prefix", "dual", "dual-kivi2"])
def test_every_finished_call_is_valid(engine, compiler, cache_mode, kv_quant):
    report, cases, prompts, params = _decode(engine, compiler, cache_mode, kv_quant)
    finished = calls = 0
    for row, (called, mode, parallel) in zip(report.rows, cases):  # the unconstrained row has no case
        assert row.finish_reason in ("stop", "length")
        problem = _problem(called, mode, parallel, row.text, row.finish_reason)
        assert problem is None, f"{[f.name for f in called]} {mode}: {problem}"
        finished += row.finish_reason == "stop"
        calls += len(read_answer(row.text, row.finish_reason).calls)
    print(f"{cache_mode}: {finished} of {len(cases)} responses finished, {calls} calls")
    # Not a vacuous pass: most responses end within max_tokens, and they are calls.
    assert finished >= 0.7 * len(cases), f"only {finished} of {len(cases)} responses finished"
    assert calls >= 0.6 * len(cases), f"only {calls} calls in {len(cases)} responses"
    store = make_kv_store(kv_quant, engine.spec) if kv_quant is not None else None
    alone = engine.generate(prompts[-1:], params, [RowOptions(max_tokens=MAX_TOKENS)], kv_store=store)
    assert report.rows[-1].generated_ids == alone.rows[0].generated_ids
