"""A LLaDA2 checkpoint on a server whose prefix/dual configuration is quantized (``DLLM_KV_QUANT`` KIVI 4-bit):
requests in those modes, and in ``block`` (which serves ``prefix``'s configuration), are served with the quantized
committed-block cache (`service.quant.committed`), as the engine decodes them alone with the same store, never a
500; a request's own ``kv_quant`` object applies in ``block`` mode."""

from __future__ import annotations

import openai
import pytest

from service.engine.block_causal import BlockCausalParams
from service.engine.block_causal_batch import generate
from service.engine.loading import load_checkpoint
from service.quant.config import KVQuantConfig
from service.quant.store import make_kv_store
from service.store.base import KIND_POLICY, open_store
from tests.support.artifacts import policy_for
from tests.support.llada2 import LLADA2_CHAT, start_llada2_server

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPT = list(range(5, 45))  # 40 token ids: a whole prompt block commits at the first forward


@pytest.fixture(scope="module")
def checkpoint():
    return LLADA2_CHAT


@pytest.fixture(scope="module")
def policies(checkpoint):
    """A dLLM-KVQ policy for ``prefix`` (what ``block`` serves, as `calibrate` makes LLaDA2's) and one for dual."""
    spec = load_checkpoint(checkpoint).spec
    return {mode: policy_for(spec, cache_mode=mode, bits=4, p=1) for mode in ("prefix", "dual")}


@pytest.fixture(scope="module")
def client(checkpoint, tmp_path_factory, policies):
    work = tmp_path_factory.mktemp("llada2-quant-server")
    store = open_store(str(work / "store"))
    for policy in policies.values():
        store.put_model(KIND_POLICY, policy)
    srv = start_llada2_server(checkpoint, work, DLLM_KV_QUANT='{"method": "kivi", "bits": 4}')
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    srv.stop()


def alone(checkpoint, bits: int | None, policy=None) -> str:
    loaded = load_checkpoint(checkpoint)
    prompt = PROMPT
    store = make_kv_store(KVQuantConfig(method="kivi", bits=bits), loaded.spec) if bits else None
    if policy is not None:
        store = make_kv_store(KVQuantConfig(method="dllm_kvq", bits=bits, policy_id=policy.id), loaded.spec, policy)
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
    assert out.choices[0].text == quantized  # block mode runs with cache mode prefix's configuration
    assert out.kv_config["cache_mode"] == "prefix" and out.kv_config["kv_quant"]["method"] == "kivi"
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=64,
                                    extra_body={"cache_mode": "none", "threshold": 0.9})
    assert out.choices[0].text == exact and out.kv_config["cache_mode"] == "none"
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=64, extra_body={
        "cache_mode": "block", "threshold": 0.9, "kv_quant": {"method": "kivi", "bits": 2}})
    assert out.choices[0].text == alone(checkpoint, 2)


def test_a_prefix_policy_serves_block_requests_and_a_dual_one_is_refused(client, checkpoint, policies):
    model = client.models.list().data[0].id
    kv_quant = {"method": "dllm_kvq", "bits": 4, "policy_id": policies["prefix"].id}
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=64,
                                    extra_body={"cache_mode": "block", "threshold": 0.9, "kv_quant": kv_quant})
    assert out.choices[0].text == alone(checkpoint, 4, policies["prefix"])
    assert out.kv_config["kv_quant"]["policy_id"] == policies["prefix"].id
    with pytest.raises(openai.UnprocessableEntityError) as refused:  # an artifact that does not fit: 422
        client.completions.create(model=model, prompt=PROMPT, max_tokens=64, extra_body={
            "cache_mode": "block", "kv_quant": {**kv_quant, "policy_id": policies["dual"].id}})
    # The request sent cache_mode, so the refusal names it (docs/api.md, errors), and both modes.
    message = refused.value.body["message"]
    assert refused.value.body["param"] == "cache_mode" and "'prefix'" in message and "'dual'" in message, message
    # dual decodes in block too: a policy fitted for prefix (what calibrate fits) serves it as block's does.
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=64,
                                    extra_body={"cache_mode": "dual", "threshold": 0.9, "kv_quant": kv_quant})
    assert out.choices[0].text == alone(checkpoint, 4, policies["prefix"])
