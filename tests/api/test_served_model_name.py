"""``DLLM_SERVED_MODEL_NAME``: the name ``/v1/models`` lists and responses carry, and which requests may name; its
default (a checkpoint directory's name, a hub id whole). The app is the real one around the fake engine, whose
checkpoint id is ``fake-llada``."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from service.config import Settings, served_model_name
from tests.support.apps import fake_app


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    settings = Settings(store_url=str(tmp_path_factory.mktemp("store")), served_model_name="llada-tiny",
                        block_length=4, default_max_tokens=8)
    with TestClient(fake_app(settings)) as c:
        yield c


def test_the_setting_is_the_listed_name(client):
    assert [card["id"] for card in client.get("/v1/models").json()["data"]] == ["llada-tiny"]


@pytest.mark.parametrize("named", ["llada-tiny", "fake-llada"])
def test_requests_may_name_the_served_name_or_the_checkpoint_and_answer_with_the_served_name(client, named):
    r = client.post("/v1/chat/completions", json={"model": named, "max_tokens": 8,
                                                  "messages": [{"role": "user", "content": "ab"}]})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "llada-tiny"


def test_any_other_name_is_a_404_that_names_the_served_one(client):
    r = client.post("/v1/completions", json={"model": "model", "prompt": "ab", "max_tokens": 8})
    assert r.status_code == 404
    assert "'llada-tiny'" in r.json()["error"]["message"]


def test_the_environment_variable_sets_it(monkeypatch, tmp_path):
    monkeypatch.setenv("DLLM_SERVED_MODEL_NAME", "llada-tiny")
    assert served_model_name(Settings(store_url=str(tmp_path)), "/model") == "llada-tiny"
    monkeypatch.setenv("DLLM_SERVED_MODEL_NAME", "")  # empty, as compose passes an unset .env line: the default
    assert served_model_name(Settings(store_url=str(tmp_path)), "GSAI-ML/LLaDA-8B-Instruct") == (
        "GSAI-ML/LLaDA-8B-Instruct")


def test_default_is_a_directory_name_or_the_hub_id_whole(tmp_path, monkeypatch):
    settings = Settings(store_url=str(tmp_path / "store"))
    checkpoint = tmp_path / "llada-tiny"
    checkpoint.mkdir()
    assert served_model_name(settings, f"{checkpoint}/") == "llada-tiny"
    monkeypatch.chdir(checkpoint)
    assert served_model_name(settings, ".") == "llada-tiny"
    # Not a directory here: a hub repo id, served under the id the user gave (as vLLM does).
    assert served_model_name(settings, "GSAI-ML/LLaDA-8B-Instruct") == "GSAI-ML/LLaDA-8B-Instruct"
    assert served_model_name(settings, "embedded") == "embedded"


@pytest.mark.parametrize("named", ["llada-tiny", "fake-llada"])
def test_retrieving_the_model_by_name_answers_its_card(client, named):
    """``GET /v1/models/{model}`` (the openai client's ``models.retrieve``): the card ``/v1/models`` lists, under
    the served name; was a bare 404 "Not Found" for every name."""
    r = client.get(f"/v1/models/{named}")
    assert r.status_code == 200, r.text
    card = r.json()
    assert card["id"] == "llada-tiny" and card["object"] == "model"
    assert card["max_model_len"] == client.get("/v1/models").json()["data"][0]["max_model_len"]


def test_retrieving_another_model_is_a_404_that_names_the_served_one(client):
    r = client.get("/v1/models/org/other-model")  # a hub id holds a slash
    assert r.status_code == 404
    assert r.json()["error"]["param"] == "model" and "'llada-tiny'" in r.json()["error"]["message"]
