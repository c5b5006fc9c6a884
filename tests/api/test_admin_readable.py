"""Admin answers are indented for command-line clients (curl, Wget, HTTPie) and compact for programs; the server
logs one start-up line naming the model, its fingerprint, the store and the active configurations."""

from __future__ import annotations

import json
import logging

import pytest
from fastapi.testclient import TestClient

from service.config import Settings
from tests.support.apps import ADMIN_KEY, fake_admin_client, fake_app
from tests.support.artifacts import kvquant_state_for
from tests.support.fake_engine import FakeEngine

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("store")


@pytest.fixture(scope="module")
def client(store_dir):
    with fake_admin_client(store_dir) as c:
        yield c


@pytest.mark.parametrize("agent", ["curl/8.5.0", "Wget/1.21.4", "HTTPie/3.2.2"])
def test_terminal_clients_get_indented_json(client, agent):
    r = client.get("/admin/active", headers={**ADMIN, "User-Agent": agent})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.text.endswith("}\n") and '\n  "' in r.text
    assert r.text == json.dumps(r.json(), indent=2, ensure_ascii=False) + "\n"
    assert int(r.headers["content-length"]) == len(r.content)


def test_programs_get_compact_json_and_bytes_stay_bytes(client):
    r = client.get("/admin/active", headers={**ADMIN, "User-Agent": "python-httpx/0.28"})
    assert r.status_code == 200 and "\n" not in r.text
    state = kvquant_state_for(FakeEngine().spec, bits=2)
    assert client.post("/admin/kvquant_states", content=state.to_bytes(), headers=ADMIN).status_code == 201
    raw = client.get(f"/admin/kvquant_states/{state.id}/raw", headers={**ADMIN, "User-Agent": "curl/8.5.0"})
    assert raw.content == state.to_bytes()


def test_not_found_names_the_store(client, store_dir):
    r = client.get("/admin/policies/policy-0000", headers={**ADMIN, "User-Agent": "curl/8.5.0"})
    assert r.status_code == 404 and str(store_dir.resolve()) in r.json()["error"]["message"]


def test_one_start_up_line(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="service.main")
    with TestClient(fake_app(Settings(store_url=str(tmp_path), block_length=4))):
        pass
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("serving ")]
    spec = FakeEngine().spec
    assert spec.fingerprint in line and str(tmp_path.resolve()) in line
    assert "none=unquantized (default)" in line and "dual=unquantized (default)" in line and line.endswith("; ready")
    assert "KV budget " in line
