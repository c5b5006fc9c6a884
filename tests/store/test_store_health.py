"""Health tells the truth about the store, with a private redis-server that the tests stop and restart empty:
``dllm_store_up`` follows the connection with no admin traffic, ``GET /admin/active`` answers 503 while the store
is away, and a replica whose store came back without the active configurations says so and (unless
``store_restore_active`` is off) writes them back, policy included, so a new replica serves the same."""

from __future__ import annotations

import time

import httpx
import pytest

from service.quant.config import KVQuantConfig
from service.store.base import KIND_POLICY
from service.store.redis_store import RedisStore
from tests.support.apps import ADMIN_KEY
from tests.support.artifacts import policy_for
from tests.support.fake_engine import FakeEngine
from tests.support.metrics import metric_sum, metrics
from tests.support.processes import RedisProcess, ServerProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FACTORY = "tests.support.apps:fake_app_from_env"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
SPEC = FakeEngine().spec
POLICY = policy_for(SPEC, cache_mode="dual", bits=4)
DUAL = {"method": "dllm_kvq", "bits": 4, "k_group_size": 32, "policy_id": POLICY.id}


def replica(tmp_path, redis_url: str, name: str, **env) -> ServerProcess:
    return ServerProcess({"DLLM_STORE_URL": redis_url, "DLLM_ADMIN_KEY": ADMIN_KEY, "DLLM_BLOCK_LENGTH": "4",
                          **env}, FACTORY, log_path=tmp_path / f"{name}.log").start()


def wait_for(condition, timeout_s: float = 30.0, what: str = "") -> float:
    """Seconds until ``condition()`` holds (fails the test after ``timeout_s``: a hang guard, not a time bound)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if condition():
            return time.monotonic() - start
        time.sleep(0.1)
    pytest.fail(f"not within {timeout_s} s: {what}")


def activate_and_lose_the_store(tmp_path, **env):
    """A replica serving a dllm_kvq policy (dual) and kivi (prefix) from a Redis that then restarts empty."""
    own = RedisProcess(tmp_path)
    own.start()
    srv = replica(tmp_path, own.url, "a", **env)
    assert httpx.post(srv.url + "/admin/policies", content=POLICY.to_json(), headers=ADMIN).status_code == 201
    assert httpx.put(srv.url + "/admin/active/dual", json=DUAL, headers=ADMIN).status_code == 200
    assert httpx.put(srv.url + "/admin/active/prefix", json={"method": "kivi", "bits": 2},
                     headers=ADMIN).status_code == 200
    own.stop()
    return own, srv


def test_store_up_follows_redis_and_a_replica_restores_what_the_store_lost(tmp_path):
    own, srv = activate_and_lose_the_store(tmp_path)
    second = None
    try:
        # No admin traffic: only /metrics, which never touches the store.
        wait_for(lambda: metric_sum(metrics(srv.url), "dllm_store_up") == 0, what="dllm_store_up 0 after Redis stopped")
        r = httpx.get(srv.url + "/admin/active", headers=ADMIN)
        assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable", r.text
        assert r.json()["error"]["type"] == "service_unavailable_error"
        own.start()  # no persistence: the store comes back empty
        wait_for(lambda: metric_sum(metrics(srv.url), "dllm_store_up") == 1, what="dllm_store_up 1 after Redis")
        store = RedisStore(own.url)
        wait_for(lambda: store.get_active(SPEC.fingerprint, "dual") is not None, what="the dual entry written back")
        wait_for(lambda: store.get_active(SPEC.fingerprint, "prefix") is not None, what="the prefix entry")
        assert store.get_active(SPEC.fingerprint, "dual").config == KVQuantConfig(**DUAL)
        assert store.get(KIND_POLICY, POLICY.id) == POLICY.to_json().encode()  # the policy it names, too
        audit = store.audit()
        assert sorted(e.cache_mode for e in audit) == ["dual", "prefix"]
        assert {e.key_id for e in audit} == {"replica-restore"} and all(e.old is None for e in audit)
        m = metrics(srv.url)
        assert metric_sum(m, "dllm_store_active_restored_total", cache_mode="dual") == 1
        assert metric_sum(m, "dllm_store_active_lost") == 0
        view = httpx.get(srv.url + "/admin/active", headers=ADMIN).json()
        assert view["store_lost"]["dual"]["kv_quant"]["policy_id"] == POLICY.id
        assert view["store_lost"]["dual"]["restored_at"] >= view["store_lost"]["dual"]["detected_at"]
        assert view["store"]["dual"]["config"]["policy_id"] == POLICY.id
        # A replica started now serves what the first one serves (it would have served the default).
        second = replica(tmp_path, own.url, "b")
        served = httpx.get(second.url + "/admin/active", headers=ADMIN).json()["serving"]
        assert served["dual"]["kv_quant"]["policy_id"] == POLICY.id and served["prefix"]["kv_quant"]["bits"] == 2
    finally:
        if second is not None:
            second.stop()
        srv.stop()
        own.stop()


def test_a_loss_is_reported_and_left_alone_when_restoring_is_off(tmp_path):
    own, srv = activate_and_lose_the_store(tmp_path, DLLM_STORE_RESTORE_ACTIVE="false")
    try:
        wait_for(lambda: metric_sum(metrics(srv.url), "dllm_store_up") == 0, what="dllm_store_up 0")
        own.start()
        wait_for(lambda: metric_sum(metrics(srv.url), "dllm_store_active_lost", cache_mode="dual") == 1,
                 what="the loss shown")
        view = httpx.get(srv.url + "/admin/active", headers=ADMIN).json()
        lost = view["store_lost"]["dual"]
        assert lost["restored_at"] is None and "store_restore_active is off" in lost["note"]
        assert view["store"] == {} and view["serving"]["dual"]["kv_quant"]["policy_id"] == POLICY.id
        assert RedisStore(own.url).audit() == []
        # An operator's activation ends the loss.
        r = httpx.put(srv.url + "/admin/active/dual", json={"method": "kivi", "bits": 4}, headers=ADMIN)
        assert r.status_code == 200
        assert metric_sum(metrics(srv.url), "dllm_store_active_lost", cache_mode="dual") == 0
    finally:
        srv.stop()
        own.stop()
