"""Later steps of several quantized stores dequantized together (`service.quant.rows`): the same keys and values,
bit for bit, as each store's own `window_kv`, whatever their lengths, and the stores that may not share one batch
key; and the block-initial write's one host read."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from service.engine.kv_store import Segments
from service.engine.models.layers import RotaryEmbedding
from service.quant.config import KVQuantConfig
from service.quant.store import make_kv_store
from tests.quant.helpers import SPEC, kv, policy, state


def store(method, bits, **kw):
    if method.startswith("dllm_kvq"):  # dllm_kvq_p0: the second layer protects no token (KIVI's K)
        table = policy([("qerror", 3), ("attention", 0 if method.endswith("p0") else 2)], bits=bits)
        cfg = KVQuantConfig(method="dllm_kvq", bits=bits, k_group_size=8, policy_id="p")
        return make_kv_store(cfg.model_copy(update={"artifact_id": table.id}), SPEC, artifact=table,
                             attention="torch")
    if method == "kvquant":
        st = state(bits)
        cfg = KVQuantConfig(method="kvquant", bits=bits, kvquant_state_id="s")
        return make_kv_store(cfg.model_copy(update={"artifact_id": st.id}), SPEC, artifact=st, attention="torch")
    return make_kv_store(KVQuantConfig(method="kivi", bits=bits, k_group_size=8, **kw), SPEC, attention="torch")


#: Requests of different numbers of rows, padding, prompt and sequence lengths (so different places on the
#: forward's key axis, different slot, group and protected-token counts: code streams of different lengths), one
#: of them in prefix mode: all of one format, so they share a batch key.
LAYOUTS = [
    Segments((0, 3), block_start=20, block_end=28, seq_len=38, cache_mode="dual"),
    Segments((4,), block_start=31, block_end=39, seq_len=45, cache_mode="dual"),
    Segments((2, 5, 0), block_start=13, block_end=21, seq_len=40, cache_mode="dual"),
    Segments((1,), block_start=17, block_end=25, seq_len=25, cache_mode="prefix"),
]


@pytest.mark.parametrize("method", ["kivi", "dllm_kvq", "dllm_kvq_p0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [2, 4])
def test_rows_of_many_stores_equal_each_store_alone(method, dtype, bits):
    _check_rows(method, dtype, bits)


@pytest.mark.parametrize("method", ["kivi", "dllm_kvq"])
def test_a_large_set_is_read_in_parts(method, monkeypatch):
    """A set whose result exceeds `MAX_ELEMENTS` is read in parts of consecutive stores (here, 2 rows each)."""
    from service.quant import rows

    monkeypatch.setattr(rows, "MAX_ELEMENTS", 2 * SPEC.num_kv_heads * 46 * SPEC.head_dim)
    _check_rows(method, torch.bfloat16, 4)


def _check_rows(method, dtype, bits):
    rope = RotaryEmbedding(SPEC.head_dim, 10000.0, False)
    stores, windows = [], []
    for i, seg in enumerate(LAYOUTS):
        s = store(method, bits)
        k, v = kv(seg.batch_size, seg.seq_len, dtype, seed=10 + i)
        for layer in range(2):
            s.write(layer, k, v, seg, torch.rand(seg.batch_size, seg.seq_len))
        stores.append(s)
        windows.append((k[:, :, seg.block_start:seg.block_end], v[:, :, seg.block_start:seg.block_end]))
    key_len = max(seg.seq_len for seg in LAYOUTS) + 1
    for layer in range(2):
        keys = {s.batch_key(layer, torch.device("cpu")) for s in stores}
        assert len(keys) == 1 and None not in keys
        kk, vv = stores[0].window_kv_batch(stores, layer, key_len)
        rows = sum(seg.batch_size for seg in LAYOUTS)
        assert kk.shape == (rows, SPEC.num_kv_heads, key_len, SPEC.head_dim) and kk.dtype == dtype
        row = 0
        for s, seg, (wk, wv) in zip(stores, LAYOUTS, windows):
            ak, av = s.window_kv(layer, wk, wv, seg, None, None, rope)
            start, end, t = seg.block_start, seg.block_end, seg.seq_len
            for b in range(seg.batch_size):
                for alone, together in ((ak[b], kk[row]), (av[b], vv[row])):
                    assert torch.equal(together[:, :start], alone[:, :start])
                    assert torch.equal(together[:, end:t], alone[:, end:t])
                    assert torch.equal(together[:, :start].view(torch.int16 if dtype != torch.float32 else torch.int32),
                                       alone[:, :start].view(torch.int16 if dtype != torch.float32 else torch.int32))
                    assert not together[:, start:end].any() and not together[:, t:].any()  # window, spare: zeros
                row += 1
    from service.quant.rows import _INDEXES

    layouts = [s._layout for s in stores]
    assert any(held is layouts[0] for index in _INDEXES.values() for held in index.layouts)
    for s in stores:
        s.clear()  # the request ended: its pooled indexes go with it
    assert not any(held is layout for index in _INDEXES.values() for held in index.layouts for layout in layouts)


def test_only_equal_formats_share_a_key():
    cpu = torch.device("cpu")
    seg = LAYOUTS[0]
    k, v = kv(2, seg.seq_len)
    made = {}
    for name, s in {"kivi4": store("kivi", 4), "kivi2": store("kivi", 2), "dllm4": store("dllm_kvq", 4),
                    "kvquant4": store("kvquant", 4), "kept": store("kivi", 4, keep_dequantized=True)}.items():
        s.write(0, k, v, seg, torch.rand(2, seg.seq_len))
        made[name] = s.batch_key(0, cpu)
    assert made["kept"] is None  # kept copies answer alone
    assert None not in {made["kivi4"], made["kivi2"], made["dllm4"], made["kvquant4"]}
    assert len({made["kivi4"], made["kivi2"], made["dllm4"], made["kvquant4"]}) == 4  # KVQuant: `rows_nuq`
    assert made["kivi4"] is not None and store("kivi", 4).batch_key(0, cpu) is None  # nothing written yet
    longer = store("kivi", 4)
    other = Segments((0, 3, 5), block_start=30, block_end=38, seq_len=48, cache_mode="dual")
    longer.write(0, *kv(3, 48), other)
    assert longer.batch_key(0, cpu) == made["kivi4"]  # other rows and lengths: the same format


class _HostReads(TorchDispatchMode):
    """Counts the aten operations whose result the host reads (a sync on a GPU), as benchmarks/iteration_cost.py
    does."""

    READS = frozenset({"_local_scalar_dense", "nonzero", "is_nonzero", "equal", "masked_select", "unique"})

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += func.__name__.split(".")[0] in self.READS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("method", ["kivi", "dllm_kvq"])
def test_a_write_reads_the_device_once(method):
    """The block-initial write of a layer puts its checks together in one host read (the finiteness of scores, K
    and V, the ranges), and dLLM-KVQ's protected tokens are found without reading how many or where."""
    s = store(method, 4)
    seg = LAYOUTS[2]
    k, v = kv(seg.batch_size, seg.seq_len)
    for layer in range(2):
        with torch.inference_mode(), _HostReads() as counter:
            s.write(layer, k, v, seg, torch.rand(seg.batch_size, seg.seq_len))
        assert counter.reads == 1, (layer, counter.reads)
    assert "protected_slots" in s._packed[0].k.tensors or method == "kivi"
