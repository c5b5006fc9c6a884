"""The quantizer registry and `make_quantizer`: method name -> quantizer class, with its policy or state checked.

KIVI is the base quantizer's own formats (`service.quant.base`): K per channel over groups of ``k_group_size``
tokens (32 in the paper's adaptation), V per token over groups of ``v_group_size`` channels, residual_length 0.
"""

from __future__ import annotations

from service.artifacts.base import ArtifactMismatch
from service.artifacts.kvquant_state import KVQuantState
from service.artifacts.policy import PolicyTable
from service.engine.spec import ModelSpec
from service.quant.base import KVQuantizer
from service.quant.config import KVQuantConfig
from service.quant.dllm_kvq import DLLMKVQQuantizer
from service.quant.errors import KVQuantError
from service.quant.kvquant import KVQuantQuantizer

QUANTIZERS: dict[str, type[KVQuantizer]] = {
    "kivi": KVQuantizer,
    "kvquant": KVQuantQuantizer,
    "dllm_kvq": DLLMKVQQuantizer,
}


def make_quantizer(
    config: KVQuantConfig,
    spec: ModelSpec,
    policy: PolicyTable | None = None,
    state: KVQuantState | None = None,
) -> KVQuantizer:
    """The quantizer for ``config.method``, its policy table or KVQuant state validated against model and config.

    Raises:
        KVQuantError: the method has no quantizer (legal: kivi, kvquant, dllm_kvq), or its policy/state is missing.
        ArtifactMismatch: the policy/state does not fit the model (fingerprint, layers, channels) or the config
            (``bits``, ``k_group_size``, ``v_group_size``, ``policy_id``, ``kvquant_state_id``); the message names
            the field.
    """
    if config.method not in QUANTIZERS:
        raise KVQuantError(f"method {config.method!r} has no quantizer; legal: {', '.join(QUANTIZERS)}")
    v_group_size = config.resolve_v_group_size(spec.head_dim)
    if config.method == "dllm_kvq":
        if policy is None:
            raise KVQuantError("method 'dllm_kvq' needs a policy table (policy_id or policy_file)")
        policy.validate_for(spec)
        _same("bits", policy.bits, config.bits)
        _same("k_group_size", policy.k_group_size, config.k_group_size)
        _same("v_group_size", policy.v_group_size, v_group_size)
        if config.policy_id is not None:
            _same("policy_id", policy.id, config.policy_id)
        return DLLMKVQQuantizer(config, spec, policy)
    if config.method == "kvquant":
        if state is None:
            raise KVQuantError("method 'kvquant' needs a fitted state (kvquant_state_id or kvquant_state_file)")
        state.validate_for(spec)
        _same("bits", state.bits, config.bits)
        if config.kvquant_state_id is not None:
            _same("kvquant_state_id", state.id, config.kvquant_state_id)
        return KVQuantQuantizer(config, spec, state)
    return QUANTIZERS[config.method](config, spec)


def _same(field: str, artifact_value, config_value) -> None:
    if artifact_value != config_value:
        raise ArtifactMismatch(f"{field}: the artifact has {artifact_value!r}, the configuration asks for {config_value!r}")
