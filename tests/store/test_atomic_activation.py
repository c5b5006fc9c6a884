"""Issue 22, finding 1 and 5: one atomic, ordered activation on both stores. The inputs of the attack pass: a
full 1 MiB store disk (a real tmpfs), a read-only store, Redis under ``maxmemory``, two real server processes on
one store, an event a replica never got. A failed write changes nothing, answers 503 ``store_unavailable`` with
``Retry-After`` on a connection that stays open; replicas converge on the newest version whatever they missed.
"""

from __future__ import annotations

import errno
import http.client
import json
import os
import stat
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import redis

from service.quant.config import KVQuantConfig
from service.store.base import KIND_POLICY, ActiveEntry, open_store
from service.store.dir_store import ORPHAN_AGE_S, DirectoryStore
from service.store.redis_store import RedisStore
from tests.support.apps import ADMIN_KEY
from tests.support.artifacts import policy_for
from tests.support.fake_engine import FakeEngine
from tests.support.processes import RedisProcess, ServerProcess
from tests.support.waiting import until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FACTORY = "tests.support.apps:fake_app_from_env"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}", "Content-Type": "application/json"}
SPEC = FakeEngine().spec
DUAL = {"method": "kivi", "bits": 2, "k_group_size": 16}  # the input: kivi, 2 bits, group 16
PREFIX = {"method": "kivi", "bits": 4}


def replica(tmp_path: Path, store_url: str, name: str, **env) -> ServerProcess:
    return ServerProcess({"DLLM_STORE_URL": store_url, "DLLM_ADMIN_KEY": ADMIN_KEY, "DLLM_BLOCK_LENGTH": "4",
                          "DLLM_STORE_CHECK_INTERVAL_S": "0.5", **env}, FACTORY,
                         log_path=tmp_path / f"{name}.log").start()


def wait_for(condition, timeout_s: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    pytest.fail(f"not within {timeout_s} s: {what}")


def serving(srv: ServerProcess, mode: str) -> dict:
    return httpx.get(srv.url + "/admin/active", headers=ADMIN).json()["serving"][mode]["kv_quant"]


def put_on_one_connection(url: str, path: str, body: dict, then: str = "/health") -> tuple[int, dict, dict, int]:
    """PUT ``body`` and then GET ``then`` over ONE kept-alive connection: (status, headers, JSON, second status).
    Fails if the server closed the connection after the first answer."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("PUT", path, body=json.dumps(body), headers=ADMIN)
        first = conn.getresponse()
        data = json.loads(first.read())
        sock = conn.sock
        assert sock is not None and first.getheader("connection", "").lower() != "close", "the server closed it"
        conn.request("GET", then)
        second = conn.getresponse()
        second.read()
        assert conn.sock is sock  # the same TCP connection answered both
        return first.status, dict(first.getheaders()), data, second.status
    finally:
        conn.close()


@pytest.fixture
def small_disk(tmp_path):
    """A real 1 MiB tmpfs (the attack pass's full disk); skipped where this host cannot mount one."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", str(mount)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode}); "
                    "test_an_injected_write_failure_changes_nothing covers the same path")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(directory: Path) -> Path:
    """Write a file until the file system is full; returns it (delete it to free the space)."""
    ballast = directory / "ballast"
    with open(ballast, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return ballast


def test_a_full_disk_changes_nothing_and_two_replicas_never_split(tmp_path, small_disk):
    url = str(small_disk / "store")
    a = replica(tmp_path, url, "a")
    b = c = None
    try:
        b = replica(tmp_path, url, "b")
        assert httpx.put(a.url + "/admin/active/prefix", json=PREFIX, headers=ADMIN).status_code == 200
        wait_for(lambda: serving(b, "prefix").get("bits") == 4, what="replica b follows the prefix activation")
        before = open_store(url).audit()
        ballast = fill(small_disk)

        status, headers, body, then = put_on_one_connection(a.url, "/admin/active/dual", DUAL)
        assert status == 503 and body["error"]["code"] == "store_unavailable", body
        assert "No space left" in body["error"]["message"] and int(headers["retry-after"]) > 0
        assert then == 200  # the connection stayed open
        store = open_store(url)
        assert store.get_active(SPEC.fingerprint, "dual") is None and store.audit() == before  # nothing changed
        assert store.version() == 1 and not list((small_disk / "store").glob(".tmp-*"))
        for srv in (a, b):
            assert serving(srv, "dual")["method"] == "none", "a replica serves what the store does not hold"

        ballast.unlink()
        r = httpx.put(a.url + "/admin/active/dual", json=DUAL, headers=ADMIN)
        assert r.status_code == 200, r.text
        wait_for(lambda: serving(b, "dual") == KVQuantConfig(**DUAL).model_dump(mode="json", exclude_none=True),
                 what="replica b converges on the new version")
        entry, audit = store.get_active(SPEC.fingerprint, "dual"), store.audit(limit=1)[0]
        assert entry.version == audit.version == store.version() == 2 and audit.new == KVQuantConfig(**DUAL)
        c = replica(tmp_path, url, "c")  # a replica started later serves the same
        assert serving(c, "dual") == serving(a, "dual") == serving(b, "dual")
    finally:
        for srv in (a, b, c):
            if srv is not None:
                srv.stop()


def test_a_read_only_store_answers_503_not_500(tmp_path, small_disk):
    url = str(small_disk / "store")
    srv = replica(tmp_path, url, "ro")
    try:
        subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
        status, headers, body, then = put_on_one_connection(srv.url, "/admin/active/dual", DUAL)
        assert status == 503 and body["error"]["code"] == "store_unavailable" and "retry-after" in headers, body
        assert then == 200
        upload = httpx.post(srv.url + "/admin/policies", content=policy_for(SPEC).to_json(), headers=ADMIN)
        assert upload.status_code == 503 and upload.json()["error"]["code"] == "store_unavailable", upload.text
        assert upload.headers["retry-after"]
    finally:
        srv.stop()
        subprocess.run(["mount", "-o", "remount,rw", str(small_disk)], check=False)


def test_an_injected_write_failure_changes_nothing(tmp_path, monkeypatch):
    """The store boundary, where no tmpfs can be mounted: the rename of active.json fails with ENOSPC."""
    from fastapi.testclient import TestClient

    from service.config import Settings
    from service.store import dir_store
    from tests.support.apps import fake_app

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    app = fake_app(Settings(store_url=str(tmp_path / "store"), admin_key=ADMIN_KEY))
    with TestClient(app) as client:
        assert client.put("/admin/active/prefix", json=PREFIX, headers=ADMIN).status_code == 200
        monkeypatch.setattr(dir_store, "atomic_write", full)
        r = client.put("/admin/active/dual", json=DUAL, headers=ADMIN)
        assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable", r.text
        assert r.headers["retry-after"]
        view = client.get("/admin/active", headers=ADMIN).json()
        assert "dual" not in view["store"] and view["serving"]["dual"]["kv_quant"]["method"] == "none"
        assert [e["new"]["bits"] for e in client.get("/admin/audit", headers=ADMIN).json()] == [4]


def test_versions_grow_and_orphan_temp_files_are_swept(tmp_path):
    root = tmp_path / "store"
    store = DirectoryStore(root)
    policy = policy_for(SPEC)
    store.put_model(KIND_POLICY, policy)
    first = store.set_active(SPEC, "dual", KVQuantConfig(method="dllm_kvq", bits=4, artifact_id=policy.id))
    second = store.set_active(SPEC, "dual", KVQuantConfig(method="kivi", bits=2))
    other = store.put(KIND_POLICY, b"{}", artifact_id="other")
    store.delete(KIND_POLICY, other)
    assert (first.version, second.version, store.version()) == (1, 2, 3)
    assert [e.version for e in store.audit()] == [2, 1]
    # What a SIGKILL during a write leaves: temporary files. Old ones go when the store is opened again; one as
    # young as a write in progress in another process stays.
    old = [root / ".tmp-killed", root / "artifacts" / KIND_POLICY / ".tmp-killed"]
    for path in old:
        path.write_bytes(b"half")
        os.utime(path, (time.time() - 2 * ORPHAN_AGE_S,) * 2)
    young = root / ".tmp-writing"
    young.write_bytes(b"in progress")
    DirectoryStore(root)
    assert not any(p.exists() for p in old) and young.exists()
    # Readable by the group (a calibration job sharing the volume), not by others.
    assert stat.S_IMODE((root / "active.json").stat().st_mode) == 0o640
    assert stat.S_IMODE((root / "artifacts" / KIND_POLICY / policy.id).stat().st_mode) == 0o640
    assert stat.S_IMODE((root / "artifacts" / KIND_POLICY).stat().st_mode) & 0o750 == 0o750


def test_a_store_written_before_versions_is_read(tmp_path):
    """The layout before active.json (active/<fp>--<mode>.json and audit.jsonl) is read as version 0."""
    root = tmp_path / "store"
    (root / "active").mkdir(parents=True)
    entry = ActiveEntry(fingerprint=SPEC.fingerprint, cache_mode="dual", config=KVQuantConfig(method="kivi", bits=2),
                        set_at=1.0)
    (root / "active" / f"{SPEC.fingerprint}--dual.json").write_text(entry.model_dump_json())
    store = DirectoryStore(root)
    assert store.get_active(SPEC.fingerprint, "dual").config.bits == 2 and store.version() == 0
    assert store.set_active(SPEC, "dual", KVQuantConfig(method="kivi", bits=4)).old.bits == 2


def test_redis_under_maxmemory_answers_503_and_leaves_index_and_keys_equal(tmp_path):
    own = RedisProcess(tmp_path)
    own.start()
    srv = None
    try:
        srv = replica(tmp_path, own.url, "oom")
        client = redis.Redis.from_url(own.url)
        assert httpx.post(srv.url + "/admin/policies", content=policy_for(SPEC).to_json(),
                          headers=ADMIN).status_code == 201
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + 64 * 1024)
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            for i in range(10_000):
                client.set(f"ballast:{i}", b"x" * 4096)
        status, headers, body, then = put_on_one_connection(srv.url, "/admin/active/dual", DUAL)
        assert status == 503 and body["error"]["code"] == "store_unavailable" and "retry-after" in headers, body
        assert then == 200
        upload = httpx.post(srv.url + "/admin/policies", content=policy_for(SPEC, bits=2).to_json(), headers=ADMIN)
        assert upload.status_code == 503 and upload.json()["error"]["code"] == "store_unavailable", upload.text
        store = RedisStore(own.url)
        assert store.get_active(SPEC.fingerprint, "dual") is None and store.audit() == [] and store.version() == 0
        index = client.zcard(f"dllm-kvq:index:{KIND_POLICY}")
        keys = len(list(client.scan_iter(match=f"dllm-kvq:artifact:{KIND_POLICY}:*")))
        assert index == keys == 1
    finally:
        if srv is not None:
            srv.stop()
        own.stop()


def test_a_replica_that_missed_an_event_converges_by_version(tmp_path):
    """An activation whose event never reached the replica (written with no PUBLISH, as a lost pub/sub message
    looks): the replica's periodic check sees the store's version move and reloads; events carry the version."""
    own = RedisProcess(tmp_path)
    own.start()
    srv = None
    try:
        srv = replica(tmp_path, own.url, "missed")
        store = RedisStore(own.url)
        pubsub = redis.Redis.from_url(own.url).pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(store.channel)
        assert httpx.put(srv.url + "/admin/active/prefix", json=PREFIX, headers=ADMIN).status_code == 200
        message = until(lambda: pubsub.get_message(timeout=0.1), "the activation's event")
        assert json.loads(message["data"])["version"] == store.version() == 1
        # The lost event: entry and version written, nothing published.
        entry = ActiveEntry(fingerprint=SPEC.fingerprint, cache_mode="dual", config=KVQuantConfig(**DUAL),
                            set_at=time.time(), version=2)
        raw = redis.Redis.from_url(own.url)
        raw.hset("dllm-kvq:active", f"{SPEC.fingerprint}:dual", entry.model_dump_json())
        raw.set("dllm-kvq:version", 2)
        wait_for(lambda: serving(srv, "dual").get("bits") == 2, what="the replica reloads at the new version")
    finally:
        if srv is not None:
            srv.stop()
        own.stop()


def test_a_damaged_active_file_makes_every_mode_not_ready(tmp_path):
    """The store answers but active.json does not parse: no cache mode quietly serves its default."""
    from fastapi.testclient import TestClient

    from service.config import Settings
    from tests.support.apps import fake_app

    root = tmp_path / "store"
    DirectoryStore(root).set_active(SPEC, "dual", KVQuantConfig(**DUAL))
    (root / "active.json").write_bytes(b"\x00\xff{not json")
    with TestClient(fake_app(Settings(store_url=str(root), admin_key=ADMIN_KEY))) as client:
        r = client.get("/health/ready")
        assert r.status_code == 503 and "active.json is not readable" in r.text, r.text
        assert all(f"cache mode {mode}" in r.text for mode in ("none", "prefix", "dual"))
        activate = client.put("/admin/active/dual", json=DUAL, headers=ADMIN)
        assert activate.status_code == 503 and activate.json()["error"]["code"] == "store_unreadable"
    assert (root / "active.json").read_bytes() == b"\x00\xff{not json"  # nothing overwritten


KILLED_WRITER = """
import sys, time
from service.quant.config import KVQuantConfig
from service.store.dir_store import DirectoryStore
from tests.support.fake_engine import FakeEngine
spec, store = FakeEngine().spec, DirectoryStore(sys.argv[1])
print("writing", flush=True)
i = 0
while True:
    i += 1
    store.set_active(spec, "dual", KVQuantConfig(method="kivi", bits=2 if i % 2 else 4), key_id=f"k{i}")
"""


def test_a_writer_killed_mid_activation_leaves_entry_and_audit_in_step(tmp_path):
    """SIGKILL during activations (the attack pass left an active file naming another policy than the newest
    audit entry): whatever instant the kill lands, the entry, the newest audit entry and the version agree."""
    import sys

    root = tmp_path / "store"
    for delay in (0.3, 0.7, 1.1):
        writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(root)], cwd=Path(__file__).parents[2],
                                  stdout=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert writer.stdout.readline().strip() == b"writing"
        time.sleep(delay)
        writer.kill()
        writer.wait()
        store = DirectoryStore(root)
        entry, newest = store.get_active(SPEC.fingerprint, "dual"), store.audit(limit=1)[0]
        assert entry is not None and entry.version == newest.version == store.version() > 0
        assert entry.config == newest.new and entry.key_id == newest.key_id
