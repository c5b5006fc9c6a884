"""Bad input at the engine boundary: a typed error whose message says what is legal; nothing runs."""

from __future__ import annotations

import dataclasses

import pytest

from service.engine import EngineInputError
from service.engine.params import DecodeParams, RowOptions

OK = [5, 6, 7]


def _params(**kw):
    base = {"gen_length": 64, "block_length": 32, "cache_mode": "dual", "threshold": 0.9}
    base.update(kw)
    return DecodeParams.model_construct(**{**DecodeParams().model_dump(), **base})


@pytest.mark.parametrize(
    "arch,prompts,params,message",
    [
        ("llada", [OK], _params(gen_length=48), "not a multiple of block_length"),
        ("llada", [OK], _params(threshold=None, steps=3), "positive multiple of the number of blocks 2"),
        ("llada", [OK], _params(threshold=None, steps=None), "exactly one of threshold"),
        ("llada", [OK], _params(threshold=0.9, steps=4), "exactly one of threshold"),
        ("llada", [OK], _params(threshold=1.5), r"outside \[0, 1\]"),
        ("llada", [OK], _params(threshold=-0.1), r"outside \[0, 1\]"),
        ("llada", [OK], _params(cache_mode="full"), "this llada model takes none, prefix or dual"),
        ("llada", [OK * 1400], _params(), "over the model's context of 4096"),
        ("llada", [[]], _params(), "prompt 0 is empty"),
        ("llada", [], _params(), "at least one prompt"),
        ("llada", [OK, [1, 336, 2]], _params(), "prompt 1 contains the mask id 336"),
        ("llada", [[1, 384]], _params(), r"outside the vocabulary \[0, 384\)"),
        ("llada", [[-1, 3]], _params(), r"outside the vocabulary \[0, 384\)"),
        ("dream", [OK], _params(threshold=None, steps=2), "at least 2 steps per block"),
        ("dream", [OK], _params(remasking="random"), "only 'low_confidence'"),
        # Dream's schedule sent to another family (was ignored); Dream takes it (tests/engine/test_decode_batch.py).
        ("llada", [OK], _params(cache_mode="none", dream_schedule="block"), "the served model is not Dream"),
    ],
)
def test_bad_request(engines, arch, prompts, params, message):
    with pytest.raises(EngineInputError, match=message):
        engines[arch].generate(prompts, params)


def test_rows_must_match_prompts(engines):
    with pytest.raises(EngineInputError, match="one per prompt"):
        engines["llada"].generate([OK, OK], _params(), [RowOptions()])


def test_pad_equal_to_mask_is_refused(engines):
    engine = engines["llada"]
    spec = engine.spec
    engine.spec = dataclasses.replace(spec, pad_id=spec.mask_id)
    try:
        with pytest.raises(EngineInputError, match="pad id equals mask id"):
            engine.generate([OK], _params())
    finally:
        engine.spec = spec


def test_threshold_zero_is_legal_and_reveals_a_block_per_call(engines):
    row = engines["llada"].generate([OK], _params(threshold=0.0, cache_mode="none")).rows[0]
    assert row.reveals_per_step == [32, 32]
