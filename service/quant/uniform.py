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

from contextvars import ContextVar
from dataclasses import dataclass

import torch

from service.artifacts.base import legal_v_group_sizes
from service.engine.kv_store import Segments
from service.quant.errors import KVQuantError
from service.quant.layout import SlotLayout


def max_code(bits: int) -> int:
    return 2**bits - 1


#: While a quantizer's write runs (`KVQuantizer.quantize`): the finiteness flags its checks put off, read together
#: in one host read at the end of the write (a host read is a sync on a GPU); None: checks read at once.
DEFERRED_CHECKS: ContextVar[list[torch.Tensor] | None] = ContextVar("deferred_checks", default=None)


def minmax_scale(mn: torch.Tensor, mx: torch.Tensor, bits: int) -> torch.Tensor:
    """``(mx - mn) / (2^b - 1)`` in the input dtype (the reference's order of operations).

    Raises:
        KVQuantError: the range overflows the dtype (inf scale would dequantize to NaN); inside a write that puts
            its checks off (:data:`DEFERRED_CHECKS`), the write raises it instead.
    """
    scale = (mx - mn) / max_code(bits)
    deferred = DEFERRED_CHECKS.get()
    if deferred is not None:
        deferred.append(torch.isfinite(scale).all())
    elif not torch.isfinite(scale).all():
        raise KVQuantError(f"a group's range overflows {mn.dtype}; values this large cannot be quantized")
    return scale


def quantize_codes(x: torch.Tensor, mn: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes of ``x`` for (broadcastable) ``mn`` and ``scale``: uint8 in ``[0, 2^b)``.

    Math in the input dtype: ``d = x - mn; u = d / scale; clamp(0, 2^b - 1); round half to even``. Where
    ``scale == 0`` (zero-range group) the divisor is 1 instead: ``d`` is 0 there, the code is 0, which
    dequantizes to ``mn``, the exact value.
    """
    return _codes_by_divisor(x, mn, _divisor(scale), bits)


def _divisor(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` with 1 where it is 0 (see :func:`quantize_codes`)."""
    return torch.where(scale == 0, torch.ones((), dtype=scale.dtype, device=scale.device), scale)


def _codes_by_divisor(x: torch.Tensor, mn: torch.Tensor, divisor: torch.Tensor, bits: int) -> torch.Tensor:
    u = x - mn
    u.div_(divisor)
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
        NaN in ``x`` propagates into the statistics (callers check them).
    """
    lo = hi = x
    if protected is not None:
        lo = x.masked_fill(protected[:, None, None], float("inf"))
        hi = x.masked_fill(protected[:, None, None], float("-inf"))
    extremes = _group_extremes if layout.batched(x.shape[1] * x.shape[2]) else _group_extremes_by_part
    mn, mx = extremes(lo, hi, layout)
    if protected is not None:
        empty = (mn > mx)[:, :1, :1]  # only a group with every token protected has min > max
        mn = mn.masked_fill(empty, 0)
        mx = mx.masked_fill(empty, 0)
    return GroupStats(scale=minmax_scale(mn, mx, bits), mn=mn)


def _group_extremes_by_part(lo: torch.Tensor, hi: torch.Tensor, layout: SlotLayout):
    """Per-group minimum of ``lo`` and maximum of ``hi`` (``[N, H, D]`` each), group block by group block."""
    shape = (layout.num_groups, *lo.shape[1:])
    mn, mx = lo.new_empty(shape), lo.new_empty(shape)
    for _, _, slot, n_groups, size, group in layout.parts():
        span = slice(slot, slot + n_groups * size)
        mn[group : group + n_groups] = lo[span].view(n_groups, size, *lo.shape[1:]).amin(1)
        mx[group : group + n_groups] = hi[span].view(n_groups, size, *lo.shape[1:]).amax(1)
    return mn, mx


def _group_extremes(lo: torch.Tensor, hi: torch.Tensor, layout: SlotLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group minimum of ``lo`` and maximum of ``hi`` (``[N, H, D]`` each) for a ``batched`` layout: every group
    gathered to ``[Ng, G, H, D]`` at once, a short group's padding reading +inf (minimum) or -inf (maximum), which
    leave the result as it is; the same values, reduced in the same order, as group block by group block."""
    ends = lo.new_tensor([float("inf"), float("-inf")])[:, None, None].expand(2, *lo.shape[1:])
    ng, g = layout.group_slots.shape
    lo_ext = torch.cat([lo, ends])
    hi_ext = lo_ext if hi is lo else torch.cat([hi, ends])
    mn = lo_ext.index_select(0, layout.group_slots.view(-1)).view(ng, g, *lo.shape[1:]).amin(1)
    mx = hi_ext.index_select(0, layout.group_slots_high.view(-1)).view(ng, g, *lo.shape[1:]).amax(1)
    return mn, mx


def quantize_k_slots(x: torch.Tensor, layout: SlotLayout, stats: GroupStats, bits: int) -> torch.Tensor:
    """Codes (uint8 ``[N, H, D]``) of every slot under its group's statistics, group block by group block (or,
    for a ``batched`` layout, all slots at once under their groups' gathered statistics)."""
    if layout.batched(x.shape[1] * x.shape[2]):
        groups = layout.group_of_slot
        mn, divisor = stats.mn.index_select(0, groups), _divisor(stats.scale).index_select(0, groups)
        return _codes_by_divisor(x, mn, divisor, bits)
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    for _, _, slot, n_groups, size, group in layout.parts():
        span = slice(slot, slot + n_groups * size)
        shape = (n_groups, size, *x.shape[1:])
        g = slice(group, group + n_groups)
        codes[span].view(shape).copy_(
            quantize_codes(x[span].view(shape), stats.mn[g, None], stats.scale[g, None], bits)
        )
    return codes


#: Elements of the float32 work buffer of a read (bounds the read's transient memory).
_WORK_ELEMENTS = 2**20


def _affine_rows_into(dest: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor) -> None:
    """``dest`` ``[H, n, D]`` (a view of the output) = ``float32(codes) * float32(scale) + float32(mn)``.

    The arithmetic runs in slot order (``codes`` ``[n, H, ...]``, contiguous, statistics broadcast along
    contiguous dims), then one transposing copy casts into ``dest``: several times faster than broadcasting
    permuted statistics over a permuted view, and bit for bit :func:`dequantize_codes` (same ops, same order).
    """
    work = codes.to(torch.float32)
    work.mul_(scale.to(torch.float32))
    work.add_(mn.to(torch.float32))
    dest.copy_(work.view(dest.shape[1], dest.shape[0], dest.shape[2]).transpose(0, 1))


def dequantize_k_batched(out: torch.Tensor, work: torch.Tensor, stats: GroupStats, layout: SlotLayout) -> torch.Tensor:
    """:func:`dequantize_k_into` for a ``batched`` layout: ``work`` float32 ``[N + 1, H, D]``, the codes as floats
    and a zero last row, reduced to the active slots (`SlotLayout.take_active`), is turned into ``code * scale +
    mn`` with each slot's group statistics gathered, then placed into ``out`` in one gather (`SlotLayout.place`);
    the same float32 values, rounded once."""
    work = layout.take_active(work, spare=True)
    groups = layout.take_active(layout.group_of_slot)
    _affine_(work[:-1], stats.scale.index_select(0, groups), stats.mn.index_select(0, groups))
    return layout.place(work, out)


def dequantize_v_batched(
    out: torch.Tensor, work: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, layout: SlotLayout
) -> torch.Tensor:
    """:func:`dequantize_v_into` for a ``batched`` layout (``work`` as in :func:`dequantize_k_batched`)."""
    work, scale, mn = layout.take_active(work, spare=True), layout.take_active(scale), layout.take_active(mn)
    n, h, d = work.shape[0] - 1, work.shape[1], work.shape[2]
    groups = scale.shape[-1]
    _affine_(work[:-1].view(n, h, groups, d // groups), scale[:, :, :, None], mn[:, :, :, None])
    return layout.place(work, out)


def _affine_(work: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor) -> None:
    """``work = work * float32(scale) + float32(mn)`` in place (work: float32 codes; :func:`dequantize_codes`
    before its cast, bit for bit)."""
    work.mul_(scale.to(torch.float32))
    work.add_(mn.to(torch.float32))


def affine_into(dest: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor) -> None:
    """``dest[...] = float32(codes) * float32(scale) + float32(mn)`` (4-D, shapes broadcast to ``dest``).

    For a float32 ``dest`` the arithmetic runs in place in ``dest`` (one conversion copy, one multiply, one add);
    otherwise in float32 chunks along dim 1 (about ``_WORK_ELEMENTS`` each) that are then cast into ``dest``, so
    the result is always the float32 value rounded once, bit for bit :func:`dequantize_codes`.
    """
    if dest.dtype == torch.float32:
        dest.copy_(codes)
        dest.mul_(scale.to(torch.float32))
        dest.add_(mn.to(torch.float32))
        return
    step = max(1, _WORK_ELEMENTS // max(1, dest[:, :1].numel()))
    for i in range(0, dest.shape[1], step):
        part = slice(i, i + step)
        work = codes[:, part].to(torch.float32)
        work.mul_(scale[:, part if scale.shape[1] > 1 else slice(None)].to(torch.float32))
        work.add_(mn[:, part if mn.shape[1] > 1 else slice(None)].to(torch.float32))
        dest[:, part] = work


def dequantize_k_into(
    out: torch.Tensor, codes: torch.Tensor, stats: GroupStats, layout: SlotLayout
) -> torch.Tensor:
    """Dequantize the codes of every slot (``[N, H, D]`` uint8) into ``out`` ``[B, H, T_reused, D]``.

    Run by run (see `SlotLayout.runs`), each run's full groups at once with broadcast statistics, then its
    short last group, written straight into ``out`` in its own layout (see :func:`affine_into`; measured faster
    for K than the slot-order path V takes, whose statistics vary along tokens instead).
    """
    h, d = codes.shape[1], codes.shape[2]
    for row, col, slot, n_groups, size, group in layout.parts():
        dest = out[row, :, col : col + n_groups * size].view(h, n_groups, size, d)
        part = codes[slot : slot + n_groups * size].view(n_groups, size, h, d)
        g = slice(group, group + n_groups)
        # [G, size, H, D] -> [H, G, size, D]; statistics [G, H, D] -> [H, G, 1, D]
        affine_into(
            dest,
            part.permute(2, 0, 1, 3),
            stats.scale[g].permute(1, 0, 2)[:, :, None],
            stats.mn[g].permute(1, 0, 2)[:, :, None],
        )
    return out


def dequantize_v_into(
    out: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, layout: SlotLayout
) -> torch.Tensor:
    """Dequantize V codes of every slot (``[N, H, D]``; statistics ``[N, H, D / G]``) into ``out``, span by span
    (`SlotLayout.spans`), at most ``_WORK_ELEMENTS`` entries at a time."""
    h, d = codes.shape[1], codes.shape[2]
    groups = scale.shape[-1]
    step = max(1, _WORK_ELEMENTS // (h * d))
    for row, col, slot, length in layout.spans():
        for t0 in range(0, length, step):
            n = min(step, length - t0)
            first = slot + t0
            # codes [n, H, D/G groups, G]; statistics [n, H, groups, 1]
            _affine_rows_into(
                out[row, :, col + t0 : col + t0 + n],
                codes[first : first + n].view(n, h, groups, d // groups),
                scale[first : first + n, :, :, None],
                mn[first : first + n, :, :, None],
            )
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
    codes = quantize_k_slots(x, layout, stats, bits)
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
