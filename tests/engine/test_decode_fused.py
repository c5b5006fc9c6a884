"""Whole decodes with the fused attention kernel forced on CPU (Triton's interpreter) are token-identical to the
PyTorch QDQ path, on both tiny checkpoints in fp32 (LLaDA: MHA; Dream: GQA, rotation in the model dtype).

Two rows of different prompt lengths (left padding) in dual mode (prefix mode's window is in the kernel tests of
tests/quant/test_fused_attention.py); later steps of each block go through
`QuantizedKVStore.attend` (the kernel) instead of ``read`` + SDPA. Short decodes: the interpreter is slow.
A running batch of such requests attends their rows in one launch per layer (`QuantizedKVStore.attend_batch`).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from service.engine.params import DecodeParams
from service.quant.config import KVQuantConfig
from service.quant.kvquant import fit_state
from service.quant.store import QuantizedKVStore, make_kv_store
from tests.engine.test_decode_quantized import PROV, _capture_pre_rope, policy_for
from tests.support.fastdllm import four_prompts

# On CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py).
PARAMS = {"gen_length": 32, "block_length": 16, "steps": 6, "threshold": None, "ignore_eos": True}


def _store(engine, method: str, prompts, attention: str, key_bias: bool = False) -> QuantizedKVStore:
    spec = engine.spec
    if method == "dllm_kvq":
        table = policy_for(spec, 4, p=2)
        config = KVQuantConfig(method=method, bits=4, k_group_size=8, policy_id=table.id, key_bias_correction=key_bias)
        return make_kv_store(config, spec, artifact=table, attention=attention)
    keys, values = _capture_pre_rope(engine, prompts)
    layers = range(spec.num_layers)
    k = [torch.cat([t.transpose(1, 2).flatten(0, 1).flatten(1) for t in keys[i]]) for i in layers]
    v = [torch.cat([t.transpose(1, 2).flatten(0, 1).flatten(1) for t in values[i]]) for i in layers]
    state = fit_state(k, v, 2, spec, PROV)
    config = KVQuantConfig(method=method, bits=2, kvquant_state_id=state.id, key_bias_correction=key_bias)
    return make_kv_store(config, spec, artifact=state, attention=attention)


@pytest.mark.parametrize(("arch", "method", "key_bias"),
                         [("llada", "dllm_kvq", False), ("dream", "kvquant", False), ("dream", "kvquant", True)])
def test_fused_kernel_decodes_token_identical(engines, arch, method, key_bias):
    """With the key-bias correction too: the kernel's term against the PyTorch path's (`service.quant.key_bias`;
    KVQuant's pre-RoPE steps, Dream's rotation in the model dtype)."""
    engine = engines[arch]
    prompts = four_prompts(arch)[1:3]  # 17 and 40 tokens: the shorter row is left-padded
    params = DecodeParams(cache_mode="dual", **PARAMS)
    calls = []
    fused = _store(engine, method, prompts, "triton", key_bias)
    attend = fused.attend
    fused.attend = lambda *args: calls.append(args[0]) or attend(*args)
    got = engine.generate(prompts, params, kv_store=fused)
    expected = engine.generate(prompts, params, kv_store=_store(engine, method, prompts, "torch", key_bias))
    assert len(calls) == engine.spec.num_layers * 2 * 2  # 2 blocks x 2 later steps, every layer through the kernel
    for row, ref in zip(got.rows, expected.rows):
        assert row.generated_ids == ref.generated_ids


@pytest.mark.parametrize("method", ["dllm_kvq", "kivi", "kivi_corrected"])
def test_a_running_batch_attends_its_fused_stores_in_one_launch_per_layer(engines, method, monkeypatch):
    """Requests of different prompt lengths whose stores are on the kernel's path (one uniform format) decode in
    one running batch beside a full-precision request: every later step's layer launches the kernel once for all
    their rows (`fused_reuse_attention_rows`; ``kivi_corrected``: with the key-bias correction), and each request
    decodes token for token as it does alone."""
    from service.quant.kernels import attention
    from service.runtime.scheduler import forward_plan

    engine = engines["llada"]
    prompts = four_prompts("llada")[:3]
    assert len({len(p) for p in prompts}) == 3
    params = DecodeParams(cache_mode="dual", **PARAMS)

    def store():
        if method.startswith("kivi"):
            config = KVQuantConfig(method="kivi", bits=4, k_group_size=8, key_bias_correction=method != "kivi")
            return make_kv_store(config, engine.spec, attention="triton")
        return _store(engine, method, prompts, "triton")

    kernel = attention._fused_reuse_attention
    launches = []

    class Counted:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(attention, "_fused_reuse_attention", Counted())
    batch = engine.batch(forward_plan())
    cohorts = [engine.cohort([p], params, None, store()) for p in prompts]
    cohorts.append(engine.cohort([four_prompts("llada")[3]], params, None, None))  # full precision, answers alone
    merged = []
    with torch.inference_mode():
        for cohort in cohorts:
            batch.join(cohort)
        while batch.cohorts:
            batch.step()
            merged.append(batch.merged)
    assert len(cohorts) in merged  # later steps where the fused rows share the forward with the other one
    # 2 blocks x 2 later steps, one launch per layer for the three requests' rows (each alone: three)
    assert len(launches) == engine.spec.num_layers * 2 * 2
    monkeypatch.setattr(attention, "_fused_reuse_attention", kernel)
    for cohort, prompt, kv in zip(cohorts, [*prompts, four_prompts("llada")[3]], [store, store, store, None]):
        alone = engine.generate([prompt], params, kv_store=kv() if kv else None).rows[0]
        assert engine.report(cohort).rows[0].generated_ids == alone.generated_ids
