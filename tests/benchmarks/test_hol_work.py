"""`benchmarks/hol_work.py` counts the work a short request waits on beside a long one: with the head-of-line rule
(`service.runtime.scheduler.first_passes_first`) it waits on its own forwards only, without it on the long one's
too, and its tokens are those it decodes alone either way; the layer split halves the forward it can arrive
into."""

from __future__ import annotations

import pytest
import torch

from benchmarks import hol_work
from service.engine import Engine


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    return Engine.load(None, threads=1)


def test_with_the_rule_a_short_request_waits_on_its_own_work_only(engine):
    ids = hol_work.prompt_ids(engine)
    forwards, work, alone = hol_work.alone_counts(engine, ids)
    without, _, _ = hol_work.run(engine, ids, 7, rule=False)
    with_rule, _, _ = hol_work.run(engine, ids, 7, rule=True)
    assert without and with_rule
    assert all(tokens == alone for _, _, tokens in [*without, *with_rule])
    assert max(f for f, _, _ in without) > forwards and max(w for _, w, _ in without) > work
    assert all((f, w) == (forwards, work) for f, w, _ in with_rule)


def test_the_layer_split_halves_the_largest_forward_a_request_can_arrive_into(engine):
    """With the long request's 556-token block-initial passes split at 512 tokens (two pieces of the embedded
    model's 4 layers), the largest forward it runs alone is half the unsplit one; the short requests still wait on
    their own work only and decode as alone, and the long one's pieces cost it iterations."""
    ids = hol_work.prompt_ids(engine)
    forwards, work, alone = hol_work.alone_counts(engine, ids)
    _, iterations, largest = hol_work.run(engine, ids, 7, rule=True)
    split, split_iterations, split_largest = hol_work.run(engine, ids, 7, rule=True, split=512)
    assert split and all(tokens == alone for _, _, tokens in split)
    assert all((f, w) == (forwards, work) for f, w, _ in split)
    assert split_largest == largest / 2 and largest > work
    assert split_iterations > iterations


def test_the_likelihood_counts_at_both_shapes_hold_the_largest_call_to_one_piece(engine):
    """`benchmarks/hol_work.py --likelihood` counts, from the plans' rules, the largest likelihood call of a
    2,200-token request over a short request's arithmetic (issue 45): before, a whole 5-row forward; now, one
    piece, a part of one layer of one row on the embedded model (a whole layer, attention counted, is 2,093 tokens'
    worth there) and of one layer of 7 rows at the LLaDA-8B shape (521), within the split's 512 tokens' worth
    (one token's worth: a token through every layer's projections and MLP)."""
    from service.engine.forward_cost import ForwardCost

    for cost, layers in ((ForwardCost.of(engine.model), engine.spec.num_layers),
                         (ForwardCost.dense(4096, 12288, 32, 128, 126464, 2), 32)):
        _, before, now = hol_work.shape_counts(cost, layers, 512, 1)
        token = cost.flops(1, 1, 0) * layers  # a token's worth
        assert before == layers * cost.flops(5, 2200, 2200)
        assert 400 * token < now <= 512 * token  # the largest piece about fills the split, never more
        layer = (1 if layers == 4 else 7) * cost.flops(1, 2200, 2200)  # one layer of the forward's rows
        assert now < layer < 1.25 * now * (4 if layers == 4 else 1)
