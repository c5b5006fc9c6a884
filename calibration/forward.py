"""The forwards calibration needs, on the engine's model through its public seams (no decoding loop).

* :func:`logits_forward`: full recompute, ids -> logits (TRACE's score matrix);
* :func:`capture_qkv` (engine): full recompute with every layer's post-RoPE Q/K/V (references, block-initial pass);
* :func:`cached_step`: one later step of a block in a cache mode, reusing given K/V for the reused columns and
  recomputing the rest, as Fast-dLLM does (paper "Preliminary: dLLM Cache"), returning the fresh queries and keys;
* :func:`capture_pre_rope`: every layer's pre-RoPE K and V of a full forward, optionally with the squared
  gradients of the masked-token loss (KVQuant's Fisher weights).

Every tensor follows ``[B, H, T, D]``; these helpers take one sequence (B = 1) and drop the batch dim on return.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from service.engine.kv_store import Segments
from service.engine.models import DiffusionLM, LayerQKV, capture_qkv

__all__ = [
    "LayerQKV",
    "PreRopeKV",
    "StepQK",
    "cached_step",
    "capture_pre_rope",
    "capture_qkv",
    "logits_forward",
    "reused_columns",
]


def logits_forward(model: DiffusionLM):
    """A TRACE ``forward``: int64 ``[N, T]`` -> position-aligned logits ``[N, T, V]``, no gradients."""

    def forward(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(ids.to(model.embed.weight.device))

    return forward


def reused_columns(cache_mode: str, block_start: int, block_end: int, seq_len: int) -> torch.Tensor:
    """Columns a cache mode reuses in the steps after the block-initial pass: int64 ``[T_reused]``.

    ``prefix``: ``[0, s)``; ``dual``: ``[0, s)`` and ``[e, T)`` (DESIGN.md "Cache mode"); the engine's one
    definition, `Segments.reused_columns`, for a batch without padding (ValueError for another cache mode).
    """
    return Segments((), block_start, block_end, seq_len, cache_mode).reused_columns


@dataclass
class StepQK:
    """One layer of a cached step: ``q_block`` ``[H, N_block, D]`` (the active block's queries) and ``k_fresh``
    ``[H_kv, T_window, D]`` (post-RoPE keys of the recomputed window columns)."""

    q_block: torch.Tensor
    k_fresh: torch.Tensor


def cached_step(model: DiffusionLM, state: torch.Tensor, cache_mode: str, block_start: int, block_end: int,
                reused: list[LayerQKV]) -> tuple[torch.Tensor, list[StepQK]]:
    """Forward of one later step of a block in ``cache_mode``, the reused columns' K/V taken from ``reused``.

    The recomputed window is the active block (dual) or the block and suffix (prefix); its columns keep their
    absolute RoPE positions, and each layer attends over all keys in sequence order: reused K/V at the reused
    columns, fresh K/V at the window.

    Args:
        state: int64 ``[T]``, the step's state.
        reused: per layer, the block-initial pass's capture (its ``k``/``v`` ``[1, H_kv, T, D]`` give the reused
            columns; unquantized, as the diagnostics require).

    Returns:
        (window logits ``[T_window, V]``, per layer :class:`StepQK`).
    """
    seq_len = state.shape[0]
    window_end = block_end if cache_mode == "dual" else seq_len
    reused_columns(cache_mode, block_start, block_end, seq_len)  # validates the cache mode
    window = torch.arange(block_start, window_end)
    captured: list[StepQK] = []

    def hook(layer, q, k_pre, k, v):
        k_all = reused[layer].k.clone()
        v_all = reused[layer].v.clone()
        k_all[:, :, window], v_all[:, :, window] = k, v
        captured.append(StepQK(q[0, :, : block_end - block_start], k[0]))
        return k_all, v_all  # the reused columns and the window together cover every column

    with torch.no_grad():
        logits = model(state[None, block_start:window_end], positions=window[None], kv_hook=hook)
    return logits[0], captured


@dataclass
class PreRopeKV:
    """One layer's pre-RoPE keys and values ``[H_kv, T, D]`` (float32), and optionally their Fisher weights
    (squared gradients of the masked-token loss, same shape)."""

    k: torch.Tensor
    v: torch.Tensor
    k_fisher: torch.Tensor | None = None
    v_fisher: torch.Tensor | None = None


def capture_pre_rope(model: DiffusionLM, state: torch.Tensor, targets: torch.Tensor | None = None) -> list[PreRopeKV]:
    """Every layer's pre-RoPE K and V of a full forward of ``state`` (int64 ``[T]``).

    With ``targets`` (int64 ``[T]``, ``-100`` where no loss), also the squared gradients of the summed
    cross-entropy of those positions with respect to K and V (KVQuant's Fisher information weights; reference
    ``SqueezeAILab/KVQuant`` collects them from the LM loss the same way).
    """
    captured: list[tuple[torch.Tensor, torch.Tensor]] = []
    fisher = targets is not None

    def hook(layer, q, k_pre, k, v):
        if fisher:
            k_pre.retain_grad()
            v.retain_grad()
        captured.append((k_pre, v))

    # The loaded model's weights may not require gradients; an embedding output that does is enough for K/V.
    handle = model.embed.register_forward_hook(lambda module, args, out: out.requires_grad_(True)) if fisher else None
    try:
        with torch.set_grad_enabled(fisher):
            logits = model(state[None], kv_hook=hook)
            if fisher:
                loss = torch.nn.functional.cross_entropy(logits[0].float(), targets, ignore_index=-100,
                                                         reduction="sum")
                loss.backward()
    finally:
        if handle is not None:
            handle.remove()
    layers = []
    for k_pre, v in captured:
        layers.append(PreRopeKV(
            k_pre[0].detach().float(), v[0].detach().float(),
            k_pre.grad[0].float().square() if fisher and k_pre.grad is not None else None,
            v.grad[0].float().square() if fisher and v.grad is not None else None,
        ))
    if fisher:
        model.zero_grad(set_to_none=True)
    return layers
