"""One dequantization for the rows of many KVQuant stores: a later step's reused K/V of several stores of one KVQuant
configuration in one set of tensor operations per layer (`KVStore.window_kv_batch`, issue 21).

`service.quant.rows` pools the uniform formats; KVQuant (`service.quant.kvquant`) differs in three ways, each
handled here with the per-store path's arithmetic, so the values are the same bit for bit:

* **codebooks**: every store of one state (the batch key names it) decodes through the same per-layer K and V
  per-byte tables (`packing.byte_table` of the codebooks); the K and V streams of all stores with the same number
  of reused tokens are stacked and decoded in one gather through the two tables side by side (V's bytes read the
  second half). Stores of different lengths pool too: the work buffer holds them in order of their slot counts,
  one decoding gather per distinct count;
* **ranges and outliers**: K's static per-channel ``lut[code] * half_range + offset`` applies to every slot at
  once, V's per-token ranges are concatenated; the sparse outliers of all stores (rows of a fixed capacity per
  token, `service.quant.kvquant.row_outliers`, laid end to end in the buffer's slot order, so a place is its
  row's first entry plus its column; free places go to the spare row) are written over their entries as
  float32, after the ranges, as each store does (`KVQuantQuantizer._finish`);
* **pre-RoPE keys**: the values are cast to the model dtype, as each store's scratch holds them, and the keys
  rotated there with the cos/sin of each slot's own position: each store's tables made exactly as its own
  `window_kv` makes them (``rope.cos_sin`` of its reused prefix positions and of its reused suffix positions,
  `QuantizedKVStore._rope_for`), gathered per slot, and `RotaryEmbedding.rotate_in_place` (float32 for LLaDA's
  ``full_precision``, the model dtype for Dream).

One gather then puts every slot at its row and sequence column of a ``[R, H, key_len, D]`` pair (zeros elsewhere),
as `service.quant.rows` does. The slot map, the per-slot cos/sin (``N_all x D`` each, the size of the stores' own
tables) depend only on the stores' block layouts and positions, so they are made
at the first later step of a block and kept (:data:`_INDEXES`, a few entries, dropped by :func:`forget` when a
store is cleared); nothing dequantized is kept.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from service.quant.base import PackedLayer, device_of, joined
from service.quant.packing import stream_words

#: Per (state, layer, device): the K and V per-byte codebook tables side by side, ``[8 / b, 512]`` float32.
_CODEBOOKS: dict[tuple[Hashable, int, torch.device], torch.Tensor] = {}


def batch_key(store, packed: PackedLayer) -> Hashable:
    """What must agree for two KVQuant stores' layers to be dequantized together: the state (its id, as the store
    recorded it), bits, dtype, heads and device. Reused lengths may differ (module doc)."""
    quantizer = store.quantizer
    state = store.artifact_id if store.artifact_id is not None else id(quantizer.state)
    return ("kvquant", state, quantizer.bits, packed.dtype, packed.num_heads, packed.head_dim,
            device_of(packed.k.tensors))


@dataclass(eq=False)
class _Index:
    """What a set of stores' block layouts and reused positions fix for every layer and step of the block."""

    layouts: tuple  # the layouts it was made from (identity)
    positions: tuple  # the reused positions the cos/sin were made from (identity)
    groups: list[tuple[int, list[int], int]]  # (slots per store, stores, first slot) per distinct slot count
    total: int  # N_all, the slots of all stores; the work buffer's row N_all is zero
    slot_map: torch.Tensor  # int64 [R x key_len]: per (row, column) its slot in the work buffer, N_all for none
    cos: torch.Tensor  # [N_all, 1, D]: each slot's RoPE cos (float32; the model dtype when RoPE runs in it)
    sin: torch.Tensor
    slot_positions: torch.Tensor  # int64 [N_all]: each slot's RoPE position
    angles: tuple[torch.Tensor, torch.Tensor] | None = None  # the key-bias correction's cos/sin per column


#: Recently used indexes, by the identities of the stores' layouts and the key length.
_INDEXES: dict[tuple, _Index] = {}
_KEPT_INDEXES = 8


def forget(layout) -> None:
    """Drop the kept indexes made from ``layout`` (its store is cleared: the block or the request ended)."""
    for key in [key for key, index in _INDEXES.items() if any(held is layout for held in index.layouts)]:
        del _INDEXES[key]


def _index(stores: list, positions: list[torch.Tensor], rope, key_len: int, dtype: torch.dtype, c: int) -> _Index:
    """The kept index of ``stores`` (made now if none is kept); ``c`` = H x D, the entries per slot."""
    layouts = [store._layout for store in stores]
    key = (tuple(id(layout) for layout in layouts), key_len, dtype)
    held = _INDEXES.get(key)
    if (held is not None and all(a is b for a, b in zip(held.layouts, layouts))
            and all(a is b for a, b in zip(held.positions, positions))):
        return held
    device = layouts[0].rows.device
    # Work order: by slot count, so the streams of one length are stacked and decoded in one gather.
    order = sorted(range(len(stores)), key=lambda i: layouts[i].num_slots)
    base, groups, total = [0] * len(stores), [], 0
    for i in order:
        n = layouts[i].num_slots
        base[i] = total
        if n and groups and groups[-1][0] == n:
            groups[-1][1].append(i)
        elif n:
            groups.append((n, [i], total))
        total += n
    # Built on the host from the layouts' runs (a handful of device operations per block, not per store): each
    # slot's place on the forward's key axis, and its position's place in the stores' positions laid end to end.
    slot_map = [total] * (sum(layout.batch_size for layout in layouts) * key_len)
    row0, first = [0] * len(stores), [0] * len(stores)
    for i in range(1, len(stores)):
        row0[i] = row0[i - 1] + layouts[i - 1].batch_size
        first[i] = first[i - 1] + positions[i - 1].numel()
    at = []
    for i in order:
        layout, reused, seg = layouts[i], positions[i], stores[i]._segments
        for (row, col, slot, length, _), (_, seq_col, _, _, _) in zip(layout.runs, layout.on_sequence(seg).runs):
            where = (row0[i] + row) * key_len + seq_col
            slot_map[where : where + length] = range(base[i] + slot, base[i] + slot + length)
            at.extend(range(first[i] + row * reused.shape[1] + col, first[i] + row * reused.shape[1] + col + length))
    # RoPE's cos/sin of every slot's position in one call: elementwise the same float32 values as the tables
    # each store's window_kv makes of its prefix and suffix positions (`QuantizedKVStore._rope_for`), as the
    # model's own position table is (`RotaryEmbedding.table`).
    flat = torch.cat([reused.reshape(-1) for reused in positions])
    slot_positions = flat.index_select(0, torch.tensor(at, dtype=torch.int64, device=device))
    cos, sin = (t[0, 0][:, None] for t in rope.cos_sin(slot_positions[None]))  # [N_all, 1, D]
    if not rope.full_precision:  # rotate_in_place casts them to the model dtype at every call otherwise
        cos, sin = cos.to(dtype), sin.to(dtype)
    index = _Index(tuple(layouts), tuple(positions), groups, total,
                   torch.tensor(slot_map, dtype=torch.int64, device=device), cos, sin,
                   slot_positions)
    if len(_INDEXES) >= _KEPT_INDEXES:
        del _INDEXES[next(iter(_INDEXES))]
    _INDEXES[key] = index
    return index


def _codebooks(store, layer: int, device: torch.device, steps: bool = False) -> torch.Tensor:
    """``[8 / b, 512]``: the layer's K per-byte table, then its V table (`KVQuantQuantizer._tables`); with
    ``steps`` ``[8 / b, 768]``, the K codes' bin widths third (`KVQuantQuantizer.width_table`)."""
    quantizer = store.quantizer
    key = (store.artifact_id if store.artifact_id is not None else id(quantizer.state), layer, device, steps)
    if key not in _CODEBOOKS:
        _, _, k_table, v_table = quantizer._tables(layer, device)
        tables = [k_table, v_table, quantizer.width_table(layer, device)] if steps else [k_table, v_table]
        _CODEBOOKS[key] = torch.cat(tables, dim=1)
    return _CODEBOOKS[key]


def _decode_into(dst: torch.Tensor, words: list[torch.Tensor], table: torch.Tensor) -> None:
    """Write the codebook values of the K streams then the V streams (all of one length; ``words`` K's first, as
    many of each; with the key steps, the K streams once more, decoded through the widths) into ``dst`` float32
    ``[s, g, numel]``: one concatenation, one gather through ``table`` (the bytes of set ``i`` moved to its
    ``i``-th 256 entries), one copy (the planar layout of `packing.pack_stream`: plane ``p`` of stream ``i`` is its
    codes ``[p m, (p + 1) m)``). ``words``: int32 ``[streams, stream words]`` pieces (several stores' streams laid
    end to end in one stacked write are one piece, `_stream_pieces`)."""
    per_byte, numel = table.shape[0], dst.shape[-1]
    m = -(-numel // per_byte)
    data = (torch.cat(words) if len(words) > 1 else words[0]).view(torch.uint8)[:, :m].to(torch.int32)
    g = dst.shape[1]
    for i in range(1, dst.shape[0]):
        data[i * g : (i + 1) * g] += 256 * i
    planes = table.index_select(1, data.view(-1)).view(per_byte, *dst.shape[:-1], m).movedim(0, -2)
    if per_byte * m == numel:
        dst.view(*dst.shape[:-1], per_byte, m).copy_(planes)
    else:
        dst.copy_(planes.reshape(*dst.shape[:-1], per_byte * m)[..., :numel])


def dequantize_rows(
    stores: list, layer: int, key_len: int, positions: list[torch.Tensor], rope, steps: bool = False
) -> tuple[torch.Tensor, ...]:
    """``QuantizedKVStore.window_kv_batch`` for KVQuant stores (module doc).

    Args:
        stores: KVQuant stores with one `batch_key` at ``layer``, every row of each taking part.
        layer: the layer, written in each store's block-initial pass.
        key_len: the key axis of the forward (at least every store's sequence length).
        positions: per store, int64 ``[B, T_reused]`` RoPE positions of its reused columns (the tensor its
            ``window_kv`` would get; identity is what the kept index checks).
        rope: the model's `RotaryEmbedding`.

        steps: also give each key's rounding steps for the key-bias correction (`service.quant.key_bias`).

    Returns:
        K (post-RoPE) and V ``[R, H, key_len, D]``, model dtype, R the stores' rows in order, zeros outside each
        row's reused columns: bit for bit what each store's ``window_kv`` holds at those columns. With
        ``steps`` three more: float32 ``[R, H, key_len, D]`` the steps in the pre-RoPE basis (each store's
        ``KVQuantQuantizer.key_steps`` at its places: bin width x half range, 0 for an outlier and outside the
        reused columns), and float32 ``[R, 1, key_len, D]`` cos and sin of each column's RoPE angle (what
        `service.quant.key_bias.key_score_bias` rotates the query back by; any value where the step is 0).
    """
    quantizer = stores[0].quantizer
    packed: list[PackedLayer] = [store._packed[layer] for store in stores]
    first = packed[0]
    h, d, dtype = first.num_heads, first.head_dim, first.dtype
    c = h * d
    device = device_of(first.k.tensors)
    index = _index(stores, positions, rope, key_len, dtype, c)
    n_all = index.total
    planes = 3 if steps else 2  # K, V, and K's steps (bin widths)
    work = torch.empty(planes, n_all + 1, c, dtype=torch.float32, device=device)
    table = _codebooks(stores[0], layer, device, steps)
    for n, members, slot0 in index.groups:
        words = (_stream_pieces([packed[i].k.tensors for i in members], n * c, quantizer.bits)
                 + _stream_pieces([packed[i].v.tensors for i in members], n * c, quantizer.bits))
        words += words[: len(words) // 2] if steps else []
        _decode_into(work[:, slot0 : slot0 + len(members) * n].view(planes, len(members), n * c), words, table)
    order = [i for _, members, _ in index.groups for i in members]
    offset, half_range = quantizer._tables(layer, device)[:2]
    work[0, :-1].mul_(half_range).add_(offset)
    if steps:
        work[2, :-1].mul_(half_range)
    if n_all:
        v_sides = [packed[i].v.tensors for i in order]
        v_half_range = _cat([t for t, _, _ in joined(v_sides, "half_range")])
        v_offset = _cat([t for t, _, _ in joined(v_sides, "offset")])
        work[1, :-1].mul_(v_half_range[:, None]).add_(v_offset[:, None])
    # Outliers after the ranges, as each store writes them (`KVQuantQuantizer._finish`): the stores' outlier rows
    # in work order are the work buffer's rows, so each place is its row's first entry plus its column; the free
    # places write into the spare row N_all, zeroed after.
    for plane, side in ((0, "k"), (1, "v")):
        held = [getattr(packed[i], side).tensors for i in order]
        cols = _rows_of(held, "outlier_index", -1)
        if cols.shape[1] == 0:
            continue
        at = outlier_places(cols, c).add_(plane * (n_all + 1) * c)
        work.view(-1).index_put_((at.view(-1),), _rows_of(held, "outlier_values", 0).reshape(-1).to(torch.float32))
        if steps and plane == 0:  # an outlier is held exact: no step (plane 2 lies two planes past K's)
            work.view(-1).index_fill_(0, at.view(-1) + 2 * (n_all + 1) * c, 0.0)
    work[:, -1].zero_()
    # The store's scratch holds the values in the model dtype; its keys are rotated there.
    kv = work[:2].to(dtype).view(2, n_all + 1, h, d)
    rope.rotate_in_place(kv[0, :n_all], index.cos, index.sin)
    total_rows = index.slot_map.numel() // key_len
    out = torch.empty(2, total_rows, h, key_len, d, dtype=dtype, device=device)
    out.copy_(kv.index_select(1, index.slot_map).view(2, total_rows, key_len, h, d).permute(0, 1, 3, 2, 4))
    if not steps:
        return out[0], out[1]
    placed = work[2].view(n_all + 1, h, d).index_select(0, index.slot_map).view(total_rows, key_len, h, d)
    cos, sin = _column_angles(index, rope, total_rows, key_len)
    return out[0], out[1], placed.permute(0, 2, 1, 3), cos, sin


def _cat(pieces: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def _stream_pieces(sides: list, numel: int, bits: int) -> list[torch.Tensor]:
    """The code streams of ``sides`` (one side of stores with ``numel`` codes each) as int32 ``[streams, words]``
    pieces in order: the stores written together and consecutive here are one piece, a view of their stacked
    write's words (each member's stream is whole words, laid end to end: `packing.pack_streams`), not a slice
    each (`service.quant.base.joined`)."""
    words = stream_words(numel, bits)
    return [t.view(-1, words) for t, _, _ in joined(sides, "codes")]


def outlier_places(cols: torch.Tensor, c: int) -> torch.Tensor:
    """int64 ``[N, cap]``: the flat index into ``[N + 1, C]`` entries (``row x C + column``) of each outlier of
    KVQuant's rows ``cols`` (`service.quant.kvquant.row_outliers`), a free place's (-1) into the spare row ``N``
    (its first entry), which the reader zeroes or leaves out."""
    n = cols.shape[0]
    rows = torch.arange(0, n * c, c, dtype=torch.int64, device=cols.device)[:, None]
    return (cols + rows).masked_fill_(cols < 0, n * c)


def _rows_of(held: list, name: str, free: int) -> torch.Tensor:
    """``held``'s outlier rows ``name`` laid end to end (`joined`: one piece per run of a stacked write's members),
    each piece widened with ``free`` to the widest capacity where they differ."""
    pieces = [t for t, _, _ in joined(held, name)]
    widest = max(p.shape[1] for p in pieces)
    pieces = [p if p.shape[1] == widest else torch.nn.functional.pad(p, (0, widest - p.shape[1]), value=free)
              for p in pieces]
    return _cat(pieces)


def _column_angles(index: _Index, rope, rows: int, key_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``[R, 1, key_len, D]`` cos and sin of each column's reused position (1 and 0 where no slot),
    made once per index: the values `QuantizedKVStore._attend_corrected` takes from ``rope.cos_sin``."""
    if index.angles is None:
        cos, sin = (t[0, 0] for t in rope.cos_sin(index.slot_positions[None]))  # [N_all, D] float32
        cos = torch.cat([cos, torch.ones_like(cos[:1])]).index_select(0, index.slot_map)
        sin = torch.cat([sin, torch.zeros_like(sin[:1])]).index_select(0, index.slot_map)
        index.angles = (cos.view(rows, 1, key_len, -1), sin.view(rows, 1, key_len, -1))
    return index.angles
