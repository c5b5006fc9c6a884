"""The prefix cache on LLaDA2 (service/engine/prefix_cache.py used by service/engine/block_causal_batch.py): a request
served from the cache decodes token for token, forward for forward, as with the cache empty and as with no cache
(LLaDA2.0, and 2.1 with editing; unquantized, KIVI and KVQuant stores), alone and batched, after eviction and after
a hot swap of the KV configuration; a perturbed cached block changes the output (the comparison can fail)."""

from __future__ import annotations

import random

import pytest
import torch

from service.engine.block_causal import BlockCausalParams
from service.engine.block_causal_batch import BlockCausalBatch, BlockCausalCohort, generate, generate_batch
from service.engine.loading import load_checkpoint
from service.engine.prefix_cache import PrefixCache, prefix_label
from service.quant.config import KVQuantConfig
from service.quant.store import make_kv_store
from service.runtime.scheduler import forward_plan
from tests.engine.test_llada2_quant import dllm_kvq_store, kivi_store, kvquant_store
from tests.support.llada2 import LLADA2_CKPT

#: name -> a fresh store for one request (None: unquantized committed blocks).
STORES = {
    "none": lambda spec: None,
    "kivi4": lambda spec: kivi_store(spec, 4),
    "kivi2": lambda spec: kivi_store(spec, 2),
    "kvquant4": lambda spec: kvquant_store(spec, 4),
}


#: The prefix cache's labels of KIVI 2- and 4-bit at the default groups (`prefix_label`).
KIVI2, KIVI4 = (prefix_label(KVQuantConfig(method="kivi", bits=b)) for b in (2, 4))


@pytest.fixture(scope="module")
def llada2():
    return {family: load_checkpoint(path) for family, path in LLADA2_CKPT.items()}


def shared_prompts(count: int, system: int = 100, question: int = 20, seed: int = 0) -> list[list[int]]:
    """``count`` prompts: one ``system``-token prefix (3 whole blocks of 32 and a part) and a different question."""
    rng = random.Random(seed)
    head = [rng.randrange(0, 490) for _ in range(system)]
    return [head + [rng.randrange(0, 490) for _ in range(question)] for _ in range(count)]


def params(family: str) -> BlockCausalParams:
    return BlockCausalParams(gen_length=64, block_length=32, steps=32, threshold=0.9, editing=family == "llada21")


def decode(loaded, prompt, family, store, cache=None):
    return generate(loaded.model, prompt, params(family), loaded.spec.mask_id, loaded.spec.eos_ids, kv_store=store,
                    prefix_cache=cache, model_key=loaded.spec.fingerprint)


@pytest.mark.parametrize("store", list(STORES))
@pytest.mark.parametrize("family", ["llada2", "llada21"])
def test_served_from_the_cache_decodes_as_without_it(llada2, family, store):
    loaded = llada2[family]
    make = STORES[store]
    cache = PrefixCache(10**8)
    for n, prompt in enumerate(shared_prompts(3)):
        alone_store, cached_store = make(loaded.spec), make(loaded.spec)
        alone = decode(loaded, prompt, family, alone_store)
        cached = decode(loaded, prompt, family, cached_store, cache)
        assert cached.generated_ids == alone.generated_ids, f"prompt {n}"
        assert cached.nfe == alone.nfe and cached.reveals_per_call == alone.reveals_per_call
        if alone_store is not None:  # the report counts the cached blocks as the request's own
            got, want = cached_store.report(), alone_store.report()
            if store.startswith("kvquant"):  # its outlier rows' room (bytes) follows what each write met
                nominal = [(x.k_nominal_bits, x.v_nominal_bits) for x in (got, *got.per_layer)]
                assert nominal == [(x.k_nominal_bits, x.v_nominal_bits) for x in (want, *want.per_layer)]
            else:
                assert got == want
    stats = next(iter(cache.stats().values()))
    assert stats.hit_tokens == 2 * 96, "the 2nd and 3rd prompts read the 3 whole blocks of the shared prefix"
    assert stats.queried_tokens == 3 * 120 and stats.blocks == 3


@pytest.mark.parametrize("store", ["none", "kivi4"])
def test_rows_of_a_batch_read_the_cache_as_each_alone(llada2, store):
    loaded, family = llada2["llada2"], "llada2"
    make = STORES[store]
    prompts = shared_prompts(4, seed=1)
    alone = [decode(loaded, p, family, make(loaded.spec)).generated_ids for p in prompts]
    cache = PrefixCache(10**8)
    decode(loaded, prompts[0], family, make(loaded.spec), cache)  # warms the shared prefix
    batched = generate_batch(loaded.model, prompts, [params(family)] * 4, loaded.spec.mask_id, loaded.spec.eos_ids,
                             kv_store=make(loaded.spec), prefix_cache=cache, model_key=loaded.spec.fingerprint)
    assert [r.generated_ids for r in batched] == alone
    assert next(iter(cache.stats().values())).hit_tokens == 4 * 96
    assert all(cache.refs(block.key) == 0 for block in cache.blocks()), "the rows gave their blocks back"


def test_after_eviction_the_decode_is_the_same(llada2):
    loaded, family = llada2["llada2"], "llada2"
    prompts = shared_prompts(2, seed=2) + shared_prompts(2, seed=3)
    block_bytes = 2 * 3 * 2 * 32 * 16 * 4  # K and V, 3 layers, 2 KV heads, 32 tokens, head dim 16, float32
    cache = PrefixCache(4 * block_bytes)  # room for one prompt's 3 blocks and one more
    outs = [decode(loaded, p, family, None, cache).generated_ids for p in prompts + prompts]
    assert outs == [decode(loaded, p, family, None).generated_ids for p in prompts + prompts]
    stats = next(iter(cache.stats().values()))
    assert stats.evicted_bytes > 0 and stats.held_bytes <= 4 * block_bytes == cache.capacity_bytes
    assert stats.hit_tokens > 0


def test_a_hot_swap_never_serves_blocks_of_the_old_configuration(llada2):
    loaded, family = llada2["llada2"], "llada2"
    prompt = shared_prompts(1, seed=4)[0]
    cache = PrefixCache(10**8)
    decode(loaded, prompt, family, kivi_store(loaded.spec, 4), cache)
    swapped = decode(loaded, prompt, family, kivi_store(loaded.spec, 2), cache)
    stats = cache.stats()
    assert stats[KIVI2].hit_tokens == 0, "2-bit must not read the 4-bit blocks"
    assert swapped.generated_ids == decode(loaded, prompt, family, kivi_store(loaded.spec, 2)).generated_ids
    again = decode(loaded, prompt, family, kivi_store(loaded.spec, 2), cache)
    assert again.generated_ids == swapped.generated_ids and cache.stats()[KIVI2].hit_tokens == 96
    # The old configuration's blocks age out first: they are the least recently used.
    old = cache.stats()[KIVI4].held_bytes
    cache.evict(old)
    assert cache.stats()[KIVI4].held_bytes == 0
    assert cache.stats()[KIVI2].held_bytes > 0


def test_dllm_kvq_does_not_use_the_cache(llada2):
    """dLLM-KVQ ranks a committing block's tokens by the active block's queries, which differ per request: its
    blocks quantized for one request are not those another would make (`KVQuantizer.block_separable`)."""
    loaded, family = llada2["llada2"], "llada2"
    cache = PrefixCache(10**8)
    for prompt in shared_prompts(2, seed=5):
        cached = decode(loaded, prompt, family, dllm_kvq_store(loaded.spec, 4), cache)
        assert cached.generated_ids == decode(loaded, prompt, family, dllm_kvq_store(loaded.spec, 4)).generated_ids
    assert len(cache) == 0 and cache.stats() == {}


def test_a_perturbed_cached_block_changes_the_output(llada2):
    """The exactness tests above can fail: the same decode over cached K/V with noise added differs."""
    loaded, family = llada2["llada2"], "llada2"
    prompts = shared_prompts(2, seed=6)
    cache = PrefixCache(10**8)
    decode(loaded, prompts[0], family, None, cache)
    with torch.inference_mode():  # the cached tensors were made under it
        for block in cache.blocks():
            for k, v in block.payload:
                k.add_(torch.randn(k.shape, generator=torch.Generator().manual_seed(0)))
                v.add_(torch.randn(v.shape, generator=torch.Generator().manual_seed(1)))
    perturbed = decode(loaded, prompts[1], family, None, cache)
    assert next(iter(cache.stats().values())).hit_tokens == 96
    assert perturbed.generated_ids != decode(loaded, prompts[1], family, None).generated_ids


def test_rows_sharing_cached_blocks_dequantize_them_once_per_forward(llada2, monkeypatch):
    """Each row's reads per forward are those it makes alone, except the cached blocks it shares with other rows of
    the forward: those are dequantized once and copied (`CommittedBlocks.read_into`). So the batch dequantizes
    strictly less than the rows alone did together (without the sharing, exactly as much)."""
    loaded, family = llada2["llada2"], "llada2"
    prompts = shared_prompts(3, seed=7)

    def dequantizes(batch: list[list[int]]) -> int:
        cache = PrefixCache(10**8)
        decode(loaded, prompts[0], family, kivi_store(loaded.spec, 4), cache)  # warms the shared prefix
        store, calls = kivi_store(loaded.spec, 4), []
        real = store.quantizer.dequantize
        monkeypatch.setattr(store.quantizer, "dequantize", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
        generate_batch(loaded.model, batch, [params(family)] * len(batch), loaded.spec.mask_id,
                       loaded.spec.eos_ids, kv_store=store, prefix_cache=cache, model_key=loaded.spec.fingerprint)
        return len(calls)

    alone = sum(dequantizes([p]) for p in prompts)
    assert dequantizes(prompts) < alone


def test_under_the_runtime_plan_split_by_layers_the_cache_is_exact(llada2):
    """The runtime's plan (`forward_plan`, one layer a piece) splits the passes that commit columns: a row's first
    pass over the rest of its prompt runs in pieces that attend over the cached prefix, and decodes as alone."""
    loaded = llada2["llada2"]
    cache = PrefixCache(10**8)
    batch = BlockCausalBatch(loaded.model, forward_plan(split_tokens=8, num_layers=3), cache,
                             loaded.spec.fingerprint)
    prompts = shared_prompts(4, seed=8)

    def cohort(prompt: list[int]) -> BlockCausalCohort:
        made = BlockCausalCohort(loaded.model, [prompt], [params("llada2")], loaded.spec.mask_id,
                                 loaded.spec.eos_ids)
        batch.join(made)
        return made

    with torch.inference_mode():
        first = cohort(prompts[0])  # alone: fills the cache
        while batch.cohorts:
            batch.step()
            assert not batch.failed
        rest = [cohort(p) for p in prompts[1:]]  # together: each reads it
        split = False
        while batch.cohorts:
            batch.step()
            split = split or bool(batch._pieces)  # between two pieces of a split pass
            assert not batch.failed
        assert split
    got = [c.results[0].generated_ids for c in [first, *rest]]
    assert got == [decode(loaded, p, "llada2", None).generated_ids for p in prompts]
    assert next(iter(cache.stats().values())).hit_tokens == 3 * 96
    assert all(block.refs == 0 for block in cache.blocks())


def test_a_preempted_request_gives_its_blocks_back_and_resumes_as_alone(llada2):
    """Preemption by recompute at a block boundary (`BlockCausalBatch.preempt`): the request's cached blocks are
    unreferenced while it waits (evictable), and resumed from column 0 it decodes as alone."""
    loaded = llada2["llada2"]
    prompts = shared_prompts(2, seed=9)
    cache = PrefixCache(10**8)
    decode(loaded, prompts[0], "llada2", None, cache)
    batch = BlockCausalBatch(loaded.model, None, cache, loaded.spec.fingerprint)
    cohort = BlockCausalCohort(loaded.model, [prompts[1]], [params("llada2")], loaded.spec.mask_id,
                               loaded.spec.eos_ids)
    batch.join(cohort)
    with torch.inference_mode():
        batch.step()  # its first forward reads the 3 cached blocks
        assert [block.refs for block in cache.blocks()] == [1, 1, 1]
        while not (batch.preemptible(cohort) and cohort.rows[0].decoded_end > 128):
            batch.step()
        calls = batch.preempt(cohort)
        assert [block.refs for block in cache.blocks()] == [0, 0, 0]
        batch.join(cohort)
        batch.resume(cohort, calls)
        while batch.cohorts:
            batch.step()
    assert cohort.results[0].generated_ids == decode(loaded, prompts[1], "llada2", None).generated_ids


@pytest.mark.parametrize("store", ["kivi2", "kvquant4"])
def test_a_row_reads_its_cached_blocks_as_one_run_per_layer(llada2, store, monkeypatch):
    """The cached blocks a row reads are joined into one packed run per layer when they are attached to it
    (`CommittedBlocks`, `KVQuantizer.concat`), and so are the row's own prompt blocks packed one by one for the
    cache: a request served from the cache dequantizes exactly as often as one decoded without it (its prompt one
    run; the miss that filled the cache wrote its three blocks one by one, a dequantization each, once), where
    reading block by block made it three per layer per forward for three blocks."""
    loaded, family = llada2["llada2"], "llada2"
    prompts = shared_prompts(2, seed=11)

    def dequantizes(prompt, cache):
        made, calls = STORES[store](loaded.spec), []
        real = made.quantizer.dequantize
        monkeypatch.setattr(made.quantizer, "dequantize", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
        out = decode(loaded, prompt, family, made, cache)
        return len(calls), out.generated_ids, made

    cache = PrefixCache(10**8)
    first, first_ids, made = dequantizes(prompts[0], cache)  # a miss: its prompt blocks packed one by one
    assert all(len(made._committed[0].layers[layer]) == 1 + 2 for layer in range(3))  # prompt, 2 generated
    cached, cached_ids, _ = dequantizes(prompts[1], cache)
    assert next(iter(cache.stats().values())).hit_tokens == 96
    layers = len(loaded.model.layers)
    for prompt, calls, ids, written in ((prompts[0], first, first_ids, 3), (prompts[1], cached, cached_ids, 1)):
        alone, alone_ids, _ = dequantizes(prompt, None)
        assert ids == alone_ids
        assert calls == alone + (written - 1) * layers


def test_metric_labels_keep_k_group_sizes_apart(llada2):
    """KIVI 2-bit at K groups 16 and 32 are two namespaces (their codes differ), so /metrics shows them as two series
    (read with prometheus-client's parser); before the fix both counted into one ``method, bits, cache_mode,
    policy`` series. The labels are those of ``dllm_active_config_info`` that change the blocks, and ``sides``."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from service.telemetry import PrefixCacheCollector

    loaded, family = llada2["llada2"], "llada2"
    prompt = shared_prompts(1, seed=5)[0]
    cache = PrefixCache(10**8)
    for group in (16, 32, 32):
        store = make_kv_store(KVQuantConfig(method="kivi", bits=2, k_group_size=group), loaded.spec, attention="torch")
        decode(loaded, prompt, family, store, cache)
    registry = CollectorRegistry()
    registry.register(PrefixCacheCollector(cache))
    hits = {}
    for metric in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in metric.samples:
            if sample.name == "dllm_prefix_cache_hits_total":
                hits[sample.labels["k_group_size"]] = (sample.value, sample.labels)
    assert sorted(hits) == ["16", "32"], hits
    assert hits["16"][0] == 0 and hits["32"][0] == 96  # only the second group-32 request hit (3 blocks of 32)
    assert hits["32"][1] == {"method": "kivi", "bits": "2", "cache_mode": "block", "policy": "",
                             "k_group_size": "32", "v_group_size": "", "sides": "kv", "key_bias_correction": "off"}
