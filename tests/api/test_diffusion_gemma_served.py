"""The tiny DiffusionGemma checkpoint served by ``python -m service serve`` (the real engine, runtime and uvicorn)
to the official openai client: completions and chat (the checkpoint's chat template), streaming per committed
canvas, ``n``, ``stop``, ``seed``, ``max_tokens`` not a multiple of the canvas, concurrent clients decoding as
alone, the metrics, and a 400 naming the field for what the family does not define."""

from __future__ import annotations

import concurrent.futures

import httpx
import openai
import pytest
import torch

from service.engine import Engine
from service.engine.loading import load_checkpoint
from service.engine.params import DecodeParams, RowOptions
from tests.support.llada2 import start_llada2_server
from tests.support.metrics import metric_sum, metrics
from tests.support.paths import REPO

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TINY = REPO / "tests" / "data" / "diffusion_gemma" / "dgemma-tiny"
#: The server's default KV budget, its max_batch_size, are untouched: max_denoising_steps keeps the runs short.
STEPS = {"max_denoising_steps": 3}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # Any checkpoint directory: `start_llada2_server` is the served tests' one-thread server with its own store.
    srv = start_llada2_server(TINY, tmp_path_factory.mktemp("dgemma-server"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    loaded = load_checkpoint(TINY)
    return Engine(loaded.model, loaded.spec, loaded.tokenizer, torch.float32, torch.device("cpu"))


def alone(engine, prompt: list[int], max_tokens: int, seed: int, stop: tuple[str, ...] = ()) -> str:
    """The in-process decode of one request alone (the window: max_tokens rounded up to whole canvases of 16)."""
    params = DecodeParams(gen_length=-(-max_tokens // 16) * 16, block_length=16, **STEPS)
    return engine.generate([prompt], params, [RowOptions(seed=seed, max_tokens=max_tokens, stop=stop)]).rows[0].text


def test_completion_is_the_engine_alone_cut_at_max_tokens(client, engine):
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt="hello world", max_tokens=37, seed=5, extra_body=STEPS)
    ids = engine.tokenizer("hello world")["input_ids"]
    assert out.choices[0].text == alone(engine, ids, 37, 5)
    assert out.usage.completion_tokens <= 37 and out.usage.prompt_tokens == len(ids)
    again = client.completions.create(model=model, prompt="hello world", max_tokens=37, seed=5, extra_body=STEPS)
    other = client.completions.create(model=model, prompt="hello world", max_tokens=37, seed=6, extra_body=STEPS)
    assert again.choices[0].text == out.choices[0].text != other.choices[0].text


def test_chat_uses_the_checkpoint_template_and_n_choices_their_seeds(client, engine):
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "hi there"}]
    out = client.chat.completions.create(model=model, messages=messages, max_tokens=20, n=2, seed=9,
                                         extra_body=STEPS)
    ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert out.usage.prompt_tokens == len(ids)
    assert [c.message.content for c in out.choices] == [alone(engine, ids, 20, 9 + j) for j in range(2)]


def test_a_stream_is_one_chunk_per_committed_canvas_and_the_plain_answer(client):
    model = client.models.list().data[0].id
    plain = client.completions.create(model=model, prompt="w5 w6", max_tokens=40, seed=2, extra_body=STEPS)
    chunks = list(client.completions.create(model=model, prompt="w5 w6", max_tokens=40, seed=2, stream=True,
                                            extra_body=STEPS))
    texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    assert "".join(texts) == plain.choices[0].text
    assert 1 < len(texts) <= -(-40 // 16)  # the tiny canvas is 16 tokens: at most 3 canvases, one chunk each


def test_stop_cuts_the_text(client):
    model = client.models.list().data[0].id
    full = client.completions.create(model=model, prompt="w1", max_tokens=32, seed=4, extra_body=STEPS)
    text = full.choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = client.completions.create(model=model, prompt="w1", max_tokens=32, seed=4, stop=[stop], extra_body=STEPS)
    assert stop and cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_concurrent_clients_decode_as_alone_in_shared_forwards(client, server):
    model = client.models.list().data[0].id
    prompts = [" ".join(f"w{i + k}" for k in range(1 + 2 * i)) for i in range(6)]

    def ask(i: int) -> str:
        return client.completions.create(model=model, prompt=prompts[i], max_tokens=24 + 8 * i, seed=i,
                                         extra_body={"max_denoising_steps": 2 + i % 3}).choices[0].text

    solo = [ask(i) for i in range(len(prompts))]
    before = metrics(server.url)
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(ask, range(len(prompts))))
    after = metrics(server.url)
    assert together == solo
    rows = metric_sum(after, "dllm_row_forwards_total") - metric_sum(before, "dllm_row_forwards_total")
    forwards = (metric_sum(after, "dllm_forwards_per_iteration_sum")
                - metric_sum(before, "dllm_forwards_per_iteration_sum"))
    assert rows > forwards > 0  # forwards held rows of several requests


@pytest.mark.parametrize(("extra", "field"), [
    ({"temperature": 0.7}, "temperature"), ({"logprobs": 1}, "logprobs"), ({"echo": True, "logprobs": 1}, "logprobs"),
    ({"steps": 32}, "steps"), ({"threshold": 0.5}, "threshold"), ({"cache_mode": "none"}, "cache_mode"),
    ({"t_max": 0.2, "t_min": 0.3}, "t_max"), ({"entropy_bound": -1}, "entropy_bound"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    # Its work over the server's ceiling: two canvases of a million passes over 35 tokens (one canvas of 16, with
    # the short prompt, is just under it; the window was two canvases once the block length of 32 sized it).
    ({"max_denoising_steps": 1_000_000, "max_tokens": 32}, "max_denoising_steps"),
])
def test_what_the_family_does_not_define_is_a_400_naming_the_field(server, extra, field):
    body = {"model": "dgemma-tiny", "prompt": "w5 w6", "max_tokens": 16, **extra}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


def test_an_image_part_is_a_400_naming_the_part(server):
    body = {"model": "dgemma-tiny", "max_tokens": 16, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "messages.0.content.1"


def test_the_server_still_answers_after_the_refusals(client):
    out = client.completions.create(model=client.models.list().data[0].id, prompt="w2", max_tokens=8,
                                    extra_body=STEPS)
    assert out.choices[0].finish_reason in ("length", "stop")


def test_the_published_schema_takes_the_renoising_fields(server):
    """/openapi.json states what the served model takes: the renoising fields (refused by schema on the other
    families, tests/api/test_openapi_document.py), and the masked families' cache mode none is not listed."""
    import jsonschema

    doc = httpx.get(server.url + "/openapi.json", timeout=60).json()
    properties = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    for name, value in (("max_denoising_steps", 8), ("t_max", 0.5), ("entropy_bound", 0.2)):
        jsonschema.validate(value, properties[name])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate("none", properties["cache_mode"])
