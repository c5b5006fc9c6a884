"""Tool calling over HTTP (issue 35), in-process: the real app and routes around the embedded model (TestClient).
Refusals name the field; a forced call comes back as ``message.tool_calls`` whose arguments validate, under every
cache mode, a quantized KV cache, n > 1 and with logprobs; streamed, each call goes out as OpenAI streams one and
adds up to the same answer; a ``max_tokens`` no call fits is a 400, never a broken call; a conversation carrying calls
and results is rendered (the generic format) and answered.

The openai client against a real server process: ``tests/structured/test_tool_server.py``."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from fastapi.testclient import TestClient

from service.config import Settings
from service.engine import Engine
from service.engine.prompts import encode_chat
from service.engine.tool_format import Function, generic_turns
from tests.support.apps import sse_events

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": WEATHER,
                                           "strict": True}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
USER = [{"role": "user", "content": "copy: 4 1 4 4 2 9 7 4"}]


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    return Engine.load(None)


@pytest.fixture(scope="module")
def client(engine, tmp_path_factory):
    from service.main import create_app

    app = create_app(Settings(store_url=str(tmp_path_factory.mktemp("store"))), engine=engine)
    with TestClient(app) as c:
        yield c


def _chat(client, **body):
    r = client.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS, "max_tokens": 64, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _valid_calls(message: dict) -> list[tuple[str, dict]]:
    calls = []
    for call in message["tool_calls"]:
        assert call["type"] == "function" and call["id"].startswith("call_")
        arguments = json.loads(call["function"]["arguments"])
        jsonschema.validate(arguments, SCHEMAS[call["function"]["name"]])
        calls.append((call["function"]["name"], arguments))
    return calls


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools"),
    ({"tools": []}, "tools"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools.1.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {f"p{i}": {"type": "string", "description": "d" * 64} for i in range(1200)}}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}}}]}, "tools.0.function.parameters"),
    ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nope"}}}}}]}, "tools.1.function.parameters"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tool_choice": "required", "tools": None}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    # An object tool_choice is told what is wrong with it, not that it is none of the strings.
    ({"tool_choice": {"type": "function"}}, "tool_choice.function"),
    ({"tool_choice": {"type": "allowed_tools", "function": {"name": "add"}}}, "tool_choice.type"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"guided_regex": "[0-9]+", "tool_choice": "required"}, "guided_regex"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages.0.tool_calls"),
    ({"messages": [*USER, {"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {
        "name": "add", "arguments": "[1, 2]"}}]}]}, "messages.1.tool_calls.0.function.arguments"),
    ({"messages": [*USER, {"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {
        "name": "add", "arguments": '{"a": ' + "[" * 100 + "]" * 100 + "}"}}]}]},
     "messages.1.tool_calls.0.function.arguments"),
])
def test_refusals_name_the_field(client, body, param):
    r = client.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS, "max_tokens": 8, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


@pytest.mark.parametrize("cache_mode,kv_quant", [
    ("none", None), ("prefix", None), ("dual", None), ("dual", {"method": "kivi", "bits": 2, "k_group_size": 32}),
], ids=["none", "prefix", "dual", "dual-kivi2"])
def test_a_required_call_comes_back_valid(client, cache_mode, kv_quant):
    answer = _chat(client, tool_choice="required", parallel_tool_calls=False, n=2, temperature=0.7, seed=5,
                   logprobs=True, cache_mode=cache_mode, kv_quant=kv_quant)
    assert len(answer["choices"]) == 2
    for choice in answer["choices"]:
        assert choice["finish_reason"] == "tool_calls", choice
        assert choice["message"]["content"] is None and len(_valid_calls(choice["message"])) == 1
        assert len(choice["logprobs"]["content"]) > 0
    assert answer["usage"]["completion_tokens"] == sum(len(c["logprobs"]["content"]) for c in answer["choices"])


def test_a_named_call_streams_as_openai_streams_it_and_adds_up(client):
    body = {"tool_choice": {"type": "function", "function": {"name": "add"}}, "seed": 1}
    whole = _chat(client, **body)["choices"][0]
    assert whole["finish_reason"] == "tool_calls" and [n for n, _ in _valid_calls(whole["message"])] == ["add"]
    r = client.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS, "max_tokens": 64, "stream": True,
                                                  "stream_options": {"include_usage": True}, **body})
    events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] > 0
    pieces = [c["choices"][0]["delta"]["tool_calls"] for c in events[:-2] if "tool_calls" in c["choices"][0]["delta"]]
    first, rest = pieces[0][0], pieces[1:]
    assert set(first) == {"index", "id", "type", "function"} and first["function"] == {"name": "add", "arguments": ""}
    assert all(set(p[0]) == {"index", "function"} and set(p[0]["function"]) == {"arguments"} for p in rest)
    arguments = "".join(p[0]["function"]["arguments"] for p in rest)
    assert arguments == whole["message"]["tool_calls"][0]["function"]["arguments"]
    assert events[-3]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_a_max_tokens_no_call_fits_is_a_400_never_a_cut_call(client, tool_choice):
    """A forced call cut by ``max_tokens`` (12 tokens; 4, inside its marker ``<tool_``) came back as ``length``
    with no call (issue 35); since issue 45 a ``max_tokens`` no complete call fits is refused before decoding,
    streamed or not, with the least that fits (`service.engine.grammar`), and at that least the call is whole."""
    for max_tokens, stream in ((4, False), (12, True)):
        r = client.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS, "tool_choice": tool_choice,
                                                      "max_tokens": max_tokens, "stream": stream})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "max_tokens" and "cannot hold a complete response to tools" in error["message"]
    least = int(error["message"].rsplit("at least ", 1)[1])
    choice = _chat(client, tool_choice=tool_choice, max_tokens=least)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and _valid_calls(choice["message"]), choice


def test_a_conversation_with_calls_and_results(client, engine):
    """call -> result -> answer: the conversation is rendered in the generic format (the embedded template knows
    no tools) and answered; the prompt is the generic turns through the chat template."""
    first = _chat(client, tool_choice="required")["choices"][0]["message"]
    call = first["tool_calls"][0]
    messages = [*USER, first, {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21 C"}]
    final = _chat(client, messages=messages, tool_choice="none")
    assert final["choices"][0]["finish_reason"] in ("stop", "length")
    assert isinstance(final["choices"][0]["message"]["content"], str)
    assert "tool_calls" not in final["choices"][0]["message"]
    functions = [Function(t["function"]["name"], t["function"].get("description"), t["function"]["parameters"])
                 for t in TOOLS]
    turns = generic_turns([USER[0], {"role": "assistant", "content": None, "tool_calls": [
        {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}]},
        {"role": "tool", "content": "sunny, 21 C"}], functions)
    assert final["usage"]["prompt_tokens"] == len(encode_chat(engine.tokenizer, turns, "embedded"))


def test_auto_lets_the_model_answer_in_text(client):
    """The digit model answers a digit task in digits: under auto that is text, not a call."""
    choice = _chat(client, tool_choice="auto")["choices"][0]
    assert choice["finish_reason"] in ("stop", "length")
    if "tool_calls" in choice["message"]:
        _valid_calls(choice["message"])
    else:
        assert isinstance(choice["message"]["content"], str) and choice["message"]["content"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_never_cuts_a_forced_call(client, stream):
    """``}`` occurs in every call: under ``required`` it would leave no call and no content with finish_reason
    ``stop``; the call is the grammar's to end, so the stop string does not apply."""
    body = {"tool_choice": {"type": "function", "function": {"name": "add"}}, "stop": ["}", "add"],
            "parallel_tool_calls": False}
    if stream:
        r = client.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS, "max_tokens": 64,
                                                      "stream": True, **body})
        assert r.status_code == 200, r.text
        events = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
        finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
        names = [t["function"]["name"] for e in events for c in e["choices"]
                 for t in (c["delta"].get("tool_calls") or []) if t.get("function", {}).get("name")]
        assert finish == ["tool_calls"] and names == ["add"], events
        return
    choice = _chat(client, **body)["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert [name for name, _ in _valid_calls(choice["message"])] == ["add"]


def test_tokenize_renders_tools_as_chat_does(client, engine):
    """``/tokenize`` takes ``tools`` with chat messages (vLLM's ``TokenizeChatRequest``) and returns the prompt
    chat completions decodes from for the same messages and tools (the strict tool's parameters as strict mode
    reads them); a ``prompt`` of messages (lm-eval's remote tokenizer) renders the same."""
    r = client.post("/tokenize", json={"messages": USER, "tools": TOOLS})
    assert r.status_code == 200, r.text
    tokens = r.json()
    assert tokens["count"] == _chat(client, tool_choice="none", max_tokens=8)["usage"]["prompt_tokens"]
    assert tokens["count"] == _chat(client, tool_choice="required", max_tokens=64)["usage"]["prompt_tokens"]
    functions = [Function(t["function"]["name"], t["function"].get("description"), t["function"]["parameters"])
                 for t in TOOLS]
    assert tokens["tokens"] == encode_chat(engine.tokenizer, generic_turns(USER, functions), "embedded")
    assert tokens["count"] > client.post("/tokenize", json={"messages": USER}).json()["count"]
    assert client.post("/tokenize", json={"prompt": USER, "tools": TOOLS}).json() == tokens


@pytest.mark.parametrize("body,param", [
    ({"prompt": "copy: 4 1", "tools": TOOLS}, "tools"),
    ({"messages": USER, "tools": [TOOLS[0], TOOLS[0]]}, "tools.1.function.name"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools.0.function.parameters"),
    ({"messages": USER, "tools": []}, "tools"),
])
def test_tokenize_refuses_tools_as_chat_does(client, body, param):
    r = client.post("/tokenize", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_tools_that_put_the_prompt_over_the_context_are_named(client):
    """A tool description that puts the prompt over the model's context is a 400 naming ``tools`` (the messages
    alone fit); messages over the context without their tools still name ``messages``."""
    huge = [{"type": "function", "function": {"name": "f", "description": "word " * 2000}}]
    r = client.post("/v1/chat/completions", json={"messages": USER, "tools": huge, "max_tokens": 8})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "tools" and error["type"] == "invalid_request_error", error
    assert "tools' rendered text" in error["message"] and "context of 4096" in error["message"], error
    long_user = [{"role": "user", "content": "word " * 2000}]
    for tools in (TOOLS, huge):
        r = client.post("/v1/chat/completions", json={"messages": long_user, "tools": tools, "max_tokens": 8})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
