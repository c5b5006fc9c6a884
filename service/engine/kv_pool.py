"""A pool of full-precision reused K/V at fixed addresses: what a captured later step reads (issue 41, item 4).

A CUDA graph reads its inputs at the addresses of its capture. When each request's store held its own buffers
(`service.engine.kv_store.FullPrecisionKVStore`), a graph of a later step was good only for the stores it was
captured with, so a batch whose set of requests changed captured anew. Here every running request's reused K/V
live in one pair of buffers per layer, and which rows a forward reads is data (an input tensor copied in before
a replay), so a graph is keyed by its bucket alone (`service.engine.graphs`).

**Layout.** Per layer, a K and a V buffer ``[N, D]``: N vectors of ``head_dim`` D, the model's dtype and device.
A store of B rows, H_kv heads and a sequence of T columns owns one contiguous **run** of ``B x H_kv x (T + 1)``
vectors (the same run in every layer's buffers), laid out as the store's own buffer was, ``[B, H_kv, T + 1, D]``:
the run's view *is* that tensor, so the eager path reads and writes it exactly as before (same layout, same
operations, same tokens). Vectors ``[0, H_kv)`` are a null row of zeros that a forward's padded rows read.

**Gather** (:class:`PooledReuse`, the KV hook of a pooled window forward): each row of the forward is
``(start, T + 1)`` of its run, int64 ``[R, 2]`` (a padded row: ``(0, 1)``, the null row); at layer 0 the forward
makes the index of every (row, head, key column) once, ``start + head x (T + 1) + min(column, T)`` ``[R, H_kv,
key_len]``, and every layer gathers its ``[R, H_kv, key_len, D]`` keys and values in one ``index_select`` each
(the copy the eager path makes with its concatenation), then writes the window's fresh K/V over the window's
columns. Columns past a row's spare column repeat it; the key mask gives them no weight (the spare column is
zeroed when a run is made, so nothing another request left there reaches a row).

**Allocation.** First fit over the gaps between live runs. When no gap fits but enough vectors are free, the live
runs move down, in place (same buffers: a graph stays valid, it reads the runs' starts as inputs; one copy of the
moved runs per layer, counted in :attr:`KVPool.moves`). When too few are free the buffers grow (new buffers:
:attr:`KVPool.generation` changes and graphs captured over the old ones are dropped): to twice their vectors, or
what is needed when more, but not past ``max_tokens`` (the admission budget's KV tokens, `service.main`) unless
what is needed is more (admission decided it fits). Freed runs keep their vectors until the live runs fill less
than a quarter of the buffers: then :meth:`KVPool.shrink` (called by `service.engine.graphs.LaterSteps` between
forwards) makes them anew at twice the live runs' size (a new generation, as a growth).

**Memory.** A run holds exactly what admission counts for the request (`service.runtime.memory.MemoryModel.cost`:
``2 x layers x H_kv x D x element size`` per token over ``seq_len + 1`` tokens per row), so the live runs are the
KV bytes the budget admitted, counted once. The buffers' unused vectors (:attr:`KVPool.bytes_held` minus
:attr:`KVPool.live_bytes`) are what an earlier peak of running requests took, at most ``max_tokens``' worth in
all and (after a shrink) at most three times the live runs; admission counts them beside the running requests
(`service.runtime.loop.Worker`, ``pool_slack``: `service.engine.graphs.LaterSteps.unused_bytes`). A growth holds the old buffers beside the new ones (up to twice as large) while it copies them: for that
moment up to three times the old buffers, a transient the budget does not count (the doubling keeps growths to a
few, all while the load ramps up).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(eq=False)
class PoolRun:
    """One store's vectors in every layer's buffers: ``start`` (first vector), ``rows`` (B), ``heads`` (H_kv) and
    ``length`` (T + 1 columns); moved by :meth:`KVPool.allocate` (its start changes, its contents go with it)."""

    start: int
    rows: int
    heads: int
    length: int

    @property
    def size(self) -> int:
        """Vectors the run takes in each buffer."""
        return self.rows * self.heads * self.length


class KVPool:
    """The K/V buffers of the running requests' full-precision stores (module doc).

    Args:
        max_tokens: the tokens (one column of one row, every layer and head, K and V) the buffers may grow to
            without being asked for more; None: no limit.

    Attributes:
        generation: changes whenever the buffers are made anew (grown or shrunk); graphs read the buffers of theirs.
        moves: runs moved down to close gaps (a copy of each moved run in every layer).
    """

    def __init__(self, max_tokens: int | None = None) -> None:
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens is >= 1 or None, got {max_tokens}")
        self.max_tokens = max_tokens
        self._kind: tuple | None = None  # (heads, head_dim, dtype, device): fixed by the first store
        self._k: dict[int, torch.Tensor] = {}
        self._v: dict[int, torch.Tensor] = {}
        self._runs: list[PoolRun] = []  # live, by start
        self.capacity = 0  # vectors per buffer
        self.generation = self.moves = 0
        #: The quantized stores' packed pool beside (`service.engine.packed_pool.PackedPool`; set by
        #: `service.engine.graphs.LaterSteps`), or None.
        self.packed = None

    def takes(self, k: torch.Tensor) -> bool:
        """Whether K/V like ``k`` (``[B, H_kv, T, D]``) can live here: the first store's heads, head dim, dtype and
        device (fixed by the first call; a store this says no to keeps its own buffers)."""
        kind = (k.shape[1], k.shape[3], k.dtype, k.device)
        if self._kind is None:
            self._kind = kind
        return self._kind == kind

    @property
    def live_bytes(self) -> int:
        """Bytes of the live runs over every layer made, K and V."""
        return self._bytes(sum(run.size for run in self._runs))

    @property
    def bytes_held(self) -> int:
        """Bytes of the buffers (every layer made, K and V)."""
        return self._bytes(self.capacity)

    def _bytes(self, vectors: int) -> int:
        if self._kind is None:
            return 0
        _, d, dtype, _ = self._kind
        return 2 * len(self._k) * vectors * d * torch.empty((), dtype=dtype).element_size()

    def allocate(self, rows: int, length: int) -> PoolRun:
        """A run of ``rows`` rows of ``length`` columns each (every head :meth:`takes` fixed); may move or grow the
        others (module doc). Its vectors hold whatever they held: the store writes them.

        Raises:
            ValueError: before :meth:`takes`, or ``rows`` or ``length`` < 1.
        """
        if self._kind is None or rows < 1 or length < 1:
            raise ValueError(f"allocate after takes(), with rows and length >= 1, got {rows}, {length}")
        heads = self._kind[0]
        run = PoolRun(0, rows, heads, length)
        start = self._first_fit(run.size)
        if start is None:
            used = heads + sum(r.size for r in self._runs)
            need = used + run.size
            if need <= self.capacity:
                self._relayout(self.capacity)
            else:
                grown = max(need, 2 * self.capacity)
                if self.max_tokens is not None:  # past the budget's tokens only when admission asks for more
                    grown = max(need, min(grown, heads + self.max_tokens * heads))
                self._relayout(grown)
            start = heads + sum(r.size for r in self._runs)
        run.start = start
        self._runs.append(run)
        self._runs.sort(key=lambda r: r.start)
        return run

    def free(self, run: PoolRun) -> None:
        """Give ``run``'s vectors back (its store holds nothing any more)."""
        self._runs = [r for r in self._runs if r is not run]

    def shrink(self, below: float = 0.25) -> bool:
        """Make the buffers anew at twice the live runs' vectors when those fill less than ``below`` of them
        (module doc, "Memory"; :attr:`generation` changes); whether they were. Call between forwards: the stores
        read their runs' views anew at each use."""
        if self._kind is None or self.capacity <= self._kind[0]:
            return False
        live = sum(run.size for run in self._runs)
        if live >= below * (self.capacity - self._kind[0]):
            return False
        self._relayout(self._kind[0] + 2 * live)
        return True

    def _first_fit(self, size: int) -> int | None:
        cursor = self._kind[0]  # after the null row
        for run in self._runs:
            if run.start - cursor >= size:
                return cursor
            cursor = run.start + run.size
        return cursor if self.capacity - cursor >= size else None

    def _relayout(self, capacity: int) -> None:
        """The live runs packed from the null row on, in buffers of ``capacity`` vectors: the same buffers when the
        capacity stays (moved down in order, so a run is copied only over vectors already moved or free), new
        (zeroed) ones when it grows."""
        heads, d, dtype, device = self._kind
        grown = capacity != self.capacity
        for buffers in (self._k, self._v):
            for layer, old in buffers.items():
                new = torch.zeros(capacity, d, dtype=dtype, device=device) if grown else old
                cursor = heads
                for run in self._runs:
                    if grown or run.start != cursor:  # a clone: a run moved by less than its size overlaps itself
                        source = old[run.start: run.start + run.size]
                        new[cursor: cursor + run.size].copy_(source if grown else source.clone())
                    cursor += run.size
                buffers[layer] = new
        cursor = heads
        for run in self._runs:
            if not grown and run.start != cursor:
                self.moves += 1
            run.start, cursor = cursor, cursor + run.size
        if grown:
            self.capacity, self.generation = capacity, self.generation + 1

    def buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V buffers, ``[N, D]`` each (made, zeroed, at its first use)."""
        if layer not in self._k:
            _, d, dtype, device = self._kind
            self._k[layer], self._v[layer] = (torch.zeros(self.capacity, d, dtype=dtype, device=device)
                                              for _ in range(2))
        return self._k[layer], self._v[layer]

    def view(self, run: PoolRun, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``run``'s K and V in layer ``layer``, ``[B, H_kv, T + 1, D]`` each: views of the buffers (written through).
        Valid until the next :meth:`allocate` (which may move the run)."""
        shape = (run.rows, run.heads, run.length, -1)
        return tuple(b[run.start: run.start + run.size].view(shape) for b in self.buffers(layer))

    @staticmethod
    def rows_where(runs: list[tuple[PoolRun, int]], rows: int, device: torch.device) -> torch.Tensor:
        """Each forward row's ``(start, T + 1)``, int64 ``[rows, 2]`` (:class:`PooledReuse`'s input): per store's
        run, ``count`` rows from its first (``runs``: (run, count) in row order), then padded rows ``(0, 1)``."""
        where = [(run.start + j * run.heads * run.length, run.length) for run, count in runs for j in range(count)]
        return torch.tensor(where + [(0, 1)] * (rows - len(where)), device=device)


def window_flat_index(dest: torch.Tensor, heads: int, key_len: int) -> torch.Tensor:
    """Where each fresh K/V vector of a window goes in a ``[R, H_kv, key_len, D]`` buffer viewed as ``[-1, D]``:
    int64 ``[R x H_kv x W]``, from ``dest`` int64 ``[R, 1, W, 1]`` (each input column's key column)."""
    r = dest.shape[0]
    head = torch.arange(heads, device=dest.device)[None, :, None]
    row = torch.arange(r, device=dest.device)[:, None, None]
    return ((row * heads + head) * key_len + dest[:, :, :, 0]).reshape(-1)


class PooledReuse:
    """KV hook of a window forward whose rows all live in ``pool`` (module doc, "Gather"): every layer gathers the
    rows' keys and values from the pool's buffers and writes the fresh window over its columns; attention then runs
    over them with the forward's key mask. Every tensor it reads is an input a graph's replay refreshes.

    Args:
        pool: the buffers; where: int64 ``[R, 2]`` (:meth:`KVPool.rows_where`); dest: int64 ``[R, 1, W, 1]``, each
        input column's key column (a padded row's: the spare column ``key_len - 1``); key_len: keys per row.
    """

    def __init__(self, pool: KVPool, where: torch.Tensor, dest: torch.Tensor, key_len: int) -> None:
        self.pool, self.where, self.dest, self.key_len = pool, where, dest, key_len
        self._index = self._flat = None

    def inputs(self) -> list[torch.Tensor]:
        """The tensors a replay copies the step's values into."""
        return [self.where, self.dest]

    def __call__(self, layer, q, k_pre, k, v):
        r, h, _, d = k.shape
        if layer == 0:  # once per forward: every layer reads the same rows (a graph records this with the rest)
            column = torch.arange(self.key_len, device=k.device)[None, None, :]
            start, length = self.where[:, 0, None, None], self.where[:, 1, None, None]
            head = torch.arange(h, device=k.device)[None, :, None]
            self._index = (start + head * length + torch.minimum(column, length - 1)).reshape(-1)
            self._flat = window_flat_index(self.dest, h, self.key_len)
        k_buf, v_buf = self.pool.buffers(layer)
        kk, vv = (b.index_select(0, self._index) for b in (k_buf, v_buf))
        kk.index_copy_(0, self._flat, k.reshape(-1, d))
        vv.index_copy_(0, self._flat, v.reshape(-1, d))
        return kk.view(r, h, self.key_len, d), vv.view(r, h, self.key_len, d)
