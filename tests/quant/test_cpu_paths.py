"""The faster CPU paths give the same bits as the plain ones they replace (issue 15): the nearest codebook entry by
comparisons, value ranges without the median, codebook values read straight from the stream, RoPE in place with
kept cos/sin, and whole-layer (batched) writes and reads against run by run."""

import numpy as np
import pytest
import torch

from service.engine.kv_store import Segments
from service.engine.models.layers import RotaryEmbedding
from service.quant import layout as layout_module
from service.quant import nuq
from service.quant.packing import byte_table, decode_stream, pack_stream, unpack_stream
from tests.quant.helpers import kv
from tests.quant.test_store import scores_for, store_for


def bits_of(x: torch.Tensor) -> torch.Tensor:
    """Raw bytes: equal bits, so +0 and -0 differ and NaN equals itself."""
    return x.contiguous().view(-1).view(torch.uint8)


def searchsorted_nearest(u: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """The binary-search version that `nuq.nearest_code` had before (an ascending codebook)."""
    flat = u.reshape(-1)
    right = torch.searchsorted(lut, flat).clamp_(1, lut.numel() - 1)
    left = right - 1
    closer_right = (flat - lut[right]).abs() < (flat - lut[left]).abs()
    return torch.where(closer_right, right, left).to(torch.uint8).view(u.shape)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_nearest_code_is_the_binary_search_and_the_argmin(bits):
    gen = torch.Generator().manual_seed(bits)
    for _ in range(4):
        lut = torch.sort(torch.randn(2**bits, generator=gen) * 0.5).values
        u = torch.randn(70_001, generator=gen) * 0.8  # more than one chunk
        hits = torch.randint(0, 2**bits, (5000,), generator=gen)
        u[:5000] = lut[hits]  # exactly on an entry
        mids = (lut[1:] + lut[:-1]) / 2
        u[5000:10000] = mids[torch.randint(0, 2**bits - 1, (5000,), generator=gen)]  # ties: the earlier entry
        u[10000:10004] = torch.tensor([float("inf"), float("-inf"), 3e38, -3e38])
        assert torch.equal(nuq.nearest_code(u, lut), searchsorted_nearest(u, lut))
        moderate = u[:10000]  # where |u - c| is exact enough for the argmin to agree with the two neighbours
        argmin = (moderate[:, None] - lut).abs().argmin(-1).to(torch.uint8)
        assert torch.equal(nuq.nearest_code(moderate, lut), argmin)


def test_nearest_code_of_an_unsorted_codebook_is_the_argmin():
    lut = torch.tensor([0.5, -1.0, 0.0, 1.0])
    u = torch.linspace(-2, 2, 101)
    assert torch.equal(nuq.nearest_code(u, lut), (u[:, None] - lut).abs().argmin(-1).to(torch.uint8))


def median_range(x, outliers):
    dense = torch.where(outliers, torch.median(x, dim=-1, keepdim=True).values, x)
    return dense.amax(-1), dense.amin(-1)


@pytest.mark.parametrize("threshold", [0.99, 0.9, 0.5])
def test_dense_range_is_the_median_replacement_bit_for_bit(threshold):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 128, generator=gen)
    x[0] = 0.0  # every entry an outlier: the median path
    x[1] = -0.0
    x[1, ::2] = 0.0  # +0 and -0 tie everywhere
    x[2] = torch.where(torch.rand(128, generator=gen) > 0.5, 1.0, -1.0)  # two values: ties at the middle
    x[3, :64] = 5.0
    x[4, 1::2] = -0.0  # zeros among the non-outliers
    for outliers in (nuq.value_outliers(x, threshold), torch.rand(x.shape, generator=gen) > 0.3):
        for got, want in zip(nuq.dense_range(x, outliers), median_range(x, outliers)):
            assert torch.equal(bits_of(got), bits_of(want))


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("numel", [1, 15, 16, 17, 1000])
def test_decode_stream_is_the_lookup_of_the_unpacked_codes(bits, numel):
    gen = torch.Generator().manual_seed(numel)
    codes = torch.randint(0, 2**bits, (numel,), generator=gen, dtype=torch.uint8)
    values = torch.randn(2**bits, generator=gen)
    words = pack_stream(codes, bits)
    table = byte_table(values, bits)
    assert table.shape == (8 // bits, 256)
    decoded = decode_stream(words, table, numel, extra=7)
    assert decoded.shape == (numel + 7,)
    assert torch.equal(decoded[:numel], values[unpack_stream(words, bits, numel).long()])


@pytest.mark.parametrize(("dtype", "full_precision"), [
    (torch.float32, True), (torch.float32, False), (torch.bfloat16, True), (torch.bfloat16, False),
])
def test_rotate_in_place_is_rotate(dtype, full_precision):
    rope = RotaryEmbedding(16, 10000.0, full_precision)
    gen = torch.Generator().manual_seed(1)
    full = torch.randn(2, 3, 20, 16, generator=gen).to(dtype)
    full[0, 0, 0] = 0.0
    full[0, 0, 1] = -0.0
    positions = torch.randint(0, 500, (2, 12), generator=gen)
    view = full[:, :, 4:16]  # a strided part of a larger buffer, as the store rotates
    want = rope.rotate(view, positions)
    rope.rotate_in_place(view, *rope.cos_sin(positions))
    assert torch.equal(bits_of(view), bits_of(want))


@pytest.mark.parametrize("method", ["kivi", "dllm_kvq", "kvquant"])
@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_layer_operations_equal_run_by_run(method, keep, dtype, monkeypatch):
    """Six left-padded rows (12 runs): the same packed bytes and the same K/V at every step, for every row and for
    a subset of rows, whole-layer or run by run."""
    pads = (0, 5, 2, 9, 0, 3)
    seg = Segments(pads, block_start=24, block_end=32, seq_len=48, cache_mode="dual")
    k, v = kv(len(pads), 48, dtype, seed=4)
    rope = RotaryEmbedding(16, 10000.0, True)
    positions = torch.arange(48)[None] - torch.tensor(pads)[:, None]
    reused = positions[:, seg.reused_columns]
    results = []
    for runs in (10**6, 0):  # never batched, always batched
        monkeypatch.setattr(layout_module, "BATCHED_RUNS", runs)
        store = store_for(method, keep_dequantized=keep)
        for layer in (0, 1):
            store.write(layer, k * (layer + 1), v - layer, seg, scores_for(k))
        out = [t for layer in (0, 1) for part in (store._packed[layer].k, store._packed[layer].v)
               for t in part.tensors.values()]
        for rows in (None, torch.tensor([1, 3, 4]), None):
            for layer in (0, 1):
                window = (k[:, :, 24:32] + layer, v[:, :, 24:32])
                if rows is not None:
                    window = tuple(t[rows] for t in window)
                pos = reused if rows is None else reused[rows]
                out += [t.clone() for t in store.window_kv(layer, *window, seg, rows, pos, rope)]
        out += list(store.read(1))
        results.append(out)
    for a, b in zip(*results):
        # equal values; padding columns of a pre-RoPE scratch may differ in the sign of their zeros (they are
        # masked out of attention), so bits are compared only where the values are not zero
        assert a.dtype == b.dtype and torch.equal(a, b)
        if a.is_floating_point():
            nonzero = a != 0
            assert torch.equal(bits_of(a[nonzero]), bits_of(b[nonzero]))


def test_batched_only_for_many_runs_and_bounded_size():
    one_row = Segments((0,), block_start=24, block_end=32, seq_len=48, cache_mode="dual")
    many = Segments((0, 5, 2, 9, 0, 3), block_start=24, block_end=32, seq_len=48, cache_mode="dual")
    small = layout_module.SlotLayout.from_segments(one_row, 8)
    large = layout_module.SlotLayout.from_segments(many, 8)
    assert not small.batched(32) and large.batched(32)
    assert not large.batched(layout_module.BATCHED_ELEMENTS)  # a layer this large keeps the bounded per-run path
    # every (row, column) names its slot, padding the sentinel N
    flat = large.slot_map.view(6, -1)
    assert int(flat[1, :5].unique()) == large.num_slots and np.all(flat[0].numpy() < large.num_slots)
