"""Load the fitted artifact a `KVQuantConfig` names, from a file or a store, validated for a model."""

from __future__ import annotations

from typing import Any

from service.engine.spec import ModelSpec
from service.quant.config import KVQuantConfig
from service.quant.registry import resolve_artifact
from service.store.base import open_store


def load_artifact(config: KVQuantConfig, spec: ModelSpec, store_url: str | None) -> Any:
    """The artifact ``config`` names (policy table, KVQuant state ...), or None when its method applies none.

    The registry's one resolver (`service.quant.registry.resolve_artifact`) with a store opened for the call.

    Args:
        config: names the artifact by id (``policy_id``, ``kvquant_state_id``, ``artifact_id``) or file.
        spec: the loaded model; the artifact is checked against it and against ``config``.
        store_url: store for ids (``redis://...`` or a directory); only needed when an id is given.

    Raises:
        ValueError: an id without a store URL.
        service.store.base.ArtifactNotFound: no artifact with that id.
        service.artifacts.base.ArtifactMismatch: the artifact was fitted on another model or has the wrong shape.
        service.quant.errors.KVQuantError: an unreadable or unparsable file.
    """
    if config.artifact_id is None:
        return resolve_artifact(config, spec)
    if store_url is None:
        raise ValueError("an artifact id (policy_id / kvquant_state_id / artifact_id) needs a store URL "
                         "(store=redis://... or a directory)")
    store = open_store(store_url)
    try:
        return resolve_artifact(config, spec, store.get)
    finally:
        store.close()
