"""The one check of a `KVQuantConfig` against a loaded model and the artifacts a store holds: every way of making
a configuration active (the admin route, `Store.set_active` from Python, a replica writing back a lost entry)
and every request naming its own configuration pass through :func:`check_config` (issue 17: the store refuses
to activate what does not resolve and validate against the model, whatever the entry point).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from service.artifacts.base import ArtifactMismatch, legal_v_group_sizes
from service.engine.families import MODEL_CLASSES, capabilities_of
from service.engine.params import CacheMode
from service.engine.spec import ModelSpec
from service.quant.canvas import check_scores
from service.quant.config import KVQuantConfig
from service.quant.errors import KVQuantError
from service.quant.registry import make_quantizer, method, resolve_artifact, spellings


class ConfigInvalid(ValueError):
    """A configuration that cannot be used with the loaded model; ``field`` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class ArtifactUnfit(ConfigInvalid):
    """The stored artifact a configuration names does not fit it or the loaded model (another model, layer
    count, cache mode or bits), or is not an artifact of the method's type: the artifact is rejected (HTTP 422,
    on a request and on an activation alike), where other `ConfigInvalid` errors are bad input (400)."""


def check_config(
    config: KVQuantConfig,
    cache_mode: CacheMode,
    spec: ModelSpec,
    fetch: Callable[[str, str], bytes],
    cache: dict[tuple[str, str], Any] | None = None,
) -> Any:
    """Check ``config`` for ``cache_mode`` on the model ``spec`` describes and load the artifact it names.

    Args:
        fetch: ``fetch(kind, id) -> bytes`` of the store the artifact is read from (a store's ``get``).
        cache: parsed artifacts by (kind, id), filled and reused (ids are content-derived, never stale).

    Returns: the loaded artifact (policy table, KVQuant state ...), or None when the method applies none.

    Raises:
        ConfigInvalid: a file path instead of a store id, quantization with cache mode none, a bound the model
            sets (group sizes, for every method; bits); ``field`` is the ``kv_quant.<field>`` a request or an
            activation body names.
        ArtifactUnfit: (a ConfigInvalid) the artifact is for another model, layer count, cache mode or bits, or
            the stored bytes are not an artifact of the method's type.
        service.store.base.ArtifactNotFound: the artifact is not stored (its ``field`` names the id field).
        service.store.base.StoreUnavailable: the store cannot be reached to load it.
    """
    from service.store.base import (  # the store interface imports this module
        ArtifactNotFound,
        InvalidName,
        describe_invalid,
    )

    entry = method(config.method)
    if config.artifact_file is not None:
        raise ConfigInvalid(
            f"kv_quant.{entry.spelling('artifact_file')}", "the server reads fitted artifacts from its store "
            "only: upload it through /admin and name it by id"
        )
    # Group sizes are bounded whatever the method (one bound for the published schema to state, issue 13); the
    # default V group size matters only to a method that quantizes.
    try:
        config.check_bounds(spec.max_length, spec.head_dim, default_v=entry.quantizer is not None)
    except KVQuantError as exc:
        raise ConfigInvalid(f"kv_quant.{exc.field}", str(exc)) from exc
    if entry.quantizer is None:
        return None
    try:
        config.check_cache_mode(cache_mode)
    except KVQuantError as exc:
        raise ConfigInvalid(exc.field or "cache_mode", str(exc)) from exc
    try:
        artifact = resolve_artifact(config, spec, fetch, cache_mode, cache)
    except ArtifactMismatch as exc:
        raise ArtifactUnfit(f"kv_quant.{exc.field}", exc.detail) from exc
    except ArtifactNotFound as exc:
        raise ArtifactNotFound(str(exc), f"kv_quant.{entry.spelling('artifact_id')}", public=exc.public) from exc
    except (KVQuantError, InvalidName) as exc:  # an id no store can hold (bad input, 400)
        raise ConfigInvalid(f"kv_quant.{entry.spelling('artifact_id')}", str(exc)) from exc
    except ValidationError as exc:  # stored bytes that are not an artifact of the method's type (rejected, 422)
        # pydantic's own message quotes the input: the stored bytes must not reach the answer (issue 22).
        raise ArtifactUnfit(f"kv_quant.{entry.spelling('artifact_id')}", "the stored artifact is not a valid "
                            f"{entry.store_kind} ({describe_invalid(exc)})") from exc
    except ValueError as exc:
        raise ArtifactUnfit(f"kv_quant.{entry.spelling('artifact_id')}", str(exc)) from exc
    if spec.arch in MODEL_CLASSES and capabilities_of(spec.arch).mask_kind == "renoising":
        # A renoising family's committed K/V are written before the queries that would rank them exist
        # (`service.quant.canvas`): refused here, at a swap or on the request, rather than by each request's cache.
        try:
            check_scores(make_quantizer(config, spec, artifact))
        except KVQuantError as exc:
            field = exc.field if exc.field == "key_bias_correction" else entry.spelling("artifact_id")
            raise ConfigInvalid(f"kv_quant.{field}", str(exc)) from exc
    return artifact


def schema_constraints(spec: ModelSpec) -> dict[str, Any]:
    """What :func:`check_config` and the store refuse beyond `KVQuantConfig`'s own validation, as JSON Schema
    constraints on a configuration object for the model ``spec`` describes (the published document states them,
    issue 13): no file references, ids the store accepts, a K group within the context, a given V group size that
    divides head_dim. Quantization with cache mode none (a rule across the request, or against the activation's
    path) and artifacts that do not fit the model are left to the callers' rules and descriptions."""
    from service.store.base import ID_PATTERN  # the store interface imports this module

    names = [("artifact_id", "artifact_id"), ("artifact_file", "artifact_file")]
    names += [(spelling, generic) for spelling, (_, generic) in spellings().items()]
    properties: dict[str, Any] = {
        name: ({"type": "null"} if generic == "artifact_file"
               else {"anyOf": [{"type": "string", "pattern": ID_PATTERN}, {"type": "null"}]})
        for name, generic in names
    }
    properties["k_group_size"] = {"maximum": spec.max_length}
    properties["v_group_size"] = {"anyOf": [{"enum": legal_v_group_sizes(spec.head_dim)}, {"type": "null"}]}
    return {"properties": properties}
