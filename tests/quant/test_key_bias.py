"""Key-bias correction (`service.quant.key_bias`): the term against Monte-Carlo estimates of the rounding
inflation, bin widths, the config option, and the store's corrected attention against a by-hand reference."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from service.engine.cache_hooks import ReuseRead
from service.engine.kv_store import Segments
from service.engine.models.layers import RotaryEmbedding, attend
from service.quant import nuq
from service.quant.config import KVQuantConfig
from service.quant.key_bias import bin_widths, key_score_bias, log_sinhc
from tests.quant.helpers import SPEC, kv
from tests.quant.test_store import STATE2, store_for

D = 16
SAMPLES = 200_000


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _monte_carlo_log_inflation(q, steps, rotation=None, seed=0):
    """log E[exp(q.e / sqrt(d))] for e_i uniform on [-D_i/2, D_i/2] (rotated by ``rotation`` [d, d] when given),
    float64, one estimate per query row of ``q`` ``[n, d]`` against one key's ``steps`` ``[d]``."""
    gen = torch.Generator().manual_seed(seed)
    e = (torch.rand(SAMPLES, q.shape[-1], generator=gen, dtype=torch.float64) - 0.5) * steps.double()
    if rotation is not None:
        e = e @ rotation.double().T
    scores = e @ q.double().T / q.shape[-1] ** 0.5  # [S, n]
    return torch.logsumexp(scores, 0) - torch.log(torch.tensor(float(SAMPLES), dtype=torch.float64))


def test_the_correction_matches_the_monte_carlo_inflation_of_post_rope_keys():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(6, D, generator=gen) * 2
    steps = torch.rand(D, generator=gen) * 1.5  # x_i = q_i D_i / (2 sqrt(d)) up to about 1
    bias = key_score_bias(q[None, None], steps[None, None, None])[0, 0, :, 0]  # [6]
    mc = _monte_carlo_log_inflation(q, steps)
    exact = log_sinhc(q.double() * steps.double() / (2 * D**0.5)).sum(-1)
    torch.testing.assert_close(exact, mc, rtol=0.03, atol=2e-3)  # the exact form is the expectation
    torch.testing.assert_close(-bias.double(), exact, rtol=0.05, atol=1e-6)  # the second-order term, within x^4/180
    assert (bias <= 0).all()


def test_the_correction_of_pre_rope_keys_uses_the_query_rotated_back():
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(4, D, generator=gen) * 2
    steps = torch.rand(D, generator=gen)
    rope = RotaryEmbedding(D, 10000.0, True)
    for position in (0, 3, 17, 250):
        cos, sin = rope.cos_sin(torch.tensor([[position]]))  # [1, 1, 1, D]
        half = D // 2
        c, s = cos[0, 0, 0, :half], sin[0, 0, 0, :half]
        rotation = torch.zeros(D, D)  # x' = R x: x1' = x1 c - x2 s, x2' = x2 c + x1 s (rotate-half)
        idx = torch.arange(half)
        rotation[idx, idx], rotation[idx, idx + half] = c, -s
        rotation[idx + half, idx + half], rotation[idx + half, idx] = c, s
        bias = key_score_bias(q[None, None], steps[None, None, None], cos, sin)[0, 0, :, 0]
        back = q @ rotation  # (R^T q) per row
        by_hand = -(back.square() * steps.square()).sum(-1) / (24 * D)
        torch.testing.assert_close(bias, by_hand, rtol=1e-5, atol=1e-7)
        mc = _monte_carlo_log_inflation(q, steps, rotation, seed=position)
        torch.testing.assert_close(-bias.double(), mc, rtol=0.05, atol=2e-3)


@pytest.mark.parametrize("rotated", [False, True])
def test_the_exact_form_matches_monte_carlo_where_the_second_order_term_does_not(rotated):
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(5, D, generator=gen) * 4
    steps = torch.rand(D, generator=gen) * 3  # x_i up to about 3: the second-order term overshoots
    cos = sin = rotation = None
    if rotated:
        rope = RotaryEmbedding(D, 10000.0, True)
        cos, sin = rope.cos_sin(torch.tensor([[37]]))
        half, c, s = D // 2, cos[0, 0, 0, : D // 2], sin[0, 0, 0, : D // 2]
        rotation, idx = torch.zeros(D, D), torch.arange(half)
        rotation[idx, idx], rotation[idx, idx + half] = c, -s
        rotation[idx + half, idx + half], rotation[idx + half, idx] = c, s
    mc = _monte_carlo_log_inflation(q, steps, rotation, seed=5)
    exact = key_score_bias(q[None, None], steps[None, None, None], cos, sin, form="log_sinh")[0, 0, :, 0]
    second = key_score_bias(q[None, None], steps[None, None, None], cos, sin)[0, 0, :, 0]
    torch.testing.assert_close(-exact.double(), mc, rtol=0.03, atol=5e-3)
    excess = (-second.double() - mc) / mc  # the second-order term is above the inflation here, 4-26%
    assert (excess > 0.02).all() and excess.mean() > 0.1
    with pytest.raises(ValueError, match="second_order, log_sinh"):
        key_score_bias(q[None, None], steps[None, None, None], form="cubic")


def test_log_sinhc_is_stable_at_both_ends():
    x = torch.tensor([0.0, 1e-6, -1e-3, 0.5, -2.0, 30.0, 1e4])
    want = [0.0, 1e-12 / 6, 1e-6 / 6, 0.5 * 0.5 / 6 - 0.5**4 / 180 + 0.5**6 / 2835, None, None, None]
    got = log_sinhc(x)
    assert torch.isfinite(got).all() and (got >= 0).all()
    for g, w in zip(got.tolist(), want):
        if w is not None:
            assert g == pytest.approx(w, rel=1e-4, abs=1e-12)
    moderate = torch.tensor([2.0, 30.0], dtype=torch.float64)
    want_big = torch.cat([torch.log(torch.sinh(moderate) / moderate), torch.tensor([1e4 - math.log(2e4)]).double()])
    torch.testing.assert_close(got[4:].double(), want_big, rtol=1e-5, atol=1e-4)


def test_exact_keys_and_gqa():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 3, D, generator=gen)
    steps = torch.rand(2, 2, 5, D, generator=gen)
    steps[:, :, 2] = 0  # an exact key
    bias = key_score_bias(q, steps)
    assert bias.shape == (2, 4, 3, 5) and (bias[..., 2] == 0).all()
    # query heads 2 and 3 read kv head 1
    torch.testing.assert_close(bias[:, 2:], key_score_bias(q[:, 2:], steps[:, 1:]))


def test_bin_widths_of_a_codebook():
    uniform = torch.linspace(-1, 1, 4)  # edges -1, -2/3, 0, 2/3, 1
    torch.testing.assert_close(bin_widths(uniform), torch.tensor([1 / 3, 2 / 3, 2 / 3, 1 / 3]))
    shuffled = uniform[[2, 0, 3, 1]]
    torch.testing.assert_close(bin_widths(shuffled), torch.tensor([2 / 3, 1 / 3, 1 / 3, 2 / 3]))
    assert bin_widths(torch.tensor([-1.0, 0.5, 0.5, 1.0])).tolist() == [0.75, 0.75, 0.0, 0.25]
    assert float(bin_widths(torch.tensor([-0.5, 0.1, 0.2, 1.5])).sum()) == pytest.approx(2.5)  # [-1, 1.5]


def test_the_option_is_written_only_when_on_and_only_for_quantized_keys():
    off = KVQuantConfig(method="kivi", bits=2)
    assert "key_bias_correction" not in off.model_dump()
    on = KVQuantConfig(method="kivi", bits=2, key_bias_correction=True)
    assert on.model_dump()["key_bias_correction"] is True
    assert KVQuantConfig.model_validate(on.model_dump()) == on
    assert KVQuantConfig(method="kivi", sides="k", key_bias_correction=True).key_bias_correction
    for bad in ({"method": "none"}, {"method": "kivi", "sides": "v"}):
        with pytest.raises(ValidationError, match="key_bias_correction corrects quantized keys"):
            KVQuantConfig(key_bias_correction=True, **bad)
    with pytest.raises(ValidationError):
        KVQuantConfig(method="kivi", key_bias_correction="yes")


SEQ, BLOCK, TOTAL, G = 24, 32, 44, 8


def _steps_by_hand(method, k_pre, pads, bits):
    """``[B, H, T, D]`` each reused key's step per channel, from the original keys: KIVI's group range /
    (2^b - 1) over groups of G from each segment's first real token; KVQuant's bin width x half range (0 for
    outliers). Zero on the window and padding."""
    steps = torch.zeros_like(k_pre)
    for row, pad in enumerate(pads):
        for start, end in ((pad, SEQ), (BLOCK, TOTAL)):
            for a in range(start, end, G):
                if method != "kivi":
                    continue
                chunk = k_pre[row, :, a : min(a + G, end)]  # [H, n, D]
                scale = (chunk.amax(1) - chunk.amin(1)) / (2**bits - 1)
                steps[row, :, a : min(a + G, end)] = scale[:, None]
    if method == "kvquant":
        s = STATE2
        for row, pad in enumerate(pads):
            cols = [c for c in range(TOTAL) if pad <= c < SEQ or c >= BLOCK]
            x = k_pre[row, :, cols].transpose(0, 1).reshape(len(cols), -1)  # [N, C]
            codes, outliers = nuq.quantize_keys(x, s.k_upper[0], s.k_lower[0], s.k_lut[0])
            _, half_range = nuq.key_offset_range(s.k_upper[0], s.k_lower[0])
            width = bin_widths(s.k_lut[0])[codes.long()] * half_range
            width[outliers] = 0
            steps[row, :, cols] = width.view(len(cols), SPEC.num_kv_heads, SPEC.head_dim).transpose(0, 1)
    return steps


@pytest.mark.parametrize("method", ["kivi", "kvquant"])
@pytest.mark.parametrize("rows", [None, [1]])
def test_the_store_attends_with_the_correction_as_by_hand(method, rows):
    pads = (0, 5)
    k_pre, v = kv(2, TOTAL, seed=7)
    segments = Segments(pads, block_start=SEQ, block_end=BLOCK, seq_len=TOTAL, cache_mode="dual")
    plain, corrected = store_for(method, bits=2), store_for(method, bits=2, key_bias_correction=True)
    for store in (plain, corrected):
        store.write(0, k_pre, v, segments)
    step_rows = [0, 1] if rows is None else rows
    gen = torch.Generator().manual_seed(8)
    n, w = len(step_rows), BLOCK - SEQ
    q = torch.randn(n, SPEC.num_heads, w, D, generator=gen) * 3
    k_fresh, v_fresh = (torch.randn(n, SPEC.num_kv_heads, w, D, generator=gen) for _ in range(2))
    rope = RotaryEmbedding(D, 10000.0, True)
    positions = torch.stack([torch.arange(TOTAL) - pads[r] for r in step_rows])
    reused = positions[:, segments.reused_columns]
    selection = None if rows is None else torch.tensor(rows)
    k_all, v_all = ReuseRead(plain, segments, selection, rope, reused)(0, q, k_fresh, k_fresh, v_fresh)
    got = ReuseRead(corrected, segments, selection, rope, reused)(0, q, k_fresh, k_fresh, v_fresh)

    steps = _steps_by_hand(method, k_pre, pads, 2)[step_rows]  # [n, H_kv, T, D]
    steps = steps.repeat_interleave(SPEC.num_heads // SPEC.num_kv_heads, dim=1)[:, :, None]  # [n, H, 1, T, D]
    query = q[:, :, :, None]  # [n, H, w, 1, D]
    if method == "kvquant":  # the query rotated back by each key's angle (its position)
        cos, sin = rope.cos_sin(positions)  # [n, 1, T, D]
        c, s = cos[:, :, None, :, : D // 2], sin[:, :, None, :, : D // 2]
        q1, q2 = query[..., : D // 2], query[..., D // 2 :]
        query = torch.cat([q1 * c + q2 * s, q2 * c - q1 * s], dim=-1)
    bias = -(query.square() * steps.square()).sum(-1) / (24 * D)  # [n, H, w, T]
    mask = torch.arange(TOTAL)[None, :] >= torch.tensor([pads[r] for r in step_rows])[:, None]
    scores = q @ k_all.repeat_interleave(2, dim=1).transpose(-1, -2) / D**0.5 + bias
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    expected = scores.softmax(-1) @ v_all.repeat_interleave(2, dim=1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert bias.abs().max() > 1e-2  # the correction is not negligible here
    # And with every step zero the corrected path is the plain one.
    corrected.quantizer.key_steps = lambda layer, packed, layout: torch.zeros(layout.num_slots, 2, D)
    zero = ReuseRead(corrected, segments, selection, rope, reused)(0, q, k_fresh, k_fresh, v_fresh)
    torch.testing.assert_close(zero, attend(q, k_all, v_all, mask), rtol=1e-6, atol=1e-6)


def test_dllm_kvq_protected_tokens_have_no_step():
    k, v = kv(1, TOTAL, seed=9)
    segments = Segments((0,), block_start=SEQ, block_end=BLOCK, seq_len=TOTAL, cache_mode="dual")
    store = store_for("dllm_kvq", bits=2, key_bias_correction=True)
    store.write(0, k, v, segments, torch.rand(1, TOTAL, generator=torch.Generator().manual_seed(1)))
    packed = store._packed[0]
    steps = store.quantizer.key_steps(0, packed, store._layout)
    protected = packed.k.tensors["protected_slots"].long()
    assert protected.numel() and (steps[protected] == 0).all()
    kept = torch.ones(steps.shape[0], dtype=torch.bool)
    kept[protected] = False
    assert (steps[kept].amax((1, 2)) > 0).all()


def test_a_method_with_its_own_k_format_and_no_key_steps_is_refused():
    from service.quant.base import KVQuantizer
    from service.quant.errors import KVQuantError
    from service.quant.kvquant import KVQuantQuantizer
    from service.quant.store import QuantizedKVStore

    class OwnKeys(KVQuantizer):
        def dequantize_k(self, layer, packed, layout, out=None):
            return super().dequantize_k(layer, packed, layout, out)

    class OwnKeysWithSteps(OwnKeys):
        def key_steps(self, layer, packed, layout):
            return torch.zeros(layout.num_slots, packed.num_heads, packed.head_dim)

    assert KVQuantizer.declares_key_steps() and KVQuantQuantizer.declares_key_steps()
    assert OwnKeysWithSteps.declares_key_steps() and not OwnKeys.declares_key_steps()
    config = KVQuantConfig(method="kivi", bits=2, key_bias_correction=True)
    with pytest.raises(KVQuantError, match="declares no key steps") as err:
        QuantizedKVStore(OwnKeys(config, SPEC))
    assert err.value.field == "key_bias_correction"
    QuantizedKVStore(OwnKeysWithSteps(config, SPEC))
    QuantizedKVStore(OwnKeys(KVQuantConfig(method="kivi", bits=2), SPEC))  # without the correction: as before
