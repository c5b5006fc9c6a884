"""A cache mode whose configuration cannot be served is not ready and says why (issue 17): a server started on a
store whose active entry names an artifact fitted on other weights (written past the checks, as a raw Redis write
or an older tool would), or with a ``DLLM_KV_QUANT`` setting naming a policy the store lacks, answers
``/health/ready`` 503 naming the cache mode, refuses that mode's requests with a 503 ``config_unavailable``
instead of a 500 or a quiet fallback, serves the other modes, and becomes ready when a valid configuration is
activated. A real uvicorn process on the fake engine, a directory store."""

from __future__ import annotations

import time

import httpx
import pytest

from service.store.base import ActiveEntry, open_store
from tests.support.apps import ADMIN_KEY
from tests.support.artifacts import policy_for
from tests.support.fake_engine import FakeEngine
from tests.support.metrics import metric_sum, metrics
from tests.support.processes import ServerProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FACTORY = "tests.support.apps:fake_app_from_env"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
SPEC = FakeEngine().spec


def server(tmp_path, **env) -> ServerProcess:
    return ServerProcess({"DLLM_STORE_URL": str(tmp_path / "store"), "DLLM_ADMIN_KEY": ADMIN_KEY,
                          "DLLM_BLOCK_LENGTH": "4", **env}, FACTORY,
                         log_path=tmp_path / "server.log").start(ready=False)


def complete(srv: ServerProcess, cache_mode: str) -> httpx.Response:
    return httpx.post(srv.url + "/v1/completions", json={"model": "fake-llada", "prompt": "abc", "max_tokens": 4,
                                                         "cache_mode": cache_mode}, timeout=30)


def test_an_active_entry_for_other_weights_makes_its_cache_mode_not_ready(tmp_path):
    store = open_store(str(tmp_path / "store"))
    foreign = policy_for(SPEC, fingerprint="0" * 64)  # fitted on another checkpoint
    store.put_model("policy", foreign)
    # Past the checks (Store.set_active would refuse it): what a hand-written Redis entry leaves behind.
    store._swap_active(ActiveEntry(fingerprint=SPEC.fingerprint, cache_mode="dual", set_at=time.time(),
                                   config={"method": "dllm_kvq", "bits": 4, "policy_id": foreign.id}))
    srv = server(tmp_path)
    try:
        r = httpx.get(srv.url + "/health/ready")
        assert r.status_code == 503, r.text
        message = r.json()["error"]["message"]
        assert "cache mode dual" in message and "weights_fingerprint" in message and "prefix" not in message
        refused = complete(srv, "dual")
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "config_unavailable", refused.text
        assert "weights_fingerprint" in refused.json()["error"]["message"]
        assert complete(srv, "prefix").status_code == 200  # the other modes serve on
        m = metrics(srv.url)
        assert metric_sum(m, "dllm_config_ready", cache_mode="dual") == 0
        assert metric_sum(m, "dllm_config_ready", cache_mode="prefix") == 1
        assert metric_sum(m, "dllm_ready") == 0
        view = httpx.get(srv.url + "/admin/active", headers=ADMIN).json()
        assert "weights_fingerprint" in view["not_ready"]["dual"] and "dual" not in view["serving"]

        r = httpx.put(srv.url + "/admin/active/dual", json={"method": "kivi", "bits": 4}, headers=ADMIN)
        assert r.status_code == 200, r.text
        assert httpx.get(srv.url + "/health/ready").status_code == 200
        assert complete(srv, "dual").status_code == 200
        assert metric_sum(metrics(srv.url), "dllm_config_ready", cache_mode="dual") == 1
        assert "Traceback" not in srv.log()
    finally:
        srv.stop()


def test_a_kv_quant_setting_naming_a_missing_policy_is_not_ready_where_it_applies(tmp_path):
    srv = server(tmp_path, DLLM_KV_QUANT='{"method": "dllm_kvq", "bits": 4, "policy_id": "policy-missing"}')
    try:
        r = httpx.get(srv.url + "/health/ready")
        assert r.status_code == 503
        message = r.json()["error"]["message"]
        assert "cache mode dual" in message and "cache mode prefix" in message and "policy-missing" in message
        assert complete(srv, "none").status_code == 200  # cache mode none is always unquantized
        assert complete(srv, "prefix").json()["error"]["code"] == "config_unavailable"
        # A valid policy activated for each mode makes the server ready.
        for mode in ("dual", "prefix"):
            table = policy_for(SPEC, cache_mode=mode)
            assert httpx.post(srv.url + "/admin/policies", content=table.to_json(), headers=ADMIN).status_code == 201
            body = {"method": "dllm_kvq", "bits": 4, "k_group_size": 32, "policy_id": table.id}
            assert httpx.put(srv.url + f"/admin/active/{mode}", json=body, headers=ADMIN).status_code == 200
        assert httpx.get(srv.url + "/health/ready").status_code == 200
        assert complete(srv, "prefix").status_code == 200
    finally:
        srv.stop()
