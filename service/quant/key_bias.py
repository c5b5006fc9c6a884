"""Key-bias correction: take each quantized key's expected rounding inflation off its attention score.

A key held as ``k + e``, with a rounding error ``e_i`` spread over a bin of width ``D_i`` per channel (uniform
codes: the group's scale; KVQuant's non-uniform codes: the width of the code's bin), has, for a query ``q`` and
``x_i = q_i D_i / (2 sqrt(d))``::

    E[exp(q.(k + e) / sqrt(d))] = exp(q.k / sqrt(d)) * prod_i sinh(x_i) / x_i

(issue 33, "Quantized Keys Steal Attention"), so a quantized key takes more softmax mass than the exact key it
stands for, beside the exact fresh window. The correction subtracts, on the scaled score (what SDPA's additive mask
acts on), the **second-order term** of ``log prod_i sinh(x_i) / x_i``::

    bias(q, key) = - sum_i q_i^2 D_i^2 / (24 d)

Why the second-order term and not the exact log of the sinh ratio: the term is one product of ``q^2`` against
``D^2`` per layer, the same shape as ``q K^T`` (a matmul beside the attention's own), where the exact form is a
per-channel function of every (query, key) pair (a ``[T_q, T_k, D]`` tensor per head). The two differ by
``x^4 / 180`` per channel, under 3% of the term up to ``x = 1`` (:func:`log_sinhc` is the exact form, kept for the
tests that compare them). Exact keys (the fresh window, dLLM-KVQ's protected tokens, KVQuant's outliers) have
``D = 0`` and no correction.

Keys stored **before RoPE** (KVQuant) are rounded in the pre-RoPE basis: the rotated error is ``R e``, and
``q.(R e) = (R^T q).e`` with the ``e_i`` still independent, so the term uses the query rotated back by each key's
angle. For the rotate-half pairs ``(j, j + d/2)`` at angle ``t`` that expands into a product of query and key
features, still one matmul: ``P (S_1 + S_2) + M cos(2t) (S_1 - S_2) + X sin(2t) (S_1 - S_2)`` with
``P = (q_1^2 + q_2^2) / 2``, ``M = (q_1^2 - q_2^2) / 2``, ``X = q_1 q_2`` and ``S = D^2`` (:func:`key_score_bias`).
"""

from __future__ import annotations

import torch


def key_score_bias(
    q: torch.Tensor, steps: torch.Tensor, rope_cos: torch.Tensor | None = None, rope_sin: torch.Tensor | None = None,
    form: str = "second_order",
) -> torch.Tensor:
    """The additive bias on the scaled scores ``q k^T / sqrt(d)``: ``-sum_i q_i^2 D_i^2 / (24 d)`` per pair
    (``form="log_sinh"``: ``-sum_i log(sinh(x_i) / x_i)``, the exact form, elementwise: :func:`log_sinh_bias`).

    Args:
        q: ``[B, H, T_q, D]`` post-RoPE queries (any float dtype; computed in float32).
        steps: float32 ``[B, H_kv, T_k, D]``, each key's rounding step per channel ``D_i`` (0: an exact key);
            GQA: query head h reads kv head ``h // (H / H_kv)``.
        rope_cos, rope_sin: for keys rounded **before** RoPE, float32 ``[B, 1, T_k, D]``, the cos/sin of each
            key's RoPE angle (`RotaryEmbedding.cos_sin`, rotate-half layout); None: the steps are in the basis
            the queries are in (post-RoPE keys).

    Returns:
        float32 ``[B, H, T_q, T_k]``, at most 0 (0 where the key is exact).
    """
    if form == "log_sinh":
        return log_sinh_bias(q, steps, rope_cos, rope_sin)
    if form != "second_order":
        raise ValueError(f"unknown form {form!r}; legal: second_order, log_sinh")
    d = q.shape[-1]
    qf = q.to(torch.float32)
    squared = steps.square()
    if rope_cos is None:
        query, key = qf.square(), squared
    else:
        half = d // 2
        q1, q2 = qf[..., :half], qf[..., half:]
        s1, s2 = squared[..., :half], squared[..., half:]
        c, s = rope_cos[..., :half], rope_sin[..., :half]
        cos2, sin2 = c.square() - s.square(), 2 * c * s  # [B, 1, T_k, D/2]
        diff = s1 - s2
        query = torch.cat([(q1.square() + q2.square()) / 2, (q1.square() - q2.square()) / 2, q1 * q2], dim=-1)
        key = torch.cat([s1 + s2, diff * cos2, diff * sin2], dim=-1)
    groups = q.shape[1] // steps.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
    return (query @ key.transpose(-1, -2)).mul_(-1.0 / (24 * d))


#: Elements of one chunk of :func:`log_sinh_bias`'s ``[B, H, T_q, keys, D]`` work tensor (float32: 16 MiB).
_SINH_CHUNK = 2**22


def log_sinh_bias(
    q: torch.Tensor, steps: torch.Tensor, rope_cos: torch.Tensor | None = None, rope_sin: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`key_score_bias` in the exact form ``-sum_i log(sinh(x_i) / x_i)``, ``x_i = a_i D_i / (2 sqrt(d))``
    with ``a`` the query (rotated back by the key's angle for pre-RoPE steps): one elementwise
    ``[B, H, T_q, keys, D]`` tensor per chunk of keys (``_SINH_CHUNK`` elements). Same arguments and result."""
    b, h, tq, d = q.shape
    qf = q.to(torch.float32)[:, :, :, None, :]  # [B, H, Tq, 1, D]
    groups = h // steps.shape[1]
    out = torch.empty(b, h, tq, steps.shape[2], dtype=torch.float32, device=q.device)
    chunk = max(1, _SINH_CHUNK // max(1, b * h * tq * d))
    half = d // 2
    for k0 in range(0, steps.shape[2], chunk):
        k1 = min(k0 + chunk, steps.shape[2])
        st = steps[:, :, k0:k1].repeat_interleave(groups, dim=1)[:, :, None]  # [B, H, 1, c, D]
        a = qf
        if rope_cos is not None:
            c = rope_cos[:, :, None, k0:k1, :half]  # [B, 1, 1, c, D/2]
            s = rope_sin[:, :, None, k0:k1, :half]
            q1, q2 = qf[..., :half], qf[..., half:]
            a = torch.cat([q1 * c + q2 * s, q2 * c - q1 * s], dim=-1)
        out[..., k0:k1] = log_sinhc(a * st * (0.5 / d**0.5)).sum(-1).neg_()
    return out


def log_sinhc(x: torch.Tensor) -> torch.Tensor:
    """``log(sinh(x) / x)`` elementwise (0 at x = 0): the exact per-channel log inflation (module doc), in x's
    float dtype: ``a + log1p(-exp(-2a)) - log(2a)`` for ``a = |x|`` (stable for large a), its series
    ``a^2 / 6 - a^4 / 180`` below 1e-2 (where the closed form cancels)."""
    ax = x.abs()
    small = ax < 1e-2
    safe = torch.where(small, torch.ones_like(ax), ax)
    exact = safe + torch.log1p(-torch.exp(-2 * safe)) - torch.log(2 * safe)
    square = ax.square()
    return torch.where(small, square / 6 - square.square() / 180, exact)


def bin_widths(lut: torch.Tensor, lo: float = -1.0, hi: float = 1.0) -> torch.Tensor:
    """The width of each code's bin under nearest-entry rounding, in the codebook's own (normalized) units.

    Args:
        lut: float ``[2^b]`` codebook (any order, as `service.quant.nuq.nearest_code` searches it).
        lo, hi: the range the rounded values lie in (KVQuant keys: ``[-1, 1]``, outliers excluded); the outer bins
            end there, or at the outer entries when those lie further out.

    Returns:
        float32 ``[2^b]``: per entry, the distance between the midpoints to its neighbours (0 for a duplicate
        entry, which nearest-entry rounding never picks).
    """
    values, order = torch.sort(lut.to(torch.float32))
    mids = (values[1:] + values[:-1]) / 2
    first = torch.minimum(values[:1], values.new_full((1,), lo))
    last = torch.maximum(values[-1:], values.new_full((1,), hi))
    edges = torch.cat([first, mids, last])
    sorted_widths = edges[1:] - edges[:-1]
    # A repeated entry: only the first of equals is ever the nearest (ties go to the earlier entry).
    sorted_widths[1:] = torch.where(values[1:] == values[:-1], torch.zeros_like(mids), sorted_widths[1:])
    widths = torch.empty_like(sorted_widths)
    widths[order] = sorted_widths
    return widths


def attend_with_bias(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, key_mask: torch.Tensor | None
) -> torch.Tensor:
    """SDPA (scale 1/sqrt(D), GQA as `service.engine.models.layers.attend`) with ``bias`` added to the scaled
    scores and masked keys given no weight.

    Args:
        q: ``[B, H, T_q, D]``; k, v: ``[B, H_kv, T_k, D]``; bias: float32 ``[B, H, T_q, T_k]`` (modified in place);
        key_mask: bool ``[B, T_k]`` (True = attend) or None.

    Returns:
        ``[B, H, T_q, D]`` in q's dtype.
    """
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    if key_mask is not None:
        bias.masked_fill_(~key_mask[:, None, None, :], float("-inf"))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), is_causal=False)
