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
