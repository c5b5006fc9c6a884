"""One dequantization for the rows of many requests: a later step's reused K/V of several quantized stores of one
uniform format in one set of tensor operations per layer (`KVStore.window_kv_batch`, issue 21).

A running batch attends all its rows in one call per layer; each request's store dequantizing its own layer costs
tens of tensor operations per layer and request, each a kernel launch on a GPU. Stores of one uniform format
(KIVI's, dLLM-KVQ's: same method, bits, group sizes, dtype and heads; :func:`batch_key`) are read together
**whatever their lengths**: their numbers of rows, reused tokens and protected tokens may all differ. Nothing is
copied into a shared pool at write time; a layer's read is

* one concatenation of every store's packed code stream (V's, then K's, after one zero word), decoded byte by
  byte through the per-byte table of the codes as floats (`service.quant.packing.byte_table`, transposed):
  ``planes[byte, plane]`` is the value of the code that plane ``plane`` of stream byte ``byte`` holds;
* one ``take`` of ``planes`` with an element index that puts each code of K and V straight at its place in the
  ``[2, R, H, key_len, D]`` result (row ``r`` of the forward, its sequence column): code ``i`` of a stream at byte
  offset ``o`` with ``m`` bytes lives at ``planes[o + i mod m, i div m]`` (the planar layout of
  `service.quant.packing.pack_stream`); the columns without a slot (padding, the active window, columns past a
  row's sequence) read the zero word;
* one concatenation of K's statistics (scales, then minima) and one of V's, flattened into one table with a zero
  after them, and one ``take`` that gives each element its scale and minimum (K: its token group's, per channel;
  V: its token's, per channel group); then ``float32(code) * float32(scale) + float32(mn)`` in place: the
  arithmetic of the per-store path, so the values are the same bit for bit (zero where there is no slot);
* one cast to the model dtype (none for float32), and for dLLM-KVQ its protected K tokens written over their
  places in the model dtype, as the per-store path writes them.

The index tensors of a set of stores (where each code and statistic goes) depend only on the stores' block
layouts, the key length and (for dLLM-KVQ's K stream, whose length is the number of unprotected tokens) the code
counts, so they are made at the first later step of a block and kept (:data:`_INDEXES`, a few entries); only a
dLLM-KVQ layer's code rows (which slots it protected) are made per layer: a few row-sized operations. The element
indexes are int64 of the result's size, ``2 x R x H x key_len x D`` for the codes and twice that for the
statistics, so a set whose result is larger than :data:`MAX_ELEMENTS` is read in parts of consecutive stores.
Nothing dequantized is kept: the pair is made anew at every step, as each store's own scratch is.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from service.quant.base import KVQuantizer, PackedLayer, device_of, joined, protected_offsets
from service.quant.base import count as held_count
from service.quant.packing import byte_table

#: Elements of one part's result ``R x H x key_len x D`` (each of K and V); its cached int64 indexes hold six
#: times that many entries (48 bytes per element; 64 with dLLM-KVQ's per-layer copy of the code index).
MAX_ELEMENTS = 2**22

#: Per (bits, device): ``[256, 8 / b]``, the per-byte table of the codes as float32, byte-major.
_TABLES: dict[tuple[int, torch.device], torch.Tensor] = {}
#: Per device: one zero int32 word, the first word of the concatenated streams (what empty columns read).
_ZERO_WORDS: dict[torch.device, torch.Tensor] = {}
#: Per (dtype, device): one zero of the statistics' dtype.
_ZEROS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def batch_key(quantizer: KVQuantizer, packed: PackedLayer) -> Hashable:
    """What must agree for two stores' layers to be dequantized together: the format, not the lengths (module
    doc). Whether the layer holds protected tokens is part of it (dLLM-KVQ layers with ``p = 0`` hold none)."""
    k = packed.k.tensors
    return (type(quantizer).__name__, quantizer.bits, quantizer.k_group_size, quantizer.v_group_size, packed.dtype,
            packed.num_heads, packed.head_dim, "protected_slots" in k, device_of(k))


@dataclass(eq=False)
class _Index:
    """Index tensors of one set of stores' block layouts at one key length (module doc)."""

    layouts: tuple  # the layouts they were made from (identity)
    rows: int  # R
    num_slots: list[int]  # per store
    codes: torch.Tensor  # int64 [2, R, H, key_len, D]: each element's code in `planes` (K's: no protected tokens)
    stats: torch.Tensor  # int64 [2, 2, R, H, key_len, D]: (scale, mn) x (K, V), each element's in the table
    slot_map: torch.Tensor  # int64 [R x key_len]: each (row, column)'s slot among all stores', N_all for none
    slot_row: torch.Tensor  # int64 [N_all]: the row of each slot in the result
    slot_col: torch.Tensor  # int64 [N_all]: its column
    v_bytes: int  # bytes of the zero word and V's streams (K's streams follow)
    # Per tuple of K code counts (dLLM-KVQ: slots less protected tokens): per code row [N_codes + 1, H x D], the
    # positions of its codes in `planes` (the last row: the zero word's).
    k_rows: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)
    # Per tuple of protected counts: each protected entry's store's first slot among all (int64 [P]).
    offsets: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)
    layer_codes: torch.Tensor | None = None  # dLLM-KVQ: `codes` with K's part of the layer being read


#: Recently used indexes, by the identities of the stores' layouts and the key length. Few: one part's indexes
#: may take up to 64 x MAX_ELEMENTS bytes (256 MiB) that admission does not count, and a running batch whose
#: rows start blocks at different iterations changes its set of layouts at most iterations anyway.
_INDEXES: dict[tuple, _Index] = {}
_KEPT_INDEXES = 4


def forget(layout) -> None:
    """Drop the kept indexes made from ``layout`` (its store is cleared: the block or the request ended)."""
    for key in [key for key, index in _INDEXES.items() if any(held is layout for held in index.layouts)]:
        del _INDEXES[key]


def _zero(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[1]`` zero of the statistics' dtype, the last entry of the statistics table (what empty columns read)."""
    key = (dtype, device)
    if key not in _ZEROS:
        _ZEROS[key] = torch.zeros(1, dtype=dtype, device=device)
    return _ZEROS[key]


def _table(bits: int, device: torch.device) -> torch.Tensor:
    key = (bits, device)
    if key not in _TABLES:
        values = torch.arange(2**bits, dtype=torch.float32, device=device)
        _TABLES[key] = byte_table(values, bits).t().contiguous()
    return _TABLES[key]


def _zero_word(device: torch.device) -> torch.Tensor:
    if device not in _ZERO_WORDS:
        _ZERO_WORDS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return _ZERO_WORDS[device]


def _positions(local_rows: torch.Tensor, m: torch.Tensor, offset: torch.Tensor, width: int, per_byte: int
               ) -> torch.Tensor:
    """int64 ``[n, width]``: for code row ``local_rows[j]`` of a stream with ``m[j]`` bytes starting at byte
    ``offset[j]``, the position of each of its ``width`` codes in the flattened ``planes`` ``[M, per_byte]``:
    code ``i`` is at byte ``offset + i mod m``, plane ``i div m`` (`service.quant.packing.pack_stream`)."""
    i = local_rows[:, None] * width + torch.arange(width, device=local_rows.device)[None, :]
    m = m[:, None]
    return (offset[:, None] + i % m) * per_byte + torch.div(i, m, rounding_mode="floor")


def _stream_bytes(numel: int, per_byte: int) -> tuple[int, int]:
    """(``m``, the stream's bytes as held: whole int32 words) of a stream of ``numel`` codes."""
    m = -(-numel // per_byte)
    return m, 4 * -(-m // 4)


def _index(stores: list, key_len: int, h: int, d: int, per_byte: int, v_groups: int) -> _Index:
    layouts = tuple(store._layout for store in stores)
    key = (tuple(id(layout) for layout in layouts), key_len)
    held = _INDEXES.get(key)
    if held is not None and all(a is b for a, b in zip(held.layouts, layouts)):
        return held
    device = layouts[0].rows.device
    width = h * d
    # Host lists (the layouts' runs are on the host): per slot, its place, K group, store and row in its store.
    slot_pos, slot_row, slot_col, group, store_of, local = [], [], [], [], [], []
    row0 = group0 = 0
    num_slots = []
    for s, (store, layout) in enumerate(zip(stores, layouts)):
        for row, col, slot, length, g in layout.on_sequence(store._segments).runs:
            for t in range(length):
                slot_pos.append((row0 + row) * key_len + col + t)
                slot_row.append(row0 + row)
                slot_col.append(col + t)
                group.append(group0 + g + t // layout.group_size)
                store_of.append(s)
                local.append(slot + t)
        row0 += layout.batch_size
        group0 += layout.num_groups
        num_slots.append(layout.num_slots)
    n, rows = len(slot_pos), row0
    slot_map = [n] * (rows * key_len)
    for j, pos in enumerate(slot_pos):
        slot_map[pos] = j
    # V's streams: one code row per slot, after the zero word; then K's (KIVI's: the same lengths).
    stream_m, v_off, k_off, offset = [], [], [], 4
    for count in num_slots:
        m, held = _stream_bytes(count * width, per_byte)
        stream_m.append(m)
        v_off.append(offset)
        offset += held
    v_bytes = offset
    for count in num_slots:
        k_off.append(offset)
        offset += _stream_bytes(count * width, per_byte)[1]
    host = torch.tensor([slot_row, slot_col, group, local, [stream_m[s] for s in store_of],
                         [v_off[s] for s in store_of], [k_off[s] for s in store_of]],
                        dtype=torch.int64).view(7, n).to(device)
    slot_rows, slot_cols, groups, local_rows, m, off_v, off_k = host.unbind(0)
    num_groups = group0
    # Row tables [6, N + 1, H x D]: the code positions of K and V, then the statistics' (K's scale, V's scale, K's
    # minimum, V's minimum); the last row (no slot) the zero word and the table's zero.
    zero_stat = 2 * num_groups * width + 2 * n * h * v_groups
    tables = torch.zeros(6, n + 1, width, dtype=torch.int64, device=device)
    tables[2:, n] = zero_stat
    tables[0, :n] = _positions(local_rows, m, off_k, width, per_byte)
    tables[1, :n] = _positions(local_rows, m, off_v, width, per_byte)
    k_stat = groups[:, None] * width + torch.arange(width, device=device)[None, :]
    tables[2, :n] = k_stat
    tables[4, :n] = k_stat + num_groups * width
    # V's statistics [N, H, groups]: entry (slot, head, channel // group size).
    channel = torch.arange(width, device=device)
    v_stat = (2 * num_groups * width + torch.arange(n, device=device)[:, None] * (h * v_groups)
              + (channel // d * v_groups + channel % d // (d // v_groups))[None, :])
    tables[3, :n] = v_stat
    tables[5, :n] = v_stat + n * h * v_groups
    slot_map_t = torch.tensor(slot_map, dtype=torch.int64).to(device)
    placed = tables.index_select(1, slot_map_t).view(6, rows, key_len, h, d).permute(0, 1, 3, 2, 4).contiguous()
    index = _Index(layouts, rows, num_slots, placed[:2], placed[2:].view(2, 2, rows, h, key_len, d), slot_map_t,
                   slot_rows, slot_cols, v_bytes)
    if len(_INDEXES) >= _KEPT_INDEXES:
        del _INDEXES[next(iter(_INDEXES))]
    _INDEXES[key] = index
    return index


def _k_rows(index: _Index, counts: tuple[int, ...], width: int, per_byte: int) -> torch.Tensor:
    """int64 ``[N_codes + 1, H x D]``: the positions in ``planes`` of the K streams' code rows (store after
    store, ``counts`` rows each; the last row the zero word's), for K streams of those code counts."""
    if counts not in index.k_rows:
        device = index.slot_map.device
        m_k, off_k, local, offset = [], [], [], index.v_bytes
        for count in counts:
            m, held = _stream_bytes(count * width, per_byte)
            m_k += [m] * count
            off_k += [offset] * count
            local += range(count)
            offset += held
        host = torch.tensor([local, m_k, off_k], dtype=torch.int64).view(3, len(local)).to(device)
        rows = torch.zeros(len(local) + 1, width, dtype=torch.int64, device=device)
        rows[:-1] = _positions(host[0], host[1], host[2], width, per_byte)
        index.k_rows[counts] = rows
    return index.k_rows[counts]


def _code_rows(index: _Index, packed: list[PackedLayer], counts: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 ``[R x key_len]``: at each (row, column) its slot's row among all stores' K codes, the zero row
    ``N_codes`` where there is no slot; int64 ``[P]``: the protected slots among all stores').

    Stores' codes follow each other and each store's protected slots are sorted (`KVQuantizer.quantize_k`), so a
    slot's code row is its index among all slots less the protected slots before it, as within one store
    (`service.quant.base._code_rows`): one sorted search. A protected slot gets the next slot's row (or the zero
    row): its value is written over afterwards, so which finite code it reads does not matter."""
    pieces = joined([x.k.tensors for x in packed], "protected_slots")
    key = (counts, tuple((first, shift) for _, first, shift in pieces))
    if key not in index.offsets:
        starts = protected_offsets(pieces, counts, index.num_slots)
        index.offsets[key] = torch.tensor(starts, dtype=torch.int64).to(index.slot_map.device)
    slots = _cat([p for p, _, _ in pieces]) + index.offsets[key]
    return index.slot_map - torch.searchsorted(slots, index.slot_map), slots


def dequantize_rows(stores: list, layer: int, key_len: int, steps: bool = False) -> tuple[torch.Tensor, ...]:
    """``QuantizedKVStore.window_kv_batch`` (module doc): ``[R, H, key_len, D]`` K and V of every row of
    ``stores`` (all with one `batch_key`), model dtype, zeros outside the reused columns. A set whose result
    would exceed :data:`MAX_ELEMENTS` is read in parts (consecutive stores) whose rows are concatenated.

    With ``steps`` a third tensor, float32 ``[R, H, key_len, D]``: each reused key's rounding step per channel
    for the key-bias correction (`service.quant.key_bias`), what each store's ``KVQuantizer.key_steps`` gives at
    its place: K's group scale as float32, taken from the statistics this read gathers anyway; 0 for protected
    tokens and outside the reused columns."""
    first = stores[0]._packed[layer]
    per_row = first.num_heads * key_len * first.head_dim
    parts, current, rows = [], [], 0
    for store in stores:
        if current and (rows + store._layout.batch_size) * per_row > MAX_ELEMENTS:
            parts.append(current)
            current, rows = [], 0
        current.append(store)
        rows += store._layout.batch_size
    parts.append(current)
    if len(parts) == 1:
        return _dequantize_part(stores, layer, key_len, steps)
    got = [_dequantize_part(part, layer, key_len, steps) for part in parts]
    return tuple(torch.cat(side) for side in zip(*got))


def _dequantize_part(stores: list, layer: int, key_len: int, steps: bool) -> tuple[torch.Tensor, ...]:
    quantizer = stores[0].quantizer
    packed: list[PackedLayer] = [store._packed[layer] for store in stores]
    first = packed[0]
    h, d, bits, dtype = first.num_heads, first.head_dim, quantizer.bits, first.dtype
    device = device_of(first.k.tensors)
    table = _table(bits, device)
    per_byte = table.shape[1]
    v_groups = first.v.tensors["scale"].shape[-1]
    index = _index(stores, key_len, h, d, per_byte, v_groups)
    protected = "protected_slots" in first.k.tensors

    ks, vs = [x.k.tensors for x in packed], [x.v.tensors for x in packed]
    words = torch.cat([_zero_word(device), *_pieces(vs, "codes"), *_pieces(ks, "codes")])
    planes = table.index_select(0, words.view(torch.uint8).to(torch.int32))  # [M, 8 / b]
    if not protected:
        work = torch.take(planes, index.codes)  # [2, R, H, key_len, D]
    else:  # K's code positions at this layer's code rows, in the index's own buffer (V's part made once)
        counts = tuple(held_count(t, "protected_slots") for t in ks)
        code_rows, slots = _code_rows(index, packed, counts)
        k_counts = tuple(n - p for n, p in zip(index.num_slots, counts))
        k_codes = _k_rows(index, k_counts, h * d, per_byte).index_select(0, code_rows)
        if index.layer_codes is None:
            index.layer_codes = index.codes.clone()
        index.layer_codes[0].copy_(k_codes.view(index.rows, key_len, h, d).permute(0, 2, 1, 3))
        work = torch.take(planes, index.layer_codes)
    # The statistics of all stores in one flat table (K's scales then minima, V's likewise, then a zero).
    k_stats = torch.cat([*_pieces(ks, "scale"), *_pieces(ks, "mn")])
    v_stats = torch.cat([*_pieces(vs, "scale"), *_pieces(vs, "mn")])
    stats = torch.take(torch.cat([k_stats.view(-1), v_stats.view(-1), _zero(dtype, device)]), index.stats)
    if stats.dtype != torch.float32:  # (``to`` dispatches even when it has nothing to do)
        stats = stats.to(torch.float32)
    work.mul_(stats[0])
    work.add_(stats[1])
    out = work if dtype == torch.float32 else work.to(dtype)
    if protected:
        values = _cat(_pieces(ks, "protected_values"))
        rows, cols = index.slot_row.index_select(0, slots), index.slot_col.index_select(0, slots)
        out[0][rows, :, cols] = values
        if steps:  # a protected token is held exact: no step
            stats[0, 0][rows, :, cols] = 0.0
    k, v = out.unbind(0)
    return (k, v, stats[0, 0]) if steps else (k, v)


def _pieces(held: list, name: str) -> list[torch.Tensor]:
    """The tensors whose concatenation is every store's ``name`` (`service.quant.base.joined`: the stores written
    together in one stacked write give one piece)."""
    return [t for t, _, _ in joined(held, name)]


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)
