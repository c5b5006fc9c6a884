"""dLLM-KVQ's attention importance of reused keys: one function the models (LLaDA's block-initial pass) and the
quantized committed blocks of block-causal families (`service.quant.committed`) share, kept out of the models so
that the quantizers need not import them (tests/test_architecture.py)."""

from __future__ import annotations

import torch


def attention_scores(
    q: torch.Tensor, k: torch.Tensor, key_mask: torch.Tensor | None
) -> torch.Tensor:
    """Attention probability each key receives, averaged over all query heads and the given queries.

    This is dLLM-KVQ's block-initial ``attention`` importance (paper "Online dLLM-KVQ Quantization":
    mean over heads H and active-block queries Q_b of softmax(q k^T / sqrt(D))).

    Args:
        q: ``[B, H, Tq, D]`` post-RoPE queries of the active block; k: ``[B, H_kv, Tk, D]`` post-RoPE keys;
        key_mask: bool ``[B, Tk]`` or None (masked keys get probability 0).

    Returns:
        float32 ``[B, Tk]``; each row sums to 1 over its unmasked keys.
    """
    groups = q.shape[1] // k.shape[1]
    kf = k.to(torch.float32).repeat_interleave(groups, dim=1)
    logits = q.to(torch.float32) @ kf.transpose(-1, -2) / q.shape[-1] ** 0.5  # [B, H, Tq, Tk]
    if key_mask is not None:
        logits = logits.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    return logits.softmax(dim=-1).mean(dim=(1, 2))
