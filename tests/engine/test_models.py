"""Forward pass of both architectures against the reference's logits, and the model-level seams."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from service.engine.models import capture_qkv
from tests.support.fastdllm import golden


def _reference_logits(case: dict) -> torch.Tensor:
    raw = np.frombuffer(base64.b64decode(case["logits_f32_b64"]), dtype="<f4")
    return torch.from_numpy(raw.reshape(case["logits_shape"][-2:]).copy())


@pytest.mark.parametrize("arch", ["llada", "dream"])
@pytest.mark.parametrize("case", ["all_masks_after_prompt", "mixed_tokens_and_masks"])
def test_forward_logits_match_reference(engines, arch, case):
    data = golden(f"{arch}_forward.json")[case]
    reference = _reference_logits(data)  # raw LM-head output [T, V]
    if arch == "dream":
        # Dream's logits are position-aligned by the model: column p comes from the hidden state at p-1.
        reference = torch.cat([reference[:1], reference[:-1]])
    with torch.no_grad():
        logits = engines[arch].model(torch.tensor([data["input_ids"]]))[0]
    assert logits.shape == reference.shape
    torch.testing.assert_close(logits, reference, atol=2e-4, rtol=0)


@pytest.mark.parametrize("arch", ["llada", "dream"])
def test_left_padding_gives_the_same_logits_as_alone(engines, arch):
    model = engines[arch].model
    ids = torch.tensor(golden(f"{arch}_forward.json")["mixed_tokens_and_masks"]["input_ids"][:30])
    pad = engines[arch].spec.pad_id
    batch = torch.stack([ids, torch.cat([torch.full((4,), pad), ids[:-4]])])
    mask = torch.ones_like(batch, dtype=torch.bool)
    mask[1, :4] = False
    with torch.no_grad():
        alone = model(ids[None])[0]
        shorter_alone = model(ids[None, :-4])[0]
        padded = model(batch, mask)
    torch.testing.assert_close(padded[0], alone, atol=1e-4, rtol=0)
    # Bidirectional attention: the padded row sees only its own 26 tokens, at positions 0..25. Its first real
    # column is skipped: Dream predicts it from the padding column before it (never decoded: it is prompt).
    torch.testing.assert_close(padded[1, 5:], shorter_alone[1:], atol=1e-4, rtol=0)


def test_capture_gives_post_rope_qkv_of_every_layer(engines):
    model = engines["dream"].model
    ids = torch.tensor([golden("dream_forward.json")["mixed_tokens_and_masks"]["input_ids"][:12]])
    with torch.no_grad():
        logits, layers = capture_qkv(model, ids)
        plain = model(ids)
    torch.testing.assert_close(logits, plain, atol=0, rtol=0)
    cfg = model.config
    assert len(layers) == cfg.num_layers
    assert layers[0].q.shape == (1, cfg.num_heads, 12, cfg.head_dim)
    assert layers[0].k.shape == layers[0].v.shape == (1, cfg.num_kv_heads, 12, cfg.head_dim)
    # Layer 0's K is the rotated projection of the normed embeddings (bias included for Dream).
    layer = model.layers[0]
    h = layer.attn_norm(model.embed(ids))
    k_pre = layer.attn.k_proj(h).view(1, 12, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
    positions = torch.arange(12)[None]
    torch.testing.assert_close(layers[0].k, model.rope.rotate(k_pre, positions), atol=1e-6, rtol=0)
    assert not torch.equal(layers[0].k, k_pre)


def test_plain_forward_trains_under_bf16_autocast(engines):
    from service.engine.models import LLaDAModel

    torch.manual_seed(0)
    model = LLaDAModel(engines["llada"].model.config)
    ids = torch.randint(0, 300, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[0, :3] = False
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids, mask)
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids.reshape(-1))
    loss.backward()
    assert logits.shape == (2, 16, model.config.vocab_size)
    assert model.layers[0].attn.q_proj.weight.grad is not None
    assert torch.isfinite(model.layers[0].attn.q_proj.weight.grad).all()


@pytest.mark.parametrize("arch", ["llada", "dream"])
def test_checkpoint_names_round_trip(engines, arch):
    from safetensors import safe_open

    from tests.support.fastdllm import CKPT

    with safe_open(CKPT[arch] / "model.safetensors", framework="pt") as handle:
        names = set(handle.keys())
    assert set(engines[arch].model.checkpoint_state_dict()) == names


@pytest.mark.parametrize("arch", ["llada", "dream"])
def test_a_forward_split_by_layers_gives_the_whole_forward_bit_for_bit(engines, arch):
    """`DiffusionLM.forward` over a layer range (a block-initial pass split by layers,
    `service.runtime.scheduler.split_by_layers`): the ranges called in turn, each from the hidden states the last
    returned, give the whole forward's logits exactly, and every layer's K/V hook sees the same tensors."""
    model = engines[arch].model
    ids = torch.tensor([golden(f"{arch}_forward.json")["mixed_tokens_and_masks"]["input_ids"]])
    layers = len(model.layers)
    assert layers >= 2

    def recorder(seen):
        def hook(layer, q, k_pre, k, v):
            seen.append((layer, k.clone(), v.clone()))
        return hook

    whole_kv, split_kv = [], []
    with torch.no_grad():
        whole = model(ids, kv_hook=recorder(whole_kv))
        hidden = None
        for start in range(layers):  # one layer a piece: every boundary is crossed
            out = model(ids, kv_hook=recorder(split_kv), layers=(start, start + 1), hidden=hidden)
            hidden = out
    assert torch.equal(out, whole)
    assert [layer for layer, *_ in split_kv] == list(range(layers)) == [layer for layer, *_ in whole_kv]
    assert all(torch.equal(a[1], b[1]) and torch.equal(a[2], b[2]) for a, b in zip(split_kv, whole_kv))
    with pytest.raises(ValueError, match="hidden states after layer 0"):
        model(ids, layers=(1, layers))
