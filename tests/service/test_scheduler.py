"""The continuous scheduler on the tiny LLaDA checkpoint: each request as alone, admission by the memory budget
(FCFS, a 2-bit row costs less than an unquantized one), and a request that can never fit refused up front."""

from __future__ import annotations

import threading
import types

import pytest
import torch

from service.engine import Engine
from service.engine.params import DecodeParams, RowOptions
from service.quant.config import KVQuantConfig
from service.quant.store import make_kv_store
from service.runtime.loop import Job, RequestTooLarge, Worker
from service.runtime.memory import MemoryModel
from service.store.active import ConfigSnapshot
from service.telemetry import Telemetry
from tests.support.fastdllm import CKPT, four_prompts

KIVI2 = KVQuantConfig(method="kivi", bits=2, k_group_size=8)
UNQUANTIZED = KVQuantConfig()


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    return Engine.load(CKPT["llada"])


def _worker(engine, budget: int, **kw) -> Worker:
    return Worker(engine, lambda snap: make_kv_store(snap.config, engine.spec), Telemetry(),
                  MemoryModel.for_engine(engine), budget, **kw)


def _params(**kw) -> DecodeParams:
    return DecodeParams(**{"gen_length": 64, "block_length": 32, "threshold": 0.9, "ignore_eos": True, **kw})


def _snapshot(config: KVQuantConfig = UNQUANTIZED, mode: str = "dual") -> ConfigSnapshot:
    return ConfigSnapshot(config, mode, "request")


def _cost(worker: Worker, prompt: list[int], params: DecodeParams, config: KVQuantConfig):
    return worker._cost(Job(prompt, params, RowOptions(), _snapshot(config, params.cache_mode)))


@pytest.mark.parametrize("split", [0, 40], ids=["whole-passes", "split-by-layers"])
def test_requests_with_mixed_settings_decode_as_alone(engine, split):
    """The worker's one loop decodes requests of every cache mode, quantized or not, as alone; with
    ``layer_split_tokens`` (a small one: every block-initial pass runs piece by piece) too, and a split request's
    cost holds its hidden states between pieces."""
    prompts = four_prompts("llada")
    requests = [
        (prompts[0], _params(), RowOptions(), KVQuantConfig()),
        (prompts[2], _params(gen_length=96, threshold=None, steps=6), RowOptions(temperature=0.7, seed=2), KIVI2),
        (prompts[1], _params(cache_mode="prefix", block_length=16), RowOptions(), KVQuantConfig()),
        (prompts[3], _params(cache_mode="none", gen_length=32), RowOptions(), KVQuantConfig()),
    ]
    worker = _worker(engine, 1 << 30, max_rows=8, layer_split_tokens=split)
    jobs = [worker.submit(Job(p, params, row, _snapshot(config, params.cache_mode)))
            for p, params, row, config in requests]
    worker.start()
    results = [job.future.result(timeout=300) for job in jobs]
    worker.stop()
    assert max(r.batch_size for r in results) >= 2  # they ran together
    whole = _worker(engine, 1 << 30)
    for p, params, _, config in requests:
        hidden = (len(p) + params.gen_length) * engine.model.config.width * 4  # float32, one row
        assert _cost(worker, p, params, config).kv - _cost(whole, p, params, config).kv == (hidden if split else 0)
    for (prompt, params, row, config), result in zip(requests, results):
        alone = engine.generate([prompt], params, [row], kv_store=make_kv_store(config, engine.spec)).rows[0]
        assert result.row.generated_ids == alone.generated_ids
        assert result.row.nfe == alone.nfe
        assert result.snapshot.config == config


def test_budget_admits_more_2_bit_rows_first_come_first_served(engine):
    prompt, params = four_prompts("llada")[2], _params(gen_length=128)
    probe = _worker(engine, 1 << 30)
    full, kivi = _cost(probe, prompt, params, KVQuantConfig()), _cost(probe, prompt, params, KIVI2)
    assert kivi.kv * 3 < full.kv
    budget = 2 * full.kv + full.transient  # exactly two unquantized rows
    peaks = {}
    for name, config in (("full", KVQuantConfig()), ("kivi", KIVI2)):
        worker = _worker(engine, budget, max_rows=16)
        jobs = [worker.submit(Job(prompt, params, RowOptions(), _snapshot(config))) for _ in range(6)]
        worker.start()
        results = [job.future.result(timeout=300) for job in jobs]
        worker.stop()
        peaks[name] = max(r.batch_size for r in results)
        # FCFS: a request never joins before one submitted ahead of it.
        joined = [r.queue_s + j.admitted_at for r, j in zip(results, jobs)]
        assert joined == sorted(joined)
    assert peaks["full"] == 2 and peaks["kivi"] >= 5


def test_a_request_that_can_never_fit_is_refused_naming_the_field(engine):
    prompt = four_prompts("llada")[2]
    worker = _worker(engine, 1 << 30)
    small = _cost(worker, prompt, _params(gen_length=32), KVQuantConfig())
    worker = _worker(engine, small.kv + small.transient)
    with pytest.raises(RequestTooLarge) as too_long:
        worker.submit(Job(prompt, _params(gen_length=512), RowOptions(), _snapshot()))
    assert too_long.value.field == "max_tokens" and "shorten max_tokens" in str(too_long.value)
    with pytest.raises(RequestTooLarge) as too_big:
        worker.submit(Job(prompt * 20, _params(gen_length=32), RowOptions(), _snapshot()))
    assert too_big.value.field == "prompt"
    # n choices: one fits, four do not: n is named, not max_tokens or the prompt.
    four = Job(prompt, _params(gen_length=32), RowOptions(), _snapshot(), more_rows=(RowOptions(),) * 3)
    with pytest.raises(RequestTooLarge) as too_many:
        worker.submit(four)
    assert too_many.value.field == "n" and "its 4 choices do (one fits): lower n" in str(too_many.value)
    assert worker.num_waiting == 0


@pytest.mark.parametrize("backfill_s", [3600.0, None], ids=["backfill", "first-come-first-served"])
def test_a_small_request_does_not_wait_for_a_large_one_blocked_at_the_head(engine, backfill_s):
    """Issue 22 item 5, the case's shape: a request costing the whole budget waits at the head of the queue
    behind a running one; a small request behind it runs beside the running one and finishes before the large
    one starts, while the large one still runs and completes (memory is reserved for it once ``backfill_s`` has
    passed). Strictly first come, first served (no backfill and no preemption, which would let the small one
    preempt the large one: `tests/service/test_preemption.py`), the small one waits for the large one's whole
    run."""
    prompts = four_prompts("llada")
    probe = _worker(engine, 1 << 30)
    running = (prompts[1], _params(gen_length=128))
    large = (prompts[2] * 3, _params(gen_length=256))
    small = (prompts[0], _params(gen_length=32))
    costs = [_cost(probe, p, params, KVQuantConfig()) for p, params in (running, large, small)]
    budget = costs[1].kv + costs[1].transient  # the large one fits only alone
    assert costs[0].kv + costs[2].kv + max(costs[0].transient, costs[2].transient) <= budget  # small fits beside
    worker = _worker(engine, budget, max_rows=8, backfill_s=backfill_s, max_preemptions=4 if backfill_s else 0)
    order = []
    jobs = {}
    for name, (prompt, params) in zip(("running", "large", "small"), (running, large, small)):
        jobs[name] = worker.submit(Job(prompt, params, RowOptions(), _snapshot()))
        jobs[name].future.add_done_callback(lambda _, name=name: order.append(name))
    worker.start()
    results = {name: job.future.result(timeout=600) for name, job in jobs.items()}
    worker.stop()
    joined = {name: results[name].queue_s + jobs[name].admitted_at for name in jobs}
    alone = engine.generate([small[0]], small[1]).rows[0]
    assert results["small"].row.generated_ids == alone.generated_ids
    assert results["large"].row.finish_reason == "length"  # the large one still completes
    if backfill_s is not None:
        assert joined["small"] < joined["large"] and order.index("small") < order.index("large")
        assert results["small"].batch_size == 2  # beside the running one, never beside the large one
    else:
        assert joined["running"] <= joined["large"] <= joined["small"] and order[-1] == "small"


def test_a_new_kv_configuration_is_measured_on_the_worker_thread_not_in_submit(engine):
    """`submit` runs on the event loop: the first request of a quantized configuration is sized when it comes up
    for admission on the worker thread (a request too large fails there, through its future, the same error);
    once measured, the next one is refused in `submit` at once."""
    prompt = four_prompts("llada")[2]
    probe = _worker(engine, 1 << 30)
    small = _cost(probe, prompt, _params(gen_length=32), KIVI2)
    worker = _worker(engine, small.kv + small.transient)
    key = (KIVI2, "dual")
    job = worker.submit(Job(prompt, _params(gen_length=512), RowOptions(), _snapshot(KIVI2)))
    assert not worker.memory.knows(key)  # nothing measured in submit
    worker.start()
    with pytest.raises(RequestTooLarge) as too_long:
        job.future.result(timeout=300)
    assert too_long.value.field == "max_tokens" and worker.memory.knows(key)
    with pytest.raises(RequestTooLarge):
        worker.submit(Job(prompt, _params(gen_length=512), RowOptions(), _snapshot(KIVI2)))
    ok = worker.submit(Job(prompt, _params(gen_length=32), RowOptions(), _snapshot(KIVI2)))
    assert ok.future.result(timeout=300).row.finish_reason == "length"
    worker.stop()


def test_submit_and_cancel_never_wait_for_a_probe_or_a_report(engine):
    """Nothing slow runs under the lock the event loop takes (issue 34): while the worker thread is held inside a
    new configuration's probe, and later inside a finished request's report (each waits for the test's own
    event), `submit` and `cancel` return; a lock held through either would keep them waiting."""
    prompt = four_prompts("llada")[2]
    worker = _worker(engine, 1 << 30)
    in_probe, probe_go, in_report, report_go = (threading.Event() for _ in range(4))
    probe, report = worker.memory._probe, engine.report

    def held_probe(store):
        in_probe.set()
        assert probe_go.wait(300)
        return probe(store)

    def held_report(cohort):
        in_report.set()
        assert report_go.wait(300)
        return report(cohort)

    def submit_and_cancel() -> bool:
        done = threading.Event()

        def call():
            worker.cancel(worker.submit(Job(prompt, _params(gen_length=32), RowOptions(), _snapshot())))
            done.set()

        threading.Thread(target=call, daemon=True).start()
        return done.wait(60)  # a bound on a hang, not a timing: the worker is held until the test lets it go

    worker.memory._probe = held_probe
    worker.engine = types.SimpleNamespace(report=held_report, **{
        name: getattr(engine, name) for name in ("spec", "batch", "cohort", "decode_text", "cache_cost")})
    first = worker.submit(Job(prompt, _params(gen_length=32), RowOptions(), _snapshot(KIVI2)))
    worker.start()
    try:
        assert in_probe.wait(300)
        assert submit_and_cancel(), "submit waited for a probe"
        probe_go.set()
        assert in_report.wait(300)
        assert submit_and_cancel(), "submit waited for a report"
        report_go.set()
        assert first.future.result(timeout=300).row.finish_reason == "length"
    finally:
        probe_go.set()
        report_go.set()
        worker.stop()


def test_the_kv_cache_usage_gauge_is_reserved_bytes_over_the_budget(engine):
    """llm-d's endpoint picker scores replicas by KV-cache use (issue 34): ``dllm_kv_cache_usage_perc`` is the
    running rows' reserved KV bytes over the budget, from 0 to 1, beside the running and waiting gauges (read as
    Prometheus scrapes them, with prometheus-client's parser), and 0 again once the request left."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    def gauges() -> dict[str, float]:
        text = generate_latest(worker.telemetry.registry).decode()
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name in ("dllm_kv_cache_usage_perc", "dllm_requests_running", "dllm_requests_waiting")}

    prompt = four_prompts("llada")[2]
    budget = 1 << 30
    worker = _worker(engine, budget)
    seen: list[dict[str, float]] = []
    job = Job(prompt, _params(gen_length=64), RowOptions(), _snapshot(),
              on_block=lambda block, ids: seen.append(gauges()) if block == 0 else None)
    worker.submit(job)
    worker.start()
    try:
        job.future.result(timeout=300)
        assert seen and 0 < job.cost.kv < budget
        assert seen[0] == {"dllm_kv_cache_usage_perc": job.cost.kv / budget, "dllm_requests_running": 1.0,
                           "dllm_requests_waiting": 0.0}
        assert gauges()["dllm_kv_cache_usage_perc"] == 0.0
    finally:
        worker.stop()
