"""Load the policy table or KVQuant state a `KVQuantConfig` names, from a file or a store, validated for a model."""

from __future__ import annotations

from pathlib import Path

from service.artifacts.kvquant_state import KVQuantState
from service.artifacts.policy import PolicyTable
from service.engine.spec import ModelSpec
from service.quant.config import KVQuantConfig
from service.store.base import KIND_KVQUANT_STATE, KIND_POLICY, open_store


def load_artifacts(config: KVQuantConfig, spec: ModelSpec, store_url: str | None
                   ) -> tuple[PolicyTable | None, KVQuantState | None]:
    """(policy table, KVQuant state) for ``config``; each None when the method needs none.

    Args:
        config: names the policy (``policy_id`` / ``policy_file``) or the state (``kvquant_state_id`` /
            ``kvquant_state_file``).
        spec: the loaded model; every artifact is checked with its ``validate_for``.
        store_url: store for ids (``redis://...`` or a directory); only needed when an id is given.

    Raises:
        ValueError: an id without a store URL.
        service.store.base.ArtifactNotFound: no artifact with that id.
        service.artifacts.base.ArtifactMismatch: the artifact was fitted on another model or has the wrong shape.
        OSError: an unreadable file.
    """
    policy = state = None
    if config.policy_id is not None or config.kvquant_state_id is not None:
        if store_url is None:
            raise ValueError("policy_id / kvquant_state_id need a store URL (store=redis://... or a directory)")
        store = open_store(store_url)
        try:
            if config.policy_id is not None:
                policy = store.get_model(KIND_POLICY, config.policy_id, PolicyTable)
            if config.kvquant_state_id is not None:
                state = KVQuantState.from_bytes(store.get(KIND_KVQUANT_STATE, config.kvquant_state_id))
        finally:
            store.close()
    if config.policy_file is not None:
        policy = PolicyTable.from_json(Path(config.policy_file).read_text())
    if config.kvquant_state_file is not None:
        state = KVQuantState.load(config.kvquant_state_file)
    for artifact in (policy, state):
        if artifact is not None:
            artifact.validate_for(spec)
    return policy, state
