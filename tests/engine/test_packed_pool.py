"""Quantized later steps graphed over the packed pool (`service.engine.packed_pool`, issue 41 item 4).

KIVI (4 and 2 bits) and dLLM-KVQ stores on the fused kernel's path (forced on CPU: Triton's interpreter) hold their
packed layers in the packed pool when the later steps are graphed (`service.engine.graphs.EagerGraphs`: the pool,
the keys, warm-ups and replays over refreshed inputs as on CUDA); a batch whose requests join and leave replays
graphs keyed by bucket, LM-head columns and pool generation, and decodes token for token as the eager, unpadded
forwards over the stores' own tensors.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from benchmarks.graph_keys import serve as serve_jobs
from benchmarks.graph_keys import store_of
from service.engine.graphs import EagerGraphs
from service.engine.packed_pool import PackedPool
from service.engine.params import DecodeParams
from tests.support.fastdllm import four_prompts


def serve(engine, jobs, runner, running: int = 3):
    """Decode ``jobs`` (prompt, params, store kind: `benchmarks.graph_keys.store_of`) at most ``running`` at once,
    a new one joining as one leaves; each job's generated ids."""
    return serve_jobs(engine, [(p, params) for p, params, _ in jobs], running, runner, tuple(k for _, _, k in jobs))


def _params(cache_mode: str, gen: int = 32, per_block: int = 4) -> DecodeParams:
    return DecodeParams(gen_length=gen, block_length=16, cache_mode=cache_mode, threshold=None,
                        steps=gen // 16 * per_block, ignore_eos=True)


@pytest.mark.parametrize(("kind", "cache_mode"), [("kivi4", "dual"), ("kivi2", "prefix"), ("dllm_kvq", "dual"),
                                                  ("dllm_kvq", "prefix")])
def test_quantized_later_steps_replay_as_eager(engines, cache_mode, kind):
    """Five requests of mixed prompt and response lengths, at most three at once (one joins as one leaves; prefix
    mode's reused length grows block by block, so each block takes new runs): every later step is graphed over
    the packed pool (a shape's first forward its warm-up, then captures and replays over refreshed inputs),
    rows padded to the bucket, and each request decodes token for token as the eager, unpadded forwards over
    its store's own tensors."""
    engine = engines["llada"]
    prompts = four_prompts("llada")
    # prefix mode: the window's width changes every block, so more steps per block for shapes to repeat
    per_block = 8 if cache_mode == "prefix" else 4
    jobs = [(prompts[i % 4], _params(cache_mode, 32 if i % 2 else 48, per_block), kind) for i in range(5)]
    saved = engine.later_steps
    try:
        eager = serve(engine, jobs, None)
        runner = EagerGraphs(key_step=16, width_step=8)
        assert serve(engine, jobs, runner) == eager
    finally:
        engine.use_graphs(saved)
    packed = runner.pool.packed
    assert runner.captures >= 1 and runner.replays >= 1
    assert runner.eager == len(runner._seen)  # every later step graphed: the eager ones were its shapes' warm-ups
    assert runner.pool.bytes_held == 0  # nothing in the full-precision pool: the K/V were quantized
    assert packed.bytes_held > 0 == packed.live_bytes and not packed.holders  # held there, freed at the end


def test_a_batch_of_kivi_and_dllm_kvq_joining_and_leaving_decodes_as_eager(engines):
    """KIVI 4 and 2 bits and dLLM-KVQ requests, dual and prefix, joining as others leave: the forwards of one batch
    key are graphed, mixed ones run eagerly over the pooled views, and every request decodes as eagerly."""
    engine = engines["llada"]
    prompts = four_prompts("llada")
    kinds = ("kivi4", "kivi2", "dllm_kvq")
    jobs = [(prompts[i % 4], _params(("dual", "prefix")[i % 2], 32), kinds[i % 3]) for i in range(6)]
    saved = engine.later_steps
    try:
        eager = serve(engine, jobs, None)
        runner = EagerGraphs(key_step=16, width_step=8)
        assert serve(engine, jobs, runner, running=2) == eager
    finally:
        engine.use_graphs(saved)
    assert runner.captures + runner.replays >= 1 and runner.pool.packed.live_bytes == 0


def test_a_new_set_of_quantized_requests_replays_the_graphs_it_has(engines):
    """The same jobs decoded again by new requests (new stores, new runs in the freed space): nothing is captured,
    the pool's generation stays, every later step replays a graph the first set captured (keyed by bucket, LM-head
    columns and pool generation, not by the stores read)."""
    engine = engines["llada"]
    prompts = four_prompts("llada")
    jobs = [(prompts[i], _params("dual"), "kivi4") for i in range(3)]
    saved = engine.later_steps
    try:
        runner = EagerGraphs(key_step=16, width_step=8)
        first = serve(engine, jobs, runner)
        captures, replays, generation = runner.captures, runner.replays, runner.generation
        assert serve(engine, jobs[::-1], runner) == first[::-1]
    finally:
        engine.use_graphs(saved)
    assert captures >= 1 and runner.generation == generation
    assert runner.captures == captures and runner.replays > replays


def _written(engine, pool: PackedPool | None, seed: int, rows: int = 2, t: int = 24):
    """A KIVI store on the kernel's path, in ``pool`` (None: its own tensors), with both layers written."""
    from service.engine.kv_pool import KVPool
    from service.engine.kv_store import Segments

    store = store_of(engine, "kivi2")
    if pool is not None:
        holder = KVPool()
        holder.packed = pool
        store.use_pool(holder)
    spec = engine.spec
    gen = torch.Generator().manual_seed(seed)
    segments = Segments(pad_lengths=(0,) * rows, block_start=t // 2, block_end=t // 2 + 4, seq_len=t,
                        cache_mode="dual")
    for layer in range(spec.num_layers):
        k, v = (torch.randn(rows, spec.num_kv_heads, t, spec.head_dim, generator=gen) for _ in range(2))
        store.write(layer, k, v, segments)
    return store


def _same(a, b) -> bool:
    return all(a._packed[i].k.tensors.keys() == b._packed[i].k.tensors.keys() and all(
        torch.equal(x.tensors[n], y.tensors[n]) for x, y in ((a._packed[i].k, b._packed[i].k),
                                                             (a._packed[i].v, b._packed[i].v)) for n in x.tensors)
        for i in a._packed)


def test_pooled_stores_hold_what_they_wrote_through_growth_and_shrinking(engines):
    """Stores' packed layers copied into the pool read back as written, after the arenas grew (a new generation:
    every holder repointed its views) and after they shrank once most runs were freed; the live bytes are the
    stores' packed bytes plus the kernel's int32 maps."""
    engine = engines["llada"]
    pool = PackedPool()
    stores = [_written(engine, pool, seed) for seed in range(5)]  # each arena doubled to 8 stores' runs
    own = [_written(engine, None, seed) for seed in range(5)]
    assert all(s.packed_runs is not None for s in stores) and all(o.packed_runs is None for o in own)
    assert pool.generation > 0 and all(_same(s, o) for s, o in zip(stores, own))
    maps = sum(4 * (s._layout.num_slots + s._layout.batch_size * s._layout.num_reused) for s in stores)
    assert pool.live_bytes == sum(sum(p.nbytes for p in s._packed.values()) for s in stores) + maps
    generation = pool.generation
    assert not pool.shrink() and pool.generation == generation  # more than a quarter full: kept
    for s in stores[:4]:
        s.clear()
    held = pool.bytes_held
    assert pool.shrink() and pool.generation == generation + 1 and pool.bytes_held < held / 2
    assert _same(stores[4], own[4]) and not pool.shrink()  # repointed; now half full
    stores[4].clear()
    assert pool.live_bytes == 0 and not pool.holders
