"""A LLaDA2 checkpoint with a tokenizer served by ``python -m service serve`` (the real engine and runtime) to the
official openai client, in every cache mode the family takes, with several clients decoding at once."""

from __future__ import annotations

import concurrent.futures

import httpx
import openai
import pytest

from service.engine.block_causal import BlockCausalParams
from service.engine.block_causal_batch import generate
from service.engine.loading import load_checkpoint
from tests.support.llada2 import LLADA2_CHAT, start_llada2_server

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


def test_refusals_are_400_naming_the_field(server):
    body = {"model": "llada2-tiny-chat", "prompt": "w5 w6", "max_tokens": 32}
    for extra, field in (({"logprobs": 2}, "logprobs"), ({"remasking": "random"}, "remasking")):
        response = httpx.post(server.url + "/v1/completions", json={**body, **extra}, timeout=60)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == field


def test_structured_output_and_tool_calls_are_400_naming_the_field_and_the_server_goes_on(server):
    """Structured output and constrained tool calls are refused on LLaDA2 before any grammar is compiled (its
    word-level tokenizer is one the grammar engine cannot read: that was a 500), and the server keeps serving."""
    body = {"model": "llada2-tiny-chat", "messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 32}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    cases = (({"response_format": {"type": "json_object"}}, "response_format"),
             ({"structured_outputs": {"regex": "w[0-9]+"}}, "structured_outputs.regex"),
             ({"tools": [tool], "tool_choice": "required"}, "tools"),
             ({"tools": [tool]}, "tools"))
    for extra, field in cases:
        response = httpx.post(server.url + "/v1/chat/completions", json={**body, **extra}, timeout=60)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == field, response.text
    listed = httpx.post(server.url + "/v1/chat/completions", json={**body, "tools": [tool], "tool_choice": "none"},
                        timeout=60)
    assert listed.status_code == 200, listed.text
