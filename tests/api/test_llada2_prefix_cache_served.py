"""The prefix cache served (``DLLM_PREFIX_CACHE_BYTES``): a LLaDA2 server with a KIVI 4-bit ``prefix``
configuration answers requests that share a long prefix, sent by several clients at once, with the text the engine
decodes alone with no cache, and /metrics (read with prometheus-client's parser) counts the hits; after a hot swap to
2 bits the old blocks are not served (the 2-bit series starts from no hit) and the answers are 2-bit's own."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from service.engine.block_causal import BlockCausalParams
from service.engine.block_causal_batch import generate
from service.engine.loading import load_checkpoint
from service.quant.config import KVQuantConfig
from service.quant.store import make_kv_store
from tests.support.llada2 import LLADA2_CHAT, start_llada2_server
from tests.support.metrics import metric_sum, metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ADMIN = "prefix-admin-key"
_rng = random.Random(44)
SYSTEM = [_rng.randrange(5, 490) for _ in range(100)]  # 3 whole blocks of 32 and a part
PROMPTS = [SYSTEM + [_rng.randrange(5, 490) for _ in range(20)] for _ in range(4)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("llada2-prefix-server")
    srv = start_llada2_server(LLADA2_CHAT, work, DLLM_KV_QUANT='{"method": "kivi", "bits": 4}',
                              DLLM_PREFIX_CACHE_BYTES=str(10**8), DLLM_ADMIN_KEY=ADMIN)
    yield srv
    srv.stop()


def alone(bits: int, prompt: list[int]) -> str:
    """The engine's decode of ``prompt`` alone with a KIVI store and no prefix cache."""
    loaded = load_checkpoint(LLADA2_CHAT)
    store = make_kv_store(KVQuantConfig(method="kivi", bits=bits), loaded.spec)
    result = generate(loaded.model, prompt, BlockCausalParams(gen_length=64, threshold=0.9, steps=32),
                      loaded.spec.mask_id, loaded.spec.eos_ids, kv_store=store)
    return loaded.tokenizer.decode(result.generated_ids, skip_special_tokens=True)


def complete(client: openai.OpenAI, prompt: list[int]) -> str:
    out = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=64,
                                    extra_body={"cache_mode": "block", "threshold": 0.9})
    return out.choices[0].text


def test_shared_prefixes_hit_the_cache_and_decode_as_alone(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    assert complete(client, PROMPTS[0]) == alone(4, PROMPTS[0])  # fills the cache with the shared blocks
    with ThreadPoolExecutor(3) as pool:
        texts = list(pool.map(lambda p: complete(client, p), PROMPTS[1:]))
    assert texts == [alone(4, p) for p in PROMPTS[1:]]
    samples = metrics(server.url)
    kivi4 = {"method": "kivi", "bits": "4", "cache_mode": "block"}
    assert metric_sum(samples, "dllm_prefix_cache_hits_total", **kivi4) == 3 * 96
    assert metric_sum(samples, "dllm_prefix_cache_queries_total", **kivi4) == 4 * 120
    assert metric_sum(samples, "dllm_prefix_cache_bytes", **kivi4) > 0
    assert metric_sum(samples, "dllm_prefix_cache_capacity_bytes") == 10**8

    # A hot swap: the 4-bit blocks are never served to a 2-bit request.
    swap = httpx.put(server.url + "/admin/active/prefix", json={"method": "kivi", "bits": 2},
                     headers={"Authorization": f"Bearer {ADMIN}"})
    assert swap.status_code == 200, swap.text
    assert complete(client, PROMPTS[0]) == alone(2, PROMPTS[0])
    kivi2 = {"method": "kivi", "bits": "2", "cache_mode": "block"}
    samples = metrics(server.url)
    assert metric_sum(samples, "dllm_prefix_cache_hits_total", **kivi2) == 0
    assert complete(client, PROMPTS[1]) == alone(2, PROMPTS[1])
    assert metric_sum(metrics(server.url), "dllm_prefix_cache_hits_total", **kivi2) == 96
