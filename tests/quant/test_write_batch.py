"""Block-initial writes of several requests' stores in one call (`QuantizedKVStore.write_batch`, issue 41): each
store holds, bit for bit, what its own `write` holds (codes, statistics, protected tokens, counts), whatever the
rows' lengths; stores that may not write together (KVQuant, other formats) say so."""


import pytest
import torch

from service.engine.kv_store import DEFER_WRITE_CHECKS
from tests.quant.helpers import SPEC, kv
from tests.quant.test_rows import LAYOUTS, store


def _stacked(dtype, seed=0):
    """Per layout its K, V and scores, and all of them stacked (each padded past its own sequence with noise,
    which no store may read)."""
    width = max(seg.seq_len for seg in LAYOUTS)
    gen = torch.Generator().manual_seed(seed)
    own, ks, vs, ss = [], [], [], []
    for i, seg in enumerate(LAYOUTS):
        k, v = kv(seg.batch_size, seg.seq_len, dtype, seed=20 + i)
        scores = torch.rand(seg.batch_size, seg.seq_len, generator=gen)
        own.append((k, v, scores))
        pad = width - seg.seq_len
        noise = torch.randn(seg.batch_size, SPEC.num_kv_heads, pad, SPEC.head_dim, generator=gen).to(dtype) * 50
        ks.append(torch.cat([k, noise], 2))
        vs.append(torch.cat([v, noise], 2))
        ss.append(torch.cat([scores, torch.rand(seg.batch_size, pad, generator=gen)], 1))
    return own, torch.cat(ks), torch.cat(vs), torch.cat(ss)


def _same_layer(a, b):
    """The same held tensors, elements, nominal bits and bytes; KVQuant's outlier rows may be wider in one (a
    stacked write's capacity grows for a fuller token of any member): the same outliers, values and nominal bits."""
    from tests.quant.test_kvquant_write import held_outliers

    for side in ("k", "v"):
        x, y = getattr(a, side), getattr(b, side)
        assert list(x.tensors) == list(y.tensors), side
        same_shapes = all(x.tensors[name].shape == y.tensors[name].shape for name in x.tensors)
        for name in x.tensors:
            assert x.tensors[name].dtype == y.tensors[name].dtype, (side, name)
            if same_shapes or not name.startswith("outlier"):
                assert torch.equal(x.tensors[name], y.tensors[name]), (side, name)
        if not same_shapes:
            n = x.tensors["outlier_index"].shape[0]
            for p, q in zip(held_outliers(x, n, x.elements // n), held_outliers(y, n, y.elements // n)):
                assert torch.equal(p, q), side
        assert (x.elements, x.nominal_bitsum) == (y.elements, y.nominal_bitsum), side
        assert x.nbytes == y.nbytes or not same_shapes, side


@pytest.mark.parametrize("method", ["kivi", "dllm_kvq", "dllm_kvq_p0", "kvquant"])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_stacked_write_holds_what_each_store_writes_alone(method, bits, dtype):
    if method in ("dllm_kvq", "kvquant") and bits == 8:
        pytest.skip("the policy and state helpers fit 2 and 4 bits only")
    own, k, v, scores = _stacked(dtype)
    alone = [store(method, bits) for _ in LAYOUTS]
    together = [store(method, bits) for _ in LAYOUTS]
    assert len({s.write_key() for s in together}) == 1 and together[0].write_key() is not None
    for layer in range(2):
        for s, seg, (kk, vv, ss) in zip(alone, LAYOUTS, own):
            s.write(layer, kk, vv, seg, ss)
        together[0].write_batch(together, layer, k, v, list(LAYOUTS), scores)
    protected = 0
    for a, t in zip(alone, together):
        for layer in range(2):
            _same_layer(a._packed[layer], t._packed[layer])
            protected += a._packed[layer].k.tensors.get("protected_slots", torch.zeros(0)).numel()
            for x, y in zip(a.read(layer), t.read(layer)):
                assert torch.equal(x, y)
        ra, rt = a.report(), t.report()
        if method == "kvquant":  # (its rows' capacity, hence bytes, may differ: `_same_layer`)
            assert [(x.k_nominal_bits, x.v_nominal_bits) for x in ra.per_layer] == [
                (x.k_nominal_bits, x.v_nominal_bits) for x in rt.per_layer]
        else:
            assert ra == rt
    assert (protected > 0) == method.startswith("dllm_kvq")
    if method == "kvquant":  # outliers on both sides, in more than one member (each member's rows its own)
        for side in ("k", "v"):
            assert sum(bool((getattr(t._packed[0], side).tensors["outlier_index"] >= 0).any()) for t in together) > 1


def test_a_second_block_starts_again():
    """A new block's stacked write (new segments) leaves nothing of the last one: the same as written alone."""
    own, k, v, scores = _stacked(torch.float32, seed=1)
    together = [store("dllm_kvq", 4) for _ in LAYOUTS]
    together[0].write_batch(together, 0, k * 3, v, list(LAYOUTS), scores)
    together[0].write_batch(together, 0, k, v, list(LAYOUTS), scores)
    for s, seg, (kk, vv, ss) in zip(together, LAYOUTS, own):
        a = store("dllm_kvq", 4)
        a.write(0, kk, vv, seg, ss)
        _same_layer(a._packed[0], s._packed[0])


def test_the_checks_of_a_stacked_write_are_one_verdict_put_off():
    _own, k, v, scores = _stacked(torch.float32)
    together = [store("kivi", 4) for _ in LAYOUTS]
    token = DEFER_WRITE_CHECKS.set(True)
    try:
        together[0].write_batch(together, 0, k, v, list(LAYOUTS), scores)
        assert all(bool(s.take_checks()) for s in together)
        bad = k.clone()
        bad[LAYOUTS[0].batch_size, 0, LAYOUTS[1].block_start - 1, 0] = float("nan")  # a reused K of store 1
        together[0].write_batch(together, 1, bad, v, list(LAYOUTS), scores)
        verdicts = [s.take_checks() for s in together]
    finally:
        DEFER_WRITE_CHECKS.reset(token)
    # one verdict for the set: every member's pass runs again alone, which finds the culprit
    assert all(verdict is not None and not bool(verdict) for verdict in verdicts)


def test_only_stores_of_one_configuration_write_together():
    keys = {name: store(*spec).write_key() for name, spec in
            {"kivi4": ("kivi", 4), "kivi2": ("kivi", 2), "dllm4": ("dllm_kvq", 4), "kvquant": ("kvquant", 4),
             "kvquant2": ("kvquant", 2)}.items()}
    assert None not in keys.values() and len(set(keys.values())) == len(keys)
    assert store("kvquant", 4).write_key() == keys["kvquant"]  # another store of the same state
    assert store("kivi", 4, sides="k").write_key() is None  # a side held as it is


@pytest.mark.parametrize("deferred", [True, False])
def test_a_stacked_kvquant_write_reads_the_device_at_most_once(deferred):
    """Its outlier rows are sized from the shape: with its checks put off (a running batch's write) it reads
    nothing; read at once, its flags (finite, outliers that fit, no median needed) are one read per layer for all
    the rows, where each store's write reads once."""
    from benchmarks.iteration_cost import Counter

    _own, k, v, scores = _stacked(torch.float32, seed=3)
    together = [store("kvquant", 4) for _ in LAYOUTS]
    together[0].write_batch(together, 0, k, v, list(LAYOUTS), scores)  # tables made
    token = DEFER_WRITE_CHECKS.set(deferred)
    try:
        with Counter() as counter:
            together[0].write_batch(together, 1, k, v, list(LAYOUTS), scores)
        assert counter.syncs == (0 if deferred else 1)
        if deferred:
            assert all(bool(s.take_checks()) for s in together)
    finally:
        DEFER_WRITE_CHECKS.reset(token)


@pytest.mark.parametrize("deferred", [True, False])
def test_a_stacked_kvquant_write_of_a_nan_fails_as_the_culprits_own(deferred):
    """A NaN in one member's reused V: put off, one False verdict for the set (each member writes again alone);
    read at once, the error its own write raises (its own row and column, not the stacked row)."""
    from service.quant.errors import NonFiniteKVError

    own, k, v, scores = _stacked(torch.float32, seed=4)
    together = [store("kvquant", 4) for _ in LAYOUTS]
    first = LAYOUTS[0].batch_size + LAYOUTS[1].batch_size
    bad = v.clone()
    bad[first, 1, LAYOUTS[2].block_start - 1, 0] = float("nan")  # store 2, its row 0
    if deferred:
        token = DEFER_WRITE_CHECKS.set(True)
        try:
            together[0].write_batch(together, 0, k, bad, list(LAYOUTS), scores)
            assert all(not bool(s.take_checks()) for s in together)
        finally:
            DEFER_WRITE_CHECKS.reset(token)
        return
    alone = store("kvquant", 4)
    with pytest.raises(NonFiniteKVError) as want:
        alone.write(0, own[2][0], bad[first:first + LAYOUTS[2].batch_size, :, : LAYOUTS[2].seq_len], LAYOUTS[2])
    with pytest.raises(NonFiniteKVError) as got:
        together[0].write_batch(together, 0, k, bad, list(LAYOUTS), scores)
    assert str(got.value) == str(want.value) and "row 0" in str(got.value)


@pytest.mark.parametrize("method", ["kivi", "dllm_kvq", "dllm_kvq_p0", "kvquant"])
def test_a_pooled_read_of_stores_written_together_reads_what_it_reads_of_stores_written_alone(method):
    """Later steps read stores written together from the stacked tensors (`service.quant.base.joined`: one piece
    per run of members, not a slice per store; KVQuant's outlier indices moved by each member's first entry,
    `service.quant.rows_nuq`): the same K/V for every subset, order and mix with a store written alone (KVQuant's
    keys rotated at each row's own positions)."""
    from service.engine.models.layers import RotaryEmbedding
    from tests.quant.test_rows_nuq import reused_positions

    own, k, v, scores = _stacked(torch.bfloat16, seed=2)
    alone = [store(method, 4) for _ in LAYOUTS]
    together = [store(method, 4) for _ in LAYOUTS]
    first = sum(seg.batch_size for seg in LAYOUTS[:3])
    for layer in range(2):
        for s, seg, (kk, vv, ss) in zip(alone, LAYOUTS, own):
            s.write(layer, kk, vv, seg, ss)
        together[0].write_batch(together[:3], layer, k[:first], v[:first], list(LAYOUTS[:3]), scores[:first])
        together[3].write(layer, *own[3][:2], LAYOUTS[3], own[3][2])
    key_len = max(seg.seq_len for seg in LAYOUTS) + 1
    rope = RotaryEmbedding(SPEC.head_dim, 5e5, True)
    positions = [reused_positions(seg) for seg in LAYOUTS]
    for members in ([0, 1, 2, 3], [0, 1, 2], [1, 2, 3], [0, 2], [2, 0, 3]):
        pos = [positions[i] for i in members] if method == "kvquant" else None
        for layer in range(2):
            want = alone[members[0]].window_kv_batch([alone[i] for i in members], layer, key_len, pos, rope)
            got = together[members[0]].window_kv_batch([together[i] for i in members], layer, key_len, pos, rope)
            for x, y in zip(want, got):
                assert torch.equal(x, y), (members, layer)


@pytest.mark.parametrize("method", ["kivi", "dllm_kvq", "dllm_kvq_p0"])
def test_the_fused_kernels_operands_of_a_set_are_made_once_for_all_its_stores(method):
    """`stores_side_by_side` (once per layer, from what the stores hold) gives the fused kernel the operands,
    value for value, that `side_by_side` makes of each store's own `kernel_operands` and `BlockMaps`, for stores
    written together, alone, and a mix in any order."""
    import dataclasses

    from service.quant.kernels.parts import side_by_side, stores_side_by_side

    own, k, v, scores = _stacked(torch.bfloat16, seed=3)
    together = [store(method, 4) for _ in LAYOUTS]
    first = sum(seg.batch_size for seg in LAYOUTS[:3])
    for layer in range(2):
        together[0].write_batch(together[:3], layer, k[:first], v[:first], list(LAYOUTS[:3]), scores[:first])
        together[3].write(layer, *own[3][:2], LAYOUTS[3], own[3][2])
    h, d = SPEC.num_kv_heads, SPEC.head_dim
    for members in ([0, 1, 2, 3], [1, 2], [3, 0, 1, 2], [2, 0]):
        stores = [together[i] for i in members]
        widths = [8 + i for i in members]
        for layer in range(2):
            want = side_by_side([s._kernel_inputs(layer) for s in stores], widths, h, d)
            got = stores_side_by_side(stores, layer, widths, h, d)
            for field in dataclasses.fields(want):
                a, b = getattr(want, field.name), getattr(got, field.name)
                if field.name == "ops":
                    for f in dataclasses.fields(a):
                        x, y = getattr(a, f.name), getattr(b, f.name)
                        if isinstance(x, torch.Tensor):
                            assert x.dtype == y.dtype and torch.equal(x, y), (members, layer, f.name)
                        else:
                            assert x == y, (members, layer, f.name)
                elif isinstance(a, torch.Tensor):
                    assert a.dtype == b.dtype and torch.equal(a, b), (members, layer, field.name)
                else:
                    assert a == b, (members, layer, field.name)

