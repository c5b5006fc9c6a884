"""The quantizer registry: one entry per quantization method, and the one artifact resolver.

An entry (:class:`QuantMethod`) is the only place that says what a method needs: its quantizer class, the type
of fitted artifact it applies (None for none and KIVI), the store kind that artifact is kept under (the artifact
type's ``KIND``), its check of an artifact against a configuration, and the public spellings of the artifact
reference (``policy_id`` ...). Everything else asks the registry: `KVQuantConfig` (legal methods, which need an
artifact), `make_quantizer` and `make_kv_store`, the server's resolver (`service.store.active`, from the store),
the ``generate`` CLI (its ``--kv-quant`` choices, artifacts from files), evaluation (`evaluation.artifacts`), the
store's reference check and telemetry's labels.

KIVI is the base quantizer's own formats (`service.quant.base`): K per channel over groups of ``k_group_size``
tokens (32 in the paper's adaptation), V per token over groups of ``v_group_size`` channels, residual_length 0.
Adding a method: docs/extending.md, "Adding a quantizer".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from service.artifacts.base import ArtifactMismatch
from service.artifacts.kvquant_state import KVQuantState
from service.artifacts.policy import PolicyTable
from service.engine.spec import ModelSpec
from service.quant.base import KVQuantizer
from service.quant.config import KVQuantConfig
from service.quant.dllm_kvq import DLLMKVQQuantizer
from service.quant.errors import KVQuantError
from service.quant.kvquant import KVQuantQuantizer

#: The generic fields of an artifact reference in `KVQuantConfig`.
REFERENCE_FIELDS = ("artifact_id", "artifact_file")


class Artifact(Protocol):
    """What an artifact type offers the registry (`PolicyTable`, `KVQuantState` ...)."""

    KIND: ClassVar[str]  # the store kind it is kept under ([a-z][a-z0-9_]*)
    LABEL: ClassVar[str]  # how messages name it ("policy table")

    @property
    def id(self) -> str: ...  # content-derived

    @property
    def weights_fingerprint(self) -> str: ...  # ModelSpec.fingerprint of the model it was fitted on

    @property
    def bits(self) -> int: ...

    @property
    def cache_mode(self) -> str | None: ...  # the cache mode it was fitted for; None: every mode

    @classmethod
    def from_bytes(cls, data: bytes) -> Artifact: ...  # ValueError if the bytes are not one

    def validate_for(self, spec: ModelSpec) -> None: ...  # ArtifactMismatch naming the field


#: ``check(artifact, config, v_group_size, cache_mode)``: raise `ArtifactMismatch` (message starting with the field
#: name) where the artifact does not fit the configuration; ``cache_mode`` is None where it is not known (CLI).
Check = Callable[[Any, KVQuantConfig, int, "str | None"], None]


@dataclass(frozen=True)
class QuantMethod:
    """One quantization method.

    Attributes:
        name: the ``method`` value (``[a-z][a-z0-9_]*``).
        quantizer: builds the quantizer: ``quantizer(config, spec)``, or ``quantizer(config, spec, artifact)`` when
            ``artifact`` is set; None for the unquantized cache (method none).
        artifact: the fitted artifact type the method applies, or None.
        check: the artifact's check against a configuration (beyond its own ``validate_for`` against the model).
        spellings: public names of the reference fields, e.g. ``{"artifact_id": "policy_id"}``; a name given here
            is accepted on input, written on output and used in messages in place of the generic one.
    """

    name: str
    quantizer: Callable[..., KVQuantizer] | None
    artifact: type | None = None
    check: Check | None = None
    spellings: dict[str, str] = field(default_factory=dict)

    @property
    def store_kind(self) -> str | None:
        """The store kind of the method's artifact (None without one)."""
        return self.artifact.KIND if self.artifact is not None else None

    def spelling(self, generic: str) -> str:
        """The public name of ``artifact_id`` / ``artifact_file`` for this method."""
        return self.spellings.get(generic, generic)


_METHODS: dict[str, QuantMethod] = {}


def register(entry: QuantMethod) -> QuantMethod:
    """Add a method (raises ValueError if the name or one of its spellings is taken)."""
    taken = spellings()
    clash = [s for s in entry.spellings.values() if s in taken or s in KVQuantConfig.model_fields]
    if entry.name in _METHODS or clash:
        raise ValueError(f"method {entry.name!r} or spellings {clash} already registered")
    if set(entry.spellings) - set(REFERENCE_FIELDS):
        raise ValueError(f"spellings rename only {REFERENCE_FIELDS}, got {sorted(entry.spellings)}")
    _METHODS[entry.name] = entry
    return entry


def unregister(name: str) -> None:
    """Remove a method (tests that register one of their own)."""
    del _METHODS[name]


def methods(with_artifact: bool = False) -> tuple[str, ...]:
    """Registered method names (only those applying an artifact with ``with_artifact``), in registration order."""
    return tuple(n for n, e in _METHODS.items() if e.artifact is not None or not with_artifact)


def artifact_types() -> dict[str, type]:
    """The artifact types of the registered methods by their admin URL segment (``PLURAL``), e.g.
    ``{"policies": PolicyTable, "kvquant_states": KVQuantState}``."""
    return {e.artifact.PLURAL: e.artifact for e in _METHODS.values() if e.artifact is not None}


def method(name: str) -> QuantMethod:
    """The entry of ``name``.

    Raises:
        KVQuantError: no such method (the message lists the registered ones).
    """
    if name not in _METHODS:
        names = [repr(n) for n in _METHODS]
        raise KVQuantError(f"unknown method {name!r}; input should be {', '.join(names[:-1])} or {names[-1]}")
    return _METHODS[name]


def spellings() -> dict[str, tuple[str, str]]:
    """Every method-specific spelling -> (method, generic field)."""
    return {s: (e.name, g) for e in _METHODS.values() for g, s in e.spellings.items()}


def check_artifact(config: KVQuantConfig, spec: ModelSpec, artifact: Any, cache_mode: str | None = None) -> None:
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
    config: KVQuantConfig,
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


def make_quantizer(config: KVQuantConfig, spec: ModelSpec, artifact: Any = None) -> KVQuantizer:
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


def same(field_name: str, artifact_value: Any, config_value: Any) -> None:
    """Raise `ArtifactMismatch` (starting with ``field_name``) unless the artifact's value is the config's."""
    if artifact_value != config_value:
        raise ArtifactMismatch(
            field_name, f"the artifact has {artifact_value!r}, the configuration asks for {config_value!r}"
        )


def _check_policy(policy: PolicyTable, config: KVQuantConfig, v_group_size: int, cache_mode: str | None) -> None:
    if cache_mode is not None:
        same("cache_mode", policy.cache_mode, cache_mode)
    same("bits", policy.bits, config.bits)
    same("k_group_size", policy.k_group_size, config.k_group_size)
    same("v_group_size", policy.v_group_size, v_group_size)


def _check_state(state: KVQuantState, config: KVQuantConfig, v_group_size: int, cache_mode: str | None) -> None:
    same("bits", state.bits, config.bits)


# Registration order is the order of CLI choices and error messages.
register(QuantMethod("none", quantizer=None))
register(QuantMethod("kivi", quantizer=KVQuantizer))
register(QuantMethod("kvquant", quantizer=KVQuantQuantizer, artifact=KVQuantState, check=_check_state,
                     spellings={"artifact_id": "kvquant_state_id", "artifact_file": "kvquant_state_file"}))
register(QuantMethod("dllm_kvq", quantizer=DLLMKVQQuantizer, artifact=PolicyTable, check=_check_policy,
                     spellings={"artifact_id": "policy_id", "artifact_file": "policy_file"}))
