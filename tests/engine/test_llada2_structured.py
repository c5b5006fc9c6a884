"""Log-probabilities and grammar-constrained responses (structured output, tool calls) on LLaDA2
(`service.engine.block_causal.step_rows`), in process on the tiny chat checkpoint (byte-level tokenizer)."""

from __future__ import annotations

import json
import math

import jsonschema
import pytest
import torch

from service.engine import Engine
from service.engine.block_causal import BlockCausalParams
from service.engine.block_causal_batch import BlockCausalBatch, BlockCausalCohort, generate
from service.engine.grammar import GrammarCompiler, GrammarSpec
from service.engine.loading import load_checkpoint
from service.engine.params import DecodeParams, RowOptions
from tests.support.llada2 import LLADA2_CHAT

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]},
                                           "tag": {"type": "string", "maxLength": 4}},
          "required": ["ok", "n", "tag"], "additionalProperties": False}


@pytest.fixture(scope="module")
def chat():
    loaded = load_checkpoint(LLADA2_CHAT)
    engine = Engine(loaded.model, loaded.spec, loaded.tokenizer, torch.float32, torch.device("cpu"))
    compiler = GrammarCompiler(loaded.tokenizer, loaded.spec.vocab_size, loaded.spec.eos_ids)
    return loaded, engine, compiler.compile(GrammarSpec.json_schema(SCHEMA, "response_format"))


def prompt_of(loaded, text: str) -> list[int]:
    return loaded.tokenizer(text)["input_ids"]


def decode(loaded, prompts: list[list[int]], settings: BlockCausalParams, rows: list[RowOptions]) -> list:
    """The rows decoded together in one running batch (block-causal settings as given); no request fails."""
    cohort = BlockCausalCohort(loaded.model, prompts, [settings] * len(prompts), loaded.spec.mask_id,
                               loaded.spec.eos_ids, rows, banned_ids=tuple(loaded.spec.banned_ids))
    batch = BlockCausalBatch(loaded.model)
    batch.join(cohort)
    with torch.inference_mode():
        while batch.cohorts:
            batch.step()
            assert not batch.failed
    return cohort.results


@pytest.mark.parametrize("mode", ["none", "block"])
def test_logprobs_are_the_revealing_forwards_and_change_no_token(chat, mode):
    loaded, engine, _ = chat
    prompt = prompt_of(loaded, "w5 w6 w7 w8 w9")
    params = DecodeParams(gen_length=64, threshold=0.9, cache_mode=mode)
    plain = engine.generate([prompt], params).rows[0]
    row = engine.generate([prompt], params, [RowOptions(logprobs=3)]).rows[0]
    assert row.generated_ids == plain.generated_ids and row.nfe == plain.nfe and plain.logprobs is None
    assert [e.token for e in row.logprobs] == row.generated_ids
    for entry in row.logprobs:
        assert len(entry.top) == 3 and entry.logprob <= 0.0
        assert [v for _, v in entry.top] == sorted((v for _, v in entry.top), reverse=True)
        # Greedy, no edits on a 2.0 checkpoint: the revealed token is the forward's argmax, its top-1 entry.
        assert entry.top[0] == (entry.token, pytest.approx(entry.logprob, abs=1e-6))
    # The whole vocabulary's probabilities at a position sum to 1: the values are a log-softmax, not raw logits.
    assert sum(math.exp(v) for _, v in row.logprobs[0].top) <= 1.0 + 1e-6


def test_logprobs_of_a_token_match_the_forward_that_revealed_it(chat):
    # Threshold 0: the first forward reveals every mask of the first block (the window [0, 32), the prompt's
    # tail in it); each of those entries is that forward's log-softmax at its column.
    loaded, engine, _ = chat
    prompt = prompt_of(loaded, "w1 w2")
    row = engine.generate([prompt], DecodeParams(gen_length=64, threshold=0.0, cache_mode="none"),
                          [RowOptions(logprobs=0)]).rows[0]
    ids = torch.tensor([prompt + [loaded.spec.mask_id] * (32 - len(prompt))])
    with torch.inference_mode():
        logp = torch.log_softmax(loaded.model(ids, block_length=32)[0, len(prompt):], dim=-1)
    first_block = row.logprobs[: 32 - len(prompt)]
    assert first_block and row.reveals_per_step[0] == 32 - len(prompt)
    for i, entry in enumerate(first_block):
        assert entry.logprob == pytest.approx(float(logp[i, entry.token]), abs=1e-5) and entry.top == []


@pytest.mark.parametrize("mode", ["none", "block"])
@pytest.mark.parametrize("threshold, steps", [(0.9, None), (None, 16)], ids=["threshold", "fixed"])
def test_a_json_schema_response_validates_and_other_rows_decode_as_alone(chat, mode, threshold, steps):
    loaded, engine, grammar = chat
    prompts = [prompt_of(loaded, "w5 w6 w7"), prompt_of(loaded, "w9 w8 w7 w6 w5 w4")]
    params = DecodeParams(gen_length=64, threshold=threshold, steps=steps, cache_mode=mode)
    alone = engine.generate([prompts[1]], params).rows[0]
    rows = engine.generate(prompts, params, [RowOptions(grammar=grammar, logprobs=1), RowOptions()]).rows
    jsonschema.validate(json.loads(rows[0].text), SCHEMA)
    assert rows[0].finish_reason == "stop" and len(rows[0].logprobs) == len(rows[0].generated_ids)
    assert (rows[1].generated_ids, rows[1].nfe) == (alone.generated_ids, alone.nfe)


def test_a_constrained_row_under_llada21_editing_validates_and_never_edits(chat):
    loaded, _, grammar = chat
    settings = BlockCausalParams(gen_length=64, block_length=32, steps=32, threshold=0.9, cache_mode="block",
                                 editing=True, editing_threshold=0.0, max_post_steps=4, min_transfer=1)
    prompt = prompt_of(loaded, "w5 w6 w7")
    constrained, free = decode(loaded, [prompt, prompt], settings, [RowOptions(grammar=grammar), RowOptions()])
    text = loaded.tokenizer.decode(constrained.generated_ids, skip_special_tokens=True)
    jsonschema.validate(json.loads(text), SCHEMA)
    # Each mask column of the decoded blocks was written once: no edit rewrote one (editing threshold 0 would
    # replace every revealed token the model predicts otherwise).
    columns = -(-(len(prompt) + 64) // 32) * 32
    assert sum(constrained.reveals_per_call) == columns - len(prompt)
    alone = generate(loaded.model, prompt, settings, loaded.spec.mask_id, loaded.spec.eos_ids)
    assert (free.generated_ids, free.nfe) == (alone.generated_ids, alone.nfe)


def test_a_constrained_block_fills_when_its_chains_reveal_fewer_than_the_schedule(chat):
    # 4 steps per block of 32 and a threshold no token reaches: each chain reveals what is forced and one more,
    # fewer than the step's 8; the row steps on until its block has no mask, and the response is complete.
    loaded, _, grammar = chat
    settings = BlockCausalParams(gen_length=64, block_length=32, steps=4, threshold=1.5, cache_mode="block")
    prompt = prompt_of(loaded, "w5 w6 w7")
    result = decode(loaded, [prompt], settings, [RowOptions(grammar=grammar)])[0]
    assert loaded.spec.mask_id not in result.generated_ids and result.finish_reason == "stop"
    jsonschema.validate(json.loads(loaded.tokenizer.decode(result.generated_ids, skip_special_tokens=True)), SCHEMA)
    assert result.nfe > 4  # more forwards than the first block's schedule
