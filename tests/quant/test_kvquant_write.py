"""KVQuant's block-initial write with one host read per layer (`KVQuantQuantizer.quantize`): the same packed layer
as quantizing K then V side by side (`KVQuantizer.quantize` over ``quantize_k`` / ``quantize_v``), and one read."""

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


@pytest.mark.parametrize("threshold", [0.99, 1.0], ids=["sparse", "dense"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [2, 4])
def test_one_read_write_packs_what_the_per_side_write_packs(bits, dtype, threshold):
    q = quantizer(bits, threshold)
    seg = LAYOUTS[0]
    q.quantize(0, *kv(2, seg.seq_len), SlotLayout.from_segments(seg, q.k_group_size))  # per-process tables made
    for i, seg in enumerate(LAYOUTS):
        layout = SlotLayout.from_segments(seg, q.k_group_size)
        k, v = kv(seg.batch_size, seg.seq_len, dtype, seed=40 + i)
        k = k * 2.5  # keys past the thresholds: K outliers
        v[0, :, -1] = 0.5  # a constant value token: a zero range
        for layer in range(SPEC.num_layers):
            with Counter() as counter:
                got = q.quantize(layer, k, v, layout)
            assert counter.syncs == 1  # everything data-dependent read at once
            want = KVQuantizer.quantize(q, layer, k, v, layout)
            for side in ("k", "v"):
                a, b = getattr(got, side), getattr(want, side)
                assert a.tensors.keys() == b.tensors.keys() and a.nominal_bitsum == b.nominal_bitsum
                for name in a.tensors:
                    assert a.tensors[name].dtype == b.tensors[name].dtype
                    assert torch.equal(a.tensors[name], b.tensors[name]), (side, name)
            if threshold < 1.0:
                assert got.k.tensors["outlier_index"].numel() and got.v.tensors["outlier_index"].numel()


def test_the_device_read_finds_the_indices_the_host_read_finds():
    from service.quant.kvquant import _read_counts, _read_once

    gen = torch.Generator().manual_seed(5)
    masks = [torch.rand(37, 24, generator=gen) < p for p in (0.01, 0.5, 0.0)] + [torch.rand(37, generator=gen) < 0.2]
    flags = torch.tensor([False, True])
    on_host, on_device = _read_once(masks, flags), _read_counts(masks, flags)
    assert on_host[1] == on_device[1] == [False, True]
    for a, b, m in zip(on_host[0], on_device[0], masks):
        assert a.dtype == b.dtype == torch.int64 and torch.equal(a, b) and torch.equal(a, m.flatten().nonzero()[:, 0])
