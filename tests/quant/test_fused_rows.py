"""The fused attention kernel over the rows of several stores in one launch
(`service.quant.kernels.attention.fused_reuse_attention_rows`, via `QuantizedKVStore.attend_batch`) against each
store's own launch (`QuantizedKVStore.attend`, itself tested against the PyTorch QDQ path in
tests/quant/test_fused_attention.py), on CPU tensors under Triton's interpreter (set by tests/conftest.py).

The stores differ in rows, padding, prompt and reused lengths, protected tokens and window width (one in prefix
mode with a wider window than the others: its padded window columns must get no weight)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from service.engine.kv_store import Segments
from service.engine.models.layers import RotaryEmbedding
from service.quant.config import KVQuantConfig
from service.quant.errors import KVQuantError
from service.quant.kernels import attention, parts
from service.quant.kernels.operands import BlockMaps
from service.quant.store import make_kv_store
from tests.quant.helpers import SPEC, kv, policy, state

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
#: fp32 round-off (tests/quant/test_fused_attention.py): the tiles, and so the summation order, may differ.
TOLERANCE = 2e-5 if DEVICE.type == "cpu" else 1e-4

LAYOUTS = [
    Segments((0, 3), block_start=20, block_end=28, seq_len=38, cache_mode="dual"),
    Segments((4,), block_start=31, block_end=39, seq_len=45, cache_mode="dual"),
    Segments((2, 5, 0), block_start=13, block_end=21, seq_len=40, cache_mode="dual"),
    Segments((1,), block_start=17, block_end=25, seq_len=29, cache_mode="prefix"),  # a window of 12
]


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


class _Counted:
    """The kernel with its launches counted (``kernel[grid](...)``)."""

    def __init__(self, kernel) -> None:
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


def _store(method: str, bits: int):
    if method.startswith("dllm_kvq"):  # dllm_kvq_p0: the second layer protects no token
        table = policy([("qerror", 3), ("attention", 0 if method.endswith("p0") else 2)], bits=bits)
        config = KVQuantConfig(method="dllm_kvq", bits=bits, k_group_size=8, policy_id=table.id)
        return make_kv_store(config, SPEC, artifact=table, attention="triton")
    return make_kv_store(KVQuantConfig(method="kivi", bits=bits, k_group_size=8), SPEC, attention="triton")


def _written(method: str, bits: int, dtype: torch.dtype, make=None):
    """A store per layout (``make(method, bits)``, default :func:`_store`), every layer written."""
    stores = []
    for i, seg in enumerate(LAYOUTS):
        s = (make or _store)(method, bits)
        k, v = kv(seg.batch_size, seg.seq_len, dtype, seed=10 + i)
        scores = torch.rand(seg.batch_size, seg.seq_len, generator=torch.Generator().manual_seed(i))
        for layer in range(SPEC.num_layers):
            s.write(layer, k.to(DEVICE), v.to(DEVICE), seg, scores.to(DEVICE))
        stores.append(s)
    return stores


def _window(seg: Segments) -> int:
    return (seg.seq_len if seg.cache_mode == "prefix" else seg.block_end) - seg.block_start


def _compare(method: str, bits: int, dtype: torch.dtype, monkeypatch, exact: bool = False) -> None:
    counted = _Counted(attention._fused_reuse_attention)
    monkeypatch.setattr(attention, "_fused_reuse_attention", counted)
    stores = _written(method, bits, dtype)
    rope = RotaryEmbedding(SPEC.head_dim, 10000.0, False)
    widths = [_window(seg) for seg in LAYOUTS]
    rows, width = sum(seg.batch_size for seg in LAYOUTS), max(widths)
    gen = torch.Generator().manual_seed(bits)
    q = torch.randn(rows, SPEC.num_heads, width, SPEC.head_dim, generator=gen).to(dtype).to(DEVICE)
    k, v = (torch.randn(rows, SPEC.num_kv_heads, width, SPEC.head_dim, generator=gen).to(dtype).to(DEVICE)
            for _ in range(2))
    for layer in range(SPEC.num_layers):
        keys = {s.batch_key(layer, DEVICE) for s in stores}
        assert len(keys) == 1 and None not in keys
        before = counted.launches
        together = stores[0].attend_batch(stores, layer, q, k, v, widths)
        assert counted.launches == before + 1  # one launch for every row of the set
        assert together.shape == q.shape and together.dtype == dtype
        row = 0
        for s, seg, w in zip(stores, LAYOUTS, widths):
            own = slice(row, row + seg.batch_size)
            alone = s.attend(layer, q[own, :, :w], k[own, :, :w], v[own, :, :w], None, None, rope)
            if exact:
                assert torch.equal(together[own, :, :w], alone)
            else:
                torch.testing.assert_close(together[own, :, :w].float(), alone.float(), rtol=TOLERANCE,
                                           atol=TOLERANCE)
            row += seg.batch_size


@pytest.mark.parametrize("method", ["kivi", "dllm_kvq", "dllm_kvq_p0"])
@pytest.mark.parametrize("bits", [2, 4])
def test_one_launch_for_the_rows_of_many_stores_equals_each_store_alone(method, bits, monkeypatch):
    _compare(method, bits, torch.float32, monkeypatch)


@pytest.mark.parametrize("method", ["kivi", "dllm_kvq"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_with_the_same_tiles_the_values_are_the_same_bit_for_bit(method, dtype, monkeypatch):
    """With the tile size of each store's own launch (16 tokens everywhere), the summation order is the same, so
    every value is: each store's offsets into the concatenations read exactly its own codes and statistics."""
    if DEVICE.type != "cpu":
        pytest.skip("the tile size is fixed on a GPU")
    monkeypatch.setattr(attention, "INTERPRETER_BLOCK_T", 16)
    _compare(method, 4, dtype, monkeypatch, exact=True)


def test_kvquant_on_the_kernel_path_still_attends_per_store():
    """KVQuant's (nuq) kernel path has no batch key (it attends per store); the set's builder refuses nuq."""
    seg = LAYOUTS[0]
    s = make_kv_store(KVQuantConfig(method="kvquant", bits=4, kvquant_state_id="s").model_copy(
        update={"artifact_id": state(4).id}), SPEC, artifact=state(4), attention="triton")
    k, v = kv(seg.batch_size, seg.seq_len, seed=3)
    s.write(0, k.to(DEVICE), v.to(DEVICE), seg)
    assert s.batch_key(0, DEVICE) is None
    ops = s.quantizer.kernel_operands(0, s._packed[0], s._layout)
    maps = BlockMaps.from_layout(s._layout)
    with pytest.raises(KVQuantError, match="uniform"):
        parts.side_by_side([(ops, maps), (ops, maps)], [8, 8], SPEC.num_kv_heads, SPEC.head_dim)


def test_the_fused_key_is_apart_from_the_pytorch_paths_and_the_set_is_dropped_on_clear():
    stores = _written("kivi", 4, torch.float32)
    torch_store = make_kv_store(KVQuantConfig(method="kivi", bits=4, k_group_size=8), SPEC, attention="torch")
    seg = LAYOUTS[0]
    torch_store.write(0, *(t.to(DEVICE) for t in kv(seg.batch_size, seg.seq_len, seed=10)), seg)
    assert torch_store.batch_key(0, DEVICE) not in (None, stores[0].batch_key(0, DEVICE))
    widths = [_window(seg) for seg in LAYOUTS]
    rows = sum(seg.batch_size for seg in LAYOUTS)
    q = torch.zeros(rows, SPEC.num_heads, max(widths), SPEC.head_dim, device=DEVICE)
    k = torch.zeros(rows, SPEC.num_kv_heads, max(widths), SPEC.head_dim, device=DEVICE)
    stores[0].attend_batch(stores, 0, q, k, k, widths)
    layout = stores[1]._layout  # the set's maps are made from the stores' layouts (`stores_side_by_side`)
    assert any(x is layout for held in parts._STORE_SETS.values() for x in held.layouts)
    stores[1].clear()
    assert not any(x is layout for held in parts._STORE_SETS.values() for x in held.layouts)
    with pytest.raises(KVQuantError, match="rows"):
        stores[0].attend_batch(stores[:1], 0, q, k, k, widths[:1])


def test_only_a_method_that_declares_fused_rows_shares_a_launch():
    """The shared launch is the plug-in's declaration (`QuantMethod.fused_rows`), not read off the quantizer's
    type: KIVI's formats under a method that does not declare it attend per store; a declaration for quantized
    pre-RoPE keys (which that launch would attend unrotated) is refused when the store is made."""
    from service.quant.base import KVQuantizer
    from service.quant.registry import QuantMethod, register, unregister

    class PreRope(KVQuantizer):
        pre_rope_keys = True

    seg = LAYOUTS[0]
    register(QuantMethod("alone", quantizer=KVQuantizer))
    register(QuantMethod("prerope", quantizer=PreRope, fused_rows=True))
    try:
        alone = make_kv_store(KVQuantConfig(method="alone", bits=4, k_group_size=8), SPEC, attention="triton")
        alone.write(0, *(t.to(DEVICE) for t in kv(seg.batch_size, seg.seq_len, seed=4)), seg)
        assert alone.batch_key(0, DEVICE) is None
        with pytest.raises(KVQuantError, match="pre-RoPE"):
            make_kv_store(KVQuantConfig(method="prerope", bits=4), SPEC, attention="triton")
        # A side held as it is never reaches the kernel, so pre-RoPE keys held are no contradiction.
        make_kv_store(KVQuantConfig(method="prerope", bits=4, sides="v"), SPEC, attention="triton")
    finally:
        unregister("alone")
        unregister("prerope")
    kivi = make_kv_store(KVQuantConfig(method="kivi", bits=4, k_group_size=8), SPEC, attention="triton")
    kivi.write(0, *(t.to(DEVICE) for t in kv(seg.batch_size, seg.seq_len, seed=4)), seg)
    assert kivi.batch_key(0, DEVICE)[0] == "fused"
