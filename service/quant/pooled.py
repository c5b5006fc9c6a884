"""A quantized store's runs in the packed pool and the KV hook that launches the fused kernel over it (issue 41,
item 4): the format-aware half of `service.engine.packed_pool` (the pool, its arenas and allocator, there; its
module doc says the layout and memory). Here because it reads the packed format (`service.quant.base`,
`service.quant.kernels`): the engine's batch asks a store for its hook
(`service.quant.store.QuantizedKVStore.pooled_hook`) and imports nothing of `service.quant`.
"""

from __future__ import annotations

import torch

from service.engine.packed_pool import PackedPool, Run
from service.quant.kernels.parts import PART_INFO, stream_bytes


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
    """KV hook of a window forward whose rows all read pooled stores of one uniform format (the pool:
    `service.engine.packed_pool`): every layer's attention is one launch of the fused kernel over the pool's buffers, each row's part of the table an
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
    """One store's runs in a `service.engine.packed_pool.PackedPool` for its block (that module's doc), and the
    views of its layers.

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
