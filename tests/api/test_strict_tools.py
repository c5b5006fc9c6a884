"""OpenAI's strict mode for tools (``function.strict: true``, issue 35): a schema outside strict mode's subset is a
400 naming ``tools.{i}.function.parameters`` and saying where and why, as OpenAI refuses it; the schemas the agent
frameworks send as strict pass; a strict function's arguments are decoded exactly (the embedded model, in-process:
every required key, no other); a non-strict schema is enforced as given."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from fastapi.testclient import TestClient
from pydantic import BaseModel

from service.api.strict_schema import MAX_NESTING, check_strict
from service.config import Settings
from service.engine import Engine
from service.engine.errors import EngineInputError

FIELD = "tools.0.function.parameters"
USER = [{"role": "user", "content": "copy: 4 1 4 4 2 9 7 4"}]


def strict_object(properties: dict, **extra) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False,
            **extra}


#: Strict-mode schemas OpenAI accepts: nullable optionals, nested objects, arrays, enums, anyOf, $defs and $ref.
NESTED = strict_object({
    "city": {"type": "string", "enum": ["Paris", "Rome"], "description": "where"},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"type": ["string", "null"], "enum": ["C", "F", None]},
    "when": {"type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}},
             "required": ["hour"], "additionalProperties": False},
    "tags": {"type": "array", "items": {"type": "string", "pattern": "^[0-9]{1,3}$"}, "minItems": 1, "maxItems": 2},
    "place": {"anyOf": [{"$ref": "#/$defs/point"}, {"type": "null"}]},
}, **{"$defs": {"point": strict_object({"x": {"type": "number", "minimum": 0, "maximum": 9}})}})


class Point(BaseModel):
    """A nested argument of an agent's tool."""

    x: int
    y: int | None


def deep(levels: int) -> dict:
    node: dict = {"type": "integer"}
    for _ in range(levels):
        node = strict_object({"a": node})
    return node


@pytest.mark.parametrize("schema,where,says", [
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, "the root",
     "additionalProperties: false"),
    ({**strict_object({"a": {"type": "integer"}}), "additionalProperties": True}, "the root", "additionalProperties"),
    ({**strict_object({"a": {"type": "integer"}, "b": {"type": "string"}}), "required": ["a"]}, "the root",
     "missing from required: b"),
    (strict_object({"o": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}),
     "properties.o", "additionalProperties: false"),
    (strict_object({"s": {"type": "string", "minLength": 2}}), "properties.s", ("'minLength' is not supported on "
     "type string")),
    (strict_object({"n": {"type": "integer", "pattern": "x"}}), "properties.n", "'pattern' is not supported"),
    (strict_object({"s": {"allOf": [{"type": "string"}]}}), "properties.s", "'allOf' is not supported"),
    (strict_object({"s": {"oneOf": [{"type": "string"}]}}), "properties.s", "'oneOf' is not supported"),
    (strict_object({"s": {"type": "string", "format": "uri"}}), "properties.s", "format is one of"),
    (strict_object({"l": {"type": "array", "items": strict_object({}, minProperties=1)}}), "properties.l.items",
     "'minProperties' is not supported"),
    ({"anyOf": [strict_object({})], "type": "object", "properties": {}, "required": [], "additionalProperties": False},
     "the root", "not anyOf"),
    (strict_object({"x": {"type": "decimal"}}), "properties.x", "type is one of"),
    (strict_object({"x": True}), "properties.x", "a boolean schema is not supported"),
    (strict_object({"p": {"$ref": "#/$defs/q"}}, **{"$defs": {"q": {"type": "object", "properties": {}}}}),
     "$defs.q", "additionalProperties: false"),
    (deep(MAX_NESTING + 2), "properties.a", f"at most {MAX_NESTING} levels"),
])
def test_a_schema_outside_strict_mode_is_refused_where_it_breaks_a_rule(schema, where, says):
    with pytest.raises(EngineInputError) as refused:
        check_strict(schema, FIELD, "f")
    message = str(refused.value)
    assert refused.value.field == FIELD and says in message and f"(at {where}" in message, message


def test_strict_schemas_openai_accepts_pass():
    for schema in (NESTED, strict_object({}), deep(MAX_NESTING), None):
        check_strict(schema, FIELD, "f")


def test_the_schemas_the_agent_frameworks_send_as_strict_pass():
    """openai-agents sends its ``@function_tool`` schemas with strict: true (pydantic-made: titles, nested models);
    they must pass as they pass at OpenAI."""
    from agents import function_tool

    @function_tool
    def place(name: str, where: Point, tags: list[str]) -> str:
        """Place a pin."""
        return name

    assert place.strict_json_schema
    check_strict(place.params_json_schema, FIELD, place.name)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from service.main import create_app

    torch.set_num_threads(1)
    app = create_app(Settings(store_url=str(tmp_path_factory.mktemp("store"))), engine=Engine.load(None))
    with TestClient(app) as c:
        yield c


def _tool(parameters: dict | None, strict: bool | None, name: str = "f") -> dict:
    function = {"name": name, "strict": strict, **({} if parameters is None else {"parameters": parameters})}
    return {"type": "function", "function": function}


def test_the_refusal_is_a_400_naming_the_parameters_field(client):
    bad = {"type": "object", "properties": {"a": {"type": "integer"}}}
    tools = [_tool(NESTED, True, "good"), _tool(bad, True, "bad")]
    r = client.post("/v1/chat/completions", json={"messages": USER, "tools": tools, "max_tokens": 8})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "tools.1.function.parameters" and error["type"] == "invalid_request_error", error
    assert "function 'bad' is strict" in error["message"] and "additionalProperties: false" in error["message"]
    # The same schema without strict is served (enforced as given).
    tools[1] = _tool(bad, False, "bad")
    assert client.post("/v1/chat/completions", json={"messages": USER, "tools": tools, "max_tokens": 8,
                                                     "tool_choice": "none"}).status_code == 200


@pytest.mark.parametrize("cache_mode", ["none", "dual"])
def test_a_strict_call_is_decoded_exactly(client, cache_mode):
    """Every required key, no other, every value as the schema says (the grammar; the model writes digits)."""
    r = client.post("/v1/chat/completions", json={
        "messages": USER, "tools": [_tool(NESTED, True, "weather")], "tool_choice": "required",
        "parallel_tool_calls": False, "max_tokens": 192, "cache_mode": cache_mode, "n": 2, "temperature": 0.8,
        "seed": 3})
    assert r.status_code == 200, r.text
    done = [c for c in r.json()["choices"] if c["finish_reason"] == "tool_calls"]
    assert done, r.text  # a length cut is possible, never a broken call; two rows give one whole call at least
    for choice in done:
        (call,) = choice["message"]["tool_calls"]
        arguments = json.loads(call["function"]["arguments"])
        jsonschema.validate(arguments, NESTED)
        assert list(arguments) == list(NESTED["properties"]), arguments


def test_a_strict_function_without_parameters_is_called_with_no_arguments(client):
    r = client.post("/v1/chat/completions", json={"messages": USER, "tools": [_tool(None, True, "ping")],
                                                  "tool_choice": "required", "parallel_tool_calls": False,
                                                  "max_tokens": 64})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert [c["function"]["arguments"] for c in choice["message"]["tool_calls"]] == ["{}"]
