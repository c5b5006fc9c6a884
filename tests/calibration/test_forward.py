"""Calibration forwards on the tiny golden checkpoints: cached steps, pre-RoPE capture, Fisher weights."""

from __future__ import annotations

import pytest
import torch

from calibration.forward import cached_step, capture_pre_rope, capture_qkv, logits_forward, reused_columns
from service.engine import Engine
from tests.support.paths import CKPT


@pytest.fixture(scope="module", params=["llada-tiny", "dream-tiny"])
def engine(request):
    torch.set_num_threads(1)
    return Engine.load(CKPT / request.param)


def _state(engine, length=20, masked_from=12):
    state = torch.randint(0, 80, (length,), generator=torch.Generator().manual_seed(3))
    state[masked_from:] = engine.spec.mask_id
    return state


@pytest.mark.parametrize("cache_mode", ["prefix", "dual"])
def test_cached_step_with_exact_reused_kv_equals_full_recompute(engine, cache_mode):
    state = _state(engine)
    logits, full = capture_qkv(engine.model, state[None])
    window_logits, layers = cached_step(engine.model, state, cache_mode, 8, 12, full)
    end = 12 if cache_mode == "dual" else 20
    # Dream's first window column reads its own hidden state (reference shift rule), so compare from column 1.
    torch.testing.assert_close(window_logits[1:], logits[0, 9:end], atol=1e-5, rtol=1e-5)
    for captured, reference in zip(layers, full):
        torch.testing.assert_close(captured.q_block, reference.q[0, :, 8:12], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(captured.k_fresh, reference.k[0, :, 8:end], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits_forward(engine.model)(state[None]), logits)


def test_cached_step_uses_the_reused_keys_it_is_given(engine):
    state = _state(engine)
    _, full = capture_qkv(engine.model, state[None])
    other = state.clone()
    other[:8] = (other[:8] + 1) % 80  # a different prefix: its K/V are not those of `state`
    _, stale = capture_qkv(engine.model, other[None])
    _, exact = cached_step(engine.model, state, "dual", 8, 12, full)
    _, reused = cached_step(engine.model, state, "dual", 8, 12, stale)
    torch.testing.assert_close(reused[0].q_block, exact[0].q_block)  # layer 0 depends only on its own tokens
    assert (reused[-1].q_block - exact[-1].q_block).abs().max() > 1e-4  # deeper layers see the stale prefix
    assert reused_columns("dual", 8, 12, 20).tolist() == [*range(8), *range(12, 20)]
    with pytest.raises(ValueError, match="'prefix' or 'dual'"):
        reused_columns("none", 8, 12, 20)


def test_pre_rope_capture_and_fisher_weights(engine):
    state = _state(engine)
    layers = capture_pre_rope(engine.model, state)
    spec = engine.spec
    assert len(layers) == spec.num_layers and layers[0].k.shape == (spec.num_kv_heads, 20, spec.head_dim)
    assert layers[0].k_fisher is None
    # Pre-RoPE keys rotated at their positions are the post-RoPE keys of the capture.
    _, post = capture_qkv(engine.model, state[None])
    rotated = engine.model.rope.rotate(layers[1].k[None], torch.arange(20)[None])
    torch.testing.assert_close(rotated[0], post[1].k[0].float(), atol=1e-5, rtol=1e-5)
    targets = torch.full((20,), -100)
    targets[12:] = 5
    weighted = capture_pre_rope(engine.model, state, targets)
    assert all(layer.k_fisher.shape == layer.k.shape and layer.v_fisher.sum() > 0 for layer in weighted)
    torch.testing.assert_close(weighted[0].k, layers[0].k)
    assert all(p.grad is None for p in engine.model.parameters())
