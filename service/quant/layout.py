"""`SlotLayout`: which reused K/V entries of a block are quantized, and how K tokens are grouped.

A **slot** is one real (non-padding) reused token of one row. Slots are numbered row by row, in reused-axis
order, so a row's slots are the same whatever else is in the batch. K groups (``k_group_size`` tokens) are cut
inside each contiguous reused segment of one row (`Segments.row_segments`: the prefix from the row's first real
token, and in dual mode the suffix from the block end): statistics never cross a segment or a row, padding never
enters one, and a segment whose length is not a multiple of G ends in a short group with its own statistics
(DESIGN.md "Rules that hold everywhere"). The reference (KIVI ``quant_and_pack_kcache``) asserts ``T % G == 0``
instead; the short last group is our departure.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import torch

from service.engine.kv_store import Segments

#: A layout with more runs than this is handled in whole-layer tensor operations (per-slot statistics, one
#: gather of all slots) instead of a few operations per run: with many short runs (a batch of short rows) the
#: per-run calls, not their arithmetic, are what a read or write costs on a CPU; with a few long runs (one row)
#: broadcasting per run is cheaper than gathering per-slot statistics.
BATCHED_RUNS = 4
#: ... as long as a whole layer's K (or V), ``B x T_reused x H x D`` entries, is at most this many: the whole-layer
#: operations make float32 temporaries of that size, which bounds the transient memory they add.
BATCHED_ELEMENTS = 2**20


@dataclass(frozen=True, eq=False)
class SlotLayout:
    """Slots and K groups of one block (shared by every layer of the block).

    Attributes:
        batch_size: B.
        num_reused: T_reused, the length of the reused axis the store returns.
        rows: int64 ``[N]``, the row of each slot.
        cols: int64 ``[N]``, the slot's index on the reused axis.
        seq_cols: int64 ``[N]``, the slot's column in the full sequence (for ``write``'s K/V and scores).
        group_of_slot: int64 ``[N]``, the K group of each slot.
        group_slots: int64 ``[Ng, G]``, the slots of each K group in order, padded with ``N`` (a sentinel) when
            the group is short.
        group_size: G (``k_group_size``).
        runs: one ``(row, col, slot, length, group)`` per contiguous reused segment of a row: its first reused
            index, first slot, number of slots and first K group (its groups are consecutive, all full but the
            last). Dequantization works run by run with broadcast statistics, which is several times faster
            than gathering per-slot statistics.
        zero_padding: :meth:`empty_output` zeroes the padding of a given buffer; False for a scratch buffer
            whose padding is known to be zero already (filled before with this layout).
        seq_starts: per run, its first column in the full sequence (host ints, so :meth:`gather` reads no
            device value; empty when not known).
        members: a :meth:`stacked` layout's member layouts, in row order (empty otherwise).
    """

    batch_size: int
    num_reused: int
    rows: torch.Tensor
    cols: torch.Tensor
    seq_cols: torch.Tensor
    group_of_slot: torch.Tensor
    group_slots: torch.Tensor
    group_size: int
    runs: tuple[tuple[int, int, int, int, int], ...]
    zero_padding: bool = True
    seq_starts: tuple[int, ...] = ()
    members: tuple[SlotLayout, ...] = ()

    @property
    def num_slots(self) -> int:
        return int(self.rows.numel())

    @property
    def num_groups(self) -> int:
        return int(self.group_slots.shape[0])

    def batched(self, per_slot: int) -> bool:
        """Whole-layer operations rather than per-run ones for ``per_slot`` (H x D) entries per token (see
        ``BATCHED_RUNS``, ``BATCHED_ELEMENTS``); always for a :meth:`stacked` layout, whose write takes the whole
        layer of every member's rows, which the forward holds anyway."""
        if self.members:
            return True
        return len(self.runs) > BATCHED_RUNS and self.batch_size * self.num_reused * per_slot <= BATCHED_ELEMENTS

    @classmethod
    def stacked(cls, layouts: list[SlotLayout]) -> SlotLayout:
        """The layouts of several requests' blocks as one, their rows stacked (member ``i``'s row ``r`` becomes
        row ``r`` plus the rows before it; its slots and K groups likewise follow the earlier members'), for one
        write of all of them (`service.quant.store.QuantizedKVStore.write_batch`): each slot keeps its member's
        sequence column (the stacked K/V hold each member's sequence from column 0) and every group its
        member's slots, so each member's statistics and codes are those its own layout gives. ``num_reused`` is
        the longest member's. Built from the members' host runs (``seq_starts`` known), one tensor per field.
        """
        rows, cols, seq_cols, group_of_slot, group_slots, runs, starts = [], [], [], [], [], [], []
        row0 = slot0 = group0 = 0
        for layout in layouts:
            for (row, col, slot, length, group), start in zip(layout.runs, layout.seq_starts, strict=True):
                runs.append((row + row0, col, slot + slot0, length, group + group0))
                starts.append(start)
                rows.extend([row + row0] * length)
                cols.extend(range(col, col + length))
                seq_cols.extend(range(start, start + length))
                first = slot + slot0
                for g0 in range(0, length, layout.group_size):
                    size = min(layout.group_size, length - g0)
                    group_of_slot.extend([len(group_slots)] * size)
                    group_slots.append(list(range(first + g0, first + g0 + size)))
            row0 += layout.batch_size
            slot0 += layout.num_slots
            group0 += layout.num_groups
        g = layouts[0].group_size
        device = layouts[0].rows.device
        host = torch.tensor([rows, cols, seq_cols, group_of_slot], dtype=torch.int64).view(4, slot0).to(device)
        padded = torch.tensor([m + [slot0] * (g - len(m)) for m in group_slots], dtype=torch.int64)
        return cls(batch_size=row0, num_reused=max(layout.num_reused for layout in layouts), rows=host[0],
                   cols=host[1], seq_cols=host[2], group_of_slot=host[3], group_slots=padded.view(-1, g).to(device),
                   group_size=g, runs=tuple(runs), seq_starts=tuple(starts), members=tuple(layouts))

    @cached_property
    def active_slots(self) -> torch.Tensor | None:
        """int64 ``[N_a]``: the slots of ``runs`` in order, or None when that is every slot (a ``select_rows``
        layout drops the runs, and so the slots, of the rows a step leaves out)."""
        covered = sum(length for _, _, _, length, _ in self.runs)
        if covered == self.num_slots:
            return None
        device = self.rows.device
        if not self.runs:
            return torch.zeros(0, dtype=torch.int64, device=device)
        return torch.cat([torch.arange(slot, slot + length, device=device) for _, _, slot, length, _ in self.runs])

    @cached_property
    def _active_with_spare(self) -> torch.Tensor | None:
        active = self.active_slots
        return None if active is None else torch.cat([active, active.new_full((1,), self.num_slots)])

    def take_active(self, x: torch.Tensor, spare: bool = False) -> torch.Tensor:
        """The rows of the active slots of a per-slot tensor ``[N, ...]`` (``spare``: ``[N + 1, ...]``, its last
        row kept last): ``x`` itself when every slot is active, else a gather."""
        index = self._active_with_spare if spare else self.active_slots
        return x if index is None else x.index_select(0, index)

    @cached_property
    def slot_map(self) -> torch.Tensor:
        """int64 ``[B x T_reused]``: at each (row, reused column) the index of its slot among the active slots
        (``active_slots``; all slots in order when every slot is active), ``N_a`` where there is none (padding;
        the active window of an ``on_sequence`` layout; a buffer row)."""
        active = self.active_slots
        n = self.num_slots if active is None else int(active.numel())
        rows, cols = (self.rows, self.cols) if active is None else (self.rows[active], self.cols[active])
        flat = torch.full((self.batch_size * self.num_reused,), n, dtype=torch.int64, device=self.rows.device)
        flat[rows * self.num_reused + cols] = torch.arange(n, device=self.rows.device)
        return flat

    def place(self, values: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Fill all of ``out`` ``[B, H, T_reused, D]`` from ``values`` ``[N_a + 1, H, D]`` (the active slots, see
        ``take_active``), whose last row is zero: each (row, column) takes its slot's values, padding (and any
        column without a slot) the zero row; one gather in (row, column) order and one transposing copy, cast to
        out's dtype. For ``batched`` layouts."""
        b, h, t, d = out.shape
        out.copy_(values.index_select(0, self.slot_map).view(b, t, h, d).permute(0, 2, 1, 3))
        return out

    @cached_property
    def group_slots_high(self) -> torch.Tensor:
        """``group_slots`` with the short-group padding pointing at slot ``N + 1`` instead of ``N``: gathering
        from the slots followed by a row of +inf and a row of -inf, ``group_slots`` reads +inf (neutral for a
        minimum) and this reads -inf (neutral for a maximum) where a group is short."""
        return torch.where(self.group_valid, self.group_slots, self.num_slots + 1)

    @property
    def group_valid(self) -> torch.Tensor:
        """bool ``[Ng, G]``: which entries of ``group_slots`` are real slots (False on the short-group padding)."""
        return self.group_slots < self.num_slots

    @property
    def nbytes(self) -> int:
        """Bytes of the index tensors (held once per block for all layers)."""
        tensors = (self.rows, self.cols, self.seq_cols, self.group_of_slot, self.group_slots)
        return sum(t.numel() * t.element_size() for t in tensors)

    @classmethod
    def from_segments(cls, segments: Segments, group_size: int, device: torch.device | str = "cpu") -> SlotLayout:
        """Build the layout of a block.

        Args:
            segments: the block's padding and reused segments.
            group_size: K tokens per group (> 0).
            device: where the index tensors live (the K/V device).
        """
        rows, cols, groups, runs = [], [], [], []
        slot = 0
        for row in range(segments.batch_size):
            for start, end in segments.row_segments(row):
                length = end - start
                runs.append((row, start, slot, length, len(groups)))
                rows.extend([row] * length)
                cols.extend(range(start, end))
                for g0 in range(0, length, group_size):
                    members = list(range(slot + g0, slot + min(g0 + group_size, length)))
                    groups.append(members)
                slot += length
        num_slots = slot
        # Built as lists and made tensors once (a block has tens of groups; one tensor op each adds up).
        group_slots = torch.tensor(
            [members + [num_slots] * (group_size - len(members)) for members in groups], dtype=torch.int64
        ).view(len(groups), group_size)
        group_of_slot = torch.tensor([g for g, members in enumerate(groups) for _ in members], dtype=torch.int64)
        cols_t = torch.tensor(cols, dtype=torch.int64)
        return cls(
            batch_size=segments.batch_size,
            num_reused=segments.num_reused,
            rows=torch.tensor(rows, dtype=torch.int64, device=device),
            cols=cols_t.to(device),
            seq_cols=segments.reused_columns[cols_t].to(device),
            group_of_slot=group_of_slot.to(device),
            group_slots=group_slots.to(device),
            group_size=group_size,
            runs=tuple(runs),
            seq_starts=tuple(col if col < segments.block_start else col + segments.block_end - segments.block_start
                             for _, col, _, _, _ in runs),
        )

    def parts(self):
        """Blocks of whole groups, for broadcast statistics: per run, its full groups, then its short last group.

        Yields ``(row, col, slot, n_groups, size, group)``: ``n_groups`` groups of ``size`` tokens starting at
        reused index ``col``, slot ``slot`` and K group ``group``.
        """
        for row, col, slot, length, group in self.runs:
            full, tail = divmod(length, self.group_size)
            if full:
                yield row, col, slot, full, self.group_size, group
            if tail:
                offset = full * self.group_size
                yield row, col + offset, slot + offset, 1, tail, group + full

    def spans(self):
        """Runs merged where they touch (a row's prefix and suffix are adjacent on the reused axis and in slot
        order): ``(row, col, slot, length)``, at most one per row. For per-token formats (V), which need no
        group boundaries, this halves the work items of a dual-cache read."""
        merged: list[list[int]] = []
        for row, col, slot, length, _ in self.runs:
            last = merged[-1] if merged else None
            if last and last[0] == row and last[1] + last[3] == col and last[2] + last[3] == slot:
                last[3] += length
            else:
                merged.append([row, col, slot, length])
        return [tuple(span) for span in merged]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The slots of a full-sequence K or V: ``[B, H, T, D]`` -> ``[N, H, D]`` (a copy), run by run, or in one
        indexed read when ``batched``."""
        if self.batched(x.shape[1] * x.shape[3]):
            return x.permute(0, 2, 1, 3)[self.rows, self.seq_cols]
        pieces = []
        known = len(self.seq_starts) == len(self.runs)
        for i, (row, _, slot, length, _) in enumerate(self.runs):
            # a run is contiguous in the sequence too
            start = self.seq_starts[i] if known else int(self.seq_cols[slot])
            pieces.append(x[row, :, start : start + length].transpose(0, 1))
        if not pieces:
            return x.new_empty(0, x.shape[1], x.shape[3])
        return torch.cat(pieces)

    def empty_output(
        self, num_heads: int, head_dim: int, dtype: torch.dtype, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``[B, H, T_reused, D]`` to be filled run by run: uninitialized except the padding, which is zero (the
        engine masks padding keys, so their value never matters, but it must be finite). ``out``: fill this
        buffer instead of a new one (a scratch reused from step to step)."""
        device = self.rows.device
        if out is None:
            out = torch.empty(self.batch_size, num_heads, self.num_reused, head_dim, dtype=dtype, device=device)
        elif not self.zero_padding:
            return out
        if self.batched(num_heads * head_dim):  # filled by `place`, padding included
            return out
        covered = [0] * self.batch_size
        for row, col, _, length, _ in self.runs:
            if col > covered[row]:
                out[row, :, covered[row] : col] = 0
            covered[row] = col + length
        for row, end in enumerate(covered):
            if end < self.num_reused:
                out[row, :, end:] = 0
        return out

    def on_sequence(self, segments: Segments) -> SlotLayout:
        """The same slots and groups placed at their **sequence** columns (``T_reused`` becomes ``seq_len``): a
        dequantization with this layout writes straight into a ``[B, H, T, D]`` buffer around the active window
        (which it leaves zero), so no reused-only copy and no concatenation is needed."""
        gap = segments.block_end - segments.block_start
        runs = tuple(
            (row, col if col < segments.block_start else col + gap, slot, length, group)
            for row, col, slot, length, group in self.runs
        )
        return replace(self, num_reused=segments.seq_len, cols=self.seq_cols, runs=runs)

    def select_rows(self, rows: list[int]) -> SlotLayout:
        """The layout of some rows only (a later step that not every row of the block takes part in): row ``rows[i]``
        becomes row ``i``; the slots of the other rows go to one extra row ``len(rows)`` (a buffer row the caller
        discards), so per-slot writes need no filtering. Runs of the other rows are dropped, so their codes are
        never dequantized."""
        position = {row: i for i, row in enumerate(rows)}
        table = torch.full((self.batch_size,), len(rows), dtype=torch.int64, device=self.rows.device)
        table[list(rows)] = torch.arange(len(rows), device=self.rows.device)
        kept = [i for i, run in enumerate(self.runs) if run[0] in position]
        runs = tuple((position[r], c, s, n, g) for r, c, s, n, g in (self.runs[i] for i in kept))
        starts = tuple(self.seq_starts[i] for i in kept) if len(self.seq_starts) == len(self.runs) else ()
        return replace(self, batch_size=len(rows) + 1, rows=table[self.rows], runs=runs, seq_starts=starts)

    def scatter(
        self, values: torch.Tensor, dtype: torch.dtype | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Place the values of all slots ``[N, H, D]`` into a new ``[B, H, T_reused, D]`` (``dtype``, default
        ``values.dtype``; or into ``out``), run by run, with zeros on padding."""
        if self.batched(values.shape[1] * values.shape[2]):
            if out is None:
                out = values.new_empty(self.batch_size, values.shape[1], self.num_reused, values.shape[2],
                                       dtype=dtype or values.dtype)
            values = self.take_active(torch.cat([values, values.new_zeros(1, *values.shape[1:])]), spare=True)
            return self.place(values, out)
        out = self.empty_output(values.shape[1], values.shape[2], dtype or values.dtype, out)
        for row, col, slot, length, _ in self.runs:
            out[row, :, col : col + length] = values[slot : slot + length].transpose(0, 1)
        return out

    def scatter_slots(self, values: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Overwrite some slots (int64 ``[n]``) of ``out`` ``[B, H, T_reused, D]`` with ``values`` ``[n, H, D]``."""
        out[self.rows[slots], :, self.cols[slots]] = values.to(out.dtype)
        return out
