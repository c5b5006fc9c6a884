"""Quantized K/V on LLaDA2's committed blocks (`service.quant.committed`): a lossless store leaves the golden runs
token-exact, KIVI, dLLM-KVQ and KVQuant at 4 and 2 bits report their agreement with the unquantized run and their
effective bits, quantized rows decode in one batch as each alone; KVQuant's path (pre-RoPE keys, partial RoPE
after the read) is lossless with a lossless store and reports its agreement as the others."""

from __future__ import annotations

import pytest
import torch

from service.engine.block_causal_batch import generate, generate_batch
from service.engine.loading import load_checkpoint
from service.quant.config import KVQuantConfig
from service.quant.store import QuantizedKVStore, make_kv_store
from tests.engine.test_llada2_generate import CASES, check_run, params_of
from tests.support.artifacts import kvquant_state_for, policy_for
from tests.support.llada2 import LLADA2_CKPT
from tests.support.quantizers import HeldQuantizer


@pytest.fixture(scope="module")
def llada2():
    return {family: load_checkpoint(path) for family, path in LLADA2_CKPT.items()}


#: 2.0 runs in block mode (2.1 editing runs write K/V the same way: after a block's last edit).
BLOCK_RUNS = [(family, run) for family, run in CASES if run["params"]["gen_length"] <= 64][:8]


def kivi_store(spec, bits: int) -> QuantizedKVStore:
    return make_kv_store(KVQuantConfig(method="kivi", bits=bits), spec, attention="torch")


def dllm_kvq_store(spec, bits: int) -> QuantizedKVStore:
    """dLLM-KVQ with one protected K token per group of 32 on every layer, ranked by attention score."""
    policy = policy_for(spec, bits=bits, p=1)
    return make_kv_store(KVQuantConfig(method="dllm_kvq", bits=bits, artifact_id=policy.id), spec, policy,
                         attention="torch")


def kvquant_store(spec, bits: int) -> QuantizedKVStore:
    """KVQuant with a small valid state (ranges of +-1, evenly spaced codebooks; tests/support/artifacts.py)."""
    state = kvquant_state_for(spec, bits=bits)
    return make_kv_store(KVQuantConfig(method="kvquant", bits=bits, artifact_id=state.id), spec, state,
                         attention="torch")


STORES = {"kivi": kivi_store, "dllm_kvq": dllm_kvq_store, "kvquant": kvquant_store}


@pytest.mark.parametrize("pre_rope", [False, True], ids=["post-rope", "pre-rope"])
@pytest.mark.parametrize("family, run", BLOCK_RUNS, ids=[run["id"] for _, run in BLOCK_RUNS])
def test_lossless_store_matches_the_golden(llada2, family, run, pre_rope):
    loaded = llada2[family]
    quantizer = HeldQuantizer(KVQuantConfig(method="kivi"), loaded.spec, pre_rope)
    store = QuantizedKVStore(quantizer, attention="torch")
    result = generate(loaded.model, run["prompt_ids"], params_of(run, "block", editing=family == "llada21"),
                      loaded.spec.mask_id, loaded.spec.eos_ids, kv_store=store)
    check_run(result, run)
    report = store.report()
    assert report.k_nominal_bits == report.v_nominal_bits == 16.0


@pytest.mark.parametrize("method", STORES)
@pytest.mark.parametrize("bits", [4, 2])
def test_agreement_and_effective_bits(llada2, method, bits):
    loaded = llada2["llada2"]
    runs = [run for family, run in CASES if family == "llada2"]
    agree = total = 0
    measured = set()  # (K, V) nominal bits per run; (0, 0) when a run committed nothing (one block, short prompt)
    for run in runs:
        params = params_of(run, "block", editing=False)
        exact = generate(loaded.model, run["prompt_ids"], params, loaded.spec.mask_id, loaded.spec.eos_ids)
        store = STORES[method](loaded.spec, bits)
        quant = generate(loaded.model, run["prompt_ids"], params, loaded.spec.mask_id, loaded.spec.eos_ids,
                         kv_store=store)
        agree += sum(a == b for a, b in zip(exact.generated_ids, quant.generated_ids))
        total += max(len(exact.generated_ids), len(quant.generated_ids))
        report = store.report()
        measured.add((report.k_nominal_bits, report.v_nominal_bits))
    # Reported, not asserted beyond sanity: the tiny checkpoint's random weights make no accuracy claim.
    print(f"{method} {bits}-bit on the tiny LLaDA2.0: token agreement with the unquantized run {agree}/{total} "
          f"= {agree / total:.3f} over {len(runs)} golden prompts")
    k_bits, v_bits = ({x[i] for x in measured - {(0.0, 0.0)}} for i in (0, 1))
    assert total > 0 and k_bits and v_bits
    if method == "kivi":
        assert k_bits == v_bits == {float(bits)}
    elif method == "dllm_kvq":  # one of 32 K tokens at 16 bits per full group; more in a short group
        assert v_bits == {float(bits)} and all(k > bits + (16 - bits) / 32 - 1e-9 for k in k_bits)
    else:  # KVQuant: outliers held at 16 bits, as the data has them
        assert all(bits <= x < 16 for x in k_bits | v_bits)


@pytest.mark.parametrize("method", STORES)
def test_quantized_rows_decode_as_alone_in_one_batch(llada2, method):
    loaded = llada2["llada2"]
    cases = [run for family, run in CASES if family == "llada2"][:6]
    settings = [params_of(run, "block", editing=False) for run in cases]
    alone = [generate(loaded.model, run["prompt_ids"], p, loaded.spec.mask_id, loaded.spec.eos_ids,
                      kv_store=STORES[method](loaded.spec, 4)).generated_ids for run, p in zip(cases, settings)]
    together = generate_batch(loaded.model, [run["prompt_ids"] for run in cases], settings, loaded.spec.mask_id,
                              loaded.spec.eos_ids, kv_store=STORES[method](loaded.spec, 4))
    assert [r.generated_ids for r in together] == alone


def test_the_engine_reports_effective_bits(llada2):
    from service.engine import Engine
    from service.engine.params import DecodeParams

    loaded = llada2["llada2"]
    engine = Engine(loaded.model, loaded.spec, None, torch.float32, torch.device("cpu"))
    report = engine.generate([list(range(1, 40))], DecodeParams(gen_length=64, threshold=0.9, cache_mode="dual"),
                             kv_store=kivi_store(loaded.spec, 4))
    assert report.kv is not None and report.kv.k_nominal_bits == 4.0 and report.kv.v_nominal_bits == 4.0


QDQ_GOLDEN = "llada2_quant_qdq.json"


@pytest.mark.parametrize("method", STORES)
@pytest.mark.parametrize("family", ["llada2", "llada21"])
def test_packed_store_decodes_as_the_qdq_in_place_cache(llada2, family, method):
    """The committed blocks held packed and dequantized at each read decode token for token (and forward for
    forward) what the cache that held them quantized-dequantized in place decoded (tests/data/llada2/README.md)."""
    from service.engine.block_causal_batch import generate_batch
    from tests.support.llada2 import llada2_golden

    golden, loaded = llada2_golden(QDQ_GOLDEN), llada2[family]
    runs = {run["id"]: run for f, run in CASES if f == family}
    editing = family == "llada21"
    for bits in (4, 2):
        for run_id, ids, nfe in golden[f"{family}/{method}/{bits}"]:
            run = runs[run_id]
            result = generate(loaded.model, run["prompt_ids"], params_of(run, "block", editing), loaded.spec.mask_id,
                              loaded.spec.eos_ids, kv_store=STORES[method](loaded.spec, bits))
            assert (result.generated_ids, result.nfe) == (ids, nfe), (run_id, bits)
    batch_runs = [runs[run_id] for run_id, _, _ in golden[f"{family}/{method}/4"]][:6]
    together = generate_batch(loaded.model, [run["prompt_ids"] for run in batch_runs],
                              [params_of(run, "block", editing) for run in batch_runs], loaded.spec.mask_id,
                              loaded.spec.eos_ids, kv_store=STORES[method](loaded.spec, 4))
    assert [r.generated_ids for r in together] == golden[f"{family}/{method}/batch"]


@pytest.mark.parametrize("method", STORES)
def test_bytes_held_are_the_packed_bytes_the_report_and_admission_count(llada2, method):
    """The committed blocks are held packed: the store holds the report's packed bytes plus its small index
    tensors, within 15% of what admission counts for the committed tokens (`MemoryModel.kv_bytes_per_token`, a
    256-token probe); no full-precision per-layer K/V is held for the row (one scratch layer)."""
    from service.engine.block_causal_batch import BlockCausalBatch, BlockCausalCohort
    from service.runtime.memory import MemoryModel

    loaded, spec = llada2["llada2"], llada2["llada2"].spec
    run = next(r for f, r in CASES if f == "llada2" and r["params"]["gen_length"] >= 64)
    store = STORES[method](spec, 4)
    batch = BlockCausalBatch(loaded.model)
    batch.join(BlockCausalCohort(loaded.model, [run["prompt_ids"]], [params_of(run, "block", editing=False)],
                                 spec.mask_id, spec.eos_ids, kv_store=store))
    seen = 0
    with torch.inference_mode():
        while batch.cohorts:
            batch.step()
            assert not batch.failed
            for cache in batch.caches:  # none once the row has left
                seen += 1
                assert all(k.shape[0] == 0 for k in cache.k + cache.v)  # no per-layer buffer for the packed row
                assert cache.nbytes == 2 * cache.scratch[0].numel() * cache.scratch[0].element_size()
    assert seen
    held = store._committed[0]
    tokens = sum(end - start for start, end, _ in held.layers[0])
    packed = sum(p.nbytes for blocks in held.layers.values() for _, _, p in blocks)
    assert tokens >= 64 and set(held.layers) == set(range(spec.num_layers))
    report = store.report()
    assert report.bytes_held == packed == sum(p.nbytes for blocks in held.layers.values() for *_, p in blocks)
    bf16 = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 2 * tokens
    assert report.bf16_bytes == bf16
    assert packed < store.bytes_held == store.committed_bytes(0) < packed * 1.3  # index tensors of the reads
    per_token = MemoryModel.dense(spec, 64, 64, 4).kv_bytes_per_token(method, lambda: STORES[method](spec, 4))
    admission = per_token * tokens
    print(f"{method} 4-bit, {tokens} committed tokens: held {store.bytes_held} B (packed {packed}), admission "
          f"{admission:.0f} B, bf16 {bf16} B")
    if method == "kvquant":  # its outlier rows' room follows the fullest token a write met: the probe's 256 tokens
        # in one write meet a fuller one than a run's blocks, so admission counts more (never less)
        assert 0.6 * admission <= store.bytes_held <= 1.15 * admission
    else:
        assert abs(store.bytes_held - admission) <= 0.15 * admission


def test_a_quantized_and_an_unquantized_request_in_one_batch_decode_as_alone(llada2):
    """Full-precision slots (per-layer buffers) and packed slots (the scratch) in one forward: each request
    decodes as it does alone."""
    from service.engine.block_causal_batch import BlockCausalBatch, BlockCausalCohort

    loaded, spec = llada2["llada2"], llada2["llada2"].spec
    cases = [run for family, run in CASES if family == "llada2"][:4]
    settings = [params_of(run, "block", editing=False) for run in cases]
    stores = [None, kivi_store(spec, 4), None, kivi_store(spec, 2)]
    alone = [generate(loaded.model, run["prompt_ids"], p, spec.mask_id, spec.eos_ids,
                      kv_store=kivi_store(spec, (None, 4, None, 2)[n]) if stores[n] else None).generated_ids
             for n, (run, p) in enumerate(zip(cases, settings))]
    batch = BlockCausalBatch(loaded.model)
    cohorts = [BlockCausalCohort(loaded.model, [run["prompt_ids"]], [p], spec.mask_id, spec.eos_ids, kv_store=s)
               for run, p, s in zip(cases, settings, stores)]
    for cohort in cohorts:
        batch.join(cohort)
    with torch.inference_mode():
        while batch.cohorts:
            batch.step()
            assert not batch.failed
    assert [c.results[0].generated_ids for c in cohorts] == alone


def test_a_row_whose_put_off_checks_fail_fails_alone_with_the_writes_error(llada2):
    """The committing block's write checks are put off to the iteration's one read (`CommitWriter`): a row whose
    committed K holds NaN (its prompt's first token embeds to NaN) fails alone with the error its write raises
    with the checks read at once; the other rows, quantized or not, decode as alone."""
    import copy

    from service.engine.block_causal_batch import BlockCausalBatch, BlockCausalCohort
    from service.quant.errors import NonFiniteKVError

    loaded, spec = llada2["llada2"], llada2["llada2"].spec
    model = copy.deepcopy(loaded.model)
    cases = [run for family, run in CASES if family == "llada2"][:3]
    settings = [params_of(run, "block", editing=False) for run in cases]
    alone = [generate(model, run["prompt_ids"], p, spec.mask_id, spec.eos_ids,
                      kv_store=kivi_store(spec, 4) if n < 2 else None).generated_ids
             for n, (run, p) in enumerate(zip(cases, settings))]
    used = {t for run, ids in zip(cases, alone) for t in run["prompt_ids"] + ids}
    poison = next(t for t in range(spec.vocab_size) if t not in used and t != spec.mask_id)
    with torch.no_grad():
        model.embed.weight[poison] = float("nan")
    bad_prompt = [poison] + cases[0]["prompt_ids"][1:]
    prompts = [bad_prompt] + [run["prompt_ids"] for run in cases]
    stores = [kivi_store(spec, 4), kivi_store(spec, 4), kivi_store(spec, 4), None]
    batch = BlockCausalBatch(model)
    cohorts = [BlockCausalCohort(model, [prompt], [p], spec.mask_id, spec.eos_ids, kv_store=s)
               for prompt, p, s in zip(prompts, [settings[0]] + settings, stores)]
    for cohort in cohorts:
        batch.join(cohort)
    failed = []
    with torch.inference_mode():
        while batch.cohorts:
            batch.step()
            failed += batch.failed
    assert [c for c, _ in failed] == [cohorts[0]]
    error = failed[0][1]
    assert isinstance(error, NonFiniteKVError)
    assert str(error).startswith("layer 0: K holds NaN or inf at row 0, sequence column 0;"), str(error)
    assert [c.results[0].generated_ids for c in cohorts[1:]] == alone
