"""Grammar limits that hold everywhere (issue 45, item 10): each reproduction of the issue against a real server
(``python -m service serve``, the embedded model), with the answer it must get.

* N2: a ``json_schema`` of 800 optional string properties compiled, then failed at its first token with
  ``structured_output_failed`` and advice about nesting; it is refused while compiling, with the real reason.
* N3: a schema the engine cannot serve took a place in the large compile lane (4 may wait) before it was refused;
  it is refused before, with the engine's reason (eight at once: eight 400s, no 429).
* N4: a tool's parameter schema bypassed the grammar size limit (``"pattern": "(b{1000}){1000}"`` ran to
  ``max_tokens`` with no call; in ``response_format`` it was a 400): a 400 naming the tool's ``parameters``.
* N5: a call nested deeper than the JSON depth the server parses (64) was silently dropped (no ``tool_calls``,
  ``finish_reason`` ``stop``); it is read.
* N6: an enum/const/choice value that spells special-token text (``<|eot_id|>``, the embedded model's EOS) was a 400,
  and for ``<|startoftext|>`` the mask and the matcher disagreed: a value is text, written with text tokens.
"""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]
USER = [{"role": "user", "content": "copy: 1 2"}]
DEPTH = 70  # over service.strict_json.MAX_DEPTH (64) with the call's own two levels


@pytest.fixture(scope="module")
def http(shared_embedded_server):  # tests/conftest.py: one embedded server for the session
    with httpx.Client(base_url=shared_embedded_server.url, timeout=300) as client:
        yield client


def _chat(http, **body) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"model": "embedded", "messages": USER, **body})


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def test_n2_800_optional_properties_refused_while_compiling_with_the_real_reason(http):
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(800)}}
    r = _chat(http, max_tokens=32, response_format=_schema_format(schema))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format.json_schema.schema"
    assert error["code"] != "structured_output_failed" and "nesting" not in error["message"]
    assert "items" in error["message"] and "optional" in error["message"], error
    # 300 optional properties decode (the limit is the engine's, not a count of ours).
    fewer = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(300)}}
    r = _chat(http, max_tokens=32, response_format=_schema_format(fewer))
    assert r.status_code == 200 and isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)


def test_n3_schemas_the_engine_cannot_serve_never_take_the_large_lane(http):
    """Eight concurrent 800-property schemas (each a large grammar: before, each took a place in the large lane,
    whose queue holds 4, and the others were 429 "retry shortly", to be refused after their compile anyway): each
    is a 400 with the engine's reason, found before compiling; none is a 429."""
    def send(i: int) -> httpx.Response:
        schema = {"type": "object", "properties": {f"k{i}_{j}": {"type": "string"} for j in range(800)}}
        return _chat(http, max_tokens=32, response_format=_schema_format(schema))

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(send, range(8)))
    for r in answers:
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "response_format.json_schema.schema", error
        assert "800 optional properties" in error["message"] and "before compiling" in error["message"], error


def test_n4_a_tool_parameter_is_held_to_the_grammar_size_limit(http):
    huge = {"type": "object", "properties": {"s": {"type": "string", "pattern": "(b{1000}){1000}"}},
            "required": ["s"]}
    tools = [{"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "huge", "parameters": huge}}]
    for choice in ("required", "auto", {"type": "function", "function": {"name": "huge"}}):
        r = _chat(http, max_tokens=32, tools=tools, tool_choice=choice)
        assert r.status_code == 400, (choice, r.text)
        error = r.json()["error"]
        assert error["param"] == "tools.1.function.parameters" and "spells out more than" in error["message"]
    # The same schema in response_format: the same limit, the same words.
    r = _chat(http, max_tokens=32, response_format=_schema_format(huge))
    assert r.status_code == 400 and "spells out more than" in r.json()["error"]["message"]


def test_n5_a_call_nested_past_the_parse_depth_is_read(http):
    """The schema forces DEPTH nested arrays through two ``$defs`` entries (as the issue reached it: a body may
    nest at most 64 levels itself, a schema's references do not count)."""

    def arrays(levels: int, inner: dict) -> dict:
        for _ in range(levels):
            inner = {"type": "array", "minItems": 1, "maxItems": 1, "items": inner}
        return inner

    deep = {"type": "object", "properties": {"c": {"$ref": "#/$defs/a"}}, "required": ["c"],
            "additionalProperties": False,
            "$defs": {"a": arrays(DEPTH // 2, {"$ref": "#/$defs/b"}), "b": arrays(DEPTH - DEPTH // 2,
                                                                                 {"type": "integer"})}}
    tools = [{"type": "function", "function": {"name": "deep", "parameters": deep}}]
    r = _chat(http, max_tokens=256, tools=tools, tool_choice="required")
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    value, depth = json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])["c"], 0
    while isinstance(value, list):
        value, depth = value[0], depth + 1
    assert depth == DEPTH and isinstance(value, int)


@pytest.mark.parametrize("value", ["<|eot_id|>", "<|startoftext|>", "<|endoftext|>"])
def test_n6_special_token_text_in_a_value_is_text(http, value):
    for body, expected in (
            ({"response_format": _schema_format({"enum": [value, "x y"]})}, None),
            ({"response_format": _schema_format({"const": value})}, json.dumps(value)),
            ({"guided_choice": [value]}, value),
            ({"response_format": _schema_format({"type": "object", "properties": {"t": {"const": value}},
                                                 "required": ["t"], "additionalProperties": False})},
             json.dumps({"t": value}))):
        r = _chat(http, max_tokens=32, **body)
        assert r.status_code == 200, (body, r.text)
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop", (body, choice)
        content = choice["message"]["content"]
        assert content == expected if expected is not None else json.loads(content) in (value, "x y"), content
    tools = [{"type": "function", "function": {"name": "say", "parameters": {
        "type": "object", "properties": {"t": {"enum": [value]}}, "required": ["t"], "additionalProperties": False}}}]
    r = _chat(http, max_tokens=64, tools=tools, tool_choice="required")
    assert r.status_code == 200, r.text
    assert json.loads(r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]) == {"t": value}
