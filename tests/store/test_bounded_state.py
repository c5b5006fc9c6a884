"""Issue 22, findings 7 and 8: state that only grew. Per-artifact metric series are bounded and dropped on delete,
the admission memo is bounded, a deleted artifact stops serving on every replica (two real server processes on
each store: the Redis event names it, the directory store's poll reloads), metric labels from admin input are
checked (``eval_scores`` with a NUL in its task was accepted), and no answer shows a path of the host."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest

from service.engine.kv_store import FullPrecisionKVStore
from service.quant.config import KVQuantConfig
from service.runtime.memory import PER_TOKEN_KEEP, MemoryModel
from service.store.redis_store import RedisStore
from service.telemetry import ARTIFACT_SERIES_KEEP, Telemetry
from tests.support.apps import ADMIN_KEY
from tests.support.artifacts import policy_for
from tests.support.fake_engine import FakeEngine
from tests.support.metrics import metrics
from tests.support.processes import SHARED_REDIS_URL, ServerProcess

FACTORY = "tests.support.apps:fake_app_from_env"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
SPEC = FakeEngine().spec


def series(telemetry: Telemetry, name: str) -> int:
    return sum(1 for m in telemetry.registry.collect() for sample in m.samples if sample.name == name)


def test_per_artifact_series_are_bounded_and_dropped_on_delete():
    telemetry = Telemetry()
    for i in range(300):  # the attack pass named 300 stored policies
        telemetry.observe_shadow(KVQuantConfig(method="dllm_kvq", bits=4, artifact_id=f"policy-{i}"), "dual", 1.0,
                                 True)
    assert series(telemetry, "dllm_shadow_requests_total") == ARTIFACT_SERIES_KEEP
    text = telemetry.render().decode()
    assert 'policy="policy-299"' in text and 'policy="policy-0"' not in text
    telemetry.forget_artifact("policy-299")
    assert 'policy="policy-299"' not in telemetry.render().decode()
    assert series(telemetry, "dllm_shadow_requests_total") == ARTIFACT_SERIES_KEEP - 1


def test_the_admission_memo_is_bounded():
    memory = MemoryModel.for_engine(FakeEngine())
    for i in range(PER_TOKEN_KEEP + 50):  # one entry per distinct kv_quant a client names
        memory.kv_bytes_per_token(("config", i), lambda: FullPrecisionKVStore())
    assert len(memory._per_token) == PER_TOKEN_KEEP


def complete(srv: ServerProcess, policy_id: str) -> httpx.Response:
    return httpx.post(srv.url + "/v1/completions", timeout=30, json={
        "model": "fake-llada", "prompt": "abc", "max_tokens": 4, "cache_mode": "dual",
        "kv_quant": {"method": "dllm_kvq", "bits": 4, "k_group_size": 32, "policy_id": policy_id}})


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["redis", "dir"])
def test_a_deleted_artifact_stops_serving_on_every_replica(tmp_path, backend):
    prefix = f"test-bounded-{uuid.uuid4().hex[:8]}"
    url = SHARED_REDIS_URL if backend == "redis" else str(tmp_path / "store")
    env = {"DLLM_STORE_URL": url, "DLLM_STORE_PREFIX": prefix, "DLLM_ADMIN_KEY": ADMIN_KEY,
           "DLLM_BLOCK_LENGTH": "4", "DLLM_SHADOW_RATE": "1.0"}
    a = ServerProcess(env, FACTORY, log_path=tmp_path / "a.log").start()
    b = None
    try:
        b = ServerProcess(env, FACTORY, log_path=tmp_path / "b.log").start()
        policy = policy_for(SPEC)
        assert httpx.post(a.url + "/admin/policies", content=policy.to_json(), headers=ADMIN).status_code == 201
        for srv in (a, b):  # both load and cache it, and label series with it
            assert complete(srv, policy.id).status_code == 200
        assert any(dict(labels).get("policy") == policy.id for _, labels in metrics(b.url))
        assert httpx.delete(a.url + f"/admin/policies/{policy.id}", headers=ADMIN).status_code == 204
        deadline = time.monotonic() + 60  # a hang guard: replica b hears of the delete or never does
        while complete(b, policy.id).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        for srv in (a, b):
            r = complete(srv, policy.id)
            assert r.status_code == 404 and r.json()["error"]["code"] == "artifact_not_found", r.text
            assert not any(dict(labels).get("policy") == policy.id for _, labels in metrics(srv.url))
    finally:
        for srv in (a, b):
            if srv is not None:
                srv.stop()
        if backend == "redis":
            RedisStore(SHARED_REDIS_URL, prefix=prefix).delete_everything()


@pytest.mark.integration
@pytest.mark.slow
def test_eval_score_labels_are_checked_and_no_answer_shows_a_host_path(tmp_path):
    policy_file = tmp_path / "secret-dir" / "policy.json"
    srv = ServerProcess({"DLLM_STORE_URL": str(tmp_path / "store"), "DLLM_ADMIN_KEY": ADMIN_KEY,
                         "DLLM_BLOCK_LENGTH": "4",
                         "DLLM_KV_QUANT": f'{{"method": "dllm_kvq", "bits": 4, "policy_file": "{policy_file}"}}'},
                        FACTORY, log_path=tmp_path / "paths.log").start(ready=False)
    try:
        report = {"task": "gsm8k", "scores": {"exact_match,strict-match": 0.5}, "cache_mode": "dual"}
        assert httpx.post(srv.url + "/admin/eval_scores", json=report, headers=ADMIN).status_code == 201
        for bad in ({"task": "gsm\x008k"}, {"task": "t" * 129}, {"scores": {"acc\nfake_metric 1": 1.0}}):
            r = httpx.post(srv.url + "/admin/eval_scores", json=report | bad, headers=ADMIN)
            assert r.status_code == 400 and r.json()["error"]["param"] in ("task", "scores.acc\nfake_metric 1"), r.text
        assert "gsm\x008k" not in httpx.get(srv.url + "/metrics").text
        # The DLLM_KV_QUANT policy_file makes prefix and dual not ready: their answers do not show the path.
        answers = [httpx.get(srv.url + "/health/ready"), httpx.get(srv.url + "/v1/models"),
                   httpx.get(srv.url + "/openapi.json"),
                   httpx.post(srv.url + "/v1/completions", json={"model": "fake-llada", "prompt": "a",
                                                                 "max_tokens": 4, "cache_mode": "dual"})]
        assert answers[0].status_code == 503 and answers[3].status_code == 503
        assert answers[3].json()["error"]["code"] == "config_unavailable"
        for r in answers:
            assert str(tmp_path) not in r.text, r.text[:500]
        assert answers[1].json()["data"][0]["root"] == answers[1].json()["data"][0]["id"]
    finally:
        srv.stop()


def test_stored_bytes_are_never_echoed_in_a_422(tmp_path):
    """An artifact whose stored bytes are not a policy (the attack pass's ``b'\\x00\\xffnot...'``), named by an
    activation and by a request: 422 naming the field, without the bytes."""
    from fastapi.testclient import TestClient

    from service.config import Settings
    from service.store.base import open_store
    from tests.support.apps import fake_app

    stored = b"\x00\xffnot a policy at all"
    open_store(str(tmp_path / "store")).put("policy", stored, artifact_id="garbage-1")
    config = {"method": "dllm_kvq", "bits": 4, "k_group_size": 32, "policy_id": "garbage-1"}
    with TestClient(fake_app(Settings(store_url=str(tmp_path / "store"), admin_key=ADMIN_KEY))) as client:
        answers = [client.put("/admin/active/dual", json=config, headers=ADMIN),
                   client.post("/v1/completions", json={"model": "fake-llada", "prompt": "a", "max_tokens": 4,
                                                        "cache_mode": "dual", "kv_quant": config})]
    for r in answers:
        assert r.status_code == 422 and r.json()["error"]["param"] == "kv_quant.policy_id", r.text
        assert "not a policy" not in r.text and "\\u0000" not in r.text and "input_value" not in r.text, r.text
