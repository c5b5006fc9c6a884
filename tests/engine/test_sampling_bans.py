"""Sampling never produces a token the model cannot mean (issue 13): never the mask id, never an id the loaded
tokenizer cannot decode; the confidence keeps the reference's full-softmax value (the goldens,
`tests/engine/test_decode_golden.py`, stay token-exact)."""

from __future__ import annotations

import shutil

import pytest
import torch

from service.engine.params import DecodeParams, RowOptions
from service.engine.sampling import dream_tokens_and_confidence, llada_tokens_and_confidence
from tests.support.fastdllm import CKPT, add_word_tokenizer

# The input: LLaDA at temperature 2, random remasking, a fixed schedule of 64 steps; before the ban the
# sampler chose the mask id, the position stayed masked and the fixed schedule ran out of steps (IndexError).
CRASHED = DecodeParams(gen_length=64, block_length=32, cache_mode="dual", threshold=None, steps=64,
                       remasking="random", ignore_eos=True)


def test_the_crashing_request_decodes_every_position_without_the_mask_id(engines):
    engine = engines["llada"]
    report = engine.generate([[5, 6, 7]], CRASHED, [RowOptions(temperature=2.0, seed=25)])
    ids = report.rows[0].generated_ids
    assert len(ids) == 64 and engine.spec.mask_id not in ids
    assert report.rows[0].nfe == 64


@pytest.mark.parametrize("seed", range(6))
def test_no_seed_at_temperature_two_yields_the_mask_id(engines, seed):
    engine = engines["llada"]
    for remasking in ("random", "low_confidence"):
        params = CRASHED.model_copy(update={"remasking": remasking})
        ids = engine.generate([[5, 6, 7]], params, [RowOptions(temperature=2.0, seed=seed)]).rows[0].generated_ids
        assert len(ids) == 64 and engine.spec.mask_id not in ids


def test_banned_ids_are_excluded_from_the_choice_only():
    """The mask column has the largest logit: the choice is the runner-up, its confidence the full softmax's."""
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0]])
    banned = torch.tensor([2])
    tokens, confidence = llada_tokens_and_confidence(logits, 0.0, "low_confidence", None, banned)
    full = torch.softmax(logits.double(), dim=-1)
    assert tokens.tolist() == [3] and confidence.item() == pytest.approx(full[0, 3].item())
    tokens, confidence = dream_tokens_and_confidence(logits, 0.0, None, False, banned)
    assert tokens.tolist() == [3] and confidence.item() == pytest.approx(torch.softmax(logits, -1)[0, 3].item())
    # Nothing banned: the reference's choice.
    assert llada_tokens_and_confidence(logits, 0.0, "low_confidence", None, None)[0].tolist() == [2]


@pytest.fixture(scope="module")
def narrow_tokenizer_engine(tmp_path_factory):
    """llada-tiny (384 logit rows) with a tokenizer of 350 ids: rows 350..383 cannot be decoded."""
    from service.engine import Engine

    directory = tmp_path_factory.mktemp("narrow") / "llada-tiny"
    shutil.copytree(CKPT["llada"], directory)
    add_word_tokenizer(directory, {81: "<|endoftext|>", 336: "<|mdm_mask|>", 346: "<|start_header_id|>",
                                   347: "<|end_header_id|>", 348: "<|eot_id|>"}, 350)
    return Engine.load(directory)


def test_ids_beyond_the_tokenizer_are_never_sampled(narrow_tokenizer_engine):
    engine = narrow_tokenizer_engine
    assert (engine.spec.tokenizer_size, engine.spec.vocab_size) == (350, 384)
    assert engine.spec.banned_ids == [336, *range(350, 384)]
    params = DecodeParams(gen_length=64, block_length=32, cache_mode="dual", threshold=0.9, ignore_eos=True)
    rows = [RowOptions(temperature=2.0, seed=s) for s in range(8)]
    report = engine.generate([[5, 6, 7]] * 8, params, rows)
    ids = [t for row in report.rows for t in row.generated_ids]
    assert len(ids) == 8 * 64 and max(ids) < 350 and 336 not in ids
