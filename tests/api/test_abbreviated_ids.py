"""The admin API takes a policy or KVQuant state id by a prefix that starts no other stored id (as ``git`` and
``docker`` take an abbreviated id), stores and answers the full id, and refuses a prefix that starts several with a
400 listing them."""

from __future__ import annotations

import pytest

from service.store.base import open_store
from tests.support.apps import ADMIN_KEY, fake_admin_client
from tests.support.artifacts import policy_for
from tests.support.fake_engine import FakeEngine

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture
def stored(tmp_path):
    """A directory store with one policy fitted for the fake engine, and its id."""
    table = policy_for(FakeEngine().spec, cache_mode="dual", bits=4)
    return tmp_path, open_store(str(tmp_path)).put("policy", table.to_bytes(), table.id)


def test_read_activate_and_delete_by_unique_prefix(stored):
    store_dir, policy_id = stored
    with fake_admin_client(store_dir) as client:
        r = client.get(f"/admin/policies/{policy_id[:7]}", headers=ADMIN)
        assert r.status_code == 200 and r.json()["id"] == policy_id
        assert client.get(f"/admin/policies/{policy_id[:7]}/raw", headers=ADMIN).content == open_store(
            str(store_dir)).get("policy", policy_id)
        body = {"method": "dllm_kvq", "bits": 4, "policy_id": policy_id[:7]}
        r = client.put("/admin/active/dual", json=body, headers=ADMIN)
        assert r.status_code == 200, r.text
        assert r.json()["new"]["policy_id"] == policy_id
        assert client.get("/admin/active", headers=ADMIN).json()["store"]["dual"]["config"]["policy_id"] == policy_id
        assert client.put("/admin/active/dual", json={"method": "none"}, headers=ADMIN).status_code == 200
        assert client.delete(f"/admin/policies/{policy_id[:7]}", headers=ADMIN).status_code == 204
        assert not open_store(str(store_dir)).exists("policy", policy_id)


def test_an_ambiguous_prefix_is_a_400_listing_the_candidates(stored):
    store_dir, policy_id = stored
    twin = policy_id[:7] + "twin"
    open_store(str(store_dir)).put("policy", open_store(str(store_dir)).get("policy", policy_id), twin)
    with fake_admin_client(store_dir) as client:
        for r in (client.get(f"/admin/policies/{policy_id[:7]}", headers=ADMIN),
                  client.put("/admin/active/dual", json={"method": "dllm_kvq", "bits": 4, "policy_id": policy_id[:7]},
                             headers=ADMIN)):
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["code"] == "ambiguous_id"
            assert f"policy id '{policy_id[:7]}' is ambiguous: it starts 2 ids ({policy_id}, {twin})" in error["message"]
        # A full id is never ambiguous, even where it starts another one.
        assert client.get(f"/admin/policies/{policy_id}", headers=ADMIN).json()["id"] == policy_id
        missing = client.get("/admin/policies/zzzz", headers=ADMIN)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "artifact_not_found"


def test_a_requests_kv_quant_takes_a_unique_prefix_and_refuses_an_ambiguous_one(stored):
    """A request's ``kv_quant.policy_id`` takes an abbreviated id as the admin routes and ``serve --kv-quant`` do
    (it was a 404 "no policy with id" even where the prefix starts one stored id), answers the full id in
    ``kv_config``, and refuses a prefix that starts several with a 400 naming the field (without listing the
    store's ids to a client)."""
    store_dir, policy_id = stored
    body = {"model": FakeEngine().spec.model_id, "prompt": "a", "max_tokens": 4}
    with fake_admin_client(store_dir) as client:
        kv_quant = {"method": "dllm_kvq", "bits": 4, "policy_id": policy_id[:9]}
        r = client.post("/v1/completions", json={**body, "kv_quant": kv_quant})
        assert r.status_code == 200, r.text
        assert r.json()["kv_config"]["kv_quant"]["policy_id"] == policy_id
        open_store(str(store_dir)).put("policy", open_store(str(store_dir)).get("policy", policy_id),
                                       policy_id[:9] + "twin")
        r = client.post("/v1/completions", json={**body, "kv_quant": kv_quant})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["code"], error["param"]) == ("ambiguous_id", "kv_quant.policy_id")
        assert "starts 2 stored policy ids" in error["message"] and policy_id not in error["message"]
        missing = client.post("/v1/completions", json={**body, "kv_quant": {**kv_quant, "policy_id": "zzzz"}})
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "kv_quant.policy_id"
        assert client.post("/v1/completions", json={**body, "kv_quant": {**kv_quant, "policy_id": policy_id}}
                           ).status_code == 200
