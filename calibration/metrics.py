"""Behaviour metrics of a candidate K cache against the full-recompute reference (paper, "Policy Diagnostics and
Selection"), and their signed improvements over the all-K-quantized baseline.

Every metric compares two attention-score vectors of the same query over the same keys:

    s_ref[h, n, :]  = Q[h, n] . K_ref[h, :]^T  / sqrt(D)     (full-recompute keys)
    s_test[h, n, :] = Q[h, n] . K_test[h, :]^T / sqrt(D)     (reused keys quantized by a policy, fresh active block)

with the same queries ``Q`` (the active block's queries at that layer). With grouped-query attention each key
head serves ``H / H_kv`` consecutive query heads, as in the models. The metrics (each then averaged over heads
and queries):

* ``centered_l2`` (lower is better): ``|| (s_test - mean(s_test)) - (s_ref - mean(s_ref)) ||_2`` over all keys;
  softmax is shift-invariant, so the mean is removed before comparing.
* ``attention_kl`` (lower is better): ``KL(softmax(s_ref) || softmax(s_test)) = sum_j p_ref,j (log p_ref,j -
  log p_test,j)`` over all keys (reused and recomputed), in nats.
* ``top1`` (higher is better): 1 if the key with the largest score among the **reused** keys is the same under
  both, else 0.
* ``topk`` (higher is better): ``|top-K_ref ∩ top-K_test| / K`` over the **reused** keys, ``K = min(8, #reused)``.
* ``cosine`` (higher is better): cosine similarity of ``s_test`` and ``s_ref`` over all keys (not centered).

Signed improvement of a candidate over the baseline (paper, "K-Cache Policy Selection"): ``baseline - candidate``
for lower-is-better metrics, ``candidate - baseline`` for the others; positive means the candidate is closer to
full recompute.
"""

from __future__ import annotations

import math

import torch

METRICS = ("centered_l2", "attention_kl", "top1", "topk", "cosine")
LOWER_IS_BETTER = frozenset({"centered_l2", "attention_kl"})
TOP_K = 8


def attention_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Scaled dot-product scores ``Q K^T / sqrt(D)``.

    Args:
        q: ``[H, N, D]`` queries.
        k: ``[..., H_kv, T, D]`` keys (leading dims, such as candidates, broadcast); ``H`` a multiple of ``H_kv``.

    Returns:
        float32 ``[..., H, N, T]``.
    """
    heads, kv_heads = q.shape[-3], k.shape[-3]
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of key heads ({kv_heads})")
    k = k.float().repeat_interleave(heads // kv_heads, dim=-3)
    return q.float() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])


def behaviour_metrics(s_ref: torch.Tensor, s_test: torch.Tensor, reused: torch.Tensor,
                      top_k: int = TOP_K) -> dict[str, torch.Tensor]:
    """The five metrics of the module docstring, averaged over heads and queries.

    Args:
        s_ref: ``[H, N, T]`` reference scores.
        s_test: ``[..., H, N, T]`` scores to judge (leading dims broadcast, e.g. one per candidate).
        reused: bool ``[T]``, which keys come from the reused cache (at least one).
        top_k: ``K`` of the top-K recall (capped at the number of reused keys).

    Returns:
        metric name -> float64 ``[...]``.
    """
    if not bool(reused.any()):
        raise ValueError("top-1 and top-K compare reused keys; this record has none")
    s_ref = s_ref.double()
    s_test = s_test.double()
    centered = (s_test - s_test.mean(-1, keepdim=True)) - (s_ref - s_ref.mean(-1, keepdim=True))
    log_p_ref = torch.log_softmax(s_ref, -1)
    kl = (log_p_ref.exp() * (log_p_ref - torch.log_softmax(s_test, -1))).sum(-1)
    cosine = torch.nn.functional.cosine_similarity(s_test, s_ref.expand_as(s_test), dim=-1)
    ref_reused, test_reused = s_ref[..., reused], s_test[..., reused]
    top1 = (ref_reused.argmax(-1) == test_reused.argmax(-1)).double()
    k = min(top_k, int(reused.sum()))
    ref_top = torch.zeros_like(ref_reused).scatter_(-1, ref_reused.topk(k, -1).indices, 1.0)
    test_top = torch.zeros_like(test_reused).scatter_(-1, test_reused.topk(k, -1).indices, 1.0)
    recall = (ref_top * test_top).sum(-1) / k
    per_query = {"centered_l2": centered.norm(dim=-1), "attention_kl": kl, "top1": top1, "topk": recall,
                 "cosine": cosine}
    return {name: value.mean(dim=(-1, -2)) for name, value in per_query.items()}


def improvements(candidate: dict[str, torch.Tensor], baseline: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Signed improvement per metric: ``baseline - candidate`` if lower is better, else ``candidate - baseline``."""
    return {
        name: (baseline[name] - candidate[name]) if name in LOWER_IS_BETTER else (candidate[name] - baseline[name])
        for name in METRICS
    }
