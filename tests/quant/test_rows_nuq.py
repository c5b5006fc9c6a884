"""Later steps of several KVQuant stores dequantized together (`service.quant.rows_nuq`): the same keys (rotated at
each row's own positions) and values, bit for bit, as each store's own `window_kv`, for stores of different
lengths and cache modes, with sparse outliers, under LLaDA's float32 rotation and Dream's model-dtype one."""

import pytest
import torch

from service.engine.kv_store import Segments
from service.engine.models.layers import RotaryEmbedding
from service.quant.config import KVQuantConfig
from service.quant.store import make_kv_store
from tests.quant.helpers import SPEC, kv, state

#: Requests of different padding, prompt and sequence lengths, blocks and cache modes: different slot counts (so
#: several decoding groups), one pair of equal length (so one group of two).
LAYOUTS = [
    Segments((0, 3), block_start=20, block_end=28, seq_len=38, cache_mode="dual"),
    Segments((4, 7), block_start=24, block_end=32, seq_len=42, cache_mode="dual"),
    Segments((2,), block_start=30, block_end=38, seq_len=46, cache_mode="dual"),
    Segments((1, 0, 5), block_start=16, block_end=24, seq_len=40, cache_mode="prefix"),
    Segments((2, 5), block_start=22, block_end=30, seq_len=40, cache_mode="dual"),
]
STATES = {bits: state(bits) for bits in (2, 4)}


def kvquant_store(bits, **kw):
    st = STATES[bits]
    cfg = KVQuantConfig(method="kvquant", bits=bits, kvquant_state_id=st.id, **kw)
    return make_kv_store(cfg, SPEC, artifact=st, attention="torch")


def reused_positions(seg):
    """As the decoder makes them: each row's positions from its first real token, read at the reused columns."""
    positions = (torch.arange(seg.seq_len)[None, :] - torch.tensor(seg.pad_lengths)[:, None]).clamp(min=0)
    return positions[:, seg.reused_columns]


@pytest.mark.parametrize("rope_full_precision", [True, False], ids=["llada", "dream"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [2, 4])
def test_rows_of_many_kvquant_stores_equal_each_store_alone(rope_full_precision, dtype, bits):
    rope = RotaryEmbedding(SPEC.head_dim, 5e5 if rope_full_precision else 1e6, rope_full_precision)
    stores, windows, positions = [], [], []
    for i, seg in enumerate(LAYOUTS):
        s = kvquant_store(bits)
        k, v = kv(seg.batch_size, seg.seq_len, dtype, seed=20 + i)
        k = k * 2.5  # keys past the fitted thresholds: K outliers beside V's per-token ones
        for layer in range(2):
            s.write(layer, k, v, seg)
        stores.append(s)
        end = seg.seq_len if seg.cache_mode == "prefix" else seg.block_end
        windows.append((k[:, :, seg.block_start:end], v[:, :, seg.block_start:end]))
        positions.append(reused_positions(seg))
    key_len = max(seg.seq_len for seg in LAYOUTS) + 1
    rows = sum(seg.batch_size for seg in LAYOUTS)
    cpu = torch.device("cpu")
    for layer in range(2):
        packed = [s._packed[layer] for s in stores]
        assert all((p.k.tensors["outlier_index"] >= 0).any() and (p.v.tensors["outlier_index"] >= 0).any() for p in packed)
        keys = {s.batch_key(layer, cpu) for s in stores}
        assert len(keys) == 1 and None not in keys
        for _ in range(2):  # the second step reads the kept index
            kk, vv = stores[0].window_kv_batch(stores, layer, key_len, positions, rope)
            assert kk.shape == (rows, SPEC.num_kv_heads, key_len, SPEC.head_dim) and kk.dtype == dtype
            row = 0
            for s, seg, (wk, wv), pos in zip(stores, LAYOUTS, windows, positions):
                ak, av = s.window_kv(layer, wk, wv, seg, None, pos, rope)
                start, end, t = seg.block_start, seg.block_start + wk.shape[2], seg.seq_len
                for b in range(seg.batch_size):
                    for alone, together in ((ak[b], kk[row]), (av[b], vv[row])):
                        # bit for bit: the same bytes, so even the sign of a zero agrees
                        assert torch.equal(together[:, :start].view(torch.uint8), alone[:, :start].view(torch.uint8))
                        assert torch.equal(together[:, end:t].view(torch.uint8), alone[:, end:t].view(torch.uint8))
                        assert not together[:, start:end].any() and not together[:, t:].any()
                    row += 1
    from service.quant.rows_nuq import _INDEXES

    layouts = [s._layout for s in stores]
    assert any(held is layouts[0] for index in _INDEXES.values() for held in index.layouts)
    for s in stores:
        s.clear()
    assert not any(held is layout for index in _INDEXES.values() for held in index.layouts for layout in layouts)


def test_kvquant_stores_share_a_key_only_with_their_state_and_format():
    cpu = torch.device("cpu")
    short, long = LAYOUTS[0], LAYOUTS[2]
    made = {}
    for name, (s, seg) in {"a": (kvquant_store(4), short), "b": (kvquant_store(4), long),
                           "2bit": (kvquant_store(2), short),
                           "kept": (kvquant_store(4, keep_dequantized=True), short)}.items():
        s.write(0, *kv(seg.batch_size, seg.seq_len), seg)
        made[name] = s.batch_key(0, cpu)
    assert made["a"] is not None and made["a"] == made["b"]  # other reused lengths pool too
    assert made["2bit"] not in (None, made["a"]) and made["kept"] is None
    other = fit_state_store()
    other.write(0, *kv(2, short.seq_len), short)
    assert other.batch_key(0, cpu) != made["a"]  # another state: other codebooks and thresholds


def fit_state_store():
    st = state(4, seed=7)
    return make_kv_store(KVQuantConfig(method="kvquant", bits=4, kvquant_state_id=st.id), SPEC, artifact=st,
                         attention="torch")
