"""Uniform asymmetric min-max quantize/dequantize (QDQ): KIVI's K and V formats, with dLLM-KVQ's protected tokens.

Reference: ``jy-yuan/KIVI`` ``quant/new_pack.py`` (``quant_and_pack_kcache``, ``quant_and_pack_vcache``,
``unpack_and_dequant_*``); paper sections "Quantization Granularity" and "Online Quantization Details".

* scale = (max - min) / (2^b - 1), zero point = min (kept as a float), both in the **input dtype**;
* codes = round_half_even(clamp((x - min) / scale, 0, 2^b - 1)), computed in the input dtype in exactly that
  order, so codes, scales and minima match the reference bit for bit in fp32, fp16 and bf16;
* dequantized = float32(code) * float32(scale) + float32(min) (what KIVI's CUDA kernel computes), then cast to the
  model dtype.

K is quantized per channel over groups of G tokens (:func:`quantize_k_groups`), V per token over groups of G
channels (:func:`quantize_v`).

Departures from the reference, on purpose:

* a zero-range group (max == min, e.g. a constant channel) gets scale 0 and codes 0 and dequantizes to its exact
  values; the reference divides by zero, casts NaN to int32 (-2^31 on x86) and ORs that into the packed word,
  corrupting the 15 (2-bit) or 7 (4-bit) codes that share it;
* a group may be short (last group of a segment) and has its own statistics (see `service.quant.layout`);
* a ``v_group_size`` that does not divide head_dim is a clear error (:class:`KVQuantError`), not an assert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from service.engine.kv_store import Segments
from service.quant.config import legal_v_group_sizes
from service.quant.errors import KVQuantError
from service.quant.layout import SlotLayout


def max_code(bits: int) -> int:
    return 2**bits - 1


def minmax_scale(mn: torch.Tensor, mx: torch.Tensor, bits: int) -> torch.Tensor:
    """``(mx - mn) / (2^b - 1)`` in the input dtype (the reference's order of operations).

    Raises:
        KVQuantError: the range overflows the dtype (inf scale would dequantize to NaN).
    """
    scale = (mx - mn) / max_code(bits)
    if not torch.isfinite(scale).all():
        raise KVQuantError(f"a group's range overflows {mn.dtype}; values this large cannot be quantized")
    return scale


def quantize_codes(x: torch.Tensor, mn: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes of ``x`` for (broadcastable) ``mn`` and ``scale``: uint8 in ``[0, 2^b)``.

    Math in the input dtype: ``d = x - mn; u = d / scale; clamp(0, 2^b - 1); round half to even``. Where
    ``scale == 0`` (zero-range group) the code is 0, which dequantizes to ``mn``, the exact value.
    """
    u = (x - mn) / scale
    u = torch.where(scale == 0, torch.zeros((), dtype=u.dtype, device=u.device), u)
    return u.clamp_(0, max_code(bits)).round_().to(torch.uint8)


def dequantize_codes(codes: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``float32(code) * float32(scale) + float32(mn)``, cast to ``dtype`` (shapes broadcast)."""
    return (codes.to(torch.float32) * scale.to(torch.float32) + mn.to(torch.float32)).to(dtype)


@dataclass(frozen=True, eq=False)
class GroupStats:
    """Per-group statistics of K: ``scale`` and ``mn``, ``[Ng, H, D]`` in the input dtype."""

    scale: torch.Tensor
    mn: torch.Tensor


def k_group_stats(
    x: torch.Tensor, layout: SlotLayout, bits: int, protected: torch.Tensor | None = None
) -> GroupStats:
    """Per-channel min/max of each K group over its quantized tokens.

    Args:
        x: ``[N, H, D]`` K of the layout's slots (model dtype).
        layout: slots and groups of the block.
        bits: 2, 4 or 8.
        protected: bool ``[N]``, tokens kept in high precision; they are excluded from min and max
            (dLLM-KVQ, paper "Online Quantization Details"). None: no protection (KIVI).

    Returns:
        :class:`GroupStats`. A group whose tokens are all protected gets scale 0 and mn 0 (never used).
    """
    excluded = ~layout.group_valid  # [Ng, G] padding of short groups
    if protected is not None:
        # The sentinel slot N is "protected" too, so padding stays excluded.
        excluded = excluded | torch.cat([protected, protected.new_ones(1)])[layout.group_slots]
    padded = torch.cat([x, x.new_zeros(1, *x.shape[1:])])[layout.group_slots]  # [Ng, G, H, D]
    keep = ~excluded[:, :, None, None]
    inf = torch.tensor(float("inf"), dtype=x.dtype, device=x.device)
    mn = torch.where(keep, padded, inf).amin(1)  # [Ng, H, D]
    mx = torch.where(keep, padded, -inf).amax(1)
    empty = excluded.all(1)[:, None, None]
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    mn = torch.where(empty, zero, mn)
    mx = torch.where(empty, zero, mx)
    return GroupStats(scale=minmax_scale(mn, mx, bits), mn=mn)


def quantize_k_slots(x: torch.Tensor, groups: torch.Tensor, stats: GroupStats, bits: int) -> torch.Tensor:
    """Codes (uint8 ``[n, H, D]``) of K tokens ``x`` ``[n, H, D]`` whose groups are ``groups`` (int64 ``[n]``)."""
    return quantize_codes(x, stats.mn[groups], stats.scale[groups], bits)


def dequantize_k_into(
    out: torch.Tensor, codes: torch.Tensor, stats: GroupStats, layout: SlotLayout
) -> torch.Tensor:
    """Dequantize the codes of every slot (``[N, H, D]`` uint8) into ``out`` ``[B, H, T_reused, D]``.

    Run by run (see `SlotLayout.runs`), each run's full groups at once with broadcast statistics, then its
    short last group: the same float32 ``code * scale + mn`` as :func:`dequantize_codes`, cast to ``out.dtype``.
    """
    g_size = layout.group_size
    h, d = codes.shape[1], codes.shape[2]
    for row, col, slot, length, group in layout.runs:
        full, tail = divmod(length, g_size)
        parts = [(0, full, g_size)] if full else []
        if tail:
            parts.append((full * g_size, 1, tail))
        for offset, n_groups, size in parts:
            g0 = group + offset // g_size
            x = codes[slot + offset : slot + offset + n_groups * size].view(n_groups, size, h, d).to(torch.float32)
            x.mul_(stats.scale[g0 : g0 + n_groups, None].to(torch.float32))
            x.add_(stats.mn[g0 : g0 + n_groups, None].to(torch.float32))
            out[row, :, col + offset : col + offset + n_groups * size] = x.view(-1, h, d).transpose(0, 1)
    return out


def quantize_k_groups(k: torch.Tensor, group_size: int, bits: int):
    """KIVI K quantization of a ``[B, H, T, D]`` tensor: per channel over groups of ``group_size`` tokens.

    The tokens of every (b, h) row form one segment; if ``T`` is not a multiple of G the last group is short.
    This is the same code path the store uses (:func:`k_group_stats`, :func:`quantize_k_slots`) on a trivial
    layout, exposed for the golden tests and for callers that hold a plain tensor.

    Returns:
        ``(codes, scale, mn)``: uint8 ``[B, H, T, D]``; ``[B, H, ceil(T / G), D]`` each, input dtype.
    """
    b, h, t, d = k.shape
    layout = _single_segment_layout(b, t, group_size, k.device)
    x = k.permute(0, 2, 1, 3).reshape(b * t, h, d)  # [N, H, D], slots row by row
    stats = k_group_stats(x, layout, bits)
    codes = quantize_k_slots(x, layout.group_of_slot, stats, bits)
    ng = layout.num_groups // b

    def as_bhgd(s: torch.Tensor) -> torch.Tensor:
        return s.reshape(b, ng, h, d).permute(0, 2, 1, 3)

    return codes.reshape(b, t, h, d).permute(0, 2, 1, 3), as_bhgd(stats.scale), as_bhgd(stats.mn)


def dequantize_k_groups(codes: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, group_size: int, dtype):
    """Inverse of :func:`quantize_k_groups`: ``[B, H, T, D]`` in ``dtype``."""
    t = codes.shape[2]
    g = torch.arange(t, device=codes.device) // group_size
    return dequantize_codes(codes, scale[:, :, g], mn[:, :, g], dtype)


def _single_segment_layout(batch: int, tokens: int, group_size: int, device) -> SlotLayout:
    # Each row is one segment of `tokens` real tokens: a prefix-mode block starting after them.
    segments = Segments((0,) * batch, block_start=tokens, block_end=tokens + 1, seq_len=tokens + 1, cache_mode="prefix")
    return SlotLayout.from_segments(segments, group_size, device)


def quantize_v(x: torch.Tensor, group_size: int, bits: int):
    """KIVI V quantization: per token over groups of ``group_size`` consecutive channels of one head.

    Args:
        x: ``[..., D]`` values (any leading dims, e.g. ``[N, H, D]`` slots or ``[B, H, T, D]``).
        group_size: channels per group; must divide D.
        bits: 2, 4 or 8.

    Returns:
        ``(codes, scale, mn)``: uint8 ``[..., D]``; ``[..., D / G]`` each, input dtype.

    Raises:
        KVQuantError: ``group_size`` does not divide D (the message lists the legal sizes).
    """
    d = x.shape[-1]
    if d % group_size:
        raise KVQuantError(f"v_group_size {group_size} does not divide head_dim {d}; legal: {legal_v_group_sizes(d)}")
    grouped = x.reshape(*x.shape[:-1], d // group_size, group_size)
    mn = grouped.amin(-1, keepdim=True)
    scale = minmax_scale(mn, grouped.amax(-1, keepdim=True), bits)
    codes = quantize_codes(grouped, mn, scale, bits)
    return codes.reshape(x.shape), scale.squeeze(-1), mn.squeeze(-1)


def dequantize_v(codes: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_v`: ``[..., D]`` in ``dtype``."""
    d = codes.shape[-1]
    groups = scale.shape[-1]
    grouped = codes.reshape(*codes.shape[:-1], groups, d // groups)
    return dequantize_codes(grouped, scale.unsqueeze(-1), mn.unsqueeze(-1), dtype).reshape(codes.shape)
