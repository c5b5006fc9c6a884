"""The local-directory backend of :class:`service.store.base.Store` (layout: see `service.store.base`).

Every file is written whole to a temporary name in the same directory and then renamed (or hard-linked, for
artifacts, so that two writers of the same id cannot overwrite each other), so a reader never sees half a file
and a crash leaves nothing half-written. The active entries, the audit log and the store's version live in one
file, ``active.json``, replaced whole by one rename: an activation's entry and its audit entry become visible
together or not at all (issue 22: with the entry and the audit in two files, a full disk left the one without the
other and replicas split). Read-check-write operations (activate, delete) hold an exclusive ``flock`` on
``R/.lock``, which also serialises several processes sharing the directory. Events are delivered by polling
``active.json`` (a ``stat`` every ``poll_s`` seconds; read again only when it was replaced).

A write the file system refuses (no space, read-only, no permission) changes nothing and raises
:class:`StoreUnavailable`; temporary files a killed writer left behind are removed when the store is opened
(those older than :data:`ORPHAN_AGE_S`, so a write in progress in another process is left alone).
Files are created ``0640`` and directories ``0750``: a second user of the volume in the same group (a
calibration job) can read them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from service.store.base import (
    AUDIT_KEEP,
    ActiveChange,
    ActiveEntry,
    ArtifactConflict,
    ArtifactInfo,
    ArtifactInUse,
    ArtifactNotFound,
    AuditEntry,
    EntryUnreadable,
    Store,
    StoreAccessDenied,
    StoreError,
    StoreUnavailable,
    Subscription,
    check_id,
    check_kind,
    describe_invalid,
    referenced_ids,
)

log = logging.getLogger(__name__)

FILE_MODE = 0o640
DIR_MODE = 0o750
TEMP_PREFIX = ".tmp-"
#: Seconds after which a temporary file is an orphan of a killed writer (a whole write takes far less).
ORPHAN_AGE_S = 60.0
STATE_FILE = "active.json"


class _State(BaseModel):
    """The content of ``active.json``: version, entries by ``"<fingerprint>:<cache_mode>"``, audit oldest first."""

    version: int = 0
    entries: dict[str, ActiveEntry] = Field(default_factory=dict)
    audit: list[AuditEntry] = Field(default_factory=list)


def _write_temp(directory: Path, data: bytes) -> Path:
    """Write ``data`` to a fresh temporary file in ``directory`` (mode 0640, fsynced) and return its path."""
    fd, name = tempfile.mkstemp(dir=directory, prefix=TEMP_PREFIX)
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)
        raise
    return Path(name)


def atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically (temp file in the same directory, then ``os.replace``)."""
    tmp = _write_temp(path.parent, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


class DirectoryStore(Store):
    """A :class:`Store` in a local directory (created if missing).

    Raises StoreUnavailable (the directory cannot be created) or StoreAccessDenied (it cannot be read).
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.url = str(self.root)
        self._cache: tuple[tuple[int, int, int], _State] | None = None
        with self._os_errors("open"):
            (self.root / "artifacts").mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
            self.sweep_orphans()

    @property
    def location(self) -> str:
        return str(self.root.resolve())

    @contextlib.contextmanager
    def _os_errors(self, doing: str) -> Iterator[None]:
        """Turn the file system's refusals into store errors naming the store (nothing was changed: every write
        goes to a temporary file first)."""
        try:
            yield
        except StoreError:
            raise
        except PermissionError as exc:
            raise StoreAccessDenied(f"store directory {self.location}: cannot {doing} ({exc.strerror})") from exc
        except OSError as exc:
            if exc.errno == errno.ENOENT and doing != "open":
                raise
            reason = exc.strerror or str(exc)
            raise StoreUnavailable(f"store directory {self.location}: cannot {doing} ({reason}); nothing was "
                                   "changed") from exc

    def sweep_orphans(self, older_than_s: float = ORPHAN_AGE_S) -> list[Path]:
        """Remove temporary files older than ``older_than_s`` seconds (left by a writer that was killed) from the
        store's directories; returns what was removed."""
        now = time.time()
        removed = []
        dirs = [self.root, self.root / "active", *(p for p in (self.root / "artifacts").iterdir() if p.is_dir())]
        for directory in dirs:
            for tmp in directory.glob(TEMP_PREFIX + "*") if directory.is_dir() else ():
                try:
                    if now - tmp.stat().st_mtime > older_than_s:
                        tmp.unlink()
                        removed.append(tmp)
                except OSError:
                    continue  # another process removed or is writing it
        if removed:
            log.warning("removed %d temporary file(s) a killed writer left in %s", len(removed), self.location)
        return removed

    @property
    def _state_path(self) -> Path:
        return self.root / STATE_FILE

    def _artifact_path(self, kind: str, artifact_id: str) -> Path:
        return self.root / "artifacts" / check_kind(kind) / check_id(artifact_id)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._os_errors("lock"), open(self.root / ".lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    # ---- artifacts -------------------------------------------------------------------------------------------
    def _put(self, kind: str, artifact_id: str, data: bytes) -> bool:
        path = self._artifact_path(kind, artifact_id)
        with self._os_errors(f"write {kind} {artifact_id!r}"):
            path.parent.mkdir(mode=DIR_MODE, exist_ok=True)
            tmp = _write_temp(path.parent, data)
            try:
                os.link(tmp, path)  # fails if the id exists: create-if-absent, never overwrite
                return True
            except FileExistsError:
                if path.read_bytes() != data:
                    raise ArtifactConflict(
                        f"{kind} {artifact_id!r} is already stored with different content; artifacts are immutable"
                    ) from None
                return False
            finally:
                os.unlink(tmp)

    def get(self, kind: str, artifact_id: str) -> bytes:
        path = self._artifact_path(kind, artifact_id)
        try:
            with self._os_errors(f"read {kind} {artifact_id!r}"):
                return path.read_bytes()
        except FileNotFoundError:
            raise self.not_found(kind, artifact_id) from None

    def info(self, kind: str, artifact_id: str) -> ArtifactInfo:
        path = self._artifact_path(kind, artifact_id)
        try:
            with self._os_errors(f"read {kind} {artifact_id!r}"):
                st = path.stat()
        except FileNotFoundError:
            raise self.not_found(kind, artifact_id) from None
        return ArtifactInfo(kind=kind, id=artifact_id, size=st.st_size, created_at=st.st_mtime)

    def list(self, kind: str) -> list[str]:
        directory = self.root / "artifacts" / check_kind(kind)
        if not directory.is_dir():
            return []
        with self._os_errors(f"list {kind}"):
            files = [p for p in directory.iterdir() if not p.name.startswith(".")]
            return [p.name for p in sorted(files, key=lambda p: (p.stat().st_mtime, p.name))]

    def kinds(self) -> list[str]:
        with self._os_errors("list kinds"):
            return sorted(p.name for p in (self.root / "artifacts").iterdir() if p.is_dir() and self.list(p.name))

    def delete(self, kind: str, artifact_id: str) -> None:
        path = self._artifact_path(kind, artifact_id)
        with self._locked():
            if not path.exists():
                raise self.not_found(kind, artifact_id)
            state = self._read_state()
            for entry in state.entries.values():
                if (kind, artifact_id) in referenced_ids(entry.config):
                    raise ArtifactInUse(
                        f"{kind} {artifact_id!r} is active for model {entry.fingerprint} cache mode "
                        f"{entry.cache_mode}; activate another configuration first"
                    )
            # Out of sight first (a rename needs no space), then the version that tells replicas to drop what
            # they cached; if that write fails the artifact is put back and nothing changed. A crash in between
            # leaves a temporary file that the next opening sweeps.
            doing = f"delete {kind} {artifact_id!r}"
            tombstone = path.with_name(f"{TEMP_PREFIX}deleted-{artifact_id}")
            with self._os_errors(doing):
                os.rename(path, tombstone)
            state.version += 1
            try:
                self._write_state(state, doing)
            except StoreError:
                os.rename(tombstone, path)
                raise
            with self._os_errors(doing):
                tombstone.unlink()

    # ---- active configuration --------------------------------------------------------------------------------
    def _read_state(self) -> _State:
        """``active.json`` (a store written before it existed: the legacy ``active/*.json`` and ``audit.jsonl``,
        at version 0). Parsed once per replacement of the file (stat-keyed cache)."""
        try:
            with self._os_errors("read the active configurations"):
                st = self._state_path.stat()
        except FileNotFoundError:
            return self._legacy_state()
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1].model_copy(deep=True)
        try:
            with self._os_errors("read the active configurations"):
                data = self._state_path.read_bytes()
        except FileNotFoundError:
            return self._legacy_state()
        try:
            state = _State.model_validate_json(data)
        except ValidationError as exc:  # the store answers but its content is damaged: not an outage to wait out
            raise EntryUnreadable(f"store directory {self.location}: {STATE_FILE} is not readable "
                                  f"({describe_invalid(exc)})") from exc
        self._cache = (key, state)
        return state.model_copy(deep=True)

    def _legacy_state(self) -> _State:
        state = _State()
        with self._os_errors("read the active configurations"):
            for path in sorted((self.root / "active").glob("*.json")) if (self.root / "active").is_dir() else ():
                if path.name.startswith("."):
                    continue
                with contextlib.suppress(ValidationError):
                    entry = ActiveEntry.model_validate_json(path.read_bytes())
                    state.entries[f"{entry.fingerprint}:{entry.cache_mode}"] = entry
            legacy_audit = self.root / "audit.jsonl"
            if legacy_audit.exists():
                for line in legacy_audit.read_bytes().splitlines():
                    with contextlib.suppress(ValidationError):
                        state.audit.append(AuditEntry.model_validate_json(line))
        state.audit = state.audit[-AUDIT_KEEP:]
        return state

    def _write_state(self, state: _State, doing: str) -> None:
        with self._os_errors(doing):
            atomic_write(self._state_path, state.model_dump_json().encode())

    def _active_raw(self) -> tuple[int, dict[str, bytes]]:
        state = self._read_state()
        return state.version, {key: e.model_dump_json().encode() for key, e in state.entries.items()}

    def version(self) -> int:
        return self._read_state().version

    def _swap_active(self, entry: ActiveEntry, only_if_absent: bool = False) -> AuditEntry | None:
        with self._locked():
            for kind, artifact_id in sorted(referenced_ids(entry.config)):
                if not self.exists(kind, artifact_id):
                    raise ArtifactNotFound(
                        f"config names {kind} {artifact_id!r}, which is not in the store {self.location}",
                        public=f"config names {kind} {artifact_id!r}, which is not in the store",
                    )
            state = self._read_state()
            key = f"{entry.fingerprint}:{entry.cache_mode}"
            old_entry = state.entries.get(key)
            if only_if_absent and old_entry is not None:
                return None
            state.version += 1
            entry = entry.model_copy(update={"version": state.version})
            audit = AuditEntry(
                at=entry.set_at,
                fingerprint=entry.fingerprint,
                cache_mode=entry.cache_mode,
                old=None if old_entry is None else old_entry.config,
                new=entry.config,
                key_id=entry.key_id,
                version=state.version,
            )
            state.entries[key] = entry
            state.audit = [*state.audit, audit][-AUDIT_KEEP:]
            self._write_state(state, f"activate a configuration of cache mode {entry.cache_mode}")
            return audit

    def audit(self, limit: int = 100) -> list[AuditEntry]:
        if limit <= 0:
            return []
        return self._read_state().audit[::-1][:limit]

    # ---- events and health -----------------------------------------------------------------------------------
    def subscribe(
        self, on_change: Callable[[ActiveChange], None], on_reconnect: Callable[[], None] | None = None
    ) -> Subscription:
        return _PollingSubscription(self, on_change, on_reconnect)

    def ping(self) -> None:
        if not os.access(self.root, os.W_OK):
            raise StoreUnavailable(f"store directory {self.location} is not writable")


class _PollingSubscription(Subscription):
    """Delivers each version the store reaches after it started, polling ``active.json`` every ``poll_s``
    seconds: an activation as its audit entry, any other change (a deletion) as an ``artifact_deleted`` event
    without an id, so that a listener reloads."""

    def __init__(self, store: DirectoryStore, on_change: Callable[[ActiveChange], None],
                 on_reconnect: Callable[[], None] | None, poll_s: float = 0.5):
        self._store = store
        self._on_change = on_change
        self._on_reconnect = on_reconnect
        self._poll_s = poll_s
        self._stop = threading.Event()
        try:
            self._version = store.version()
        except StoreError:
            self._version = -1  # read it when the store answers
        self._thread = threading.Thread(target=self._run, name="dllm-kvq-store-poll", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        state = self._store._read_state()
        if state.version == self._version:
            return
        if self._version < 0:
            self._version = state.version
            if self._on_reconnect is not None:
                self._on_reconnect()
            return
        for audit in state.audit:
            if audit.version > self._version:
                self._on_change(ActiveChange(version=audit.version, entry=audit))
                self._version = audit.version
        if state.version > self._version:
            self._on_change(ActiveChange(event="artifact_deleted", version=state.version))
        self._version = state.version

    def _run(self) -> None:
        failing = False
        while not self._stop.wait(self._poll_s):
            try:
                self._poll()
                failing = False
            except StoreError as exc:  # keep polling; an unreadable store is logged once, not fatal
                if not failing:
                    log.error("polling %s failed: %s", self._store._state_path, exc)
                failing = True
            except Exception:
                log.exception("applying a change of %s failed", self._store._state_path)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

