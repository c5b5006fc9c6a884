"""Pools of packed reused K/V at fixed addresses: what a captured later step of quantized stores reads (issue 41,
item 4; the full-precision pool is `service.engine.kv_pool`).

The fused kernel (`service.quant.kernels.attention`) serves the rows of many KIVI and dLLM-KVQ stores in one launch
per layer by reading a small table per row: where its store's slots, K groups, protected rows and code streams
begin in the tensors it reads. Eagerly those tensors are the stores' own, concatenated at every later step
(`service.quant.kernels.parts.stores_side_by_side`), so their addresses change with the set of stores and a CUDA
graph of the step would be good only for the set it was captured with. Here every pooled store's packed layers
live in buffers shared by all stores, each store a **run** in them, and the table is an input tensor made from the
runs' starts (:class:`PooledPacked`): a graph reads the same buffers whichever requests run, so it is keyed by its
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
layout's) and gives them back when its block ends (a new block, prefix mode's longer reused length, takes new
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

from service.quant.kernels.parts import PART_INFO, stream_bytes


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


def part_rows(stores: list, widths: list[int], rows: int, layers: int, heads: int, head_dim: int,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's per-row inputs for pooled ``stores`` (one uniform format, in row order; ``widths`` their
    windows' widths) padded to ``rows``: int32 ``[rows]``, each row's first ``slot_of`` entry in the pool; int32
    ``[layers, rows, PART_INFO]``, its part of the table (`service.quant.kernels.parts`: window width, reused
    length, first slot, first K group, first protected row, K stream byte offset and ``m``, V's), with the runs'
    starts as offsets. A padded row is an empty part: width 1 (its own first window column), reused length 0."""
    per_token = heads * head_dim
    starts, info = [], [[] for _ in range(layers)]
    for store, width in zip(stores, widths):
        runs, layout, bits = store.packed_runs, store._layout, store.quantizer.bits
        t = layout.num_reused
        for j in range(layout.batch_size):
            starts.append(runs["slot_of"].start + j * t)
        v_m = stream_bytes(layout.num_slots * per_token, bits)
        for layer in range(layers):
            kept = runs.protected.get(layer)
            k_m = stream_bytes((layout.num_slots - (kept.size if kept else 0)) * per_token, bits)
            part = [width, t, runs["slots"].start, runs["groups"].start, kept.start if kept else 0,
                    4 * runs.k_words[layer].start, k_m, 4 * runs["v_words"].start, v_m]
            info[layer] += [part] * layout.batch_size
    pad = rows - len(starts)
    empty = [1, 0, 0, 0, 0, 0, 1, 0, 1]
    for layer in range(layers):
        info[layer] += [empty] * pad
    flat = torch.tensor(starts + [0] * pad, dtype=torch.int32).to(device)
    table = torch.tensor(info, dtype=torch.int32).view(layers, rows, PART_INFO).to(device)
    return flat, table


class PooledPacked:
    """KV hook of a window forward whose rows all read pooled stores of one uniform format (module doc): every
    layer's attention is one launch of the fused kernel over the pool's buffers, each row's part of the table an
    input (``where`` int32 ``[R]``, ``info`` int32 ``[L, R, PART_INFO]``, :func:`part_rows`) a graph's replay
    refreshes; the launch's sizes are the bucket's (``width`` window columns, ``tile``: the reused length its
    tiles are chosen for under Triton's interpreter).

    Args:
        pool: the buffers; store: one of the forward's stores (its quantizer's bits and V group size, whether it
        protects tokens and corrects key bias: the same for all, their batch key says so).
    """

    def __init__(self, pool: PackedPool, store, where: torch.Tensor, info: torch.Tensor, tile: int) -> None:
        self.pool, self.where, self.info, self.tile = pool, where, info, tile
        quantizer = store.quantizer
        self.bits, self.v_group_size = quantizer.bits, quantizer.v_group_size
        self.protected = store.packed_runs.protected_layers
        self.key_bias = store.key_bias_correction
        self.parts = torch.arange(where.shape[0], dtype=torch.int32, device=where.device)
        self._dummy = torch.zeros(1, dtype=torch.float32, device=where.device)  # the kernel's unused pointers
        self._dummy_index = torch.zeros(1, dtype=torch.int32, device=where.device)

    def inputs(self) -> list[torch.Tensor]:
        """The tensors a replay copies the step's values into."""
        return [self.where, self.info]

    def __call__(self, layer, q, k_pre, k, v):
        from service.quant.kernels.attention import _launch  # imports Triton
        from service.quant.kernels.operands import KernelOperands

        arenas, dtype, device = self.pool.arenas, k.dtype, k.device
        h, d = k.shape[1], k.shape[3]
        slots, groups = arenas["slots"].buffers, arenas["groups"].buffers
        dummy, dummy_index = self._dummy, self._dummy_index
        protected = self.protected
        k_prot = arenas[f"protected.{layer}"].buffer("values", (h, d), dtype, device) if protected else dummy
        ops = KernelOperands(
            fmt="uniform", bits=self.bits, num_slots=0,
            k_codes=arenas[f"k_words.{layer}"].buffers["codes"].view(torch.uint8),
            v_codes=arenas["v_words"].buffers[f"codes.{layer}"].view(torch.uint8),
            k_row=slots[f"k_row.{layer}"] if protected else None,
            k_scale=groups[f"scale.{layer}"], k_mn=groups[f"mn.{layer}"], k_protected=k_prot, k_lut=dummy,
            k_outlier_index=dummy_index, k_outlier_values=dummy, v_scale=slots[f"scale.{layer}"],
            v_mn=slots[f"mn.{layer}"], v_lut=dummy, v_outlier_index=dummy_index, v_outlier_values=dummy,
            v_group_size=self.v_group_size)
        return _launch(q, k, v, ops, arenas["slot_of"].buffers["slot_of"], slots["group_of_slot"], self.where,
                       self.parts, self.info[layer], k.shape[2], 1, 0, 0, None, None, True, self.key_bias,
                       tile=self.tile)


class PackedRuns:
    """One store's runs in a :class:`PackedPool` for its block (module doc), and the views of its layers.

    ``runs[name]`` for the arenas every layer shares (``slots``, ``groups``, ``v_words``, ``slot_of``);
    :attr:`k_words` and :attr:`protected` per layer; :attr:`kept` per layer what is not pooled: its protected slots
    (the eager paths' index, small) and its PackedLayer's other fields (not its tensors: the pool holds those).
    """

    SHARED = ("slots", "groups", "v_words", "slot_of")

    def __init__(self, pool: PackedPool, layout, protected: bool) -> None:
        self.pool, self.layout, self.protected_layers = pool, layout, protected
        self.k_words: dict[int, Run] = {}
        self.protected: dict[int, Run] = {}
        self.kept: dict[int, tuple] = {}
        self._shared: dict[str, Run] = {}
        device = layout.rows.device
        self._shared = {"slots": pool.allocate("slots", layout.num_slots),
                        "groups": pool.allocate("groups", layout.num_groups),
                        "slot_of": pool.allocate("slot_of", layout.batch_size * layout.num_reused)}
        from service.quant.kernels.operands import BlockMaps

        maps = BlockMaps.from_layout(layout)
        self._write("slot_of", "slot_of", maps.slot_of.reshape(-1))
        self._write("slots", "group_of_slot", maps.group_of_slot)
        self.device = device

    def __getitem__(self, name: str) -> Run:
        return self._shared[name]

    def _write(self, arena: str, name: str, values: torch.Tensor, run: Run | None = None) -> None:
        run = self._shared[arena] if run is None else run
        buffer = self.pool.arena(arena).buffer(name, tuple(values.shape[1:]), values.dtype, values.device)
        buffer[run.start: run.start + run.size].copy_(values)

    def hold(self, layer: int, packed) -> None:
        """Copy ``packed`` (the store's layer as written) into its runs (taking the layer's K stream and protected
        rows' runs, and V's stream's at the first layer)."""
        k, v = packed.k.tensors, packed.v.tensors
        if "v_words" not in self._shared:
            self._shared["v_words"] = self.pool.allocate("v_words", v["codes"].shape[0])
        self.k_words[layer] = self.pool.allocate(f"k_words.{layer}", k["codes"].shape[0])
        slots = k.get("protected_slots")
        if self.protected_layers:
            self.protected[layer] = self.pool.allocate(f"protected.{layer}", slots.shape[0])
        # after every allocation of this layer (a growth moves the runs): the copies
        self._write(f"k_words.{layer}", "codes", k["codes"], self.k_words[layer])
        self._write("v_words", f"codes.{layer}", v["codes"])
        self._write("groups", f"scale.{layer}", k["scale"])
        self._write("groups", f"mn.{layer}", k["mn"])
        self._write("slots", f"scale.{layer}", v["scale"])
        self._write("slots", f"mn.{layer}", v["mn"])
        if self.protected_layers:
            n = self.layout.num_slots
            keep = torch.ones(n, dtype=torch.bool, device=slots.device)
            keep[slots.long()] = False
            k_row = torch.cumsum(keep, 0, dtype=torch.int32) - 1  # `uniform_operands`' k_row
            k_row[slots.long()] = -1 - torch.arange(slots.shape[0], dtype=torch.int32, device=slots.device)
            self._write("slots", f"k_row.{layer}", k_row)
            self._write(f"protected.{layer}", "values", k["protected_values"], self.protected[layer])
        self.kept[layer] = (slots, packed.k.elements, packed.k.nominal_bitsum, packed.v.elements,
                            packed.v.nominal_bitsum, packed.dtype, packed.num_heads, packed.head_dim)

    def view(self, layer: int):
        """The layer as the store holds it: a `service.quant.base.PackedLayer` whose tensors are views of the runs
        (the same shapes and values as written; valid until the pool's next generation, :meth:`repoint`)."""
        from service.quant.base import PackedLayer, PackedTensor

        slots, k_elements, k_bits, v_elements, v_bits, dtype, heads, head_dim = self.kept[layer]
        arenas = self.pool.arenas

        def part(arena: str, name: str, run: Run | None = None) -> torch.Tensor:
            run = self._shared[arena] if run is None else run
            return arenas[arena].buffers[name][run.start: run.start + run.size]

        k = {"codes": part(f"k_words.{layer}", "codes", self.k_words[layer]), "scale": part("groups", f"scale.{layer}"),
             "mn": part("groups", f"mn.{layer}")}
        if slots is not None:
            k |= {"protected_slots": slots,
                  "protected_values": part(f"protected.{layer}", "values", self.protected[layer])}
        v = {"codes": part("v_words", f"codes.{layer}"), "scale": part("slots", f"scale.{layer}"),
             "mn": part("slots", f"mn.{layer}")}
        return PackedLayer(k=PackedTensor(k, k_elements, k_bits), v=PackedTensor(v, v_elements, v_bits), dtype=dtype,
                           num_heads=heads, head_dim=head_dim)

    def free(self) -> None:
        """Give every run back."""
        for name, run in self._shared.items():
            self.pool.free(name, run)
        for layer, run in self.k_words.items():
            self.pool.free(f"k_words.{layer}", run)
        for layer, run in self.protected.items():
            self.pool.free(f"protected.{layer}", run)
        self._shared, self.k_words, self.protected, self.kept = {}, {}, {}, {}


def pooled_packed(pool: PackedPool, group: list, rows: int, key_len: int, device: torch.device) -> PooledPacked:
    """The KV hook of a window forward of ``rows`` rows (padded) over ``group``'s pooled quantized stores
    (`service.engine.graphs.graphable`), its tiles chosen for ``key_len`` keys (the bucket's)."""
    stores = [p.cohort.store for p in group]
    first = stores[0]
    spec = first._packed[next(iter(first._packed))]
    where, info = part_rows(stores, [p.width for p in group], rows, len(first.packed_runs.kept), spec.num_heads,
                            spec.head_dim, device)
    return PooledPacked(pool, first, where, info, key_len - 1)
