"""The Monte-Carlo masked log-likelihood against values computed by hand on a position-wise toy model."""

import math

import pytest
import torch

from evaluation.likelihood import greedy_check, mc_loglikelihood

V, MASK = 6, 5


def _independent_model(table):
    """logits[:, i] = log table[i] whatever the input: a model whose positions are independent."""
    logp = torch.log(torch.tensor(table, dtype=torch.float32))

    def logits_fn(ids):
        return logp[: ids.shape[1]].unsqueeze(0).expand(ids.shape[0], -1, -1).clone()

    return logits_fn


def test_equal_per_token_loss_gives_the_exact_value_for_every_sample():
    # Every continuation token has probability 0.5: each sample is L/l * l * log 2 = L log 2 exactly.
    table = [[0.5, 0.1, 0.1, 0.1, 0.1, 0.1]] * 2 + [[0.5, 0.5, 0.0, 0.0, 0.0, 0.0]] * 3
    table = [[p if p > 0 else 1e-9 for p in row] for row in table]
    value = mc_loglikelihood(_independent_model(table), [0, 0], [1, 0, 1], mask_id=MASK, mc_num=8, mc_batch_size=4)
    assert value == pytest.approx(-3 * math.log(2), rel=1e-5)


def test_estimate_is_unbiased_for_independent_positions():
    # E[L/l * sum_masked CE] = sum_i CE_i = -log p(continuation) for a position-independent model.
    table = [[0.2] * 5 + [1e-9]] + [[0.7, 0.1, 0.1, 0.05, 0.05, 1e-9], [0.1, 0.6, 0.1, 0.1, 0.1, 1e-9],
                                    [0.25, 0.25, 0.25, 0.2, 0.05, 1e-9]]
    exact = math.log(0.7) + math.log(0.6) + math.log(0.05)
    value = mc_loglikelihood(_independent_model(table), [3], [0, 1, 4], mask_id=MASK, mc_num=4096, mc_batch_size=64)
    assert value == pytest.approx(exact, rel=0.03)


def test_estimate_depends_only_on_the_request_and_seed():
    table = [[0.3, 0.2, 0.2, 0.2, 0.1, 1e-9]] * 6
    fn = _independent_model(table)
    a = mc_loglikelihood(fn, [1, 2], [3, 0, 4], mask_id=MASK, mc_num=8, mc_batch_size=2, seed=7)
    mc_loglikelihood(fn, [4], [4, 4], mask_id=MASK, mc_num=8, mc_batch_size=2, seed=7)  # another request between
    assert mc_loglikelihood(fn, [1, 2], [3, 0, 4], mask_id=MASK, mc_num=8, mc_batch_size=2, seed=7) == a


def test_bad_arguments():
    fn = _independent_model([[0.2] * 6] * 4)
    with pytest.raises(ValueError, match="at least one token"):
        mc_loglikelihood(fn, [1], [], mask_id=MASK)
    with pytest.raises(ValueError, match="multiple of mc_batch_size"):
        mc_loglikelihood(fn, [1], [2], mask_id=MASK, mc_num=10, mc_batch_size=4)


def test_greedy_check_follows_the_most_confident_token():
    table = [[0.2] * 6, [0.1, 0.7, 0.1, 0.05, 0.05, 1e-9], [0.6, 0.1, 0.1, 0.1, 0.1, 1e-9]]
    fn = _independent_model(table)
    assert greedy_check(fn, [3], [1, 0], mask_id=MASK)
    assert not greedy_check(fn, [3], [1, 2], mask_id=MASK)
