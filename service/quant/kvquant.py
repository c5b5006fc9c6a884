"""KVQuant adapted to Fast-dLLM cache reuse: NUQ codebooks, static key ranges, dynamic value ranges, sparse outliers.

Paper "KIVI and KVQuant Adaptations": the fitted per-layer state (`service.artifacts.kvquant_state`) is applied to
the reused cache after the block-initial pass; keys are stored **before RoPE** (the engine rotates them after
reading); sparse outlier handling is on with sparsity threshold 0.99; first_few_fp16 = 0. The math is
`service.quant.nuq`'s. It works per token over all kv heads (the reference's ``[tokens, heads x head_dim]`` view), so
grouped-query attention needs nothing special and no statistic crosses a row (no token groups at all).

Held per layer: the b-bit codes of every entry (outliers included, their code is unused, as in KVQuant's dense
matrix), the outliers in fixed-capacity rows (:func:`row_outliers`: per token ``cap`` column indices, the
smallest integer type that holds ``H x D``, -1 past its outliers, and ``cap`` model-dtype values), and for V the
float32 offset and half range of each token. ``cap`` is known on the host from the shape and the sparsity threshold (:func:`default_caps`), so a
write reads nothing from the device to size what it holds; a token with more outliers than ``cap`` (ties at a value
quantile, keys far past their thresholds) is found by the write's checks, and the write is made again with room
for it. The padded capacity is held, so it is counted in the bytes (storage bits); the nominal bits count the
outliers the data has (a device count, read when a report is made: :class:`DeviceBits`). The state's thresholds and
codebooks are not counted: they are fixed per model, like the weights.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from service.artifacts.base import Provenance
from service.artifacts.kvquant_state import KVQuantState, KVQuantStateMeta
from service.engine.spec import ModelSpec
from service.quant import nuq
from service.quant.base import (
    DeviceBits,
    KVQuantizer,
    MemberTensor,
    PackedLayer,
    PackedTensor,
    QuantSettings,
    _finite_slots,
    _Slices,
    device_of,
)
from service.quant.kernels.operands import KernelOperands, nuq_operands
from service.quant.key_bias import bin_widths
from service.quant.layout import SlotLayout
from service.quant.packing import byte_table, decode_stream, pack_stream, pack_streams, stream_words
from service.quant.plugin import CalibrationStep, PooledReader, QuantMethod, same
from service.quant.rows_nuq import batch_key as nuq_batch_key
from service.quant.rows_nuq import dequantize_rows as nuq_dequantize_rows
from service.quant.rows_nuq import forget as nuq_forget
from service.quant.rows_nuq import outlier_places


class KVQuantQuantizer(KVQuantizer):
    """KVQuant (NUQ + dense-and-sparse) on reused pre-RoPE keys and values.

    Args:
        config: method ``kvquant``; ``bits`` must equal the state's.
        spec: the loaded model.
        state: the fitted state (already validated against ``spec`` by the factory).
    """

    pre_rope_keys = True
    redone_on_false_verdict = True  # a token with more outliers than its row holds (:meth:`quantize`)

    def block_separable(self, block_length: int) -> bool:
        """Always: every statistic is per token (no token groups), so a block quantized alone is the run's."""
        return True

    def __init__(self, config: QuantSettings, spec: ModelSpec, state: KVQuantState) -> None:
        super().__init__(config, spec)
        self.state = state
        self.sparse = state.meta.sparsity_threshold < 1.0
        # Per (layer, device), made at the first read: the keys' static offset and half range, and each
        # codebook as a per-byte table (`service.quant.packing.byte_table`). Fixed per model, like the state.
        self._read_tables: dict[tuple[int, torch.device], tuple[torch.Tensor, ...]] = {}
        # Per (layer, device): the key codebook's bin widths as a per-byte table (the key-bias correction).
        self._width_tables: dict[tuple[int, torch.device], torch.Tensor] = {}
        # Per (layer, C): outlier capacities per token grown past `default_caps` by a fuller token (`_grow`).
        self._caps: dict[tuple[int, int], tuple[int, int]] = {}
        # Per layer, whether the K and V codebooks are strictly increasing (`nuq.nearest_code`'s fast path): read
        # once here from the state (host tensors), not from the device at every write.
        self._increasing = [(bool((k[1:] > k[:-1]).all()), bool((v[1:] > v[:-1]).all()))
                            for k, v in zip(state.k_lut, state.v_lut)]
        self._state_id: str | None = None  # `artifact_key`, hashed at its first use

    def write_key(self):
        """`KVQuantizer.write_key`: stores of one state, bits and K group size write together (the stacked write
        of :meth:`quantize`); None with a side held as it is (``sides``)."""
        if not (self.quantizes_k and self.quantizes_v):
            return None
        return (type(self).__name__, self.bits, self.k_group_size, self.artifact_key())

    def artifact_key(self):
        """The state's content id (`KVQuantState.id`), computed once per quantizer (a hash of the whole state)."""
        if self._state_id is None:
            self._state_id = self.state.id
        return self._state_id

    def quantize(self, layer, k, v, layout, scores=None, verdicts=None):
        """`KVQuantizer.quantize` reading nothing from the device with ``verdicts``, and with one host read (a sync
        on a GPU) without them. The outliers are held in rows of a capacity known from the shape (:func:`row_outliers`,
        :meth:`caps`), so no data-dependent size is read to make the write; what could make it wrong or raise is
        computed as flags on the device: K or V not finite (`base._finite_slots`'s hint, a float32 sum), a token
        with more outliers than its row holds, a value token whose median is needed (`nuq.dense_range`, none on
        real K/V). With ``verdicts`` the flags are its verdict (False: the write must be made again, as the base
        contract says; without ``verdicts`` that write reads them, and on a flag makes the exact write: the
        culprit raises, a fuller row is sized by one more read and the layer's capacity grows to it, the needed
        medians are computed). The same codes, ranges, outliers and errors as quantizing K then V
        (``quantize_k``, ``quantize_v``); K's slots, codes and outlier mask are held while V is read.

        A stacked layout (`SlotLayout.stacked`: several requests' blocks written in one call,
        `service.quant.store.QuantizedKVStore.write_batch`) is one write of all their slots: every statistic is per
        token, so each member's codes, ranges and outlier rows are its own write's; the codes are packed one
        stream per member (`packing.pack_streams`), the outlier rows are cut by slots (:meth:`split`). There a K
        or V that is not finite does not raise: with ``verdicts`` a False verdict is appended (every member writes
        again alone, which finds the culprit and names its own row), without it the stacked write is made again
        member by member, which raises what the culprit's own write raises."""
        if not (self.quantizes_k and self.quantizes_v):
            return super().quantize(layer, k, v, layout, scores, verdicts)
        return self._quantize_both(layer, k, v, layout, verdicts)

    def _quantize_both(self, layer, k, v, layout, verdicts, finite_known: bool = False):
        """:meth:`quantize` of both sides; ``finite_known``: K and V were found finite (the flags' sums overflowed)."""
        members = layout.members
        s = self.state
        k_slots, v_slots = layout.gather(k), layout.gather(v)
        kx, vx = k_slots.reshape(k_slots.shape[0], -1), v_slots.reshape(v_slots.shape[0], -1)
        upper, lower, k_lut = (t[layer].to(k.device) for t in (s.k_upper, s.k_lower, s.k_lut))
        k_increasing, v_increasing = self._increasing[layer]
        k_codes, k_outliers = nuq.quantize_keys(kx, upper, lower, k_lut, self.sparse, k_increasing)
        xf, v_outliers, mx, mn, need = nuq.value_candidates(vx, self.sparse, s.meta.sparsity_threshold)
        k_cap, v_cap = self.caps(layer, kx.shape[1])
        k_rows, v_rows = row_outliers(k_outliers, k_cap), row_outliers(v_outliers, v_cap)
        sums = torch.stack([k_slots.sum(dtype=torch.float32), v_slots.sum(dtype=torch.float32)])
        flags = [(k_rows[2] > k_cap).any(), (v_rows[2] > v_cap).any()] + ([need.any()] if need is not None else [])
        flags = torch.cat([~torch.isfinite(sums), torch.stack(flags)])
        rows = None
        if verdicts is not None:
            verdicts.append(~flags.any())
        else:
            read = flags.tolist()  # the write's one host read
            not_finite = [False, False] if finite_known else read[:2]
            if members and (not_finite[0] or not_finite[1]):
                return self._member_by_member(layer, k, v, layout)
            # A sum that is not finite is only a hint (`base._finite_slots`): its scan decides, and names the culprit.
            for name, x, flagged in (("K", k, not_finite[0]), ("V", v, not_finite[1])):
                if flagged:
                    _finite_slots(layer, name, x, layout)
            if read[2] or read[3]:  # a token with more outliers than its row holds: room for the most (a read)
                k_cap, v_cap = self._grow(layer, kx.shape[1], k_rows[2].amax(), v_rows[2].amax())
                k_rows, v_rows = row_outliers(k_outliers, k_cap), row_outliers(v_outliers, v_cap)
            if need is not None and read[4]:
                rows = need.nonzero().squeeze(1)
        v_codes, offset, half_range, _ = nuq.quantize_values_of(
            xf, v_outliers, mx, mn, rows, s.v_lut[layer].to(v.device), v_increasing,
        )
        slots = [m.num_slots for m in members] if members else None
        return PackedLayer(
            k=self._pack(kx, k_codes, k_rows, {}, slots),
            v=self._pack(vx, v_codes, v_rows, {"offset": offset, "half_range": half_range}, slots),
            dtype=k.dtype, num_heads=k.shape[1], head_dim=k.shape[3],
        )

    def caps(self, layer: int, channels: int) -> tuple[int, int]:
        """The outlier capacity per token of ``layer``'s K and V rows (:func:`default_caps`, or what a fuller
        token made it grow to, :meth:`_grow`): host ints, so a write sizes what it holds without a read."""
        return self._caps.get((layer, channels)) or default_caps(channels, self.state.meta.sparsity_threshold,
                                                                 self.sparse)

    def _grow(self, layer: int, channels: int, k_most: torch.Tensor, v_most: torch.Tensor) -> tuple[int, int]:
        """Capacities that hold ``k_most``/``v_most`` outliers (0-dim, read here together), kept for the layer's
        later writes: an eighth more than was met, so that a few more tokens like it do not each redo their write."""
        most = torch.stack([k_most, v_most]).tolist()
        caps = tuple(max(cap, m + m // 8) for cap, m in zip(self.caps(layer, channels), most))
        self._caps[(layer, channels)] = caps
        return caps

    def _member_by_member(self, layer: int, k: torch.Tensor, v: torch.Tensor, layout: SlotLayout) -> PackedLayer:
        """A stacked write whose K or V may not be finite, made again one member at a time (each member's rows of
        the stacked K/V, its own layout): the first member whose K or V is not finite raises, naming its own row
        and column; if none does (large finite values overflowed the float32 sums), the stacked write is made
        again knowing them finite, which gives the members' own codes."""
        row0 = 0
        for member in layout.members:
            rows = slice(row0, row0 + member.batch_size)
            self.quantize(layer, k[rows], v[rows], member)
            row0 += member.batch_size
        return self._quantize_both(layer, k, v, layout, None, finite_known=True)

    def split(self, layer, packed, layout):
        """`KVQuantizer.split` of a stacked :meth:`quantize`: each member's streams, outlier rows, value ranges,
        elements and nominal bits (its rows' outlier counts), as its own write holds them (slices made at first
        use, `service.quant.base.MemberTensor`; nothing read or dispatched here)."""
        c = packed.num_heads * packed.head_dim
        out, slot0, words0 = [], 0, 0
        for member in layout.members:
            n = member.num_slots
            words = stream_words(n * c, self.bits)
            codes, rows = (words0, words0 + words), (slot0, slot0 + n)
            k_ranges = {"codes": codes, "outlier_index": rows, "outlier_values": rows}
            v_ranges = {**k_ranges, "offset": rows, "half_range": rows}
            sides = []
            for side, ranges in ((packed.k, k_ranges), (packed.v, v_ranges)):
                bits = side.nominal_bitsum.rows(slot0, slot0 + n, self.bits * n * c)
                sides.append(MemberTensor(_Slices(side.tensors, ranges, slot0, {}), n * c, bits))
            out.append(PackedLayer(k=sides[0], v=sides[1], dtype=packed.dtype, num_heads=packed.num_heads,
                                   head_dim=packed.head_dim))
            slot0, words0 = slot0 + n, words0 + words
        return out

    def quantize_k(self, layer, x, layout, scores):
        s = self.state
        x2d = x.reshape(x.shape[0], -1)  # [N, H*D], column h*D + d
        upper, lower, lut = (t[layer].to(x.device) for t in (s.k_upper, s.k_lower, s.k_lut))
        codes, outliers = nuq.quantize_keys(x2d, upper, lower, lut, self.sparse, self._increasing[layer][0])
        return self._pack(x2d, codes, _rows_held(outliers), {})

    def dequantize_k(self, layer, packed, layout, out=None):
        # nuq.dequantize_keys (lut[code] * range + offset, float32), the lookup read straight from the stream.
        t = packed.k.tensors
        offset, half_range, k_table, _ = self._tables(layer, t["codes"].device)
        values = self._values(t, k_table, layout, packed)
        values[:-1].mul_(half_range).add_(offset)
        return self._finish(values, t, layout, packed, out)

    def quantize_v(self, layer, x):
        x2d = x.reshape(x.shape[0], -1)
        lut = self.state.v_lut[layer].to(x.device)
        codes, offset, half_range, outliers = nuq.quantize_values(
            x2d, lut, self.sparse, self.state.meta.sparsity_threshold, self._increasing[layer][1]
        )
        return self._pack(x2d, codes, _rows_held(outliers), {"offset": offset, "half_range": half_range})

    def dequantize_v(self, layer, packed, layout, out=None):
        # nuq.dequantize_values, likewise.
        t = packed.v.tensors
        v_table = self._tables(layer, t["codes"].device)[3]
        values = self._values(t, v_table, layout, packed)
        values[:-1].mul_(t["half_range"][:, None]).add_(t["offset"][:, None])
        return self._finish(values, t, layout, packed, out)

    def key_steps(self, layer, packed, layout):
        """float32 ``[N, H, D]`` in the pre-RoPE basis: each key entry's code bin width times its channel's half
        range (`service.quant.key_bias.bin_widths` over ``[-1, 1]``, where the non-outlier keys lie), 0 for an
        outlier (held exact)."""
        t = packed.k.tensors
        device = t["codes"].device
        half_range = self._tables(layer, device)[1]
        n, c = layout.num_slots, packed.num_heads * packed.head_dim
        steps = decode_stream(t["codes"], self.width_table(layer, device), n * c, extra=c).view(n + 1, c)
        steps.mul_(half_range).view(-1).index_fill_(0, outlier_places(t["outlier_index"], c).view(-1), 0.0)
        return steps[:n].view(n, packed.num_heads, packed.head_dim)

    def width_table(self, layer: int, device: torch.device) -> torch.Tensor:
        """The per-byte table (`service.quant.packing.byte_table`) of the layer's K code bin widths (normalized
        units, `service.quant.key_bias.bin_widths`), made once per layer and device."""
        key = (layer, device)
        if key not in self._width_tables:
            self._width_tables[key] = byte_table(bin_widths(self.state.k_lut[layer].to(device)), self.bits)
        return self._width_tables[key]

    def _tables(self, layer: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """``(k_offset [C], k_half_range [C], k_table, v_table)`` of a layer on ``device`` (made once)."""
        key = (layer, device)
        if key not in self._read_tables:
            s = self.state
            offset, half_range = nuq.key_offset_range(s.k_upper[layer].to(device), s.k_lower[layer].to(device))
            self._read_tables[key] = (
                offset, half_range,
                byte_table(s.k_lut[layer].to(device, torch.float32), self.bits),
                byte_table(s.v_lut[layer].to(device, torch.float32), self.bits),
            )
        return self._read_tables[key]

    def kernel_operands(self, layer, packed, layout) -> KernelOperands:
        """`nuq_operands` of the held format, its outliers given the kernel as it reads them: flat int32 indices
        ``slot x C + column`` (-1 for a row's free places, which match no entry) with CSR pointers per (slot, kv
        head) row (`kernels.operands.outlier_rows`' meaning): a head's outliers lie together in its slot's row,
        the last head's range runs on over the free places after them, and ``most`` counts outliers only (one
        read, as `outlier_rows` makes), so the kernel's scan finds each row's outliers first."""
        s = self.state
        device = device_of(packed.k.tensors)
        offset, half_range = nuq.key_offset_range(s.k_upper[layer].to(device), s.k_lower[layer].to(device))
        sides = [_kernel_outliers(t["outlier_index"], packed.num_heads, packed.head_dim)
                 for t in (packed.k.tensors, packed.v.tensors)]
        most = torch.stack([sides[0][2], sides[1][2]]).tolist()
        dense = {"outlier_index": torch.zeros(0, dtype=torch.int32, device=device)}
        ops = nuq_operands(
            {**packed.k.tensors, **dense}, {**packed.v.tensors, **dense}, self.bits, 0, packed.num_heads,
            packed.head_dim, offset, half_range,
            s.k_lut[layer].to(device, torch.float32), s.v_lut[layer].to(device, torch.float32),
        )
        return dataclasses.replace(
            ops, num_slots=layout.num_slots,
            k_outlier_index=sides[0][0], k_outlier_values=packed.k.tensors["outlier_values"].reshape(-1),
            v_outlier_index=sides[1][0], v_outlier_values=packed.v.tensors["outlier_values"].reshape(-1),
            k_outlier_start=sides[0][1], v_outlier_start=sides[1][1], k_outlier_most=most[0], v_outlier_most=most[1])

    # ---- shared by K and V -----------------------------------------------------------------------------------
    def _pack(self, x2d: torch.Tensor, codes: torch.Tensor, rows: tuple[torch.Tensor, ...], extra: dict,
              slots: list[int] | None = None) -> PackedTensor:
        """``rows``: :func:`row_outliers` of ``x2d``'s outliers, whose values are taken here. ``slots``: a stacked
        write's slots per member (its codes one stream each)."""
        cols, taken, count = rows
        tensors = {
            "codes": pack_stream(codes, self.bits) if slots is None else pack_streams(codes, self.bits, slots),
            "outlier_index": cols,
            "outlier_values": x2d.gather(1, taken).masked_fill_(cols < 0, 0),  # free places: 0 (never read)
            **extra,
        }
        # Nominal bits: b per code, 16 per outlier, the outliers counted on the device (read at a report).
        bitsum = DeviceBits(self.bits * x2d.numel(), ((count, 0, count.numel(), 16 - self.bits),))
        return PackedTensor(tensors=tensors, elements=x2d.numel(), nominal_bitsum=bitsum)

    def _concat_side(self, sides: list[PackedTensor]) -> PackedTensor:
        """`KVQuantizer._concat_side`: the outlier rows are per token, so they join as they are (no index moves),
        each part's widened to the widest capacity first (free places: -1)."""
        widest = max(s.tensors["outlier_index"].shape[1] for s in sides)
        wide = []
        for side in sides:
            more = widest - side.tensors["outlier_index"].shape[1]
            if more:
                t = dict(side.tensors)
                t["outlier_index"] = torch.nn.functional.pad(t["outlier_index"], (0, more), value=-1)
                t["outlier_values"] = torch.nn.functional.pad(t["outlier_values"], (0, more))
                side = PackedTensor(tensors=t, elements=side.elements, nominal_bitsum=side.nominal_bitsum)
            wide.append(side)
        return super()._concat_side(wide)

    @staticmethod
    def _values(t: dict, table: torch.Tensor, layout: SlotLayout, packed: PackedLayer) -> torch.Tensor:
        """float32 ``[N + 1, C]``: the codebook value of every code, and a spare last row (a new tensor, free to
        modify in place; see :meth:`_finish`)."""
        n, c = layout.num_slots, packed.num_heads * packed.head_dim
        return decode_stream(t["codes"], table, n * c, extra=c).view(n + 1, c)

    @staticmethod
    def _finish(
        values: torch.Tensor, t: dict, layout: SlotLayout, packed: PackedLayer, out: torch.Tensor | None
    ) -> torch.Tensor:
        """Fill in the outliers and place the values (``[N + 1, C]``, the last row spare) into the output."""
        c = values.shape[1]
        values.view(-1).index_put_((outlier_places(t["outlier_index"], c).view(-1),),
                                   t["outlier_values"].reshape(-1).to(values.dtype))  # free places: the spare row
        h, d = packed.num_heads, packed.head_dim
        if layout.batched(h * d):
            values[-1].zero_()
            out = layout.empty_output(h, d, packed.dtype, out)
            return layout.place(layout.take_active(values, spare=True).view(-1, h, d), out)
        return layout.scatter(values[:-1].view(-1, h, d), dtype=packed.dtype, out=out)


def default_caps(channels: int, sparsity_threshold: float, sparse: bool = True) -> tuple[int, int]:
    """Outliers per token a K and a V row hold (host ints, from the shape alone). V: the entries at or beyond a
    token's ``t`` and ``1 - t`` quantiles (`nuq.value_outliers`), ``C - ceil(t (C - 1))`` above and
    ``floor((1 - t)(C - 1)) + 1`` below when no entries tie at a quantile, and ``C // 512`` more each side for
    ties (model-dtype values often tie at 4096 entries). K: its static thresholds leave out ``(1 - threshold)``
    of the calibration keys, ``m`` per token on average; a token's count varies about it, so room for
    ``m + 6 sqrt(m) + 1``. A token past them makes its write again, and the layer's rows grow
    (:meth:`KVQuantQuantizer.quantize`); tiny widths pay most for the room (every token holds it). Without
    sparse outliers, none."""
    if not sparse:
        return 0, 0
    t = 1 - (1 - sparsity_threshold) / 2
    v = (channels - math.ceil(t * (channels - 1))) + math.floor((1 - t) * (channels - 1)) + 1 + 2 * (channels // 512)
    mean = (1 - sparsity_threshold) * channels
    k = math.ceil(mean + 6 * math.sqrt(mean)) + 1
    return min(channels, k), min(channels, v)


def row_outliers(mask: torch.Tensor, cap: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's outliers in ``cap`` places, read nothing: ``(cols, taken, count)``: the True columns of each row
    of ``mask`` (bool ``[N, C]``) ascending, then -1 (``[N, cap]``, the smallest of int8, int16 and int32 that holds ``C``), the
    same columns as int64 with any column at the free places (to gather values by), and int64 ``[N]`` the
    True entries per row (more than ``cap`` where the row does not fit: only its first ``cap`` are taken). One
    ``topk`` of the columns' reversed order where True: the True ones first, in column order."""
    c = mask.shape[1]
    cap = min(cap, c)
    key = (c, mask.device)
    if key not in _REVERSED:
        _REVERSED[key] = torch.arange(c, 0, -1, dtype=torch.float32, device=mask.device)
    top, taken = (mask * _REVERSED[key]).topk(cap, dim=1)
    dtype = next(d for d in (torch.int8, torch.int16, torch.int32) if c <= torch.iinfo(d).max)
    return taken.to(dtype).masked_fill_(top == 0, -1), taken, mask.sum(1)


#: Per (C, device): float32 ``[C]``, ``C .. 1`` (:func:`row_outliers`'s order).
_REVERSED: dict[tuple[int, torch.device], torch.Tensor] = {}


def _rows_held(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`row_outliers` with room for the fullest row (one read: the single-side writes, a config holding the
    other side as it is)."""
    return row_outliers(mask, int(mask.sum(1).amax()) if mask.numel() else 0)


def _kernel_outliers(cols: torch.Tensor, heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused kernel's view of outlier rows ``cols`` (`KVQuantQuantizer.kernel_operands`): int32 flat indices
    ``[N x cap]`` (-1 free), int32 ``[N x H + 1]`` CSR pointers per (slot, head) and the most outliers one holds
    (0-dim)."""
    n, cap = cols.shape
    wide = cols.long()
    flat = (wide + torch.arange(0, n * heads * head_dim, heads * head_dim, device=cols.device)[:, None])
    flat = flat.masked_fill_(wide < 0, -1).to(torch.int32).reshape(-1)
    # per slot, where each head's outliers start in its row: the free places (-1) sort past every column
    ordered = wide.masked_fill(wide < 0, heads * head_dim)
    bounds = (torch.arange(heads + 1, device=cols.device) * head_dim).expand(n, heads + 1).contiguous()
    at = torch.searchsorted(ordered, bounds)  # [N, H + 1]
    starts = at[:, :-1] + torch.arange(0, n * cap, cap, device=cols.device)[:, None]
    start = torch.cat([starts.reshape(-1), torch.full((1,), n * cap, device=cols.device, dtype=starts.dtype)])
    most = (at[:, 1:] - at[:, :-1]).amax() if n else torch.zeros((), dtype=torch.int64, device=cols.device)
    return flat, start.to(torch.int32), most


def fit_state(
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    bits: int,
    spec: ModelSpec,
    provenance: Provenance,
    sparsity_threshold: float = 0.99,
) -> KVQuantState:
    """Fit a whole KVQuant state from per-layer calibration activations (a small fitter, for tests and tools;
    the calibration job owns the real fit over cache traces).

    Args:
        keys, values: one ``[N, C]`` tensor per layer (pre-RoPE keys; ``C = num_kv_heads * head_dim``), or
            ``[B, H, T, D]`` tensors, which are viewed as ``[B * T, H * D]``.
        bits: 2, 4 or 8.
        spec: the model (fingerprint, layers, channels are recorded and checked).
        provenance: what data and code made it.
        sparsity_threshold: 0.99 in the paper.
    """
    fitted = [nuq.fit_layer(_as_2d(k), _as_2d(v), bits, sparsity_threshold) for k, v in zip(keys, values)]
    meta = KVQuantStateMeta(
        model_id=spec.model_id,
        weights_fingerprint=spec.fingerprint,
        bits=bits,
        num_layers=len(fitted),
        channels=spec.num_kv_heads * spec.head_dim,
        sparsity_threshold=sparsity_threshold,
        provenance=provenance,
    )
    k_upper, k_lower, k_lut, v_lut = (torch.stack(parts) for parts in zip(*fitted))
    return KVQuantState(meta, k_upper=k_upper, k_lower=k_lower, k_lut=k_lut, v_lut=v_lut)


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 4:
        return x.transpose(1, 2).reshape(x.shape[0] * x.shape[2], -1)
    return x


def _check_state(state: KVQuantState, config: QuantSettings, v_group_size: int, cache_mode: str | None) -> None:
    same("bits", state.bits, config.bits)


#: KVQuant's plug-in (`service.quant.plugin`): a fitted state per bit width serving every cache mode, read pooled
#: per state (`service.quant.rows_nuq`), fitted by ``calibrate kvquant``.
METHOD = QuantMethod(
    "kvquant", quantizer=KVQuantQuantizer, artifact=KVQuantState, check=_check_state,
    spellings={"artifact_id": "kvquant_state_id", "artifact_file": "kvquant_state_file"}, label="KVQuant",
    pooled=PooledReader(key=nuq_batch_key, read=nuq_dequantize_rows, forget=nuq_forget,
                        read_steps=functools.partial(nuq_dequantize_rows, steps=True)),
    calibration=CalibrationStep(
        "kvquant", "KVQuant states (per-channel non-uniform codebooks) from the trajectories",
        "calibration.kvquant_fit:fit_kvquant_states"),
)
