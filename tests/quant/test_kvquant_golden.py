"""KVQuant's reference quantizer given its stored codebooks and thresholds, and the fitter against its k-means."""

import pytest
import torch

from service.quant import nuq
from tests.quant.golden import cases, load

NUQ_CASES = cases("kvquant_nuq")


@pytest.mark.parametrize("case", NUQ_CASES, ids=lambda c: c["name"])
def test_keys_match_reference(case):
    g = load(case)
    x, lut = g["k_test_2d"], g["k_lut"].flatten()
    sparse = case["include_sparse"]
    codes, outliers = nuq.quantize_keys(x, g["k_upper"].flatten(), g["k_lower"].flatten(), lut, sparse)
    deq = nuq.dequantize_keys(codes, g["k_upper"].flatten(), g["k_lower"].flatten(), lut)
    deq[outliers] = x.float()[outliers]  # outliers are kept as they are
    if sparse:
        assert torch.equal(outliers, g["k_outlier_mask"])
    assert torch.equal(deq[~outliers], g["k_qdq_fp32"][~outliers])  # bit-exact on the dense part
    assert torch.equal(deq.half(), g["k_qdq_module_fp16"])  # and the module's fp16 output everywhere


@pytest.mark.parametrize("case", NUQ_CASES, ids=lambda c: c["name"])
def test_values_match_reference(case):
    g = load(case)
    x, lut = g["v_test_2d"], g["v_lut"].flatten()
    sparse = case["include_sparse"]
    codes, offset, half_range, outliers = nuq.quantize_values(x, lut, sparse, 0.99)
    deq = nuq.dequantize_values(codes, offset, half_range, lut)
    deq[outliers] = x.float()[outliers]
    if sparse:
        assert torch.equal(outliers, g["v_outlier_mask"])
    assert torch.equal(deq, g["v_qdq_fp32"])
    assert torch.equal(deq.half(), g["v_qdq_module_fp16"])


def test_nearest_code_ties_go_to_the_earlier_entry():
    lut = torch.tensor([0.5, -0.5, 0.0, 1.0])
    u = torch.tensor([0.25, -0.25, 0.75, 2.0, -3.0])
    # 0.25 is equally far from 0.5 (entry 0) and 0.0 (entry 2): the earlier wins, as argmin's first minimum.
    assert nuq.nearest_code(u, lut).tolist() == [0, 1, 0, 3, 1]


def test_fitter_reproduces_reference_kmeans_and_thresholds():
    g = load(cases("kvquant_lut_fisher_vs_unweighted_b4")[0])
    cal = g["k_cal_2d"]
    # Comparison advice: refit codebooks compare after sorting, atol ~1e-5.
    _, _, with_fisher, _ = nuq.fit_layer(cal, cal, 4, 0.99, key_fisher=g["k_fisher"])
    torch.testing.assert_close(with_fisher, g["lut_fisher"].flatten().sort().values, atol=1e-5, rtol=0)
    _, _, unweighted, _ = nuq.fit_layer(cal, cal, 4, 0.99)
    torch.testing.assert_close(unweighted, g["lut_unweighted"].flatten().sort().values, atol=1e-5, rtol=0)
    t = load(cases("kvquant_nuq4_sparse_T64")[0])
    upper, lower, _, v_lut = nuq.fit_layer(t["k_cal_2d"], t["v_cal_2d"], 4, 0.99)
    assert torch.equal(upper, t["k_upper"].flatten().half()) and torch.equal(lower, t["k_lower"].flatten().half())
    assert v_lut.shape == (16,) and bool((v_lut.diff() > 0).all()) and v_lut.abs().max() <= 1


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_sorted_codebook_fast_path_equals_exhaustive_search(bits):
    gen = torch.Generator().manual_seed(bits)
    lut = torch.rand(2**bits, generator=gen).mul(2).sub(1).sort().values
    u = torch.cat([torch.randn(5000, generator=gen), lut, (lut[1:] + lut[:-1]) / 2, torch.tensor([-9.0, 9.0])])
    fast = nuq.nearest_code(u, lut)
    exhaustive = (u[:, None] - lut).abs().argmin(-1)  # the reference's rule
    assert torch.equal(fast.long(), exhaustive)


@pytest.mark.parametrize("channels", [16, 33, 70, 512, 4096])
def test_tail_quantiles_equal_torch_quantile(channels):
    x = torch.randn(40, channels, generator=torch.Generator().manual_seed(channels))
    x[0] = 1.5  # a constant row: ties everywhere
    upper, lower = nuq.tail_quantiles(x, 0.995)
    expected = torch.quantile(x, torch.tensor([0.995, 0.005]), dim=-1, keepdim=True)
    assert torch.equal(upper, expected[0]) and torch.equal(lower, expected[1])


def test_the_nearest_code_does_not_depend_on_the_chunk(monkeypatch):
    """`nuq.NEAREST_CHUNK` (cache-sized on a CPU, one chunk on an accelerator) changes the launches, not the codes:
    chunks of 1,000 (a last part shorter) and one chunk give the codes of the default."""
    from service.quant import nuq

    gen = torch.Generator().manual_seed(9)
    u = torch.randn(70_123, generator=gen) * 1.5
    lut = torch.sort(torch.randn(16, generator=gen)).values
    want = nuq.nearest_code(u, lut, True)
    for chunk in (1_000, 2**24):
        monkeypatch.setitem(nuq.NEAREST_CHUNK, "cpu", chunk)
        assert torch.equal(nuq.nearest_code(u, lut, True), want)
    assert torch.equal(want, (u[:, None] - lut).abs().argmin(-1).to(torch.uint8))
