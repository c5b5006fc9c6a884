"""Preemption over HTTP (issue 36 item 5; LLaDA2 too, issue 42): ``python -m service serve`` on the embedded model
(and on the tiny LLaDA2) with a memory budget just above one large streamed completion; a small completion sent while it streams preempts it at a block boundary,
finishes first, and the large stream goes on with exactly the chunks it has alone; ``dllm_preemptions_total``
counts it (read with prometheus_client's parser)."""

from __future__ import annotations

import threading

import httpx
import pytest

from service.config import Settings
from service.engine import Engine
from service.engine.params import DecodeParams
from service.runtime.memory import MemoryModel
from service.runtime.scheduler import DEFAULT_MAX_BATCHED_TOKENS, Cost, kv_held
from tests.support.apps import sse_events
from tests.support.metrics import metric_sum, metrics
from tests.support.processes import embedded_server

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _costs(engine: Engine, large: int, small: int) -> int:
    """A budget just above the large request (prompt of ``large`` tokens, 256 response tokens): the small one
    (``small`` tokens, 32) does not fit beside it, as the server costs them (full precision, dual cache, as the
    family holds them: `Engine.cache_cost`, `service.runtime.scheduler.kv_held`)."""
    memory = MemoryModel.for_engine(engine)
    spec = engine.spec
    per_token = 2.0 * spec.num_layers * spec.num_kv_heads * spec.head_dim * memory.element_size

    def cost(prompt: int, gen: int) -> Cost:
        params = DecodeParams(gen_length=gen, block_length=32, cache_mode="dual")
        one = memory.cost(prompt, params, per_token)
        cache = engine.cache_cost(prompt, params, one.kv, False)
        return Cost(cache.kv, one.transient, cache.slot_bytes, cache.slot_columns)

    big, little = cost(large, 256), cost(small, 32)
    forward = memory.measure_forward(engine, DEFAULT_MAX_BATCHED_TOKENS)
    # The large request's block-initial passes are split by layers (the default DLLM_LAYER_SPLIT_TOKENS): it holds
    # its hidden states between pieces beside its KV (`Worker._cost`).
    held = memory.hidden_bytes(large + 256) if large + 256 > Settings.model_fields["layer_split_tokens"].default else 0
    beside = kv_held([big, little]) - kv_held([big])  # what the small one adds beside it
    return kv_held([big]) + held + max(big.transient, forward) + beside // 2


def _stream(url: str, prompt: list[int], on_first=None, model: str = "embedded", ignore_eos: bool = True
            ) -> list[str]:
    """The large completion, streamed: each chunk's text (``on_first`` called at the first one)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 256, "ignore_eos": ignore_eos, "stream": True}
    texts = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():  # one line at a time: on_first runs while the stream goes on
            events = sse_events([line])
            if not events:
                continue
            event = events[0]
            if event == "[DONE]":
                texts.append(event)
                continue
            texts.append(event["choices"][0]["text"])
            if on_first is not None and len(texts) == 1:
                on_first()
    return texts


def test_a_streamed_request_preempted_for_a_small_one_streams_as_alone(tmp_path):
    engine = Engine.load(None)
    digits = engine.tokenizer.encode(" 4 1 4 4 2 9 7 4 3 2 8 3" * 90, add_special_tokens=False)[:1000]
    small_prompt = engine.tokenizer.encode("copy: 4 1 4 4 2 9 7 4 3 2 8 3 3 8 5 9 9 6", add_special_tokens=False)
    budget = _costs(engine, len(digits), len(small_prompt))
    with embedded_server(tmp_path, "preempt", DLLM_KV_BUDGET_BYTES=str(budget)) as srv:
        alone = _stream(srv.url, digits)
        assert metric_sum(metrics(srv.url), "dllm_preemptions_total") == 0
        order: list[str] = []
        small: dict = {}

        def send_small() -> None:
            r = httpx.post(srv.url + "/v1/completions", json={"model": "embedded", "prompt": small_prompt,
                                                                "max_tokens": 32, "ignore_eos": True}, timeout=300)
            small["status"] = r.status_code
            order.append("small")

        sender = threading.Thread(target=send_small)
        streamed = _stream(srv.url, digits, on_first=sender.start)
        order.append("large")
        sender.join()
        samples = metrics(srv.url)
    assert small["status"] == 200
    assert metric_sum(samples, "dllm_preemptions_total") == 1, (order, samples)
    assert order == ["small", "large"]  # the small one did not wait for the large one's run
    assert metric_sum(samples, "dllm_preemptions_total") == 1
    assert streamed == alone and len(streamed) >= 5  # every chunk as alone, across the preemption


def test_a_streamed_llada2_request_preempted_for_a_small_one_streams_as_alone(tmp_path):
    """The same on the tiny LLaDA2 (issue 42: every family under the same preemption), its default cache mode
    (dual, decoded in block); no ignore_eos (LLaDA2 refuses it): the prompt is one the tiny model answers past 256
    tokens without an EOS, which the test checks alone first."""
    from tests.support.llada2 import LLADA2_CHAT, start_llada2_server

    engine = Engine.load(LLADA2_CHAT)
    digits = [5 + i % 40 for i in range(600)]
    small_prompt = [5 + i % 7 for i in range(9)]
    budget = _costs(engine, len(digits), len(small_prompt))
    srv = start_llada2_server(LLADA2_CHAT, tmp_path, DLLM_KV_BUDGET_BYTES=str(budget))
    try:
        model = "llada2-tiny-chat"
        alone = _stream(srv.url, digits, model=model, ignore_eos=False)
        order: list[str] = []
        small: dict = {}

        def send_small() -> None:
            r = httpx.post(srv.url + "/v1/completions", json={"model": model, "prompt": small_prompt,
                                                                "max_tokens": 32}, timeout=300)
            small["status"] = r.status_code
            order.append("small")

        sender = threading.Thread(target=send_small)
        streamed = _stream(srv.url, digits, on_first=sender.start, model=model, ignore_eos=False)
        order.append("large")
        sender.join()
        samples = metrics(srv.url)
    finally:
        srv.stop()
    assert len(alone) >= 5, alone  # the large answer streams several blocks alone
    assert small["status"] == 200
    assert metric_sum(samples, "dllm_preemptions_total") == 1, (order, samples)
    assert order == ["small", "large"]
    assert streamed == alone
