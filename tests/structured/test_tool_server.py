"""Tool calling through a real server (``python -m service serve``, the embedded model, the suite's Redis) and the
clients that speak OpenAI's contract, unchanged (issue 35): the official openai client (a forced call, streamed
and not, and a loop call -> tool result -> final answer), the openai-agents SDK (an ``Agent`` with a
``@function_tool`` on an OpenAI-compatible chat model) and pydantic-ai (an ``OpenAIChatModel`` whose structured
output is its output tool). The embedded model knows only digits and cannot choose tools well: the point is the
contract (the call is made, parsed into OpenAI's fields, and its arguments validate)."""

from __future__ import annotations

import json
from typing import Annotated

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.support.processes import embedded_server

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD, "strict": True}}]
USER = [{"role": "user", "content": "sum: 1 2 3 4"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with embedded_server(tmp_path_factory.mktemp("tools"), "tools") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_a_forced_call_streamed_and_not(client):
    done = client.chat.completions.create(model="embedded", messages=USER, tools=TOOLS, tool_choice="required",
                                          max_tokens=64, seed=3)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.function.name == "add" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), ADD)

    # The SDK's own accumulation of a stream (what agent frameworks use) gives the same call.
    with client.chat.completions.stream(model="embedded", messages=USER, tools=TOOLS, max_tokens=64, seed=3,
                                        tool_choice={"type": "function", "function": {"name": "add"}}) as stream:
        final = stream.get_final_completion()
    streamed = final.choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert streamed.message.tool_calls[0].function.arguments == call.function.arguments


def test_a_loop_call_result_answer(client):
    first = client.chat.completions.create(model="embedded", messages=USER, tools=TOOLS, tool_choice="required",
                                           max_tokens=64)
    call = first.choices[0].message.tool_calls[0]
    arguments = json.loads(call.function.arguments)
    messages = [*USER, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": str(arguments["a"] + arguments["b"])}]
    final = client.chat.completions.create(model="embedded", messages=messages, tools=TOOLS, max_tokens=32)
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    message = final.choices[0].message
    assert message.content or message.tool_calls


def test_the_openai_agents_sdk_unchanged(server):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)  # nothing leaves the machine
    calls = []

    @agents.function_tool
    def add(a: Annotated[int, Field(ge=0, le=99)], b: Annotated[int, Field(ge=0, le=99)]) -> int:
        """Add two numbers."""
        calls.append((a, b))
        return a + b

    model = agents.OpenAIChatCompletionsModel(
        model="embedded", openai_client=openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused"))
    agent = agents.Agent(name="adder", instructions="Add the numbers.", tools=[add], model=model,
                         model_settings=agents.ModelSettings(tool_choice="required", max_tokens=64))
    # The SDK resets tool_choice to auto after a call, so the second turn may answer in text.
    result = agents.Runner.run_sync(agent, "sum: 1 2 3 4", max_turns=4)
    assert calls and all(0 <= a <= 99 and 0 <= b <= 99 for a, b in calls)
    assert isinstance(result.final_output, str)


class Ledger(BaseModel):
    op: Annotated[str, Field(pattern="^(copy|next|sum)$")]
    digits: Annotated[list[Annotated[int, Field(ge=0, le=9)]], Field(min_length=1, max_length=4)]


def test_pydantic_ai_unchanged(server):
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel("embedded", provider=OpenAIProvider(base_url=server.url + "/v1", api_key="unused"))
    # A structured output is pydantic-ai's output tool, called under tool_choice required.
    agent = Agent(model, output_type=Ledger, model_settings={"max_tokens": 64})
    result = agent.run_sync("copy: 4 1 4 4")
    assert isinstance(result.output, Ledger)
