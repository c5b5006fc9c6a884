"""Pools of packed reused K/V at fixed addresses: what a captured later step of quantized stores reads (issue 41,
item 4; the full-precision pool is `service.engine.kv_pool`).

The fused kernel (`service.quant.kernels.attention`) serves the rows of many KIVI and dLLM-KVQ stores in one launch
per layer by reading a small table per row: where its store's slots, K groups, protected rows and code streams
begin in the tensors it reads. Eagerly those tensors are the stores' own, concatenated at every later step
(`service.quant.kernels.parts.stores_side_by_side`), so their addresses change with the set of stores and a CUDA
graph of the step would be good only for the set it was captured with. Here every pooled store's packed layers
live in buffers shared by all stores, each store a **run** in them, and the table is an input tensor made from the
runs' starts (`service.quant.pooled.PooledPacked`): a graph reads the same buffers whichever requests run, so it is keyed by its
bucket and :attr:`PackedPool.generation` alone (`service.engine.graphs`).

**Layout.** Buffers come in :class:`Arena` s, one allocator each whose runs every buffer of the arena shares (the
kernel adds one offset to all of them):

* ``slots`` (one run per store, its block's slots N; every layer): per layer V's ``scale`` and ``mn`` ``[N, H, D /
  G]``, dLLM-KVQ's ``k_row`` (int32 ``[N]``, `service.quant.kernels.operands`), and the block's ``group_of_slot``
  (int32 ``[N]``, once for all layers);
* ``groups`` (its K groups): per layer K's ``scale`` and ``mn`` ``[Ng, H, D]``;
* ``v_words`` (its V code stream, int32 words: the same in every layer);
* per layer ``k_words.<layer>`` (its K code stream; dLLM-KVQ leaves protected tokens out of it, so its length is
  the layer's) and ``protected.<layer>`` (the layer's protected K rows ``[P, H, D]``);
* ``slot_of`` (int32, ``B x T_reused`` entries: each row's slot per reused column, -1 on padding).

A store takes its runs at its block-initial write (`service.quant.store.QuantizedKVStore`, its sizes are its
layout's; the runs of one store and the hook that launches the kernel over the pool: `service.quant.pooled`, which
knows the packed format, so this allocator imports nothing of `service.quant`) and gives them back when its block ends (a new block, prefix mode's longer reused length, takes new
ones); what it holds are views of its runs (the same values and shapes as its own tensors were, so its eager paths
read them unchanged).

**Allocation.** First fit over the gaps between an arena's live runs; when none fits the arena's buffers are made
anew at twice their size or what is needed (:attr:`PackedPool.generation` changes: graphs over the old buffers are
dropped), the live runs packed from the start, and every holder repoints its views (:meth:`PackedPool.holders`).
When an arena's live runs fill less than a quarter of it, :meth:`PackedPool.shrink` (between iterations) makes its
buffers anew at twice the live size, the same way.

**Memory.** A run holds exactly the store's packed tensors (what its ``bytes_held`` counts and admission measured,
`service.runtime.memory.MemoryModel.kv_bytes_per_token`) plus the int32 maps the kernel reads (``k_row``,
``group_of_slot``, ``slot_of``: fewer bytes than the layout's int64 index tensors admission also counts, which the
store keeps). :attr:`PackedPool.bytes_held` minus :attr:`PackedPool.live_bytes` is space held by freed runs;
the server reserves it with the graphs' pools (`service.main`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(eq=False)
class Run:
    """``size`` rows of an arena's buffers from ``start`` (moved when the arena's buffers are made anew)."""

    start: int
    size: int


class Arena:
    """Named buffers ``[N, ...]`` sharing one allocator (module doc): each run is the same rows of every buffer."""

    def __init__(self) -> None:
        self.capacity = 0
        self.runs: list[Run] = []  # live, by start
        self.kinds: dict[str, tuple[tuple[int, ...], torch.dtype, torch.device]] = {}
        self.buffers: dict[str, torch.Tensor] = {}

    def buffer(self, name: str, inner: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Buffer ``name`` (made, zeroed, at its first use, at the arena's capacity; at least one row, so the
        kernel always has a pointer)."""
        if name not in self.buffers:
            self.kinds[name] = (tuple(inner), dtype, device)
            self.buffers[name] = torch.zeros(max(1, self.capacity), *inner, dtype=dtype, device=device)
        return self.buffers[name]

    @property
    def live(self) -> int:
        return sum(r.size for r in self.runs)

    def nbytes(self, rows: int) -> int:
        return sum(rows * b[0].numel() * b.element_size() for b in self.buffers.values())

    def allocate(self, size: int) -> tuple[Run, bool]:
        """A run of ``size`` rows, and whether the buffers were made anew for it (first fit, else grown)."""
        run = Run(0, size)
        cursor, start = 0, None
        for other in self.runs:
            if other.start - cursor >= size:
                start = cursor
                break
            cursor = other.start + other.size
        if start is None and self.capacity - cursor >= size:
            start = cursor
        grown = start is None
        if grown:
            self.relayout(max(self.live + size, 2 * self.capacity))
            start = self.live
        run.start = start
        self.runs.append(run)
        self.runs.sort(key=lambda r: r.start)
        return run, grown

    def free(self, run: Run) -> None:
        self.runs = [r for r in self.runs if r is not run]

    def relayout(self, capacity: int) -> None:
        """New buffers of ``capacity`` rows holding the live runs packed from row 0 (their starts change)."""
        for name, old in self.buffers.items():
            inner, dtype, device = self.kinds[name]
            new = torch.zeros(max(1, capacity), *inner, dtype=dtype, device=device)
            cursor = 0
            for run in self.runs:
                new[cursor: cursor + run.size] = old[run.start: run.start + run.size]
                cursor += run.size
            self.buffers[name] = new
        cursor = 0
        for run in self.runs:
            run.start, cursor = cursor, cursor + run.size
        self.capacity = capacity


class PackedPool:
    """The arenas of the running requests' pooled quantized stores (module doc).

    Attributes:
        generation: changes whenever an arena's buffers are made anew (grown or shrunk); graphs read those of theirs.
        holders: the stores holding runs here (each repoints its views when the buffers are made anew).
    """

    def __init__(self) -> None:
        self.arenas: dict[str, Arena] = {}
        self.generation = 0
        self.holders: list = []

    def arena(self, name: str) -> Arena:
        if name not in self.arenas:
            self.arenas[name] = Arena()
        return self.arenas[name]

    def allocate(self, name: str, size: int) -> Run:
        """A run of ``size`` rows of arena ``name`` (every holder repoints when the buffers were made anew)."""
        run, grown = self.arena(name).allocate(size)
        if grown:
            self._made_anew()
        return run

    def free(self, name: str, run: Run) -> None:
        self.arena(name).free(run)

    def _made_anew(self) -> None:
        self.generation += 1
        for holder in self.holders:
            holder.repoint()

    def shrink(self, below: float = 0.25) -> bool:
        """Make anew, at twice their live rows, the arenas whose live runs fill less than ``below`` of them (module
        doc); whether any was. Call between iterations: views and graphs of the old buffers are repointed/dropped."""
        shrunk = False
        for arena in self.arenas.values():
            if arena.capacity > 1 and arena.live < below * arena.capacity:
                arena.relayout(2 * arena.live)
                shrunk = True
        if shrunk:
            self._made_anew()
        return shrunk

    @property
    def bytes_held(self) -> int:
        """Bytes of every arena's buffers."""
        return sum(a.nbytes(a.capacity) for a in self.arenas.values())

    @property
    def live_bytes(self) -> int:
        """Bytes of the live runs."""
        return sum(a.nbytes(a.live) for a in self.arenas.values())
