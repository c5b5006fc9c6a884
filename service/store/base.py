"""The store interface for calibration artifacts and the server's active configuration, and `open_store`.

Two backends implement :class:`Store` with the same behaviour: Redis through redis-py
(`service.store.redis_store`) and a local directory (`service.store.dir_store`, the embedded default). A store
URL picks the backend: ``redis://...`` / ``rediss://...`` / ``unix://...`` for Redis, ``file://...`` or a plain
path for a directory; any other scheme is refused (:func:`check_store_url`).

What a store holds
------------------

* **Artifacts**: immutable byte strings by ``(kind, id)``. The kind is a short name (:data:`KINDS` lists the ones
  the project uses: policy tables, KVQuant states, TRACE trajectories, calibration sums, evaluation scores ...; any
  name matching ``[a-z][a-z0-9_]*`` is accepted so the calibration job can add its own). The id is derived from
  the content: either the artifact's own content-derived id (a policy table's ``id``) or, when the caller gives
  none, ``sha256-<hex of the bytes>``. Writing the same id twice with the same bytes is a no-op; with other bytes
  it raises :class:`ArtifactConflict` (ids never change meaning). Deleting an artifact that an active
  configuration names raises :class:`ArtifactInUse`.
* **Active configurations**: one `KVQuantConfig` per ``(model fingerprint, cache mode)``. :meth:`Store.set_active`
  is one atomic write that also appends an audit entry and publishes an :class:`ActiveChange` event (Redis
  pub/sub; the directory backend is polled), so every replica can act on it (DESIGN.md flow 3). It takes the
  model's `ModelSpec` and refuses (:class:`ConfigInvalid`, :class:`ArtifactNotFound`) a configuration that does
  not resolve and validate against that model.
* **Version**: a number that only grows, raised by every activation and every deletion in the same atomic
  write; entries, audit entries and events carry it, so a replica that missed anything (an event lost in an
  outage, a poll that came late) sees a gap and reloads (:meth:`Store.version`, issue 22).
* **Audit log**: every change of an active configuration: when, old, new, by which key id (newest
  :data:`AUDIT_KEEP` kept).

Key layout (Redis; ``P`` is the key prefix, default ``dllm-kvq``)::

    P:artifact:<kind>:<id>        string   the artifact's bytes (immutable)
    P:index:<kind>                zset     ids of that kind, scored by creation time (unix seconds)
    P:active                      hash     field "<fingerprint>:<cache_mode>" -> ActiveEntry JSON
    P:audit                       list     AuditEntry JSON, newest first (trimmed to the newest 10,000)
    P:version                     string   the store's version (an integer; absent: 0)
    P:events                      channel  ActiveChange JSON, published in the same transaction as the write

Directory layout (root ``R``)::

    R/artifacts/<kind>/<id>             the artifact's bytes (written to a temp file, then hard-linked)
    R/active.json                       {version, entries, audit}: every active entry and the audit log in one
                                        file, replaced whole (temp file + rename), so both change together
    R/.lock                             flock taken by every read-check-write (activate, delete)
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args
from urllib.parse import parse_qsl, urlencode, urlsplit

from pydantic import BaseModel, ValidationError

from service.artifacts.base import canonical_json
from service.artifacts.kvquant_state import KVQuantState
from service.artifacts.policy import PolicyTable
from service.engine.errors import validation_message
from service.engine.params import CacheMode, ConfiguredCacheMode
from service.engine.spec import ModelSpec
from service.quant.config import KVQuantConfig
from service.quant.registry import method
from service.store.config_check import ArtifactUnfit, ConfigInvalid, check_config

#: Artifact kinds the project uses (others matching ``[a-z][a-z0-9_]*`` are accepted too).
KIND_POLICY = PolicyTable.KIND
KIND_KVQUANT_STATE = KVQuantState.KIND
KIND_TRAJECTORY = "trajectory"
KIND_CALIBRATION_SUMS = "calibration_sums"
KIND_EVAL_SCORES = "eval_scores"
KINDS = (KIND_POLICY, KIND_KVQUANT_STATE, KIND_TRAJECTORY, KIND_CALIBRATION_SUMS, KIND_EVAL_SCORES)

#: The cache modes that hold an active configuration (`service.engine.params.ConfiguredCacheMode`): what each
#: family's declared modes run with (`service.engine.models.DiffusionLM.cache_modes`).
CACHE_MODES: tuple[str, ...] = get_args(ConfiguredCacheMode)

#: Audit entries kept by either backend (the newest; older ones are dropped in the write that adds one).
AUDIT_KEEP = 10_000

_KIND_RE = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
# Ids become file names and key parts: no path separators, no leading dot, no colon. Matched whole (fullmatch:
# "$" alone would also take a trailing newline); ID_PATTERN is also the published schema's pattern.
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$"
_ID_RE = re.compile(ID_PATTERN)
_FINGERPRINT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

M = TypeVar("M", bound=BaseModel)


class StoreError(Exception):
    """Base of every store error."""


class EntryUnreadable(StoreError, ValueError):
    """A stored active entry that does not parse (written past the store's checks, or corrupted)."""


class InvalidName(StoreError, ValueError):
    """A kind, id, fingerprint or cache mode that cannot be used (the message says what is legal)."""


class AmbiguousId(InvalidName):
    """An abbreviated id that starts more than one stored id; the message lists them."""


#: Candidates an ambiguous id's message lists at most.
AMBIGUOUS_SHOWN = 10


def ids_matching(stored: list[str], typed: str) -> list[str]:
    """The stored ids a typed id names, as ``git`` and ``docker`` read an abbreviated id: itself when stored, else
    every stored id it starts (sorted); none for an empty string."""
    if typed in stored:
        return [typed]
    return sorted(i for i in stored if typed and i.startswith(typed))


def ambiguous_id(what: str, typed: str, candidates: list[str]) -> AmbiguousId:
    """The error for an id prefix that starts several ids, listing them (at most ``AMBIGUOUS_SHOWN``)."""
    shown = ", ".join(candidates[:AMBIGUOUS_SHOWN])
    more = f" and {len(candidates) - AMBIGUOUS_SHOWN} more" if len(candidates) > AMBIGUOUS_SHOWN else ""
    return AmbiguousId(f"{what} id {typed!r} is ambiguous: it starts {len(candidates)} ids ({shown}{more}); type "
                       "more of it")


class ArtifactNotFound(StoreError, KeyError):
    """No artifact of that kind and id; ``field`` names the request field that named it, when one did.

    The message names the store (for operators: admin routes, commands, logs); ``public`` says the same without
    where the store is, for answers to any client (a serving route must not tell it a path or a Redis URL).
    """

    def __init__(self, message: str, field: str | None = None, public: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.public = public or message

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class ArtifactConflict(StoreError):
    """An id already holds different bytes (artifacts are immutable)."""


class ArtifactInUse(StoreError):
    """The artifact is named by an active configuration and cannot be deleted."""


class StoreUnavailable(StoreError):
    """The backend cannot be reached (Redis down) or refused a write (disk full, read-only, Redis ``maxmemory``);
    nothing was changed, the caller keeps what it last loaded and may retry after ``retry_after_s`` seconds."""

    retry_after_s: int = 5


class StoreAccessDenied(StoreError):
    """The backend answers but refuses these credentials or this user (Redis ``WRONGPASS``/``NOAUTH``/``NOPERM``,
    a store directory this process may not read): not an outage to wait out, a setting to fix. A server does not
    start with it, and turns not ready when it appears later."""


class ArtifactInfo(BaseModel):
    """One stored artifact: kind, id, size in bytes, creation time (unix seconds)."""

    kind: str
    id: str
    size: int
    created_at: float


class ActiveEntry(BaseModel):
    """The active configuration of one (model fingerprint, cache mode), with when and by whom it was set, and the
    store version its write made (0: written before versions existed)."""

    fingerprint: str
    cache_mode: CacheMode
    config: KVQuantConfig
    set_at: float
    key_id: str | None = None
    version: int = 0


class AuditEntry(BaseModel):
    """One change of an active configuration; ``old`` is None for the first setting; ``version`` is the store
    version the change made."""

    at: float
    fingerprint: str
    cache_mode: CacheMode
    old: KVQuantConfig | None
    new: KVQuantConfig
    key_id: str | None = None
    version: int = 0


class ActiveChange(BaseModel):
    """The event published with every change of the store's version: ``active_changed`` (``entry`` is the audit
    entry) or ``artifact_deleted`` (``kind`` and ``id``). ``version`` is the version the change made: a listener
    whose last version is not ``version - 1`` missed something and reloads."""

    event: Literal["active_changed", "artifact_deleted"] = "active_changed"
    version: int = 0
    entry: AuditEntry | None = None
    kind: str | None = None
    id: str | None = None


@dataclass
class ActiveState:
    """What a store holds for one model at one version: the entry per cache mode, and why each cache mode whose
    entry is stored but cannot be read (not JSON, not a configuration) is unusable."""

    version: int
    entries: dict[str, ActiveEntry] = field(default_factory=dict)
    unreadable: dict[str, str] = field(default_factory=dict)


class Subscription:
    """A running event listener; :meth:`close` stops it. Backends subclass it."""

    def close(self) -> None:
        """Stop delivering events (idempotent)."""


def describe_invalid(exc: ValidationError) -> str:
    """The first error of a failed validation as ``<field>: <message>``, without the input (stored or uploaded
    bytes are never echoed back)."""
    errors = exc.errors(include_url=False, include_input=False, include_context=False)
    if not errors:
        return "invalid"
    loc = ".".join(str(p) for p in errors[0]["loc"])
    return f"{loc}: {validation_message(errors[0])}" if loc else validation_message(errors[0])


def check_kind(kind: str) -> str:
    """Return ``kind`` or raise :class:`InvalidName` (legal: ``[a-z][a-z0-9_]{0,63}``, e.g. one of KINDS)."""
    if not isinstance(kind, str) or not _KIND_RE.fullmatch(kind):
        raise InvalidName(f"kind {kind!r} is not legal: use [a-z][a-z0-9_]* such as {', '.join(KINDS)}")
    return kind


def check_id(artifact_id: str) -> str:
    """Return ``artifact_id`` or raise :class:`InvalidName` (legal: ``[A-Za-z0-9][A-Za-z0-9._-]{0,199}``)."""
    if not isinstance(artifact_id, str) or not _ID_RE.fullmatch(artifact_id):
        raise InvalidName(f"id {artifact_id!r} is not legal: use [A-Za-z0-9][A-Za-z0-9._-]*, at most 200 chars")
    return artifact_id


def check_target(fingerprint: str, cache_mode: str) -> None:
    """Raise :class:`InvalidName` unless ``fingerprint`` is a plain token and ``cache_mode`` one of CACHE_MODES."""
    if not isinstance(fingerprint, str) or not _FINGERPRINT_RE.fullmatch(fingerprint):
        raise InvalidName(f"fingerprint {fingerprint!r} is not legal: use [A-Za-z0-9][A-Za-z0-9._-]*")
    if cache_mode not in CACHE_MODES:
        raise InvalidName(f"cache_mode {cache_mode!r} is not legal: use one of {', '.join(CACHE_MODES)}")


def content_id(data: bytes) -> str:
    """The default content-derived id: ``sha256-`` + hex SHA-256 of the bytes."""
    return "sha256-" + hashlib.sha256(data).hexdigest()


def referenced_ids(config: KVQuantConfig) -> set[tuple[str, str]]:
    """The (kind, id) artifacts an active configuration depends on (the method's registry entry gives the kind)."""
    entry = method(config.method)
    return {(entry.store_kind, config.artifact_id)} if entry.artifact is not None and config.artifact_id else set()


class Store(ABC):
    """Artifacts by (kind, id), the active configuration per (fingerprint, cache mode), the audit log, events.

    Every method may raise :class:`StoreUnavailable` when the backend cannot be reached.
    """

    url: str

    @property
    def location(self) -> str:
        """Where the store is, for messages and logs (never a user name or password: :func:`redact_url`)."""
        return redact_url(self.url)

    def not_found(self, kind: str, artifact_id: str) -> ArtifactNotFound:
        """The error for an artifact that is not stored, naming the store it was looked for in."""
        return ArtifactNotFound(f"no {kind} with id {artifact_id!r} in the store {self.location}",
                                public=f"no {kind} with id {artifact_id!r} in the store")

    # ---- artifacts -------------------------------------------------------------------------------------------
    @abstractmethod
    def _put(self, kind: str, artifact_id: str, data: bytes) -> bool:
        """Store if absent; True if written, False if the same bytes were there; ArtifactConflict otherwise."""

    @abstractmethod
    def get(self, kind: str, artifact_id: str) -> bytes:
        """The artifact's bytes; raises :class:`ArtifactNotFound`."""

    @abstractmethod
    def info(self, kind: str, artifact_id: str) -> ArtifactInfo:
        """Size and creation time; raises :class:`ArtifactNotFound`."""

    @abstractmethod
    def list(self, kind: str) -> list[str]:
        """Ids of that kind, oldest first."""

    @abstractmethod
    def kinds(self) -> list[str]:
        """Kinds that hold at least one artifact, sorted."""

    @abstractmethod
    def delete(self, kind: str, artifact_id: str) -> None:
        """Remove an artifact; :class:`ArtifactInUse` if an active configuration names it, else
        :class:`ArtifactNotFound` if absent."""

    def put(self, kind: str, data: bytes, artifact_id: str | None = None) -> str:
        """Store immutable bytes and return their id (``content_id(data)`` when none is given).

        Raises :class:`ArtifactConflict` when the id already holds other bytes, :class:`InvalidName`.
        """
        check_kind(kind)
        if not isinstance(data, bytes | bytearray):
            raise TypeError(f"data must be bytes, got {type(data).__name__}")
        artifact_id = check_id(artifact_id if artifact_id is not None else content_id(bytes(data)))
        self._put(kind, artifact_id, bytes(data))
        return artifact_id

    def resolve_id(self, kind: str, artifact_id: str) -> str:
        """The full id that ``artifact_id`` names: itself when stored, else the one stored id it starts (an
        abbreviated id, as ``git`` takes one).

        Raises: :class:`ArtifactNotFound` (no id matches), :class:`AmbiguousId` listing the candidates,
        :class:`InvalidName` (an illegal kind or id)."""
        check_kind(kind)
        check_id(artifact_id)
        if self.exists(kind, artifact_id):
            return artifact_id
        found = ids_matching(self.list(kind), artifact_id)
        if not found:
            raise self.not_found(kind, artifact_id)
        if len(found) > 1:
            raise ambiguous_id(kind, artifact_id, found)
        return found[0]

    def exists(self, kind: str, artifact_id: str) -> bool:
        """Whether the artifact is stored."""
        try:
            self.info(kind, artifact_id)
        except ArtifactNotFound:
            return False
        return True

    def put_json(self, kind: str, obj: Any, artifact_id: str | None = None) -> str:
        """Store a JSON-able object as canonical JSON (see :func:`canonical_json`); returns the id."""
        return self.put(kind, canonical_json(obj), artifact_id)

    def get_json(self, kind: str, artifact_id: str) -> Any:
        """Load an artifact stored with :meth:`put_json`."""
        return json.loads(self.get(kind, artifact_id))

    def put_model(self, kind: str, model: BaseModel) -> str:
        """Store a validated pydantic artifact (a policy table, a state's metadata ...) as canonical JSON.

        Its id is the model's own content-derived ``id`` attribute when it has one (policy tables and KVQuant
        states do), otherwise the content hash.
        """
        own_id = getattr(model, "id", None)
        return self.put_json(kind, model.model_dump(mode="json"), own_id if isinstance(own_id, str) else None)

    def get_model(self, kind: str, artifact_id: str, cls: type[M]) -> M:
        """Load and validate an artifact as ``cls`` (pydantic ValidationError if it does not fit)."""
        return cls.model_validate_json(self.get(kind, artifact_id))

    # ---- active configuration --------------------------------------------------------------------------------
    @abstractmethod
    def _active_raw(self) -> tuple[int, dict[str, bytes]]:
        """The store's version and every stored active entry as raw JSON by ``"<fingerprint>:<cache_mode>"``, read
        together (one snapshot)."""

    @abstractmethod
    def version(self) -> int:
        """The store's version: raised by every activation and deletion, never lowered (0 before the first)."""

    def active_state(self, fingerprint: str) -> ActiveState:
        """The version and the entries of one model, read together; an entry that is stored but does not parse is
        listed in ``unreadable`` with why (never with its bytes)."""
        version, raw = self._active_raw()
        state = ActiveState(version)
        for key, data in raw.items():
            entry_fp, _, mode = key.rpartition(":")
            if entry_fp != fingerprint:
                continue
            try:
                state.entries[mode] = ActiveEntry.model_validate_json(data)
            except ValidationError as exc:
                state.unreadable[mode] = f"the stored entry is not an active configuration ({describe_invalid(exc)})"
        return state

    def get_active(self, fingerprint: str, cache_mode: str) -> ActiveEntry | None:
        """The active configuration of (fingerprint, cache mode), or None if never set.

        Raises: EntryUnreadable when the stored entry does not parse.
        """
        check_target(fingerprint, cache_mode)
        state = self.active_state(fingerprint)
        if cache_mode in state.unreadable:
            raise EntryUnreadable(f"cache mode {cache_mode}: {state.unreadable[cache_mode]}")
        return state.entries.get(cache_mode)

    def list_active(self) -> list[ActiveEntry]:
        """Every readable active configuration, sorted by (fingerprint, cache mode) (unreadable ones are left out:
        :meth:`active_state` names them)."""
        entries = []
        for data in self._active_raw()[1].values():
            try:
                entries.append(ActiveEntry.model_validate_json(data))
            except ValidationError:
                continue
        return sorted(entries, key=lambda e: (e.fingerprint, e.cache_mode))

    @abstractmethod
    def _swap_active(self, entry: ActiveEntry, only_if_absent: bool = False) -> AuditEntry | None:
        """Atomically: check referenced artifacts exist, replace the entry, append audit, raise the version,
        publish; the entry and the audit entry carry the new version.

        With ``only_if_absent``, nothing is written and None returned when an entry is already there.
        """

    def set_active(
        self, spec: ModelSpec, cache_mode: str, config: KVQuantConfig, key_id: str | None = None
    ) -> AuditEntry:
        """Make ``config`` the active configuration of (``spec.fingerprint``, cache mode) in one atomic write.

        The configuration is checked against the model ``spec`` describes and the artifact it names is read from
        this store and checked too (`service.store.config_check.check_config`), so that nothing a server cannot
        serve becomes active, whoever writes it.
        Returns the audit entry (old and new) that was also appended and published.

        Raises: ConfigInvalid, ArtifactNotFound, InvalidName (cache mode), StoreUnavailable; nothing is written.
        """
        return self._swap_active(self._checked_entry(spec, cache_mode, config, key_id))

    def restore_active(
        self, spec: ModelSpec, cache_mode: str, config: KVQuantConfig, key_id: str | None = None
    ) -> AuditEntry | None:
        """Like :meth:`set_active`, but only where the store holds no entry (checked in the same atomic step):
        a replica writing back the configuration it serves after the store lost it never overwrites what
        another replica or an operator set meanwhile. Returns None when an entry was there.
        """
        return self._swap_active(self._checked_entry(spec, cache_mode, config, key_id), only_if_absent=True)

    def _checked_entry(self, spec: ModelSpec, cache_mode: str, config: KVQuantConfig, key_id: str | None
                       ) -> ActiveEntry:
        check_target(spec.fingerprint, cache_mode)
        check_config(config, cache_mode, spec, self.get)
        return ActiveEntry(
            fingerprint=spec.fingerprint, cache_mode=cache_mode, config=config, set_at=time.time(), key_id=key_id
        )

    @abstractmethod
    def audit(self, limit: int = 100) -> list[AuditEntry]:
        """The newest ``limit`` audit entries, newest first."""

    # ---- events and health -----------------------------------------------------------------------------------
    @abstractmethod
    def subscribe(
        self, on_change: Callable[[ActiveChange], None], on_reconnect: Callable[[], None] | None = None
    ) -> Subscription:
        """Call ``on_change`` (in a background thread) for every change of an active configuration.

        ``on_reconnect`` is called after the backend comes back from an outage, since events published while
        it was away are lost: the listener should reload what it holds.
        """

    @abstractmethod
    def ping(self) -> None:
        """Return if the backend answers; raise :class:`StoreUnavailable` otherwise."""

    def close(self) -> None:
        """Release connections (idempotent)."""


#: Query parameters of a Redis URL that hold credentials (redis-py reads them as connection arguments).
_SECRET_QUERY = ("password", "username", "user")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
_LOOSE_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*:/*)[^/@]*@")


def redact_url(url: str) -> str:
    """``url`` with its user name and password replaced by ``***`` (in the authority and in ``password=`` /
    ``username=`` query parameters): what every message, log line and command output shows of a store URL.
    ``redis://:s3cret@10.0.0.5:6379/0`` -> ``redis://:***@10.0.0.5:6379/0``; a path is returned as it is."""
    if url.startswith("file:") or not _SCHEME.match(url):
        return url
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<store URL>"
    out = url
    if "@" in parts.netloc:
        userinfo, _, hostport = parts.netloc.rpartition("@")
        user, colon, _password = userinfo.partition(":")
        out = out.replace(parts.netloc, f"{'***' if user else ''}{':***' if colon else ''}@{hostport}", 1)
    elif "@" in url:  # no authority parsed (a mistyped scheme such as redis:/user:pw@host): redact up to the @
        out = _LOOSE_USERINFO.sub(r"\1***@", url)
    if parts.query:
        pairs = parse_qsl(parts.query, keep_blank_values=True)
        query = urlencode([(k, "***" if k.lower() in _SECRET_QUERY else v) for k, v in pairs], safe="*")
        out = out.replace("?" + parts.query, "?" + query, 1)
    return out


def url_secrets(url: str) -> list[str]:
    """The user name and password a URL carries (raw and percent-decoded), for :func:`scrub`."""
    from urllib.parse import unquote

    try:
        parts = urlsplit(url)
    except ValueError:
        return []
    found = []
    userinfo = parts.netloc.rpartition("@")[0] if "@" in parts.netloc else ""
    found += [p for p in userinfo.split(":", 1) if p]
    found += [v for k, v in parse_qsl(parts.query, keep_blank_values=True) if k.lower() in _SECRET_QUERY and v]
    return sorted({s for f in found for s in (f, unquote(f))}, key=len, reverse=True)


def scrub(text: str, url: str) -> str:
    """``text`` (an exception message from a client library) with every credential of ``url`` replaced by ``***``."""
    for secret in url_secrets(url):
        text = text.replace(secret, "***")
    return text


#: URL schemes of the Redis backend (redis-py's); ``file://`` and a plain path (no scheme) name a directory.
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def check_store_url(url: str) -> str:
    """The directory path a store URL names, or ``""`` for a Redis URL.

    Raises:
        InvalidName: an empty URL, or a scheme that is neither Redis's, ``file://`` nor absent (``dir:///x`` or the
            typo ``redis:/host:6379/0`` would otherwise become a local folder named like the URL).
    """
    if url.startswith(REDIS_SCHEMES):
        return ""
    path = url.removeprefix("file://")
    scheme = _SCHEME.match(path)
    if scheme is not None:
        raise InvalidName(f"store URL {redact_url(url)!r}: unknown scheme {scheme.group(0)!r}; use redis://host:port/db, "
                          "rediss://..., unix:///path.sock, file:///path or a plain directory path")
    if not path:
        raise InvalidName("store URL is empty: give redis://host:port/db or a directory path")
    return path


def open_store(url: str, prefix: str = "dllm-kvq") -> Store:
    """Open the store a URL names: ``redis://``, ``rediss://``, ``unix://`` -> Redis; ``file://`` or a plain path
    -> a directory; anything else :class:`InvalidName` (see :func:`check_store_url`).

    ``prefix`` is the Redis key prefix (ignored by the directory backend). Nothing is contacted here: a Redis
    that is down surfaces as :class:`StoreUnavailable` on first use, so a server can start without it.
    """
    path = check_store_url(url)
    if not path:
        from service.store.redis_store import RedisStore

        return RedisStore(url, prefix=prefix)
    from service.store.dir_store import DirectoryStore

    return DirectoryStore(Path(path).expanduser())


__all__ = [
    "CACHE_MODES",
    "KINDS",
    "ActiveChange",
    "ActiveEntry",
    "ActiveState",
    "AmbiguousId",
    "ArtifactConflict",
    "ArtifactInUse",
    "ArtifactInfo",
    "ArtifactNotFound",
    "ArtifactUnfit",
    "AuditEntry",
    "ConfigInvalid",
    "EntryUnreadable",
    "InvalidName",
    "Store",
    "StoreAccessDenied",
    "StoreError",
    "StoreUnavailable",
    "Subscription",
    "ambiguous_id",
    "check_store_url",
    "content_id",
    "ids_matching",
    "open_store",
    "redact_url",
    "referenced_ids",
    "scrub",
]
