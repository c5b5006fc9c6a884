import pytest
import torch

from service.engine.kv_store import FullPrecisionKVStore, Segments


def test_reused_columns_prefix_and_dual():
    prefix = Segments((0, 2), block_start=5, block_end=9, seq_len=13, cache_mode="prefix")
    assert prefix.reused_columns.tolist() == [0, 1, 2, 3, 4]
    dual = Segments((0, 2), block_start=5, block_end=9, seq_len=13, cache_mode="dual")
    assert dual.reused_columns.tolist() == [0, 1, 2, 3, 4, 9, 10, 11, 12]
    # Row 1 has 2 padding columns: its prefix segment starts at its first real token.
    assert dual.row_segments(1) == [(2, 5), (5, 9)]
    assert dual.row_segments(0) == [(0, 5), (5, 9)]


def test_last_block_has_no_suffix_segment():
    seg = Segments((1,), block_start=8, block_end=12, seq_len=12, cache_mode="dual")
    assert seg.row_segments(0) == [(1, 8)]


def test_bad_segments_rejected():
    with pytest.raises(ValueError, match="cache_mode"):
        Segments((0,), 1, 2, 3, "none")
    with pytest.raises(ValueError, match="pad_lengths"):
        Segments((5,), 4, 6, 8, "prefix")


def test_full_precision_store_keeps_reused_columns_only():
    k = torch.arange(2 * 1 * 6 * 2, dtype=torch.float32).reshape(2, 1, 6, 2)
    v = -k
    seg = Segments((0, 1), block_start=2, block_end=4, seq_len=6, cache_mode="dual")
    store = FullPrecisionKVStore()
    store.write(0, k, v, seg)
    rk, rv = store.read(0)
    assert torch.equal(rk, k[:, :, [0, 1, 4, 5]])
    assert torch.equal(rv, v[:, :, [0, 1, 4, 5]])
    k.zero_()  # the store must not alias the forward's tensors
    assert rk.abs().sum() > 0
