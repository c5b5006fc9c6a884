"""The key-bias correction (`service.quant.key_bias`) off the one-store PyTorch path, against it: the pooled read
of several corrected stores (`QuantizedKVStore.attend_batch` on the PyTorch path: `service.quant.rows`,
`service.quant.rows_nuq`) and the fused Triton kernel (one store, `fused_reuse_attention`; the rows of many in one
launch, `fused_reuse_attention_rows`), on CPU tensors under Triton's interpreter (set by tests/conftest.py). The
one-store PyTorch path (`QuantizedKVStore._attend_corrected`) is checked by hand in tests/quant/test_key_bias.py.

The stores are tests/quant/test_fused_rows.py's: they differ in rows, padding, reused lengths and window width (one
in prefix mode with a wider window than the others: its padded window columns must get no weight)."""

from __future__ import annotations

import pytest
import torch

from service.engine.models.layers import RotaryEmbedding
from service.quant.config import KVQuantConfig
from service.quant.store import make_kv_store
from tests.quant.helpers import SPEC, policy
from tests.quant.test_fused_rows import LAYOUTS
from tests.quant.test_fused_rows import _window as window
from tests.quant.test_fused_rows import _written as written
from tests.quant.test_store import STATE2, STATE4

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
#: The pooled read gives each store's own values and steps bit for bit; only the attention's length (the pooled
#: key axis is the longest sequence's, plus a spare column) may change fp32 round-off.
POOLED_TOLERANCE = 2e-6
#: The kernel against the PyTorch path: fp32 round-off of a different summation order (and its own cos(2t)).
KERNEL_TOLERANCE = 2e-5 if DEVICE.type == "cpu" else 1e-4

METHODS = ["kivi", "dllm_kvq", "kvquant"]


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _store(method: str, bits: int, attention: str, correct: bool = True):
    cfg = {"method": method, "bits": bits, "key_bias_correction": correct}
    if method == "dllm_kvq":
        table = policy([("qerror", 3), ("attention", 2)], bits=bits)
        return make_kv_store(KVQuantConfig(**cfg, k_group_size=8, policy_id=table.id), SPEC, artifact=table,
                             attention=attention)
    if method == "kvquant":
        st = STATE4 if bits == 4 else STATE2
        return make_kv_store(KVQuantConfig(**cfg, kvquant_state_id=st.id), SPEC, artifact=st, attention=attention)
    return make_kv_store(KVQuantConfig(**cfg, k_group_size=8), SPEC, attention=attention)


def _written(method: str, bits: int, attention: str, correct: bool = True):
    return written(method, bits, torch.float32, lambda m, b: _store(m, b, attention, correct))


def _step(dtype=torch.float32, seed=0):
    """A later step's queries, fresh K/V (every row, the widest window), widths and reused positions."""
    widths = [window(seg) for seg in LAYOUTS]
    rows, width = sum(seg.batch_size for seg in LAYOUTS), max(widths)
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(rows, SPEC.num_heads, width, SPEC.head_dim, generator=gen) * 3).to(dtype).to(DEVICE)
    k, v = (torch.randn(rows, SPEC.num_kv_heads, width, SPEC.head_dim, generator=gen).to(dtype).to(DEVICE)
            for _ in range(2))
    positions = [torch.stack([torch.arange(seg.seq_len) - pad for pad in seg.pad_lengths])[:, seg.reused_columns]
                 .to(DEVICE) for seg in LAYOUTS]
    return q, k, v, widths, positions


def _alone(stores, layer, q, k, v, widths, positions, rope, attention):
    """Each store's own attention of its rows (``attention``: its path), row-major like ``attend_batch``."""
    out, row = [], 0
    for s, seg, w, pos in zip(stores, LAYOUTS, widths, positions):
        own = slice(row, row + seg.batch_size)
        s.attention, held = attention, s.attention
        out.append((own, w, s.attend(layer, q[own, :, :w], k[own, :, :w], v[own, :, :w], None, pos, rope)))
        s.attention = held
        row += seg.batch_size
    return out


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("bits", [2, 4])
def test_the_pooled_read_of_corrected_stores_equals_each_store_alone(method, bits):
    stores = _written(method, bits, "torch")
    plain = _written(method, bits, "torch", correct=False)
    rope = RotaryEmbedding(SPEC.head_dim, 10000.0, True)
    q, k, v, widths, positions = _step(seed=bits)
    for layer in range(SPEC.num_layers):
        keys = {s.batch_key(layer, DEVICE) for s in stores}
        assert len(keys) == 1 and None not in keys
        assert keys.isdisjoint({s.batch_key(layer, DEVICE) for s in plain})  # never pooled with uncorrected
        together = stores[0].attend_batch(stores, layer, q, k, v, widths, positions, rope)
        assert together.shape == q.shape
        uncorrected = _alone(plain, layer, q, k, v, widths, positions, rope, "torch")
        for (own, w, alone), (_, _, kv_only) in zip(_alone(stores, layer, q, k, v, widths, positions, rope, "torch"),
                                                    uncorrected):
            torch.testing.assert_close(together[own, :, :w], alone, rtol=POOLED_TOLERANCE, atol=POOLED_TOLERANCE)
            assert kv_only is None  # an uncorrected store on the PyTorch path leaves attention to the engine


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("bits", [2, 4])
def test_the_kernel_corrects_each_store_as_the_pytorch_path(method, bits):
    stores = _written(method, bits, "triton")
    rope = RotaryEmbedding(SPEC.head_dim, 10000.0, method != "kvquant" or bits == 4)  # Dream-like rotation too
    q, k, v, widths, positions = _step(seed=bits)
    for layer in range(SPEC.num_layers):
        fused = _alone(stores, layer, q, k, v, widths, positions, rope, "triton")
        torch_path = _alone(stores, layer, q, k, v, widths, positions, rope, "torch")
        for (own, _, got), (_, _, expected) in zip(fused, torch_path):
            torch.testing.assert_close(got, expected, rtol=KERNEL_TOLERANCE, atol=KERNEL_TOLERANCE)
        # a step's subset of rows reads its own rows' steps
        s, w, pos = stores[2], widths[2], positions[2]
        rows = torch.tensor([2, 0], device=DEVICE)
        picked = [sum(x.batch_size for x in LAYOUTS[:2]) + r for r in (2, 0)]
        args = (q[picked, :, :w], k[picked, :, :w], v[picked, :, :w], rows, pos.index_select(0, rows), rope)
        got = s.attend(layer, *args)
        s.attention = "torch"
        torch.testing.assert_close(got, s.attend(layer, *args), rtol=KERNEL_TOLERANCE, atol=KERNEL_TOLERANCE)
        s.attention = "triton"


@pytest.mark.parametrize("method", ["kivi", "dllm_kvq"])
@pytest.mark.parametrize("bits", [2, 4])
def test_one_launch_for_the_rows_of_many_corrected_stores_equals_the_pytorch_path(method, bits, monkeypatch):
    from service.quant.kernels import attention

    launches = []
    kernel = attention._fused_reuse_attention

    class Counted:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    stores = _written(method, bits, "triton")
    rope = RotaryEmbedding(SPEC.head_dim, 10000.0, True)
    q, k, v, widths, positions = _step(seed=bits)
    plain_key = _written(method, bits, "triton", correct=False)[0].batch_key(0, DEVICE)
    monkeypatch.setattr(attention, "_fused_reuse_attention", Counted())  # the PyTorch path launches nothing
    for layer in range(SPEC.num_layers):
        keys = {s.batch_key(layer, DEVICE) for s in stores}
        assert len(keys) == 1 and None not in keys and plain_key not in keys
        together = stores[0].attend_batch(stores, layer, q, k, v, widths, positions, rope)
        assert len(launches) == layer + 1  # one launch for every row of the set
        for own, w, expected in _alone(stores, layer, q, k, v, widths, positions, rope, "torch"):
            torch.testing.assert_close(together[own, :, :w], expected, rtol=KERNEL_TOLERANCE, atol=KERNEL_TOLERANCE)


@pytest.mark.parametrize("method", ["kivi", "kvquant"])
def test_the_correction_is_not_negligible_in_these_checks(method):
    """The comparisons above would pass for a correction that did nothing: here it moves the outputs."""
    corrected, plain = _written(method, 2, "triton"), _written(method, 2, "triton", correct=False)
    rope = RotaryEmbedding(SPEC.head_dim, 10000.0, True)
    q, k, v, widths, positions = _step(seed=2)
    for (_, _, a), (_, _, b) in zip(_alone(corrected, 0, q, k, v, widths, positions, rope, "triton"),
                                      _alone(plain, 0, q, k, v, widths, positions, rope, "triton")):
        assert (a - b).abs().max() > 1e-2
