"""The published document states what the server enforces (issue 13), in-process with a fake engine: the loaded
model's values are filled in, and for requests on either side of every rule the document's verdict (JSON Schema
validation of the body) is the server's (2xx or 400). `tests/api/test_schemathesis.py` does the same with
generated requests against a real server process."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from service.config import Settings
from tests.support.apps import fake_app
from tests.support.fake_engine import MASK, OFFSET

jsonschema_rs = pytest.importorskip("jsonschema_rs")  # comes with schemathesis (pip install -e .[test])


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    settings = Settings(store_url=str(tmp_path_factory.mktemp("store")), block_length=4, default_max_tokens=8)
    with TestClient(fake_app(settings)) as c:
        yield c


@pytest.fixture(scope="module")
def doc(client):
    return client.get("/openapi.json").json()


def admits(doc: dict, component: str, body: object) -> bool:
    """Whether the document's schema of ``component`` admits ``body`` (OpenAPI 3.1: JSON Schema 2020-12)."""
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$ref": f"#/components/schemas/{component}",
              "components": doc["components"]}
    return jsonschema_rs.validator_for(schema).is_valid(body)


def test_the_loaded_models_values_are_filled_in(client, doc):
    spec = client.app.state.serving.spec
    schemas = doc["components"]["schemas"]
    assert "x-from-server" not in json.dumps(doc)
    completion = schemas["CompletionRequest"]["properties"]
    assert completion["max_tokens"]["anyOf"][0]["maximum"] == spec.max_length - 1
    assert completion["block_length"]["anyOf"][0]["maximum"] == spec.max_length - 1
    ids = completion["prompt"]["anyOf"][2]
    assert ids["maxItems"] == spec.max_length - 1
    assert ids["items"]["maximum"] == spec.vocab_size - 1 and ids["items"]["not"] == {"const": spec.mask_id}
    assert completion["model"]["anyOf"][0]["enum"] == ["fake-llada"]
    # Integers beyond 2**53 are written exactly (FastAPI's document model types bounds as floats).
    assert completion["seed"]["anyOf"][0]["minimum"] == -(1 << 63)
    served = schemas["ServedKVQuantConfig"]["allOf"][1]["properties"]
    assert served["k_group_size"] == {"maximum": spec.max_length}
    assert served["v_group_size"]["anyOf"][0]["enum"] == [1, 2, 4, 8]  # the divisors of head_dim 8
    assert completion["kv_quant"]["anyOf"][0]["$ref"].endswith("/ServedKVQuantConfig")
    assert schemas["EvalScoreReport"]["properties"]["kv_quant"]["$ref"].endswith("/KVQuantConfig")
    kind = doc["paths"]["/admin/{kind}"]["get"]["parameters"][0]["schema"]
    assert sorted(kind["enum"]) == ["kvquant_states", "policies"]
    assert doc["paths"]["/admin/audit"]["get"]["security"] == [{"adminKey": []}]


PROMPT = {"prompt": [OFFSET, OFFSET + 1], "max_tokens": 4}
# (route, component, body): each rule on both sides; the server's verdict must equal the document's.
CASES = [
    ("/v1/completions", "CompletionRequest", body) for body in [
        PROMPT,
        {**PROMPT, "prompt": "ab"},
        {**PROMPT, "prompt": ""},
        {**PROMPT, "prompt": []},
        {**PROMPT, "prompt": [[]]},
        {**PROMPT, "prompt": [OFFSET, MASK]},
        {**PROMPT, "prompt": [OFFSET, 128]},
        {**PROMPT, "prompt": [OFFSET, 127 if MASK != 127 else 126]},
        {**PROMPT, "max_tokens": 8.0, "seed": 3.0},
        {**PROMPT, "max_tokens": 1.5},
        {**PROMPT, "max_tokens": "8"},
        {**PROMPT, "max_tokens": 512},
        {**PROMPT, "top_p": 1}, {**PROMPT, "top_p": 1.0}, {**PROMPT, "top_p": 0.5},
        {**PROMPT, "n": 1}, {**PROMPT, "n": 2}, {**PROMPT, "n": True},
        {**PROMPT, "echo": False}, {**PROMPT, "echo": 0}, {**PROMPT, "echo": True},
        {**PROMPT, "echo": True, "max_tokens": 0}, {**PROMPT, "max_tokens": 0}, {**PROMPT, "echo": True, "stream": True},
        {**PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0, "mc_num": 4}, {**PROMPT, "mc_num": 4},
        {**PROMPT, "logprobs": None}, {**PROMPT, "logprobs": 0}, {**PROMPT, "logprobs": 21}, {**PROMPT, "suffix": "x"},
        {**PROMPT, "n": 8}, {**PROMPT, "n": 9},
        {**PROMPT, "logit_bias": {}}, {**PROMPT, "logit_bias": {"1": 1.0}},
        {**PROMPT, "frequency_penalty": 0}, {**PROMPT, "frequency_penalty": 0.5},
        {**PROMPT, "steps": 1}, {**PROMPT, "steps": 1, "threshold": 0.5}, {**PROMPT, "steps": 1, "threshold": None},
        {**PROMPT, "threshold": "0.5"},
        {**PROMPT, "stream": True, "stream_options": {"include_usage": True}},
        {**PROMPT, "stream_options": {"include_usage": True}},
        {**PROMPT, "cache_mode": "none", "kv_quant": {"method": "kivi"}},
        {**PROMPT, "cache_mode": "none", "kv_quant": {"method": "none"}},
        {**PROMPT, "cache_mode": "prefix", "kv_quant": {"method": "kivi", "bits": 2}},
        {**PROMPT, "kv_quant": {"method": "kivi", "v_group_size": 3}},
        {**PROMPT, "kv_quant": {"method": "none", "k_group_size": 513}},
        {**PROMPT, "kv_quant": {"method": "kivi", "artifact_id": "x"}},
        {**PROMPT, "kv_quant": {"method": "dllm_kvq", "policy_file": "/etc/passwd"}},
        {**PROMPT, "kv_quant": {"method": "dllm_kvq", "policy_id": "bad id"}},
        {**PROMPT, "kv_quant": {"method": "dllm_kvq"}},
        {**PROMPT, "model": "fake-llada"}, {**PROMPT, "model": "gpt-4"},
        # LLaDA2.1's token editing: refused by a family that does not edit, null only in its document (issue 45).
        {**PROMPT, "editing_threshold": 0.5}, {**PROMPT, "min_transfer": 2}, {**PROMPT, "max_post_steps": None},
        # DiffusionGemma's renoising fields: likewise, refused by a family that does not renoise.
        {**PROMPT, "max_denoising_steps": 4}, {**PROMPT, "t_max": 0.5}, {**PROMPT, "entropy_bound": None},
        {**PROMPT, "return_token_ids": True}, {**PROMPT, "return_token_ids": True, "stream": True},
    ]
] + [
    ("/v1/chat/completions", "ChatCompletionRequest", {"messages": [{"role": "user", "content": "ab"}], **extra})
    for extra in [
        {}, {"max_tokens": 4, "max_completion_tokens": 4}, {"max_completion_tokens": 4},
        {"modalities": ["text"]}, {"modalities": []}, {"response_format": {"type": "text"}},
        # (JSON cannot be written in the fake model's alphabet, no "{": a regex and a choice it can write.)
        {"structured_outputs": {"regex": "[a-z]{3}"}}, {"structured_outputs": {"choice": ["yes", "no"]}},
        {"tools": []}, {"tools": [{"type": "function"}]},
        {"tool_choice": "none"}, {"tool_choice": "auto"}, {"logprobs": False}, {"logprobs": True},
        {"top_logprobs": 0}, {"top_logprobs": 1}, {"logprobs": True, "top_logprobs": 2},
        {"logprobs": True, "top_logprobs": 21}, {"store": False}, {"store": True}, {"audio": {}},
    ]
] + [
    ("/generate", "GenerateRequest", body) for body in [
        {"prompt": "ab", "chat": True}, {"prompt": [OFFSET], "chat": True}, {"prompt": [OFFSET]},
        {"prompt": "ab", "chat": 1},
    ]
] + [
    ("/tokenize", "TokenizeRequest", body) for body in [
        {"prompt": "ab"}, {"prompt": ""}, {}, {"prompt": "a", "messages": [{"role": "user", "content": "b"}]},
        {"messages": [{"role": "user", "content": "b"}]}, {"prompt": None, "messages": None},
        {"prompt": [{"role": "user", "content": "b"}], "add_special_tokens": False}, {"prompt": []},
        {"prompt": [{"role": "robot", "content": "b"}]},
    ]
] + [
    ("/detokenize", "DetokenizeRequest", body) for body in [
        {"tokens": [OFFSET]}, {"tokens": [128]}, {"tokens": [-1]}, {"tokens": []},
    ]
]


def _stated_in_words(route: str, body: dict) -> tuple[str, str] | None:
    """The rule of the operation's description (not of its schema) that ``body`` breaks, if any, and the field it
    names: chat's ``top_logprobs`` needs ``logprobs`` = true, and its ``tool_choice`` other than none needs
    ``tools`` (as schema ``allOf`` s they made schemathesis' generator give up on the operation,
    `service.api.schemas.ChatCompletionRequest`)."""
    from service.api.schemas import TOOL_CHOICE_RULE, TOP_LOGPROBS_RULE

    if route == "/v1/chat/completions" and body.get("top_logprobs") is not None and body.get("logprobs") is not True:
        return TOP_LOGPROBS_RULE, "top_logprobs"
    if route == "/v1/chat/completions" and body.get("tool_choice") not in (None, "none") and not body.get("tools"):
        return TOOL_CHOICE_RULE, "tool_choice"
    return None


@pytest.mark.parametrize("route,component,body", CASES, ids=[f"{r}:{json.dumps(b)[:60]}" for r, _, b in CASES])
def test_the_document_and_the_server_agree(client, doc, route, component, body):
    r = client.post(route, json=body)
    assert r.status_code in (200, 400, 404), r.text  # 404: an unknown model
    stated = _stated_in_words(route, body)
    if stated is not None:  # the document states it in the operation's description; the server refuses, naming it
        rule, param = stated
        assert rule in doc["paths"][route]["post"]["description"] and admits(doc, component, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param and rule in r.text
        return
    assert (r.status_code == 200) == admits(doc, component, body), r.text
