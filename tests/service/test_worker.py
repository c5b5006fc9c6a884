"""The worker without HTTP: requests sharing iterations, cancellation, queue bound, drain, fault classification,
shadow re-decodes (with the fake engine, which records the rows of every iteration it runs: one block of every
running request)."""

from __future__ import annotations

import threading

import pytest

from service.engine.params import DecodeParams, RowOptions
from service.engine.prefix_cache import Namespace, PrefixCache
from service.quant.config import KVQuantConfig
from service.runtime.loop import (
    DeviceFault,
    Job,
    JobCancelled,
    QueueFull,
    Worker,
    WorkerUnavailable,
    is_device_fault,
)
from service.runtime.memory import MemoryModel
from service.store.active import ConfigSnapshot
from service.telemetry import Telemetry
from tests.support.fake_engine import ALPHABET, OFFSET, FakeEngine

NONE = ConfigSnapshot(KVQuantConfig(), "dual", "default")
KIVI = ConfigSnapshot(KVQuantConfig(method="kivi", bits=2), "dual", "active")


def job(gen=4, snapshot=NONE, prompt=(10, 11)) -> Job:
    return Job(list(prompt), DecodeParams(gen_length=gen, block_length=4), RowOptions(), snapshot)


def make_worker(engine: FakeEngine, **kw) -> Worker:
    """A worker whose memory budget (1 GiB) holds every job of these tests: only ``max_rows`` limits the batch."""
    return Worker(engine, lambda snap: None, Telemetry(), MemoryModel.for_engine(engine), 1 << 30, **kw)


def test_jobs_of_any_settings_join_in_queue_order_up_to_max_rows_and_leave_when_done():
    engine = FakeEngine()
    worker = make_worker(engine, max_rows=3)
    jobs = [job(4), job(8), job(4), job(4), job(4, KIVI), job(4)]
    for j in jobs:  # queued before the thread starts, so the iterations are deterministic
        worker.submit(j)
    worker.start()
    results = [j.future.result(timeout=60) for j in jobs]
    # Iteration 1: the first three (a 2-block job among 1-block ones); 2: the 2-block job alone, the others left;
    # 3: the next two join it (the kivi job's other snapshot and length do not matter) as it leaves; 4: the last.
    assert engine.calls == [3, 1, 2, 1]
    assert [r.batch_size for r in results] == [3, 3, 3, 3, 3, 3]
    assert results[4].snapshot is KIVI and results[0].snapshot is NONE
    assert all(r.row.generated_ids == [11, 10, 2] for r in results)  # the prompt reversed, then EOS
    worker.stop()


def test_queue_bound_cancel_frees_a_slot_and_drain_refuses_new_jobs():
    engine = FakeEngine()
    worker = make_worker(engine, max_queue=2)
    a, b = worker.submit(job()), worker.submit(job())
    with pytest.raises(QueueFull) as full:
        worker.submit(job())
    assert full.value.retry_after_s == 1
    worker.cancel(a)
    with pytest.raises(JobCancelled):
        a.future.result(timeout=30)
    c = worker.submit(job())  # the cancelled job's slot is free
    worker.start()
    assert worker.drain(timeout_s=60) is True
    assert b.future.result().row.generated_ids and c.future.result().row.generated_ids
    with pytest.raises(WorkerUnavailable, match="shutting down"):
        worker.submit(job())


def test_batch_failure_and_device_fault():
    engine = FakeEngine()
    worker = make_worker(engine)
    worker.start()
    bad = worker.submit(job(prompt=(OFFSET + ALPHABET.index("!"),)))  # "!" makes the fake engine raise
    with pytest.raises(Exception, match="injected fault"):
        bad.future.result(timeout=60)
    assert worker.submit(job()).future.result(timeout=60).row.generated_ids == [11, 10, 2]
    assert worker.healthy
    fatal = worker.submit(job(prompt=(OFFSET + ALPHABET.index("#"),)))
    with pytest.raises(Exception, match="illegal memory access"):
        fatal.future.result(timeout=60)
    with pytest.raises(WorkerUnavailable, match="device fault"):
        worker.submit(job())
    assert not worker.healthy


@pytest.mark.parametrize("exc,fatal", [
    (DeviceFault("x"), True),
    (RuntimeError("CUDA error: device-side assert triggered"), True),
    (RuntimeError("shape mismatch"), False),
    (type("OutOfMemoryError", (RuntimeError,), {})("CUDA error: out of memory"), False),
    (ValueError("CUDA error"), False),
])
def test_device_fault_classification(exc, fatal):
    assert is_device_fault(exc) is fatal


def test_shadow_re_decode_only_for_quantized_jobs_and_labelled_by_the_served_config():
    engine = FakeEngine()
    worker = make_worker(engine, shadow_rate=1.0, seed=0)
    done = threading.Event()
    observed = []
    worker.telemetry.observe_shadow = lambda config, mode, agreement, exact: (observed.append(
        (config.method, mode, agreement, exact)), done.set())
    worker.start()
    worker.submit(job()).future.result(timeout=60)
    worker.submit(job(snapshot=KIVI)).future.result(timeout=60)
    assert done.wait(60)
    worker.drain(10)
    assert observed == [("kivi", "dual", 1.0, True)]  # the fake engine ignores the cache: full agreement
    assert engine.calls == [1, 1, 1]


def test_the_prefix_cache_counts_in_the_budget_and_gives_way_before_a_request_waits():
    """The cache's blocks fill the whole budget: a request still joins at once, because the cache evicts its least
    recently used unreferenced blocks first, and only as many as the request needs (one block here)."""
    engine = FakeEngine()
    budget = 1 << 24
    cache = PrefixCache(budget)
    namespace = Namespace("fa" * 32, "cpu:torch.float32", 4, "none")
    for b in range(8):  # 8 one-block chains of budget / 8 bytes each
        hit = cache.lookup(namespace, [b] * 4)
        cache.insert(hit, [([b] * 4, (), budget // 8)])
        cache.release(hit)
    worker = Worker(engine, lambda snap: None, Telemetry(), MemoryModel.for_engine(engine), budget,
                    prefix_cache=cache)
    first = cache.blocks()[0].key
    j = job(4)
    worker.submit(j)
    worker.start()
    assert j.future.result(timeout=60).row.generated_ids == [11, 10, 2]
    stats = cache.stats()["none"]
    assert stats.evicted_bytes == budget // 8 and first not in cache, "the least recently used block, only"
    assert cache.held_bytes == 7 * budget // 8
    worker.stop()


def test_what_the_graphs_pools_hold_past_their_live_runs_counts_in_the_budget_and_the_reserved_gauge():
    """The pools of the CUDA graphs (`service.engine.graphs.LaterSteps.unused_bytes`) keep freed runs' space until
    they shrink: admission sees that much less budget, and dllm_kv_bytes_reserved includes it."""
    engine = FakeEngine()
    budget = 1 << 24
    worker = Worker(engine, lambda snap: None, Telemetry(), MemoryModel.for_engine(engine), budget)
    assert worker._budget_beside_cache([], None) == budget
    worker.pool_slack = lambda: budget // 4
    assert worker._budget_beside_cache([], None) == budget - budget // 4
    worker._publish()
    assert worker.telemetry.registry.get_sample_value("dllm_kv_bytes_reserved") == budget // 4
