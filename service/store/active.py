"""Configuration snapshots: resolving a `KVQuantConfig` against the loaded model and the store, and the server's
active configuration per cache mode, kept in step with the store (DESIGN.md flow 3).

A :class:`ConfigSnapshot` is a validated configuration together with the artifacts it needs (policy table,
KVQuant state), loaded once; a request takes one at admission and keeps it to the end. :class:`ActiveConfigs`
holds the current snapshot of each cache mode. It loads the store's active entries at start, applies every
change event in version order (a gap in the versions, an outage, or a poll that finds the store at another
version reloads everything: replicas converge on the newest version whatever they missed, issue 22), and keeps
serving the last loaded snapshot while the store is unreachable. Credentials the store refuses make the server
not ready (:attr:`ActiveConfigs.store_denied`), never a quiet default.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal, TypeVar

from service.engine.families import capabilities_of
from service.engine.models import configured_cache_mode
from service.engine.params import CacheMode
from service.engine.spec import ModelSpec
from service.quant.accounting import configured_bits
from service.quant.config import KVQuantConfig
from service.store.base import (
    CACHE_MODES,
    ActiveChange,
    ActiveState,
    ArtifactConflict,
    AuditEntry,
    EntryUnreadable,
    Store,
    StoreAccessDenied,
    StoreError,
    StoreUnavailable,
)
from service.store.config_check import ArtifactUnfit, ConfigInvalid, check_config
from service.telemetry import Telemetry

T = TypeVar("T")

log = logging.getLogger(__name__)

Source = Literal["active", "default", "request"]

#: Key id of the audit entry a replica writes when it restores an active configuration the store lost.
RESTORE_KEY_ID = "replica-restore"
#: Parsed artifacts a replica keeps (least recently used dropped first; a request naming one again reloads it).
ARTIFACT_CACHE_SIZE = 64


def public_config(config: KVQuantConfig) -> dict[str, Any]:
    """A configuration as answers to any client show it: a local file path (``policy_file`` ...) is replaced by
    ``"(a file)"``, so that no path of the host reaches an unauthenticated route (issue 22); logs keep it."""
    dumped = config.model_dump(mode="json", exclude_none=True)
    return {k: "(a file)" if k.endswith("_file") else v for k, v in dumped.items()}


class ArtifactCache(OrderedDict):
    """Parsed artifacts by (kind, id), the least recently used dropped beyond ``max_size`` (the ``cache`` of
    `service.store.config_check.check_config`: ``get`` and item assignment; safe across request threads)."""

    def __init__(self, max_size: int = ARTIFACT_CACHE_SIZE) -> None:
        super().__init__()
        self.max_size = max_size
        self._lock = threading.RLock()

    def get(self, key: Any, default: Any = None) -> Any:
        with self._lock:
            if key in self:
                self.move_to_end(key)
                return self[key]
            return default

    def __setitem__(self, key: Any, value: Any) -> None:
        with self._lock:
            super().__setitem__(key, value)
            self.move_to_end(key)
            while len(self) > self.max_size:
                self.popitem(last=False)

    def discard(self, key: Any) -> None:
        """Drop ``key`` if cached."""
        with self._lock:
            self.pop(key, None)

    def keys_now(self) -> list[Any]:
        """The cached keys (a copy)."""
        with self._lock:
            return list(self)


class ConfigUnavailable(RuntimeError):
    """A cache mode whose configuration cannot be served: the store's active entry (or, without one, the
    ``kv_quant`` setting) does not resolve or validate against the loaded model. The mode is not ready until an
    operator activates a configuration that does; the others serve on.

    Attributes: cache_mode; reason (the check's message).
    """

    def __init__(self, cache_mode: str, reason: str) -> None:
        super().__init__(f"cache mode {cache_mode} is not ready: {reason}")
        self.cache_mode = cache_mode
        self.reason = reason


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
        """What a report says about the configuration it ran with: ``configured_bits`` is the configuration's
        nominal K and V bits on full groups (`service.quant.accounting.configured_bits`; absent where none follows
        from it: the unquantized cache, KVQuant)."""
        bits = configured_bits(self.config, self.artifact)
        return {
            "kv_quant": self.config.model_dump(mode="json", exclude_none=True),
            "cache_mode": self.cache_mode,
            "source": self.source,
            "set_at": self.set_at,
            **({"configured_bits": bits} if bits else {}),
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
        self._artifacts = ArtifactCache()

    def forget(self, kind: str, artifact_id: str) -> None:
        """Drop a deleted artifact, so that a request naming it is answered from the store (404), not the cache."""
        self._artifacts.discard((kind, artifact_id))

    def prune(self) -> list[tuple[str, str]]:
        """Drop every cached artifact the store no longer holds (after missed events); returns them.
        Raises StoreUnavailable / StoreAccessDenied."""
        gone = [key for key in self._artifacts.keys_now() if not self.store.exists(*key)]
        for key in gone:
            self.forget(*key)
        return gone

    def resolve(self, config: KVQuantConfig, cache_mode: CacheMode, source: Source, set_at: float | None = None
                ) -> ConfigSnapshot:
        """Check ``config`` for ``cache_mode`` on the loaded model and load what it names.

        Raises: see `service.store.config_check.check_config` (ConfigInvalid, ArtifactNotFound, StoreUnavailable).
        """
        try:
            artifact = check_config(config, cache_mode, self.spec, self.store.get, self._artifacts)
        except ArtifactUnfit as exc:
            # A family whose cache holds committed blocks (LLaDA2) decodes prefix and dual alike, its reused cache
            # the committed blocks: a policy fitted for prefix (what `calibrate` fits for it) fits dual's too.
            committed = capabilities_of(self.spec.arch).cache_kind == "committed"
            if not (cache_mode == "dual" and committed and exc.field == "kv_quant.cache_mode"):
                raise
            artifact = check_config(config, "prefix", self.spec, self.store.get, self._artifacts)
        return ConfigSnapshot(config, cache_mode, source, artifact=artifact, set_at=set_at)


class ActiveConfigs:
    """The current snapshot per cache mode for the loaded model, following the store.

    A cache mode whose configuration cannot be served (the store's active entry or, without one, ``default``
    does not resolve or validate: an entry written past the checks, an artifact the store no longer holds, a
    setting naming an unknown id) is not ready: :meth:`snapshot` raises :class:`ConfigUnavailable` naming why,
    :attr:`not_ready` lists it for ``/health/ready``, and the mode never quietly serves another configuration.

    Args:
        resolver: validates and loads.
        default: the ``kv_quant`` setting, used for ``prefix`` and ``dual`` while the store has no active entry
            (cache mode ``none`` is always unquantized).
        telemetry: shows the active configuration and counts changes.
        model_name: the served model name, for the info metric.
        restore: after an outage, write back (artifacts, entry, audit) an active configuration the store lost
            (the ``store_restore_active`` setting); either way the loss is shown (:attr:`losses`, metric).
    """

    def __init__(self, resolver: ConfigResolver, default: KVQuantConfig, telemetry: Telemetry, model_name: str,
                 restore: bool = True):
        self.resolver = resolver
        self.default = default
        self.telemetry = telemetry
        self.model_name = model_name
        self.restore = restore
        #: The last loss found per cache mode (kept as a record after it is restored).
        self.losses: dict[str, StoreLoss] = {}
        #: Why each cache mode that is not ready is not (see the class doc).
        self.not_ready: dict[str, str] = {}
        #: Why the store refuses this server (credentials): the server is not ready while it is set.
        self.store_denied: str | None = None
        #: The store version this replica has applied (-1: nothing read yet).
        self.version = -1
        self._unreadable: str | None = None  # the damage poll() last found in the store
        self._lock = threading.Lock()
        # Serialises reloads, events and activations, so versions are applied in order.
        self._sync = threading.RLock()
        self._current: dict[str, ConfigSnapshot] = {}
        for mode in CACHE_MODES:
            self._use_default(mode, count=False)

    @property
    def fingerprint(self) -> str:
        """The loaded model's weights fingerprint."""
        return self.resolver.spec.fingerprint

    def snapshot(self, cache_mode: CacheMode) -> ConfigSnapshot:
        """The snapshot a request admitted now runs with; ConfigUnavailable when the mode is not ready. Cache mode
        ``block`` (block-causal families, LLaDA2) runs with ``prefix``'s (`configured_cache_mode`: its committed
        blocks are its reused prefix), and its report's ``kv_config`` says ``prefix``."""
        cache_mode = configured_cache_mode(cache_mode, self.resolver.spec.arch)
        with self._lock:
            reason = self.not_ready.get(cache_mode)
            if reason is not None:
                raise ConfigUnavailable(cache_mode, reason)
            return self._current[cache_mode]

    def all(self) -> dict[str, ConfigSnapshot]:
        """The current snapshot of every ready cache mode."""
        with self._lock:
            return {mode: snap for mode, snap in self._current.items() if mode not in self.not_ready}

    def _install(self, snapshot: ConfigSnapshot, count: bool = True, by: str | None = None) -> None:
        """Serve ``snapshot`` from now on; ``by`` (an admin key id, the key id of a store entry) is logged with
        every change of what is served."""
        mode = snapshot.cache_mode
        with self._lock:
            old = self._current.get(mode)
            self._current[mode] = snapshot
            self.not_ready.pop(mode, None)
        self.telemetry.config_ready.labels(mode).set(1)
        # The nominal K-bit cap an artifact was fitted under (policy tables have one).
        cap = getattr(snapshot.artifact, "k_bit_cap", None)
        self.telemetry.set_active(self.model_name, mode, snapshot.config, snapshot.source, cap,
                                  configured_bits(snapshot.config, snapshot.artifact))
        if count and (old is None or old.config != snapshot.config):
            self.telemetry.config_changes.labels(mode).inc()
            log.info("cache mode %s: active configuration changed by %s: %s -> %s (%s)", mode, by or "store",
                     public_config(old.config) if old else None, public_config(snapshot.config), snapshot.source)

    def _refuse(self, cache_mode: str, what: str, exc: BaseException) -> None:
        """Make ``cache_mode`` not ready: ``what`` cannot be served because of ``exc``. The reason kept (shown by
        /health/ready and every 503 of the mode, to any client) does not say where the store is; the log does."""
        public = getattr(exc, "public", None) or str(exc)
        with self._lock:
            self.not_ready[cache_mode] = f"{what} cannot be served: {public}"
        self.telemetry.config_ready.labels(cache_mode).set(0)
        log.error("cache mode %s is not ready: %s cannot be served: %s", cache_mode, what, exc)

    def _use_default(self, cache_mode: str, count: bool = True) -> None:
        config = self.default if cache_mode != "none" else KVQuantConfig()
        try:
            self._install(self.resolver.resolve(config, cache_mode, "default"), count)
        except (ValueError, KeyError, StoreError) as exc:
            self._refuse(cache_mode, f"the kv_quant setting {public_config(config)}", exc)

    def _read_state(self) -> ActiveState:
        """The store's state for this model, keeping ``dllm_store_up`` and :attr:`store_denied` current.
        Raises StoreUnavailable, StoreAccessDenied, EntryUnreadable (the store's file is damaged)."""
        store = self.resolver.store
        state = self._ask_store(lambda: store.active_state(self.fingerprint))
        if self.store_denied is not None:
            log.warning("the store accepts this server's credentials again")
            self.store_denied = None
        return state

    def _ask_store(self, ask: Callable[[], T]) -> T:
        """The answer of ``ask()``, a call of the store, keeping ``dllm_store_up`` current and noting a refusal of
        this server's credentials (:meth:`deny`). Raises what ``ask`` raised (StoreUnavailable, StoreAccessDenied,
        EntryUnreadable)."""
        try:
            answer = ask()
        except StoreUnavailable:
            self.telemetry.store_up.set(0)
            raise
        except StoreAccessDenied as exc:
            self.telemetry.store_up.set(0)
            self.deny(exc)
            raise
        self.telemetry.store_up.set(1)
        return answer

    def deny(self, exc: BaseException) -> None:
        """The store refused this server's credentials: not ready, saying why (the message has no password)."""
        if self.store_denied is None:
            log.error("not ready: %s", exc)
        self.store_denied = f"the store refuses this server: {exc}"
        self.telemetry.ready.set(0)

    def reload(self) -> None:
        """Load every active entry of this model from the store (start-up, after a store outage, after a gap in
        the versions), and drop cached artifacts the store no longer holds.

        An entry that does not validate, or is stored but cannot be read, makes its cache mode not ready. A cache
        mode served from an active entry that the store no longer holds is a loss (:meth:`_lost`); one with no
        entry and a default that could not be loaded before tries the default again.
        Raises StoreUnavailable if the store cannot be reached, StoreAccessDenied if it refuses this server.
        """
        with self._sync:
            try:
                state = self._read_state()
            except EntryUnreadable as exc:  # reachable, but what it holds cannot be read: no mode is right
                for mode in CACHE_MODES:
                    self._refuse(mode, "the store's active configurations", exc)
                return
            for kind, artifact_id in self.resolver.prune():
                self.telemetry.forget_artifact(artifact_id)
                log.info("dropped %s %s, which the store no longer holds", kind, artifact_id)
            for mode in CACHE_MODES:
                if mode in state.unreadable:
                    self._refuse(mode, "the store's active entry", EntryUnreadable(state.unreadable[mode]))
                    continue
                entry = state.entries.get(mode)
                if entry is None:
                    current = self._current.get(mode)
                    if current is not None and current.source == "active" and mode not in self.not_ready:
                        self._lost(current)
                    elif mode in self.not_ready:
                        self._use_default(mode)
                    continue
                self.telemetry.store_active_lost.labels(mode).set(0)
                self._use_entry(mode, entry.config, entry.set_at, entry.key_id)
            self.version = max(self.version, state.version)

    def poll(self) -> None:
        """Ping the store and reload when its version is not the one applied here (the periodic check of
        `service.store.monitor`: replicas converge whatever events they missed).
        Raises StoreUnavailable, StoreAccessDenied."""
        store = self.resolver.store

        def version() -> int:
            store.ping()
            return store.version()

        try:
            current = self._ask_store(version)
        except EntryUnreadable as exc:
            if self._unreadable != str(exc):  # refuse (and log) once per damage, not every round
                self._unreadable = str(exc)
                self.reload()
            return
        if current != self.version or self.store_denied is not None or self._unreadable is not None:
            self._unreadable = None
            self.reload()

    def _use_entry(self, cache_mode: str, config: KVQuantConfig, set_at: float, by: str | None = None) -> None:
        """Serve the store's active ``config`` for ``cache_mode``, or make the mode not ready if it does not
        validate; an unreachable store keeps what is served (the outage rule)."""
        try:
            self._install(self.resolver.resolve(config, cache_mode, "active", set_at), by=by)
        except StoreUnavailable as exc:
            log.error("could not load the active configuration of %s (%s); serving the previous", cache_mode, exc)
        except (ValueError, KeyError, StoreError) as exc:
            self._refuse(cache_mode, f"the store's active configuration {public_config(config)}", exc)

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
            audit = store.restore_active(self.resolver.spec, mode, snapshot.config, key_id=RESTORE_KEY_ID)
        except (StoreError, ConfigInvalid) as exc:
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
        """Apply a store event (called from the store's listener thread): in version order; an event after a gap
        (this replica missed one) reloads everything."""
        with self._sync:
            if change.version and change.version <= self.version:
                return  # applied already (this replica's own activation, or a reload that read it)
            if change.version and change.version != self.version + 1:  # a gap, or nothing read yet (-1)
                self._reload_quietly(f"at version {self.version}, the store at {change.version}")
                return
            if change.event == "artifact_deleted":
                if change.kind is None or change.id is None:
                    self._reload_quietly("an artifact was deleted")  # the directory store does not say which
                    return
                self.resolver.forget(change.kind, change.id)
                self.telemetry.forget_artifact(change.id)
            elif change.entry is not None and change.entry.fingerprint == self.fingerprint:
                entry = change.entry
                self.telemetry.store_active_lost.labels(entry.cache_mode).set(0)  # the store holds an entry again
                self._use_entry(entry.cache_mode, entry.new, entry.at, entry.key_id)
            self.version = max(self.version, change.version)

    def _reload_quietly(self, why: str) -> None:
        log.info("reloading the active configurations: %s", why)
        try:
            self.reload()
        except (StoreUnavailable, StoreAccessDenied) as exc:
            log.error("could not reload the active configurations: %s", exc)

    def activate(self, cache_mode: CacheMode, config: KVQuantConfig, key_id: str | None) -> AuditEntry:
        """Validate ``config``, make it the store's active configuration (one atomic write + event) and use it
        here at once (so a request admitted after this returns already runs with it).

        Raises: ConfigInvalid, ArtifactNotFound, StoreUnavailable (nothing changed in each case).
        """
        snapshot = self.resolver.resolve(config, cache_mode, "active")
        audit = self.resolver.store.set_active(self.resolver.spec, cache_mode, config, key_id=key_id)
        with self._sync:
            self.telemetry.store_active_lost.labels(cache_mode).set(0)
            self._install(replace(snapshot, set_at=audit.at), by=key_id)
            if audit.version != self.version + 1:  # changes this replica has not applied came first
                self._reload_quietly(f"at version {self.version}, the store at {audit.version}")
            self.version = max(self.version, audit.version)
        return audit
