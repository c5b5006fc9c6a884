"""`QuantizedKVStore`: the engine's KV store holding reused K/V packed, and the `make_kv_store` factory.

Where it acts (paper "KIVI and KVQuant Adaptations", DESIGN.md): right after the block-initial pass, the reused
regions of every layer (prefix; in dual mode prefix and suffix) are quantized layer by layer as the engine calls
``write``, and held packed. Later steps call ``window_kv(layer, ...)``: the layer is dequantized straight into a
scratch pair ``[B, H, T, D]`` at its sequence columns, the fresh window is copied into the gap, and attention reads
that; the scratch is reused by every layer and step of the block, so it is the only full-precision copy of reused
K/V alive (the unquantized path makes the same-sized concatenation at every layer), and there is no separate
dequantized tensor and no concatenation. With ``keep_dequantized`` the
dequantized copies are kept for the rest of the block (they do not change within a block): faster, but it saves
no memory within a block. The active block is never handed to the store, so it is never quantized.

CPU costs (issue 15): a batch of short rows (many runs, `SlotLayout.batched`) is read and written in whole-layer
operations rather than a few per run; KVQuant's pre-RoPE reused keys are rotated in place with cos/sin made once
per block and set of rows (the same at every layer and step; held beside the scratch, ``2 x B x T_reused x D``
float32).

On CUDA (``attention="auto"``) later steps do not read at all: ``attend`` runs the fused Triton kernel
(`service.quant.kernels.attention`) straight over the packed layer and the fresh window, so no full-precision copy
of the reused K/V is ever made; the stores of one uniform format in a running batch attend in one launch per
layer for all their rows (``attend_batch``). ``attention="triton"`` forces that path anywhere (CPU tensors need Triton's
interpreter, ``TRITON_INTERPRET=1``; the exactness tests use it), ``"torch"`` never takes it.

With the key-bias correction (`service.quant.key_bias`) a store attends itself on every path: on the PyTorch path
over its window K/V with the bias added to the scaled scores, a running batch's corrected stores of one format
together over one pooled read that also gives each key's steps (``attend_batch``); on the kernel's path the kernel
subtracts the term itself. Corrected and uncorrected stores never share a batch key.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from service.engine.kv_store import DEFER_WRITE_CHECKS, FullPrecisionKVStore, KVStore, Segments
from service.engine.report import KVReport
from service.engine.spec import ModelSpec
from service.quant.accounting import KVAccounting
from service.quant.base import KVQuantizer, PackedLayer
from service.quant.canvas import Geometry, LayerRotation, PackedCanvas
from service.quant.canvas import bytes_per_token as canvas_bytes_per_token
from service.quant.committed import Commit, CommittedBlocks
from service.quant.config import KVQuantConfig
from service.quant.errors import KVQuantError
from service.quant.kernels.operands import BlockMaps, KernelOperands
from service.quant.kernels.parts import forget as forget_set
from service.quant.kernels.parts import forget_layout
from service.quant.key_bias import attend_with_bias, key_score_bias
from service.quant.layout import SlotLayout
from service.quant.registry import make_quantizer, method, report_fields, resolve_artifact
from service.quant.rows import batch_key


class QuantizedKVStore(KVStore):
    """A :class:`KVStore` that holds each layer's reused K/V packed by a quantizer.

    Args:
        quantizer: the method (see `service.quant.registry`).
        keep_dequantized: keep each layer's dequantized copy until the next block.
        artifact_id: the applied artifact's id, recorded in the report under ``report_field`` (the method's
            spelling of ``artifact_id``: ``policy_id``, ``kvquant_state_id`` ...).
        attention: ``auto`` (the fused kernel on CUDA when Triton is installed, the PyTorch path elsewhere),
            ``triton`` (always the kernel) or ``torch`` (never).

    ``needs_scores`` and ``pre_rope_keys`` are the quantizer's. A new block starts when ``write`` sees other
    segments, or a layer already written. ``read`` of a layer not written in this block raises
    :class:`KVQuantError`; so does a config with ``key_bias_correction`` for a quantizer whose K format declares
    no key steps (`KVQuantizer.declares_key_steps`), and a method that declares `QuantMethod.fused_rows` for a
    quantizer that quantizes pre-RoPE keys (``pre_rope_keys``).
    """

    def __init__(
        self,
        quantizer: KVQuantizer,
        keep_dequantized: bool = False,
        artifact_id: str | None = None,
        report_field: str = "artifact_id",
        attention: AttentionPath = "auto",
    ) -> None:
        if attention not in ATTENTION_PATHS:
            raise KVQuantError(f"attention must be one of {ATTENTION_PATHS}, got {attention!r}")
        self.quantizer = quantizer
        self.attention = attention
        self.needs_scores = quantizer.needs_scores
        self.key_bias_correction = quantizer.config.key_bias_correction
        if self.key_bias_correction and not quantizer.declares_key_steps():
            raise KVQuantError(f"method {quantizer.config.method!r} has its own K format and declares no key steps "
                               "(KVQuantizer.key_steps), so key_bias_correction cannot be applied to it",
                               "key_bias_correction")
        self.pre_rope_keys = quantizer.pre_rope_keys
        self.keep_dequantized = keep_dequantized
        self.artifact_id = artifact_id
        self.report_field = report_field
        entry = method(quantizer.config.method)
        # The method's pooled reader (`service.quant.plugin.PooledReader`), None: each store reads alone.
        self.pooled = entry.pooled
        # Whether its stores share the fused kernel's launches (`QuantMethod.fused_rows`): that launch passes no
        # positions, so a declaration for quantized pre-RoPE keys would attend them unrotated.
        self.fused_rows = entry.fused_rows
        if self.fused_rows and self.pre_rope_keys and quantizer.quantizes_k:
            raise KVQuantError(f"method {entry.name!r} declares fused_rows, but its quantizer stores pre-RoPE keys, "
                               "which the fused kernel's shared launch does not rotate")
        self.accounting = KVAccounting()
        self._segments: Segments | None = None
        self._layout: SlotLayout | None = None
        self._packed: dict[int, PackedLayer] = {}
        self._dequantized: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._maps: BlockMaps | None = None
        self._operands: dict[int, KernelOperands] = {}
        self._on_sequence: SlotLayout | None = None
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None
        self._kept: dict[int, tuple[torch.Tensor, torch.Tensor, bool]] = {}
        self._row_layouts: dict[tuple[int, ...], SlotLayout] = {}
        self._scratch_layout: SlotLayout | None = None
        self._refills: dict[int, SlotLayout] = {}
        # Pre-RoPE keys: cos/sin of the reused positions (prefix, suffix), per set of rows of a step, kept for
        # the block (they are the same at every layer and step), with the positions they were made from.
        self._rope_tables: dict[tuple[int, ...] | None, tuple[torch.Tensor, RopeTables]] = {}
        # The verdict of the checks the block-initial pass's writes put off (`take_checks`), or None.
        self._verdict: torch.Tensor | None = None
        # The pooled corrected read's window places (:meth:`_attend_corrected_rows`): the set's layouts, shapes,
        # and `_window_columns` of them.
        self._window_places: tuple | None = None
        # A block-causal family's committed blocks, packed, per row of the request (`commit`).
        self._committed: dict[int, CommittedBlocks] = {}
        # The stacked write this store's block was written in with other requests' stores (`write_batch`), or None.
        self._stack: _Stack | None = None
        # The packed pool a captured later step reads (`use_pool`, `service.engine.packed_pool`), and this block's
        # runs there (None: its layers are held in tensors of its own).
        self.pool = None
        self.packed_runs = None

    def write(self, layer, k, v, segments, scores=None) -> None:
        """`KVStore.write`: quantize the layer (`KVQuantizer.quantize`). Inside a running batch's iteration
        (`DEFER_WRITE_CHECKS`) the checks' verdict stays on the device, ANDed over the block-initial pass's layers
        for :meth:`take_checks`; a layer whose checks failed is held until the batch runs the pass again."""
        if segments != self._segments or layer in self._packed:
            self._start_block(segments, k.device)
        verdicts: list[torch.Tensor] | None = [] if DEFER_WRITE_CHECKS.get() else None
        packed = self.quantizer.quantize(layer, k, v, self._layout, scores if self.needs_scores else None, verdicts)
        if verdicts:
            self._verdict = verdicts[0] if self._verdict is None else self._verdict & verdicts[0]
        self._packed[layer] = packed
        self.accounting.add(layer, packed)
        self._pool_layer(layer, k.device)

    def use_pool(self, pool) -> None:
        """`KVStore.use_pool`: from the next block-initial write on, hold the packed layers in the pool's packed
        pool (``pool.packed``, `service.engine.packed_pool`) when the later steps take the fused kernel's shared
        launch (:meth:`batch_key` ``fused``: KIVI, dLLM-KVQ), so that a captured later step reads them; None:
        tensors of its own."""
        self.pool = pool.packed if pool is not None else None

    def pooled_in(self, pool) -> bool:
        """Whether every layer written in this block is held in ``pool`` (a `service.engine.packed_pool.PackedPool`)."""
        return pool is not None and self.pool is pool and self.packed_runs is not None and bool(self._packed) and (
            len(self.packed_runs.kept) == len(self._packed))

    def _pool_layer(self, layer: int, device: torch.device) -> None:
        """Copy the layer just written into this block's runs of the packed pool and hold views of them instead
        (`service.quant.pooled.PackedRuns`): only on the fused path's shared launch, uncorrected or not."""
        if self.pool is None or not (self.fused_rows and self._fused(device) and self.quantizer.quantizes_k
                                     and self.quantizer.quantizes_v):
            return
        from service.quant.pooled import PackedRuns

        if self.packed_runs is None:
            self.packed_runs = PackedRuns(self.pool, self._layout, "protected_slots" in self._packed[layer].k.tensors)
            self.pool.holders.append(self)
        self.packed_runs.hold(layer, self._packed[layer])
        self._packed[layer] = self.packed_runs.view(layer)
        self._operands.pop(layer, None)

    def pooled_hook(self, pool, group: list, rows: int, key_len: int, device: torch.device):
        """The KV hook of a window forward over ``group``'s stores, all held in ``pool`` (this store's batch key,
        :meth:`pooled_in`): one fused launch per layer over the pool's buffers, ``rows`` rows (padded), tiles for
        ``key_len`` keys (`service.quant.pooled.pooled_packed`; the engine asks the store, it does not import
        the packed format)."""
        from service.quant.pooled import pooled_packed

        return pooled_packed(pool, group, rows, key_len, device)

    def repoint(self) -> None:
        """The packed pool's buffers were made anew: hold views of the runs where they are now."""
        for layer in self.packed_runs.kept:
            self._packed[layer] = self.packed_runs.view(layer)
        self._operands.clear()

    def write_key(self):
        """`KVStore.write_key`: the quantizer's (`KVQuantizer.write_key`: KIVI's and dLLM-KVQ's uniform formats, or
        KVQuant's, of one configuration and artifact; None for a side held as it is), or None for a subclass
        that writes its own way (its ``write`` is what it holds)."""
        if type(self).write is not QuantizedKVStore.write:
            return None
        return self.quantizer.write_key()

    def write_batch(self, stores, layer, k, v, segments, scores=None) -> None:
        """`KVStore.write_batch`: one :meth:`KVQuantizer.quantize` of the layer over every member's rows stacked
        (`SlotLayout.stacked` of their block layouts, built at the layer that starts their block), then each
        member holds its own part (`KVQuantizer.split`: the tensors its own :meth:`write` would
        hold, sliced when first read) and counts it. The checks' verdict is one for the members together (ANDed
        over the layers, :meth:`take_checks` gives it to each): when it fails, every member's pass runs again
        alone (the running batch's failure path), which finds the culprit."""
        device = k.device
        for store, seg in zip(stores, segments, strict=True):
            if seg != store._segments or layer in store._packed:
                store._start_block(seg, device)
        group = self._stack
        if group is None or layer in group.layers or len(group.stores) != len(stores) or any(
                a is not b or a._stack is not group for a, b in zip(group.stores, stores)):
            group = _Stack(list(stores), SlotLayout.stacked([store._layout for store in stores]))
            pending = [store._verdict for store in stores if store._verdict is not None]
            if pending:  # earlier layers of this block written in another set (a pass split by layers)
                group.verdict = torch.stack(pending).all()
            for store in stores:
                store._stack = group
        group.layers.add(layer)
        quantizer = self.quantizer
        verdicts: list[torch.Tensor] | None = [] if DEFER_WRITE_CHECKS.get() else None
        packed = quantizer.quantize(layer, k, v, group.layout, scores if self.needs_scores else None, verdicts)
        if verdicts:
            group.verdict = verdicts[0] if group.verdict is None else group.verdict & verdicts[0]
        parts = quantizer.split(layer, packed, group.layout)
        for store, part in zip(stores, parts):
            store._packed[layer] = part
            store._verdict = group.verdict
            store.accounting.add(layer, part)
            store._pool_layer(layer, device)

    def take_checks(self) -> torch.Tensor | None:
        verdict, self._verdict = self._verdict, None
        return verdict

    def read(self, layer):
        if layer in self._dequantized:
            return self._dequantized[layer]
        if layer not in self._packed:
            raise KVQuantError(f"layer {layer} was not written in this block's initial pass")
        kv = self.quantizer.dequantize(layer, self._packed[layer], self._layout)
        if self.keep_dequantized:
            self._dequantized[layer] = kv
        return kv

    def window_kv(self, layer, k, v, segments, rows, positions, rope):
        """The step's keys and values, ``[B_step, H, T, D]``, in a buffer the layer was dequantized into at its
        sequence columns (module doc): the shared scratch pair (valid until the next layer's call), or with
        ``keep_dequantized`` the layer's own pair, filled at its first step of the block (pre-RoPE keys rotated
        then too when every row of the block takes part; otherwise at every step)."""
        if layer not in self._packed:
            raise KVQuantError(f"layer {layer} was not written in this block's initial pass")
        if self._on_sequence is None:
            self._on_sequence = self._layout.on_sequence(segments)
        start, end = segments.block_start, segments.block_start + k.shape[2]
        rotate = self.pre_rope_keys
        key = tuple(rows.tolist()) if rows is not None else None
        if self.keep_dequantized:
            if layer not in self._kept:
                kept = self.quantizer.dequantize(layer, self._packed[layer], self._on_sequence)
                if rotate and rows is None:
                    _rotate_reused(kept[0], self._rope_for(key, positions, rope, start), rope, start, end)
                self._kept[layer] = (*kept, rotate and rows is None)
            k_all, v_all, rotated = self._kept[layer]
            rotate = rotate and not rotated
            if rows is not None:
                k_all, v_all = k_all.index_select(0, rows), v_all.index_select(0, rows)
        else:
            layout = self._on_sequence
            if rows is not None:  # only the step's rows are dequantized (plus one discarded buffer row)
                if key not in self._row_layouts:
                    self._row_layouts[key] = layout.select_rows(list(key))
                layout = self._row_layouts[key]
            shape = (layout.batch_size, k.shape[1], segments.seq_len, k.shape[3])
            held = self._scratch[0] if self._scratch is not None else None
            if held is None or held.shape[1:] != shape[1:] or held.dtype != k.dtype or held.shape[0] < shape[0]:
                self._scratch = (k.new_empty(shape), v.new_empty(shape))
                self._scratch_layout = None
            scratch = (self._scratch[0][: shape[0]], self._scratch[1][: shape[0]])
            if self._scratch_layout is layout:  # padding still zero from the last fill: only runs are written
                if id(layout) not in self._refills:
                    self._refills[id(layout)] = replace(layout, zero_padding=False)
                layout = self._refills[id(layout)]
            else:
                self._scratch_layout = layout
            k_all, v_all = self.quantizer.dequantize(layer, self._packed[layer], layout, scratch)
            k_all, v_all = k_all[: k.shape[0]], v_all[: k.shape[0]]
        if rotate:
            _rotate_reused(k_all, self._rope_for(key, positions, rope, start), rope, start, end)
        k_all[:, :, start:end] = k
        v_all[:, :, start:end] = v
        return k_all, v_all

    def attend(self, layer, q, k, v, rows, positions, rope):
        """The fused kernel's attention over the packed layer and the window (see the module doc), the PyTorch
        path's own attention when the configuration corrects key bias (:meth:`_attend_corrected`), else None
        (the PyTorch path: the engine attends over :meth:`window_kv`). The kernel's index maps are built at the
        layer's first step of a block."""
        if not self._fused(q.device):
            if self.key_bias_correction:
                return self._attend_corrected(layer, q, k, v, rows, positions, rope)
            return None
        from service.quant.kernels.attention import fused_reuse_attention  # imports Triton

        ops, maps = self._kernel_inputs(layer)
        if rows is None:
            rows = torch.arange(q.shape[0], device=q.device)
        pre_rope = self.pre_rope_keys
        return fused_reuse_attention(
            q, k, v, ops, maps, rows,
            positions=positions if pre_rope else None,
            inv_freq=rope.inv_freq(q.device) if pre_rope else None,
            rope_full_precision=rope.full_precision,
            key_bias=self.key_bias_correction,
        )

    def _attend_corrected(self, layer, q, k, v, rows, positions, rope) -> torch.Tensor:
        """Attention over :meth:`window_kv` with each reused key's score lowered by its expected rounding
        inflation (`service.quant.key_bias.key_score_bias`; the fresh window and exact tokens have step 0), and
        the row's padding masked. The steps are read from the packed layer at every step (no per-block copy: it
        would cost as much memory as a kept dequantized layer)."""
        segments = self._segments
        k_all, v_all = self.window_kv(layer, k, v, segments, rows, positions, rope)  # [B_step, H_kv, T, D]
        n = q.shape[0]
        layout = self._on_sequence
        key = tuple(rows.tolist()) if rows is not None else None
        if key is not None:
            if key not in self._row_layouts:
                self._row_layouts[key] = layout.select_rows(list(key))
            layout = self._row_layouts[key]
        steps = layout.scatter(self.quantizer.key_steps(layer, self._packed[layer], self._layout))[:n]
        cos = sin = None
        if self.pre_rope_keys:  # the steps are in the pre-RoPE basis: each key's angle (its reused position)
            start, end = segments.block_start, segments.block_end
            placed = positions.new_zeros(n, segments.seq_len)
            placed[:, :start] = positions[:, :start]
            if segments.cache_mode == "dual":
                placed[:, end:] = positions[:, start:]
            cos, sin = rope.cos_sin(placed)
        bias = key_score_bias(q, steps, cos, sin)
        pads = torch.tensor(segments.pad_lengths, device=q.device)
        if rows is not None:
            pads = pads.index_select(0, rows)
        key_mask = torch.arange(segments.seq_len, device=q.device)[None, :] >= pads[:, None]
        return attend_with_bias(q, k_all, v_all, bias, key_mask)

    def attend_batch(self, stores, layer, q, k, v, widths, positions=None, rope=None):
        """Stores with a fused batch key (:meth:`batch_key`): every row of ``stores`` attends in one launch of
        the kernel (`service.quant.kernels.attention.fused_reuse_attention_rows`, with the key-bias correction
        when the stores correct); corrected stores on the PyTorch path attend together over one pooled read
        (:meth:`_attend_corrected_rows`); None for the others."""
        if self._fused(q.device):
            from service.quant.kernels.attention import fused_reuse_attention_stores  # imports Triton

            return fused_reuse_attention_stores(q, k, v, stores, layer, widths, key_bias=self.key_bias_correction)
        if self.key_bias_correction:
            return self._attend_corrected_rows(stores, layer, q, k, v, widths, positions, rope)
        return None

    def _attend_corrected_rows(self, stores, layer, q, k, v, widths, positions, rope) -> torch.Tensor:
        """:meth:`_attend_corrected` for every row of ``stores`` at once: their reused K/V and key steps in one
        pooled read (`service.quant.rows`, `service.quant.rows_nuq`: the values and steps each store gives
        alone), each row's fresh window written over its window columns (padded window columns into a spare
        last column that gets no weight), one bias and one attention for all rows."""
        key_len = max(store._segments.seq_len for store in stores) + 1
        k_all, v_all, steps, cos, sin = self.pooled.read_steps(stores, layer, key_len, positions, rope)
        # Where the windows go: the same for every layer of a step, and for the block while the set is the same.
        held = self._window_places
        shape = (tuple(widths), key_len, k.shape[2], k.shape[1])
        if held is None or held[1] != shape or len(held[0]) != len(stores) or any(
                a is not b._layout for a, b in zip(held[0], stores)):
            held = (tuple(store._layout for store in stores), shape,
                    *_window_columns(stores, widths, key_len, k.shape[2], k.shape[1], q.device))
            self._window_places = held
        flat, key_mask = held[2], held[3]
        d = k.shape[3]
        k_all.view(-1, d).index_copy_(0, flat, k.reshape(-1, d))
        v_all.view(-1, d).index_copy_(0, flat, v.reshape(-1, d))
        return attend_with_bias(q, k_all, v_all, key_score_bias(q, steps, cos, sin), key_mask)

    def _kernel_inputs(self, layer: int) -> tuple[KernelOperands, BlockMaps]:
        """The kernel's operands of ``layer`` and the block's maps, made at the layer's first later step."""
        if layer not in self._packed:
            raise KVQuantError(f"layer {layer} was not written in this block's initial pass")
        if self._maps is None:
            self._maps = BlockMaps.from_layout(self._layout)
        if layer not in self._operands:
            self._operands[layer] = self.quantizer.kernel_operands(layer, self._packed[layer], self._layout)
        return self._operands[layer], self._maps

    def batch_key(self, layer, device):
        """Later steps of stores whose method declares one pooled reader (`service.quant.plugin.PooledReader`:
        KIVI's and dLLM-KVQ's uniform formats, `service.quant.rows`; KVQuant's per state,
        `service.quant.rows_nuq`) and whose reader's key agrees dequantize together: not with kept dequantized
        copies, a side held as it is, or a method that declares no reader. Stores on the fused kernel's path of
        one uniform format whose method declares `QuantMethod.fused_rows` attend together in one launch
        (:meth:`attend_batch`; their key is apart from the PyTorch path's); KVQuant's kernel path still attends
        per store. Stores with the key-bias correction attend together (:meth:`attend_batch`), apart from
        uncorrected ones."""
        key = self._format_key(layer, device)
        return ("key_bias", key) if key is not None and self.key_bias_correction else key

    def _format_key(self, layer, device):
        quantizer = self.quantizer
        if layer not in self._packed or not (quantizer.quantizes_k and quantizer.quantizes_v):
            return None
        if self._fused(device):
            return ("fused", batch_key(quantizer, self._packed[layer])) if self.fused_rows else None
        if self.keep_dequantized or self.pooled is None:
            return None
        if self.key_bias_correction and self.pooled.read_steps is None:
            return None  # no steps from this method's reader: the correction attends per store
        return (id(self.pooled), self.pooled.key(self, self._packed[layer]))

    def window_kv_batch(self, stores, layer, key_len, positions=None, rope=None):
        return self.pooled.read(stores, layer, key_len, positions, rope)

    def _fused(self, device: torch.device) -> bool:
        if not (self.quantizer.quantizes_k and self.quantizer.quantizes_v):
            return False  # the kernel reads codes; a side held as it is (``sides``) goes through window_kv
        if self.attention == "auto":
            return device.type == "cuda" and _triton_available()
        return self.attention == "triton"

    def commit(self, slot: int, start: int, end: int, block: int, row: int = 0) -> Commit:
        """Row ``row`` of the request (a block-causal family's, in cache slot ``slot`` of this forward): its
        committed blocks, held packed here, are read before ``start``, and the columns ``[start, end)`` that
        commit now (active block ``[end, end + block)``; none when ``start == end``) are quantized by this
        store's quantizer, kept packed and counted in its accounting (`service.quant.committed`; LLaDA2's
        ``block`` cache mode)."""
        if row not in self._committed:
            self._committed[row] = CommittedBlocks(self.quantizer)
        return Commit(slot, start, end, block, self.quantizer, self.accounting, self._committed[row])

    def canvas(self, batch: int, geometry: Geometry, rotate_keys: LayerRotation) -> PackedCanvas:
        """The packed committed K/V of a renoising decode's ``batch`` rows (DiffusionGemma's
        `service.engine.models.diffusion_gemma.make_canvas_cache`; `service.quant.canvas`): this store's
        quantizer writes them, its accounting counts them (its :meth:`report`), its ``bytes_held`` includes them.
        ``geometry``: per layer (KV heads, head dim, positions a sliding layer reads or None).

        Raises:
            KVQuantError: a configuration the family cannot run (`service.quant.canvas.check_geometry`).
        """
        rows = [self._committed.setdefault(r, CommittedBlocks(self.quantizer)) for r in range(batch)]
        return PackedCanvas(self.quantizer, self.accounting, rows, geometry, rotate_keys, self.keep_dequantized)

    def canvas_bytes_per_token(self, geometry: Geometry, layers: list[int], dtype: torch.dtype,
                               device: torch.device | str = "cpu") -> float:
        """Bytes this store's quantizer holds per committed token of a renoising family over ``layers`` (K and
        V; `service.quant.canvas.bytes_per_token`: a probe at each layer's geometry).

        Raises:
            KVQuantError: see :meth:`canvas`.
        """
        return canvas_bytes_per_token(self.quantizer, geometry, layers, dtype, device)

    def committed_bytes(self, row: int) -> int:
        """Bytes of row ``row``'s committed blocks held packed (0 before its first commit)."""
        held = self._committed.get(row)
        return held.nbytes if held is not None else 0

    def clear(self) -> None:
        """Drop the held tensors (and the pooled indexes made from this block's layout, `service.quant.rows`,
        `service.quant.rows_nuq`, and the kernel's sets made from its maps, `service.quant.kernels.parts`); the
        accounting stays for :meth:`report`."""
        if self._layout is not None and self.pooled is not None:
            self.pooled.forget(self._layout)
        if self._maps is not None:
            forget_set(self._maps)
        if self._layout is not None:
            forget_layout(self._layout)
        if self.packed_runs is not None:
            self.packed_runs.free()
            self.pool.holders.remove(self)
            self.packed_runs = None
        self._segments = None
        self._layout = None
        self._verdict = None
        self._packed.clear()
        self._dequantized.clear()
        self._maps = None
        self._operands.clear()
        self._on_sequence = None
        self._scratch = None
        self._kept.clear()
        self._row_layouts.clear()
        self._scratch_layout = None
        self._refills.clear()
        self._rope_tables.clear()
        self._window_places = None
        self._committed.clear()
        self._stack = None

    def _rope_for(self, key, positions: torch.Tensor, rope, start: int) -> RopeTables:
        """cos/sin of the reused prefix and suffix positions of a step's rows (``key``), made once per block and
        set of rows: the positions are checked against those the tables were made from (identity first: one
        step hands every layer the same tensor), so new positions always get new tables."""
        held = self._rope_tables.get(key)
        if held is not None and (held[0] is positions or torch.equal(held[0], positions)):
            return held[1]
        tables = (rope.cos_sin(positions[:, :start]), rope.cos_sin(positions[:, start:]))
        self._rope_tables[key] = (positions, tables)
        return tables

    @property
    def bytes_held(self) -> int:
        """Bytes held now: packed layers, the block's index tensors, kept dequantized copies, the later steps'
        scratch pair (the size of the concatenation the unquantized path makes at every layer) and, for pre-RoPE
        keys, the block's cos/sin tables."""
        held = sum(p.nbytes + p.derived_nbytes for p in self._packed.values())
        buffers = [*(self._scratch or ()), *(t for k, v, _ in self._kept.values() for t in (k, v))]
        held += sum(t.numel() * t.element_size() for t in buffers)
        held += sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self._dequantized.values())
        held += sum(t.numel() * t.element_size() for _, tables in self._rope_tables.values() for pair in tables
                    for t in pair)
        held += sum(blocks.nbytes for blocks in self._committed.values())
        return held + (self._layout.nbytes if self._layout is not None else 0)

    def report(self) -> KVReport:
        """Effective bits and bytes of everything written so far (see `service.quant.accounting`)."""
        fields = dict.fromkeys(report_fields()) | {self.report_field: self.artifact_id}
        return self.accounting.report(self.quantizer.config.model_dump(mode="json"), fields)

    def _start_block(self, segments: Segments, device: torch.device) -> None:
        self.clear()
        self._segments = segments
        self._layout = SlotLayout.from_segments(segments, self.quantizer.k_group_size, device)
        self.accounting.start_block(self._layout.nbytes)


@dataclass(eq=False)
class _Stack:
    """Stores whose block was written together (`QuantizedKVStore.write_batch`): the members in row order, their
    stacked layout, the layers written so far and the verdict of the checks put off (ANDed over the layers)."""

    stores: list
    layout: SlotLayout
    layers: set[int] = field(default_factory=set)
    verdict: torch.Tensor | None = None


#: cos/sin ``[B, 1, T, D]`` (`RotaryEmbedding.cos_sin`) of the reused prefix and of the reused suffix.
RopeTables = tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _rotate_reused(k_all: torch.Tensor, tables: RopeTables, rope, start: int, end: int) -> None:
    """Rotate the reused columns of ``k_all`` ``[B, H, T, D]`` in place: ``[0, start)`` and ``[end, T)``, with
    the cos/sin of their positions (`QuantizedKVStore._rope_for`; each part's own tables, as ``rope.rotate`` of
    that part would make them, so the result is bit for bit the same)."""
    rope.rotate_in_place(k_all[:, :, :start], *tables[0])
    if end < k_all.shape[2]:
        rope.rotate_in_place(k_all[:, :, end:], *tables[1])


def _window_columns(stores, widths: list[int], key_len: int, window: int, heads: int, device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a pooled read's fresh window goes, and which keys each row attends.

    Returns:
        int64 ``[R x heads x window]``: per (row, kv head, window column) its row of a ``[R, heads, key_len, D]``
        buffer viewed as ``[-1, D]`` (the row's block start plus the column; a column past the row's own window
        width goes to the spare last column, ``key_len - 1``); bool ``[R, key_len]``: True on the row's real
        keys (past its padding, before its sequence's end).
    """
    starts, ends, pads, kept = [], [], [], []
    for store, width in zip(stores, widths):
        seg = store._segments
        for pad in seg.pad_lengths:
            starts.append(seg.block_start)
            ends.append(seg.seq_len)
            pads.append(pad)
            kept.append(width)
    host = torch.tensor([starts, ends, pads, kept], dtype=torch.int64).to(device)
    col = torch.arange(window, device=device)
    dest = torch.where(col[None, :] < host[3][:, None], host[0][:, None] + col[None, :], key_len - 1)  # [R, W]
    rows = torch.arange(len(starts), device=device)[:, None, None] * heads + torch.arange(heads, device=device)[None, :, None]
    flat = (rows * key_len + dest[:, None, :]).reshape(-1)
    keys = torch.arange(key_len, device=device)[None, :]
    return flat, (keys >= host[2][:, None]) & (keys < host[1][:, None])


AttentionPath = Literal["auto", "triton", "torch"]
ATTENTION_PATHS: tuple[str, ...] = ("auto", "triton", "torch")


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def make_kv_store(
    config: KVQuantConfig, spec: ModelSpec, artifact: Any = None, attention: AttentionPath = "auto"
) -> KVStore:
    """The KV store for one request's configuration.

    ``method="none"`` gives the engine's :class:`FullPrecisionKVStore`. An artifact named by file in the config
    is loaded here (`service.quant.registry.resolve_artifact`); one named by id must be passed in (the caller
    resolves ids through its store, `service.store.base`). ``attention`` picks the later steps' path (see
    :class:`QuantizedKVStore`).

    Raises:
        KVQuantError: the artifact is missing, or named by id but not passed, or its file cannot be read or
            parsed; an unknown method; a bad v_group_size.
        ArtifactMismatch: the artifact does not fit the model or the config (message names the field).
    """
    entry = method(config.method)
    if entry.quantizer is None:
        return FullPrecisionKVStore()
    if entry.artifact is not None and artifact is None:
        if config.artifact_file is None:
            raise KVQuantError(f"{entry.spelling('artifact_id')} {config.artifact_id!r} must be resolved by the "
                               "caller and passed as artifact")
        artifact = resolve_artifact(config, spec)
    quantizer = make_quantizer(config, spec, artifact)
    return QuantizedKVStore(
        quantizer,
        keep_dequantized=config.keep_dequantized,
        artifact_id=artifact.id if artifact is not None else None,
        report_field=entry.spelling("artifact_id"),
        attention=attention,
    )
