"""Configuration snapshots: resolving a `KVQuantConfig` against the loaded model and the store, and the server's
active configuration per cache mode, kept in step with the store (DESIGN.md flow 3).

A :class:`ConfigSnapshot` is a validated configuration together with the artifacts it needs (policy table,
KVQuant state), loaded once; a request takes one at admission and keeps it to the end. :class:`ActiveConfigs`
holds the current snapshot of each cache mode. It loads the store's active entries at start, applies every
change event (and reloads everything after the store comes back from an outage), and keeps serving the last
loaded snapshot while the store is unreachable.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Literal

from service.artifacts.base import ArtifactMismatch, legal_v_group_sizes
from service.engine.params import CacheMode
from service.engine.spec import ModelSpec
from service.quant.config import KVQuantConfig
from service.quant.errors import KVQuantError
from service.quant.registry import method, resolve_artifact, spellings
from service.store.base import (
    CACHE_MODES,
    ID_PATTERN,
    ActiveChange,
    ArtifactConflict,
    ArtifactNotFound,
    AuditEntry,
    Store,
    StoreError,
    StoreUnavailable,
)
from service.telemetry import Telemetry

log = logging.getLogger(__name__)

Source = Literal["active", "default", "request"]

#: Key id of the audit entry a replica writes when it restores an active configuration the store lost.
RESTORE_KEY_ID = "replica-restore"


@dataclass
class StoreLoss:
    """The store came back from an outage without the active configuration this replica serves (a Redis
    restarted empty): when it was found, and whether and when this replica wrote it back.

    Attributes:
        config: the configuration this replica served (and still serves) for the cache mode.
        detected_at: unix seconds.
        restored_at: when this replica wrote it back (None: not written back, see ``note``).
        note: why it was not written back (the setting is off, another writer came first, the write failed).
    """

    config: KVQuantConfig
    detected_at: float
    restored_at: float | None = None
    note: str | None = None

    def describe(self) -> dict[str, Any]:
        """The ``/admin/active`` detail."""
        return {"kv_quant": self.config.model_dump(mode="json", exclude_none=True), "detected_at": self.detected_at,
                "restored_at": self.restored_at, "note": self.note}


class ConfigInvalid(ValueError):
    """A configuration that cannot be used with the loaded model; ``field`` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class ConfigSnapshot:
    """A validated KV quantization configuration for one cache mode, with its loaded artifacts.

    Attributes:
        config: the configuration.
        cache_mode: the cache mode it applies to.
        source: ``active`` (the store's active entry), ``default`` (the ``kv_quant`` setting, the store having
            none), or ``request`` (named by the request itself).
        artifact: the loaded artifact the method applies (policy table, KVQuant state ...), else None.
        set_at: when the active entry was set (unix seconds), if it came from the store.
        origin: for a shadow re-decode, the snapshot the served request used (telemetry labels come from it).
    """

    config: KVQuantConfig
    cache_mode: CacheMode
    source: Source
    artifact: Any = None
    set_at: float | None = None
    origin: ConfigSnapshot | None = None

    def describe(self) -> dict[str, Any]:
        """What a report says about the configuration it ran with."""
        return {
            "kv_quant": self.config.model_dump(mode="json", exclude_none=True),
            "cache_mode": self.cache_mode,
            "source": self.source,
            "set_at": self.set_at,
        }

    def unquantized(self) -> ConfigSnapshot:
        """The same cache mode with the unquantized cache (for the shadow re-decode), remembering ``self``."""
        return ConfigSnapshot(KVQuantConfig(), self.cache_mode, self.source, origin=self)


class ConfigResolver:
    """Validates configurations against the model and loads the artifacts they name from the store (through
    the registry's one resolver, `service.quant.registry.resolve_artifact`; cached: immutable by id)."""

    def __init__(self, store: Store, spec: ModelSpec) -> None:
        self.store = store
        self.spec = spec
        self._artifacts: dict[tuple[str, str], Any] = {}

    def schema_constraints(self) -> dict[str, Any]:
        """What :meth:`resolve` refuses beyond `KVQuantConfig`'s own validation, as JSON Schema constraints on a
        configuration object (the published document states them, issue 13): no file references, ids the store
        accepts, a K group within the context, a given V group size dividing head_dim. Quantization with cache
        mode none and artifacts that do not fit the model are left to the caller's rules and to the store."""
        names = [("artifact_id", "artifact_id"), ("artifact_file", "artifact_file")]
        names += [(spelling, generic) for spelling, (_, generic) in spellings().items()]
        properties: dict[str, Any] = {
            name: ({"type": "null"} if kind == "artifact_file"
                   else {"anyOf": [{"type": "string", "pattern": ID_PATTERN}, {"type": "null"}]})
            for name, kind in names
        }
        properties["k_group_size"] = {"maximum": self.spec.max_length}
        properties["v_group_size"] = {"anyOf": [{"enum": legal_v_group_sizes(self.spec.head_dim)},
                                                {"type": "null"}]}
        return {"properties": properties}

    def resolve(self, config: KVQuantConfig, cache_mode: CacheMode, source: Source, set_at: float | None = None
                ) -> ConfigSnapshot:
        """Check ``config`` for ``cache_mode`` on the loaded model and load what it names.

        Raises:
            ConfigInvalid: a file path instead of a store id, quantization with cache mode none, a V group size
                that does not divide head_dim, an artifact for another model, layer count, cache mode or bits.
            service.store.base.ArtifactNotFound: the artifact is not stored.
            service.store.base.StoreUnavailable: the store cannot be reached to load it.
        """
        entry = method(config.method)
        if config.artifact_file is not None:
            raise ConfigInvalid(
                f"kv_quant.{entry.spelling('artifact_file')}", "the server reads fitted artifacts from its store "
                "only: upload it through /admin and name it by id"
            )
        # Group sizes are bounded whatever the method (one bound for the published schema to state, issue 13);
        # the default V group size matters only to a method that quantizes.
        try:
            config.check_bounds(self.spec.max_length, self.spec.head_dim, default_v=entry.quantizer is not None)
        except KVQuantError as exc:
            raise ConfigInvalid(f"kv_quant.{exc.field}", str(exc)) from exc
        if entry.quantizer is None:
            return ConfigSnapshot(config, cache_mode, source, set_at=set_at)
        try:
            config.check_cache_mode(cache_mode)
        except KVQuantError as exc:
            raise ConfigInvalid(exc.field or "cache_mode", str(exc)) from exc
        try:
            artifact = resolve_artifact(config, self.spec, self.store.get, cache_mode, self._artifacts)
        except ArtifactMismatch as exc:
            raise ConfigInvalid(f"kv_quant.{exc.field}", exc.detail) from exc
        except ArtifactNotFound as exc:
            raise ArtifactNotFound(str(exc), f"kv_quant.{entry.spelling('artifact_id')}") from exc
        return ConfigSnapshot(config, cache_mode, source, artifact=artifact, set_at=set_at)


class ActiveConfigs:
    """The current snapshot per cache mode for the loaded model, following the store.

    Args:
        resolver: validates and loads.
        default: the ``kv_quant`` setting, used for ``prefix`` and ``dual`` while the store has no active entry
            (where it does not validate for a mode, that mode falls back to method none with a warning; cache
            mode ``none`` is always unquantized).
        telemetry: shows the active configuration and counts changes.
        model_name: the served model name, for the info metric.
        restore: after an outage, write back (artifacts, entry, audit) an active configuration the store lost
            (the ``store_restore_active`` setting); either way the loss is shown (:attr:`losses`, metric).
    """

    def __init__(self, resolver: ConfigResolver, default: KVQuantConfig, telemetry: Telemetry, model_name: str,
                 restore: bool = True):
        self.resolver = resolver
        self.telemetry = telemetry
        self.model_name = model_name
        self.restore = restore
        #: The last loss found per cache mode (kept as a record after it is restored).
        self.losses: dict[str, StoreLoss] = {}
        self._lock = threading.Lock()
        self._defaults: dict[str, ConfigSnapshot] = {}
        for mode in CACHE_MODES:
            config = default if mode != "none" else KVQuantConfig()
            try:
                self._defaults[mode] = resolver.resolve(config, mode, "default")
            except (ValueError, KeyError) as exc:
                log.warning("kv_quant setting does not apply to cache mode %s (%s); using none there", mode, exc)
                self._defaults[mode] = resolver.resolve(KVQuantConfig(), mode, "default")
        self._current: dict[str, ConfigSnapshot] = {}
        for mode, snapshot in self._defaults.items():
            self._install(snapshot, count=False)

    @property
    def fingerprint(self) -> str:
        """The loaded model's weights fingerprint."""
        return self.resolver.spec.fingerprint

    def snapshot(self, cache_mode: CacheMode) -> ConfigSnapshot:
        """The snapshot a request admitted now runs with."""
        return self._current[cache_mode]

    def all(self) -> dict[str, ConfigSnapshot]:
        """The current snapshot of every cache mode."""
        return dict(self._current)

    def _install(self, snapshot: ConfigSnapshot, count: bool = True) -> None:
        with self._lock:
            old = self._current.get(snapshot.cache_mode)
            self._current[snapshot.cache_mode] = snapshot
        # The nominal K-bit cap an artifact was fitted under (policy tables have one).
        cap = getattr(snapshot.artifact, "k_bit_cap", None)
        self.telemetry.set_active(self.model_name, snapshot.cache_mode, snapshot.config, snapshot.source, cap)
        if count and (old is None or old.config != snapshot.config):
            self.telemetry.config_changes.labels(snapshot.cache_mode).inc()

    def reload(self) -> None:
        """Load every active entry of this model from the store (start-up, and after a store outage).

        An entry that no longer validates is logged and skipped (the previous snapshot stays). A cache mode
        served from an active entry that the store no longer holds is a loss (:meth:`_lost`).
        Raises StoreUnavailable if the store cannot be reached.
        """
        try:
            entries = {e.cache_mode: e for e in self.resolver.store.list_active() if e.fingerprint == self.fingerprint}
            self.telemetry.store_up.set(1)
        except StoreUnavailable:
            self.telemetry.store_up.set(0)
            raise
        for mode in CACHE_MODES:
            entry = entries.get(mode)
            if entry is None:
                if self._current[mode].source == "active":
                    self._lost(self._current[mode])
                continue
            self.telemetry.store_active_lost.labels(mode).set(0)
            try:
                self._install(self.resolver.resolve(entry.config, mode, "active", entry.set_at))
            except (ValueError, KeyError, StoreUnavailable) as exc:
                log.error("active configuration of %s in the store is unusable (%s); keeping the previous", mode, exc)

    def _lost(self, snapshot: ConfigSnapshot) -> None:
        """The store no longer holds the active entry ``snapshot`` came from: keep serving it, say so, and unless
        configured otherwise write it back (its artifact first: a store restarted empty lost that too)
        with an audit entry, only where no entry has appeared meanwhile, so that every replica converges on it
        (through the event) and a new replica starts with it."""
        mode = snapshot.cache_mode
        loss = StoreLoss(snapshot.config, time.time())
        self.losses[mode] = loss
        self.telemetry.store_active_lost.labels(mode).set(1)
        log.warning("the store no longer holds the active configuration of %s that this replica serves (%s)",
                    mode, snapshot.config.model_dump(mode="json", exclude_none=True))
        if not self.restore:
            loss.note = "not written back: store_restore_active is off"
            return
        store = self.resolver.store
        try:
            artifact = snapshot.artifact
            if artifact is not None:
                try:
                    store.put(artifact.KIND, artifact.to_bytes(), artifact.id)
                except ArtifactConflict:
                    pass  # still stored (bytes written by another tool): the id names the same content
            audit = store.restore_active(self.fingerprint, mode, snapshot.config, key_id=RESTORE_KEY_ID)
        except StoreError as exc:
            loss.note = f"not written back: {exc}"
            log.error("could not write back the active configuration of %s: %s", mode, exc)
            return
        self.telemetry.store_active_lost.labels(mode).set(0)
        if audit is None:
            loss.note = "not written back: another replica or an operator set an entry first"
            return
        loss.restored_at = audit.at
        self.telemetry.store_active_restored.labels(mode).inc()
        log.warning("wrote the active configuration of %s back to the store (audit key id %s)", mode, RESTORE_KEY_ID)

    def on_change(self, change: ActiveChange) -> None:
        """Apply a store event (called from the store's listener thread)."""
        entry = change.entry
        if entry.fingerprint != self.fingerprint:
            return
        self.telemetry.store_active_lost.labels(entry.cache_mode).set(0)  # the store holds an entry again
        current = self._current.get(entry.cache_mode)
        if current is not None and current.set_at is not None and entry.at < current.set_at:
            return  # an older change arriving after a newer one this replica already applied
        try:
            self._install(self.resolver.resolve(entry.new, entry.cache_mode, "active", entry.at))
        except (ValueError, KeyError, StoreUnavailable) as exc:
            log.error("ignoring active configuration change for %s: %s", entry.cache_mode, exc)

    def activate(self, cache_mode: CacheMode, config: KVQuantConfig, key_id: str | None) -> AuditEntry:
        """Validate ``config``, make it the store's active configuration (one atomic write + event) and use it
        here at once (so a request admitted after this returns already runs with it).

        Raises: ConfigInvalid, ArtifactNotFound, StoreUnavailable (nothing changed in each case).
        """
        snapshot = self.resolver.resolve(config, cache_mode, "active")
        audit = self.resolver.store.set_active(self.fingerprint, cache_mode, config, key_id=key_id)
        self.telemetry.store_active_lost.labels(cache_mode).set(0)
        self._install(replace(snapshot, set_at=audit.at))
        return audit
