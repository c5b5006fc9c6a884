"""The Redis backend of :class:`service.store.base.Store` (redis-py). Key layout: see `service.store.base`.

Read-check-write operations (activate, delete) use optimistic transactions: ``WATCH`` the keys they read, then
``MULTI``/``EXEC`` the writes, retrying if another client changed a watched key in between. The event of an
activation is ``PUBLISH``ed inside the same transaction as the write, the audit entry and the raised version, so
a replica never sees an event for a change that did not happen, and never an entry without its audit entry.

Errors: a connection that fails or times out, and a write Redis refuses (``OOM`` under ``maxmemory``,
``READONLY`` replica, ``MISCONF``; the transaction is then discarded whole) raise :class:`StoreUnavailable`;
refused credentials (``WRONGPASS``, ``NOAUTH``, ``NOPERM``) raise :class:`StoreAccessDenied`. Messages name the
store by its redacted URL and never carry a password (`service.store.base.redact_url`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

import redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import (
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    AuthorizationError,
    ExecAbortError,
    NoPermissionError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
    WatchError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from service.store.base import (
    AUDIT_KEEP,
    ActiveChange,
    ActiveEntry,
    ArtifactConflict,
    ArtifactInfo,
    ArtifactInUse,
    ArtifactNotFound,
    AuditEntry,
    Store,
    StoreAccessDenied,
    StoreUnavailable,
    Subscription,
    check_id,
    check_kind,
    redact_url,
    referenced_ids,
    scrub,
)

log = logging.getLogger(__name__)

#: Credentials refused (checked before the connection errors: redis-py's AuthenticationError is one).
_DENIED = (AuthenticationError, AuthorizationError, NoPermissionError, AuthenticationWrongNumberOfArgsError)
#: A write Redis refused as a whole (the transaction was discarded): nothing changed, retry later.
_REFUSED = (OutOfMemoryError, ReadOnlyError, ExecAbortError)


def store_error(exc: BaseException, url: str) -> Exception | None:
    """The store error a redis-py exception means (None: not one of these), its message scrubbed of the URL's
    credentials."""
    where = f"Redis at {redact_url(url)}"
    text = scrub(str(exc), url)
    if isinstance(exc, _DENIED):
        return StoreAccessDenied(f"{where} refused the credentials of the store URL: {text}")
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError, OSError)):
        return StoreUnavailable(f"{where} is unreachable: {text}")
    if isinstance(exc, _REFUSED) or (isinstance(exc, ResponseError) and text.startswith(("MISCONF", "OOM"))):
        return StoreUnavailable(f"{where} refused the write, nothing was changed: {text}")
    return None


@contextlib.contextmanager
def _unavailable_on_connection_error(url: str) -> Iterator[None]:
    """Turn redis-py's connection, timeout, refused-write and credential errors into store errors."""
    try:
        yield
    except (RedisConnectionError, RedisTimeoutError, OSError, ResponseError) as exc:
        mapped = store_error(exc, url)
        if mapped is None:
            raise
        raise mapped from None  # the chained redis-py error would repeat what the message already says


class RedisStore(Store):
    """Artifacts, active configurations, audit log and events in one Redis database under a key prefix."""

    def __init__(self, url: str, prefix: str = "dllm-kvq", socket_timeout_s: float = 2.0) -> None:
        self.url = url
        self.prefix = prefix
        # Few, fast retries: a Redis that is down must turn into a 503 quickly, not hang a request.
        self._client = redis.Redis.from_url(
            url,
            socket_connect_timeout=socket_timeout_s,
            socket_timeout=socket_timeout_s,
            retry=Retry(ExponentialBackoff(cap=0.2, base=0.05), 1),
            health_check_interval=10,
        )

    @property
    def location(self) -> str:
        """The URL without its user name and password, and the key prefix."""
        return f"{redact_url(self.url)} (key prefix {self.prefix})"

    # ---- keys ------------------------------------------------------------------------------------------------
    def _artifact_key(self, kind: str, artifact_id: str) -> str:
        return f"{self.prefix}:artifact:{kind}:{artifact_id}"

    def _index_key(self, kind: str) -> str:
        return f"{self.prefix}:index:{kind}"

    @property
    def _active_key(self) -> str:
        return f"{self.prefix}:active"

    @property
    def _audit_key(self) -> str:
        return f"{self.prefix}:audit"

    @property
    def _version_key(self) -> str:
        return f"{self.prefix}:version"

    @property
    def channel(self) -> str:
        """The pub/sub channel of activation events."""
        return f"{self.prefix}:events"

    @staticmethod
    def _field(fingerprint: str, cache_mode: str) -> str:
        return f"{fingerprint}:{cache_mode}"

    # ---- artifacts -------------------------------------------------------------------------------------------
    def _put(self, kind: str, artifact_id: str, data: bytes) -> bool:
        key = self._artifact_key(kind, artifact_id)
        with _unavailable_on_connection_error(self.url):
            with self._client.pipeline(transaction=True) as pipe:
                pipe.set(key, data, nx=True)
                pipe.zadd(self._index_key(kind), {artifact_id: time.time()}, nx=True)
                written, _ = pipe.execute()
            if written:
                return True
            existing = self._client.get(key)
        if existing != data:
            raise ArtifactConflict(
                f"{kind} {artifact_id!r} is already stored with different content; artifacts are immutable"
            )
        return False

    def get(self, kind: str, artifact_id: str) -> bytes:
        check_kind(kind)
        check_id(artifact_id)
        with _unavailable_on_connection_error(self.url):
            data = self._client.get(self._artifact_key(kind, artifact_id))
        if data is None:
            raise self.not_found(kind, artifact_id)
        return data

    def info(self, kind: str, artifact_id: str) -> ArtifactInfo:
        check_kind(kind)
        check_id(artifact_id)
        with _unavailable_on_connection_error(self.url), self._client.pipeline(transaction=False) as pipe:
            pipe.strlen(self._artifact_key(kind, artifact_id))
            pipe.exists(self._artifact_key(kind, artifact_id))
            pipe.zscore(self._index_key(kind), artifact_id)
            size, exists, created = pipe.execute()
        if not exists:
            raise self.not_found(kind, artifact_id)
        return ArtifactInfo(kind=kind, id=artifact_id, size=size, created_at=created or 0.0)

    def list(self, kind: str) -> list[str]:
        check_kind(kind)
        with _unavailable_on_connection_error(self.url):
            return [m.decode() for m in self._client.zrange(self._index_key(kind), 0, -1)]

    def kinds(self) -> list[str]:
        start = len(self._index_key(""))
        with _unavailable_on_connection_error(self.url):
            keys = self._client.scan_iter(match=self._index_key("*"), count=1000)
            return sorted(k.decode()[start:] for k in keys)

    def delete(self, kind: str, artifact_id: str) -> None:
        check_kind(kind)
        check_id(artifact_id)
        key = self._artifact_key(kind, artifact_id)
        with _unavailable_on_connection_error(self.url), self._client.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(self._active_key, self._version_key, key)
                    if not pipe.exists(key):
                        raise self.not_found(kind, artifact_id)
                    for raw in pipe.hvals(self._active_key):
                        try:
                            entry = ActiveEntry.model_validate_json(raw)
                        except ValueError:
                            continue  # unreadable: names nothing this can tell (its cache mode is not ready)
                        if (kind, artifact_id) in referenced_ids(entry.config):
                            raise ArtifactInUse(
                                f"{kind} {artifact_id!r} is active for model {entry.fingerprint} cache mode "
                                f"{entry.cache_mode}; activate another configuration first"
                            )
                    version = int(pipe.get(self._version_key) or 0) + 1
                    pipe.multi()
                    pipe.delete(key)
                    pipe.zrem(self._index_key(kind), artifact_id)
                    pipe.set(self._version_key, version)
                    event = ActiveChange(event="artifact_deleted", version=version, kind=kind, id=artifact_id)
                    pipe.publish(self.channel, event.model_dump_json())
                    pipe.execute()
                    return
                except WatchError:
                    continue  # an activation or delete raced us: check again

    # ---- active configuration --------------------------------------------------------------------------------
    def _active_raw(self) -> tuple[int, dict[str, bytes]]:
        # Not MULTI: Redis refuses a transaction under maxmemory even when it only reads. Every write raises the
        # version in its own transaction, so equal versions before and after the read mean one snapshot.
        with _unavailable_on_connection_error(self.url), self._client.pipeline(transaction=False) as pipe:
            while True:
                pipe.get(self._version_key)
                pipe.hgetall(self._active_key)
                pipe.get(self._version_key)
                before, raw, after = pipe.execute()
                if before == after:
                    return int(before or 0), {k.decode(): v for k, v in raw.items()}

    def version(self) -> int:
        with _unavailable_on_connection_error(self.url):
            return int(self._client.get(self._version_key) or 0)

    def _swap_active(self, entry: ActiveEntry, only_if_absent: bool = False) -> AuditEntry | None:
        field = self._field(entry.fingerprint, entry.cache_mode)
        refs = sorted(referenced_ids(entry.config))
        ref_keys = [self._artifact_key(k, i) for k, i in refs]
        with _unavailable_on_connection_error(self.url), self._client.pipeline(transaction=True) as pipe:
            while True:
                try:
                    # Watching the referenced artifacts makes activate-vs-delete safe.
                    pipe.watch(self._active_key, self._version_key, *ref_keys)
                    for (kind, artifact_id), key in zip(refs, ref_keys, strict=True):
                        if not pipe.exists(key):
                            raise ArtifactNotFound(
                                f"config names {kind} {artifact_id!r}, which is not in the store {self.location}",
                                public=f"config names {kind} {artifact_id!r}, which is not in the store",
                            )
                    raw_old = pipe.hget(self._active_key, field)
                    if only_if_absent and raw_old is not None:
                        pipe.unwatch()
                        return None
                    try:
                        old = None if raw_old is None else ActiveEntry.model_validate_json(raw_old).config
                    except ValueError:
                        old = None  # an unreadable entry is replaced; the audit cannot say what it held
                    version = int(pipe.get(self._version_key) or 0) + 1
                    entry = entry.model_copy(update={"version": version})
                    audit = AuditEntry(
                        at=entry.set_at,
                        fingerprint=entry.fingerprint,
                        cache_mode=entry.cache_mode,
                        old=old,
                        new=entry.config,
                        key_id=entry.key_id,
                        version=version,
                    )
                    pipe.multi()
                    pipe.set(self._version_key, version)
                    pipe.hset(self._active_key, field, entry.model_dump_json())
                    pipe.lpush(self._audit_key, audit.model_dump_json())
                    pipe.ltrim(self._audit_key, 0, AUDIT_KEEP - 1)
                    pipe.publish(self.channel, ActiveChange(version=version, entry=audit).model_dump_json())
                    pipe.execute()
                    return audit
                except WatchError:
                    continue

    def audit(self, limit: int = 100) -> list[AuditEntry]:
        if limit <= 0:
            return []
        with _unavailable_on_connection_error(self.url):
            raws = self._client.lrange(self._audit_key, 0, limit - 1)
        return [AuditEntry.model_validate_json(r) for r in raws]

    # ---- events and health -----------------------------------------------------------------------------------
    def subscribe(
        self, on_change: Callable[[ActiveChange], None], on_reconnect: Callable[[], None] | None = None
    ) -> Subscription:
        return _RedisSubscription(self, on_change, on_reconnect)

    def ping(self) -> None:
        with _unavailable_on_connection_error(self.url):
            self._client.ping()

    def close(self) -> None:
        self._client.close()

    def delete_everything(self) -> int:
        """Remove every key under this store's prefix (tests and tear-down); returns how many."""
        with _unavailable_on_connection_error(self.url):
            keys = list(self._client.scan_iter(match=f"{self.prefix}:*", count=1000))
            return self._client.delete(*keys) if keys else 0


class _RedisSubscription(Subscription):
    """A daemon thread listening on the events channel; it resubscribes after an outage and then calls
    ``on_reconnect`` (events published while Redis was away are lost, so the owner reloads)."""

    def __init__(
        self,
        store: RedisStore,
        on_change: Callable[[ActiveChange], None],
        on_reconnect: Callable[[], None] | None,
        retry_s: float = 0.5,
    ) -> None:
        self._store = store
        self._on_change = on_change
        self._on_reconnect = on_reconnect
        self._retry_s = retry_s
        self._stop = threading.Event()
        self.connected = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dllm-kvq-store-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        lost = False
        while not self._stop.is_set():
            pubsub = self._store._client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(self._store.channel)
                self.connected.set()
                if lost and self._on_reconnect is not None:
                    self._on_reconnect()
                lost = False
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=0.5)
                    if message is None or message.get("type") != "message":
                        continue
                    try:
                        change = ActiveChange.model_validate_json(message["data"])
                    except ValueError:
                        log.warning("ignoring malformed event on %s: %r", self._store.channel, message["data"])
                        continue
                    self._on_change(change)
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                if not lost:
                    log.warning("lost Redis events channel (%s); retrying every %.1f s", scrub(str(exc), self._store.url),
                                self._retry_s)
                lost = True
                self.connected.clear()
                self._stop.wait(self._retry_s)
            except Exception:  # a listener bug must not kill event delivery for good
                log.exception("event listener failed; resubscribing")
                self._stop.wait(self._retry_s)
            finally:
                with contextlib.suppress(Exception):
                    pubsub.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
