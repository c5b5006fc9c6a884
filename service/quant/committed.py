"""Quantized K/V on a block-causal model's committed blocks (LLaDA2's ``block`` cache mode).

A block-causal model's committed blocks never change (`service.engine.block_causal`), so their K/V are
quantized once, when their block commits, and read dequantized after that; the active block stays in full
precision. This is QDQ: the batch's cache (`service.engine.models.llada2.CommittedKV`) keeps the dequantized values
in the model dtype in place of the exact ones, so attention reads exactly what a packed store would give back;
the request's accounting (`service.quant.accounting.KVAccounting`) counts the packed layers, so its report's
effective bits and bytes are those of the packed store (``bytes_held`` accumulates over the committed blocks, as
the cache grows with the text).

The quantization runs inside the forward, per layer, between the scatter of the window's K/V and the attention
(the ``on_write`` hook of `CommittedKV`): the first forward of a block, which computes the just-committed block's
final K/V, already attends over their dequantized values, as every later forward does.

Methods: KIVI (``kivi``), dLLM-KVQ (``dllm_kvq``) and KVQuant (``kvquant``). dLLM-KVQ's attention score of a
committing column is the probability the active block's queries put on it in the forward that commits it
(`attention_scores`: mean over query heads and the block's queries, keys up to the active block's end, which is
what those queries see under the block-causal mask), the other families' block-initial score in this family's
terms. KVQuant quantizes the
committing columns' pre-RoPE keys (the forward's own, taken before its rotation) and the dequantized keys take
partial RoPE at their positions (only the rotated channels: the model's ``rotate_keys``) before they go back in
the cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from service.engine.kv_store import Segments
from service.engine.scores import attention_scores
from service.quant.accounting import KVAccounting
from service.quant.base import KVQuantizer
from service.quant.layout import SlotLayout


@dataclass(frozen=True)
class Commit:
    """Columns ``[start, end)`` of cache slot ``slot`` that commit in this forward (whose window starts at
    ``start``; its active block is ``[end, end + block)``), and whose quantizer and accounting take them (the
    request's `service.quant.store.QuantizedKVStore` parts)."""

    slot: int
    start: int
    end: int
    block: int
    quantizer: KVQuantizer
    accounting: KVAccounting

    @staticmethod
    def hook(k_cache: list[torch.Tensor], v_cache: list[torch.Tensor], commits: list[Commit],
             rotate_keys: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
             ) -> Callable[[int, torch.Tensor, torch.Tensor], None] | None:
        """`commit_hook`, reached through a commit so that the engine, which gets its commits from the requests'
        stores, needs no import of this package."""
        return commit_hook(k_cache, v_cache, commits, rotate_keys)


def commit_hook(k_cache: list[torch.Tensor], v_cache: list[torch.Tensor], commits: list[Commit],
                rotate_keys: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                ) -> Callable[[int, torch.Tensor, torch.Tensor], None] | None:
    """The ``on_write(layer, q, k_pre)`` hook that quantizes-dequantizes the committing columns of one layer in
    place (q: the window's post-RoPE queries ``[B, H, T_w, D]``; k_pre: its pre-RoPE keys ``[B, H_kv, T_w, D]``;
    each commit's window starts at its ``start``).

    Args:
        k_cache, v_cache: per layer ``[B, H_kv, capacity, D]`` (the cache's ``k`` and ``v`` lists, model dtype);
            ``end < capacity`` for every commit (the cache holds twice the longest row).
        commits: this forward's commits (at most one per slot).
        rotate_keys: ``rotate_keys(k, positions)``, the model's RoPE of pre-RoPE keys ``[B, H_kv, T, D]`` at int64
            positions ``[B, T]`` (for a quantizer with ``pre_rope_keys``).

    Returns:
        None when nothing commits; else the hook. It raises what `KVQuantizer.quantize` raises
        (`service.quant.errors.NonFiniteKVError` for a NaN/inf K or V).
    """
    commits = [c for c in commits if c.end > c.start]
    if not commits:
        return None
    device = k_cache[0].device
    # The committing columns as one row's reused prefix after "padding" [0, start) (the columns committed before,
    # already quantized): K groups run over them from ``start``, as in the other families' prefix segment.
    layouts = [SlotLayout.from_segments(Segments((c.start,), c.end, c.end + 1, c.end + 1, "prefix"),
                                        c.quantizer.k_group_size, device) for c in commits]

    def on_write(layer: int, q: torch.Tensor, k_pre: torch.Tensor) -> None:
        for commit, layout in zip(commits, layouts):
            quantizer, width = commit.quantizer, commit.end - commit.start
            k = k_cache[layer][commit.slot:commit.slot + 1, :, : commit.end + 1]
            if quantizer.pre_rope_keys:  # the committing columns' pre-RoPE keys at their columns (others unread)
                k = torch.zeros_like(k)
                k[:, :, commit.start:commit.end] = k_pre[commit.slot:commit.slot + 1, :, :width]
            v = v_cache[layer][commit.slot:commit.slot + 1, :, : commit.end + 1]
            scores = None
            if quantizer.needs_scores:
                queries = q[commit.slot:commit.slot + 1, :, width:width + commit.block]  # the active block's
                keys = k_cache[layer][commit.slot:commit.slot + 1, :, : commit.end + commit.block]
                scores = attention_scores(queries, keys, None)  # float32 [1, end + block]
            packed = quantizer.quantize(layer, k, v, layout, scores)
            commit.accounting.add(layer, packed)
            k_dq, v_dq = quantizer.dequantize(layer, packed, layout)  # [1, H_kv, end, D]
            k_dq = k_dq[:, :, commit.start:commit.end]
            if quantizer.pre_rope_keys:
                positions = torch.arange(commit.start, commit.end, device=device)[None]
                k_dq = rotate_keys(k_dq, positions)
            k_cache[layer][commit.slot, :, commit.start:commit.end] = k_dq[0]
            v_cache[layer][commit.slot, :, commit.start:commit.end] = v_dq[0, :, commit.start:commit.end]

    return on_write
