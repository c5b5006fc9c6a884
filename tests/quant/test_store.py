"""The quantized KV store: the dLLM rules, bad and awkward input, accounting."""

import pytest
import torch
from pydantic import ValidationError

from service.artifacts.base import ArtifactMismatch
from service.engine.kv_store import FullPrecisionKVStore, Segments
from service.quant.config import KVQuantConfig
from service.quant.errors import KVQuantError, NonFiniteKVError
from service.quant.kvquant import fit_state
from service.quant.store import QuantizedKVStore, make_kv_store
from service.quant.uniform import dequantize_k_groups, dequantize_v, quantize_k_groups, quantize_v
from tests.quant.helpers import PROV, SPEC, kv, policy, state

STATE4 = state(bits=4)
STATE2 = state(bits=2)


def store_for(method, bits=4, **kw):
    cfg = {"method": method, "bits": bits, "k_group_size": 8, **kw}
    if method == "dllm_kvq":
        cfg["policy_file"] = "unused.json"
        return make_kv_store(KVQuantConfig(**cfg), SPEC, artifact=policy([("qerror", 2), ("hybrid", 1)], bits=bits))
    if method == "kvquant":
        cfg["kvquant_state_file"] = "unused.safetensors"
        return make_kv_store(KVQuantConfig(**cfg), SPEC, artifact=STATE4 if bits == 4 else STATE2)
    return make_kv_store(KVQuantConfig(**cfg), SPEC)


def kivi_reference(x, group_size, bits, dtype):
    codes, scale, mn = quantize_k_groups(x, group_size, bits)
    return dequantize_k_groups(codes, scale, mn, group_size, dtype)


def scores_for(k):
    return torch.rand(k.shape[0], k.shape[2], generator=torch.Generator().manual_seed(5))


def test_none_is_the_full_precision_store():
    assert isinstance(make_kv_store(KVQuantConfig(), SPEC), FullPrecisionKVStore)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("work_elements", [2**20, 64])  # 64: the 16-bit read path works in many small chunks
def test_k_groups_stay_inside_segments_with_short_last_groups(dtype, work_elements, monkeypatch):
    monkeypatch.setattr("service.quant.uniform._WORK_ELEMENTS", work_elements)
    k, v = kv(2, 40, dtype)
    seg = Segments((0, 3), block_start=20, block_end=28, seq_len=40, cache_mode="dual")
    store = store_for("kivi", bits=2)
    store.write(0, k, v, seg)
    rk, rv = store.read(0)
    assert rk.shape == (2, 2, 32, 16) and rk.dtype == dtype
    for row, start in ((0, 0), (1, 3)):
        # prefix segment [start, 20): groups of 8 from the first real token, last one short
        expected = kivi_reference(k[row : row + 1, :, start:20], 8, 2, dtype)
        assert torch.equal(rk[row : row + 1, :, start:20], expected)
        # suffix segment [28, 40) -> reused positions [20, 32): 8 + a short group of 4
        assert torch.equal(rk[row : row + 1, :, 20:], kivi_reference(k[row : row + 1, :, 28:], 8, 2, dtype))
    codes, scale, mn = quantize_v(v, 16, 2)
    columns = list(range(20)) + list(range(28, 40))
    assert torch.equal(rv[0], dequantize_v(codes, scale, mn, dtype)[0][:, columns])
    assert (rk[1, :, :3] == 0).all() and (rv[1, :, :3] == 0).all()  # padding is not held


@pytest.mark.parametrize("method", ["kivi", "dllm_kvq", "kvquant"])
def test_row_alone_equals_row_in_any_batch_and_padding_never_counts(method):
    k, v = kv(3, 48, seed=3)
    # Row 1 alone has no padding; in the batch it has 5 padding columns filled with huge values.
    alone_k, alone_v = k[1:2, :, 5:], v[1:2, :, 5:]
    k[1, :, :5] = 1e4
    v[1, :, :5] = -1e4
    batch_seg = Segments((2, 5, 0), block_start=24, block_end=32, seq_len=48, cache_mode="dual")
    alone_seg = Segments((0,), block_start=19, block_end=27, seq_len=43, cache_mode="dual")
    batch, single = store_for(method), store_for(method)
    scores = scores_for(k)
    batch.write(1, k, v, batch_seg, scores)
    single.write(1, alone_k, alone_v, alone_seg, scores[1:2, 5:])
    bk, bv = batch.read(1)
    sk, sv = single.read(1)
    assert torch.equal(bk[1:2, :, 5:], sk) and torch.equal(bv[1:2, :, 5:], sv)


def test_zero_range_group_is_exact_and_one_token_group_too():
    k, v = kv(1, 20)
    k[0, 1, 0:8, 3] = 0.625  # a constant channel over the first K group
    v[0, 0, 4] = -1.5  # a constant V token (one V group = the whole head)
    # prefix segment of 17 tokens = 8 + 8 + a group of one token
    seg = Segments((0,), block_start=17, block_end=20, seq_len=20, cache_mode="prefix")
    store = store_for("kivi", bits=2)
    store.write(0, k, v, seg)
    rk, rv = store.read(0)
    assert (rk[0, 1, 0:8, 3] == 0.625).all()
    assert torch.equal(rk[0, :, 16], k[0, :, 16])  # a group of one token: min == max, exact
    assert (rv[0, 0, 4] == -1.5).all()
    # neighbours of the constant channel are quantized normally
    assert torch.equal(rk[0, 1, 0:8, 4], kivi_reference(k[:, :, 0:8], 8, 2, torch.float32)[0, 1, :, 4])


def test_segment_shorter_than_one_group():
    k, v = kv(1, 12)
    seg = Segments((0,), block_start=3, block_end=8, seq_len=12, cache_mode="dual")  # 3 + 4 reused tokens
    store = store_for("kivi", bits=4)
    store.write(0, k, v, seg)
    rk, _ = store.read(0)
    assert torch.equal(rk[:, :, :3], kivi_reference(k[:, :, :3], 8, 4, torch.float32))
    assert torch.equal(rk[:, :, 3:], kivi_reference(k[:, :, 8:], 8, 4, torch.float32))


@pytest.mark.parametrize("method", ["kivi", "dllm_kvq", "kvquant"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("which", ["K", "V"])
def test_non_finite_input_is_a_clear_error(method, bad, which):
    k, v = kv(2, 24)
    (k if which == "K" else v)[1, 0, 6, 2] = bad
    seg = Segments((0, 4), block_start=16, block_end=20, seq_len=24, cache_mode="dual")
    store = store_for(method)
    with pytest.raises(NonFiniteKVError, match=f"layer 0: {which} holds NaN or inf at row 1, sequence column 6"):
        store.write(0, k, v, seg, scores_for(k))
    with pytest.raises(KVQuantError, match="layer 0 was not written"):
        store.read(0)  # nothing half-written
    # NaN in padding is never read
    k, v = kv(2, 24)
    k[1, 0, 2, 2] = bad
    store.write(0, k, v, seg, scores_for(k))
    assert torch.isfinite(store.read(0)[0]).all()


@pytest.mark.parametrize("method", ["kivi", "dllm_kvq", "kvquant"])
@pytest.mark.parametrize("which", ["K", "V"])
def test_huge_finite_values_quantize(method, which):
    # A float32 sum of these overflows to inf (it once made the NaN scan find nothing and raise IndexError).
    seg = Segments((0, 4), block_start=16, block_end=20, seq_len=24, cache_mode="dual")
    k, v = kv(2, 24)
    (k if which == "K" else v)[:] = 1e36
    store = store_for(method)
    store.write(0, k, v, seg, scores_for(k))
    rk, rv = store.read(0)
    assert ((rk if which == "K" else rv)[1, :, 4:] == 1e36).all()  # a constant group is exact (padding: 0)
    k, v = kv(2, 24)
    (k if which == "K" else v)[1, 0, 6:8, 2] = 3e38  # two entries, one K group and channel, two V tokens
    store.write(0, k, v, seg, scores_for(k))
    rk, rv = store.read(0)
    assert torch.isfinite(rk).all() and torch.isfinite(rv).all()
    got = (rk if which == "K" else rv)[1, 0, 6:8, 2]  # prefix positions keep their column
    assert torch.allclose(got, torch.full((2,), 3e38), rtol=0.01)


@pytest.mark.parametrize("method", ["kivi", "dllm_kvq"])
def test_a_range_that_overflows_the_dtype_is_named(method):
    k, v = kv(2, 24)
    k[1, 0, 6, 2], k[1, 0, 7, 2] = 3e38, -3e38  # max - min = 6e38 > float32's 3.4e38
    seg = Segments((0, 4), block_start=16, block_end=20, seq_len=24, cache_mode="dual")
    with pytest.raises(KVQuantError, match="a group's range overflows torch.float32") as raised:
        store_for(method).write(0, k, v, seg, scores_for(k))
    assert not isinstance(raised.value, NonFiniteKVError)


@pytest.mark.parametrize("bad", [(3e38, 3e38), (3e38, -3e38), (-3e38, -3e38)])
def test_kvquant_dense_value_ranges_do_not_overflow(bad):
    # Without sparse outliers, a token's midpoint or half range overflows float32 here.
    keys, values = zip(*(kv(4, 64, seed=1 + i) for i in range(SPEC.num_layers)))
    dense = fit_state(list(keys), list(values), 4, SPEC, PROV, sparsity_threshold=1.0)
    cfg = KVQuantConfig(method="kvquant", bits=4, k_group_size=8, kvquant_state_file="unused.safetensors")
    store = make_kv_store(cfg, SPEC, artifact=dense)
    k, v = kv(1, 24)
    v[0, :, 6, :8], v[0, :, 6, 8:] = bad  # one token: all of its H x D entries are at the extremes
    seg = Segments((0,), block_start=16, block_end=20, seq_len=24, cache_mode="dual")
    store.write(0, k, v, seg)
    got = store.read(0)[1][0, :, 6]
    assert torch.isfinite(got).all()
    if bad[0] == bad[1]:
        assert (got == bad[0]).all()  # a constant token is exact
    else:
        assert (got[:, :8] > 2e38).all() and (got[:, 8:] < -2e38).all()


def test_v_group_size_must_divide_head_dim():
    with pytest.raises(KVQuantError, match=r"v_group_size 5 does not divide head_dim 16; legal: \[1, 2, 4, 8, 16\]"):
        make_kv_store(KVQuantConfig(method="kivi", v_group_size=5), SPEC)


def test_kvquant_request_without_state():
    with pytest.raises(ValidationError, match="needs exactly one of kvquant_state_id or kvquant_state_file"):
        KVQuantConfig(method="kvquant")
    with pytest.raises(KVQuantError, match="must be resolved by the caller"):
        make_kv_store(KVQuantConfig(method="kvquant", kvquant_state_id="kvqstate-x"), SPEC)


def test_unreadable_policy_or_state_file_is_a_clear_error(tmp_path):
    with pytest.raises(KVQuantError, match="policy_file '.*missing.json' cannot be used"):
        make_kv_store(KVQuantConfig(method="dllm_kvq", policy_file=str(tmp_path / "missing.json")), SPEC)
    (tmp_path / "bad.safetensors").write_bytes(b"not a state")
    with pytest.raises(KVQuantError, match="kvquant_state_file .* cannot be used: not a KVQuant state file"):
        make_kv_store(KVQuantConfig(method="kvquant", kvquant_state_file=str(tmp_path / "bad.safetensors")), SPEC)


def test_state_and_policy_must_fit_model_and_config(tmp_path):
    path = tmp_path / "state.safetensors"
    STATE4.save(path)
    store = make_kv_store(KVQuantConfig(method="kvquant", bits=4, kvquant_state_file=str(path)), SPEC)
    assert store.pre_rope_keys and store.artifact_id == STATE4.id
    with pytest.raises(ArtifactMismatch, match="^bits: the artifact has 4, the configuration asks for 2"):
        make_kv_store(KVQuantConfig(method="kvquant", bits=2, kvquant_state_file=str(path)), SPEC)
    with pytest.raises(ArtifactMismatch, match="^kvquant_state_id"):
        make_kv_store(KVQuantConfig(method="kvquant", kvquant_state_id="kvqstate-other"), SPEC, artifact=STATE4)
    table = policy([("attention", 1)] * 3)
    (tmp_path / "p.json").write_text(table.to_json())
    with pytest.raises(ArtifactMismatch, match="^layers: the policy has 3 layer entries, the model has 2"):
        make_kv_store(KVQuantConfig(method="dllm_kvq", k_group_size=8, policy_file=str(tmp_path / "p.json")), SPEC)
    with pytest.raises(ArtifactMismatch, match="^k_group_size: the artifact has 8, the configuration asks for 32"):
        make_kv_store(KVQuantConfig(method="dllm_kvq", policy_id="x"), SPEC, artifact=policy([("attention", 1)] * 2))


@pytest.mark.parametrize("method", ["kivi", "dllm_kvq", "kvquant"])
def test_keep_dequantized_gives_the_same_values_and_holds_them(method):
    k, v = kv(1, 40, torch.bfloat16)
    seg = Segments((0,), block_start=24, block_end=32, seq_len=40, cache_mode="dual")
    lazy, keep = store_for(method), store_for(method, keep_dequantized=True)
    for s in (lazy, keep):
        s.write(0, k, v, seg, scores_for(k))
    assert all(torch.equal(a, b) for a, b in zip(lazy.read(0), keep.read(0)))
    assert keep.read(0)[0] is keep.read(0)[0] and keep.bytes_held > lazy.bytes_held
    assert lazy.read(0)[0] is not lazy.read(0)[0]


def test_new_block_replaces_the_previous_one():
    k, v = kv(1, 40)
    store = store_for("kivi")
    store.write(0, k, v, Segments((0,), 8, 16, 40, "dual"))
    store.write(1, k, v, Segments((0,), 8, 16, 40, "dual"))
    store.write(0, k, v, Segments((0,), 16, 24, 40, "dual"))
    assert store.read(0)[0].shape[2] == 32
    with pytest.raises(KVQuantError, match="layer 1 was not written"):
        store.read(1)


def test_accounting_by_hand():
    # One row, 64 prefix tokens, 2 kv heads x 16 channels, G = 32 tokens, V groups of 16 channels, 4 bits, bf16.
    k, v = kv(1, 72, torch.bfloat16)
    seg = Segments((0,), block_start=64, block_end=72, seq_len=72, cache_mode="prefix")
    store = make_kv_store(KVQuantConfig(method="kivi", bits=4), SPEC)
    store.write(0, k, v, seg)
    store.write(1, k, v, seg)
    report = store.report()
    elements = 64 * 2 * 16
    assert report.k_nominal_bits == report.v_nominal_bits == 4
    # K: 4-bit codes + per (group, head, channel) a bf16 scale and min: 2 groups x 32 x 4 bytes
    assert report.k_storage_bits == (elements * 4 / 8 + 2 * 32 * 4) * 8 / elements == 5.0
    # V: per (token, head) one group of 16 channels with a bf16 scale and min: 4 bytes per 16 elements
    assert report.v_storage_bits == (elements * 4 / 8 + 64 * 2 * 4) * 8 / elements == 6.0
    assert report.bf16_bytes == 2 * 2 * elements * 2
    layout_bytes = store._layout.nbytes
    assert report.bytes_held == 2 * (elements * 4 / 8 * 2 + 2 * 32 * 4 + 64 * 2 * 4) + layout_bytes
    assert [layer.layer for layer in report.per_layer] == [0, 1]


def test_kvquant_store_matches_nuq_functions_with_gqa():
    from service.quant import nuq

    k, v = kv(1, 40, torch.float16, seed=9)
    seg = Segments((0,), block_start=24, block_end=32, seq_len=40, cache_mode="dual")
    store = store_for("kvquant")
    assert isinstance(store, QuantizedKVStore) and store.pre_rope_keys
    store.write(1, k, v, seg)
    rk, _ = store.read(1)
    cols = list(range(24)) + list(range(32, 40))
    x2d = k[0][:, cols].transpose(0, 1).reshape(32, -1)  # [T, H*D], column h*D + d
    s = STATE4
    codes, outliers = nuq.quantize_keys(x2d, s.k_upper[1], s.k_lower[1], s.k_lut[1])
    deq = nuq.dequantize_keys(codes, s.k_upper[1], s.k_lower[1], s.k_lut[1]).half()
    deq[outliers] = x2d[outliers]
    assert torch.equal(rk[0].transpose(0, 1).reshape(32, -1), deq)
    report = store.report()
    n_out = int(outliers.sum())
    assert report.k_nominal_bits == (4 * (x2d.numel() - n_out) + 16 * n_out) / x2d.numel()
    assert report.v_nominal_bits > 4  # per-token quantile outliers, about 1% of entries at 16 bits


@pytest.mark.parametrize("method", ["kivi", "kvquant", "dllm_kvq"])
def test_sides_quantize_one_of_k_and_v_and_hold_the_other_exactly(method):
    k, v = kv(2, 40)
    seg = Segments((0, 3), block_start=20, block_end=28, seq_len=40, cache_mode="dual")
    both = store_for(method, bits=2)
    both.write(0, k, v, seg, scores_for(k))
    k_both, v_both = both.read(0)
    reused = torch.cat([k[:, :, :20], k[:, :, 28:]], dim=2), torch.cat([v[:, :, :20], v[:, :, 28:]], dim=2)
    k_only = store_for(method, bits=2, sides="k")
    k_only.write(0, k, v, seg, scores_for(k))
    rk, rv = k_only.read(0)
    assert torch.equal(rk, k_both)  # K exactly as the method quantizes it with both sides
    assert torch.equal(rv[0], reused[1][0]) and torch.equal(rv[1, :, 3:], reused[1][1, :, 3:])  # V as it was
    v_only = store_for(method, bits=2, sides="v")
    v_only.write(0, k, v, seg, scores_for(k))
    rk, rv = v_only.read(0)
    assert torch.equal(rv, v_both) and torch.equal(rk[0], reused[0][0])
    # The held side counts 16 nominal bits per entry (the paper's high-precision accounting).
    assert v_only.report().k_nominal_bits == 16.0
    assert k_only.report().v_nominal_bits == 16.0


def test_sides_is_refused_outside_its_legal_values():
    with pytest.raises(ValidationError, match="'kv', 'k' or 'v'"):
        KVQuantConfig(method="kivi", sides="kq")
