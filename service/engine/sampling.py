"""Which masked positions a forward call reveals, and with which tokens (one row at a time).

Rules of NVlabs/Fast-dLLM (commit 24cc59e; golden SPEC 3.1, 3.5, 3.6):

* LLaDA (`llada/generate.py` ``get_transfer_index``): token = argmax of the logits (mask id not excluded; at
  temperature T > 0 argmax of ``exp(logits) / (-log u)^T`` in float64); confidence = float64 softmax probability of
  that token (``low_confidence``) or uniform noise (``random``). Fixed schedule: the ``k`` most confident
  candidates; threshold: the most confident always, every other one iff ``confidence >= threshold``.
* Dream (`dream/model/generation_utils*.py` ``sample_tokens``): probabilities are the softmax in the **logits
  dtype**; threshold confidence = max probability, fixed-schedule confidence = negative entropy
  ``sum p log(p + 1e-10)``; the threshold comparison also happens in the logits dtype (bf16 0.9 is 0.8984375).

Departure at every temperature: **banned ids are never chosen** (issue 13). The reference's argmax can choose the
mask id (the position then stays masked, and LLaDA's fixed schedule runs out of steps) and, where the logit rows
are wider than the tokenizer (Dream: 152,064 rows for ~151,665 ids), ids no tokenizer can decode. Here the mask id
and, when a tokenizer is loaded, every id at or beyond its size (`service.engine.spec.ModelSpec.banned_ids`) are
excluded from the **choice** of token only: the confidence stays the reference's full-softmax value of the chosen
token, so whenever the reference's choice was legal nothing changes (the goldens stay token-exact).

Departures only at temperature > 0 (the goldens are greedy): noise comes from a per-row ``torch.Generator``
seeded per request and is drawn only for the row's candidate positions, so a row samples the same tokens whatever
else is in its batch; Dream samples with the Gumbel-max trick (same distribution as the reference's
``Categorical`` draw, different random stream); the reference's dead noise draw in the prefix-cache loop is not
made.
"""

from __future__ import annotations

import torch

# Dream's generation_config ``eps``: the fixed schedule's timesteps run linspace(1, eps, steps + 1).
DREAM_EPS = 1e-3
# Added inside the log of Dream's negative-entropy confidence (reference ``sample_tokens``).
_ENTROPY_EPS = 1e-10


def llada_fixed_schedule(masked: int, steps_per_block: int) -> list[int]:
    """Tokens to reveal at each step of a block: the even split with the remainder first.

    Reference ``get_num_transfer_tokens``: ``masked // steps`` each, plus one for the first ``masked % steps``.
    """
    base, extra = divmod(masked, steps_per_block)
    return [base + (1 if i < extra else 0) for i in range(steps_per_block)]


def dream_fixed_count(masked: int, step: int, steps: int) -> int:
    """Dream's fixed-schedule reveal count at ``step`` of ``steps`` with ``masked`` candidates left.

    ``int(masked * (1 - ts[step+1] / ts[step]))`` with ``ts = linspace(1, eps, steps + 1)`` in float32, and every
    remaining candidate at the last step (reference ``_sample``; the truncation can give 0, e.g. the first step of
    a 32-step block).
    """
    if step >= steps - 1:
        return masked
    ts = torch.linspace(1, DREAM_EPS, steps + 1)
    return int(torch.tensor(masked, dtype=torch.float32) * (1 - ts[step + 1] / ts[step]))


def _gumbel_denominator(shape: tuple[int, ...], temperature: float, generator: torch.Generator, device) -> torch.Tensor:
    """``(-log u)^T`` in float64 with ``u ~ U[0, 1)`` from the row's generator (reference ``add_gumbel_noise``)."""
    noise = torch.rand(shape, dtype=torch.float64, generator=generator, device=device)
    return (-torch.log(noise)) ** temperature


def _choosable(scores: torch.Tensor, banned: torch.Tensor | None) -> torch.Tensor:
    """``scores`` ``[N, V]`` with the banned columns at -inf, so an argmax never chooses them (a copy; the
    confidence is computed from the unmasked values)."""
    if banned is None or banned.numel() == 0:
        return scores
    return scores.index_fill(-1, banned, float("-inf"))


def llada_tokens_and_confidence(
    logits: torch.Tensor, temperature: float, remasking: str, generator: torch.Generator | None,
    banned: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidate tokens and confidences of one row.

    Args:
        logits: ``[N, V]`` logits of the N candidate positions, model dtype.
        temperature: 0 for greedy; remasking: ``"low_confidence"`` or ``"random"``; generator: the row's RNG
            (needed when temperature > 0 or remasking is random).
        banned: int64 ids never chosen (module docstring), or None.

    Returns:
        (int64 tokens ``[N]``, float64 confidences ``[N]``).
    """
    if temperature > 0:
        noisy = logits.to(torch.float64).exp() / _gumbel_denominator(logits.shape, temperature, generator, logits.device)
        tokens = _choosable(noisy, banned).argmax(dim=-1)
    else:
        tokens = _choosable(logits, banned).argmax(dim=-1)
    if remasking == "random":
        confidence = torch.rand(tokens.shape, dtype=torch.float64, generator=generator, device=logits.device)
    else:
        probs = torch.softmax(logits.to(torch.float64), dim=-1)
        confidence = probs.gather(-1, tokens[:, None])[:, 0]
    return tokens, confidence


def dream_tokens_and_confidence(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None, neg_entropy: bool,
    banned: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dream's ``sample_tokens`` for one row: tokens and confidences of N candidates, in the logits dtype.

    Args:
        logits: ``[N, V]``; temperature: 0 for greedy (max probability), else Gumbel-max sampling of
            ``softmax(logits / T)``; neg_entropy: confidence is ``sum p log(p + 1e-10)`` instead of the token's
            probability; banned: int64 ids never chosen (module docstring), or None.

    Returns:
        (int64 tokens ``[N]``, confidences ``[N]`` in the logits dtype).
    """
    if temperature > 0:
        logits = logits / temperature
    probs = torch.softmax(logits, dim=-1)
    if temperature > 0:
        gumbel = -torch.log(_gumbel_denominator(logits.shape, 1.0, generator, logits.device))
        tokens = _choosable(torch.log_softmax(logits.to(torch.float64), dim=-1) + gumbel, banned).argmax(dim=-1)
    else:
        tokens = _choosable(probs, banned).argmax(dim=-1)
    confidence = probs.gather(-1, tokens[:, None])[:, 0]
    if neg_entropy:
        confidence = (probs * torch.log(probs + _ENTROPY_EPS)).sum(dim=-1)
    return tokens, confidence


def select_reveals(confidence: torch.Tensor, count: int, threshold: float | None) -> torch.Tensor:
    """Indices (into the N candidates) to reveal.

    Fixed schedule (``threshold`` None): the ``count`` most confident (``torch.topk``). Threshold: of the ``count``
    most confident, the first always and each other one iff ``confidence >= threshold``; the comparison runs in
    the confidence's dtype, as the reference's tensor-vs-float ``<`` does.

    Args:
        confidence: ``[N]``; count: how many of the top candidates to consider (<= N).

    Returns:
        int64 ``[n_revealed]``.
    """
    if count <= 0:
        return torch.empty(0, dtype=torch.long, device=confidence.device)
    values, order = torch.topk(confidence, count)
    if threshold is None:
        return order
    keep = ~(values < threshold)
    keep[0] = True
    return order[keep]


def dream_threshold_reveals(
    confidence: torch.Tensor, quota: int, threshold: float
) -> tuple[torch.Tensor, int]:
    """Dream whole-sequence threshold step: of the ``quota`` most confident, the first always, the rest iff
    ``confidence >= threshold``.

    Returns:
        (indices to reveal, number rejected), the rejected count being what the reference carries to the next step
        (``left_tokens_last_step``).
    """
    chosen = select_reveals(confidence, quota, threshold)
    return chosen, quota - int(chosen.numel())
