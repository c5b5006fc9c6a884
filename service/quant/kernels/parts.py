"""Kernel-ready views of several stores' layers side by side: what one launch of the fused attention kernel reads
to serve the rows of many requests (`service.quant.kernels.attention.fused_reuse_attention_rows`, issue 21).

Each store's operands (`service.quant.kernels.operands`) are concatenated as they are, values unchanged: the code
streams byte after byte, the K statistics group after group, V's slot after slot, the protected K rows, the
per-slot maps (``k_row``, ``group_of_slot``) slot after slot, and the slot maps ``slot_of`` row after row (padded
with -1 to the longest reused length). What tells a query row where its store's part begins is a small int32
table, one row per store (:data:`PART_INFO` entries): its fresh window width, its reused length, its first slot,
first K group and first protected row among all, and the byte offset and length (``m``) of its K and V streams.
The kernel adds those offsets to its pointers, so every index the per-store kernel computes stays local to the
store and the values read are the same.

Kept per set of stores (:data:`_SETS`, a few entries, dropped by :func:`forget` when a store is cleared): the
concatenated maps (they change only when a store starts a block, which gives it new maps), the query rows' store
rows and parts, and the tables (per tuple of layer shapes: layers of one block mostly share one). Not kept: the
concatenated codes and statistics of a layer; holding them for the block would double the set's packed cache
outside admission, so they are concatenated at every later step (a few copies per layer, as the pooled PyTorch
read `service.quant.rows` makes). A graphed later step reads none of this: with CUDA graphs on, the stores hold
their layers in one pool whose runs' starts make the table (`service.engine.packed_pool`), no concatenation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from service.quant.errors import KVQuantError
from service.quant.kernels.operands import BlockMaps, KernelOperands

#: int32 entries per store in the kernel's table: window width, reused length, first slot, first K group, first
#: protected row, K stream offset (bytes), K stream ``m``, V stream offset, V stream ``m``.
PART_INFO = 9
#: Sets of stores whose concatenated maps are kept (a running batch changes its set whenever a row starts a block).
_KEPT_SETS = 4


def stream_bytes(n_codes: int, bits: int) -> int:
    """``m``, the bytes of a planar stream of ``n_codes`` codes of ``bits`` bits (`service.quant.packing`)."""
    per_byte = 8 // bits
    return -(-n_codes // per_byte)


def k_code_count(ops: KernelOperands, heads: int, head_dim: int) -> int:
    """Codes in the layer's K stream (dLLM-KVQ leaves its protected tokens out of it)."""
    slots = ops.num_slots if ops.k_row is None else ops.num_slots - ops.k_protected.shape[0]
    return slots * heads * head_dim


@dataclass(eq=False)
class _Set:
    maps: tuple[BlockMaps, ...]  # the stores' maps they were made from (identity)
    slot_of: torch.Tensor  # int32 [R_all, T_max], -1 on padding
    group_of_slot: torch.Tensor  # int32 [N_all], local groups
    rows: torch.Tensor  # int32 [R_all], 0..R_all - 1: each query row's store row in slot_of
    part_of_row: torch.Tensor  # int32 [R_all]
    info: dict[tuple, torch.Tensor] = field(default_factory=dict)  # per tuple of layer shapes: int32 [P, 9]


_SETS: dict[tuple, _Set] = {}


def forget(maps: BlockMaps) -> None:
    """Drop the kept sets made from ``maps`` (its store is cleared: the block or the request ended)."""
    for key in [key for key, held in _SETS.items() if any(m is maps for m in held.maps)]:
        del _SETS[key]


@dataclass(frozen=True, eq=False)
class SetOperands:
    """One layer of several stores, side by side (module doc).

    Attributes:
        ops: the concatenated operands (``num_slots`` the total; ``k_row`` None unless the stores protect tokens).
        slot_of: int32 ``[R_all, T_max]``; group_of_slot: int32 ``[N_all]``.
        rows: int32 ``[R]``, each query row's row of ``slot_of``; part_of_row: int32 ``[R]``, its store.
        info: int32 ``[P, PART_INFO]``.
        longest: T_max, the longest reused length.
    """

    ops: KernelOperands
    slot_of: torch.Tensor
    group_of_slot: torch.Tensor
    rows: torch.Tensor
    part_of_row: torch.Tensor
    info: torch.Tensor
    longest: int


def _set(maps: tuple[BlockMaps, ...]) -> _Set:
    key = tuple(id(m) for m in maps)
    held = _SETS.get(key)
    if held is not None and all(a is b for a, b in zip(held.maps, maps)):
        return held
    longest = max(m.slot_of.shape[1] for m in maps)
    slot_of = torch.cat([F.pad(m.slot_of, (0, longest - m.slot_of.shape[1]), value=-1) for m in maps])
    device = slot_of.device
    counts = [m.slot_of.shape[0] for m in maps]
    part_of_row = torch.tensor([p for p, count in enumerate(counts) for _ in range(count)], dtype=torch.int32)
    held = _Set(maps, slot_of, torch.cat([m.group_of_slot for m in maps]),
                torch.arange(slot_of.shape[0], dtype=torch.int32, device=device), part_of_row.to(device))
    if len(_SETS) >= _KEPT_SETS:
        del _SETS[next(iter(_SETS))]
    _SETS[key] = held
    return held


def _info(shapes: tuple, bits: int, heads: int, head_dim: int, device: torch.device) -> torch.Tensor:
    """int32 ``[P, PART_INFO]`` (module doc) from each store's (window width, reused length, slots, K groups,
    protected rows, K stream bytes held, V stream bytes held, K codes)."""
    table, slot0, group0, prot0, k_off, v_off = [], 0, 0, 0, 0, 0
    for width, reused, slots, groups, prot, k_bytes, v_bytes, k_codes in shapes:
        table.append([width, reused, slot0, group0, prot0, k_off, stream_bytes(k_codes, bits), v_off,
                      stream_bytes(slots * heads * head_dim, bits)])
        slot0, group0, prot0, k_off, v_off = slot0 + slots, group0 + groups, prot0 + prot, k_off + k_bytes, v_off + v_bytes
    return torch.tensor(table, dtype=torch.int32).to(device)


@dataclass(eq=False)
class _StoreSet:
    """:class:`_Set` made from the stores' block layouts (:func:`stores_side_by_side`), with, per tuple of protected
    counts, each protected entry's offset to its slot among all and what dLLM-KVQ's ``k_row`` subtracts."""

    layouts: tuple  # the stores' layouts they were made from (identity)
    slot_of: torch.Tensor
    group_of_slot: torch.Tensor
    rows: torch.Tensor
    part_of_row: torch.Tensor
    num_slots: list[int]
    info: dict[tuple, torch.Tensor] = field(default_factory=dict)
    protected: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    slots: torch.Tensor | None = None  # int64 arange of the set's slots (made at the first protected layer)


_STORE_SETS: dict[tuple, _StoreSet] = {}


def forget_layout(layout) -> None:
    """Drop the kept sets made from ``layout`` (its store is cleared: the block or the request ended)."""
    for key in [key for key, held in _STORE_SETS.items() if any(x is layout for x in held.layouts)]:
        del _STORE_SETS[key]


def _store_set(layouts: tuple) -> _StoreSet:
    """The set's maps, as :func:`_set` makes them from each store's `BlockMaps.from_layout`, built on the host
    from the layouts' runs (one tensor each, no per-store operation)."""
    key = tuple(id(x) for x in layouts)
    held = _STORE_SETS.get(key)
    if held is not None and all(a is b for a, b in zip(held.layouts, layouts)):
        return held
    longest = max(x.num_reused for x in layouts)
    slot_of, group_of_slot, part_of_row = [], [], []
    for p, layout in enumerate(layouts):
        grid = [[-1] * longest for _ in range(layout.batch_size)]
        groups = [0] * layout.num_slots
        for row, col, slot, length, group in layout.runs:
            grid[row][col:col + length] = range(slot, slot + length)
            groups[slot:slot + length] = [group + t // layout.group_size for t in range(length)]
        slot_of += grid
        group_of_slot += groups
        part_of_row += [p] * layout.batch_size
    device = layouts[0].rows.device
    held = _StoreSet(layouts, torch.tensor(slot_of, dtype=torch.int32).view(-1, longest).to(device),
                     torch.tensor(group_of_slot, dtype=torch.int32).to(device),
                     torch.arange(len(part_of_row), dtype=torch.int32, device=device),
                     torch.tensor(part_of_row, dtype=torch.int32).to(device), [x.num_slots for x in layouts])
    if len(_STORE_SETS) >= _KEPT_SETS:
        del _STORE_SETS[next(iter(_STORE_SETS))]
    _STORE_SETS[key] = held
    return held


def stores_side_by_side(stores: list, layer: int, widths: list[int], heads: int, head_dim: int) -> SetOperands:
    """:func:`side_by_side` of the stores' layers (`service.quant.store.QuantizedKVStore`, one uniform format, as
    their batch key says) made straight from what they hold, once per layer for all of them: the stores written
    together in one stacked write (`service.quant.base.joined`) give their codes and statistics as one piece
    each, the maps come from the layouts' host runs (once per set of blocks), and dLLM-KVQ's ``k_row`` is made
    for every slot at once. The same tensors, value for value, as :func:`side_by_side` of each store's
    ``kernel_operands`` and ``BlockMaps``; no operation per store.

    Raises:
        KVQuantError: a set with 2^31 or more code bytes or reused entries (the kernel indexes in int32).
    """
    from service.quant.base import count, joined, protected_offsets, stream_words

    quantizer = stores[0].quantizer
    bits = quantizer.bits
    packed = [store._packed[layer] for store in stores]
    ks, vs = [x.k.tensors for x in packed], [x.v.tensors for x in packed]
    protected = "protected_slots" in ks[0]
    held = _store_set(tuple(store._layout for store in stores))
    per_token = heads * head_dim
    counts = tuple(count(t, "protected_slots") for t in ks)
    shapes = tuple((w, layout.num_reused, layout.num_slots, layout.num_groups, prot,
                    4 * stream_words((layout.num_slots - prot) * per_token, bits),
                    4 * stream_words(layout.num_slots * per_token, bits), (layout.num_slots - prot) * per_token)
                   for w, layout, prot in zip(widths, held.layouts, counts))
    total_slots = sum(x[2] for x in shapes)
    if total_slots * per_token >= 2**31 or sum(x[5] + x[6] for x in shapes) >= 2**31:
        raise KVQuantError("a set of stores this large exceeds the kernel's int32 indices")
    if shapes not in held.info:
        held.info[shapes] = _info(shapes, bits, heads, head_dim, held.slot_of.device)
    device = held.slot_of.device

    def cat(tensors: list, name: str) -> torch.Tensor:
        pieces = [t for t, _, _ in joined(tensors, name)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    dummy = torch.zeros(1, dtype=torch.float32, device=device)
    dummy_index = torch.zeros(1, dtype=torch.int32, device=device)
    k_row, k_protected = None, dummy
    if protected:
        pieces = joined(ks, "protected_slots")
        key = (counts, tuple((first, shift) for _, first, shift in pieces))
        if key not in held.protected:
            offsets = protected_offsets(pieces, counts, held.num_slots)
            # per protected entry: its row among its store's protected values; per slot: the unprotected slots of
            # the stores before its own (its store's code rows count from there)
            entry_base, slot_base, prot0, slot0 = [], [], 0, 0
            for n, p in zip(held.num_slots, counts):
                entry_base += [prot0] * p
                slot_base += [slot0 - prot0] * n
                prot0, slot0 = prot0 + p, slot0 + n
            if held.slots is None:
                held.slots = torch.arange(slot0, device=device)
            # `uniform_operands` of each store: an unprotected slot's code row is its index less the protected
            # slots before it, counted from its store's first slot (its slot among all, less the searched count,
            # less the unprotected slots of the stores before); a protected slot's -1 - its row among the store's
            # protected values. Both constant parts made once per tuple of counts.
            rows = [slot - base for slot, base in enumerate(slot_base)]
            entries = [base - 1 - e for e, base in enumerate(entry_base)]
            host = torch.tensor(offsets, dtype=torch.int64).to(device)
            held.protected[key] = (host, torch.tensor(rows, dtype=torch.int32).to(device),
                                   torch.tensor(entries, dtype=torch.int32).to(device))
        offsets, rows_less, entries = held.protected[key]
        slots = offsets + (pieces[0][0] if len(pieces) == 1 else torch.cat([t for t, _, _ in pieces]))  # int64
        k_row = rows_less - torch.searchsorted(slots, held.slots, out_int32=True)
        k_row[slots] = entries
        k_protected = cat(ks, "protected_values")
    ops = KernelOperands(
        fmt="uniform", bits=bits, num_slots=total_slots,
        k_codes=cat(ks, "codes").view(torch.uint8), v_codes=cat(vs, "codes").view(torch.uint8), k_row=k_row,
        k_scale=cat(ks, "scale"), k_mn=cat(ks, "mn"), k_protected=k_protected, k_lut=dummy,
        k_outlier_index=dummy_index, k_outlier_values=dummy,
        v_scale=cat(vs, "scale"), v_mn=cat(vs, "mn"), v_lut=dummy, v_outlier_index=dummy_index, v_outlier_values=dummy,
        v_group_size=quantizer.v_group_size,
    )
    return SetOperands(ops, held.slot_of, held.group_of_slot, held.rows, held.part_of_row, held.info[shapes],
                       held.slot_of.shape[1])


def side_by_side(parts: list[tuple[KernelOperands, BlockMaps]], widths: list[int], heads: int,
                 head_dim: int) -> SetOperands:
    """One layer of ``parts`` (each store's operands and block maps, every row of each in order) side by side.

    Args:
        parts: per store, its layer's operands and its block's maps; uniform format (KIVI, dLLM-KVQ), one bits,
            one V group size, all protecting tokens or none.
        widths: per store, its fresh window's width (columns of the window K/V it reads).
        heads, head_dim: the K/V heads and channels.

    Raises:
        KVQuantError: a KVQuant (nuq) part, parts that disagree on the format, or a set with 2^31 or more code
            bytes or reused entries (the kernel indexes in int32).
    """
    first = parts[0][0]
    protected = first.k_row is not None
    for ops, _ in parts:
        if ops.fmt != "uniform" or (ops.bits, ops.v_group_size, ops.k_row is not None) != (
                first.bits, first.v_group_size, protected):
            raise KVQuantError("stores attended in one launch must share one uniform format (bits, V group size, "
                               "protected tokens or not)")
    held = _set(tuple(maps for _, maps in parts))
    shapes = tuple((w, maps.slot_of.shape[1], ops.num_slots, ops.k_scale.shape[0],
                    ops.k_protected.shape[0] if protected else 0, ops.k_codes.numel(), ops.v_codes.numel(),
                    k_code_count(ops, heads, head_dim))
                   for (ops, maps), w in zip(parts, widths))
    total_slots = sum(s[2] for s in shapes)
    if total_slots * heads * head_dim >= 2**31 or sum(s[5] + s[6] for s in shapes) >= 2**31:
        raise KVQuantError("a set of stores this large exceeds the kernel's int32 indices")
    if shapes not in held.info:
        held.info[shapes] = _info(shapes, first.bits, heads, head_dim, held.slot_of.device)
    opss = [ops for ops, _ in parts]
    ops = KernelOperands(
        fmt="uniform", bits=first.bits, num_slots=total_slots,
        k_codes=torch.cat([o.k_codes for o in opss]), v_codes=torch.cat([o.v_codes for o in opss]),
        k_row=torch.cat([o.k_row for o in opss]) if protected else None,
        k_scale=torch.cat([o.k_scale for o in opss]), k_mn=torch.cat([o.k_mn for o in opss]),
        k_protected=torch.cat([o.k_protected for o in opss]) if protected else first.k_protected,
        k_lut=first.k_lut, k_outlier_index=first.k_outlier_index, k_outlier_values=first.k_outlier_values,
        v_scale=torch.cat([o.v_scale for o in opss]), v_mn=torch.cat([o.v_mn for o in opss]), v_lut=first.v_lut,
        v_outlier_index=first.v_outlier_index, v_outlier_values=first.v_outlier_values,
        v_group_size=first.v_group_size,
    )
    return SetOperands(ops, held.slot_of, held.group_of_slot, held.rows, held.part_of_row, held.info[shapes],
                       held.slot_of.shape[1])
