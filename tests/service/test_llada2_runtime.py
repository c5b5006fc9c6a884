"""LLaDA2 served under the same plan, token budget and preemption as LLaDA and Dream (issue 42 item 3), on the
tiny LLaDA2 checkpoint: its forwards are the plan's groups, each within ``max_batched_tokens`` (a pass alone
may be wider), requests batched under a small budget decode token for token as alone, and a large running
request preempted at a block boundary for a small one resumes token for token (its stream block for block)."""

from __future__ import annotations

import pytest
import torch

from service.engine import Engine
from service.engine.params import DecodeParams, RowOptions
from service.quant.config import KVQuantConfig
from service.quant.store import make_kv_store
from service.runtime.loop import Job, Worker
from service.runtime.memory import MemoryModel
from service.runtime.scheduler import forward_tokens, kv_held
from service.store.active import ConfigSnapshot
from service.telemetry import Telemetry
from tests.support.llada2 import LLADA2_CKPT, llada2_golden
from tests.support.preemption import large_then_small

UNQUANTIZED = KVQuantConfig()
KIVI2 = KVQuantConfig(method="kivi", bits=2, k_group_size=8)


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    return Engine.load(LLADA2_CKPT["llada2"])


def _prompts() -> list[list[int]]:
    """Golden prompts of four lengths (5, 12, 17, 40 tokens)."""
    by_length = {len(r["prompt_ids"]): r["prompt_ids"] for r in llada2_golden("llada2_generate.json")["runs"]}
    return [by_length[n] for n in (5, 12, 17, 40)]


def _worker(engine, budget: int, telemetry: Telemetry, kv_store_factory=lambda snap: None, **kw) -> Worker:
    return Worker(engine, kv_store_factory, telemetry, MemoryModel.for_engine(engine), budget, max_rows=8, **kw)


def _snapshot(mode: str) -> ConfigSnapshot:
    return ConfigSnapshot(UNQUANTIZED, mode, "request")


@pytest.mark.parametrize("split", [0, 24], ids=["whole", "layer-split"])
@pytest.mark.parametrize("mode", ["block", "none"])
def test_batched_under_a_small_token_budget_each_request_decodes_as_alone(engine, mode, split):
    prompts = _prompts()
    params = [DecodeParams(gen_length=64, block_length=32, threshold=0.9, cache_mode=mode),
              DecodeParams(gen_length=32, block_length=16, steps=8, cache_mode=mode)]
    jobs = [Job(p, params[i % 2], RowOptions(temperature=0.5 * (i == 3), seed=3), _snapshot(mode))
            for i, p in enumerate(prompts)]
    alone = [engine.generate([j.prompt_ids], j.params, [j.row]).rows[0].generated_ids for j in jobs]
    budget_tokens = 96  # below two block-initial passes together: the plan makes several forwards
    worker = _worker(engine, 1 << 30, Telemetry(), max_batched_tokens=budget_tokens, layer_split_tokens=split)
    planned: list[list[int]] = []
    pieces: list[tuple[int, int]] = []
    plan = worker._plan

    def spy(passes):
        forwards = plan(passes)
        planned.append([forward_tokens(group) for group in forwards if len(group) > 1])
        pieces.extend(group[0].layers for group in forwards if group[0].layers is not None)
        return forwards

    worker._plan = spy
    for job in jobs:
        worker.submit(job)
    worker.start()
    served = [j.future.result(timeout=300).row.generated_ids for j in jobs]
    worker.stop()
    assert served == alone
    assert max(len(p) for p in planned) >= 1  # requests did share forwards
    assert all(tokens <= budget_tokens for forwards in planned for tokens in forwards)  # merged ones in budget
    layers = engine.spec.num_layers
    assert bool(pieces) == bool(split)  # block-initial passes ran piece by piece, first and last pieces among them
    if split:
        assert any(a == 0 and b < layers for a, b in pieces) and any(a > 0 and b == layers for a, b in pieces)


def _run(engine, mode: str, n: int, temperature: float, max_preemptions: int):
    """The large request alone in the budget; the small one submitted when the large one commits its first block
    (as tests/service/test_preemption.py does for LLaDA and Dream)."""
    prompts = _prompts()
    large_params = DecodeParams(gen_length=96, block_length=32, threshold=0.9, cache_mode=mode)
    small_params = DecodeParams(gen_length=32, block_length=32, threshold=0.9, cache_mode="block")
    rows = [RowOptions(temperature=temperature, seed=7 + i) for i in range(n)]
    telemetry = Telemetry()
    probe = _worker(engine, 1 << 30, telemetry)
    large = Job(prompts[3] * 3, large_params, rows[0], _snapshot(mode), more_rows=tuple(rows[1:]))
    small = Job(prompts[0], small_params, RowOptions(), _snapshot("block"))
    large_cost, small_cost = probe._cost(large), probe._cost(small)
    budget = kv_held([large_cost]) + large_cost.transient  # the large one fits alone, the small one not beside it
    assert kv_held([small_cost]) + small_cost.transient <= budget
    assert kv_held([large_cost]) + large_cost.transient > kv_held([small_cost]) + small_cost.transient
    worker = _worker(engine, budget, telemetry, max_preemptions=max_preemptions)
    large_result, small_result, blocks, order = large_then_small(worker, large, small)
    return large_result, small_result, blocks, large, order


@pytest.mark.parametrize(("mode", "n", "temperature"), [("block", 1, 0.0), ("none", 1, 0.0), ("block", 2, 0.7)])
def test_a_preempted_llada2_request_decodes_and_streams_as_without_preemption(engine, mode, n, temperature):
    large, small, blocks, job, order = _run(engine, mode, n, temperature, max_preemptions=4)
    without = _run(engine, mode, n, temperature, max_preemptions=0)
    assert job.preemptions == 1
    assert order == ["small", "large"] and without[4] == ["large", "small"]
    assert [r.generated_ids for r in large.report.rows] == [r.generated_ids for r in without[0].report.rows]
    assert [r.nfe for r in large.report.rows] == [r.nfe for r in without[0].report.rows]
    assert blocks == without[2]
    assert small.row.generated_ids == without[1].row.generated_ids


@pytest.mark.parametrize("quantized", [False, True], ids=["full-precision", "kivi-packed-beside-full"])
def test_the_caches_llada2_holds_stay_within_the_budget_admission_counts(engine, quantized):
    """Issue 42 (a): admission counts what a LLaDA2 batch really holds (`BlockCausalDecoder.cache_cost`): slots as
    wide as twice the batch's longest row, and a regroup's copy. Under a budget that fits three of these requests
    by that count, a run of mixed requests (lengths, blocks, cache modes, joining and leaving, regrouped by a small
    token budget) never holds more cache bytes than the budget leaves beside its forward reserve, several run at
    once, and each decodes as alone. Before, admission counted a row's own ``seq_len + 1`` columns: this budget
    admitted all eight at once and their caches held up to 1.6 times what it leaves beside the reserve. With
    ``quantized``, every other ``block`` request packs its committed blocks (KIVI 2-bit): caches then hold packed
    rows' scratch beside full-precision rows' slots, and the packed blocks count in the budget too (asserted on
    the caches, which are what the test measures)."""
    prompts = _prompts()
    params = [DecodeParams(gen_length=64, block_length=32, threshold=0.9, cache_mode="block"),
              DecodeParams(gen_length=32, block_length=16, steps=8, cache_mode="block"),
              DecodeParams(gen_length=32, block_length=32, threshold=0.9, cache_mode="none")]
    packs = [quantized and i % 2 == 0 and params[i % 3].cache_mode == "block" for i in range(8)]
    jobs = [Job(prompts[i % 4] * (1 + i % 3), params[i % 3], RowOptions(),
                ConfigSnapshot(KIVI2 if packs[i] else UNQUANTIZED, params[i % 3].cache_mode, "request"))
            for i in range(8)]
    stores = (lambda snap: make_kv_store(snap.config, engine.spec)) if quantized else (lambda snap: None)
    alone = [engine.generate([j.prompt_ids], j.params, [j.row], kv_store=stores(j.snapshot)).rows[0].generated_ids
             for j in jobs]
    probe = _worker(engine, 1 << 30, Telemetry(), kv_store_factory=stores)
    costs = [probe._cost(j) for j in jobs]
    largest = sorted(costs, key=lambda c: kv_held([c]) + c.transient)[-3:]
    budget = kv_held(largest) + max(c.transient for c in costs)  # any three fit together
    worker = _worker(engine, budget, Telemetry(), max_batched_tokens=96, kv_store_factory=stores)
    running: list[int] = []
    plan = worker._plan

    def spy(passes):
        running.append(worker.num_running)
        return plan(passes)

    worker._plan = spy
    for job in jobs:
        worker.submit(job)
    worker.start()
    served = [j.future.result(timeout=300).row.generated_ids for j in jobs]
    peak = worker._batch.peak_bytes
    worker.stop()
    assert served == alone
    assert max(running) >= 3  # not a test of one request at a time
    reserve = max(c.transient for c in costs)
    assert 0 < peak <= budget - reserve
