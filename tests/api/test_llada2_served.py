"""A LLaDA2 checkpoint with a tokenizer served by ``python -m service serve`` (the real engine and runtime) to the
official openai client, in every cache mode the family takes, with several clients decoding at once."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import jsonschema
import openai
import pytest

from service.engine.block_causal import BlockCausalParams
from service.engine.block_causal_batch import generate
from service.engine.loading import load_checkpoint
from tests.support.llada2 import LLADA2_CHAT, start_llada2_server
from tests.support.metrics import metric_sum, metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def checkpoint():
    return LLADA2_CHAT


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    srv = start_llada2_server(checkpoint, tmp_path_factory.mktemp("llada2-server"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_served_in_every_cache_mode_as_the_engine_decodes_alone(client, checkpoint):
    loaded = load_checkpoint(checkpoint)
    prompt = loaded.tokenizer("w5 w6 w7 w8 w9")["input_ids"]
    alone = generate(loaded.model, prompt, BlockCausalParams(gen_length=64, threshold=0.9, steps=32),
                     loaded.spec.mask_id, loaded.spec.eos_ids)
    expected = loaded.tokenizer.decode(alone.generated_ids, skip_special_tokens=True)
    model = client.models.list().data[0].id
    for mode in ("none", "block", "prefix", "dual"):
        out = client.completions.create(model=model, prompt="w5 w6 w7 w8 w9", max_tokens=64,
                                        extra_body={"cache_mode": mode, "threshold": 0.9})
        assert out.choices[0].text == expected, mode
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "w5 w6 w7"}],
                                          max_tokens=32, n=2, temperature=0.7, seed=3)
    assert len(chat.choices) == 2 and chat.usage.completion_tokens > 0
    chunks = list(client.completions.create(model=model, prompt="w5 w6 w7 w8 w9", max_tokens=64, stream=True,
                                            extra_body={"threshold": 0.9}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected


def test_concurrent_clients_decode_as_alone(client):
    model = client.models.list().data[0].id
    prompts = [" ".join(f"w{i + k}" for k in range(3 + i)) for i in range(6)]

    def ask(prompt: str) -> str:
        return client.completions.create(model=model, prompt=prompt, max_tokens=32,
                                         extra_body={"cache_mode": "block"}).choices[0].text

    alone = [ask(p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(ask, prompts))
    assert together == alone


def test_under_a_small_token_budget_requests_share_planned_forwards_and_decode_as_alone(client, tmp_path):
    """LLaDA2 under the runtime's plan (issue 42): with DLLM_MAX_BATCHED_TOKENS 64 concurrent requests' passes
    are grouped into several forwards an iteration, each within the budget, and every answer is as alone."""
    prompts = [" ".join(f"w{i + k}" for k in range(3 + 4 * i)) for i in range(4)]
    model = client.models.list().data[0].id
    alone = [client.completions.create(model=model, prompt=p, max_tokens=32, extra_body={"cache_mode": "block"})
             .choices[0].text for p in prompts]
    srv = start_llada2_server(LLADA2_CHAT, tmp_path, DLLM_MAX_BATCHED_TOKENS="64", DLLM_LAYER_SPLIT_TOKENS="0")
    try:
        small = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        before = metrics(srv.url)

        def ask(prompt: str) -> str:
            return small.completions.create(model=model, prompt=prompt, max_tokens=32,
                                            extra_body={"cache_mode": "block"}).choices[0].text

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(ask, prompts))
        after = metrics(srv.url)
    finally:
        srv.stop()
    assert together == alone
    forwards = (metric_sum(after, "dllm_forwards_per_iteration_sum")
                - metric_sum(before, "dllm_forwards_per_iteration_sum"))
    iterations = (metric_sum(after, "dllm_forwards_per_iteration_count")
                  - metric_sum(before, "dllm_forwards_per_iteration_count"))
    assert forwards > iterations  # some iteration made more than one forward: the plan split the rows


def test_refusals_are_400_naming_the_field(server):
    # Echo with logprobs scores the prompt (the ELBO, not implemented for the block-causal mask).
    body = {"model": "llada2-tiny-chat", "prompt": "w5 w6", "max_tokens": 32}
    for extra, field in (({"remasking": "random"}, "remasking"), ({"echo": True, "logprobs": 1}, "logprobs"),
                         ({"dream_schedule": "block"}, "dream_schedule"), ({"ignore_eos": True}, "ignore_eos")):
        response = httpx.post(server.url + "/v1/completions", json={**body, **extra}, timeout=60)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == field


def test_logprobs_a_json_schema_response_and_a_forced_tool_call(client):
    """What the family brings beside text: log-probabilities of the revealed tokens, a response_format
    json_schema and a forced (named) tool call, both through the grammar-constrained reveal, with the
    checkpoint's chat template (byte-level tokenizer: the grammar engine reads it)."""
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt="w5 w6 w7 w8 w9", max_tokens=64, logprobs=2,
                                    extra_body={"threshold": 0.9})
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == out.usage.completion_tokens > 0
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(top) <= 2 for top in lp.top_logprobs)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    for mode in ("none", "block"):
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "w5 w6"}], max_tokens=64,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
            extra_body={"cache_mode": mode})
        jsonschema.validate(json.loads(chat.choices[0].message.content), schema)
    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "w5 w6"}], max_tokens=64, stream=True, logprobs=True,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}))
    streamed = [c.choices[0] for c in chunks if c.choices]
    jsonschema.validate(json.loads("".join(c.delta.content or "" for c in streamed)), schema)
    entries = [e for c in streamed if c.logprobs is not None for e in c.logprobs.content]
    # The entries cover the streamed text, then the EOS that ended it (kept in the ids, as on every family).
    text = "".join(e.token for e in entries)
    assert text == "".join(c.delta.content or "" for c in streamed) + "<|eot_id|>"
    parameters = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
                  "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "weather", "parameters": parameters}}]
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "w5 w6"}], max_tokens=128, tools=tools,
        tool_choice={"type": "function", "function": {"name": "weather"}}, parallel_tool_calls=False)
    calls = chat.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "weather", chat
    jsonschema.validate(json.loads(calls[0].function.arguments), parameters)
    assert chat.choices[0].finish_reason == "tool_calls"
