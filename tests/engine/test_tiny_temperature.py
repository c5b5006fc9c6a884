"""Issue 25: a tiny temperature decodes exactly as greedy, and no temperature yields NaN (DreamLM/Dream#72).

The issue's input: Dream, prompt ids [64, 245, 278, 101, 17], seed 7, the tiny Dream checkpoint; before the fix
temperature 0 gave 25 tokens in 30 forwards (dual), 1e-3 down to 1e-30 revealed each block in one step with
degenerate repeats (163, 163, ...) and 1e-38 and below returned 64 copies of id 0 (NaN logits)."""

from __future__ import annotations

import math

import pytest
import torch

from service.engine.params import GREEDY_BELOW, DecodeParams, RowOptions
from service.engine.sampling import dream_tokens_and_confidence, llada_tokens_and_confidence

PROMPT = [64, 245, 278, 101, 17]
DUAL = DecodeParams(gen_length=64, block_length=32, cache_mode="dual", threshold=0.9)


@pytest.mark.parametrize("arch", ["dream", "llada"])
def test_temperatures_below_the_threshold_decode_exactly_as_greedy(engines, arch):
    engine = engines[arch]
    greedy = engine.generate([PROMPT], DUAL, [RowOptions(temperature=0.0, seed=7)]).rows[0]
    if arch == "dream":
        assert (len(greedy.generated_ids), greedy.nfe) == (25, 30)  # the figures
    for temperature in (1e-45, 1e-39, 1e-38, 1e-30, 1e-5, 1e-3, GREEDY_BELOW * 0.99):
        row = engine.generate([PROMPT], DUAL, [RowOptions(temperature=temperature, seed=7)]).rows[0]
        assert (row.generated_ids, row.nfe, row.reveals_per_step) == (
            greedy.generated_ids, greedy.nfe, greedy.reveals_per_step), temperature


@pytest.mark.parametrize("arch", ["dream", "llada"])
def test_no_temperature_yields_nan_or_the_banned_ids(engines, arch):
    engine = engines[arch]
    for temperature in (GREEDY_BELOW, 0.02, 0.1, 0.5, 1.0, 2.0):
        ids = engine.generate([PROMPT], DUAL.model_copy(update={"ignore_eos": True}),
                              [RowOptions(temperature=temperature, seed=7)]).rows[0].generated_ids
        assert len(ids) == 64 and engine.spec.mask_id not in ids
        assert ids != [0] * 64, temperature  # what NaN logits decoded to


def test_the_sampling_functions_stay_finite_on_extreme_logits():
    """Logits of magnitude 1e4 at the lowest sampling temperature: finite confidences, a legal token."""
    logits = torch.tensor([[1e4, -1e4, 0.0, 9999.0]])
    generator = torch.Generator().manual_seed(7)
    for neg_entropy in (False, True):
        tokens, confidence = dream_tokens_and_confidence(logits, GREEDY_BELOW, generator, neg_entropy)
        assert tokens.tolist() in ([0], [3]) and math.isfinite(confidence.item())
    tokens, confidence = llada_tokens_and_confidence(logits, 2.0, "low_confidence", generator)
    assert math.isfinite(confidence.item())
    assert RowOptions(temperature=GREEDY_BELOW / 2).temperature == 0.0
    assert RowOptions(temperature=GREEDY_BELOW).temperature == GREEDY_BELOW
