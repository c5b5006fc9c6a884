import dataclasses
import json

import pytest
import torch
from pydantic import ValidationError

from service.artifacts.base import ArtifactMismatch, Provenance
from service.artifacts.kvquant_state import KVQuantState, KVQuantStateMeta
from service.artifacts.policy import LayerPolicy, PolicyTable, nominal_k_bits
from service.engine.spec import ModelSpec

SPEC = ModelSpec(
    arch="llada", model_id="tiny", fingerprint="ab" * 32, num_layers=3, num_heads=4, num_kv_heads=2,
    head_dim=16, vocab_size=100, mask_id=99, eos_ids=(1,), pad_id=0, max_length=256,
)
PROV = Provenance(data="mixed_chat x8", code="dllm-kvq 0.1.0 calibration fit")


def make_table(**over) -> PolicyTable:
    fields = {
        "model_id": "tiny", "weights_fingerprint": SPEC.fingerprint, "cache_mode": "dual", "bits": 4, "k_group_size": 32,
        "v_group_size": 16, "k_bit_cap": 4.9,
        "layers": [LayerPolicy(score_type="attention", p=1), LayerPolicy(score_type="qerror", p=0),
                LayerPolicy(score_type="hybrid", p=2)],
        "provenance": PROV,
    }
    fields.update(over)
    return PolicyTable(**fields)


def test_policy_json_round_trip_keeps_content_and_id():
    table = make_table()
    again = PolicyTable.from_json(table.to_json())
    assert again == table and again.id == table.id
    assert table.id.startswith("policy-") and len(table.id) == len("policy-") + 32
    # The id follows the content: any change gives another id.
    assert make_table(layers=[LayerPolicy(score_type="attention", p=2)] * 3).id != table.id
    assert "id" not in json.loads(table.to_json())  # derived, never stored


def test_policy_validates_against_model():
    make_table().validate_for(SPEC)
    with pytest.raises(ArtifactMismatch, match="^weights_fingerprint"):
        make_table(weights_fingerprint="cd" * 32).validate_for(SPEC)
    with pytest.raises(ArtifactMismatch, match="^layers: the policy has 2 layer entries, the model has 3"):
        make_table(layers=[LayerPolicy(score_type="qerror", p=0)] * 2).validate_for(SPEC)
    with pytest.raises(ArtifactMismatch, match=r"^v_group_size: 32 does not divide .* legal: \[1, 2, 4, 8, 16\]"):
        make_table(v_group_size=32).validate_for(SPEC)


@pytest.mark.parametrize(
    "layers, match",
    [
        ([{"score_type": "attention", "p": -1}], r"layers\.0\.p"),
        ([{"score_type": "qerror", "p": 0}, {"score_type": "qerror", "p": 32}], r"layers\.1\.p: budget 32"),
        ([{"score_type": "entropy", "p": 1}], r"(?s)layers\.0\.score_type.*'attention', 'qerror' or 'hybrid'"),
        # p = 4 at 4 bits, G = 32: (4 * 28 + 16 * 4) / 32 = 5.5 nominal K bits > cap 4.9
        ([{"score_type": "hybrid", "p": 4}], r"layers\.0\.p: budget 4 gives 5.5"),
    ],
)
def test_illegal_layer_entries_name_the_field(layers, match):
    with pytest.raises(ValidationError, match=match):
        make_table(layers=layers)


def test_bits_and_cache_mode_list_legal_values():
    with pytest.raises(ValidationError, match="(?s)bits.*2, 4 or 8"):
        make_table(bits=3)
    with pytest.raises(ValidationError, match="(?s)cache_mode.*'prefix' or 'dual'"):
        make_table(cache_mode="none")


def test_nominal_k_bits_matches_paper_accounting():
    assert nominal_k_bits(4, 32, 0) == 4.0
    assert nominal_k_bits(4, 32, 1) == (4 * 31 + 16) / 32
    assert nominal_k_bits(2, 32, 4) == 3.75


def make_state(**over) -> KVQuantState:
    gen = torch.Generator().manual_seed(0)
    channels = SPEC.num_kv_heads * SPEC.head_dim
    lower = -torch.rand(3, channels, generator=gen).half()
    fields = {
        "meta": KVQuantStateMeta(model_id="tiny", weights_fingerprint=SPEC.fingerprint, bits=2, num_layers=3,
                              channels=channels, provenance=PROV),
        "k_upper": -lower, "k_lower": lower, "k_lut": torch.rand(3, 4, generator=gen), "v_lut": torch.rand(3, 4, generator=gen),
    }
    fields.update(over)
    return KVQuantState(**fields)


def test_kvquant_state_file_round_trip(tmp_path):
    state = make_state()
    state.save(tmp_path / "s.safetensors")
    again = KVQuantState.load(tmp_path / "s.safetensors")
    assert again.meta == state.meta and again.id == state.id and state.id.startswith("kvqstate-")
    for name in ("k_upper", "k_lower", "k_lut", "v_lut"):
        assert torch.equal(getattr(again, name), getattr(state, name))
    assert make_state(v_lut=state.v_lut + 1).id != state.id


def test_kvquant_state_validation():
    state = make_state()
    state.validate_for(SPEC)
    with pytest.raises(ArtifactMismatch, match="^weights_fingerprint"):
        state.validate_for(dataclasses.replace(SPEC, fingerprint="00" * 32))
    with pytest.raises(ArtifactMismatch, match="^num_layers"):
        state.validate_for(dataclasses.replace(SPEC, num_layers=4))
    with pytest.raises(ArtifactMismatch, match="^channels.*num_kv_heads \\* head_dim = 4 \\* 16 = 64"):
        state.validate_for(dataclasses.replace(SPEC, num_kv_heads=4))
    with pytest.raises(ValueError, match=r"k_lut: expected torch.float32 \[3, 4\]"):
        make_state(k_lut=torch.zeros(3, 16))
    with pytest.raises(ValueError, match="not a KVQuant state file"):
        KVQuantState.from_bytes(b"garbage")
