"""Valid policy tables for a model spec (tests of upload, activation and the export/import command)."""

from __future__ import annotations

from service.engine.spec import ModelSpec
from service.policy.schema import LayerPolicy, PolicyTable, Provenance


def policy_for(spec: ModelSpec, cache_mode: str = "dual", bits: int = 4, num_layers: int | None = None,
               fingerprint: str | None = None, p: int = 1) -> PolicyTable:
    """A policy with ``p`` protected K tokens per group on every layer (attention score)."""
    return PolicyTable(
        model_id=spec.model_id,
        weights_fingerprint=fingerprint or spec.fingerprint,
        cache_mode=cache_mode,
        bits=bits,
        k_group_size=32,
        v_group_size=min(32, spec.head_dim),
        k_bit_cap=16.0,
        layers=[LayerPolicy(score_type="attention", p=p)] * (num_layers or spec.num_layers),
        provenance=Provenance(data="tests", code="tests/support/artifacts.py"),
    )
