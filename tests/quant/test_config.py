import pytest
from pydantic import ValidationError

from service.quant.config import KVQuantConfig
from service.quant.errors import KVQuantError


def test_bits_and_method_errors_list_legal_values():
    with pytest.raises(ValidationError, match="2, 4 or 8"):
        KVQuantConfig(method="kivi", bits=3)
    with pytest.raises(ValidationError, match="'none', 'kivi', 'kvquant' or 'dllm_kvq'"):
        KVQuantConfig(method="gptq")


def test_kvquant_request_without_a_state_is_refused():
    with pytest.raises(ValidationError, match="'kvquant' needs exactly one of kvquant_state_id or kvquant_state_file"):
        KVQuantConfig(method="kvquant", bits=4)
    with pytest.raises(ValidationError, match="'dllm_kvq' needs exactly one of policy_id or policy_file"):
        KVQuantConfig(method="dllm_kvq", bits=4)
    with pytest.raises(ValidationError, match="needs exactly one"):
        KVQuantConfig(method="dllm_kvq", policy_id="a", policy_file="b.json")
    with pytest.raises(ValidationError, match="policy_file is only used by method 'dllm_kvq', not 'kivi'"):
        KVQuantConfig(method="kivi", policy_file="b.json")
    assert KVQuantConfig(method="kvquant", kvquant_state_file="s.safetensors").artifact_file == "s.safetensors"


def test_v_group_size_default_and_divisibility():
    assert KVQuantConfig().resolve_v_group_size(128) == 32
    assert KVQuantConfig().resolve_v_group_size(16) == 16
    with pytest.raises(KVQuantError, match=r"v_group_size 32 does not divide head_dim 48.*legal: \[1, 2, 3, 4, 6, 8, 12, 16, 24, 48\]"):
        KVQuantConfig(v_group_size=32).resolve_v_group_size(48)
