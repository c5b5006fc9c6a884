"""The quantizer base: slots, finiteness checks, packing and accounting; uniform min-max K and V by default.

A quantizer turns one layer's reused K/V (the slots of a :class:`SlotLayout`) into a :class:`PackedLayer`, the
bytes a store holds, and back. The base implements KIVI's formats (`service.quant.uniform`): K per channel over
token groups, V per token over channel groups, codes packed tightly (`service.quant.packing`). A method overrides
only what differs: dLLM-KVQ chooses protected K tokens (:meth:`KVQuantizer.protect`), KVQuant replaces both
formats. Paper: "KIVI and KVQuant Adaptations", "Online Quantization Details".

Accounting (paper "Effective bits", DESIGN.md): every packed tensor knows the elements it stands for (real reused
tokens x heads x head_dim, padding excluded), its **nominal** bits as the paper counts them (codes at b bits,
protected or outlier entries at 16, scales not counted) and the bytes it actually holds (codes, scales, minima,
protected values, indices, outliers), whence its **storage** bits.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Hashable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch

from service.engine.spec import ModelSpec
from service.quant.errors import KVQuantError, NonFiniteKVError
from service.quant.kernels.operands import KernelOperands, uniform_operands
from service.quant.layout import SlotLayout
from service.quant.packing import (
    byte_table,
    decode_stream,
    pack_stream,
    pack_streams,
    stream_words,
    unpack_stream,
)
from service.quant.uniform import (
    DEFERRED_CHECKS,
    GroupStats,
    dequantize_k_batched,
    dequantize_k_into,
    dequantize_v_batched,
    dequantize_v_into,
    k_group_stats,
    quantize_k_slots,
    quantize_v,
)


@dataclass(eq=False)
class PackedTensor:
    """The held form of one layer's reused K or V.

    Attributes:
        tensors: everything held, by name (packed code words, scales, minima, protected values, indices ...).
        elements: how many K (or V) entries it stands for: real reused tokens x H x D.
        nominal_bitsum: sum of the nominal bits of those entries (b per code, 16 per protected/outlier entry); a
            :class:`DeviceBits` where the entries at 16 bits are counted on the device.
    """

    tensors: dict[str, torch.Tensor]
    elements: int
    nominal_bitsum: float | DeviceBits

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def nominal_bits(self) -> float:
        return float(self.nominal_bitsum) / self.elements if self.elements else 0.0

    @property
    def storage_bits(self) -> float:
        return self.nbytes * 8 / self.elements if self.elements else 0.0


class DeviceBits:
    """A nominal bit sum part of which is counted on the device (KVQuant's outliers: the write holds their per-token
    counts and reads nothing, `service.quant.kvquant`): ``host`` bits plus, per part ``(counts, start, end,
    factor)``, ``factor x counts[start:end].sum()``. Sums with numbers and other :class:`DeviceBits` stay unread;
    ``float()`` (a report, `service.quant.accounting.KVAccounting.report`) reads the counts, and
    :func:`read_bits` reads those of many sums with one host read."""

    __slots__ = ("_value", "host", "parts")

    def __init__(self, host: float, parts: tuple = ()) -> None:
        self.host, self.parts, self._value = float(host), parts, None

    def rows(self, start: int, end: int, host: float) -> DeviceBits:
        """The sum of ``counts[start:end]`` of this one-part sum's counts, with ``host`` bits (a member's rows)."""
        (counts, _, _, factor), = self.parts
        return DeviceBits(host, ((counts, start, end, factor),))

    def __add__(self, other):
        if isinstance(other, DeviceBits):
            return DeviceBits(self.host + other.host, self.parts + other.parts)
        return DeviceBits(self.host + other, self.parts)

    __radd__ = __add__

    def __float__(self) -> float:
        if self._value is None:
            read_bits([self])
        return self._value

    def __truediv__(self, other) -> float:
        return float(self) / other

    def __eq__(self, other) -> bool:
        return float(self) == float(other)

    __hash__ = None  # type: ignore[assignment]


def read_bits(sums: list) -> None:
    """Read the device counts of every :class:`DeviceBits` in ``sums`` (others are skipped) with one host read."""
    pending = [x for x in sums if isinstance(x, DeviceBits) and x._value is None]
    held: dict[int, torch.Tensor] = {}
    for x in pending:
        for counts, *_ in x.parts:
            held.setdefault(id(counts), counts)
    if held:
        flat = torch.cat([t.reshape(-1).to(torch.int64).cpu() for t in held.values()]).tolist()
        at, first = {}, 0
        for key, t in held.items():
            at[key], first = first, first + t.numel()
    for x in pending:
        x._value = x.host + sum(factor * sum(flat[at[id(c)] + start : at[id(c)] + end])
                                for c, start, end, factor in x.parts)


@dataclass(eq=False)
class PackedLayer:
    """One layer's packed K and V, with the model dtype and head count to dequantize them into."""

    k: PackedTensor
    v: PackedTensor
    dtype: torch.dtype
    num_heads: int
    head_dim: int
    #: Index tensors derived from the held ones at the layer's first read of a block and kept for its later
    #: steps (:meth:`derived_index`): not part of the packed format (``nbytes``), counted in the store's bytes.
    derived: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @property
    def derived_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.derived.values() )

    def derived_index(self, name: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``derived[name]``, made by ``make()`` at its first use (the held tensors never change)."""
        if name not in self.derived:
            self.derived[name] = make()
        return self.derived[name]


class QuantSettings(Protocol):
    """What a quantizer reads of its configuration (`service.quant.config.KVQuantConfig` is the one in use; the
    quantizers name this interface, not the config, so the config may ask the registry of quantizers for its legal
    methods without an import circle)."""

    method: str
    bits: int
    k_group_size: int
    sides: str
    key_bias_correction: bool

    def resolve_v_group_size(self, head_dim: int) -> int: ...


class KVQuantizer:
    """Base quantizer (KIVI's uniform formats); subclasses are registered in `service.quant.registry`.

    Class flags (copied onto the store, see `service.engine.kv_store.KVStore`): ``needs_scores`` (the engine
    passes block-initial attention scores to ``write``), ``pre_rope_keys`` (keys are stored before RoPE).

    Args:
        config: the request's configuration (method, bits, group sizes).
        spec: the loaded model (head_dim for the V group size).

    Raises:
        KVQuantError: ``v_group_size`` does not divide head_dim (the message lists the legal sizes).
    """

    needs_scores: bool = False
    pre_rope_keys: ClassVar[bool] = False
    #: Whether a False verdict of :meth:`quantize` may come from the write itself, not from its input (KVQuant: a
    #: token with more outliers than its row's room): the write made again then packs something else, so a caller
    #: that keeps a falsely alarmed write's result and the logits made from it (a block-causal commit,
    #: `service.quant.committed.CommitWriter`) reads the checks at once instead.
    redone_on_false_verdict: ClassVar[bool] = False

    def __init__(self, config: QuantSettings, spec: ModelSpec) -> None:
        self.config = config
        self.spec = spec
        self.bits = config.bits
        self.k_group_size = config.k_group_size
        self.v_group_size = config.resolve_v_group_size(spec.head_dim)

    # ---- the whole layer -------------------------------------------------------------------------------------
    def quantize(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, layout: SlotLayout, scores: torch.Tensor | None = None,
        verdicts: list[torch.Tensor] | None = None,
    ) -> PackedLayer:
        """Pack one layer's reused K/V.

        Args:
            layer: 0-based layer index.
            k, v: ``[B, H, T, D]`` of the whole sequence (model dtype); only the layout's slots are read.
            layout: slots and K groups of the block.
            scores: float32 ``[B, T]`` block-initial attention scores (only when ``needs_scores``).
            verdicts: when given, the write reads nothing: the verdict of its checks (bool 0-dim on the device,
                True when all passed) is appended to it, for the caller to read later; a False verdict means the
                packed layer must not be used and writing again without ``verdicts`` raises what the checks found
                (or, for a false alarm, packs the same). A method that must read to know its sizes (KVQuant)
                reads and raises as without it, appending nothing.

        Raises:
            NonFiniteKVError: NaN or +/-inf in a reused K or V entry (the message names layer, row and column).
            KVQuantError: scores missing or not finite when the method needs them.
        """
        # The checks (scores, K and V finite, ranges that fit the dtype) are put off and read in one host read at
        # the end (one sync per write on a GPU, not one per check), or with ``verdicts`` later still, by the
        # caller (a running batch: with its iteration's one read); when one fails, the write is made again with
        # each check read at once, in order, which raises what it always raised (or, for large finite values
        # whose float32 sum overflows, finds nothing and gives the same packed layer).
        # Anything raised while the checks are put off (a method's own code meeting a value the checks would have
        # refused first) also redoes the write that way, so the first failing check is what is raised.
        checks: list[torch.Tensor] = []
        token = DEFERRED_CHECKS.set(checks)
        try:
            packed = self._quantize(layer, k, v, layout, scores, checks)
        except (KVQuantError, RuntimeError, ValueError, IndexError):  # torch's errors are RuntimeError subclasses
            packed = None
        finally:
            DEFERRED_CHECKS.reset(token)
        if packed is not None and checks and verdicts is not None:
            verdicts.append(torch.stack(checks).all())
            return packed
        if packed is None or (checks and not bool(torch.stack(checks).all())):
            packed = self._quantize(layer, k, v, layout, scores, None)
        return packed

    def _quantize(self, layer, k, v, layout, scores, checks: list[torch.Tensor] | None) -> PackedLayer:
        """:meth:`quantize`, its checks appended to ``checks`` (None: each read at once, raising)."""
        slot_scores = None
        if scores is not None:
            slot_scores = scores[layout.rows, layout.seq_cols].float()
            if checks is not None:
                checks.append(torch.isfinite(slot_scores).all())
            elif not torch.isfinite(slot_scores).all():
                raise KVQuantError(f"layer {layer}: attention scores hold NaN or inf")
        # One of K and V at a time, so the write's transient memory is one tensor's slots and temporaries.
        # A side the config leaves out (``sides``) is held as it is.
        k_slots = _finite_slots(layer, "K", k, layout, checks)
        packed_k = self.quantize_k(layer, k_slots, layout, slot_scores) if self.quantizes_k else _held(k_slots)
        v_slots = _finite_slots(layer, "V", v, layout, checks)
        token = _MEMBER_SLOTS.set([m.num_slots for m in layout.members] if layout.members else None)
        try:
            packed_v = self.quantize_v(layer, v_slots) if self.quantizes_v else _held(v_slots)
        finally:
            _MEMBER_SLOTS.reset(token)
        return PackedLayer(k=packed_k, v=packed_v, dtype=k.dtype, num_heads=k.shape[1], head_dim=k.shape[3])

    def write_key(self) -> Hashable | None:
        """What must agree for the block-initial writes of several requests' stores to be made in one call of
        :meth:`quantize` over their stacked rows (`service.quant.store.QuantizedKVStore.write_batch`): the
        method, its bits, group sizes and artifact (:meth:`artifact_key`); None where this quantizer writes
        alone: a side held as it is (``sides``), or a method that overrides :meth:`quantize` or packs its own
        way (it would not split into each member's own streams, :func:`split_members`) unless it says its own
        key and :meth:`split` (KVQuant does)."""
        own = type(self)
        if (own.quantize is not KVQuantizer.quantize or own.quantize_k is not KVQuantizer.quantize_k
                or own.quantize_v is not KVQuantizer.quantize_v or not (self.quantizes_k and self.quantizes_v)):
            return None
        return (own.__name__, self.bits, self.k_group_size, self.v_group_size, self.artifact_key())

    def split(self, layer: int, packed: PackedLayer, layout: SlotLayout) -> list[PackedLayer]:
        """Each member's :class:`PackedLayer` of a stacked :meth:`quantize` (``layout`` :meth:`SlotLayout.stacked`):
        the tensors, elements and nominal bits of the member's own write (:func:`split_members`, with each
        member's protected K tokens, :func:`member_kept`)."""
        return split_members(packed, layout, member_kept(self, layer, packed, layout), self.bits)

    def artifact_key(self) -> Hashable:
        """What of the method's fitted artifact decides its writes (None: no artifact; dLLM-KVQ: its policy)."""
        return None

    def _kept(self, layer: int, member: SlotLayout, protected: torch.Tensor | None, index: int,
              stacked: SlotLayout) -> int:
        """Protected K tokens of member ``index`` of a stacked write: :meth:`protected_count` of its own layout,
        or (a method that does not know it on the host) a read of its flags."""
        if protected is None:
            return 0
        kept = self.protected_count(layer, member)
        if kept is None:
            first = sum(m.num_slots for m in stacked.members[:index])
            kept = int(protected[first:first + member.num_slots].sum())
        return kept

    def dequantize(
        self, layer: int, packed: PackedLayer, layout: SlotLayout, out: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Both of one layer: ``[B, H, T_reused, D]`` each, model dtype (padding positions are zero); into the
        ``out`` buffers (K, V) when given. A side the config leaves out (``sides``) is placed as it was held."""
        k_out, v_out = out if out is not None else (None, None)
        k = (self.dequantize_k(layer, packed, layout, k_out) if self.quantizes_k
             else layout.scatter(packed.k.tensors["held"], out=k_out))
        v = (self.dequantize_v(layer, packed, layout, v_out) if self.quantizes_v
             else layout.scatter(packed.v.tensors["held"], out=v_out))
        return k, v

    def kernel_operands(self, layer: int, packed: PackedLayer, layout: SlotLayout) -> KernelOperands:
        """What the fused attention kernel reads of one packed layer (`service.quant.kernels.operands`); the
        kernel reads codes only, so a config with one side held (``sides``) takes the PyTorch path instead."""
        return uniform_operands(packed.k.tensors, packed.v.tensors, self.bits, layout.num_slots, self.v_group_size)

    def concat(self, parts: list[PackedLayer]) -> PackedLayer | None:
        """One packed layer of runs packed alone, in column order, that lie end to end (a block-causal row's
        committed blocks, `service.quant.committed`): codes re-packed as one stream (`packing.pack_stream` of
        the parts' codes laid end to end), per-group and per-token tensors concatenated along dim 0 (KVQuant's
        per-token outlier rows among them: `KVQuantQuantizer._concat_side`); elements and nominal bits summed. Where the quantizer is :meth:`block_separable` at the parts' widths, this is bit for bit what
        :meth:`quantize` makes of the whole run at once with a layout of the run alone (tested), so reading it
        with that layout gives the values each part gives with its own.

        Args:
            parts: at least one; one layer's packed runs of one quantizer, each of whole K groups but the last.

        Returns:
            The joined layer (``parts[0]`` itself when there is one part), or None where the format holds what
            does not simply join: protected K tokens (their slots count from their part's first slot; dLLM-KVQ is
            never block-separable anyway) or a side held as it is (``sides``).

        Cost: per part and side one unpack of its stream; one pack per side (a few tensor operations per part,
        made once when the runs are attached to a row, not at each read).
        """
        if len(parts) == 1:
            return parts[0]
        if not (self.quantizes_k and self.quantizes_v) or any("protected_slots" in p.k.tensors for p in parts):
            return None
        first = parts[0]
        return PackedLayer(k=self._concat_side([p.k for p in parts]), v=self._concat_side([p.v for p in parts]),
                           dtype=first.dtype, num_heads=first.num_heads, head_dim=first.head_dim)

    def _concat_side(self, sides: list[PackedTensor]) -> PackedTensor:
        """:meth:`concat` of one side (K or V) of every part."""
        tensors: dict[str, torch.Tensor] = {}
        for name in sides[0].tensors:
            if name == "codes":
                codes = [unpack_stream(s.tensors["codes"], self.bits, s.elements) for s in sides]
                tensors[name] = pack_stream(torch.cat(codes), self.bits)
            else:
                tensors[name] = torch.cat([s.tensors[name] for s in sides])
        return PackedTensor(tensors=tensors, elements=sum(s.elements for s in sides),
                            nominal_bitsum=sum(s.nominal_bitsum for s in sides))

    def block_separable(self, block_length: int) -> bool:
        """Whether quantizing a run of whole blocks of ``block_length`` tokens one block at a time gives the same
        codes as quantizing the run at once (a block-causal family's prefix cache, `service.engine.prefix_cache`,
        stores blocks so, and serves them only then): K groups of ``k_group_size`` tokens counted from the run's
        first column must not cross a block, and no statistic may read anything but the block's own K/V (a
        quantizer that ``needs_scores`` ranks tokens by the active block's queries, which differ per request)."""
        return not self.needs_scores and block_length % self.k_group_size == 0

    @property
    def quantizes_k(self) -> bool:
        return "k" in self.config.sides

    @property
    def quantizes_v(self) -> bool:
        return "v" in self.config.sides

    # ---- K: per channel over token groups, protected tokens excluded from the statistics ---------------------
    def protect(
        self, layer: int, x: torch.Tensor, layout: SlotLayout, scores: torch.Tensor | None
    ) -> torch.Tensor | None:
        """bool ``[N]``: K tokens kept in the model dtype; None keeps none (KIVI)."""
        return None

    def protected_count(self, layer: int, layout: SlotLayout) -> int | None:
        """How many tokens :meth:`protect` keeps at ``layer``, when that is known on the host without reading
        its result (dLLM-KVQ: ``min(p, group size)`` per K group); None reads it (a host read: a sync on a GPU)."""
        return None

    def quantize_k(self, layer: int, x: torch.Tensor, layout: SlotLayout, scores: torch.Tensor | None) -> PackedTensor:
        """Uniform K: statistics per group and channel over the unprotected tokens; codes of those tokens only."""
        protected = self.protect(layer, x, layout, scores)
        stats = k_group_stats(x, layout, self.bits, protected)
        tensors = {"scale": stats.scale, "mn": stats.mn}
        codes = quantize_k_slots(x, layout, stats, self.bits)
        kept = 0
        if protected is not None:
            kept = self.protected_count(layer, layout)
            if kept is None:
                kept = int(protected.sum())
        if kept:
            # A stable sort of the flags puts the unprotected slots first and the protected ones last, each in
            # slot order (what ``nonzero`` gives), with no host read of where they are.
            order = torch.sort(protected.to(torch.uint8), stable=True).indices
            slots = order[x.shape[0] - kept :]
            tensors["protected_slots"] = slots.to(torch.int32)
            tensors["protected_values"] = x.index_select(0, slots)
            codes = codes.index_select(0, order[: x.shape[0] - kept])  # protected tokens hold no code
        if layout.members:  # a stacked write: one stream per member, its protected tokens left out of it
            kept_of = [self._kept(layer, m, protected, i, layout) for i, m in enumerate(layout.members)]
            # (`member_kept` finds the same counts again from what this returns)
            tensors["codes"] = pack_streams(codes, self.bits, [m.num_slots - k for m, k in zip(layout.members, kept_of)])
        else:
            tensors["codes"] = pack_stream(codes, self.bits)
        per_token = x.shape[1] * x.shape[2]
        return PackedTensor(
            tensors=tensors,
            elements=x.shape[0] * per_token,
            nominal_bitsum=float(per_token * (self.bits * (x.shape[0] - kept) + 16 * kept)),
        )

    def dequantize_k(
        self, layer: int, packed: PackedLayer, layout: SlotLayout, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """K of one layer, ``[B, H, T_reused, D]`` in the model dtype (or into ``out``); protected tokens exact,
        padding zero."""
        t = packed.k.tensors
        h, d = packed.num_heads, packed.head_dim
        n = layout.num_slots
        protected = code_rows = None
        if "protected_slots" in t:
            # Protected slots get code 0 (a zero row of the codes; overwritten below), so every slot dequantizes
            # at once. The gather index is made at the layer's first read of a block: fixed shapes, no host read.
            protected = packed.derived_index("protected_slots", lambda: t["protected_slots"].long())
            code_rows = packed.derived_index("code_rows", lambda: _code_rows(protected, n))
        n_codes = n if protected is None else n - protected.numel()
        stats = GroupStats(scale=t["scale"], mn=t["mn"])
        if layout.batched(h * d):
            work = _float_codes(t["codes"], self.bits, n_codes, h, d)
            if code_rows is not None:  # [n + 1, H, D], the last row zero as `SlotLayout.place` wants
                work = work.index_select(0, code_rows)
            out = dequantize_k_batched(layout.empty_output(h, d, packed.dtype, out), work, stats, layout)
            if protected is not None:
                layout.scatter_slots(t["protected_values"], protected, out)
            return out
        codes = unpack_stream(t["codes"], self.bits, n_codes * h * d).view(n_codes, h, d)
        if code_rows is not None:
            codes = _expand_rows(codes, code_rows[:-1])
        out = layout.empty_output(h, d, packed.dtype, out)
        dequantize_k_into(out, codes, stats, layout)
        if protected is not None:
            layout.scatter_slots(t["protected_values"], protected, out)
        return out

    @classmethod
    def declares_key_steps(cls) -> bool:
        """Whether :meth:`key_steps` describes this method's K format: the base's uniform one (a method that keeps
        :meth:`quantize_k` and :meth:`dequantize_k`), or the method's own override. The key-bias correction needs
        it (`service.quant.store.QuantizedKVStore` refuses the correction otherwise)."""
        base = KVQuantizer
        own_format = cls.quantize_k is not base.quantize_k or cls.dequantize_k is not base.dequantize_k
        return cls.key_steps is not base.key_steps or not own_format

    def key_steps(self, layer: int, packed: PackedLayer, layout: SlotLayout) -> torch.Tensor:
        """float32 ``[N, H, D]``: each slot's K rounding step per channel, for the key-bias correction
        (`service.quant.key_bias`): its group's scale, 0 for a protected token (held exact)."""
        t = packed.k.tensors
        steps = t["scale"].to(torch.float32).index_select(0, layout.group_of_slot)
        if "protected_slots" in t:
            steps.index_fill_(0, packed.derived_index("protected_slots", lambda: t["protected_slots"].long()), 0.0)
        return steps

    # ---- V: per token over channel groups --------------------------------------------------------------------
    def quantize_v(self, layer: int, x: torch.Tensor) -> PackedTensor:
        """Uniform V (KIVI's per-token format, dLLM-KVQ's "standard contiguous value-side QDQ path")."""
        codes, scale, mn = quantize_v(x, self.v_group_size, self.bits)
        return PackedTensor(
            tensors={"codes": _pack(codes, self.bits), "scale": scale, "mn": mn},
            elements=x.numel(),
            nominal_bitsum=float(self.bits * x.numel()),
        )

    def dequantize_v(
        self, layer: int, packed: PackedLayer, layout: SlotLayout, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """V of one layer, ``[B, H, T_reused, D]`` in the model dtype (or into ``out``); padding zero."""
        t = packed.v.tensors
        n, h, d = layout.num_slots, packed.num_heads, packed.head_dim
        out = layout.empty_output(h, d, packed.dtype, out)
        if layout.batched(h * d):
            return dequantize_v_batched(out, _float_codes(t["codes"], self.bits, n, h, d), t["scale"], t["mn"], layout)
        codes = unpack_stream(t["codes"], self.bits, n * h * d).view(n, h, d)
        return dequantize_v_into(out, codes, t["scale"], t["mn"], layout)


#: Per (bits, device): the stream's per-byte table of the codes themselves as float32 (`packing.byte_table`).
_CODE_TABLES: dict[tuple[int, torch.device], torch.Tensor] = {}


def _float_codes(words: torch.Tensor, bits: int, n: int, h: int, d: int) -> torch.Tensor:
    """float32 ``[n + 1, H, D]``: the ``n`` slots' codes as floats, read straight from the stream (no uint8
    codes, no separate conversion), and a zero last row (what `SlotLayout.place` reads for padding)."""
    key = (bits, words.device)
    if key not in _CODE_TABLES:
        _CODE_TABLES[key] = byte_table(torch.arange(2**bits, dtype=torch.float32, device=words.device), bits)
    work = decode_stream(words, _CODE_TABLES[key], n * h * d, extra=h * d).view(n + 1, h, d)
    work[-1].zero_()
    return work


def _code_rows(protected: torch.Tensor, n: int) -> torch.Tensor:
    """int64 ``[n + 1]``: for each slot of ``[0, n)`` its row among the codes of the unprotected slots (held in
    slot order), ``n - len(protected)`` (a zero row after them) for a protected slot and for the spare last entry.

    A slot's row is its index less the protected slots before it (a cumulative count): fixed shapes, so no host
    read of how many slots are kept (``nonzero`` would be one per layer on a GPU).
    """
    n_codes = n - protected.numel()
    mask = torch.zeros(n + 1, dtype=torch.bool, device=protected.device)
    mask[protected] = True
    mask[n] = True
    rows = torch.arange(n + 1, device=protected.device) - mask.cumsum(0)
    return rows.masked_fill_(mask, n_codes)


def _expand_rows(codes: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``[len(rows), H, D]``: ``codes`` ``[n_codes, H, D]`` (uint8) gathered by ``rows``, where ``n_codes`` stands
    for a zero row (see :func:`_code_rows`).

    Rows are moved as int64 words when their byte length allows (8x fewer elements for the gather).
    """
    full = torch.cat([codes, codes.new_zeros(1, *codes.shape[1:])])
    width = codes[0].numel() if codes.shape[0] else 0
    if width and width % 8 == 0:
        words = full.view(full.shape[0], width).view(torch.int64).index_select(0, rows)
        return words.view(torch.uint8).view(rows.numel(), *codes.shape[1:])
    return full.index_select(0, rows)


def _held(x: torch.Tensor) -> PackedTensor:
    """A side held unquantized (``sides``): the slots ``[N, H, D]`` as they are, 16 nominal bits per entry."""
    return PackedTensor(tensors={"held": x}, elements=x.numel(), nominal_bitsum=16.0 * x.numel())


def _finite_slots(
    layer: int, name: str, x: torch.Tensor, layout: SlotLayout, checks: list[torch.Tensor] | None = None
) -> torch.Tensor:
    """The layout's slots of ``x`` (``[N, H, D]``), checked for NaN and inf (with ``checks``: the first test, the
    sum's, appended to it instead of read; the caller reads it and, if it fails, calls again without).

    One float32 sum (NaN and inf propagate; no overflow from fp16/bf16 inputs) instead of an elementwise scan.
    A sum that is not finite is only a hint: large finite values (a constant 1e36, two entries of 3e38) overflow
    it too, so the elementwise scan decides, and names the culprit.

    Raises:
        NonFiniteKVError: some slot holds NaN or +/-inf.
    """
    slots = layout.gather(x)
    finite = torch.isfinite(slots.sum(dtype=torch.float32))
    if checks is not None:
        checks.append(finite)
        return slots
    if bool(finite):
        return slots
    bad = (~torch.isfinite(slots)).flatten(1).any(1).nonzero()
    if bad.numel() == 0:
        return slots
    slot = int(bad[0])
    raise NonFiniteKVError(
        f"layer {layer}: {name} holds NaN or inf at row {int(layout.rows[slot])}, sequence column "
        f"{int(layout.seq_cols[slot])}; refusing to quantize it (it would poison its group's statistics)"
    )


#: While a stacked write packs V (`KVQuantizer._quantize` with a :meth:`SlotLayout.stacked` layout): the slots of
#: each member, whose codes go into a stream of their own (:func:`_pack`); None: one stream.
_MEMBER_SLOTS: ContextVar[list[int] | None] = ContextVar("member_slots", default=None)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """V's codes ``[N, H, D]`` as one stream, or inside a stacked write one per member (:data:`_MEMBER_SLOTS`)."""
    counts = _MEMBER_SLOTS.get()
    return pack_stream(codes, bits) if counts is None else pack_streams(codes, bits, counts)


class _Slices(Mapping):
    """A member's tensors of a stacked write, as its own write would have held them: each a slice of the stacked
    tensor (its streams' words, its K groups, its slots, its protected tokens with their slots made its own),
    made at its first use and kept; ``nbytes`` from the slices' sizes without making them."""

    def __init__(self, stacked: dict[str, torch.Tensor], ranges: dict[str, tuple[int, int]], slot0: int,
                 shifts: dict[str, int] | None = None) -> None:
        self._stacked, self._ranges, self._slot0 = stacked, ranges, slot0
        # What each index tensor's slice is less, to count from the member's start: protected slots its first
        # slot; a method's own may say theirs (KVQuant's per-token outlier rows need none: ``{}``).
        self._shifts = shifts if shifts is not None else {"protected_slots": slot0}
        self._made: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._made:
            start, end = self._ranges[name]
            part = self._stacked[name][start:end]
            if name in self._shifts:
                part = part - self._shifts[name]
            self._made[name] = part
        return self._made[name]

    def __contains__(self, name: object) -> bool:  # (Mapping's would make the slice)
        return name in self._ranges

    def __iter__(self) -> Iterator[str]:
        return iter(self._ranges)

    def __len__(self) -> int:
        return len(self._ranges)

    def stacked(self, name: str) -> torch.Tensor:
        """The stacked tensor ``name`` of the write this member belongs to."""
        return self._stacked[name]

    @property
    def nbytes(self) -> int:
        total = 0
        for name, (start, end) in self._ranges.items():
            t = self._stacked[name]
            total += (end - start) * math.prod(t.shape[1:]) * t.element_size()  # (t[0] would dispatch)
        return total


def device_of(tensors: Mapping[str, torch.Tensor]) -> torch.device:
    """The device of a packed side's tensors, without making a member's slice (:class:`_Slices`)."""
    if isinstance(tensors, _Slices):
        return tensors.stacked("codes").device
    return tensors["codes"].device


def count(tensors: Mapping[str, torch.Tensor], name: str) -> int:
    """Rows of ``tensors[name]`` (0 when absent), without making a member's slice (:class:`_Slices`)."""
    if name not in tensors:
        return 0
    if isinstance(tensors, _Slices):
        start, end = tensors._ranges[name]
        return end - start
    return int(tensors[name].shape[0])


def joined(held: list[Mapping[str, torch.Tensor]], name: str) -> list[tuple[torch.Tensor, int, int | None]]:
    """Pieces whose concatenation along dim 0 is ``torch.cat([t[name] for t in held])``, for a read of many stores
    together: consecutive members of one stacked write (:func:`split_members`) give one piece, the stacked tensor
    itself when they are all of it (no copy) or one slice of it, instead of a slice each. Each piece: ``(tensor,
    index in held of its first member, shift)``, ``shift`` the first member's first slot in its stacked write
    for ``protected_slots`` read from a stacked tensor (whose slots count from the write's first slot, not the
    member's), else None."""
    pieces: list[tuple[torch.Tensor, int, int | None]] = []
    i = 0
    while i < len(held):
        t = held[i]
        if not isinstance(t, _Slices) or name not in t._ranges:
            pieces.append((t[name], i, None))
            i += 1
            continue
        start, end = t._ranges[name]
        j = i + 1
        while (j < len(held) and isinstance(held[j], _Slices) and held[j]._stacked is t._stacked
               and name in held[j]._ranges and held[j]._ranges[name][0] == end):
            end = held[j]._ranges[name][1]
            j += 1
        whole = t._stacked[name]
        if j == i + 1 and name != "protected_slots":
            pieces.append((t[name], i, None))
        else:
            part = whole if (start, end) == (0, whole.shape[0]) else whole[start:end]
            pieces.append((part, i, t._slot0 if name == "protected_slots" else None))
        i = j
    return pieces


def protected_offsets(pieces: list[tuple[torch.Tensor, int, int | None]], counts: tuple[int, ...],
                      num_slots: list[int]) -> list[int]:
    """Per protected entry of the :func:`joined` ``protected_slots`` ``pieces`` of stores with ``counts`` protected
    tokens and ``num_slots`` slots each: what to add to make it the slot's index among all the stores' slots (a
    member's own slots count from its first; a stacked piece's from its write's first, ``shift``)."""
    firsts = [sum(num_slots[:i]) for i in range(len(counts))]
    starts: list[int] = []
    for n, (_, first, shift) in enumerate(pieces):
        end = pieces[n + 1][1] if n + 1 < len(pieces) else len(counts)
        starts += [firsts[i] if shift is None else firsts[first] - shift
                   for i in range(first, end) for _ in range(counts[i])]
    return starts


@dataclass(eq=False)
class MemberTensor(PackedTensor):
    """One member's K or V of a stacked write (:func:`split_members`): :class:`PackedTensor` over :class:`_Slices`."""

    @property
    def nbytes(self) -> int:
        return self.tensors.nbytes  # type: ignore[attr-defined]


def member_kept(quantizer: KVQuantizer, layer: int, packed: PackedLayer, layout: SlotLayout) -> list[int]:
    """Each member's protected K tokens in a stacked write's ``packed`` (``layout`` :meth:`SlotLayout.stacked`):
    :meth:`KVQuantizer.protected_count` of its own layout, or for a method that does not know it on the host one
    read of where the members' slots start among the sorted protected slots."""
    if "protected_slots" not in packed.k.tensors:
        return [0] * len(layout.members)
    kept = [quantizer.protected_count(layer, member) for member in layout.members]
    if None in kept:
        bounds, first = [], 0
        for member in layout.members:
            bounds.append(first)
            first += member.num_slots
        slots = packed.k.tensors["protected_slots"].long()
        starts = torch.searchsorted(slots, torch.tensor(bounds + [first], device=slots.device)).tolist()
        kept = [b - a for a, b in itertools.pairwise(starts)]
    return kept


def split_members(packed: PackedLayer, layout: SlotLayout, kept: list[int], bits: int) -> list[PackedLayer]:
    """Each member's :class:`PackedLayer` of a stacked write (``layout`` :meth:`SlotLayout.stacked`, ``packed`` what
    :meth:`KVQuantizer.quantize` made of it; ``kept``: each member's protected K tokens): the same tensors,
    elements and nominal bits as the member's own write (slices, made when first read; nothing here reads or
    dispatches)."""
    h, d = packed.num_heads, packed.head_dim
    per_token = h * d
    protected = "protected_slots" in packed.k.tensors
    out, slot0, group0, prot0, kw0, vw0 = [], 0, 0, 0, 0, 0
    for member, n_kept in zip(layout.members, kept, strict=True):
        n, groups = member.num_slots, member.num_groups
        kw, vw = stream_words((n - n_kept) * per_token, bits), stream_words(n * per_token, bits)
        k_ranges = {"scale": (group0, group0 + groups), "mn": (group0, group0 + groups)}
        if protected and n_kept:
            k_ranges |= {"protected_slots": (prot0, prot0 + n_kept), "protected_values": (prot0, prot0 + n_kept)}
        k_ranges["codes"] = (kw0, kw0 + kw)
        v_ranges = {"codes": (vw0, vw0 + vw), "scale": (slot0, slot0 + n), "mn": (slot0, slot0 + n)}
        k = MemberTensor(_Slices(packed.k.tensors, k_ranges, slot0), n * per_token,
                         float(per_token * (bits * (n - n_kept) + 16 * n_kept)))
        v = MemberTensor(_Slices(packed.v.tensors, v_ranges, slot0), n * per_token, float(bits * n * per_token))
        out.append(PackedLayer(k=k, v=v, dtype=packed.dtype, num_heads=h, head_dim=d))
        slot0, group0, prot0, kw0, vw0 = slot0 + n, group0 + groups, prot0 + n_kept, kw0 + kw, vw0 + vw
    return out
