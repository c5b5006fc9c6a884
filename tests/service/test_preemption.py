"""Preemption by recompute (issue 36 item 5) on the tiny LLaDA and Dream checkpoints: a large running request
that holds the memory budget makes way at a block boundary for a small request that does not fit beside it, and
its output (tokens, NFE, streamed blocks, sampled rows) is the same as without preemption; the rule itself as a
pure function (`service.runtime.preemption`)."""

from __future__ import annotations

import threading

import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from service.engine import Engine
from service.engine.params import DecodeParams, RowOptions
from service.quant.config import KVQuantConfig
from service.quant.store import make_kv_store
from service.runtime.loop import Job, Worker
from service.runtime.memory import MemoryModel
from service.runtime.preemption import Holder, plan_preemption
from service.runtime.scheduler import Cost
from service.store.active import ConfigSnapshot
from service.telemetry import Telemetry
from tests.support.fastdllm import CKPT, four_prompts
from tests.support.preemption import large_then_small

KIVI2 = KVQuantConfig(method="kivi", bits=2, k_group_size=8)
UNQUANTIZED = KVQuantConfig()


@pytest.fixture(scope="module")
def engines():
    torch.set_num_threads(1)
    return {arch: Engine.load(path) for arch, path in CKPT.items()}


def _worker(engine, budget: int, telemetry: Telemetry, **kw) -> Worker:
    return Worker(engine, lambda snap: make_kv_store(snap.config, engine.spec), telemetry,
                  MemoryModel.for_engine(engine), budget, max_rows=8, **kw)


def _preemptions(telemetry: Telemetry) -> float:
    """``dllm_preemptions_total`` as a Prometheus scraper reads it."""
    text = generate_latest(telemetry.registry).decode()
    family = next(f for f in text_string_to_metric_families(text) if f.name == "dllm_preemptions")
    return next(s.value for s in family.samples if s.name == "dllm_preemptions_total")


def _run(engine, arch: str, mode: str, config: KVQuantConfig, n: int, temperature: float, max_preemptions: int):
    """The large request alone in the budget; the small one submitted when the large one commits its first block.
    Returns the two results, the large one's streamed blocks, its job, the order they finished in and the
    Prometheus counter."""
    prompts = four_prompts(arch)
    large_params = DecodeParams(gen_length=96, block_length=32, threshold=0.9, ignore_eos=True, cache_mode=mode)
    small_params = DecodeParams(gen_length=32, block_length=32, threshold=0.9, ignore_eos=True, cache_mode="dual")
    rows = [RowOptions(temperature=temperature, seed=7 + i) for i in range(n)]
    telemetry = Telemetry()
    probe = _worker(engine, 1 << 30, telemetry)
    large = Job(prompts[2] * 3, large_params, rows[0], ConfigSnapshot(config, mode, "request"), more_rows=tuple(rows[1:]))
    small = Job(prompts[0], small_params, RowOptions(), ConfigSnapshot(UNQUANTIZED, "dual", "request"))
    large_cost, small_cost = probe._cost(large), probe._cost(small)
    budget = large_cost.kv + large_cost.transient  # the large one fits alone, the small one not beside it
    assert small_cost.kv > 0 and small_cost.kv + small_cost.transient <= budget
    assert large_cost.kv + large_cost.transient > small_cost.kv + small_cost.transient
    worker = _worker(engine, budget, telemetry, max_preemptions=max_preemptions)
    large_result, small_result, blocks, order = large_then_small(worker, large, small)
    return large_result, small_result, blocks, large, order, _preemptions(telemetry)


CASES = [
    ("llada", "dual", UNQUANTIZED, 1, 0.0),
    ("llada", "prefix", KIVI2, 1, 0.0),
    ("llada", "none", UNQUANTIZED, 1, 0.0),
    ("llada", "dual", KIVI2, 3, 0.8),
    ("dream", "dual", UNQUANTIZED, 1, 0.0),
    ("dream", "prefix", KIVI2, 1, 0.0),
    ("dream", "none", UNQUANTIZED, 1, 0.0),
    ("dream", "dual", UNQUANTIZED, 2, 0.7),
]


@pytest.mark.parametrize(("arch", "mode", "config", "n", "temperature"), CASES,
                         ids=[f"{a}-{m}-{c.method}-n{n}-t{t}" for a, m, c, n, t in CASES])
def test_a_preempted_request_decodes_and_streams_as_without_preemption(engines, arch, mode, config, n, temperature):
    engine = engines[arch]
    with_p = _run(engine, arch, mode, config, n, temperature, max_preemptions=4)
    without = _run(engine, arch, mode, config, n, temperature, max_preemptions=0)
    large, small, blocks, job, order, counted = with_p
    assert job.preemptions == 1 and counted == 1.0
    assert order == ["small", "large"]  # the small one did not wait for the large one's run
    assert without[5] == 0.0 and without[4] == ["large", "small"]
    assert [r.generated_ids for r in large.report.rows] == [r.generated_ids for r in without[0].report.rows]
    assert [r.nfe for r in large.report.rows] == [r.nfe for r in without[0].report.rows]
    assert blocks == without[2]  # the stream goes on across the preemption, block for block
    assert small.row.generated_ids == without[1].row.generated_ids
    if n > 1:  # sampled rows differ from each other: each row's generator kept its state across the preemption
        assert len({tuple(r.generated_ids) for r in large.report.rows}) > 1


# ---- the rule, as a pure function -------------------------------------------------------------------------------
BUDGET = 100
SMALL, LARGE = Cost(10, 5), Cost(80, 10)


def _holder(cost: Cost, since: float = 0.0, preemptions: int = 0, pausable: bool = True, boundary: bool = True):
    return Holder(cost, since, preemptions, pausable, boundary)


def test_the_request_holding_memory_longest_makes_way_for_a_smaller_head():
    running = [_holder(LARGE, since=5.0), _holder(LARGE, since=1.0)]
    assert plan_preemption(SMALL, running, 170) == [1]  # the one that joined first


def test_nobody_makes_way_for_a_request_as_large_as_itself_or_beyond_the_limit():
    assert plan_preemption(LARGE, [_holder(LARGE)], BUDGET) == []
    assert plan_preemption(SMALL, [_holder(LARGE, preemptions=2)], BUDGET, max_preemptions=2) == []
    assert plan_preemption(SMALL, [_holder(LARGE)], BUDGET, max_preemptions=0) == []
    assert plan_preemption(SMALL, [_holder(LARGE, pausable=False)], BUDGET) == []


def test_preemption_waits_for_a_block_boundary_and_is_refused_when_it_cannot_help():
    assert plan_preemption(SMALL, [_holder(LARGE, boundary=False)], BUDGET) == []
    # two large ones must both go: the one at its boundary goes now, the other at its own
    running = [_holder(Cost(45, 5), since=0.0, boundary=False), _holder(Cost(45, 5), since=1.0)]
    assert plan_preemption(Cost(40, 5), running, 85) == [1]
    # a request that is not pausable holds too much: preempting the others would not make the head fit
    assert plan_preemption(SMALL, [_holder(Cost(85, 10), pausable=False), _holder(Cost(15, 5))], BUDGET) == []


# ---- one running set (issue 34 item 4) --------------------------------------------------------------------------
class _WatchedLock(threading.Condition):
    """The worker's lock, noting each time the worker thread takes it while the batch's ``run`` is on its stack."""

    def __init__(self) -> None:
        super().__init__()
        self.in_run = False
        self.taken_in_run = 0

    def __enter__(self):
        if self.in_run and threading.current_thread().name == "dllm-kvq-worker":
            self.taken_in_run += 1
        return super().__enter__()


def test_the_worker_keeps_the_one_running_set_and_nothing_of_it_runs_inside_the_batch(engines):
    """The batch decodes exactly the worker's running cohorts each iteration and keeps no list of its own; nothing
    of the worker (no callback, no lock) runs inside ``run``; once every request is done (one of them preempted
    and resumed) the batch holds no pending call of any of them."""
    engine = engines["llada"]
    prompts = four_prompts("llada")
    large = Job(prompts[2] * 3, DecodeParams(gen_length=96, block_length=32, threshold=0.9, ignore_eos=True,
                                             cache_mode="dual"), RowOptions(), ConfigSnapshot(KIVI2, "dual", "request"))
    small = Job(prompts[0], DecodeParams(gen_length=32, block_length=32, threshold=0.9, ignore_eos=True,
                                         cache_mode="dual"), RowOptions(), ConfigSnapshot(UNQUANTIZED, "dual", "request"))
    probe = _worker(engine, 1 << 30, Telemetry())
    cost = probe._cost(large)
    worker = _worker(engine, cost.kv + cost.transient, Telemetry())
    lock = worker._cond = _WatchedLock()
    iterations: list[tuple[list, list, list]] = []  # (the worker's running cohorts, the passes' cohorts, batch.cohorts)

    def watch(batch):
        passes, run = batch.passes, batch.run

        def watched_passes(cohorts):
            got = passes(cohorts)
            iterations.append(([j.cohort for j in worker._running.values()], list(cohorts), list(batch.cohorts)))
            return got

        def watched_run(forwards):
            lock.in_run = True
            try:
                return run(forwards)
            finally:
                lock.in_run = False

        batch.passes, batch.run = watched_passes, watched_run
        return batch

    make = engine.batch
    engine.batch = lambda *a, **kw: watch(make(*a, **kw))
    try:
        submitted = threading.Event()

        def on_block(block: int, ids: list[list[int]]) -> None:
            if not submitted.is_set():  # this test's own callback (the server's hands the block to its event
                submitted.set()             # loop): its submit is not the worker's taking the lock
                lock.in_run, was = False, lock.in_run
                worker.submit(small)
                lock.in_run = was

        large.on_block = on_block
        worker.submit(large)
        worker.start()
        large.future.result(timeout=300)
        small.future.result(timeout=300)
        worker.stop()
    finally:
        engine.batch = make
    assert large.preemptions == 1  # the set changed under preemption, not only by joins and finishes
    assert iterations and all(running == given and own == [] for running, given, own in iterations)
    assert lock.taken_in_run == 0
    assert worker._batch._next == {}  # nothing left behind by the cohorts that left
