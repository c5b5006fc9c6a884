"""Likelihood as planned rows (issue 34): a prompt's per-token values (`service.engine.likelihood.PromptLikelihood`)
with its context splits packed as rows of a few forwards give the values of one forward per batch, within 1e-6,
and a 109-token ``echo`` + ``logprobs`` request takes at most 4 forwards at the default token budget, also under
the server's memory reserve for one forward (its LM head one batch of rows at a time)."""

from __future__ import annotations

import pytest
import torch

from service.engine import Engine
from service.engine.likelihood import mc_loglikelihood
from service.runtime.memory import MemoryModel
from service.runtime.scheduler import DEFAULT_MAX_BATCHED_TOKENS

MC = 4  # the HTTP tests' DLLM_LIKELIHOOD_MC_NUM and _MC_BATCH_SIZE (tests/api/test_likelihood_http.py)


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    return Engine.load(None, threads=1)


def _prompt(engine, length: int) -> list[int]:
    ids = engine.tokenizer("copy: 3 1 4 1 5 9 2 6 5 3 5 8 9 7 9 3 2 3 8 4 6 2 6 4 3 3 8 3 2 7 9 5")["input_ids"]
    return (ids * (length // len(ids) + 1))[:length]


@pytest.mark.parametrize("reserve", [False, True], ids=["token-budget", "server-memory-reserve"])
def test_splits_packed_as_rows_give_the_values_of_one_forward_per_batch_in_at_most_4_forwards(engine, reserve):
    ids = _prompt(engine, 109)
    alone = engine.likelihood(ids, MC, MC, 1234, top_k=2)
    while alone.step():
        pass
    # The server's bound (service.runtime.loop.Worker._step_tasks): the forward reserve at the default budget.
    memory = MemoryModel.for_engine(engine)
    max_bytes = memory.measure_forward(engine, DEFAULT_MAX_BATCHED_TOKENS) if reserve else None
    packed = engine.likelihood(ids, MC, MC, 1234, top_k=2)
    while packed.step(DEFAULT_MAX_BATCHED_TOKENS // len(ids), max_bytes):
        assert max_bytes is None or packed.last_rows == MC or packed.bytes(packed.last_rows) <= max_bytes
    assert alone.forwards == (len(ids) - 1) + -(-(len(ids) - 1) // MC)  # 108 splits + 27 batches of alternatives
    assert packed.forwards <= 4
    for a, b in zip(alone.scores(), packed.scores(), strict=True):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-6)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-6)


def test_values_match_the_in_process_estimate_with_logits_at_every_column(engine):
    """The LM head one batch at a time changes no value: a split's tail sum is the in-process estimate
    (`mc_loglikelihood`, the model's call with logits at every column) within 1e-6."""
    ids = _prompt(engine, 40)
    work = engine.likelihood(ids, MC, MC, 1234)
    while work.step(DEFAULT_MAX_BATCHED_TOKENS // len(ids)):
        pass
    values = [v.logprob for v in work.scores()]  # tokens 1..T-1
    for c in (1, 17, 39):
        expected = mc_loglikelihood(lambda x: engine.model(x), ids[:c], ids[c:], mask_id=engine.spec.mask_id,
                                    mc_num=MC, mc_batch_size=MC, seed=1234)
        assert sum(values[c - 1:]) == pytest.approx(expected, abs=1e-6)


def test_the_server_runs_the_109_token_request_in_at_most_4_forwards_with_the_same_values(engine):
    """In the server (`service.runtime.loop.Worker._step_tasks`: the default token budget and the memory reserved
    for one forward at it) the request takes at most 4 forwards (5 while a row was counted with logits at every
    column), with the values of one forward per batch."""
    from service.engine.likelihood import LikelihoodTask
    from service.engine.params import DecodeParams, RowOptions
    from service.quant.config import KVQuantConfig
    from service.runtime.loop import Job, Worker
    from service.store.active import ConfigSnapshot
    from service.telemetry import Telemetry

    ids = _prompt(engine, 109)
    memory = MemoryModel.for_engine(engine)
    worker = Worker(engine, lambda snap: None, Telemetry(), memory, 1 << 30,
                    forward_bytes=memory.measure_forward(engine, DEFAULT_MAX_BATCHED_TOKENS))
    params = DecodeParams(gen_length=1, block_length=1, cache_mode="none", threshold=None, steps=1)
    job = Job(ids, params, RowOptions(), ConfigSnapshot(KVQuantConfig(), "none", "default"),
              task=LikelihoodTask(tuple(ids), MC, MC, 1234, 2))
    worker.submit(job)
    worker.start()
    try:
        served = job.future.result(timeout=600)
    finally:
        worker.stop()
    assert job.cohort.forwards <= 4
    alone = engine.likelihood(ids, MC, MC, 1234, top_k=2)
    while alone.step():
        pass
    for a, b in zip(alone.scores(), served, strict=True):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-6)
        assert a.top == b.top or [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-6)


@pytest.mark.parametrize("rows", [MC, 2], ids=["whole-batches", "batches-cut-in-two"])
def test_a_forward_run_in_layer_pieces_gives_the_values_of_the_same_forward_run_whole_bit_for_bit(engine, rows):
    """The server's plan of likelihood work (issue 45 items 7-8, `service.runtime.scheduler.likelihood_layers`): each
    forward of ``rows`` rows runs a piece of its layers per call, its hidden states kept between calls, and a batch
    larger than ``rows`` is cut over several forwards (its LM head once all its rows are through). The values are
    those of the same forwards run whole, bit for bit (a piece runs the same operations on the same inputs), and
    those of one forward per batch within 1e-6."""
    from service.runtime.scheduler import likelihood_layers

    ids = _prompt(engine, 40)
    whole = engine.likelihood(ids, MC, MC, 1234, top_k=2)
    while whole.step(rows):
        pass
    pieces = engine.likelihood(ids, MC, MC, 1234, top_k=2)
    layers = engine.spec.num_layers
    while (call := pieces.next_call(rows)) is not None:
        # 10 tokens' worth a piece: one layer per call (a forward holds 40 tokens or more)
        assert pieces.step(rows, layers=likelihood_layers(call.rows * len(ids), call.start, 10, layers))
    assert not pieces.step(rows)
    assert pieces.calls == layers * whole.forwards and pieces.forwards == whole.forwards
    assert pieces.work == pytest.approx(whole.work)
    assert [(v.token, v.logprob, v.top) for v in pieces.scores()] == [(v.token, v.logprob, v.top)
                                                                      for v in whole.scores()]
    alone = engine.likelihood(ids, MC, MC, 1234, top_k=2)
    while alone.step():
        pass
    for a, b in zip(alone.scores(), pieces.scores(), strict=True):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-6)
