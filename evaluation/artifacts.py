"""Load the fitted artifact a `KVQuantConfig` names, from a file or a store, validated for a model."""

from __future__ import annotations

from typing import Any

from service.config import default_store
from service.engine.spec import ModelSpec
from service.quant.config import KVQuantConfig
from service.quant.registry import resolve_artifact
from service.store.base import open_store


def load_artifact(config: KVQuantConfig, spec: ModelSpec, store_url: str | None,
                  cache_mode: str | None = None) -> Any:
    """The artifact ``config`` names (policy table, KVQuant state ...), or None when its method applies none.

    The registry's one resolver (`service.quant.registry.resolve_artifact`) with a store opened for the call.

    Args:
        config: names the artifact by id (``policy_id``, ``kvquant_state_id``, ``artifact_id``) or file.
        spec: the loaded model; the artifact is checked against it and against ``config``.
        store_url: store for ids (``redis://...`` or a directory); None: the default store
            (`service.config.default_store`).
        cache_mode: the cache mode it will serve, checked against the artifact's (None: not checked).

    Raises:
        service.store.base.ArtifactNotFound: no artifact with that id.
        service.artifacts.base.ArtifactMismatch: the artifact was fitted on another model or has the wrong shape.
        service.quant.errors.KVQuantError: an unreadable or unparsable file.
    """
    if config.artifact_id is None:
        return resolve_artifact(config, spec, cache_mode=cache_mode)
    store = open_store(*default_store(store_url))
    try:
        return resolve_artifact(config, spec, store.get, cache_mode=cache_mode)
    finally:
        store.close()
