"""The local-directory backend of :class:`service.store.base.Store` (layout: see `service.store.base`).

Every file is written whole to a temporary name in the same directory and then renamed (or hard-linked, for
artifacts, so that two writers of the same id cannot overwrite each other), so a reader never sees half a file
and a crash leaves nothing half-written. Read-check-write operations (activate, delete) hold an exclusive
``flock`` on ``R/.lock``, which also serialises several processes sharing the directory. Events are delivered
by polling the audit log (there is no broker), every ``poll_s`` seconds.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from service.store.base import (
    ActiveChange,
    ActiveEntry,
    ArtifactConflict,
    ArtifactInfo,
    ArtifactInUse,
    ArtifactNotFound,
    AuditEntry,
    Store,
    StoreUnavailable,
    Subscription,
    check_id,
    check_kind,
    check_target,
    referenced_ids,
)

log = logging.getLogger(__name__)


def _write_temp(directory: Path, data: bytes) -> Path:
    """Write ``data`` to a fresh temporary file in ``directory`` (fsynced) and return its path."""
    fd, name = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    try:
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
    """A :class:`Store` in a local directory (created if missing)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.url = str(self.root)
        try:
            (self.root / "artifacts").mkdir(parents=True, exist_ok=True)
            (self.root / "active").mkdir(exist_ok=True)
        except OSError as exc:
            raise StoreUnavailable(f"cannot use {self.root} as a store directory: {exc}") from exc

    @property
    def location(self) -> str:
        return str(self.root.resolve())

    @property
    def _audit_path(self) -> Path:
        return self.root / "audit.jsonl"

    def _artifact_path(self, kind: str, artifact_id: str) -> Path:
        return self.root / "artifacts" / check_kind(kind) / check_id(artifact_id)

    def _active_path(self, fingerprint: str, cache_mode: str) -> Path:
        return self.root / "active" / f"{fingerprint}--{cache_mode}.json"

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.root / ".lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    # ---- artifacts -------------------------------------------------------------------------------------------
    def _put(self, kind: str, artifact_id: str, data: bytes) -> bool:
        path = self._artifact_path(kind, artifact_id)
        path.parent.mkdir(exist_ok=True)
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
        try:
            return self._artifact_path(kind, artifact_id).read_bytes()
        except FileNotFoundError:
            raise self.not_found(kind, artifact_id) from None

    def info(self, kind: str, artifact_id: str) -> ArtifactInfo:
        try:
            st = self._artifact_path(kind, artifact_id).stat()
        except FileNotFoundError:
            raise self.not_found(kind, artifact_id) from None
        return ArtifactInfo(kind=kind, id=artifact_id, size=st.st_size, created_at=st.st_mtime)

    def list(self, kind: str) -> list[str]:
        directory = self.root / "artifacts" / check_kind(kind)
        if not directory.is_dir():
            return []
        files = [p for p in directory.iterdir() if not p.name.startswith(".")]
        return [p.name for p in sorted(files, key=lambda p: (p.stat().st_mtime, p.name))]

    def kinds(self) -> list[str]:
        return sorted(p.name for p in (self.root / "artifacts").iterdir() if p.is_dir() and self.list(p.name))

    def delete(self, kind: str, artifact_id: str) -> None:
        path = self._artifact_path(kind, artifact_id)
        with self._locked():
            if not path.exists():
                raise self.not_found(kind, artifact_id)
            for entry in self.list_active():
                if (kind, artifact_id) in referenced_ids(entry.config):
                    raise ArtifactInUse(
                        f"{kind} {artifact_id!r} is active for model {entry.fingerprint} cache mode "
                        f"{entry.cache_mode}; activate another configuration first"
                    )
            path.unlink()

    # ---- active configuration --------------------------------------------------------------------------------
    def get_active(self, fingerprint: str, cache_mode: str) -> ActiveEntry | None:
        check_target(fingerprint, cache_mode)
        try:
            return ActiveEntry.model_validate_json(self._active_path(fingerprint, cache_mode).read_bytes())
        except FileNotFoundError:
            return None

    def list_active(self) -> list[ActiveEntry]:
        entries = [
            ActiveEntry.model_validate_json(p.read_bytes())
            for p in (self.root / "active").glob("*.json")
            if not p.name.startswith(".")
        ]
        return sorted(entries, key=lambda e: (e.fingerprint, e.cache_mode))

    def _swap_active(self, entry: ActiveEntry, only_if_absent: bool = False) -> AuditEntry | None:
        with self._locked():
            for kind, artifact_id in sorted(referenced_ids(entry.config)):
                if not self.exists(kind, artifact_id):
                    raise ArtifactNotFound(
                        f"config names {kind} {artifact_id!r}, which is not in the store {self.location}",
                        public=f"config names {kind} {artifact_id!r}, which is not in the store",
                    )
            old_entry = self.get_active(entry.fingerprint, entry.cache_mode)
            if only_if_absent and old_entry is not None:
                return None
            audit = AuditEntry(
                at=entry.set_at,
                fingerprint=entry.fingerprint,
                cache_mode=entry.cache_mode,
                old=None if old_entry is None else old_entry.config,
                new=entry.config,
                key_id=entry.key_id,
            )
            atomic_write(self._active_path(entry.fingerprint, entry.cache_mode), entry.model_dump_json().encode())
            # One line per append with O_APPEND: readers see whole lines (they skip a torn last line anyway).
            with open(self._audit_path, "ab") as f:
                f.write(audit.model_dump_json().encode() + b"\n")
                f.flush()
                os.fsync(f.fileno())
            return audit

    def _read_audit(self, start: int = 0) -> tuple[list[AuditEntry], int]:
        """Whole audit lines from byte ``start``; returns them (oldest first) and the offset after the last."""
        try:
            with open(self._audit_path, "rb") as f:
                f.seek(start)
                data = f.read()
        except FileNotFoundError:
            return [], start
        end = data.rfind(b"\n") + 1  # a line still being appended is read next time
        entries = [AuditEntry.model_validate_json(line) for line in data[:end].splitlines() if line.strip()]
        return entries, start + end

    def audit(self, limit: int = 100) -> list[AuditEntry]:
        if limit <= 0:
            return []
        entries, _ = self._read_audit()
        return entries[::-1][:limit]

    # ---- events and health -----------------------------------------------------------------------------------
    def subscribe(
        self, on_change: Callable[[ActiveChange], None], on_reconnect: Callable[[], None] | None = None
    ) -> Subscription:
        return _PollingSubscription(self, on_change)

    def ping(self) -> None:
        if not os.access(self.root / "active", os.W_OK):
            raise StoreUnavailable(f"store directory {self.root} is not writable")


class _PollingSubscription(Subscription):
    """Delivers the audit entries appended after it started, polling the file every ``poll_s`` seconds."""

    def __init__(self, store: DirectoryStore, on_change: Callable[[ActiveChange], None], poll_s: float = 0.5):
        self._store = store
        self._on_change = on_change
        self._poll_s = poll_s
        self._stop = threading.Event()
        _, self._offset = store._read_audit()
        self._thread = threading.Thread(target=self._run, name="dllm-kvq-store-poll", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                entries, self._offset = self._store._read_audit(self._offset)
                for entry in entries:
                    self._on_change(ActiveChange(entry=entry))
            except Exception:  # keep polling; a bad line or a listener bug is logged, not fatal
                log.exception("polling %s failed", self._store._audit_path)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
