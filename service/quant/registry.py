"""The quantizer registry: the registered plug-ins (`service.quant.plugin.QuantMethod`), one per quantization
method, and the one artifact resolver.

A plug-in is the only place that says what a method needs (`service.quant.plugin`). Everything else asks the
registry: `KVQuantConfig` (legal methods, which need an artifact), `make_quantizer` and `make_kv_store`, the
pooled reads and the fused kernel's shared launches (`service.quant.store`), configured bits
(`service.quant.accounting`), the KV report's artifact fields, the server's resolver
(`service.store.active`, from the store), the admin API, the ``generate`` CLI (its ``--kv-quant`` choices,
artifacts from files), the ``policies`` and ``calibrate`` commands, evaluation (`evaluation.artifacts`, the matrix's
rows and labels), the store's reference check and telemetry's labels.

The built-in plug-ins are declared beside their quantizers (`service.quant.kivi`, `service.quant.kvquant`,
`service.quant.dllm_kvq`) and registered at the first look into the table (`_table`: they import torch, and
`KVQuantConfig`, which every command's ``--help`` imports, imports this module). The configuration is read
through the quantizers' `QuantSettings` interface, so this module imports no configuration.
Adding a method: docs/extending.md, "Adding a quantizer".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.artifacts.base import Artifact, ArtifactMismatch
from service.quant.errors import KVQuantError
from service.quant.plugin import REFERENCE_FIELDS, CalibrationStep, PooledReader, QuantMethod, code_bits, same

if TYPE_CHECKING:
    from service.engine.spec import ModelSpec
    from service.quant.base import KVQuantizer, QuantSettings

__all__ = ["REFERENCE_FIELDS", "Artifact", "ArtifactMismatch", "CalibrationStep", "PooledReader", "QuantMethod",
           "code_bits", "same"]

_METHODS: dict[str, QuantMethod] = {}
_BUILT_IN_LOADED = False


def _table() -> dict[str, QuantMethod]:
    """The registered plug-ins; the built-in ones are registered at the first look, not at import: they import the
    quantizers, so torch, and `KVQuantConfig` (every command's ``--help``) imports this module."""
    global _BUILT_IN_LOADED
    if not _BUILT_IN_LOADED:
        _BUILT_IN_LOADED = True
        from service.quant import dllm_kvq, kivi, kvquant

        # Registration order is the order of CLI choices, error messages and the matrix's rows.
        for entry in (QuantMethod("none", quantizer=None, label="Cache only"), kivi.METHOD, kvquant.METHOD,
                      dllm_kvq.METHOD):
            register(entry)
    return _METHODS


#: Names a spelling may not take: the configuration's own fields (`reserve`).
_RESERVED: set[str] = set(REFERENCE_FIELDS)


def reserve(names: Iterable[str]) -> None:
    """Names no method's spelling may take (`KVQuantConfig` reserves its fields)."""
    _RESERVED.update(names)


def register(entry: QuantMethod) -> QuantMethod:
    """Add a method (raises ValueError if the name or one of its spellings is taken, or its artifact type is not
    an `Artifact` subclass)."""
    if entry.artifact is not None and not (isinstance(entry.artifact, type) and issubclass(entry.artifact, Artifact)):
        raise ValueError(f"method {entry.name!r}: its artifact type must subclass service.artifacts.base.Artifact")
    taken = spellings()
    clash = [s for s in entry.spellings.values() if s in taken or s in _RESERVED]
    if entry.name in _table() or clash:
        raise ValueError(f"method {entry.name!r} or spellings {clash} already registered")
    if set(entry.spellings) - set(REFERENCE_FIELDS):
        raise ValueError(f"spellings rename only {REFERENCE_FIELDS}, got {sorted(entry.spellings)}")
    _METHODS[entry.name] = entry
    return entry


def unregister(name: str) -> None:
    """Remove a method (tests that register one of their own)."""
    del _table()[name]


def methods(with_artifact: bool = False) -> tuple[str, ...]:
    """Registered method names (only those applying an artifact with ``with_artifact``), in registration order."""
    return tuple(n for n, e in _table().items() if e.artifact is not None or not with_artifact)


def artifact_types() -> dict[str, type]:
    """The artifact types of the registered methods by their admin URL segment (``PLURAL``), e.g.
    ``{"policies": PolicyTable, "kvquant_states": KVQuantState}``."""
    return {e.artifact.PLURAL: e.artifact for e in _table().values() if e.artifact is not None}


def method(name: str) -> QuantMethod:
    """The entry of ``name``.

    Raises:
        KVQuantError: no such method (the message lists the registered ones).
    """
    if name not in _table():
        names = [repr(n) for n in _METHODS]
        raise KVQuantError(f"unknown method {name!r}; input should be {', '.join(names[:-1])} or {names[-1]}")
    return _METHODS[name]


def spellings() -> dict[str, tuple[str, str]]:
    """Every method-specific spelling -> (method, generic field)."""
    return {s: (e.name, g) for e in _table().values() for g, s in e.spellings.items()}


def check_artifact(config: QuantSettings, spec: ModelSpec, artifact: Any, cache_mode: str | None = None) -> None:
    """Check ``artifact`` against the model, the reference in ``config`` and the method's own check.

    Raises:
        ArtifactMismatch: the message starts with the offending field (``weights_fingerprint``, ``layers``,
            ``bits``, ``k_group_size``, ``v_group_size``, ``cache_mode``, ``policy_id`` ...).
        KVQuantError: the V group size does not divide head_dim.
    """
    entry = method(config.method)
    v_group_size = config.resolve_v_group_size(spec.head_dim)
    artifact.validate_for(spec)
    if entry.check is not None:
        entry.check(artifact, config, v_group_size, cache_mode)
    if config.artifact_id is not None:
        same(entry.spelling("artifact_id"), artifact.id, config.artifact_id)


def resolve_artifact(
    config: QuantSettings,
    spec: ModelSpec,
    fetch: Callable[[str, str], bytes] | None = None,
    cache_mode: str | None = None,
    cache: dict[tuple[str, str], Any] | None = None,
) -> Any:
    """The artifact ``config`` references, loaded and checked; None when its method applies none.

    The one resolver: the server passes its store's ``get`` as ``fetch`` (and refuses files before calling),
    the ``generate`` CLI passes nothing (files only), evaluation passes a store's ``get`` when given a store URL.

    Args:
        config: names the artifact by ``artifact_id`` (store) or ``artifact_file`` (path).
        spec: the loaded model.
        fetch: ``fetch(kind, id) -> bytes`` from a store (raises the store's ArtifactNotFound/StoreUnavailable).
        cache_mode: checked against the artifact where known.
        cache: parsed artifacts by (kind, id), filled and reused (ids are content-derived, so never stale).

    Raises:
        KVQuantError: an id without a store, an unreadable or unparsable file (message names the field).
        ValueError: stored bytes that are not an artifact of the method's type.
        ArtifactMismatch: see :func:`check_artifact`.
    """
    entry = method(config.method)
    if entry.artifact is None:
        return None
    if config.artifact_id is not None:
        if fetch is None:
            raise KVQuantError(f"{entry.spelling('artifact_id')} {config.artifact_id!r} names a stored artifact; "
                               "give a store to read it from, or the file")
        key = (entry.store_kind, config.artifact_id)
        artifact = cache.get(key) if cache is not None else None
        if artifact is None:
            artifact = entry.artifact.from_bytes(fetch(*key))
            if cache is not None:
                cache[key] = artifact
    else:
        name = entry.spelling("artifact_file")
        try:
            artifact = entry.artifact.from_bytes(Path(config.artifact_file).read_bytes())
        except (OSError, ValueError) as err:
            raise KVQuantError(f"{name} {config.artifact_file!r} cannot be used: {err}", name) from err
    check_artifact(config, spec, artifact, cache_mode)
    return artifact


def make_quantizer(config: QuantSettings, spec: ModelSpec, artifact: Any = None) -> KVQuantizer:
    """The quantizer for ``config.method``, its artifact (if the method applies one) checked first.

    Raises:
        KVQuantError: the method has no quantizer (none) or is unknown (the message lists the legal methods), its
            artifact is missing, or the V group size does not divide head_dim.
        ArtifactMismatch: see :func:`check_artifact`.
    """
    entry = method(config.method)
    if entry.quantizer is None:
        raise KVQuantError(f"method {config.method!r} has no quantizer; legal: {', '.join(methods()[1:])}")
    config.resolve_v_group_size(spec.head_dim)
    if entry.artifact is None:
        return entry.quantizer(config, spec)
    if artifact is None:
        raise KVQuantError(f"method {entry.name!r} needs a {entry.artifact.LABEL} "
                           f"({entry.spelling('artifact_id')} or {entry.spelling('artifact_file')})")
    check_artifact(config, spec, artifact)
    return entry.quantizer(config, spec, artifact)


def calibration_steps() -> dict[str, QuantMethod]:
    """The methods with a calibration step, by the step's ``calibrate`` verb."""
    return {e.calibration.verb: e for e in _table().values() if e.calibration is not None}


def report_fields() -> tuple[str, ...]:
    """The names the KV report carries an applied artifact's id under: every registered method's spelling of
    ``artifact_id``, and ``artifact_id`` itself (`service.engine.report.KVReport`)."""
    names = [e.spelling("artifact_id") for e in _table().values() if e.artifact is not None]
    return tuple(dict.fromkeys([*names, "artifact_id"]))

