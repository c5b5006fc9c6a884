"""LLaDA2: detection, refusals and the forward pass against the reference's logits (tests/data/llada2)."""

from __future__ import annotations

import json

import pytest
import torch

from service.engine.errors import EngineInputError
from service.engine.loading import detect_arch, load_checkpoint
from service.engine.models.llada2 import LLaDA2Model, SparseMoE
from tests.support.llada2 import LLADA2_CKPT, llada2_golden, reference_logits


@pytest.fixture(scope="module")
def llada2():
    return {family: load_checkpoint(path) for family, path in LLADA2_CKPT.items()}


@pytest.mark.parametrize("family", ["llada2", "llada21"])
def test_both_checkpoints_are_llada2_never_llada(family):
    config = json.loads((LLADA2_CKPT[family] / "config.json").read_text())
    assert detect_arch(config) == "llada2"
    assert detect_arch({"model_type": "llada2_moe"}) == "llada2"
    assert detect_arch({"architectures": ["LLaDA2MoeModelLM"]}) == "llada2"
    assert detect_arch({"model_type": "llada"}) == "llada"


def test_the_21_copy_is_an_editing_checkpoint(llada2):
    assert llada2["llada21"].model.config.editing
    assert not llada2["llada2"].model.config.editing
    assert llada2["llada2"].spec.mask_id == 500 and 497 in llada2["llada2"].spec.eos_ids


@pytest.mark.parametrize("key, value", [("expert_capacity", 64), ("rope_scaling", {"type": "yarn"}),
                                        ("score_function", "softmax"), ("use_sliding_window", True)])
def test_unimplemented_variants_are_refused_naming_the_key(tmp_path, key, value):
    config = json.loads((LLADA2_CKPT["llada2"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, key: value}))
    (tmp_path / "model.safetensors").symlink_to(LLADA2_CKPT["llada2"] / "model.safetensors")
    with pytest.raises(EngineInputError, match=f"{key}=") as err:
        load_checkpoint(tmp_path)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("family", ["llada2", "llada21"])
@pytest.mark.parametrize("case", ["all_masks_after_prompt", "mixed_tokens_and_masks", "block16"])
def test_forward_logits_match_reference(llada2, family, case):
    # The golden set's llada21_forward.json is byte-identical to llada2's (same weights): one file serves both.
    data = llada2_golden("llada2_forward.json")[case]
    with torch.no_grad():
        logits = llada2[family].model(torch.tensor([data["input_ids"]]), block_length=data["block_length"])[0]
    torch.testing.assert_close(logits, reference_logits(data), atol=2e-4, rtol=0)


def test_checkpoint_round_trips_through_public_names(llada2):
    model: LLaDA2Model = llada2["llada2"].model
    public = model.checkpoint_state_dict()
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in public
    assert not any(name.endswith((".gate_up", ".experts.down")) for name in public)
    with torch.device("meta"):
        again = LLaDA2Model(model.config)
    again.load_checkpoint_tensors(public)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(again.state_dict()[name], value, atol=0, rtol=0)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "per_expert"])
def test_moe_matches_a_loop_over_tokens(llada2, grouped, monkeypatch):
    # The grouped computation (one grouped_mm pair, or the fallback's matmul pair per active expert) against the
    # definition: each token's K experts, weighted, plus the shared expert.
    moe: SparseMoE = llada2["llada2"].model.layers[1].mlp
    assert moe._grouped(torch.zeros(1, moe.gate_weight.shape[1]))  # the tiny checkpoint's widths take grouped_mm
    if not grouped:
        monkeypatch.setattr(moe, "_grouped", lambda rows: False)
    x = torch.randn(2, 7, moe.gate_weight.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = moe(x)
        ids, weights = moe.route(x.reshape(-1, x.shape[-1]))
        expected = []
        for token, row in enumerate(x.reshape(-1, x.shape[-1])):
            acc = moe.shared(row)
            for k in range(ids.shape[1]):
                e = int(ids[token, k])
                gate, up = (moe.gate_up[e] @ row).chunk(2)
                acc = acc + weights[token, k] * (moe.down[e] @ (torch.nn.functional.silu(gate) * up))
            expected.append(acc)
    torch.testing.assert_close(out.reshape(-1, x.shape[-1]), torch.stack(expected), atol=1e-5, rtol=1e-5)


def test_grouped_moe_reads_nothing_on_the_host(llada2, monkeypatch):
    # No .tolist()/.item() in the grouped path: the per-expert fallback (the only reader) must not run, and the
    # result is the fallback's in bfloat16 too (aligned widths), up to bfloat16 rounding.
    moe: SparseMoE = llada2["llada2"].model.layers[1].mlp
    x = torch.randn(3, 5, moe.gate_weight.shape[1], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = {dtype: _moe_in(moe, dtype, x, grouped=False) for dtype in (torch.float32, torch.bfloat16)}

        def no_read(*args):
            raise AssertionError("the grouped path fell back to the per-expert loop")

        monkeypatch.setattr(SparseMoE, "_per_expert", no_read)
        for dtype, expected in reference.items():
            out = _moe_in(moe, dtype, x, grouped=True)
            assert out.dtype == dtype
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


def _moe_in(moe: SparseMoE, dtype: torch.dtype, x: torch.Tensor, grouped: bool) -> torch.Tensor:
    """``moe`` (a copy, in ``dtype``) on ``x``, by grouped_mm or by the per-expert fallback."""
    import copy

    layer = copy.deepcopy(moe).to(dtype)
    if not grouped:
        layer._grouped = lambda rows: False
    return layer(x.to(dtype))
