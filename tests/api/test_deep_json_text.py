"""Issue 36, item 1: JSON text carried inside a request field (a schema sent as a string) is bounded in depth and
size before it is parsed, so 10,000 levels of it are a 400 naming the field, never a ``RecursionError`` (500); the
same nesting sent as JSON objects is refused by the body's own depth limit (the real app and routes around the fake
engine)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from service.config import Settings
from service.engine.grammar import MAX_SOURCE_BYTES
from service.strict_json import MAX_DEPTH
from tests.support.apps import fake_app

LEVELS = 10_000
DEEP_ARRAY = "[" * LEVELS + "]" * LEVELS
DEEP_OBJECT = '{"a":' * LEVELS + "{}" + "}" * LEVELS
MESSAGES = [{"role": "user", "content": "x"}]

# Every request field whose value may be JSON text, and where it goes in the body.
TEXT_FIELDS = {
    "structured_outputs.json": lambda text: {"structured_outputs": {"json": text}},
    "guided_json": lambda text: {"guided_json": text},
}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    settings = Settings(store_url=str(tmp_path_factory.mktemp("store")), block_length=4, default_max_tokens=4)
    with TestClient(fake_app(settings)) as c:
        yield c


def _post(client, route: str, extra: dict):
    base = {"model": "fake-llada", "max_tokens": 4}
    base.update({"messages": MESSAGES} if route == "/v1/chat/completions" else {"prompt": "x"})
    return client.post(route, content=json.dumps({**base, **extra}), headers={"content-type": "application/json"})


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("field", sorted(TEXT_FIELDS))
@pytest.mark.parametrize("text", [DEEP_ARRAY, DEEP_OBJECT], ids=["array", "object"])
def test_deep_json_text_is_a_400_naming_the_field(client, route, field, text):
    r = _post(client, route, TEXT_FIELDS[field](text))
    assert r.status_code == 400, r.text[:500]
    error = r.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error", error
    assert f"nested more than {MAX_DEPTH} levels deep" in error["message"] and field in error["message"], error


@pytest.mark.parametrize("field", sorted(TEXT_FIELDS))
def test_json_text_over_the_size_limit_is_refused_before_parsing(client, field):
    text = json.dumps({"type": "object", "description": "d" * MAX_SOURCE_BYTES})
    error = _post(client, "/v1/completions", TEXT_FIELDS[field](text)).json()["error"]
    assert error["param"] == field and f"over the {MAX_SOURCE_BYTES:,} bytes" in error["message"], error


@pytest.mark.parametrize("extra", [
    {"guided_json": json.loads("[" * 60 + "]" * 60)},  # 61 levels with the body: inside the limit, the wrong type
    {"structured_outputs": {"json": "[" * 30 + "]" * 30}},
])
def test_shallow_json_text_is_judged_as_a_schema(client, extra):
    """Within the limits, the text is parsed and judged (a list is not a schema) rather than refused as deep."""
    r = _post(client, "/v1/completions", extra)
    assert r.status_code == 400 and "levels deep" not in r.text, r.text[:500]


@pytest.mark.parametrize("where", ["guided_json", "response_format"])
def test_deep_objects_in_the_body_are_refused_by_the_body_limit(client, where):
    """The object form of the same fields: the body's depth limit refuses it before any schema is built."""
    extra = ({"guided_json": 0} if where == "guided_json" else
             {"response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": 0}}})
    text = json.dumps({"model": "fake-llada", "prompt": "x", **extra}).replace(": 0}", ": " + DEEP_OBJECT + "}", 1)
    r = client.post("/v1/completions", content=text, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "levels deep" in r.json()["error"]["message"], r.text[:500]
