"""A LLaDA2 checkpoint on a server whose prefix/dual configuration is quantized (``DLLM_KV_QUANT`` KIVI 4-bit):
requests in those modes are served with the quantized committed-block cache (`service.quant.committed`), as the
engine decodes them alone with the same store, never a 500; a request's own ``kv_quant`` object applies in
``block`` mode."""

from __future__ import annotations

import openai
import pytest

from service.engine.block_causal import BlockCausalParams
from service.engine.block_causal_batch import generate
from service.engine.loading import load_checkpoint
from service.quant.config import KVQuantConfig
from service.quant.store import make_kv_store
from tests.support.llada2 import LLADA2_CHAT, start_llada2_server

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPT = list(range(5, 45))  # 40 token ids: a whole prompt block commits at the first forward


@pytest.fixture(scope="module")
def checkpoint():
    return LLADA2_CHAT


@pytest.fixture(scope="module")
def client(checkpoint, tmp_path_factory):
    srv = start_llada2_server(checkpoint, tmp_path_factory.mktemp("llada2-quant-server"),
                              DLLM_KV_QUANT='{"method": "kivi", "bits": 4}')
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    srv.stop()


def alone(checkpoint, bits: int | None) -> str:
    loaded = load_checkpoint(checkpoint)
    prompt = PROMPT
    store = make_kv_store(KVQuantConfig(method="kivi", bits=bits), loaded.spec) if bits else None
    result = generate(loaded.model, prompt, BlockCausalParams(gen_length=64, threshold=0.9, steps=32),
                      loaded.spec.mask_id, loaded.spec.eos_ids, kv_store=store)
    return loaded.tokenizer.decode(result.generated_ids, skip_special_tokens=True)


def test_quantized_prefix_and_dual_are_served_as_the_engine_decodes_alone(client, checkpoint):
    model = client.models.list().data[0].id
    quantized, exact = alone(checkpoint, 4), alone(checkpoint, None)
    assert quantized != exact  # the 4-bit cache changes this decode: the comparison below sees the store
    for mode in ("prefix", "dual"):
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=64,
                                        extra_body={"cache_mode": mode, "threshold": 0.9})
        assert out.choices[0].text == quantized, mode
        assert out.kv_config["kv_quant"]["method"] == "kivi"
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=64,
                                    extra_body={"cache_mode": "block", "threshold": 0.9})
    assert out.choices[0].text == exact  # block mode runs with cache mode none's configuration (unquantized)
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=64, extra_body={
        "cache_mode": "block", "threshold": 0.9, "kv_quant": {"method": "kivi", "bits": 2}})
    assert out.choices[0].text == alone(checkpoint, 2)
