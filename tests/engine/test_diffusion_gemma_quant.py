"""DiffusionGemma's committed K/V held quantized (`service.quant.canvas`): a lossless store through the packed path
leaves runs token-exact (post- and pre-RoPE keys, sliding windows crossed); KIVI, dLLM-KVQ (qerror) and KVQuant at
4 and 2 bits follow the unquantized decoder far closer than a garbage cache does; their effective bits are
reported; the bytes held drop by the ratio admission counts (`DiffusionGemmaModel.kv_bytes_per_token`), per layer
kind; sliding layers stay bounded; what the family cannot run is refused in one line.

Agreement is teacher-forced (`tests.support.dgemma_kv.decoder_agreement`: the decoder's argmax on the same canvases
over both caches): a renoising decode's later draws depend on every earlier one, so two whole runs part at the first
changed draw and their token agreement says little. The tiny checkpoints' random MoE weights make them far more
sensitive than a trained model: a routing choice flips under a small K/V change (a 0.004 perturbation of one
layer's V moves logits by 1.5), so 4 bits agree on about half the positions, 8 bits on most
(benchmarks/diffusion_gemma_kv_bytes.py prints the figures).
"""

from __future__ import annotations

import pytest
import torch

from service.engine.loading import load_checkpoint
from service.engine.models.diffusion_gemma import GLOBAL, SLIDING
from service.engine.renoise import generate
from service.quant.canvas import check_geometry
from service.quant.config import KVQuantConfig
from service.quant.errors import KVQuantError
from service.quant.store import QuantizedKVStore, make_kv_store
from tests.engine.test_diffusion_gemma import CASES, PAD, SETTLING, TINY, W8
from tests.support.artifacts import kvquant_state_for, policy_for
from tests.support.dgemma_kv import METHODS, decoder_agreement, held_store, prompts_for, store_for
from tests.support.quantizers import HeldQuantizer

CHECKPOINTS = (TINY, W8, SETTLING)


@pytest.fixture(scope="module")
def engines():
    torch.set_num_threads(1)
    return {path: load_checkpoint(path) for path in CHECKPOINTS}


def run(loaded, case, kv_store=None, caches=None):
    return generate(loaded.model, [case.prompt], case.params(), loaded.spec.eos_ids, PAD,
                    torch.Generator().manual_seed(case.seed), mode="shared", kv_store=kv_store, caches=caches)[0]


#: Several canvases (up to 8), prompts below and far above the window, low temperature, an EOS.
LOSSLESS = [CASES[i] for i in (0, 13, 18, 19, 20, 25, 28, 29)]


@pytest.mark.parametrize("pre_rope", [False, True], ids=["post-rope", "pre-rope"])
@pytest.mark.parametrize("index", range(len(LOSSLESS)))
def test_a_lossless_store_decodes_token_for_token(engines, index, pre_rope):
    case = LOSSLESS[index]
    loaded = engines[case.checkpoint]
    # pre-RoPE: KVQuant's path (pre-RoPE keys in, each layer kind's RoPE after the read) with nothing lost
    quantizer = HeldQuantizer(KVQuantConfig(method="kivi", k_group_size=4), loaded.spec, pre_rope)
    store = QuantizedKVStore(quantizer, attention="torch")
    exact, held = run(loaded, case), run(loaded, case, store)
    assert held.generated_ids == exact.generated_ids and held.nfe == exact.nfe
    assert store.report().k_nominal_bits == 16.0


def pooled_agreement(engines, make_store, garbage=False) -> float:
    same = total = 0
    for path in CHECKPOINTS:
        loaded = engines[path]
        a, n = decoder_agreement(loaded.model, lambda loaded=loaded: make_store(loaded.spec),
                                 prompts_for(4, 20, 498), garbage=garbage)
        same, total = same + a, total + n
    return same / total


#: Pooled over the three tiny checkpoints (384 positions): a garbage cache (its K/V replaced by noise of their
#: scale) agrees on 0.07, 2 bits on 0.23-0.24, 4 bits on 0.42-0.53 (KVQuant lowest), 8 bits on 0.89 (measured).
GARBAGE_BELOW, BOUND = 0.15, {2: 0.17, 4: 0.35}


def test_the_agreement_bound_fails_for_a_garbage_cache(engines):
    assert pooled_agreement(engines, held_store) == 1.0
    assert pooled_agreement(engines, held_store, garbage=True) < GARBAGE_BELOW < min(BOUND.values())


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("method", METHODS)
def test_quantized_decoders_follow_the_unquantized_one(engines, method, bits):
    agreement = pooled_agreement(engines, lambda spec: store_for(method, bits, spec))
    print(f"{method} {bits}-bit: teacher-forced decoder agreement with the unquantized cache {agreement:.3f}")
    assert agreement >= BOUND[bits]


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("method", METHODS)
def test_effective_bits_are_reported(engines, method, bits):
    loaded = engines[TINY]
    store = store_for(method, bits, loaded.spec)
    run(loaded, CASES[18], store)  # 12-token prompt, 3 canvases: the prompt and two canvases are written
    report = store.report()
    assert {layer.layer for layer in report.per_layer} == set(range(loaded.model.config.num_layers))
    if method == "kivi":
        assert report.k_nominal_bits == report.v_nominal_bits == bits
    elif method == "dllm_kvq":  # one protected K token per group of 8 at 16 bits (more in a short group)
        assert report.v_nominal_bits == bits and report.k_nominal_bits >= bits + (16 - bits) / 8
    else:  # KVQuant: outliers at 16 bits, as the data has them
        assert bits <= report.k_nominal_bits < 16 and bits <= report.v_nominal_bits < 16
    assert report.k_storage_bits > report.k_nominal_bits - 1e-9  # scales, minima, indices on top
    assert 0 < report.bytes_held < report.bf16_bytes


def held_positions(cache, layer: int, row: int = 0) -> int:
    holder, index = cache.packed[row]
    return sum(end - start for start, end, _ in holder.rows[index].layers[layer])


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("bits", [4, 2])
def test_bytes_held_are_what_admission_counts_per_layer_kind(engines, method, bits):
    """A long prompt (40 tokens, groups of 8) and canvases of 16 on dgemma-tiny (window 12): the global layers hold
    every committed token, at the probe's bytes per token (exact for KIVI; dLLM-KVQ's read derives one index entry
    per slot and one per run, whose runs are not the probe's: within 1%; KVQuant's outliers within 10%); the
    sliding layers between ``W - 1`` and ``W - 1 + G - 1`` positions at the same rate; both far under
    the unquantized cache of the same run (so a quantization silently skipped fails here)."""
    loaded = engines[TINY]
    model, config = loaded.model, loaded.model.config
    case = CASES[25]  # TINY, prompt 40, 32 tokens: the prompt and one canvas written
    exact_caches, caches = [], []
    run(loaded, case, caches=exact_caches)
    store = store_for(method, bits, loaded.spec)
    run(loaded, case, store, caches)
    cache, exact = caches[0], exact_caches[0]
    length = cache.length[0]
    assert length == 40 + 16
    held, full = cache.row_bytes(0), exact.row_bytes(0)
    tolerance = {"kivi": 0.0, "dllm_kvq": 0.01, "kvquant": 0.1}[method]
    for kind in (SLIDING, GLOBAL):
        per_token, unquantized = model.kv_bytes_per_token(kind, store), model.kv_bytes_per_token(kind)
        layers = [i for i, k in enumerate(config.layer_types) if k == kind]
        positions = held_positions(cache, layers[0])
        cap = model.kv_positions_held(kind, store)
        if kind == GLOBAL:
            assert positions == length and cap is None
        else:
            assert config.sliding_window - 1 <= positions <= cap == config.sliding_window - 1 + 8 - 1
            assert model.kv_positions_held(kind) == config.sliding_window - 1
        assert abs(held[kind] - per_token * positions) <= tolerance * per_token * positions
        assert full[kind] == unquantized * exact.held(0, kind)
        ratio = per_token / unquantized  # float32 model: KIVI at b bits with groups of 8 stores (b + 8) bits
        print(f"{method} {bits}-bit {kind}: {per_token:.1f} B/token vs {unquantized:.0f} unquantized ({ratio:.3f}); "
              f"held {held[kind]} B for {positions} positions, unquantized cache {full[kind]} B")
        assert ratio < (bits + 8 + 2) / 32
        assert held[kind] < full[kind] * (positions / exact.held(0, kind)) * (bits + 10) / 32


def test_sliding_layers_stay_bounded_as_the_text_grows(engines):
    """Six canvases on dgemma-tiny-w8 (window 8, canvas 8): after each commit a sliding layer holds at most
    ``W - 1 + G - 1`` positions and a read gives exactly its last ``W - 1``; the global layers grow."""
    loaded = engines[W8]
    model, config = loaded.model, loaded.model.config
    store = store_for("kivi", 4, loaded.spec, group=4)
    from service.engine.models.diffusion_gemma import make_canvas_cache

    cache = make_canvas_cache(model, 1, store)
    sliding = config.layer_types.index(SLIDING)
    glob = config.layer_types.index(GLOBAL)
    pending = torch.tensor([[498] + list(range(3, 20))])
    seen = []
    with torch.inference_mode():
        for _ in range(6):
            model.encode(pending, [pending.shape[1]], cache)
            k, v = cache.read(sliding, 0)
            assert k.shape[2] == v.shape[2] == config.sliding_window - 1
            assert held_positions(cache, sliding) <= config.sliding_window - 1 + 4 - 1
            assert held_positions(cache, glob) == cache.length[0] == cache.read(glob, 0)[0].shape[2]
            seen.append(cache.row_bytes(0)[SLIDING])
            pending = model.decode(torch.randint(0, 496, (1, config.canvas_length)), cache).argmax(-1)
    assert max(seen[1:]) <= max(seen[:2])  # no growth once the window is full


def test_what_the_family_cannot_run_is_refused(engines):
    loaded = engines[TINY]
    spec, model = loaded.spec, loaded.model
    policy = policy_for(spec, bits=4, p=1, score_type="attention", k_group_size=8)
    store = make_kv_store(KVQuantConfig(method="dllm_kvq", bits=4, k_group_size=8, artifact_id=policy.id), spec,
                          policy, attention="torch")
    with pytest.raises(KVQuantError, match="score by qerror"):
        generate(model, [[498, 1, 2]], CASES[0].params(), spec.eos_ids, PAD, kv_store=store)
    with pytest.raises(KVQuantError, match="score by qerror"):
        model.kv_bytes_per_token(SLIDING, store)
    kivi = store_for("kivi", 4, spec).quantizer  # V groups of 16 channels
    with pytest.raises(KVQuantError, match=r"v_group_size 16 does not divide layer 1's head dim 24; legal for every "
                                           r"layer: \[1, 2, 4, 8\]"):
        check_geometry(kivi, [(2, 16, 11), (1, 24, None)])
    kvquant = store_for("kvquant", 4, spec).quantizer  # 32 channels per layer
    with pytest.raises(KVQuantError, match=r"the state has 32 channels per layer, layer 1 has 2 x 32 = 64"):
        check_geometry(kvquant, [(2, 16, 11), (2, 32, None)])
    assert kvquant_state_for(spec).meta.channels == 32  # the tiny checkpoint's both kinds: 2 x 16 = 1 x 32


def test_rows_of_different_stores_in_one_batch_decode_as_alone(engines):
    """A running batch's rows of several requests (`make_canvas_cache` with one store per row): an unquantized
    row, two KIVI rows of one request and a KVQuant row each decode token for token as alone (per-row generators)
    and each request's report counts its own rows."""
    loaded = engines[TINY]
    spec = loaded.spec
    cases = [CASES[i] for i in (0, 18, 19, 25)]
    params = [case.params() for case in cases]

    def decode(indices, stores):
        return generate(loaded.model, [cases[i].prompt for i in indices], [params[i] for i in indices],
                        spec.eos_ids, PAD, [torch.Generator().manual_seed(cases[i].seed) for i in indices],
                        mode="per_row", kv_store=stores)

    alone_stores = [None, store_for("kivi", 4, spec), store_for("kivi", 4, spec), store_for("kvquant", 2, spec)]
    alone = [decode([i], [alone_stores[i]])[0].generated_ids for i in range(4)]
    kivi, kvquant = store_for("kivi", 4, spec), store_for("kvquant", 2, spec)
    together = decode(range(4), [None, kivi, kivi, kvquant])
    assert [r.generated_ids for r in together] == alone
    assert kvquant.report() == alone_stores[3].report()  # its one row, as alone
    pair = [alone_stores[i].report().bf16_bytes for i in (1, 2)]  # peaks: at most their sum, at least the larger
    assert max(pair) <= kivi.report().bf16_bytes <= sum(pair) and kivi.report().k_nominal_bits == 4.0
