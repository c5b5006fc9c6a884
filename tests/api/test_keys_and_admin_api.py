"""API keys on the serving routes, and the admin routes for KVQuant states (upload validated against the model,
read, raw bytes, activate, refuse deletion while active), in-process with a fake engine and a directory store."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from service.config import Settings
from tests.support.apps import ADMIN_KEY, fake_app
from tests.support.artifacts import kvquant_state_for, policy_for
from tests.support.fake_engine import FakeEngine

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
SPEC = FakeEngine().spec


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    settings = Settings(store_url=str(tmp_path_factory.mktemp("store")), block_length=4, admin_key=ADMIN_KEY,
                        api_keys=["user-key-1", "user-key-2"])
    with TestClient(fake_app(settings)) as c:
        yield c


def test_api_keys_guard_serving_routes_not_health(client):
    body = {"prompt": "ab", "max_tokens": 4}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert client.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
    assert client.post("/v1/completions", json=body, headers={"Authorization": "Bearer user-key-2"}).status_code == 200
    assert client.post("/generate", json=body).status_code == 401
    assert client.get("/health/ready").status_code == 200 and client.get("/metrics").status_code == 200
    # The admin key is not an API key, and an API key is not the admin key.
    assert client.get("/admin/policies", headers={"Authorization": "Bearer user-key-1"}).status_code == 401


def test_kvquant_state_upload_read_activate_delete(client):
    wrong = kvquant_state_for(SPEC, num_layers=SPEC.num_layers + 1)
    r = client.post("/admin/kvquant_states", content=wrong.to_bytes(), headers=ADMIN)
    assert r.status_code == 422 and r.json()["error"]["param"] == "num_layers"
    r = client.post("/admin/kvquant_states", content=b"not safetensors", headers=ADMIN)
    assert r.status_code == 422
    assert client.get("/admin/kvquant_states", headers=ADMIN).json()["data"] == []

    state = kvquant_state_for(SPEC, bits=2)
    r = client.post("/admin/kvquant_states", content=state.to_bytes(), headers=ADMIN)
    assert r.status_code == 201 and r.json()["id"] == state.id
    assert client.get(f"/admin/kvquant_states/{state.id}", headers=ADMIN).json()["bits"] == 2
    assert client.get(f"/admin/kvquant_states/{state.id}/raw", headers=ADMIN).content == state.to_bytes()

    r = client.put("/admin/active/dual", json={"method": "kvquant", "bits": 4, "kvquant_state_id": state.id},
                   headers=ADMIN)
    assert r.status_code == 422 and r.json()["error"]["param"] == "kv_quant.bits"
    first = client.put("/admin/active/dual", json={"method": "kivi", "bits": 2}, headers=ADMIN)
    # The store had no entry: old is null, as the audit entry says; this replica served its kv_quant setting,
    # which has no bits (the unquantized cache).
    assert first.status_code == 200 and first.json()["old"] is None
    assert first.json()["served_before"] == {"method": "none"}
    assert client.get("/admin/audit", headers=ADMIN).json()[0]["old"] is None
    r = client.put("/admin/active/dual", json={"method": "kvquant", "bits": 2, "kvquant_state_id": state.id},
                   headers=ADMIN)
    assert r.status_code == 200 and r.json()["old"] == client.get("/admin/audit", headers=ADMIN).json()[0]["old"]
    assert r.json()["old"]["method"] == "kivi" == r.json()["served_before"]["method"]
    # Old and new read with the same keys: a reference is written only when set, under the method's spelling.
    assert set(r.json()["new"]) - set(r.json()["old"]) == {"kvquant_state_id"}
    assert "artifact_id" not in r.json()["old"] and "artifact_file" not in r.json()["old"]
    gen = client.post("/generate", json={"prompt": "ab", "max_tokens": 4}, headers={"Authorization": "Bearer user-key-1"})
    assert gen.json()["kv_config"]["kv_quant"]["kvquant_state_id"] == state.id
    assert client.delete(f"/admin/kvquant_states/{state.id}", headers=ADMIN).status_code == 409
    assert client.put("/admin/active/dual", json={"method": "none"}, headers=ADMIN).status_code == 200
    assert client.delete(f"/admin/kvquant_states/{state.id}", headers=ADMIN).status_code == 204
    assert client.get(f"/admin/kvquant_states/{state.id}", headers=ADMIN).status_code == 404
    assert client.get("/admin/widgets", headers=ADMIN).json()["error"]["param"] == "kind"
    audit = client.get("/admin/audit", headers=ADMIN).json()
    assert [a["new"]["method"] for a in audit] == ["none", "kvquant", "kivi"]


def test_a_downloaded_policy_uploads_as_it_is_and_its_id_is_checked(client):
    policy = policy_for(SPEC, bits=2)
    assert client.post("/admin/policies", content=policy.to_json(), headers=ADMIN).status_code == 201
    downloaded = client.get(f"/admin/policies/{policy.id}", headers=ADMIN).json()
    assert downloaded["id"] == policy.id
    r = client.post("/admin/policies", json=downloaded, headers=ADMIN)
    assert r.status_code == 201 and r.json()["id"] == policy.id
    # An id that is not the content's is refused and nothing is stored under it.
    r = client.post("/admin/policies", json=downloaded | {"bits": 4}, headers=ADMIN)
    assert r.status_code == 422 and r.json()["error"]["param"] == "id"
    ids = [a["id"] for a in client.get("/admin/policies", headers=ADMIN).json()["data"]]
    assert ids == [policy.id]


@pytest.mark.parametrize(("body", "param"), [
    ({"method": "none", "key_bias_correction": True}, "key_bias_correction"),
    ({"method": "kivi", "bits": 2, "policy_id": "policy-x"}, "policy_id"),
    ({"method": "dllm_kvq", "bits": 2}, "policy_id"),
])
def test_an_activation_that_breaks_a_rule_across_fields_names_the_field(client, body, param):
    """An activation body is a `KVQuantConfig`: a rule between its fields names the field to fix, with no
    pydantic "Value error," in the message; a request's ``kv_quant`` names it under ``kv_quant``."""
    r = client.put("/admin/active/dual", json=body, headers=ADMIN)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and not error["message"].startswith("Value error"), error
    r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 4, "kv_quant": body},
                    headers={"Authorization": "Bearer user-key-1"})
    assert r.status_code == 400 and r.json()["error"]["param"] == f"kv_quant.{param}", r.text


def test_activating_block_says_it_is_served_by_prefix(client):
    """``block`` (LLaDA2's cache mode) holds no configuration of its own: the 400 says which one it serves."""
    r = client.put("/admin/active/block", json={"method": "kivi", "bits": 4}, headers=ADMIN)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "cache_mode" and "PUT /admin/active/prefix" in error["message"], error


def test_a_bad_kv_quant_method_is_named_without_pydantics_prefix(client):
    """Issue 45 item 6: an unknown ``kv_quant.method`` (activation body, request field, the commands' one-line
    messages) says what is legal, without pydantic's "Value error," in front."""
    from pydantic import ValidationError

    from service.commands import describe_validation_error
    from service.quant.config import KVQuantConfig
    from service.store.base import describe_invalid

    legal = "unknown method 'bogus'; input should be 'none', 'kivi', 'kvquant' or 'dllm_kvq'"
    r = client.put("/admin/active/dual", json={"method": "bogus"}, headers=ADMIN)
    assert r.status_code == 400 and r.json()["error"]["message"] == f"method: {legal}", r.text
    r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 4, "kv_quant": {"method": "bogus"}},
                    headers={"Authorization": "Bearer user-key-1"})
    assert r.status_code == 400 and r.json()["error"]["message"] == f"kv_quant.method: {legal}", r.text
    with pytest.raises(ValidationError) as refused:
        KVQuantConfig(method="bogus")
    assert describe_validation_error(refused.value) == describe_invalid(refused.value) == f"method: {legal}"
