"""The tool-call format (`service.engine.tool_format`): the generic rendering of a conversation with tools, the
call grammar (compiled by llguidance for the embedded tokenizer: what it takes and refuses), and reading calls
back, whole or cut. No model forward."""

from __future__ import annotations

import json

import pytest

from service.engine.grammar import GrammarCompiler, GrammarSpec
from service.engine.loading import EMBEDDED_DIR, load_tokenizer
from service.engine.prompts import encode_chat, knows_tools
from service.engine.tool_format import (
    CALL_OPEN,
    Function,
    call_grammar,
    call_text,
    generic_turns,
    parse_calls,
    starts_as_call,
)

WEATHER = Function("get_weather", "the weather of a city", {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city"], "additionalProperties": False})
ADD = Function("add", None, {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                             "additionalProperties": False})


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(EMBEDDED_DIR)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))


def _accepts(compiler, grammar: str, text: str) -> bool:
    """Whether the grammar takes ``text`` whole (every token, then the end)."""
    state = compiler.compile(GrammarSpec.lark(grammar, "tools")).start()
    for token in compiler.tokenizer(text, add_special_tokens=False)["input_ids"]:
        if not state.matcher.consume_token(token):
            return False
    return state.accepting


def test_generic_turns_list_tools_write_calls_and_merge_results():
    turns = generic_turns([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [{"name": "get_weather", "arguments": '{"city": "Paris"}'},
                                                              {"name": "get_weather", "arguments": '{"city": "Rome"}'}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "a"},
        {"role": "tool", "content": "rain", "tool_call_id": "b"},
    ], [WEATHER])
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "user"]
    assert turns[0]["content"].startswith("Be brief.\n\n") and json.dumps(WEATHER.declared()) in turns[0]["content"]
    assert turns[2]["content"] == (call_text("get_weather", '{"city": "Paris"}') + "\n"
                                   + call_text("get_weather", '{"city": "Rome"}'))
    assert turns[3]["content"] == "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
    # No system turn: one is added; no tools: none is listed.
    assert generic_turns([{"role": "user", "content": "x"}], [ADD])[0]["role"] == "system"
    assert generic_turns([{"role": "user", "content": "x"}], []) == [{"role": "user", "content": "x"}]


@pytest.mark.parametrize("parallel,text_allowed,text,taken", [
    (False, False, call_text("get_weather", '{"city": "Paris", "days": 3}'), True),
    (False, False, call_text("get_weather", '{"city": "Paris"}'), True),
    (False, False, call_text("get_weather", '{"city": "Paris", "days": 9}'), False),  # over the maximum
    (False, False, call_text("get_weather", '{"town": "Paris"}'), False),  # a key the schema does not have
    (False, False, call_text("get_time", '{"city": "Paris"}'), False),  # a function not offered
    (False, False, call_text("add", '{"a": 1}') + "\n" + call_text("add", '{"a": 2}'), False),  # one call only
    (True, False, call_text("add", '{"a": 1}') + "\n" + call_text("add", '{"a": 2}'), True),
    (False, False, "It is sunny.", False),
    (False, True, "It is sunny.", True),
    (False, True, "<tool_cal is text", True),
    (False, True, CALL_OPEN + "not a call", False),  # under auto, the marker starts a call, and only a call
    (False, True, call_text("add", '{"a": 1}'), True),
])
def test_the_call_grammar(compiler, parallel, text_allowed, text, taken):
    assert _accepts(compiler, call_grammar([WEATHER, ADD], parallel, text_allowed), text) is taken


def test_reading_calls_whole_and_cut():
    one, two = call_text("add", '{"a": 1}'), call_text("get_weather", '{"city": "R\\u00f6m"}')
    calls, complete = parse_calls(one + "\n" + two)
    assert complete and [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1}),
                                                                               ("get_weather", {"city": "Röm"})]
    for cut in (len(one) + 1 + len(two) - 3, len(one) + 5, len(one) + 1):  # inside the second call
        calls, complete = parse_calls((one + "\n" + two)[:cut])
        assert not complete and [c.name for c in calls] == ["add"]
    assert parse_calls("plain text") == ([], False)
    assert parse_calls(CALL_OPEN + '{"name": "add", "arguments": [1]}\n</tool_call>') == ([], False)
    assert starts_as_call("") and starts_as_call("<tool") and starts_as_call(one) and not starts_as_call("<b>")


def test_a_template_that_knows_tools_renders_them(tokenizer):
    """A checkpoint whose template takes ``tools`` gets them (and OpenAI-shaped calls); the served templates do
    not, and use the generic turns."""
    assert not knows_tools(tokenizer)
    aware = load_tokenizer(EMBEDDED_DIR)
    aware.chat_template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}"
                           "{{ m.role }}:{{ m.content }}{% for c in m.tool_calls or [] %}({{ c.function.name }} "
                           "{{ c.function.arguments.a }}){% endfor %};{% endfor %}")
    assert knows_tools(aware)
    messages = [{"role": "user", "content": "x"},
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                    "name": "add", "arguments": {"a": 7}}}]}]
    ids = encode_chat(aware, messages, "aware", add_generation_prompt=False, tools=[ADD.declared()])
    assert aware.decode(ids) == "[add]user:x;assistant:(add 7);"
