"""Valid policy tables for a model spec (tests of upload, activation and the export/import command)."""

from __future__ import annotations

from service.artifacts.base import Provenance, default_v_group_size
from service.artifacts.policy import LayerPolicy, PolicyTable
from service.engine.spec import ModelSpec


def policy_for(spec: ModelSpec, cache_mode: str = "dual", bits: int = 4, num_layers: int | None = None,
               fingerprint: str | None = None, p: int = 1, score_type: str = "attention",
               k_group_size: int = 32) -> PolicyTable:
    """A policy with ``p`` protected K tokens per group of ``k_group_size`` on every layer, ranked by
    ``score_type``."""
    return PolicyTable(
        model_id=spec.model_id,
        weights_fingerprint=fingerprint or spec.fingerprint,
        cache_mode=cache_mode,
        bits=bits,
        k_group_size=k_group_size,
        v_group_size=default_v_group_size(spec.head_dim),
        k_bit_cap=16.0,
        layers=[LayerPolicy(score_type=score_type, p=p)] * (num_layers or spec.num_layers),
        provenance=Provenance(data="tests", code="tests/support/artifacts.py"),
    )


def kvquant_state_for(spec: ModelSpec, bits: int = 2, num_layers: int | None = None, k_range: float = 1.0):
    """A small valid KVQuant state (symmetric key ranges ``+-k_range``, evenly spaced codebooks) for ``spec``."""
    import torch

    from service.artifacts.kvquant_state import KVQuantState, KVQuantStateMeta

    layers = num_layers or spec.num_layers
    channels = spec.num_kv_heads * spec.head_dim
    meta = KVQuantStateMeta(model_id=spec.model_id, weights_fingerprint=spec.fingerprint, bits=bits,
                            num_layers=layers, channels=channels,
                            provenance=Provenance(data="tests", code="tests/support/artifacts.py"))
    lut = torch.linspace(-1, 1, 2**bits).repeat(layers, 1)
    return KVQuantState(meta, k_upper=torch.full((layers, channels), k_range, dtype=torch.float16),
                        k_lower=torch.full((layers, channels), -k_range, dtype=torch.float16), k_lut=lut,
                        v_lut=lut.clone())
