"""Behaviour metrics on hand-made tensors (values computed by hand in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from calibration.metrics import attention_scores, behaviour_metrics, improvements


def _softmax(values):
    total = sum(math.exp(v) for v in values)
    return [math.exp(v) / total for v in values]


def test_identical_keys_give_zero_distance_and_full_agreement():
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(4, 3, 8, generator=generator), torch.randn(2, 12, 8, generator=generator)
    s = attention_scores(q, k)
    metrics = behaviour_metrics(s, s, torch.tensor([True] * 9 + [False] * 3))
    assert metrics["centered_l2"].item() == pytest.approx(0.0, abs=1e-9)
    assert metrics["attention_kl"].item() == pytest.approx(0.0, abs=1e-9)
    assert metrics["top1"].item() == 1.0 and metrics["topk"].item() == 1.0
    assert metrics["cosine"].item() == pytest.approx(1.0)


def test_each_metric_on_a_hand_made_case():
    q = torch.tensor([[[1.0]]])  # H = 1, one query, D = 1: scores equal the keys
    k_ref = torch.tensor([[[2.0], [0.0], [1.0]]])
    k_test = torch.tensor([[[0.0], [2.0], [1.0]]])
    s_ref, s_test = attention_scores(q, k_ref), attention_scores(q, k_test)
    assert s_ref.flatten().tolist() == [2.0, 0.0, 1.0]
    metrics = behaviour_metrics(s_ref, s_test, torch.tensor([True, True, False]))
    # centered: [1, -1, 0] vs [-1, 1, 0] -> difference [-2, 2, 0], norm sqrt(8)
    assert metrics["centered_l2"].item() == pytest.approx(math.sqrt(8))
    p_ref, p_test = _softmax([2, 0, 1]), _softmax([0, 2, 1])
    expected_kl = sum(p * math.log(p / r) for p, r in zip(p_ref, p_test))
    assert metrics["attention_kl"].item() == pytest.approx(expected_kl)
    assert metrics["top1"].item() == 0.0  # reused keys 0 and 1: reference picks 0, test picks 1
    assert metrics["topk"].item() == 1.0  # K = min(8, 2 reused) = 2: both sets are {0, 1}
    assert metrics["cosine"].item() == pytest.approx(1 / 5)  # (0 + 0 + 1) / (sqrt 5 * sqrt 5)
    every_key = behaviour_metrics(s_ref, s_test, torch.tensor([True, True, True]), top_k=2)
    assert every_key["topk"].item() == 0.5  # {0, 2} vs {1, 2}


def test_centered_distance_ignores_a_constant_shift_and_kl_too():
    s_ref = torch.tensor([[[0.5, -1.0, 2.0, 0.0]]])
    metrics = behaviour_metrics(s_ref, s_ref + 3.0, torch.ones(4, dtype=torch.bool))
    assert metrics["centered_l2"].item() == pytest.approx(0.0, abs=1e-12)
    assert metrics["attention_kl"].item() == pytest.approx(0.0, abs=1e-12)
    assert metrics["cosine"].item() < 1.0  # the raw cosine does see the shift


def test_grouped_query_heads_share_keys_and_candidates_broadcast():
    q = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])  # two query heads, one key head
    k = torch.tensor([[[1.0, 2.0], [3.0, 4.0]]])
    s = attention_scores(q, k)
    assert s.shape == (2, 1, 2)
    scale = math.sqrt(2)
    assert s[0, 0].tolist() == pytest.approx([1 / scale, 3 / scale]) and s[1, 0].tolist() == pytest.approx(
        [2 / scale, 4 / scale])
    candidates = torch.stack([k, k.flip(-2)])  # [C = 2, H_kv, T, D]
    metrics = behaviour_metrics(s, attention_scores(q, candidates), torch.tensor([True, True]))
    assert metrics["top1"].tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="multiple of key heads"):
        attention_scores(torch.zeros(3, 1, 2), torch.zeros(2, 1, 2))
    with pytest.raises(ValueError, match="has none"):
        behaviour_metrics(s, s, torch.tensor([False, False]))


def test_improvements_are_signed_so_positive_means_closer_to_full_recompute():
    baseline = {"centered_l2": torch.tensor(2.0), "attention_kl": torch.tensor(0.5), "top1": torch.tensor(0.5),
                "topk": torch.tensor(0.75), "cosine": torch.tensor(0.9)}
    candidate = {"centered_l2": torch.tensor(1.5), "attention_kl": torch.tensor(0.7), "top1": torch.tensor(1.0),
                 "topk": torch.tensor(0.5), "cosine": torch.tensor(0.95)}
    delta = {name: value.item() for name, value in improvements(candidate, baseline).items()}
    assert delta == pytest.approx({"centered_l2": 0.5, "attention_kl": -0.2, "top1": 0.5, "topk": -0.25,
                                   "cosine": 0.05})
