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

Methods: KIVI (``kivi``) and dLLM-KVQ (``dllm_kvq``). dLLM-KVQ's attention score of a committing column is the
probability the active block's queries put on it in the forward that commits it (`attention_scores`: mean over
query heads and the block's queries, keys up to the active block's end, which is what those queries see under the
block-causal mask), the other families' block-initial score in this family's terms. KVQuant (pre-RoPE keys under
partial RoPE) is refused by :func:`check_quantizer` with a message naming ``kv_quant``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from service.engine.kv_store import Segments
from service.engine.models.layers import attention_scores
from service.quant.accounting import KVAccounting
from service.quant.base import KVQuantizer
from service.quant.config import KVQuantConfig
from service.quant.layout import SlotLayout
from service.quant.registry import make_quantizer, method


def check_quantizer(quantizer: KVQuantizer) -> str | None:
    """Why ``quantizer`` cannot quantize a block-causal model's committed blocks (a message naming the method and
    ``kv_quant``), or None when it can."""
    if quantizer.pre_rope_keys:
        return (f"kv_quant method {quantizer.config.method!r} stores pre-RoPE keys, which a block-causal model's "
                "(LLaDA2) cache does not rotate after reading yet; use kivi, dllm_kvq or none")
    return None


def check_config(config: KVQuantConfig, spec, artifact=None) -> str | None:
    """:func:`check_quantizer` of the quantizer ``config`` makes on model ``spec`` (`service.engine.spec.ModelSpec`)
    with its loaded ``artifact`` (a dLLM-KVQ policy decides whether scores are needed); None for method ``none``.
    The server asks this when it admits a request, so a method this cache lacks is a 400, not a failed batch."""
    if method(config.method).quantizer is None:
        return None
    return check_quantizer(make_quantizer(config, spec, artifact))


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


def commit_hook(k_cache: list[torch.Tensor], v_cache: list[torch.Tensor],
                commits: list[Commit]) -> Callable[[int, torch.Tensor], None] | None:
    """The ``on_write(layer, q)`` hook (q: the window's post-RoPE queries ``[B, H, T_w, D]``) that quantizes-dequantizes the committing columns of one layer in place.

    Args:
        k_cache, v_cache: per layer ``[B, H_kv, capacity, D]`` (the cache's ``k`` and ``v`` lists, model dtype);
            ``end < capacity`` for every commit (the cache holds twice the longest row).
        commits: this forward's commits (at most one per slot).

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

    def on_write(layer: int, q: torch.Tensor) -> None:
        for commit, layout in zip(commits, layouts):
            k = k_cache[layer][commit.slot:commit.slot + 1, :, : commit.end + 1]
            v = v_cache[layer][commit.slot:commit.slot + 1, :, : commit.end + 1]
            scores = None
            if commit.quantizer.needs_scores:
                active = commit.end - commit.start  # the active block's first column in the window
                queries = q[commit.slot:commit.slot + 1, :, active:active + commit.block]
                keys = k_cache[layer][commit.slot:commit.slot + 1, :, : commit.end + commit.block]
                scores = attention_scores(queries, keys, None)  # float32 [1, end + block]
            packed = commit.quantizer.quantize(layer, k, v, layout, scores)
            commit.accounting.add(layer, packed)
            k_dq, v_dq = commit.quantizer.dequantize(layer, packed, layout)  # [1, H_kv, end, D]
            k_cache[layer][commit.slot, :, commit.start:commit.end] = k_dq[0, :, commit.start:commit.end]
            v_cache[layer][commit.slot, :, commit.start:commit.end] = v_dq[0, :, commit.start:commit.end]

    return on_write
