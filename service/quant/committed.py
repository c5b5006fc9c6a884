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

Methods: those whose quantizer needs neither attention scores nor pre-RoPE keys (KIVI's uniform formats, the
``kivi`` method). dLLM-KVQ (scores of the active block's queries) and KVQuant (pre-RoPE keys under partial RoPE)
are refused by :func:`check_quantizer` with a message naming ``kv_quant``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from service.engine.kv_store import Segments
from service.quant.accounting import KVAccounting
from service.quant.base import KVQuantizer
from service.quant.config import KVQuantConfig
from service.quant.layout import SlotLayout
from service.quant.registry import make_quantizer, method


def check_quantizer(quantizer: KVQuantizer) -> str | None:
    """Why ``quantizer`` cannot quantize a block-causal model's committed blocks (a message naming the method and
    ``kv_quant``), or None when it can."""
    if quantizer.needs_scores:
        return (f"kv_quant method {quantizer.config.method!r} needs the active block's attention scores, which a "
                "block-causal model's (LLaDA2) cache does not compute yet; use kivi or none")
    if quantizer.pre_rope_keys:
        return (f"kv_quant method {quantizer.config.method!r} stores pre-RoPE keys, which a block-causal model's "
                "(LLaDA2) cache does not rotate after reading yet; use kivi or none")
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
    """Columns ``[start, end)`` of cache slot ``slot`` that commit in this forward, and whose quantizer and
    accounting take them (the request's `service.quant.store.QuantizedKVStore` parts)."""

    slot: int
    start: int
    end: int
    quantizer: KVQuantizer
    accounting: KVAccounting


def commit_hook(k_cache: list[torch.Tensor], v_cache: list[torch.Tensor],
                commits: list[Commit]) -> Callable[[int], None] | None:
    """The ``on_write(layer)`` hook that quantizes-dequantizes the committing columns of one layer in place.

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

    def on_write(layer: int) -> None:
        for commit, layout in zip(commits, layouts):
            k = k_cache[layer][commit.slot:commit.slot + 1, :, : commit.end + 1]
            v = v_cache[layer][commit.slot:commit.slot + 1, :, : commit.end + 1]
            packed = commit.quantizer.quantize(layer, k, v, layout)
            commit.accounting.add(layer, packed)
            k_dq, v_dq = commit.quantizer.dequantize(layer, packed, layout)  # [1, H_kv, end, D]
            k_cache[layer][commit.slot, :, commit.start:commit.end] = k_dq[0, :, commit.start:commit.end]
            v_cache[layer][commit.slot, :, commit.start:commit.end] = v_dq[0, :, commit.start:commit.end]

    return on_write
