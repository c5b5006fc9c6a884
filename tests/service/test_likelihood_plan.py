"""Likelihood work in the iteration's plan (issue 45 items 7-8): a likelihood task's forwards have rows fixed for
the task (`service.runtime.scheduler.likelihood_rows`) and run piece by piece of their layers under the same
split and head-of-line rule as decoding passes (`likelihood_piece`: layers, or parts of a layer when one is over
the split; `first_passes_first`), the tasks taking turns
within one piece's allowance (`take_turns`). Counted, never timed: the likelihood work a small decoding request
waits on beside one or four 2,200-token likelihood requests (the reproduction of item 8), the calls counted in
``dllm_forwards_per_iteration``, and the values served beside decoding equal, bit for bit, to the same forwards
run alone."""

from __future__ import annotations

import time

import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from service.engine import Engine
from service.engine.forward_cost import ForwardCost, likelihood_work
from service.engine.likelihood import LikelihoodTask
from service.engine.params import DecodeParams, RowOptions
from service.quant.config import KVQuantConfig
from service.runtime.loop import Job, Worker
from service.runtime.memory import MemoryModel
from service.runtime.scheduler import (
    DEFAULT_MAX_BATCHED_TOKENS,
    likelihood_piece,
    likelihood_rows,
    take_turns,
)
from service.store.active import ConfigSnapshot
from service.telemetry import Telemetry

SPLIT = 512  # DLLM_LAYER_SPLIT_TOKENS' default
SNAPSHOT = ConfigSnapshot(KVQuantConfig(), "none", "default")
SMALL = DecodeParams(gen_length=32, block_length=32, threshold=0.9, ignore_eos=True, cache_mode="dual")


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    return Engine.load(None, threads=1)


def _ids(engine, length: int) -> list[int]:
    ids = engine.tokenizer("copy: 3 1 4 1 5 9 2 6 5 3 5 8 9 7 9 3 2 3 8 4 6 2 6 4")["input_ids"]
    return (ids * (length // len(ids) + 1))[:length]


def _likelihood(ids: list[int], mc_num: int, top_k: int) -> Job:
    params = DecodeParams(gen_length=1, block_length=1, cache_mode="none", threshold=None, steps=1)
    return Job(ids, params, RowOptions(), SNAPSHOT, task=LikelihoodTask(tuple(ids), mc_num, mc_num, 1234, top_k))


def _worker(engine, telemetry: Telemetry) -> Worker:
    memory = MemoryModel.for_engine(engine)
    return Worker(engine, lambda snap: None, telemetry, memory, 1 << 32, max_rows=8,
                  forward_bytes=memory.measure_forward(engine, DEFAULT_MAX_BATCHED_TOKENS), layer_split_tokens=SPLIT)


def _until(check) -> None:
    for _ in range(6000):  # a hang bound, not a time bar
        if check():
            return
        time.sleep(0.01)
    raise AssertionError("the worker never got there")


def _histogram_sum(telemetry: Telemetry, name: str) -> float:
    text = generate_latest(telemetry.registry).decode()
    family = next(f for f in text_string_to_metric_families(text) if f.name == name)
    return next(s.value for s in family.samples if s.name == f"{name}_sum")


# ---- the rule's arithmetic --------------------------------------------------------------------------------------
def _pieces(rows: int, width: int, layers: int, stages) -> list[tuple[int, int]]:
    """Every piece of one forward (`likelihood_piece`, in turn)."""
    at, end, pieces = 0, 2 * rows * width * layers, []
    while at < end:
        piece = likelihood_piece(rows, width, at, SPLIT, layers, stages) or (at, end)
        pieces.append(piece)
        at = piece[1]
    return pieces


def test_a_likelihood_forward_runs_in_pieces_within_the_split_and_the_tasks_take_turns(engine):
    # 4 layers, pieces of 512 tokens' worth: a 2,200-token prompt runs one row a forward
    assert likelihood_rows(2200, DEFAULT_MAX_BATCHED_TOKENS, SPLIT, 4) == 1
    # a 109-token one: 18 rows (1,962 tokens); without a split, the whole token budget
    assert likelihood_rows(109, DEFAULT_MAX_BATCHED_TOKENS, SPLIT, 4) == 18
    assert likelihood_rows(109, DEFAULT_MAX_BATCHED_TOKENS, 0, 4) == DEFAULT_MAX_BATCHED_TOKENS // 109
    # deep models: the split's bound is the token budget itself (32 layers x 512 = 16,384): 7 rows of 2,200
    assert likelihood_rows(109, DEFAULT_MAX_BATCHED_TOKENS, SPLIT, 32) == DEFAULT_MAX_BATCHED_TOKENS // 109
    assert likelihood_rows(2200, DEFAULT_MAX_BATCHED_TOKENS, SPLIT, 32) == 7
    # One layer of the 2,200-token row is 2,093 tokens' worth on the embedded model (its attention over 2,200 keys
    # outweighs its projections and MLP 3.8 to 1): it runs in 5 pieces, the row's projections and 416 query
    # columns, then stretches of 544 (17 x 32), the last to the row's end. Every piece is within the split and the
    # pieces cover the forward, none across a layer's end.
    cost = ForwardCost.of(engine.model)
    stages = cost.layer_stages(2200, 4)
    assert 2093 < 2200 * (stages.project + stages.rest) < 2094
    pieces = _pieces(1, 2200, 4, stages)
    assert pieces[:3] == [(0, 2200 + 416), (2616, 2616 + 544), (3160, 3704)] and len(pieces) == 20
    assert all(likelihood_work(2200, p, stages) <= SPLIT for p in pieces)
    assert all(a // 4400 == (b - 1) // 4400 for a, b in pieces)
    assert [b for _, b in pieces[:-1]] == [a for a, _ in pieces[1:]] and pieces[-1][1] == 4 * 4400
    # the query stretches are multiples of 32 columns, a row's last one at least 32
    for a, b in pieces:
        start, stop = max(a % 4400, 2200) - 2200, b % 4400 - 2200 if b % 4400 else 2200
        assert (stop - start) % 32 == 0 or (stop == 2200 and stop - start >= 32)
    # a forward whose layer fits runs whole layers (the layer split of decoding passes); a small one is not split
    short = cost.layer_stages(109, 4)
    assert _pieces(8, 109, 4, short) == [(0, 2 * 1744), (2 * 1744, 4 * 1744)]  # 2 layers of 248 tokens' worth
    assert likelihood_piece(4, 109, 0, SPLIT, 4, short) is None and likelihood_piece(18, 109, 0, 0, 4, short) is None
    # at LLaDA-8B's shape (32 layers, width 4096) 7 rows of 2,200 tokens: a layer is 521 tokens' worth, so parts
    llada8b = ForwardCost.dense(4096, 12288, 32, 128, 126464, 2).layer_stages(2200, 32)
    assert all(likelihood_work(7 * 2200, p, llada8b) <= SPLIT for p in _pieces(7, 2200, 32, llada8b))
    # turns: the first always runs, the others while the allowance lasts
    assert take_turns([550, 550, 550, 550], SPLIT) == [0]
    assert take_turns([200, 550, 200], SPLIT) == [0, 2]
    assert take_turns([0, 550], SPLIT) == [0, 1]  # a finished task's turn (no call) costs nothing


# ---- served: what a small request waits on beside 2,200-token likelihood requests (item 8) ----------------------
@pytest.mark.parametrize("tasks", [1, 4])
def test_a_small_request_beside_2200_token_likelihoods_waits_on_one_piece_per_forward_of_its_own(engine, tasks):
    """The reproduction of item 8 (2,200-token prompts, ``mc_num`` 5, ``logprobs`` 5) in counts: while a 32-token
    request is in the server, the likelihood work that runs is at most one piece (at most 512 tokens' worth, its
    attention counted: a part of one layer of one row) per forward of the small request (the one in flight when
    it arrived; none beside its first pass, which the head-of-line rule runs alone), whether one or four
    likelihood requests run. Before issue 45 each iteration ran every task's whole forward of a batch (5 rows x
    2,200 tokens x 4 layers: 41,800 tokens' worth with its attention, 80 pieces); before the parts of a layer a
    piece was a whole layer of the row (2,093). The small request decodes as alone; the likelihood calls are in
    ``dllm_forwards_per_iteration``."""
    telemetry = Telemetry()
    worker = _worker(engine, telemetry)
    likelihoods = [_likelihood(_ids(engine, 2200)[i:] + _ids(engine, i), 5, 5) for i in range(tasks)]
    small = Job(_ids(engine, 100), SMALL, RowOptions(), ConfigSnapshot(KVQuantConfig(), "dual", "request"))
    for job in likelihoods:
        worker.submit(job)
    worker.start()
    try:
        _until(lambda: all(j.cohort is not None and j.cohort.calls >= 1 for j in likelihoods))
        done: list[tuple[float, int]] = []
        small.future.add_done_callback(  # on the worker thread, as the small request leaves
            lambda _: done.append((sum(j.cohort.work for j in likelihoods), sum(j.cohort.calls for j in likelihoods))))
        worker.submit(small)
        # Read just after it arrives: a piece that ends in between is left out, which can only make the counts
        # below smaller than they are (a piece lasts far longer than these two statements).
        before = [j.cohort.work for j in likelihoods]
        calls_before = sum(j.cohort.calls for j in likelihoods)
        result = small.future.result(timeout=600)
        for job in likelihoods:
            job.cancel()
    finally:
        worker.stop()
    work, calls = done[0]
    assert calls - calls_before <= result.row.nfe
    assert work - sum(before) <= result.row.nfe * SPLIT  # one piece (at most SPLIT tokens' worth) an iteration
    assert result.row.generated_ids == engine.generate([_ids(engine, 100)], SMALL).rows[0].generated_ids
    assert _histogram_sum(telemetry, "dllm_forwards_per_iteration") >= sum(j.cohort.calls for j in likelihoods)


def test_values_served_in_pieces_beside_decoding_equal_the_same_forwards_run_whole_alone_bit_for_bit(engine):
    """A likelihood served with the layer split, beside decoding requests that join and leave (so its calls wait,
    take turns and run in pieces), returns the values of the same forwards (the same rows each,
    `likelihood_rows`) run whole and alone, bit for bit: a piece runs the same operations on the same inputs."""
    ids = _ids(engine, 20)  # batches of 128 rows; 102 rows a forward (2,040 tokens: four pieces), batches cut
    job = _likelihood(ids, 128, 2)
    worker = _worker(engine, Telemetry())
    smalls = [Job(_ids(engine, 40 + 10 * i), SMALL, RowOptions(), ConfigSnapshot(KVQuantConfig(), "dual", "request"))
              for i in range(3)]
    worker.submit(job)
    worker.start()
    try:
        _until(lambda: job.cohort is not None and job.cohort.calls >= 1)
        for small in smalls:
            worker.submit(small)
            small.future.result(timeout=600)
        served = job.future.result(timeout=600)
    finally:
        worker.stop()
    rows = likelihood_rows(len(ids), DEFAULT_MAX_BATCHED_TOKENS, SPLIT, engine.spec.num_layers)
    assert rows == 102 and job.cohort.calls > job.cohort.forwards  # it ran in pieces
    alone = engine.likelihood(ids, 128, 128, 1234, top_k=2)
    while alone.step(rows):
        pass
    assert [(v.token, v.logprob, v.top) for v in served] == [(v.token, v.logprob, v.top) for v in alone.scores()]
