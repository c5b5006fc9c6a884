"""KVQuant adapted to Fast-dLLM cache reuse: NUQ codebooks, static key ranges, dynamic value ranges, sparse outliers.

Paper "KIVI and KVQuant Adaptations": the fitted per-layer state (`service.artifacts.kvquant_state`) is applied to
the reused cache after the block-initial pass; keys are stored **before RoPE** (the engine rotates them after
reading); sparse outlier handling is on with sparsity threshold 0.99; first_few_fp16 = 0. The math is
`service.quant.nuq`'s. It works per token over all kv heads (the reference's ``[tokens, heads x head_dim]`` view), so
grouped-query attention needs nothing special and no statistic crosses a row (no token groups at all).

Held per layer: the b-bit codes of every entry (outliers included, their code is unused, as in KVQuant's dense
matrix), the outliers as int32 flat indices + model-dtype values, and for V the float32 offset and half range of
each token. The state's thresholds and codebooks are not counted: they are fixed per model, like the weights.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from service.artifacts.base import Provenance
from service.artifacts.kvquant_state import KVQuantState, KVQuantStateMeta
from service.engine.spec import ModelSpec
from service.quant import nuq
from service.quant.base import (
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


class KVQuantQuantizer(KVQuantizer):
    """KVQuant (NUQ + dense-and-sparse) on reused pre-RoPE keys and values.

    Args:
        config: method ``kvquant``; ``bits`` must equal the state's.
        spec: the loaded model.
        state: the fitted state (already validated against ``spec`` by the factory).
    """

    pre_rope_keys = True
    element_indices = ("outlier_index",)  # flat into [N, H x D] (`KVQuantizer.concat` moves them)

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
        """`KVQuantizer.quantize` with one host read for the layer (a sync on a GPU), where reading each
        data-dependent size as it comes took nine: everything that decides a size (both sides' outliers, the value
        tokens whose median is needed, `nuq.dense_range`) and both finiteness checks (`base._finite_slots`) are
        computed first and read together (:func:`_read_once`); then the outlier indices are taken with those
        sizes. The same codes, ranges, outliers and errors as quantizing K then V (``quantize_k``, ``quantize_v``).
        K's slots, codes and outliers are held while V is read (``N x C`` bytes more than one side at a time).

        That read stays even with ``verdicts``: the outlier counts are the sizes of the held outlier tensors and
        the needed tokens choose the value ranges, so the write cannot finish without them (holding the masks
        until a later read would cost a large share of the full-precision K/V per layer); the finiteness flags
        ride along in the same read, and a K or V that is not finite raises at once (nothing is appended).

        A stacked layout (`SlotLayout.stacked`: several requests' blocks written in one call,
        `service.quant.store.QuantizedKVStore.write_batch`) is one write of all their slots with still one read:
        every statistic is per token, so each member's codes, ranges and outliers are its own write's; the codes
        are packed one stream per member (`packing.pack_streams`), and each side's outlier count per member comes
        from the same read (:class:`StackedSide`, what :meth:`split` cuts by). There a K or V that is not finite
        does not raise: with ``verdicts`` a False verdict is appended (every member writes again alone, which
        finds the culprit and names its own row), without it the stacked write is made again member by member,
        which raises what the culprit's own write raises."""
        if not (self.quantizes_k and self.quantizes_v):
            return super().quantize(layer, k, v, layout, scores, verdicts)
        members = layout.members
        s = self.state
        k_slots, v_slots = layout.gather(k), layout.gather(v)
        kx, vx = k_slots.reshape(k_slots.shape[0], -1), v_slots.reshape(v_slots.shape[0], -1)
        upper, lower, k_lut = (t[layer].to(k.device) for t in (s.k_upper, s.k_lower, s.k_lut))
        k_increasing, v_increasing = self._increasing[layer]
        k_codes, k_outliers = nuq.quantize_keys(kx, upper, lower, k_lut, self.sparse, k_increasing)
        xf, v_outliers, mx, mn, need = nuq.value_candidates(vx, self.sparse, s.meta.sparsity_threshold)
        sums = torch.stack([k_slots.sum(dtype=torch.float32), v_slots.sum(dtype=torch.float32)])
        masks = [k_outliers, v_outliers] + ([need] if need is not None else [])
        slots = [m.num_slots for m in members] if members else None
        indices, not_finite, per_member = _read_once(masks, ~torch.isfinite(sums), slots)
        if members and (not_finite[0] or not_finite[1]):
            if verdicts is None:
                return self._member_by_member(layer, k, v, layout)
            verdicts.append(torch.zeros((), dtype=torch.bool, device=k.device))
        else:
            # A sum that is not finite is only a hint (`base._finite_slots`): its scan decides, and names the culprit.
            for name, x, flagged in (("K", k, not_finite[0]), ("V", v, not_finite[1])):
                if flagged:
                    _finite_slots(layer, name, x, layout)
        v_codes, offset, half_range, _ = nuq.quantize_values_of(
            xf, v_outliers, mx, mn, indices[2] if need is not None else None, s.v_lut[layer].to(v.device),
            v_increasing,
        )
        return PackedLayer(
            k=self._pack(kx, k_codes, indices[0], {}, slots, per_member[0]),
            v=self._pack(vx, v_codes, indices[1], {"offset": offset, "half_range": half_range}, slots,
                         per_member[1]),
            dtype=k.dtype, num_heads=k.shape[1], head_dim=k.shape[3],
        )

    def _member_by_member(self, layer: int, k: torch.Tensor, v: torch.Tensor, layout: SlotLayout) -> PackedLayer:
        """A stacked write whose K or V may not be finite, made again one member at a time (each member's rows of
        the stacked K/V, its own layout): the first member whose K or V is not finite raises, naming its own row
        and column; if none does (large finite values overflowed the float32 sums), the stacked write is made
        again past its flags (a throwaway verdict), which gives the members' own codes."""
        row0 = 0
        for member in layout.members:
            rows = slice(row0, row0 + member.batch_size)
            self.quantize(layer, k[rows], v[rows], member)
            row0 += member.batch_size
        return self.quantize(layer, k, v, layout, verdicts=[])

    def split(self, layer, packed, layout):
        """`KVQuantizer.split` of a stacked :meth:`quantize`: each member's streams, outliers (indices made its
        own: less its first entry), value ranges, elements and nominal bits, as its own write holds them (slices
        made at first use, `service.quant.base.MemberTensor`; nothing read here)."""
        c = packed.num_heads * packed.head_dim
        out, slot0, words0, k0, v0 = [], 0, 0, 0, 0
        for member, k_out, v_out in zip(layout.members, packed.k.member_outliers, packed.v.member_outliers,
                                        strict=True):
            n = member.num_slots
            words = stream_words(n * c, self.bits)
            codes, shift = (words0, words0 + words), {"outlier_index": slot0 * c}
            k_ranges = {"codes": codes, "outlier_index": (k0, k0 + k_out), "outlier_values": (k0, k0 + k_out)}
            v_ranges = {"codes": codes, "outlier_index": (v0, v0 + v_out), "outlier_values": (v0, v0 + v_out),
                        "offset": (slot0, slot0 + n), "half_range": (slot0, slot0 + n)}
            out.append(PackedLayer(
                k=MemberTensor(_Slices(packed.k.tensors, k_ranges, slot0, shift), n * c, self._bitsum(n * c, k_out)),
                v=MemberTensor(_Slices(packed.v.tensors, v_ranges, slot0, shift), n * c, self._bitsum(n * c, v_out)),
                dtype=packed.dtype, num_heads=packed.num_heads, head_dim=packed.head_dim))
            slot0, words0, k0, v0 = slot0 + n, words0 + words, k0 + k_out, v0 + v_out
        return out

    def _bitsum(self, elements: int, outliers: int) -> float:
        """Nominal bits of ``elements`` entries of which ``outliers`` are held at 16 bits (the paper's count)."""
        return float(self.bits * (elements - outliers) + 16 * outliers)

    def quantize_k(self, layer, x, layout, scores):
        s = self.state
        x2d = x.reshape(x.shape[0], -1)  # [N, H*D], column h*D + d
        upper, lower, lut = (t[layer].to(x.device) for t in (s.k_upper, s.k_lower, s.k_lut))
        codes, outliers = nuq.quantize_keys(x2d, upper, lower, lut, self.sparse, self._increasing[layer][0])
        return self._pack(x2d, codes, _flat_nonzero(outliers), {})

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
        return self._pack(x2d, codes, _flat_nonzero(outliers), {"offset": offset, "half_range": half_range})

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
        steps = decode_stream(t["codes"], self.width_table(layer, device), n * c).view(n, c).mul_(half_range)
        steps.view(-1).index_fill_(0, t["outlier_index"].long(), 0.0)
        return steps.view(n, packed.num_heads, packed.head_dim)

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
        s = self.state
        device = device_of(packed.k.tensors)
        offset, half_range = nuq.key_offset_range(s.k_upper[layer].to(device), s.k_lower[layer].to(device))
        return nuq_operands(
            packed.k.tensors, packed.v.tensors, self.bits, layout.num_slots, packed.num_heads, packed.head_dim,
            offset, half_range,
            s.k_lut[layer].to(device, torch.float32), s.v_lut[layer].to(device, torch.float32),
        )

    # ---- shared by K and V -----------------------------------------------------------------------------------
    def _pack(self, x2d: torch.Tensor, codes: torch.Tensor, index: torch.Tensor, extra: dict,
              slots: list[int] | None = None, member_outliers: list[int] | None = None) -> PackedTensor:
        """``index``: int64, the outliers' flat indices into ``x2d``, ascending. ``slots``: a stacked write's
        slots per member (its codes one stream each) with ``member_outliers``, its outliers per member."""
        tensors = {
            "codes": pack_stream(codes, self.bits) if slots is None else pack_streams(codes, self.bits, slots),
            "outlier_index": index.to(torch.int32),
            "outlier_values": x2d.flatten()[index],
            **extra,
        }
        bitsum = self._bitsum(x2d.numel(), index.numel())
        if slots is None:
            return PackedTensor(tensors=tensors, elements=x2d.numel(), nominal_bitsum=bitsum)
        return StackedSide(tensors=tensors, elements=x2d.numel(), nominal_bitsum=bitsum,
                           member_outliers=member_outliers)

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
        values.view(-1)[t["outlier_index"].long()] = t["outlier_values"].to(values.dtype)
        h, d = packed.num_heads, packed.head_dim
        if layout.batched(h * d):
            values[-1].zero_()
            out = layout.empty_output(h, d, packed.dtype, out)
            return layout.place(layout.take_active(values, spare=True).view(-1, h, d), out)
        return layout.scatter(values[:-1].view(-1, h, d), dtype=packed.dtype, out=out)


@dataclass(eq=False)
class StackedSide(PackedTensor):
    """One side of a stacked :meth:`KVQuantQuantizer.quantize`: :class:`PackedTensor` with each member's outlier
    count (host ints, from the write's one read), which :meth:`KVQuantQuantizer.split` cuts the outliers by."""

    member_outliers: list[int] = field(default_factory=list)


def _flat_nonzero(mask: torch.Tensor) -> torch.Tensor:
    """int64 ``[n]``: the flat indices of the True entries of ``mask``, ascending (numpy's ``flatnonzero`` on a
    CPU tensor: several times faster there than ``torch.nonzero``, the same indices)."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(mask.numpy()))
    return mask.flatten().nonzero().squeeze(1)


def _read_once(masks: list[torch.Tensor], flags: torch.Tensor, slots: list[int] | None = None,
               ) -> tuple[list[torch.Tensor], list[bool], list[list[int] | None]]:
    """The flat indices (int64, ascending, as :func:`_flat_nonzero`) of the True entries of each mask and the bool
    ``flags`` (1-D), with one read of the host: on a CPU one copy of them all read as numpy (``flatnonzero``,
    several times faster there than ``torch.nonzero``); elsewhere the counts and flags in one small read, then
    ``nonzero_static`` of each mask at its count (no further sync).

    ``slots`` (a stacked write's slots per member, the masks' rows): the third result gives, for each of the
    first two masks (``[N, C]``), its True entries per member (host ints, from the same read); without it, None
    twice."""
    if flags.device.type == "cpu":
        host = torch.cat([m.reshape(-1) for m in masks] + [flags]).numpy()
        found, start = [], 0
        for m in masks:
            found.append(np.flatnonzero(host[start : start + m.numel()]))
            start += m.numel()
        per_member: list[list[int] | None] = [None, None]
        if slots is not None:  # on the host arrays already read
            for side in range(2):
                bounds = np.cumsum([0] + slots) * (masks[side].numel() // max(sum(slots), 1))
                per_member[side] = np.diff(np.searchsorted(found[side], bounds)).tolist()
        return [torch.from_numpy(f) for f in found], [bool(f) for f in host[start:]], per_member
    return _read_counts(masks, flags, slots)


def _read_counts(masks: list[torch.Tensor], flags: torch.Tensor, slots: list[int] | None = None,
                 ) -> tuple[list[torch.Tensor], list[bool], list[list[int] | None]]:
    """:func:`_read_once` off a CPU (any device; tested on a CPU): the per-member counts are sums of each member's
    rows, read with the others."""
    parts = [torch.stack([m.sum() for m in masks]), flags.long()]
    if slots is not None:
        ends = torch.tensor(list(itertools.accumulate(slots)), device=flags.device)
        for side in range(2):
            rows = masks[side].reshape(masks[side].shape[0], -1).sum(1).cumsum(0)
            at = rows.index_select(0, ends - 1) if rows.numel() else torch.zeros_like(ends)
            parts.append(torch.diff(at, prepend=at.new_zeros(1)))
    counts = torch.cat(parts).tolist()
    indices = [torch.nonzero_static(m.reshape(-1), size=c).squeeze(1) for m, c in zip(masks, counts)]
    rest = counts[len(masks):]
    flags_read = [bool(f) for f in rest[: flags.numel()]]
    rest = rest[flags.numel():]
    per_member: list[list[int] | None] = [None, None]
    if slots is not None:
        per_member = [rest[: len(slots)], rest[len(slots): 2 * len(slots)]]
    return indices, flags_read, per_member


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
