"""Block decoding with quantized KV stores on both tiny architectures (LLaDA MHA, Dream GQA).

Each quantized decode is checked against an independent simulation: a full-precision store that quantizes and
dequantizes the reused K/V at write time with the golden-tested tensor functions (`quantize_k_groups` per row
and segment, `quantize_v`, the NUQ functions). Same tokens means the packed store, its layout, its reads and the
engine's plumbing (pre-RoPE keys included) do exactly what the formats say.
"""

from __future__ import annotations

import pytest
import torch

from service.artifacts.base import Provenance, default_v_group_size
from service.artifacts.policy import LayerPolicy, PolicyTable
from service.engine.kv_store import FullPrecisionKVStore
from service.engine.params import DecodeParams
from service.quant import nuq
from service.quant.config import KVQuantConfig
from service.quant.kvquant import fit_state
from service.quant.store import make_kv_store
from service.quant.uniform import dequantize_k_groups, dequantize_v, quantize_k_groups, quantize_v
from tests.support.fastdllm import four_prompts as _four_prompts

PROV = Provenance(data="tests: one tiny-model forward", code="tests/engine/test_decode_quantized.py")
G = 8  # K group size (tokens): several groups and short ones on the tiny prompts


def params(mode: str) -> DecodeParams:
    return DecodeParams(gen_length=64, block_length=32, cache_mode=mode, threshold=0.9, ignore_eos=True)


@pytest.fixture(scope="module")
def states(engines):
    """A KVQuant state per (arch, bits), fitted on the model's own pre-RoPE keys and values of two prompts."""
    fitted = {}
    for arch, engine in engines.items():
        keys, values = _capture_pre_rope(engine, _four_prompts(arch)[1:3])
        layers = range(engine.spec.num_layers)
        k = [torch.cat([t.transpose(1, 2).flatten(0, 1).flatten(1) for t in keys[i]]) for i in layers]
        v = [torch.cat([t.transpose(1, 2).flatten(0, 1).flatten(1) for t in values[i]]) for i in layers]
        for bits in (2, 4):
            fitted[arch, bits] = fit_state(k, v, bits, engine.spec, PROV)
    return fitted


def _capture_pre_rope(engine, prompts):
    """Per layer, the pre-RoPE keys and the values of full forwards over ``prompts``."""
    keys, values = {}, {}

    def hook(layer, q, k_pre, k, v):
        keys.setdefault(layer, []).append(k_pre)
        values.setdefault(layer, []).append(v)

    with torch.inference_mode():
        for prompt in prompts:
            engine.model(torch.tensor([prompt]), None, kv_hook=hook)
    return keys, values


def policy_for(spec, bits: int, p: int = 1) -> PolicyTable:
    kinds = ("attention", "qerror", "hybrid")
    return PolicyTable(
        model_id=spec.model_id, weights_fingerprint=spec.fingerprint, cache_mode="dual", bits=bits,
        k_group_size=G, v_group_size=default_v_group_size(spec.head_dim), k_bit_cap=16.0, provenance=PROV,
        layers=[LayerPolicy(score_type=kinds[i % 3], p=p) for i in range(spec.num_layers)],
    )


def store_for(engine, method, bits, states=None, p=1):
    spec = engine.spec
    if method == "dllm_kvq":
        table = policy_for(spec, bits, p)
        return make_kv_store(
            KVQuantConfig(method=method, bits=bits, k_group_size=G, policy_id=table.id), spec, artifact=table
        )
    if method == "kvquant":
        state = states[spec.arch, bits]
        return make_kv_store(KVQuantConfig(method=method, bits=bits, kvquant_state_id=state.id), spec, artifact=state)
    return make_kv_store(KVQuantConfig(method=method, bits=bits, k_group_size=G), spec)


class SimulatedStore(FullPrecisionKVStore):
    """Keeps QDQ'd reused K/V in full precision, computed row by row, segment by segment, at write time."""

    def __init__(self, method: str, bits: int, state=None) -> None:
        super().__init__()
        self.method, self.bits, self.state = method, bits, state
        self.pre_rope_keys = method == "kvquant"

    def write(self, layer, k, v, segments, scores=None):
        columns = segments.reused_columns
        kr, vr = k[:, :, columns], v[:, :, columns]
        out_k, out_v = torch.zeros_like(kr), torch.zeros_like(vr)
        for row in range(segments.batch_size):
            for a, e in segments.row_segments(row):
                xk, xv = kr[row : row + 1, :, a:e], vr[row : row + 1, :, a:e]
                out_k[row : row + 1, :, a:e], out_v[row : row + 1, :, a:e] = self.qdq(layer, xk, xv)
        self._layers[layer] = (out_k, out_v)

    def qdq(self, layer, k, v):
        if self.method == "kivi":
            codes, scale, mn = quantize_k_groups(k, G, self.bits)
            k_hat = dequantize_k_groups(codes, scale, mn, G, k.dtype)
            codes, scale, mn = quantize_v(v, default_v_group_size(v.shape[-1]), self.bits)
            return k_hat, dequantize_v(codes, scale, mn, v.dtype)
        s, (_, h, t, d) = self.state, k.shape
        k2, v2 = k[0].transpose(0, 1).reshape(t, h * d), v[0].transpose(0, 1).reshape(t, h * d)
        codes, out = nuq.quantize_keys(k2, s.k_upper[layer], s.k_lower[layer], s.k_lut[layer])
        k_hat = nuq.dequantize_keys(codes, s.k_upper[layer], s.k_lower[layer], s.k_lut[layer])
        k_hat[out] = k2[out].float()
        codes, offset, half_range, out = nuq.quantize_values(v2, s.v_lut[layer])
        v_hat = nuq.dequantize_values(codes, offset, half_range, s.v_lut[layer])
        v_hat[out] = v2[out].float()

        def back(x):
            return x.to(k.dtype).reshape(t, h, d).transpose(0, 1)[None]

        return back(k_hat), back(v_hat)


@pytest.mark.parametrize("arch", ["llada", "dream"])
@pytest.mark.parametrize("mode", ["prefix", "dual"])
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("method", ["kivi", "kvquant", "dllm_kvq"])
def test_quantized_decoding(engines, states, arch, mode, bits, method):
    engine = engines[arch]
    prompt = _four_prompts(arch)[1]
    report = engine.generate([prompt], params(mode), kv_store=store_for(engine, method, bits, states))
    row, kv = report.rows[0], report.kv
    assert len(row.generated_ids) == 64 and kv is not None
    assert kv.config["method"] == method and kv.config["bits"] == bits
    assert len(kv.per_layer) == engine.spec.num_layers
    assert 0 < kv.bytes_held < kv.bf16_bytes
    assert kv.v_nominal_bits >= bits and kv.k_storage_bits > kv.k_nominal_bits
    if method == "dllm_kvq":
        assert kv.policy_id is not None and kv.k_nominal_bits > bits  # one 16-bit token per group of 8
        return
    if method == "kivi":
        assert kv.k_nominal_bits == kv.v_nominal_bits == bits
    else:
        assert kv.kvquant_state_id == states[arch, bits].id
    simulated = engine.generate([prompt], params(mode), kv_store=SimulatedStore(method, bits, states.get((arch, bits))))
    assert row.generated_ids == simulated.rows[0].generated_ids
    assert row.steps_per_block == simulated.rows[0].steps_per_block


@pytest.mark.parametrize("arch", ["llada", "dream"])
def test_dllm_kvq_with_p0_decodes_exactly_as_kivi(engines, arch):
    engine = engines[arch]
    prompt = _four_prompts(arch)[2]
    kivi = engine.generate([prompt], params("dual"), kv_store=store_for(engine, "kivi", 2))
    dllm = engine.generate([prompt], params("dual"), kv_store=store_for(engine, "dllm_kvq", 2, p=0))
    assert kivi.rows[0].generated_ids == dllm.rows[0].generated_ids
    assert kivi.kv.k_storage_bits == dllm.kv.k_storage_bits


@pytest.mark.parametrize("arch", ["llada", "dream"])
@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_batch_rows_equal_rows_alone_with_kivi_2_bits(engines, arch, mode):
    engine = engines[arch]
    prompts = _four_prompts(arch)
    batch = engine.generate(prompts, params(mode), kv_store=store_for(engine, "kivi", 2)).rows
    for prompt, got in zip(prompts, batch):
        alone = engine.generate([prompt], params(mode), kv_store=store_for(engine, "kivi", 2)).rows[0]
        assert got.generated_ids == alone.generated_ids
        assert got.reveals_per_step == alone.reveals_per_step


@pytest.mark.parametrize("arch", ["llada", "dream"])
@pytest.mark.parametrize("method", ["kivi", "kvquant", "dllm_kvq"])
def test_kept_dequantized_layers_decode_as_the_per_layer_scratch(engines, states, arch, method):
    """Dequantizing once per block (kept per layer, pre-RoPE keys rotated once) and at every step (the shared
    scratch) give the same tokens, also when rows leave a block early (a batch of four prompt lengths)."""
    engine = engines[arch]
    prompts = _four_prompts(arch)
    per_step = store_for(engine, method, 2, states)
    kept = store_for(engine, method, 2, states)
    kept.keep_dequantized = True
    a = engine.generate(prompts, params("dual"), kv_store=per_step).rows
    b = engine.generate(prompts, params("dual"), kv_store=kept).rows
    assert [r.generated_ids for r in a] == [r.generated_ids for r in b]


@pytest.mark.parametrize("arch", ["llada", "dream"])
@pytest.mark.parametrize("method", ["kivi", "kvquant", "dllm_kvq"])
def test_key_bias_correction_rows_decode_as_alone_and_change_nothing_else(engines, states, arch, method, monkeypatch):
    """With the key-bias correction (`service.quant.key_bias`) a batched row gives the same tokens as the row
    alone; with every step zero it gives exactly the uncorrected tokens (the correction is the only change)."""
    from service.quant.base import KVQuantizer
    from service.quant.kvquant import KVQuantQuantizer

    engine = engines[arch]
    prompts = _four_prompts(arch)

    def corrected():
        store = store_for(engine, method, 2, states)
        store.key_bias_correction = True
        return store

    batch = engine.generate(prompts, params("dual"), kv_store=corrected()).rows
    for prompt, got in zip(prompts[:2], batch):
        alone = engine.generate([prompt], params("dual"), kv_store=corrected()).rows[0]
        assert got.generated_ids == alone.generated_ids
    plain = engine.generate(prompts, params("dual"), kv_store=store_for(engine, method, 2, states)).rows
    for cls in (KVQuantizer, KVQuantQuantizer):
        monkeypatch.setattr(cls, "key_steps", lambda self, layer, packed, layout: torch.zeros(
            layout.num_slots, packed.num_heads, packed.head_dim))
    zero = engine.generate(prompts, params("dual"), kv_store=corrected()).rows
    assert [r.generated_ids for r in zero] == [r.generated_ids for r in plain]
    assert [r.generated_ids for r in batch] != [r.generated_ids for r in plain]


@pytest.mark.parametrize("arch", ["llada", "dream"])
@pytest.mark.parametrize("method", ["kivi", "kvquant", "dllm_kvq"])
def test_a_running_batch_reads_its_corrected_requests_pooled_and_each_decodes_as_alone(engines, states, arch, method,
                                                                                       monkeypatch):
    """Requests of different prompt lengths with the key-bias correction, beside a full-precision one, in one
    running batch: every later step's layer attends all their rows in one pooled call
    (`QuantizedKVStore._attend_corrected_rows`), none alone, and each decodes token for token as it does alone."""
    from service.quant.store import QuantizedKVStore
    from service.runtime.scheduler import forward_plan

    engine = engines[arch]
    prompts = _four_prompts(arch)[:3]
    assert len({len(p) for p in prompts}) == 3
    fixed = DecodeParams(cache_mode="dual", gen_length=32, block_length=16, steps=6, threshold=None, ignore_eos=True)

    def corrected():
        store = store_for(engine, method, 2, states)
        store.key_bias_correction = True
        return store

    pooled, alone_calls = [], []
    rows_fn, one_fn = QuantizedKVStore._attend_corrected_rows, QuantizedKVStore._attend_corrected
    monkeypatch.setattr(QuantizedKVStore, "_attend_corrected_rows",
                        lambda self, stores, *a: pooled.append(len(stores)) or rows_fn(self, stores, *a))
    monkeypatch.setattr(QuantizedKVStore, "_attend_corrected", lambda self, *a: alone_calls.append(1) or one_fn(self, *a))
    batch = engine.batch(forward_plan())
    cohorts = [engine.cohort([p], fixed, None, corrected()) for p in prompts]
    cohorts.append(engine.cohort([_four_prompts(arch)[3]], fixed, None, None))  # full precision, answers alone
    with torch.inference_mode():
        for cohort in cohorts:
            batch.join(cohort)
        while batch.cohorts:
            batch.step()
    # 2 blocks x 2 later steps, one pooled call per layer for the three requests' rows
    assert pooled == [3] * (engine.spec.num_layers * 2 * 2) and not alone_calls
    for cohort, prompt, kv in zip(cohorts, [*prompts, _four_prompts(arch)[3]], [corrected] * 3 + [None]):
        alone = engine.generate([prompt], fixed, kv_store=kv() if kv else None).rows[0]
        assert engine.report(cohort).rows[0].generated_ids == alone.generated_ids
