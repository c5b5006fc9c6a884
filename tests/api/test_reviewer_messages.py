"""A reviewer's findings on error messages (issue 35's follow-ups): each names the field the client sent and says
what this server's model takes (the real app and routes around the fake engine, a bidirectional LLaDA)."""

from __future__ import annotations

import pytest

from service.store.base import open_store
from tests.support.apps import fake_admin_client
from tests.support.artifacts import policy_for
from tests.support.fake_engine import FakeEngine

USER = [{"role": "user", "content": "w1"}]


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """A client over a directory store holding one policy fitted for the dual cache, and the policy's id."""
    store_dir = tmp_path_factory.mktemp("store")
    table = policy_for(FakeEngine().spec, cache_mode="dual", bits=4)
    policy_id = open_store(str(store_dir)).put("policy", table.to_bytes(), table.id)
    with fake_admin_client(store_dir) as client:
        yield client, policy_id


def error(response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_a_policy_of_another_cache_mode_names_the_cache_mode_the_client_sent(stored):
    """Was param kv_quant.cache_mode, a field no request has (the resolver's name for the mode it checks)."""
    client, policy_id = stored
    kv = {"method": "dllm_kvq", "bits": 4, "policy_id": policy_id}
    sent = error(client.post("/v1/chat/completions", json={"messages": USER, "cache_mode": "prefix", "kv_quant": kv}),
                 422)
    assert sent["param"] == "cache_mode" and sent["message"].startswith(
        f"cache_mode: cache_mode 'prefix' does not fit kv_quant.policy_id '{policy_id}'"), sent
    assert "the artifact has 'dual'" in sent["message"]
    # Not sent: the mode is the server's default, so the client's field at fault is the policy's id.
    settings_default = client.app.state.settings.cache_mode
    assert settings_default == "dual"
    client.app.state.settings.cache_mode = "prefix"
    try:
        default = error(client.post("/v1/chat/completions", json={"messages": USER, "kv_quant": kv}), 422)
    finally:
        client.app.state.settings.cache_mode = settings_default
    assert default["param"] == "kv_quant.policy_id" and "server's default 'prefix'" in default["message"], default
    # The mode it was fitted for is served.
    assert client.post("/v1/chat/completions", json={"messages": USER, "cache_mode": "dual", "kv_quant": kv,
                                                     "max_tokens": 4}).status_code == 200


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
                                  {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
                                  {"type": "file", "file": {"file_id": "file-1"}}])
def test_an_image_or_audio_part_is_refused_at_its_index(stored, part):
    """Was 'messages.0.content: Input should be a valid string' (the union's first branch)."""
    client, _ = stored
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "w1"}, part]}]
    refused = error(client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4}))
    assert refused["param"] == "messages.1.content.1", refused
    assert f"content part 1 is of type '{part['type']}'" in refused["message"]
    assert "image, audio and file parts are not supported" in refused["message"]
    assert "valid string" not in refused["message"]


def test_text_parts_are_still_taken_and_a_malformed_one_is_still_refused(stored):
    client, _ = stored
    parts = [{"type": "text", "text": "w1"}, {"type": "text", "text": " w2"}]
    assert client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": parts}],
                                                     "max_tokens": 4}).status_code == 200
    refused = error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
        {"type": "text"}]}], "max_tokens": 4}))
    assert refused["param"].startswith("messages.0.content"), refused


@pytest.mark.parametrize("mode", ["bogus", "full", 3])
def test_an_unknown_cache_mode_says_which_modes_this_model_takes(stored, mode):
    """Was "Input should be 'none', 'prefix', 'dual' or 'block'", and 'block' is then refused on this model."""
    client, _ = stored
    for route, body in (("/v1/chat/completions", {"messages": USER}), ("/v1/completions", {"prompt": "w1"})):
        refused = error(client.post(route, json={**body, "cache_mode": mode, "max_tokens": 4}))
        assert refused["param"] == "cache_mode", refused
        assert refused["message"].endswith("this llada model takes none, prefix or dual"), refused
        assert "'block'" not in refused["message"]
    block = error(client.post("/v1/completions", json={"prompt": "w1", "cache_mode": "block", "max_tokens": 4}))
    assert block["param"] == "cache_mode" and block["message"].endswith("this llada model takes none, prefix or dual")


def test_the_published_schema_lists_this_models_cache_modes(stored):
    client, _ = stored
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    for request in ("CompletionRequest", "ChatCompletionRequest", "GenerateRequest"):
        mode = schemas[request]["properties"]["cache_mode"]
        assert _enum(mode) == ["none", "prefix", "dual"], (request, mode)


def test_dreams_schedule_is_refused_on_another_family(stored):
    """``dream_schedule`` ``block`` (Dream's block-wise no-cache schedule) sent to this LLaDA model was accepted and
    ignored: a 400 naming it; ``origin`` (the default) is still taken, and the published schema lists only it."""
    client, _ = stored
    for route, body in (("/v1/chat/completions", {"messages": USER}), ("/v1/completions", {"prompt": "w1"}),
                        ("/generate", {"prompt": "w1"})):
        for mode in ("none", "dual"):
            refused = error(client.post(route, json={**body, "dream_schedule": "block", "cache_mode": mode,
                                                     "max_tokens": 4}))
            assert refused["param"] == "dream_schedule" and "the served model is not Dream" in refused["message"]
        taken = client.post(route, json={**body, "dream_schedule": "origin", "max_tokens": 4})
        assert taken.status_code == 200, taken.text
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    for request in ("CompletionRequest", "ChatCompletionRequest", "GenerateRequest"):
        assert _enum(schemas[request]["properties"]["dream_schedule"]) == ["origin"], request


def _enum(node: dict) -> list | None:
    """The enum of a (possibly nullable) field's schema."""
    if "enum" in node:
        return node["enum"]
    for branch in node.get("anyOf", ()):
        if "enum" in branch:
            return branch["enum"]
    return None


def test_quantizing_with_cache_mode_none_names_every_mode_that_reuses(stored):
    """The rule said "prefix or dual"; block reuses the cache too, on a block-causal model."""
    client, _ = stored
    refused = error(client.post("/v1/completions", json={"prompt": "w1", "cache_mode": "none", "max_tokens": 4,
                                                         "kv_quant": {"method": "kivi", "bits": 4}}))
    assert refused["param"] == "cache_mode" and "(prefix or dual; block on a block-causal model)" in refused["message"]
