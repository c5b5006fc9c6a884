"""The two store backends against the same behaviour: a real redis-server (the suite's own, own key prefix,
removed after) and a temporary directory."""

from __future__ import annotations

import hashlib
import itertools
import socket
import threading
import uuid

import pytest
from pydantic import BaseModel

from service.quant.config import KVQuantConfig
from service.store.base import (
    ArtifactConflict,
    ArtifactInUse,
    ArtifactNotFound,
    ConfigInvalid,
    InvalidName,
    StoreUnavailable,
    open_store,
)
from service.store.dir_store import DirectoryStore
from service.store.redis_store import RedisStore
from tests.support.artifacts import policy_for
from tests.support.fake_engine import FakeEngine
from tests.support.processes import SHARED_REDIS_URL, RedisProcess, free_port

pytestmark = pytest.mark.integration  # the real Redis (the suite's own redis-server) and private ones

SPEC = FakeEngine().spec  # a model to activate configurations for (2 layers, head_dim 8, context 512)
FP = SPEC.fingerprint


@pytest.fixture(params=["redis", "dir"])
def store(request, tmp_path):
    if request.param == "redis":
        s = open_store(SHARED_REDIS_URL, prefix=f"test-store-{uuid.uuid4().hex[:8]}")
        assert isinstance(s, RedisStore)
        yield s
        s.delete_everything()
        s.close()
    else:
        s = open_store(str(tmp_path / "store"))
        assert isinstance(s, DirectoryStore)
        yield s


def test_put_get_is_content_addressed_and_immutable(store):
    data = b"\x00\x01 policy bytes"
    artifact_id = store.put("policy", data)
    assert artifact_id == "sha256-" + hashlib.sha256(data).hexdigest()
    assert store.get("policy", artifact_id) == data
    assert store.put("policy", data) == artifact_id  # same bytes again: no-op
    assert store.info("policy", artifact_id).size == len(data)
    assert store.put("policy", b"other", artifact_id="named-1") == "named-1"
    with pytest.raises(ArtifactConflict, match="immutable"):
        store.put("policy", b"changed", artifact_id="named-1")
    assert store.get("policy", "named-1") == b"other"
    assert store.list("policy") == [artifact_id, "named-1"]
    assert store.list("trajectory") == []
    store.put_json("trajectory", {"b": 1, "a": [1, 2]})
    assert store.kinds() == ["policy", "trajectory"]
    with pytest.raises(ArtifactNotFound):
        store.get("policy", "missing")
    assert not store.exists("policy", "missing")


def test_json_and_model_round_trip(store):
    tid = store.put_json("trajectory", {"b": 1, "a": [1, 2]})
    assert tid == store.put_json("trajectory", {"a": [1, 2], "b": 1})  # canonical JSON: key order is irrelevant
    assert store.get_json("trajectory", tid) == {"a": [1, 2], "b": 1}

    class Table(BaseModel):
        id: str
        bits: int

    assert store.put_model("policy", Table(id="pol-abc", bits=4)) == "pol-abc"
    assert store.get_model("policy", "pol-abc", Table) == Table(id="pol-abc", bits=4)


@pytest.mark.parametrize("kind,artifact_id", [("Policy", "x"), ("policy", "../etc"), ("policy", ".hidden"),
                                              ("policy", "a/b"), ("", "x"), ("policy", "a:b")])
def test_bad_names_are_refused(store, kind, artifact_id):
    with pytest.raises(InvalidName, match="legal"):
        store.put(kind, b"x", artifact_id=artifact_id)


def test_active_configuration_swap_audit_and_delete(store):
    table = policy_for(SPEC)
    pid = store.put_model("policy", table)
    prefix_pid = store.put_model("policy", policy_for(SPEC, cache_mode="prefix"))
    missing = KVQuantConfig(method="dllm_kvq", bits=4, policy_id="nope")
    with pytest.raises(ArtifactNotFound, match="no policy with id .nope. in the store"):
        store.set_active(SPEC, "dual", missing)
    assert store.get_active(FP, "dual") is None and store.audit() == []

    first = store.set_active(SPEC, "dual", KVQuantConfig(method="dllm_kvq", bits=4, policy_id=pid), key_id="k1")
    assert first.old is None and first.new.artifact_id == pid and first.key_id == "k1"
    second = store.set_active(SPEC, "dual", KVQuantConfig(method="kivi", bits=2), key_id="k2")
    assert second.old == first.new and second.new.method == "kivi"
    store.set_active(SPEC, "prefix", KVQuantConfig(method="dllm_kvq", bits=4, policy_id=prefix_pid))
    assert store.get_active(FP, "dual").config.method == "kivi"
    assert [(e.fingerprint, e.cache_mode) for e in store.list_active()] == [(FP, "dual"), (FP, "prefix")]
    assert [e.key_id for e in store.audit()] == [None, "k2", "k1"]
    assert len(store.audit(limit=1)) == 1

    store.delete("policy", pid)  # no longer active anywhere
    with pytest.raises(ArtifactInUse, match="prefix"):
        store.delete("policy", prefix_pid)
    assert store.exists("policy", prefix_pid)
    store.set_active(SPEC, "prefix", KVQuantConfig(method="none"))
    store.delete("policy", prefix_pid)
    assert store.list("policy") == []
    with pytest.raises(ArtifactNotFound):
        store.delete("policy", pid)
    with pytest.raises(InvalidName, match="none, prefix, dual"):
        store.set_active(SPEC, "triple", KVQuantConfig())


def test_a_configuration_that_does_not_validate_is_never_activated(store):
    """Issue 17: the store itself refuses what the model cannot serve, whoever calls it (here Python, as
    docs/stores.md shows): nothing is written, no audit entry, no event."""
    other_model = store.put_model("policy", policy_for(SPEC, fingerprint="0" * 64))
    prefix_table = store.put_model("policy", policy_for(SPEC, cache_mode="prefix"))
    two_bit = store.put_model("policy", policy_for(SPEC, bits=2))
    garbage = store.put("policy", b"not a policy table")
    refused = [
        (KVQuantConfig(method="dllm_kvq", bits=4, policy_id=other_model), "weights_fingerprint"),
        (KVQuantConfig(method="dllm_kvq", bits=4, policy_id=prefix_table), "cache_mode"),
        (KVQuantConfig(method="dllm_kvq", bits=4, policy_id=two_bit), "bits"),
        (KVQuantConfig(method="dllm_kvq", bits=4, policy_id=garbage), "policy_id"),
        (KVQuantConfig(method="kivi", bits=4, k_group_size=4096), "k_group_size"),
        (KVQuantConfig(method="kivi", bits=4, v_group_size=3), "v_group_size"),
    ]
    for config, field in refused:
        with pytest.raises(ConfigInvalid) as err:
            store.set_active(SPEC, "dual", config)
        assert field in err.value.field, (config, err.value)
    with pytest.raises(ConfigInvalid, match="cache mode"):
        store.set_active(SPEC, "none", KVQuantConfig(method="kivi", bits=2))
    assert store.list_active() == [] and store.audit() == []
    with pytest.raises(ConfigInvalid):
        store.restore_active(SPEC, "dual", refused[0][0])
    assert store.list_active() == []


def test_concurrent_swaps_are_linearizable(store):
    """Each audit entry's old is the previous entry's new: no swap read a stale value."""
    configs = [KVQuantConfig(method="kivi", bits=b, k_group_size=g) for b in (2, 4, 8) for g in (16, 32, 64)]

    def swap(cfg):
        for _ in range(3):
            store.set_active(SPEC, "dual", cfg)

    threads = [threading.Thread(target=swap, args=(c,)) for c in configs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    chain = store.audit(limit=1000)[::-1]
    assert len(chain) == 3 * len(configs)
    assert chain[0].old is None
    for prev, nxt in itertools.pairwise(chain):
        assert nxt.old == prev.new
    assert store.get_active(FP, "dual").config == chain[-1].new


def test_events_reach_subscribers(store):
    got: list = []
    arrived = threading.Event()

    def on_change(change):
        got.append(change)
        arrived.set()

    sub = store.subscribe(on_change)
    try:
        if isinstance(store, RedisStore):
            assert sub.connected.wait(30)  # hang guards: an event arrives or never does
        store.set_active(SPEC, "dual", KVQuantConfig(method="kivi", bits=2), key_id="admin")
        assert arrived.wait(30)
        assert got[0].entry.new == KVQuantConfig(method="kivi", bits=2) and got[0].entry.key_id == "admin"
    finally:
        sub.close()


def test_unreachable_or_silent_redis_raises_store_unavailable_after_few_tries():
    store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", socket_timeout_s=0.5)
    with pytest.raises(StoreUnavailable, match="unreachable"):
        store.list("policy")
    with pytest.raises(StoreUnavailable):
        store.ping()
    # A Redis that takes connections and never answers: each try ends at the socket timeout, and the client retries
    # the connection (its handshake) and the command once each, so a request gives up after at most 2 x 2
    # connections -- a count, not a time (redis-py's default would retry three times with a longer backoff).
    accepted: list[socket.socket] = []
    with socket.create_server(("127.0.0.1", 0)) as listener:
        def take() -> None:
            while True:
                try:
                    accepted.append(listener.accept()[0])
                except OSError:  # the listener closed
                    return

        threading.Thread(target=take, daemon=True).start()
        silent = RedisStore(f"redis://127.0.0.1:{listener.getsockname()[1]}/0", socket_timeout_s=0.5)
        try:
            with pytest.raises(StoreUnavailable):
                silent.ping()
        finally:
            silent.close()
            for conn in accepted:
                conn.close()
    assert 1 <= len(accepted) <= 4


def test_redis_restart_resubscribes_and_recovers(tmp_path):
    redis_proc = RedisProcess(tmp_path)
    redis_proc.start()
    store = RedisStore(redis_proc.url, prefix="t", socket_timeout_s=0.5)
    reconnected, changed = threading.Event(), threading.Event()
    sub = store.subscribe(lambda c: changed.set(), on_reconnect=reconnected.set)
    try:
        assert sub.connected.wait(30)  # hang guards: each event arrives or never does
        redis_proc.stop()
        with pytest.raises(StoreUnavailable):
            store.set_active(SPEC, "dual", KVQuantConfig(method="kivi"))
        redis_proc.start()
        assert reconnected.wait(60)
        store.set_active(SPEC, "dual", KVQuantConfig(method="kivi"))
        assert changed.wait(30)
        assert store.get_active(FP, "dual").config.method == "kivi"
    finally:
        sub.close()
        store.close()
        redis_proc.stop()


def test_open_store_picks_backend(tmp_path):
    assert isinstance(open_store("redis://127.0.0.1:6379/0"), RedisStore)
    assert isinstance(open_store(f"file://{tmp_path}/s"), DirectoryStore)
    with pytest.raises(InvalidName):
        open_store("")


def test_an_abbreviated_id_resolves_when_it_starts_one_stored_id(store):
    from service.store.base import AmbiguousId, ArtifactNotFound

    first = store.put("policy", b'{"a": 1}')
    assert store.resolve_id("policy", first) == first and store.resolve_id("policy", first[:6]) == first
    twin = store.put("policy", b'{"a": 2}', first[:6] + "twin")
    with pytest.raises(AmbiguousId, match=rf"it starts 2 ids \({first}, {twin}\)"):
        store.resolve_id("policy", first[:6])
    assert store.resolve_id("policy", first) == first  # a full id is never ambiguous
    with pytest.raises(ArtifactNotFound):
        store.resolve_id("policy", "zzzz")
    with pytest.raises(ArtifactNotFound):
        store.resolve_id("kvquant_state", first[:6])  # another kind's ids do not count
