"""Quantized K/V on a block-causal model's committed blocks (LLaDA2's ``block`` cache mode), held packed.

A block-causal model's committed blocks never change (`service.engine.block_causal`), so their K/V are
quantized once, when their block commits, and kept packed (:class:`CommittedBlocks`: per layer, per block, the
`service.quant.base.PackedLayer` the quantizer made: codes with scales/zeros, or KVQuant's codes and outliers,
the formats of the other families' stores); the active block stays in full precision. Every later forward reads
them back per layer: the row's committed columns are dequantized into the batch's one-layer scratch
(`service.engine.models.llada2.CommittedKV`: a quantized row holds no full-precision copy of its committed
blocks between forwards), so the bytes held are the packed bytes the request's accounting
(`service.quant.accounting.KVAccounting`) reports and admission counts, plus that scratch.

The quantization runs inside the forward, per layer, between the scatter of the window's K/V and the attention
(the ``on_write`` hook of `CommittedKV`): the first forward of a block, which computes the just-committed block's
final K/V, already attends over their dequantized values, as every later forward does. The values attention
reads are the same as a quantize-dequantize in place would leave (the same quantize call, the same slots and K
groups on the read), so decoding is token for token what it was when the cache held them dequantized.

Methods: KIVI (``kivi``), dLLM-KVQ (``dllm_kvq``) and KVQuant (``kvquant``). dLLM-KVQ's attention score of a
committing column is the probability the active block's queries put on it in the forward that commits it
(`attention_scores`: mean over query heads and the block's queries, keys up to the active block's end, which is
what those queries see under the block-causal mask), the other families' block-initial score in this family's
terms. KVQuant quantizes the committing columns' pre-RoPE keys (the forward's own, taken before its rotation)
and the dequantized keys take partial RoPE at their positions (only the rotated channels: the model's
``rotate_keys``) at every read.

Cost: a read dequantizes each packed run of each quantized row separately (a few tensor operations per run, row
and layer, per forward). A row's prompt is committed as one run, except where the prefix cache is involved
(`service.engine.prefix_cache`), which stores and serves whole blocks one by one: there the runs are joined into
one per layer when they are attached to the row (:meth:`CommittedBlocks.merge`, `KVQuantizer.concat`: once per
request, not per forward; the cached blocks a row reads are joined once for all rows reading the same chain,
`PrefixCache.joined`), so a row that hit 24 cached blocks reads one run per layer, not 24.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from service.engine.kv_store import DEFER_WRITE_CHECKS, Segments
from service.engine.scores import attention_scores
from service.quant.accounting import KVAccounting
from service.quant.base import KVQuantizer, PackedLayer
from service.quant.errors import KVQuantError
from service.quant.key_bias import key_score_bias
from service.quant.layout import SlotLayout

#: ``rotate_keys(k, positions)``: the model's RoPE of pre-RoPE keys ``[B, H_kv, T, D]`` at int64 ``[B, T]``.
RotateKeys = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
#: ``key_rotation(positions)``: float32 cos, sin ``[B, 1, T, R]`` of the model's RoPE at int64 ``[B, T]``
#: (rotate-half layout over the first ``R`` channels, the rest unrotated: LLaDA2's partial RoPE).
KeyRotation = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class CommittedBlocks:
    """One row's committed blocks, packed: per layer, ``(start, end, packed)`` per block in commit order.

    The packed layers are the quantizer's own (`KVQuantizer.quantize` over the block's columns); ``read_into``
    dequantizes them with a layout of the block alone (its slots and K groups in the same order as at the write:
    groups counted from the block's first column), so the values are those of the write's layout.
    """

    quantizer: KVQuantizer
    layers: dict[int, list[tuple[int, int, PackedLayer]]] = field(default_factory=dict)
    _layouts: dict[tuple[int, str], SlotLayout] = field(default_factory=dict)

    def add(self, layer: int, start: int, end: int, packed: PackedLayer) -> None:
        self.layers.setdefault(layer, []).append((start, end, packed))

    def read_into(self, layer: int, slot: int, k_buf: torch.Tensor, v_buf: torch.Tensor,
                  rotate_keys: RotateKeys, read: dict[int, int] | None = None, offset: int = 0,
                  steps: torch.Tensor | None = None) -> None:
        """Write the layer's committed K/V (model dtype; keys post-RoPE) at their columns of row ``slot`` of
        ``k_buf``/``v_buf`` ``[B, H_kv, capacity, D]``; other columns untouched. ``offset``: the position of the
        buffers' column 0 (a renoising family's sliding window holds only its last positions,
        `service.quant.canvas`); RoPE still rotates keys at their positions.

        ``read``: packed layers already read into another slot of the same buffers in this forward (``id`` -> that
        slot), updated here: a block shared by several rows (a prefix cache's, `service.engine.prefix_cache`,
        always at the same columns) is dequantized once per forward and layer and copied to the others.

        ``steps``: float32 ``[B, H_kv, capacity, D]`` or None: each read key's rounding steps go to the same
        columns (`KVQuantizer.key_steps`, in the basis the keys were rounded in: pre-RoPE for KVQuant), for the
        key-bias correction (:class:`CommitWriter`)."""
        for start, end, packed in self.layers.get(layer, ()):
            a, b = start - offset, end - offset
            done = read.get(id(packed)) if read is not None else None
            if done is not None:
                k_buf[slot, :, a:b] = k_buf[done, :, a:b]
                v_buf[slot, :, a:b] = v_buf[done, :, a:b]
                if steps is not None:
                    steps[slot, :, a:b] = steps[done, :, a:b]
                continue
            layout = self._layout(end - start, k_buf.device)
            k, v = self.quantizer.dequantize(layer, packed, layout)  # [1, H, w, D]
            if steps is not None:
                steps[slot, :, a:b] = self.quantizer.key_steps(layer, packed, layout).transpose(0, 1)
            if self.quantizer.pre_rope_keys:
                k = rotate_keys(k, torch.arange(start, end, device=k.device)[None])
            k_buf[slot, :, a:b] = k[0]
            v_buf[slot, :, a:b] = v[0]
            if read is not None:
                read[id(packed)] = slot

    def merge(self, layer: int, start: int, end: int) -> None:
        """Join the layer's runs that lie within columns ``[start, end)`` into one (`KVQuantizer.concat`), where
        there are two or more and the quantizer joins them; otherwise leave them. The values a read gives are
        the same (the quantizer is block-separable at the runs' widths: a row whose runs were packed alone,
        `Commit.pieces`, is one whose quantizer is); the joined run is the row's own (the parts stay where else
        they are held, e.g. the prefix cache)."""
        runs = self.layers.get(layer, [])
        inside = [i for i, (a, b, _) in enumerate(runs) if a >= start and b <= end]
        if len(inside) < 2 or inside != list(range(inside[0], inside[-1] + 1)):
            return
        joined = self.quantizer.concat([runs[i][2] for i in inside])
        if joined is not None:
            runs[inside[0]:inside[-1] + 1] = [(runs[inside[0]][0], runs[inside[-1]][1], joined)]

    def before(self, start: int) -> CommittedBlocks:
        """A copy holding only the blocks that start before column ``start`` (the packed layers themselves are
        shared): the row as it was before the forward that commits ``start`` onward."""
        layers = {layer: [b for b in blocks if b[0] < start] for layer, blocks in self.layers.items()}
        return CommittedBlocks(self.quantizer, layers, self._layouts)

    def _layout(self, width: int, device: torch.device) -> SlotLayout:
        """The layout of one block of ``width`` columns on its own (shared by the row's blocks of that width)."""
        key = (width, str(device))
        if key not in self._layouts:
            self._layouts[key] = SlotLayout.from_segments(Segments((0,), width, width + 1, width + 1, "prefix"),
                                                          self.quantizer.k_group_size, device)
        return self._layouts[key]

    @property
    def nbytes(self) -> int:
        """Bytes held: the packed layers (and indexes derived from them) and the read layouts' index tensors."""
        held = sum(p.nbytes + p.derived_nbytes for blocks in self.layers.values() for _, _, p in blocks)
        return held + sum(layout.nbytes for layout in self._layouts.values())


@dataclass(frozen=True)
class Commit:
    """One quantized row of a forward: its cache slot ``slot``, the columns ``[start, end)`` that commit in this
    forward (empty on a later step; the window starts at ``start``; the active block is ``[end, end + block)``),
    its committed blocks held packed (read before ``start``), and the quantizer and accounting that take the
    committing columns (the request's `service.quant.store.QuantizedKVStore` parts). ``pieces``: 0 packs the
    committing columns as one run; a block length cuts them into runs of that many columns, each packed alone (a
    prefix cache stores a prompt's blocks one by one, `service.engine.prefix_cache`; the codes are the same when
    the quantizer is `KVQuantizer.block_separable`)."""

    slot: int
    start: int
    end: int
    block: int
    quantizer: KVQuantizer
    accounting: KVAccounting
    held: CommittedBlocks
    pieces: int = 0

    def runs(self) -> list[tuple[int, int]]:
        """The committing columns ``[a, b)`` packed alone, in order (one run unless ``pieces``)."""
        if self.pieces <= 0 or self.end <= self.start:
            return [(self.start, self.end)]
        return [(a, min(a + self.pieces, self.end)) for a in range(self.start, self.end, self.pieces)]

    @staticmethod
    def hook(commits: list[Commit], rotate_keys: RotateKeys,
             key_rotation: KeyRotation | None = None) -> CommitWriter | None:
        """`commit_hook`, reached through a commit so that the engine, which gets its commits from the requests'
        stores, needs no import of this package."""
        return commit_hook(commits, rotate_keys, key_rotation)

    def alone(self) -> Commit:
        """This row in slot 0 of a forward of its own, its committed blocks as before this commit's forward and a
        throwaway accounting: for running its forward again with each check read at once (the failure path of
        a check put off, :class:`CommitWriter`), so that what it raises is what the write raised before the
        checks were put off."""
        return Commit(0, self.start, self.end, self.block, self.quantizer, KVAccounting(),
                      self.held.before(self.start), self.pieces)


def commit_hook(commits: list[Commit], rotate_keys: RotateKeys,
                key_rotation: KeyRotation | None = None) -> CommitWriter | None:
    """The ``on_write`` hook of one forward (:class:`CommitWriter`), or None when there is no quantized row.

    Args:
        commits: this forward's quantized rows (one per slot); ``end < capacity`` for each.
        rotate_keys: the model's RoPE of pre-RoPE keys (for a quantizer with ``pre_rope_keys``).
        key_rotation: the model's RoPE cos/sin, for the key-bias correction of pre-RoPE keys (KVQuant's).

    Raises:
        KVQuantError: ``key_bias_correction`` on a pre-RoPE quantizer with no ``key_rotation``.
    """
    return CommitWriter(commits, rotate_keys, key_rotation) if commits else None


class CommitWriter:
    """The ``on_write(layer, q, k_pre, k_buf, v_buf)`` hook of one forward: for each quantized row, its committed
    blocks are dequantized into its slot, then the columns that commit now are quantized, kept packed and
    written back dequantized (q: the window's post-RoPE queries ``[B, H, T_w, D]``; k_pre: its pre-RoPE keys
    ``[B, H_kv, T_w, D]``; each commit's window starts at its ``start``; k_buf, v_buf: the layer's K/V
    ``[B, H_kv, capacity, D]``, model dtype, the window already written at its columns).

    A write raises what `KVQuantizer.quantize` raises (`service.quant.errors.NonFiniteKVError` for a NaN/inf K or
    V). Inside a running batch's iteration (`service.engine.kv_store.DEFER_WRITE_CHECKS`) the writes' checks are
    not read: each committing row's verdict (ANDed over the layers) stays on the device for :meth:`take_checks`,
    which the iteration's one host read joins (a read per row per layer before). A row whose verdict is False
    holds packed layers that must not be used (its K/V, hence its logits, may be NaN; no other row attends over
    them): its forward is run again alone with each check read at once (`Commit.alone`), which raises what the
    write raised, or, for a false alarm, writes the same K/V.

    **Key-bias correction** (`service.quant.key_bias`; a commit whose quantizer's config has
    ``key_bias_correction``): the hook returns the additive bias on the scaled scores, float32 ``[B, H, T_w,
    capacity]`` (`key_score_bias` of the window's queries and each committed key's rounding steps, written beside
    the dequantized keys by the reads and writes; 0 for the active block, the other rows and the uncorrected ones),
    which the model adds to its block-causal mask; None when no row corrects (the attention is exactly the
    uncorrected one). KVQuant's keys are rounded before RoPE: the rotated channels take the query rotated back by
    each key's angle (``key_rotation``), the unrotated ones (LLaDA2's partial RoPE) the query as it is, each part
    weighted by its share of the head dim (the term is ``/ (24 d)`` over the whole head).
    """

    def __init__(self, commits: list[Commit], rotate_keys: RotateKeys,
                 key_rotation: KeyRotation | None = None) -> None:
        self.commits, self.rotate_keys, self.key_rotation = commits, rotate_keys, key_rotation
        self.committing = [c for c in commits if c.end > c.start]
        self.corrected = [c for c in commits if c.quantizer.config.key_bias_correction]
        if key_rotation is None and any(c.quantizer.pre_rope_keys for c in self.corrected):
            raise KVQuantError("key_bias_correction of pre-RoPE keys needs the model's RoPE (key_rotation)",
                               "key_bias_correction")
        self._steps: torch.Tensor | None = None  # float32 [B, H_kv, capacity, D], zeroed once per forward
        self._layouts: list[list[SlotLayout]] = []  # per commit, per run: made at the first layer, on the device
        self._verdicts: dict[int, torch.Tensor] = {}  # slot -> bool 0-dim, the checks put off

    def take_checks(self, batch: int) -> torch.Tensor | None:
        """The verdicts of the checks put off since the last call, and forget them: bool ``[batch]`` per cache
        slot on the device (True: every check of the row passed, or it had none); None when none were put off."""
        if not self._verdicts:
            return None
        verdicts, self._verdicts = self._verdicts, {}
        slots = list(verdicts)
        out = torch.ones(batch, dtype=torch.bool, device=verdicts[slots[0]].device)
        out[slots] = torch.stack([verdicts[s] for s in slots])
        return out

    @staticmethod
    def _layout_of(commit: Commit, start: int, end: int, device: torch.device) -> SlotLayout:
        # The committing columns [start, end) as one row's reused prefix after "padding" [0, start) (the columns
        # committed before): K groups run over them from ``start``, as in the other families' prefix segment.
        return SlotLayout.from_segments(Segments((start,), end, end + 1, end + 1, "prefix"),
                                        commit.quantizer.k_group_size, device)

    def __call__(self, layer: int, q: torch.Tensor, k_pre: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                 columns: int | None = None) -> torch.Tensor | None:
        """Read and write the layer's packed rows (class doc); the key-bias correction's float32 ``[B, H, T_w,
        columns]`` (``columns``: the keys attention reads, default the capacity), or None when no row corrects."""
        rotate_keys, committing, layouts = self.rotate_keys, self.committing, self._layouts
        read: dict[int, int] = {}  # the packed blocks read into a slot in this layer: shared ones are copied
        steps = None
        if self.corrected:
            # Zeroed once per forward: every layer writes the same columns of the same corrected rows, so the
            # zeros left are the active block's, the full-precision rows' and the uncorrected rows' (step 0).
            if self._steps is None:
                self._steps = torch.zeros(k_buf.shape, dtype=torch.float32, device=k_buf.device)
            steps = self._steps
        corrected = {id(c) for c in self.corrected}
        for commit in self.commits:
            own = steps if id(commit) in corrected else None
            # A shared block read by an uncorrected row must not be copied into a corrected row's steps (they
            # were not written): a corrected row reads its blocks itself.
            commit.held.read_into(layer, commit.slot, k_buf, v_buf, rotate_keys,
                                  read if own is None else None, steps=own)
        if len(layouts) < len(committing):
            layouts.extend([self._layout_of(c, a, b, k_buf.device) for a, b in c.runs()] for c in committing)
        deferred = DEFER_WRITE_CHECKS.get()
        for commit, run_layouts in zip(committing, layouts):
            quantizer, width, slot = commit.quantizer, commit.end - commit.start, commit.slot
            # (a write whose false alarm packs something else is checked at once: its packed run and the logits
            # made from it are kept on a false alarm, `KVQuantizer.redone_on_false_verdict`)
            put_off = deferred and not quantizer.redone_on_false_verdict
            scores = None
            if quantizer.needs_scores:
                queries = q[slot:slot + 1, :, width:width + commit.block]  # the active block's
                keys = k_buf[slot:slot + 1, :, : commit.end + commit.block]
                scores = attention_scores(queries, keys, None)  # float32 [1, end + block]
            for (start, end), layout in zip(commit.runs(), run_layouts):
                self._write_run(layer, commit, start, end, layout, k_pre, k_buf, v_buf, scores, put_off,
                                steps if id(commit) in corrected else None)
        if steps is None:
            return None
        return self._score_bias(q, steps[:, :, : k_buf.shape[2] if columns is None else columns])

    def _score_bias(self, q: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """float32 ``[B, H, T_w, K]``: `key_score_bias` of the window's post-RoPE queries ``q`` ``[B, H, T_w, D]``
        and the keys' steps ``[B, H_kv, K, D]`` (column = position), each row in its quantizer's basis."""
        pre = [c.slot for c in self.corrected if c.quantizer.pre_rope_keys]
        bias = key_score_bias(q, steps) if len(pre) < len(self.corrected) else None
        if pre:
            b, d, keys = q.shape[0], q.shape[-1], steps.shape[2]
            cos, sin = self.key_rotation(torch.arange(keys, device=q.device).expand(b, keys))
            r = cos.shape[-1]
            rotated = key_score_bias(q[..., :r], steps[..., :r], cos, sin).mul_(r / d)
            if r < d:
                rotated += key_score_bias(q[..., r:], steps[..., r:]).mul_((d - r) / d)
            if bias is None:
                bias = rotated
            else:
                bias[pre] = rotated[pre]
        return bias

    def _write_run(self, layer: int, commit: Commit, start: int, end: int, layout: SlotLayout, k_pre: torch.Tensor,
                   k_buf: torch.Tensor, v_buf: torch.Tensor, scores: torch.Tensor | None, deferred: bool,
                   steps: torch.Tensor | None = None) -> None:
        """Quantize the committing columns ``[start, end)`` of ``commit`` as one packed run, keep it and write it
        back dequantized (the window starts at ``commit.start``), and its keys' rounding steps into ``steps``
        (float32 ``[B, H_kv, capacity, D]``) when given."""
        quantizer, slot, rotate_keys = commit.quantizer, commit.slot, self.rotate_keys
        k = k_buf[slot:slot + 1, :, : end + 1]
        if quantizer.pre_rope_keys:  # the run's pre-RoPE keys at their columns (others unread)
            k = torch.zeros_like(k)
            k[:, :, start:end] = k_pre[slot:slot + 1, :, start - commit.start:end - commit.start]
        v = v_buf[slot:slot + 1, :, : end + 1]
        verdicts: list[torch.Tensor] | None = [] if deferred else None
        packed = quantizer.quantize(layer, k, v, layout, scores, verdicts)
        if verdicts:
            held = self._verdicts.get(slot)
            self._verdicts[slot] = verdicts[0] if held is None else held & verdicts[0]
        commit.accounting.add(layer, packed)
        commit.held.add(layer, start, end, packed)
        k_dq, v_dq = quantizer.dequantize(layer, packed, layout)  # [1, H_kv, end, D]
        k_dq = k_dq[:, :, start:end]
        if quantizer.pre_rope_keys:
            positions = torch.arange(start, end, device=k_dq.device)[None]
            k_dq = rotate_keys(k_dq, positions)
        k_buf[slot, :, start:end] = k_dq[0]
        v_buf[slot, :, start:end] = v_dq[0, :, start:end]
        if steps is not None:
            steps[slot, :, start:end] = quantizer.key_steps(layer, packed, layout).transpose(0, 1)
