"""The pool of full-precision reused K/V (`service.engine.kv_pool`): runs that keep their contents when the pool
moves or grows them, a store that holds in the pool what it held in its own buffers, the gather of a pooled window
forward equal to the eager side-by-side buffers, and a run's bytes equal to what admission counts."""

from __future__ import annotations

import pytest
import torch

from service.engine.kv_pool import KVPool, PooledReuse, window_flat_index
from service.engine.kv_store import FullPrecisionKVStore, Segments
from service.engine.params import DecodeParams

H, D = 2, 4


def _kv(rows: int, length: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, H, length, D, generator=torch.Generator().manual_seed(seed))


def _filled(pool: KVPool, rows: int, length: int, seed: int, layers: int = 2):
    """A run of ``rows`` x ``length`` whose every layer holds seeded values: (run, [(k, v) per layer])."""
    run = pool.allocate(rows, length)
    values = []
    for layer in range(layers):
        k, v = _kv(rows, length, seed + 2 * layer), _kv(rows, length, seed + 2 * layer + 1)
        kk, vv = pool.view(run, layer)
        kk.copy_(k)
        vv.copy_(v)
        values.append((k, v))
    return run, values


def _holds(pool: KVPool, run, values) -> bool:
    return all(torch.equal(pool.view(run, layer)[0], k) and torch.equal(pool.view(run, layer)[1], v)
               for layer, (k, v) in enumerate(values))


def test_runs_keep_their_contents_through_first_fit_moves_and_growth():
    pool = KVPool()
    assert pool.takes(_kv(1, 1, 0)) and not pool.takes(_kv(1, 1, 0).double())
    with pytest.raises(ValueError, match="rows and length"):
        pool.allocate(0, 4)
    a, _ = _filled(pool, 1, 5, 0)
    b, _ = _filled(pool, 2, 3, 10)
    c, vc = _filled(pool, 1, 7, 20)
    grown = pool.generation
    assert a.start == H and b.start == a.start + a.size  # packed after the null row
    pool.free(b)
    d, vd = _filled(pool, 1, 4, 30)  # fits b's gap: first fit, no move, no growth
    assert d.start == b.start and pool.generation == grown and pool.moves == 0
    pool.free(a)
    free = pool.capacity - H - d.size - c.size
    e, ve = _filled(pool, 1, free // H, 40)  # fits only once the gaps are closed: c and d move down
    assert pool.moves >= 1 and pool.generation == grown
    assert _holds(pool, c, vc) and _holds(pool, d, vd) and _holds(pool, e, ve)
    f, vf = _filled(pool, 3, 9, 50)  # no room: new buffers, everything copied
    assert pool.generation == grown + 1 and pool.capacity >= 2 * (H + d.size + c.size + e.size)
    assert _holds(pool, c, vc) and _holds(pool, d, vd) and _holds(pool, e, ve) and _holds(pool, f, vf)
    for layer in range(2):  # the null row padded rows read is zeros
        assert not pool.buffers(layer)[0][:H].any() and not pool.buffers(layer)[1][:H].any()
    assert pool.live_bytes == 2 * 2 * (c.size + d.size + e.size + f.size) * D * 4
    assert pool.bytes_held == 2 * 2 * pool.capacity * D * 4


def test_the_buffers_shrink_once_the_live_runs_fill_less_than_a_quarter():
    """Freed runs' vectors stay until the live runs fill less than a quarter of the buffers; then the buffers are
    made anew at twice the live size (a new generation), the live runs' contents kept, the null row zeros."""
    pool = KVPool()
    pool.takes(_kv(1, 1, 0))
    assert not pool.shrink()  # nothing made yet
    runs = [_filled(pool, 1, 8, 10 * i) for i in range(4)]
    for run, _ in runs[1:3]:
        pool.free(run)
    generation, held = pool.generation, pool.bytes_held
    assert not pool.shrink() and pool.generation == generation  # half of it still live
    pool.free(runs[3][0])
    assert pool.shrink() and pool.generation == generation + 1
    assert pool.capacity == H + 2 * runs[0][0].size and pool.bytes_held < held / 2
    assert _holds(pool, *runs[0]) and runs[0][0].start == H
    assert not pool.buffers(0)[0][:H].any() and not pool.shrink()


def test_growth_stops_at_max_tokens_unless_more_is_needed():
    pool = KVPool(max_tokens=10)
    pool.takes(_kv(1, 1, 0))
    pool.allocate(1, 6)
    pool.allocate(1, 3)  # doubling would pass 10 tokens: the buffers stop at 10 (+ the null row)
    assert pool.capacity == H + 10 * H
    pool.allocate(1, 8)  # more than max_tokens in all: admission asked for it, so it is made
    assert pool.capacity == H + 17 * H
    with pytest.raises(ValueError, match="max_tokens"):
        KVPool(max_tokens=0)


def _segments(t: int) -> Segments:
    return Segments(pad_lengths=(0,), block_start=t // 2, block_end=t // 2 + 2, seq_len=t, cache_mode="dual")


def test_a_pooled_store_holds_and_reads_what_its_own_buffers_would():
    pool, own, pooled = KVPool(), FullPrecisionKVStore(), FullPrecisionKVStore()
    pooled.use_pool(pool)
    other = FullPrecisionKVStore()  # a request that leaves its run to the next one, spare column and all
    other.use_pool(pool)
    for layer in range(2):
        other.write(layer, torch.full((1, H, 9, D), float("nan")), torch.full((1, H, 9, D), float("nan")),
                    _segments(9))
    other.clear()
    for block in range(2):  # a later block is written in place: the same run
        for layer in range(2):
            k, v = _kv(1, 9, 4 * block + layer), _kv(1, 9, 4 * block + layer + 2)
            own.write(layer, k, v, _segments(9))
            pooled.write(layer, k, v, _segments(9))
        if block == 0:
            run = pooled.run
        assert pooled.run is run and run.start == H  # the freed run's vectors, taken again
        assert pooled.held_layers == own.held_layers == [0, 1]
        for layer in range(2):
            assert all(torch.equal(a, b) for a, b in zip(own.read(layer), pooled.read(layer)))
            kk, vv = pooled.sequence_kv(layer)
            assert torch.equal(kk[:, :, :-1], own.sequence_kv(layer)[0][:, :, :-1])
            assert not kk[:, :, -1].any() and not vv[:, :, -1].any()  # the spare column: zeros, not the NaNs
    pooled.clear()
    assert pooled.run is None and pool.live_bytes == 0


def test_a_store_that_writes_its_own_way_keeps_its_own_buffers():
    class Own(FullPrecisionKVStore):
        def read(self, layer):
            return super().read(layer)

    store = Own()
    store.use_pool(KVPool())
    assert store.pool is None


def test_the_pooled_gather_is_the_side_by_side_buffer_with_the_window_in_place():
    """Two stores' rows and a padded row gathered at 12 key columns, the window written over its columns: each real
    row holds its sequence (its spare column repeated past it), the window at its destination columns; the padded
    row the null row, its window in the spare column."""
    pool = KVPool()
    pool.takes(_kv(1, 1, 0))
    a, va = _filled(pool, 2, 6, 0, layers=1)
    b, vb = _filled(pool, 1, 10, 5, layers=1)
    key_len, width = 12, 3
    where = pool.rows_where([(a, 2), (b, 1)], 4, torch.device("cpu"))
    assert where.tolist() == [[a.start, 6], [a.start + H * 6, 6], [b.start, 10], [0, 1]]
    dest = torch.tensor([[1, 2, 11], [1, 2, 11], [4, 5, 6], [11, 11, 11]])[:, None, :, None]
    k, v = _kv(4, width, 7), _kv(4, width, 8)
    kk, vv = PooledReuse(pool, where, dest, key_len)(0, None, None, k, v)
    for got, fresh, held in ((kk, k, 0), (vv, v, 1)):
        rows = [va[0][held][0], va[0][held][1], vb[0][held][0]]
        for r, seq in enumerate(rows):
            want = torch.cat([seq, seq[:, -1:].expand(H, key_len - seq.shape[1], D)], dim=1)
            want[:, dest[r, 0, :, 0]] = fresh[r]
            assert torch.equal(got[r], want)
        padded = torch.zeros(H, key_len, D)
        padded[:, 11] = fresh[3, :, -1]  # the last of the window's columns written there wins
        assert torch.equal(got[3], padded)
    assert window_flat_index(dest, H, key_len).shape == (4 * H * width,)


def test_a_run_holds_the_bytes_admission_counts():
    """A request's run in the pool takes what `MemoryModel.cost` counts for its full-precision KV: no more."""
    from service.engine.spec import ModelSpec
    from service.runtime.memory import MemoryModel

    spec = ModelSpec(arch="llada", model_id="m", fingerprint="f", num_layers=3, num_heads=H, num_kv_heads=H,
                     head_dim=D, vocab_size=32, mask_id=31, eos_ids=(1,), pad_id=2, max_length=128)
    memory = MemoryModel.dense(spec, H * D, 3 * H * D, 4)
    params = DecodeParams(gen_length=16, block_length=8, cache_mode="dual")
    cost = memory.cost(20, params, memory.kv_bytes_per_token("fp", FullPrecisionKVStore))
    pool, store = KVPool(), FullPrecisionKVStore()
    store.use_pool(pool)
    for layer in range(3):
        store.write(layer, _kv(1, 36, layer), _kv(1, 36, layer + 9), _segments(36))
    assert pool.live_bytes == cost.kv


def test_the_server_caps_the_pool_at_the_budgets_kv_tokens(tmp_path):
    """`service.main.make_worker`: the graphs' pool grows unasked up to the KV bytes the budget admits beside the
    forward reserve, in tokens of the full-precision store, and its bytes are published (``dllm_kv_pool_bytes``)."""
    from service.config import Settings
    from service.engine import Engine
    from service.engine.graphs import EagerGraphs
    from service.main import default_kv_store_factory, make_worker
    from service.telemetry import Telemetry

    engine = Engine.load(None, threads=1)
    engine.use_graphs(EagerGraphs())
    settings = Settings(store_url=str(tmp_path), kv_budget_bytes=1 << 30)
    telemetry = Telemetry()
    worker = make_worker(settings, engine, default_kv_store_factory(engine.spec), telemetry)
    engine.generate([[engine.spec.pad_id + 10] * 3], DecodeParams(gen_length=16, block_length=8, cache_mode="dual"))
    assert telemetry.registry.get_sample_value("dllm_kv_pool_bytes") == engine.later_steps.pool.bytes_held > 0
    per_token = worker.memory.full_precision_bytes_per_token
    assert per_token == 2 * engine.spec.num_layers * engine.spec.num_kv_heads * engine.spec.head_dim * 4
    assert engine.later_steps.pool.max_tokens == (worker.budget_bytes - worker.forward_bytes) // per_token > 0
