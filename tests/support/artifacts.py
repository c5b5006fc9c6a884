"""Valid policy tables for a model spec (tests of upload, activation and the export/import command)."""

from __future__ import annotations

from service.artifacts.base import Provenance, default_v_group_size
from service.artifacts.policy import LayerPolicy, PolicyTable
from service.engine.spec import ModelSpec


def policy_for(spec: ModelSpec, cache_mode: str = "dual", bits: int = 4, num_layers: int | None = None,
               fingerprint: str | None = None, p: int = 1) -> PolicyTable:
    """A policy with ``p`` protected K tokens per group on every layer (attention score)."""
    return PolicyTable(
        model_id=spec.model_id,
        weights_fingerprint=fingerprint or spec.fingerprint,
        cache_mode=cache_mode,
        bits=bits,
        k_group_size=32,
        v_group_size=default_v_group_size(spec.head_dim),
        k_bit_cap=16.0,
        layers=[LayerPolicy(score_type="attention", p=p)] * (num_layers or spec.num_layers),
        provenance=Provenance(data="tests", code="tests/support/artifacts.py"),
    )


def kvquant_state_for(spec: ModelSpec, bits: int = 2, num_layers: int | None = None):
    """A small valid KVQuant state (symmetric ranges, evenly spaced codebooks) for ``spec``."""
    import torch

    from service.artifacts.kvquant_state import KVQuantState, KVQuantStateMeta

    layers = num_layers or spec.num_layers
    channels = spec.num_kv_heads * spec.head_dim
    meta = KVQuantStateMeta(model_id=spec.model_id, weights_fingerprint=spec.fingerprint, bits=bits,
                            num_layers=layers, channels=channels,
                            provenance=Provenance(data="tests", code="tests/support/artifacts.py"))
    lut = torch.linspace(-1, 1, 2**bits).repeat(layers, 1)
    return KVQuantState(meta, k_upper=torch.ones(layers, channels, dtype=torch.float16),
                        k_lower=-torch.ones(layers, channels, dtype=torch.float16), k_lut=lut, v_lut=lut.clone())
