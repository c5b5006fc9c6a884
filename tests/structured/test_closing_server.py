"""Constrained output always closes within ``max_tokens`` (issue 45, item 1) and ``strict: true`` on
``response_format`` (item 2), through a real server (``python -m service serve``, the embedded model) and the
clients a user has: the openai-agents SDK and pydantic-ai exactly as the issue ran them (free ``int`` and ``str``
fields, no bounds: before, the embedded model wrote digits until ``max_tokens`` and no call came back), the openai
client for forced calls with free ints, strings, arrays and nested objects at small ``max_tokens``, and
``response_format`` / vLLM's fields. Every output comes back complete and valid (``finish_reason`` ``stop`` or
``tool_calls``); a ``max_tokens`` no complete output fits is a 400 naming ``max_tokens``, before decoding.

The embedded model knows only digits: what it writes inside a free string or number is digits and spaces; the point
is that the grammar's end is always reached in the positions the request has."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel

pytestmark = [pytest.mark.integration, pytest.mark.slow]
USER = [{"role": "user", "content": "sum: 1 2 3 4"}]
FREE_ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"]}
FREE_TEXT = {"type": "object", "properties": {"city": {"type": "string"}, "temp": {"type": "integer"}},
             "required": ["city", "temp"]}
FREE_ARRAY = {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer"}},
                                               "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2}},
              "required": ["xs", "tags"]}
NESTED = {"type": "object", "properties": {"order": {"type": "object", "properties": {
    "id": {"type": "string"}, "lines": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
        "sku": {"type": "string"}, "qty": {"type": "integer"}, "note": {"type": "string"}},
        "required": ["sku", "qty"]}}}, "required": ["id", "lines"]}}, "required": ["order"]}
SCHEMAS = {"free_int": FREE_ADD, "free_str": FREE_TEXT, "arrays": FREE_ARRAY, "nested": NESTED}


@pytest.fixture(scope="module")
def server(shared_embedded_server):  # tests/conftest.py: one embedded server for the session
    return shared_embedded_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _tool(name: str, schema: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": name, "parameters": schema}}]


def _shortest(client, tools) -> int:
    """The smallest ``max_tokens`` the server takes for a forced call of ``tools``, read from its 400."""
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="embedded", messages=USER, tools=tools, tool_choice="required",
                                       max_tokens=1)
    assert bad.value.body["param"] == "max_tokens", bad.value.body
    assert "cannot hold a complete response to tools" in bad.value.body["message"]
    return int(re.search(r"raise max_tokens to at least (\d+)", bad.value.body["message"]).group(1))


def test_the_openai_agents_sdk_example_unchanged(server):
    """The issue's reproduction: ``def add(a: int, b: int) -> int`` under ``tool_choice="required"`` raised
    ``ModelBehaviorError: ... finish_reason='length' but produced no ... tool call``."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)  # nothing leaves the machine
    calls = []

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        calls.append((a, b))
        return a + b

    model = agents.OpenAIChatCompletionsModel(
        model="embedded", openai_client=openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused"))
    agent = agents.Agent(name="adder", instructions="Add the numbers.", tools=[add], model=model,
                         model_settings=agents.ModelSettings(tool_choice="required"))
    result = agents.Runner.run_sync(agent, "sum: 1 2 3 4", max_turns=4)
    assert calls and all(isinstance(a, int) and isinstance(b, int) for a, b in calls)
    assert isinstance(result.final_output, str)


class Plain(BaseModel):
    city: str
    temp: int


def test_pydantic_ai_example_unchanged(server):
    """The issue's reproduction: ``Agent(..., output_type=Plain)`` raised ``OutputTokenLimitExceeded``."""
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel("embedded", provider=OpenAIProvider(base_url=server.url + "/v1", api_key="unused"))
    result = Agent(model, output_type=Plain).run_sync("copy: 4 1 4 4")
    assert isinstance(result.output, Plain)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_forced_calls_close_at_small_max_tokens(client, name):
    """A forced call with free fields at the smallest ``max_tokens`` the server takes, and a little above it, for
    both forms of forcing: the call always comes back whole and valid."""
    tools = _tool("f", SCHEMAS[name])
    least = _shortest(client, tools)
    for max_tokens, choice in ((least, "required"), (least + 5, {"type": "function", "function": {"name": "f"}}),
                               (least + 24, "required")):
        done = client.chat.completions.create(model="embedded", messages=USER, tools=tools, tool_choice=choice,
                                              max_tokens=max_tokens, seed=max_tokens)
        answer = done.choices[0]
        assert answer.finish_reason == "tool_calls", (max_tokens, answer)
        assert done.usage.completion_tokens <= max_tokens
        jsonschema.validate(json.loads(answer.message.tool_calls[0].function.arguments), SCHEMAS[name])


def test_a_max_tokens_no_call_fits_is_a_400_before_decoding(client):
    tools = _tool("add", FREE_ADD)
    least = _shortest(client, tools)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="embedded", messages=USER, tools=tools, max_tokens=least - 1,
                                       tool_choice={"type": "function", "function": {"name": "add"}})
    assert bad.value.body["param"] == "max_tokens" and f"at least {least}" in bad.value.body["message"]


@pytest.mark.parametrize("max_tokens", [24, 40, 96])
def test_response_formats_close(client, max_tokens):
    """json_schema (the issue's schema without additionalProperties: false, whose extra key never ended), json_object,
    and vLLM's regex and choice on completions: complete and valid in every case."""
    schema = {"type": "object", "properties": {"op": {"type": "string"}, "digits": {"type": "array", "items": {
        "type": "integer"}}, "ok": {"type": "boolean"}}, "required": ["op", "digits", "ok"]}
    messages = [{"role": "user", "content": "copy: 4 9 0"}]
    for response_format in ({"type": "json_schema", "json_schema": {"name": "ledger", "schema": schema}},
                            {"type": "json_object"}):
        done = client.chat.completions.create(model="embedded", messages=messages, max_tokens=max_tokens,
                                              response_format=response_format, seed=max_tokens)
        assert done.choices[0].finish_reason == "stop", done.choices[0]
        value = json.loads(done.choices[0].message.content)
        jsonschema.validate(value, schema if response_format["type"] == "json_schema" else {"type": "object"})
    regex = r"[a-z]+@[a-z]+\.(com|org)"
    done = client.completions.create(model="embedded", prompt="next: 1 2", max_tokens=max_tokens,
                                     extra_body={"structured_outputs": {"regex": regex}})
    assert done.choices[0].finish_reason == "stop" and re.fullmatch(regex, done.choices[0].text)
    choices = ["copy", "a much longer choice than max_tokens"]
    done = client.completions.create(model="embedded", prompt="next: 1 2", max_tokens=max_tokens,
                                     extra_body={"guided_choice": choices})
    assert done.choices[0].finish_reason == "stop" and done.choices[0].text in choices


def test_a_response_format_over_max_tokens_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="embedded", prompt="x", max_tokens=8,
                                  extra_body={"structured_outputs": {"regex": r"( [0-9]){48}"}})
    assert bad.value.body["param"] == "max_tokens"
    assert "structured_outputs.regex" in bad.value.body["message"]


def test_strict_response_format_is_checked_as_openai_checks_it(client):
    """Item 2: ``strict: true`` with a plain pydantic ``model_json_schema()`` (no ``additionalProperties: false``)
    is OpenAI's 400, not a 200 whose extra key never ends; the same schema made strict, or sent without ``strict``,
    is served."""
    plain = Plain.model_json_schema()
    messages = [{"role": "user", "content": "copy: 4 9 0"}]
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="embedded", messages=messages, max_tokens=32, response_format={
            "type": "json_schema", "json_schema": {"name": "plain", "schema": plain, "strict": True}})
    body = bad.value.body
    assert body["param"] == "response_format.json_schema.schema"
    assert "response_format json_schema 'plain' is strict" in body["message"]
    assert "additionalProperties: false" in body["message"]
    for schema, strict in (({**plain, "additionalProperties": False}, True), (plain, False)):
        done = client.chat.completions.create(model="embedded", messages=messages, max_tokens=32, response_format={
            "type": "json_schema", "json_schema": {"name": "plain", "schema": schema, "strict": strict}})
        assert done.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(done.choices[0].message.content), schema)
    # What the openai client's parse() sends (its own strict form of the model) is served.
    parsed = client.chat.completions.parse(model="embedded", messages=messages, response_format=Plain, max_tokens=32)
    assert isinstance(parsed.choices[0].message.parsed, Plain)
