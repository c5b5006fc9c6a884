"""dLLM-KVQ's protected K tokens (paper "Online Quantization Details")."""

import pytest
import torch

from service.engine.kv_store import Segments
from service.quant.config import KVQuantConfig
from service.quant.errors import KVQuantError
from service.quant.layout import SlotLayout
from service.quant.store import make_kv_store
from service.quant.uniform import dequantize_k_groups, quantize_k_groups
from tests.quant.helpers import SPEC, kv, policy

SEG = Segments((0, 2), block_start=20, block_end=28, seq_len=40, cache_mode="dual")


def dllm_store(entries, bits=4, **kw):
    cfg = KVQuantConfig(method="dllm_kvq", bits=bits, k_group_size=8, policy_id="p", **kw)
    table = policy(entries, bits=bits)
    return make_kv_store(cfg.model_copy(update={"artifact_id": table.id}), SPEC, artifact=table)


@pytest.mark.parametrize("score_type", ["attention", "qerror", "hybrid"])
@pytest.mark.parametrize("bits", [2, 4])
def test_p0_equals_kivi_exactly(score_type, bits):
    k, v = kv(2, 40, torch.bfloat16, seed=2)
    kivi = make_kv_store(KVQuantConfig(method="kivi", bits=bits, k_group_size=8), SPEC)
    dllm = dllm_store([(score_type, 0)] * 2, bits=bits)
    assert not dllm.needs_scores
    kivi.write(0, k, v, SEG)
    dllm.write(0, k, v, SEG, torch.rand(2, 40))
    assert all(torch.equal(a, b) for a, b in zip(kivi.read(0), dllm.read(0)))
    assert kivi.report().k_storage_bits == dllm.report().k_storage_bits


def test_top_p_tokens_are_exact_and_excluded_from_the_range():
    k, v = kv(1, 24)
    k[0, :, 3] *= 50  # an outlier token in the first K group (tokens 0..7)
    scores = torch.full((1, 24), 0.01)
    scores[0, 3] = 0.5
    seg = Segments((0,), block_start=8, block_end=16, seq_len=24, cache_mode="dual")
    store = dllm_store([("attention", 1)] * 2, bits=2)
    assert store.needs_scores
    store.write(0, k, v, seg, scores)
    rk, _ = store.read(0)
    assert torch.equal(rk[0, :, 3], k[0, :, 3])
    rest = [0, 1, 2, 4, 5, 6, 7]
    # The other 7 tokens are quantized over their own range, exactly as a group of those 7 alone.
    codes, scale, mn = quantize_k_groups(k[:, :, rest], 8, 2)
    assert torch.equal(rk[:, :, rest], dequantize_k_groups(codes, scale, mn, 8, torch.float32))
    # Second group (suffix segment): its own top-attention token (the first, all tied) is protected.
    assert torch.equal(rk[0, :, 8], k[0, :, 16])
    report = store.report()
    assert report.k_nominal_bits == (2 * 7 + 16) / 8  # one protected token per group of 8
    assert report.per_layer[0].k_nominal_bits == report.k_nominal_bits


def test_qerror_protects_the_worst_reconstructed_tokens():
    k, v = kv(1, 8, seed=4)
    seg = Segments((0,), block_start=8, block_end=8 + 1, seq_len=9, cache_mode="prefix")
    kpad = torch.cat([k, k[:, :, :1]], dim=2)
    store = dllm_store([("qerror", 2)] * 2)
    store.write(0, kpad, torch.cat([v, v[:, :, :1]], dim=2), seg)
    rk, _ = store.read(0)
    codes, scale, mn = quantize_k_groups(k, 8, 4)
    err = (k - dequantize_k_groups(codes, scale, mn, 8, torch.float32)).square().sum((1, 3))[0]
    worst = err.topk(2).indices.sort().values.tolist()
    exact = [t for t in range(8) if torch.equal(rk[0, :, t], k[0, :, t])]
    assert set(worst) <= set(exact)


def test_hybrid_ranks_by_the_product_of_group_normalized_scores():
    from service.quant.dllm_kvq import normalize_per_group, top_p_per_group

    layout = SlotLayout.from_segments(Segments((0,), 6, 7, 7, "prefix"), group_size=4)  # groups of 4 and 2
    attention = torch.tensor([0.1, 0.4, 0.2, 0.3, 0.0, 0.0], dtype=torch.float64)
    qerror = torch.tensor([4.0, 0.5, 3.0, 1.0, 2.0, 1.0], dtype=torch.float64)
    a, e = normalize_per_group(attention, layout), normalize_per_group(qerror, layout)
    assert torch.allclose(a[:4], attention[:4] / 0.25) and (a[4:] == 0).all()  # zero-mean group -> 0
    assert torch.allclose(e[4:], qerror[4:] / 1.5)
    # products in group 0: 0.4*4, 0.2*0.5, ... -> ranks token 2 (0.6), then 0 (0.4); group 1 ties -> earlier
    assert top_p_per_group(a * e, layout, 2).tolist() == [True, False, True, False, True, True]


def test_attention_policy_without_scores_is_an_error():
    k, v = kv(2, 40)
    store = dllm_store([("attention", 1), ("qerror", 1)])
    with pytest.raises(KVQuantError, match="layer 0: score type 'attention' needs block-initial attention scores"):
        store.write(0, k, v, SEG)
    bad = torch.rand(2, 40)
    bad[0, 5] = float("nan")
    with pytest.raises(KVQuantError, match="layer 0: attention scores hold NaN or inf"):
        store.write(0, k, v, SEG, bad)


def test_protection_covers_short_groups():
    # prefix segment of 3 tokens with p = 4: every token of the short group is kept
    k, v = kv(1, 6)
    seg = Segments((0,), block_start=3, block_end=6, seq_len=6, cache_mode="dual")
    store = dllm_store([("qerror", 4)] * 2, bits=2)
    store.write(0, k, v, seg)
    assert torch.equal(store.read(0)[0], k[:, :, :3])
    assert store.report().k_nominal_bits == 16


@pytest.mark.parametrize("width", [(2, 16), (1, 6)])  # int64 row moves, and the byte fallback
def test_code_rows_expand_around_protected_slots(width):
    from service.quant.base import _code_rows, _expand_rows

    codes = torch.randint(0, 16, (3, *width), dtype=torch.uint8)
    rows = _code_rows(torch.tensor([1, 4]), 5)  # slots 1 and 4 protected: 0, 2, 3 hold codes 0, 1, 2
    assert rows.tolist() == [0, 3, 1, 2, 3, 3]
    full = _expand_rows(codes, rows[:-1])
    assert torch.equal(full[[0, 2, 3]], codes) and not full[[1, 4]].any()
