"""DiffusionGemma's preemption over HTTP (real uvicorn, `tests.support.processes.ServerProcess`): with a KV budget
just above one large streamed completion, a small completion sent while it streams preempts it at a canvas
boundary (`service.engine.renoise.RenoisingBatch.preempt`), finishes first, and the large stream goes on with
exactly the chunks (one per committed canvas) it streams alone; ``dllm_preemptions_total`` counts it."""

from __future__ import annotations

import threading

import httpx
import pytest

from service.engine import Engine
from service.engine.params import DecodeParams
from service.runtime.memory import MemoryModel
from service.runtime.scheduler import DEFAULT_MAX_BATCHED_TOKENS, Cost, kv_held
from tests.support.apps import sse_events
from tests.support.llada2 import start_llada2_server
from tests.support.metrics import metric_sum, metrics
from tests.support.paths import REPO

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TINY = REPO / "tests" / "data" / "diffusion_gemma" / "dgemma-tiny"
MODEL = "dgemma-tiny"
LARGE = {"max_tokens": 128, "seed": 11, "max_denoising_steps": 4}
SMALL = {"max_tokens": 16, "seed": 12, "max_denoising_steps": 4}


def _budget(engine: Engine, large: int, small: int) -> int:
    """A budget just above the large request (prompt of ``large`` tokens, 128 response tokens, eight canvases):
    the small one does not fit beside it, as the server costs them (`MemoryModel.cost`, by layer kind)."""
    memory = MemoryModel.for_engine(engine)

    def cost(prompt: int, gen: int) -> Cost:
        params = DecodeParams(gen_length=gen, block_length=16, cache_mode="dual")
        one = memory.cost(prompt, params, 0.0)
        cache = engine.cache_cost(prompt, params, one.kv, False)
        return Cost(cache.kv, one.transient, cache.slot_bytes, cache.slot_columns)

    big, little = cost(large, LARGE["max_tokens"]), cost(small, SMALL["max_tokens"])
    forward = memory.measure_forward(engine, DEFAULT_MAX_BATCHED_TOKENS)
    beside = kv_held([big, little]) - kv_held([big])
    return kv_held([big]) + max(big.transient, forward) + beside // 2


def _stream(url: str, prompt: list[int], on_first=None) -> list[str]:
    """The large completion, streamed: each chunk's text (``on_first`` called at the first one)."""
    body = {"model": MODEL, "prompt": prompt, "stream": True, **LARGE}
    texts = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            events = sse_events([line])
            if not events:
                continue
            texts.append(events[0] if events[0] == "[DONE]" else events[0]["choices"][0]["text"])
            if on_first is not None and len(texts) == 1:
                on_first()
    return texts


def test_a_streamed_request_preempted_at_a_canvas_boundary_streams_as_alone(tmp_path):
    engine = Engine.load(TINY)
    large = [498] + [(7 * i + 3) % 256 for i in range(39)]  # past the 12-token window
    small_prompt = [498, 5, 6, 7, 8, 9, 10, 11, 12]
    budget = _budget(engine, len(large), len(small_prompt))
    srv = start_llada2_server(TINY, tmp_path, DLLM_KV_BUDGET_BYTES=str(budget))
    try:
        alone = _stream(srv.url, large)
        assert metric_sum(metrics(srv.url), "dllm_preemptions_total") == 0
        order: list[str] = []
        small: dict = {}

        def send_small() -> None:
            r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": small_prompt, **SMALL},
                           timeout=300)
            small["status"], small["text"] = r.status_code, r.json()["choices"][0]["text"]
            order.append("small")

        sender = threading.Thread(target=send_small)
        streamed = _stream(srv.url, large, on_first=sender.start)
        order.append("large")
        sender.join()
        samples = metrics(srv.url)
        small_alone = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": small_prompt,
                                                                     **SMALL}, timeout=300).json()
    finally:
        srv.stop()
    assert len(alone) >= 5, alone  # several canvases stream alone
    assert small["status"] == 200 and small["text"] == small_alone["choices"][0]["text"]
    assert metric_sum(samples, "dllm_preemptions_total") == 1, (order, samples)
    assert order == ["small", "large"]  # the small one did not wait for the large one's run
    assert streamed == alone  # every chunk as alone, across the preemption
