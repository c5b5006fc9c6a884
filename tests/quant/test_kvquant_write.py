"""KVQuant's block-initial write (`KVQuantQuantizer.quantize`), its outliers in rows of a capacity known from the
shape: the same packed layer as quantizing K then V side by side (`KVQuantizer.quantize` over ``quantize_k`` /
``quantize_v``), with no host read when its checks are put off and one otherwise."""

import pytest
import torch

from benchmarks.iteration_cost import Counter
from service.engine.kv_store import Segments
from service.quant.base import KVQuantizer
from service.quant.config import KVQuantConfig
from service.quant.kvquant import fit_state
from service.quant.layout import SlotLayout
from service.quant.registry import make_quantizer
from tests.quant.helpers import PROV, SPEC, kv

LAYOUTS = [
    Segments((0, 3), block_start=20, block_end=28, seq_len=38, cache_mode="dual"),
    Segments((2,), block_start=30, block_end=38, seq_len=46, cache_mode="dual"),
    Segments((1, 0, 5, 3, 2, 4), block_start=16, block_end=24, seq_len=40, cache_mode="prefix"),
]


def quantizer(bits, threshold):
    keys, values = zip(*(kv(4, 64, seed=3 + i) for i in range(SPEC.num_layers)))
    st = fit_state(list(keys), list(values), bits, SPEC, PROV, sparsity_threshold=threshold)
    return make_quantizer(KVQuantConfig(method="kvquant", bits=bits, kvquant_state_id=st.id), SPEC, st)


def held_outliers(side, n, c):
    """Dense ``[N, C]`` bool mask and values of a side's outlier rows (whatever their capacity)."""
    from service.quant.rows_nuq import outlier_places

    t = side.tensors
    at = outlier_places(t["outlier_index"], c).view(-1)
    mask = torch.zeros((n + 1) * c, dtype=torch.bool).index_fill_(0, at, True).view(n + 1, c)[:n]
    values = torch.zeros((n + 1) * c, dtype=t["outlier_values"].dtype)
    values.index_put_((at,), t["outlier_values"].reshape(-1))
    return mask, values.view(n + 1, c)[:n]


@pytest.mark.parametrize("threshold", [0.99, 1.0], ids=["sparse", "dense"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [2, 4])
def test_the_write_packs_what_the_per_side_write_packs(bits, dtype, threshold):
    """The same codes, ranges, outliers and nominal bits as quantizing K then V side by side, on plain K/V (one
    read without verdicts, none with them) and on K/V whose tokens need more outlier room than the shape gives
    and a median (the flags' read, one to size the fuller rows, one for the medians)."""
    q = quantizer(bits, threshold)
    seg = LAYOUTS[0]
    q.quantize(0, *kv(2, seg.seq_len), SlotLayout.from_segments(seg, q.k_group_size))  # per-process tables made
    c = SPEC.num_kv_heads * SPEC.head_dim
    for i, seg in enumerate(LAYOUTS):
        layout = SlotLayout.from_segments(seg, q.k_group_size)
        k, v = kv(seg.batch_size, seg.seq_len, dtype, seed=40 + i)
        for hard in (False, True):
            if hard:
                k = k * 2.5  # keys past the thresholds: K outliers, more than the default room
                v[0, :, -1] = 0.5  # a constant value token: a zero range, every entry an outlier, a median
            for layer in range(SPEC.num_layers):
                verdicts = []
                with Counter() as counter:
                    q.quantize(layer, k, v, layout, verdicts=verdicts)
                assert counter.syncs == 0 and len(verdicts) == 1
                fits = bool(verdicts[0])
                if threshold == 1.0 or (not hard and dtype == torch.float32):  # (bf16 values may tie at a quantile)
                    assert fits
                elif hard and i == 0:  # more outliers than the default room, and a median: the write must be redone
                    assert not fits
                with Counter() as counter:
                    got = q.quantize(layer, k, v, layout)
                assert counter.syncs <= (1 if fits else 3)
                want = KVQuantizer.quantize(q, layer, k, v, layout)
                for side in ("k", "v"):
                    a, b = getattr(got, side), getattr(want, side)
                    assert a.tensors.keys() == b.tensors.keys() and a.nominal_bitsum == b.nominal_bitsum
                    for name in a.tensors:
                        assert a.tensors[name].dtype == b.tensors[name].dtype
                        if not name.startswith("outlier"):
                            assert torch.equal(a.tensors[name], b.tensors[name]), (side, name)
                    for x, y in zip(held_outliers(a, layout.num_slots, c), held_outliers(b, layout.num_slots, c)):
                        assert torch.equal(x, y), side
                if threshold < 1.0:
                    assert held_outliers(got.k, layout.num_slots, c)[0].any()
                    assert held_outliers(got.v, layout.num_slots, c)[0].any()


def test_outlier_rows_hold_each_rows_true_columns_in_order():
    from service.quant.kvquant import row_outliers

    gen = torch.Generator().manual_seed(5)
    mask = torch.rand(37, 24, generator=gen) < 0.2
    cols, taken, count = row_outliers(mask, 6)
    assert cols.dtype == torch.int8 and cols.shape == (37, 6) and torch.equal(count, mask.sum(1))
    for row in range(37):
        want = mask[row].nonzero()[:, 0][:6].tolist()
        assert cols[row].tolist() == want + [-1] * (6 - len(want))
        assert taken[row, : len(want)].tolist() == want
    assert (count > 6).any()  # some rows do not fit: only their first 6 are held
