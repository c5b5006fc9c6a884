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


@pytest.mark.parametrize("split", [150, 10, 1], ids=["layers", "parts-of-a-layer", "smallest-parts"])
@pytest.mark.parametrize("rows", [MC, 2], ids=["whole-batches", "batches-cut-in-two"])
def test_a_forward_run_in_pieces_gives_the_values_of_the_same_forward_run_whole_bit_for_bit(engine, rows, split):
    """The server's plan of likelihood work (issue 45 items 7-8, `service.runtime.scheduler.likelihood_piece`): each
    forward of ``rows`` rows runs a piece per call, its hidden states (and in a layer begun its q/k/v) kept between
    calls, and a batch larger than ``rows`` is cut over several forwards (its LM head once all its rows are
    through). Pieces of whole layers (``split`` 150 tokens' worth) or of parts of a layer (10: a row's projections,
    stretches of 32 query columns; 1: the smallest, one stretch a call) give the values of the same forwards run
    whole, bit for bit, and those of one forward per batch within 1e-6. The prompt (97 tokens) is no multiple of
    32, so a row's last stretch is longer."""
    from service.engine.forward_cost import likelihood_work
    from service.runtime.scheduler import likelihood_piece

    ids = _prompt(engine, 97)
    whole = engine.likelihood(ids, MC, MC, 1234, top_k=2)
    while whole.step(rows):
        pass
    pieces = engine.likelihood(ids, MC, MC, 1234, top_k=2)
    layers, largest = engine.spec.num_layers, 0.0
    while (call := pieces.next_call(rows)) is not None:
        piece = likelihood_piece(call.rows, len(ids), call.at, split, layers, pieces.stages)
        largest = max(largest, likelihood_work(call.rows * len(ids), piece, pieces.stages))
        assert pieces.step(rows, units=piece)
    assert not pieces.step(rows)
    per_forward = 2 * rows * len(ids) * layers  # units of a forward
    if split == 150:
        layer = rows * len(ids) * (pieces.stages.project + pieces.stages.rest)  # a layer's tokens' worth
        assert pieces.calls == whole.forwards * -(-layers // int(split // layer)) and largest <= split
    else:
        assert pieces.calls > 2 * layers * whole.forwards and largest <= max(split, 32 * pieces.stages.rest * 2)
    assert pieces.forwards == whole.forwards and per_forward > 0
    assert pieces.work == pytest.approx(whole.work)
    assert [(v.token, v.logprob, v.top) for v in pieces.scores()] == [(v.token, v.logprob, v.top)
                                                                      for v in whole.scores()]
    alone = engine.likelihood(ids, MC, MC, 1234, top_k=2)
    while alone.step():
        pass
    for a, b in zip(alone.scores(), pieces.scores(), strict=True):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-6)


def test_the_parts_of_a_layer_give_its_output_bit_for_bit_at_2200_columns(engine):
    """At the issue's prompt length (2,200 columns, two rows): a layer run as its parts the way the plan cuts it
    (every row's projections, then query stretches of multiples of 32 columns, a row's last one to its end) gives
    the layer's output of the model's forward bit for bit."""
    from service.runtime.scheduler import CHUNK_COLUMNS

    model, t = engine.model, 2200
    ids = torch.tensor([_prompt(engine, t), _prompt(engine, t + 7)[7:]])
    with torch.inference_mode():
        x = model(ids, head=False, layers=(0, 0))
        expected = model(ids, head=False, layers=(0, 1), hidden=x)
        cos, sin = model.rope_columns(t, x.device)
        q, k, v = (torch.cat(parts) for parts in zip(*(model.project_layer(0, x[r:r + 1], cos, sin)
                                                       for r in range(2)), strict=True))
        out = x.clone()
        for r, size in ((0, 544), (1, 416)):
            c0 = 0
            while c0 < t:
                c1 = c0 + size if t - (c0 + size) >= CHUNK_COLUMNS else t
                out[r:r + 1, c0:c1] = model.finish_layer(0, x[r:r + 1, c0:c1], q[r:r + 1, :, c0:c1], k[r:r + 1],
                                                         v[r:r + 1])
                c0 = c1
    assert torch.equal(out, expected)
