"""Joining a block-causal row's committed runs (`KVQuantizer.concat`, `CommittedBlocks.merge`, issue 44): runs
packed one block at a time and joined hold, bit for bit, what one write of the whole run holds, and a read of the
joined run gives the values the runs gave one by one; formats that do not simply join (protected tokens) say so."""

import pytest
import torch

from service.engine.kv_store import Segments
from service.quant.committed import CommittedBlocks
from service.quant.layout import SlotLayout
from tests.quant.helpers import SPEC, kv
from tests.quant.test_rows import store
from tests.quant.test_write_batch import _same_layer

#: Runs of one row: whole K groups of 8 (the prefix cache's blocks), the last one shorter.
RUNS = [(0, 16), (16, 32), (32, 48), (48, 56)]


def _layout(start, end):
    """A run ``[start, end)`` as `CommitWriter` lays it out: the row's reused prefix after ``start`` columns."""
    return SlotLayout.from_segments(Segments((start,), end, end + 1, end + 1, "prefix"), 8, torch.device("cpu"))


def _runs(quantizer, k, v):
    return [quantizer.quantize(0, k[:, :, : b + 1], v[:, :, : b + 1], _layout(a, b)) for a, b in RUNS]


@pytest.mark.parametrize("method, bits", [("kivi", 2), ("kivi", 4), ("kivi", 8), ("kvquant", 2), ("kvquant", 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_joined_runs_are_the_write_of_the_whole_run(method, bits, dtype):
    quantizer = store(method, bits).quantizer
    end = RUNS[-1][1]
    k, v = kv(1, end + 1, dtype, seed=3)
    k[0, 1, 20, 3] = 40.0  # an outlier past the first run (KVQuant: in a row of the second run)
    joined = quantizer.concat(_runs(quantizer, k, v))
    _same_layer(joined, quantizer.quantize(0, k, v, _layout(0, end)))
    if method == "kvquant":
        assert (joined.k.tensors["outlier_index"] >= 0).any()


def test_kvquant_runs_of_different_outlier_room_join_and_read_the_same():
    """A run written after a fuller token grew the layer's outlier rows (`KVQuantQuantizer.caps`) holds wider
    rows: the join widens the others (free places), and a read of it gives what the runs at one width give."""
    from service.quant.base import PackedLayer, PackedTensor

    quantizer = store("kvquant", 4).quantizer
    end = RUNS[-1][1]
    k, v = kv(1, end + 1, torch.float32, seed=6)
    runs = _runs(quantizer, k, v)

    def wider(side, more):
        t = dict(side.tensors)
        t["outlier_index"] = torch.nn.functional.pad(t["outlier_index"], (0, more), value=-1)
        t["outlier_values"] = torch.nn.functional.pad(t["outlier_values"], (0, more), value=99.0)
        return PackedTensor(tensors=t, elements=side.elements, nominal_bitsum=side.nominal_bitsum)

    mixed = [PackedLayer(k=wider(p.k, 3), v=wider(p.v, 5), dtype=p.dtype, num_heads=p.num_heads,
                         head_dim=p.head_dim) if i == 1 else p for i, p in enumerate(runs)]
    want, got = quantizer.concat(runs), quantizer.concat(mixed)
    assert got.k.tensors["outlier_index"].shape[1] == want.k.tensors["outlier_index"].shape[1] + 3
    assert got.k.nominal_bitsum == want.k.nominal_bitsum and got.k.nbytes > want.k.nbytes
    layout = _layout(0, end)
    assert torch.equal(quantizer.dequantize_k(0, got, layout), quantizer.dequantize_k(0, want, layout))
    assert torch.equal(quantizer.dequantize_v(0, got, layout), quantizer.dequantize_v(0, want, layout))


@pytest.mark.parametrize("method", ["kivi", "kvquant"])
def test_a_merged_row_reads_what_its_runs_read(method):
    quantizer = store(method, 4).quantizer
    end = RUNS[-1][1]
    k, v = kv(1, end + 1, torch.bfloat16, seed=4)
    held, merged = CommittedBlocks(quantizer), CommittedBlocks(quantizer)
    for layer in range(2):
        for (a, b), packed in zip(RUNS, _runs(quantizer, k * (layer + 1), v)):
            held.add(layer, a, b, packed)
            merged.add(layer, a, b, packed)
        merged.merge(layer, 16, end)  # the runs after the first (a row's own blocks after its cached ones)
    assert [(a, b) for a, b, _ in merged.layers[0]] == [(0, 16), (16, end)]

    def rotate(keys, positions):  # position-dependent, so a run read at the wrong columns differs
        return keys + positions[:, None, :, None].to(keys.dtype)

    shape = (2, SPEC.num_kv_heads, end + 8, SPEC.head_dim)
    for layer in range(2):
        want = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(2)]
        got = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(2)]
        held.read_into(layer, 1, *want, rotate)
        merged.read_into(layer, 1, *got, rotate)
        assert want[0][1, :, :end].abs().sum() > 0
        for x, y in zip(want, got):
            assert torch.equal(x, y), layer


def test_protected_tokens_do_not_join():
    quantizer = store("dllm_kvq", 4).quantizer
    k, v = kv(1, 33, seed=5)
    scores = torch.rand(1, 33)
    parts = [quantizer.quantize(1, k[:, :, : b + 1], v[:, :, : b + 1], _layout(a, b), scores[:, : b + 1])
             for a, b in RUNS[:2]]
    assert "protected_slots" in parts[0].k.tensors
    assert quantizer.concat(parts) is None
    assert quantizer.concat(parts[:1]) is parts[0]
    held = CommittedBlocks(quantizer)
    for (a, b), packed in zip(RUNS, parts):
        held.add(1, a, b, packed)
    held.merge(1, 0, 32)
    assert len(held.layers[1]) == 2  # left as they were
