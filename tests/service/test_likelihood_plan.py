"""Likelihood work in the iteration's plan (issue 45 items 7-8): a likelihood task's forwards have rows fixed for
the task (`service.runtime.scheduler.likelihood_rows`) and run piece by piece of their layers under the same
split and head-of-line rule as decoding passes (`likelihood_layers`, `first_passes_first`), the tasks taking turns
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
from service.engine.likelihood import LikelihoodTask
from service.engine.params import DecodeParams, RowOptions
from service.quant.config import KVQuantConfig
from service.runtime.loop import Job, Worker
from service.runtime.memory import MemoryModel
from service.runtime.scheduler import (
    DEFAULT_MAX_BATCHED_TOKENS,
    likelihood_layers,
    likelihood_rows,
    piece_work,
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
def test_a_likelihood_forward_holds_about_one_piece_per_layer_and_the_tasks_take_turns():
    # 4 layers, pieces of 512 tokens' worth: a 2,200-token prompt runs one row a forward, one layer a piece
    assert likelihood_rows(2200, DEFAULT_MAX_BATCHED_TOKENS, SPLIT, 4) == 1
    assert likelihood_layers(2200, 0, SPLIT, 4) == (0, 1) and likelihood_layers(2200, 3, SPLIT, 4) == (3, 4)
    assert piece_work(2200, (0, 1), 4) == 550
    # a 109-token one: 18 rows (1,962 tokens, four pieces of ~490); without a split, the whole token budget
    assert likelihood_rows(109, DEFAULT_MAX_BATCHED_TOKENS, SPLIT, 4) == 18
    assert likelihood_rows(109, DEFAULT_MAX_BATCHED_TOKENS, 0, 4) == DEFAULT_MAX_BATCHED_TOKENS // 109
    # deep models: the split's bound is the token budget itself (32 layers x 512 = 16,384): 7 rows of 2,200
    # tokens, one layer a piece (481 tokens' worth; not 16 pieces of two layers, 962, as equal pieces would be)
    assert likelihood_rows(109, DEFAULT_MAX_BATCHED_TOKENS, SPLIT, 32) == DEFAULT_MAX_BATCHED_TOKENS // 109
    assert likelihood_rows(2200, DEFAULT_MAX_BATCHED_TOKENS, SPLIT, 32) == 7
    assert likelihood_layers(7 * 2200, 5, SPLIT, 32) == (5, 6)
    assert likelihood_layers(1962, 0, SPLIT, 4) == (0, 1) and likelihood_layers(600, 0, SPLIT, 4) == (0, 3)
    assert likelihood_layers(512, 0, SPLIT, 4) is None and likelihood_layers(600, 0, 0, 4) is None
    # turns: the first always runs, the others while the allowance lasts
    assert take_turns([550, 550, 550, 550], SPLIT) == [0]
    assert take_turns([200, 550, 200], SPLIT) == [0, 2]
    assert take_turns([0, 550], SPLIT) == [0, 1]  # a finished task's turn (no call) costs nothing


# ---- served: what a small request waits on beside 2,200-token likelihood requests (item 8) ----------------------
@pytest.mark.parametrize("tasks", [1, 4])
def test_a_small_request_beside_2200_token_likelihoods_waits_on_one_piece_per_forward_of_its_own(engine, tasks):
    """The reproduction of item 8 (2,200-token prompts, ``mc_num`` 5, ``logprobs`` 5) in counts: while a 32-token
    request is in the server, the likelihood work that runs is at most one piece (one row of one layer: 550
    tokens' worth) per forward of the small request (the one in flight when it arrived; none beside its first
    pass, which the head-of-line rule runs alone), whether one or four likelihood requests run. Before issue 45
    each iteration ran every task's whole forward of a batch (5 rows x 2,200 tokens x 4 layers: 11,000 tokens'
    worth, 20 pieces). The small request decodes as alone; the likelihood calls are in
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
    piece = piece_work(2200, (0, 1), engine.spec.num_layers)
    assert calls - calls_before <= result.row.nfe
    assert work - sum(before) <= result.row.nfe * piece
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
