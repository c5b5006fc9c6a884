"""Kernel-ready views of one layer's packed K/V (`service.quant.base.PackedLayer`), built once per block.

The fused attention kernel (`service.quant.kernels.attention`) reads the stored format as it is: the planar code
stream of `service.quant.packing.pack_stream` (code ``i`` in byte ``i mod m`` at bit ``(i div m) * b``), the
group statistics, dLLM-KVQ's protected tokens from their side store, KVQuant's codebooks and sorted outlier
indices. What it needs beyond that is small int32 index maps, built here once per block (the layout is shared
by every layer; the per-layer maps are one int32 per slot):

* ``slot_of``: ``[B_store, T_reused]``, the slot of each reused column of each row, -1 on padding;
* ``k_row``: ``[N]``, the row of the slot's K codes in the code stream (codes of protected tokens are left out
  of the stream, so later slots shift down), or ``-1 - j`` for the slot's row ``j`` in ``protected_values``.

Formats (`Format`): ``uniform`` (KIVI and dLLM-KVQ: K per channel over token groups, V per token over channel
groups, ``service.quant.uniform``) and ``nuq`` (KVQuant: codebook lookups scaled per channel (K) or per token
(V), sparse outliers, pre-RoPE keys, ``service.quant.nuq``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from service.quant.key_bias import bin_widths
from service.quant.layout import SlotLayout

Format = Literal["uniform", "nuq"]


@dataclass(frozen=True, eq=False)
class BlockMaps:
    """Index maps shared by every layer of a block.

    Attributes:
        slot_of: int32 ``[B_store, T_reused]``; -1 on padding.
        group_of_slot: int32 ``[N]``, the K group of each slot.
    """

    slot_of: torch.Tensor
    group_of_slot: torch.Tensor

    @classmethod
    def from_layout(cls, layout: SlotLayout) -> BlockMaps:
        device = layout.rows.device
        slot_of = torch.full((layout.batch_size, layout.num_reused), -1, dtype=torch.int32, device=device)
        slot_of[layout.rows, layout.cols] = torch.arange(layout.num_slots, dtype=torch.int32, device=device)
        return cls(slot_of=slot_of, group_of_slot=layout.group_of_slot.to(torch.int32))


@dataclass(frozen=True, eq=False)
class KernelOperands:
    """What the kernel reads of one layer (all on the K/V device; unused entries are 1-element dummies).

    Attributes:
        fmt: ``uniform`` or ``nuq``.
        bits: 2, 4 or 8.
        num_slots: N.
        k_codes, v_codes: uint8 views of the packed code streams.
        k_row: int32 ``[N]`` (see the module doc); None when every slot has codes.
        k_scale, k_mn: uniform: ``[Ng, H, D]`` (model dtype); nuq: float32 ``[C]`` half range and offset.
        k_protected: uniform: ``[n_protected, H, D]`` protected K values (model dtype).
        k_lut, v_lut: nuq: float32 ``[2^b]`` codebooks.
        k_width: nuq: float32 ``[2^b]``, each K code's bin width (`service.quant.key_bias.bin_widths`), what the
            key-bias correction's steps are made of; None for uniform (its steps are the group scales).
        k_outlier_index, k_outlier_values, v_outlier_index, v_outlier_values: nuq: sorted int32 flat indices
            into ``[N, C]`` and their values.
        k_outlier_start, v_outlier_start: nuq: int32 ``[N * H + 1]``, where the outliers of each (slot, kv head)
            row of D entries start in the sorted index (CSR row pointers, built once per block).
        k_outlier_most, v_outlier_most: nuq: the most outliers any (slot, kv head) row holds.
        v_scale, v_mn: uniform: ``[N, H, D / G]`` (model dtype); nuq: float32 ``[N]`` half range and offset.
        v_group_size: uniform V channels per group (nuq: D).
    """

    fmt: Format
    bits: int
    num_slots: int
    k_codes: torch.Tensor
    v_codes: torch.Tensor
    k_row: torch.Tensor | None
    k_scale: torch.Tensor
    k_mn: torch.Tensor
    k_protected: torch.Tensor
    k_lut: torch.Tensor
    k_outlier_index: torch.Tensor
    k_outlier_values: torch.Tensor
    v_scale: torch.Tensor
    v_mn: torch.Tensor
    v_lut: torch.Tensor
    v_outlier_index: torch.Tensor
    v_outlier_values: torch.Tensor
    v_group_size: int
    k_outlier_start: torch.Tensor | None = None
    v_outlier_start: torch.Tensor | None = None
    k_outlier_most: int = 0
    v_outlier_most: int = 0
    k_width: torch.Tensor | None = None


def outlier_rows(index: torch.Tensor, rows: int, row_width: int) -> tuple[torch.Tensor, int]:
    """CSR pointers of sorted flat outlier indices over rows of ``row_width`` entries: int32 ``[rows + 1]``,
    and the largest count in a row. The kernel scans a row's few outliers instead of searching them all."""
    bounds = torch.arange(rows + 1, device=index.device, dtype=torch.int64) * row_width
    start = torch.searchsorted(index.long(), bounds).to(torch.int32)
    most = int((start[1:] - start[:-1]).max()) if rows else 0
    return start, most


def _dummy(device, dtype=torch.float32) -> torch.Tensor:
    return torch.zeros(1, dtype=dtype, device=device)


def uniform_operands(tensors_k: dict, tensors_v: dict, bits: int, num_slots: int, v_group_size: int) -> KernelOperands:
    """Operands of the base quantizer's format (KIVI; dLLM-KVQ with ``protected_slots``/``protected_values``)."""
    device = tensors_k["codes"].device
    k_row, protected = None, _dummy(device)
    if "protected_slots" in tensors_k:
        slots = tensors_k["protected_slots"].long()
        keep = torch.ones(num_slots, dtype=torch.bool, device=device)
        keep[slots] = False
        # Code rows of unprotected slots count up past the protected ones; protected slots point (negated) into
        # the side store.
        k_row = (torch.cumsum(keep, 0, dtype=torch.int32) - 1).to(torch.int32)
        k_row[slots] = -1 - torch.arange(slots.numel(), dtype=torch.int32, device=device)
        protected = tensors_k["protected_values"]
    dummy = _dummy(device)
    dummy_index = _dummy(device, torch.int32)
    return KernelOperands(
        fmt="uniform", bits=bits, num_slots=num_slots,
        k_codes=tensors_k["codes"].view(torch.uint8), v_codes=tensors_v["codes"].view(torch.uint8), k_row=k_row,
        k_scale=tensors_k["scale"], k_mn=tensors_k["mn"], k_protected=protected, k_lut=dummy,
        k_outlier_index=dummy_index, k_outlier_values=dummy,
        v_scale=tensors_v["scale"], v_mn=tensors_v["mn"], v_lut=dummy,
        v_outlier_index=dummy_index, v_outlier_values=dummy, v_group_size=v_group_size,
    )


def nuq_operands(
    tensors_k: dict, tensors_v: dict, bits: int, num_slots: int, num_heads: int, head_dim: int,
    k_offset: torch.Tensor, k_half_range: torch.Tensor, k_lut: torch.Tensor, v_lut: torch.Tensor,
) -> KernelOperands:
    """Operands of KVQuant's format; ``k_offset``/``k_half_range`` are the layer's float32 ``[C]`` key ranges
    (`service.quant.nuq.key_offset_range`), the codebooks float32 ``[2^b]``."""
    device = tensors_k["codes"].device
    rows = num_slots * num_heads
    k_start, k_most = outlier_rows(tensors_k["outlier_index"], rows, head_dim)
    v_start, v_most = outlier_rows(tensors_v["outlier_index"], rows, head_dim)
    return KernelOperands(
        fmt="nuq", bits=bits, num_slots=num_slots,
        k_codes=tensors_k["codes"].view(torch.uint8), v_codes=tensors_v["codes"].view(torch.uint8), k_row=None,
        k_scale=k_half_range, k_mn=k_offset, k_protected=_dummy(device), k_lut=k_lut,
        k_outlier_index=tensors_k["outlier_index"], k_outlier_values=tensors_k["outlier_values"],
        v_scale=tensors_v["half_range"], v_mn=tensors_v["offset"], v_lut=v_lut,
        v_outlier_index=tensors_v["outlier_index"], v_outlier_values=tensors_v["outlier_values"],
        v_group_size=1, k_outlier_start=k_start, v_outlier_start=v_start, k_outlier_most=k_most,
        v_outlier_most=v_most, k_width=bin_widths(k_lut),
    )
