"""Likelihood as planned rows (issue 34): a prompt's per-token values (`service.engine.likelihood.PromptLikelihood`)
with its context splits packed as rows of a few forwards give the values of one forward per batch, within 1e-6,
and a 109-token ``echo`` + ``logprobs`` request takes at most 4 forwards at the default token budget."""

from __future__ import annotations

import pytest
import torch

from service.engine import Engine
from service.runtime.scheduler import DEFAULT_MAX_BATCHED_TOKENS

MC = 4  # the HTTP tests' DLLM_LIKELIHOOD_MC_NUM and _MC_BATCH_SIZE (tests/api/test_likelihood_http.py)


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    return Engine.load(None, threads=1)


def _prompt(engine, length: int) -> list[int]:
    ids = engine.tokenizer("copy: 3 1 4 1 5 9 2 6 5 3 5 8 9 7 9 3 2 3 8 4 6 2 6 4 3 3 8 3 2 7 9 5")["input_ids"]
    return (ids * (length // len(ids) + 1))[:length]


def test_splits_packed_as_rows_give_the_values_of_one_forward_per_batch_in_at_most_4_forwards(engine):
    ids = _prompt(engine, 109)
    alone = engine.likelihood(ids, MC, MC, 1234, top_k=2)
    while alone.step():
        pass
    packed = engine.likelihood(ids, MC, MC, 1234, top_k=2)
    while packed.step(DEFAULT_MAX_BATCHED_TOKENS // len(ids)):
        pass
    assert alone.forwards == (len(ids) - 1) + -(-(len(ids) - 1) // MC)  # 108 splits + 27 batches of alternatives
    assert packed.forwards <= 4
    for a, b in zip(alone.scores(), packed.scores(), strict=True):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-6)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-6)
