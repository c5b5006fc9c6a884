"""One dequantization for the rows of many requests: a later step's reused K/V of several quantized stores of the
same kind in one set of tensor operations per layer (`KVStore.window_kv_batch`, issue 21).

A running batch attends all its rows in one call per layer; each request's store dequantizing its own layer costs
about a hundred tensor operations per layer and request, each a kernel launch on a GPU. Stores of the same uniform
format (KIVI's, dLLM-KVQ's: same method, bits, group sizes, dtype and heads) whose packed streams have the same
length (the same number of reused tokens and protected tokens) are read together instead:

* the packed code streams are stacked ``[S, words]`` and decoded through the per-byte table of the codes as floats
  in one gather (`service.quant.packing.decode_stream`'s planar layout, stream by stream), K and V alike;
* K's per-group and V's per-token statistics of all stores are concatenated and applied to every slot at once:
  ``float32(code) * float32(scale) + float32(mn)``, the arithmetic of the per-store path, so the values are the
  same bit for bit; dLLM-KVQ's protected tokens are written over their slots as float32 (exact for the model's
  dtypes) before the cast;
* one gather puts every slot at its row and sequence column of a ``[R, H, key_len, D]`` pair (zeros elsewhere).

The index tensors of a set of stores (where each slot goes, its K group, where protected tokens' codes are missing)
depend only on the stores' block layouts and protected slots, so they are made at a layer's first later step of a
block and kept (:data:`_INDEXES`, a few entries). Nothing dequantized is kept: the pair is made anew at every step,
as each store's own scratch is.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from service.quant.base import KVQuantizer, PackedLayer, _code_rows
from service.quant.packing import byte_table
from service.quant.uniform import _affine_

#: Per (bits, device): the stream's per-byte table of the codes themselves as float32 (`packing.byte_table`).
_TABLES: dict[tuple[int, torch.device], torch.Tensor] = {}


def batch_key(quantizer: KVQuantizer, packed: PackedLayer, num_slots: int) -> Hashable:
    """What must agree for two stores' layers to be dequantized together (module doc)."""
    k, v = packed.k.tensors, packed.v.tensors
    protected = k["protected_slots"].numel() if "protected_slots" in k else 0
    return (type(quantizer).__name__, quantizer.bits, quantizer.k_group_size, quantizer.v_group_size, packed.dtype,
            packed.num_heads, packed.head_dim, num_slots, protected, k["codes"].numel(), v["codes"].numel(),
            k["codes"].device)


@dataclass(eq=False)
class _Index:
    """Index tensors of one set of stores' block layouts (and, per layer, their protected slots)."""

    layouts: tuple  # the layouts they were made from (identity)
    slot_map: torch.Tensor  # int64 [R x key_len]: per (row, column) its slot among all stores', N_all for none
    group_of_slot: torch.Tensor  # int64 [N_all]: each slot's K group among all stores' groups
    protected: dict[int, tuple[torch.Tensor, torch.Tensor]]  # per layer: (code rows [N_all + 1], protected slots)


#: Recently used indexes, by the identities of the stores' layouts and the key length.
_INDEXES: dict[tuple, _Index] = {}
_KEPT_INDEXES = 8


def forget(layout) -> None:
    """Drop the kept indexes made from ``layout`` (its store is cleared: the block or the request ended)."""
    for key in [key for key, index in _INDEXES.items() if any(held is layout for held in index.layouts)]:
        del _INDEXES[key]


def _index(layouts: list, segments: list, key_len: int) -> _Index:
    key = (tuple(id(layout) for layout in layouts), key_len)
    held = _INDEXES.get(key)
    if held is not None and all(a is b for a, b in zip(held.layouts, layouts)):
        return held
    device = layouts[0].rows.device
    n = layouts[0].num_slots
    total_rows = sum(layout.batch_size for layout in layouts)
    slot_map = torch.full((total_rows * key_len,), n * len(layouts), dtype=torch.int64, device=device)
    groups, row0, group0 = [], 0, 0
    for s, (layout, seg) in enumerate(zip(layouts, segments)):
        seq = layout.on_sequence(seg)
        slot_map[(seq.rows + row0) * key_len + seq.cols] = torch.arange(s * n, (s + 1) * n, device=device)
        groups.append(layout.group_of_slot + group0)
        row0 += layout.batch_size
        group0 += layout.num_groups
    index = _Index(tuple(layouts), slot_map, torch.cat(groups), {})
    if len(_INDEXES) >= _KEPT_INDEXES:
        del _INDEXES[next(iter(_INDEXES))]
    _INDEXES[key] = index
    return index


def _protected(index: _Index, layer: int, packed: list[PackedLayer], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 ``[S x n + 1]`` the row of each slot among all stores' codes, the zero row for a protected slot and
    the spare last entry; int64 ``[S x p]`` the protected slots among all stores'), made at the layer's first
    later step of the block. Each store protects the same number ``p`` of its ``n`` slots (the batch key) and its
    codes follow the previous stores', so a slot's code row is its index among all slots less the protected
    slots before it, as within one store (`service.quant.base._code_rows`)."""
    if layer not in index.protected:
        held = torch.stack([x.k.tensors["protected_slots"] for x in packed]).long()  # [S, p]
        slots = (held + torch.arange(0, len(packed) * n, n, device=held.device)[:, None]).view(-1)
        index.protected[layer] = (_code_rows(slots, len(packed) * n), slots)
    return index.protected[layer]


def _decode_into(dst: torch.Tensor, words: list[torch.Tensor], bits: int) -> None:
    """Write the codes of the streams (all of one length) as floats into ``dst`` float32 ``[..., numel]`` (its
    leading dims, in C order, one per stream): one stack, one gather through the per-byte table, one copy."""
    key = (bits, words[0].device)
    if key not in _TABLES:
        _TABLES[key] = byte_table(torch.arange(2**bits, dtype=torch.float32, device=words[0].device), bits)
    table = _TABLES[key]
    per_byte, numel = table.shape[0], dst.shape[-1]
    m = -(-numel // per_byte)
    data = torch.stack(words).view(torch.uint8)[:, :m].reshape(-1).to(torch.int32)
    # plane p of stream i at [p, i]: moved to [i, p], which is stream i's codes in order (the planar layout)
    planes = table.index_select(1, data).view(per_byte, *dst.shape[:-1], m).movedim(0, -2)
    if per_byte * m == numel:
        dst.view(*dst.shape[:-1], per_byte, m).copy_(planes)
    else:
        dst.copy_(planes.reshape(*dst.shape[:-1], per_byte * m)[..., :numel])


def dequantize_rows(stores: list, layer: int, key_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``QuantizedKVStore.window_kv_batch`` (module doc): ``[R, H, key_len, D]`` K and V of every row of
    ``stores`` (all with one `batch_key`), model dtype, zeros outside the reused columns.

    K and V share one float32 work buffer ``[2, S x n + 1, H, D]`` (each with a zero last row) and one placing
    gather; without protected tokens their streams have one length and are decoded in one gather too."""
    quantizer = stores[0].quantizer
    packed: list[PackedLayer] = [store._packed[layer] for store in stores]
    first = packed[0]
    h, d, bits = first.num_heads, first.head_dim, quantizer.bits
    layouts = [store._layout for store in stores]
    n, s = layouts[0].num_slots, len(stores)
    index = _index(layouts, [store._segments for store in stores], key_len)
    total_rows = index.slot_map.numel() // key_len
    protected = "protected_slots" in first.k.tensors
    p = first.k.tensors["protected_slots"].numel() if protected else 0

    work = torch.empty(2, s * n + 1, h, d, dtype=torch.float32, device=first.k.tensors["codes"].device)
    k_words, v_words = [x.k.tensors["codes"] for x in packed], [x.v.tensors["codes"] for x in packed]
    if not protected:
        _decode_into(work[:, : s * n].view(2, s, n * h * d), k_words + v_words, bits)
    else:  # K: codes of the unprotected slots, then every slot's (a protected one reads the zero row)
        codes = work.new_empty(s * (n - p) + 1, h, d)
        _decode_into(codes[:-1].view(s, (n - p) * h * d), k_words, bits)
        codes[-1].zero_()
        code_rows, slots = _protected(index, layer, packed, n)
        torch.index_select(codes, 0, code_rows, out=work[0])
        _decode_into(work[1, : s * n].view(s, n * h * d), v_words, bits)
    work[:, -1].zero_()
    k_work, v_work = work[0], work[1]
    scale = torch.cat([x.k.tensors["scale"] for x in packed])
    mn = torch.cat([x.k.tensors["mn"] for x in packed])
    _affine_(k_work[:-1], scale.index_select(0, index.group_of_slot), mn.index_select(0, index.group_of_slot))
    if protected:
        values = torch.cat([x.k.tensors["protected_values"] for x in packed])
        k_work.index_copy_(0, slots, values.to(torch.float32))
    # V: per token over channel groups.
    v_scale = torch.cat([x.v.tensors["scale"] for x in packed])
    v_mn = torch.cat([x.v.tensors["mn"] for x in packed])
    groups = v_scale.shape[-1]
    _affine_(v_work[:-1].view(s * n, h, groups, d // groups), v_scale[:, :, :, None], v_mn[:, :, :, None])
    # Every (row, column) its slot's K and V, the zero rows where none; one gather, one transposing copy.
    out = torch.empty(2, total_rows, h, key_len, d, dtype=first.dtype, device=work.device)
    out.copy_(work.index_select(1, index.slot_map).view(2, total_rows, key_len, h, d).permute(0, 1, 3, 2, 4))
    return out[0], out[1]
