"""Issue 25, item 1: each returned token's log-probability and alternatives as the model gave them at the step
that revealed it, captured without an extra forward and cut with the response."""

from __future__ import annotations

import pytest
import torch

from service.engine.params import DecodeParams, RowOptions

PROMPT = [64, 245, 278, 101, 17]
MODES = {
    "dual-threshold": DecodeParams(gen_length=64, block_length=32, cache_mode="dual", threshold=0.9),
    "prefix-fixed": DecodeParams(gen_length=32, block_length=16, cache_mode="prefix", threshold=None, steps=16),
    "none": DecodeParams(gen_length=32, block_length=32, cache_mode="none", threshold=None, steps=8),
}


@pytest.mark.parametrize("arch", ["llada", "dream"])
@pytest.mark.parametrize("mode", list(MODES))
def test_capture_changes_nothing_and_costs_no_forward(engines, arch, mode):
    engine, params = engines[arch], MODES[mode]
    if arch == "dream" and mode == "none":
        params = params.model_copy(update={"dream_schedule": "origin"})  # the whole-response schedule
    for temperature in (0.0, 0.7):
        plain = engine.generate([PROMPT], params, [RowOptions(temperature=temperature, seed=3)]).rows[0]
        row = engine.generate([PROMPT], params, [RowOptions(temperature=temperature, seed=3, logprobs=3)]).rows[0]
        assert (row.generated_ids, row.nfe, row.reveals_per_step) == (plain.generated_ids, plain.nfe,
                                                                      plain.reveals_per_step)
        assert plain.logprobs is None and len(row.logprobs) == len(row.generated_ids) > 0
        for token, entry in zip(row.generated_ids, row.logprobs):
            assert entry.token == token and entry.logprob <= 0 and len(entry.top) == 3
            assert [v for _, v in entry.top] == sorted((v for _, v in entry.top), reverse=True)
            if temperature == 0.0 and token not in engine.spec.banned_ids:
                # Greedy: the distribution that chose it has it on top.
                assert entry.top[0] == (token, pytest.approx(entry.logprob))


def test_the_first_step_values_are_the_forward_log_softmax(engines):
    """One token per step (a fixed schedule of gen_length steps): the token revealed at the block-initial pass
    carries the log-softmax of that pass's logits at its position."""
    engine = engines["llada"]
    params = DecodeParams(gen_length=16, block_length=16, cache_mode="none", threshold=None, steps=16)
    row = engine.generate([PROMPT], params, [RowOptions(logprobs=2)]).rows[0]
    x = torch.tensor([PROMPT + [engine.spec.mask_id] * 16])
    with torch.inference_mode():
        logp = torch.log_softmax(engine.model(x)[0, len(PROMPT):].float(), -1)
    first = int(logp.max(-1).values.argmax())  # the most confident position goes first
    assert row.logprobs[first].logprob == pytest.approx(float(logp[first].max()), abs=1e-5)
    assert row.logprobs[first].top[1][1] == pytest.approx(float(logp[first].topk(2).values[1]), abs=1e-5)


def test_values_are_cut_with_the_response(engines):
    engine = engines["llada"]
    params = MODES["dual-threshold"].model_copy(update={"ignore_eos": True})
    row = engine.generate([PROMPT], params, [RowOptions(logprobs=0, max_tokens=5)]).rows[0]
    assert len(row.generated_ids) == len(row.logprobs) == 5 and all(e.top == [] for e in row.logprobs)
