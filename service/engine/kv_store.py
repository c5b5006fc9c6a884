"""The seam between block decoding and whatever holds the reused K/V regions of a block.

The engine owns this interface; `service.quant` implements quantized stores behind it.

Protocol (Fast-dLLM cache reuse, paper "Preliminary: dLLM Cache"):

* During the **block-initial pass** (one full forward over the whole sequence at the start of a block) every
  layer calls ``write(layer, k, v, segments, scores)`` as soon as its K/V exist, so that a store can quantize
  layer by layer and never hold every layer in full precision.
* Every later step of the block calls ``window_kv(layer, k, v, ...)`` and gets the keys and values to attend
  over: the reused K/V around the fresh active-block (and, in prefix mode, block + suffix) K/V, in sequence
  order. The default reads ``read(layer)`` (the K/V of the **reused positions** only, prefix positions, then, in
  dual mode, suffix positions) and concatenates; a store may fill a scratch buffer instead.
* A store may instead compute the step's attention itself, straight from what it holds: ``attend(layer, q, k,
  v, rows, positions, rope)`` returns the attention output, or None to fall back to ``read`` (the default; a
  quantized store answers on CUDA with a fused kernel over its packed cache, `service.quant.kernels`).
* The next block's initial pass overwrites every layer.

Shapes use the fixed letters of STYLE.md: B batch, H kv heads, T tokens, D head dim.
"""

from __future__ import annotations

from collections.abc import Hashable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from service.engine.kv_pool import KVPool, PoolRun
    from service.engine.models.layers import RotaryEmbedding
    from service.engine.report import KVReport

#: Set by a running batch around the forwards of an iteration (`service.engine.batch`): a store's ``write`` may
#: then leave the verdict of its checks on the device (:meth:`KVStore.take_checks`) for the iteration's one host
#: read, instead of reading it at every write (a sync per request and layer on a GPU). Unset (the default), a
#: write reads its checks itself and raises at once.
DEFER_WRITE_CHECKS: ContextVar[bool] = ContextVar("defer_write_checks", default=False)


@dataclass(frozen=True)
class Segments:
    """Where padding, prefix, active block and suffix lie in a left-padded batch for one block.

    Sequence layout per row: ``[left padding][prompt][response]``; every row of a batch has the same total
    length ``seq_len`` and the response starts at the same column, so the block bounds are shared and only
    the padding differs per row.

    Attributes:
        pad_lengths: per row, number of left-padding columns (padding is ``[0, pad_lengths[b])``).
        block_start: first column of the active block (``s``).
        block_end: one past the last column of the active block (``e``).
        seq_len: total columns ``T``.
        cache_mode: ``"prefix"`` (reuse ``[0, s)``) or ``"dual"`` (reuse ``[0, s)`` and ``[e, T)``).
    """

    pad_lengths: tuple[int, ...]
    block_start: int
    block_end: int
    seq_len: int
    cache_mode: Literal["prefix", "dual"]

    def __post_init__(self) -> None:
        if self.cache_mode not in ("prefix", "dual"):
            raise ValueError(f"cache_mode must be 'prefix' or 'dual', got {self.cache_mode!r}")
        if not 0 <= self.block_start < self.block_end <= self.seq_len:
            raise ValueError(f"need 0 <= block_start < block_end <= seq_len, got {self}")
        if any(not 0 <= p <= self.block_start for p in self.pad_lengths):
            raise ValueError(f"pad_lengths must lie in [0, block_start], got {self.pad_lengths}")

    @property
    def batch_size(self) -> int:
        return len(self.pad_lengths)

    @property
    def reused_columns(self) -> torch.Tensor:
        """Columns of the sequence that are reused, in order: int64 ``[T_reused]``."""
        prefix = torch.arange(0, self.block_start)
        if self.cache_mode == "prefix":
            return prefix
        return torch.cat([prefix, torch.arange(self.block_end, self.seq_len)])

    @property
    def num_reused(self) -> int:
        return int(self.reused_columns.numel())

    def row_segments(self, row: int) -> list[tuple[int, int]]:
        """Contiguous reused segments of one row, as ``(start, end)`` indices into the **reused** axis.

        Padding is excluded (it never enters a statistic); the prefix segment starts at the row's first real
        token and the suffix segment (dual mode) starts right after the prefix in the reused axis. Empty
        segments are left out.
        """
        segments = []
        if self.block_start > self.pad_lengths[row]:
            segments.append((self.pad_lengths[row], self.block_start))
        if self.cache_mode == "dual" and self.seq_len > self.block_end:
            segments.append((self.block_start, self.block_start + self.seq_len - self.block_end))
        return segments


class KVStore:
    """Holds the reused K/V of every layer between the block-initial pass and the later steps of a block.

    Subclasses set the two class flags when they need more from the engine:

    * ``needs_scores``: the engine passes ``scores`` to :meth:`write`, float32 ``[B, T]``: the attention
      probability that the active block's queries put on each key in the block-initial pass, averaged over all
      query heads and the block's queries (dLLM-KVQ's ``attention`` score, paper "Online Quantization Details").
    * ``pre_rope_keys``: ``write`` receives keys **before** RoPE and ``read`` returns pre-RoPE keys that the
      engine rotates at their absolute positions after reading (KVQuant stores pre-RoPE keys). Otherwise keys are
      **after** RoPE, which gives the same values as the reference's rotate-at-every-call.
    """

    needs_scores: bool = False
    pre_rope_keys: bool = False
    #: True for a store whose layers a running batch may gather in sequence order (`FullPrecisionKVStore`).
    sequence_ordered: bool = False

    def write(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        segments: Segments,
        scores: torch.Tensor | None = None,
    ) -> None:
        """Take the reused part of one layer's K/V from the block-initial pass.

        Args:
            layer: layer index, 0-based.
            k, v: ``[B, H, T, D]`` K/V of the whole sequence, model dtype.
            segments: the block's layout; the store keeps the columns ``segments.reused_columns``.
            scores: float32 ``[B, T]``, only when ``needs_scores``.
        """
        raise NotImplementedError

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the reused columns of one layer: ``[B, H, T_reused, D]`` each, model dtype."""
        raise NotImplementedError

    def write_key(self) -> Hashable | None:
        """Stores whose keys are equal (and not None) take a block-initial layer of all their rows in one call
        (:meth:`write_batch`), so a running batch pays one set of tensor operations per layer for them, not one
        per request. None (this default): this store is written alone (:meth:`write`)."""
        return None

    def write_batch(
        self, stores: list[KVStore], layer: int, k: torch.Tensor, v: torch.Tensor, segments: list[Segments],
        scores: torch.Tensor | None = None,
    ) -> None:
        """:meth:`write` of one layer for every store of ``stores`` (this one among them, all with this one's
        :meth:`write_key`, each with every row of its pass, in order) at once: each store then holds what its own
        :meth:`write` would have held.

        Args:
            k, v: ``[R, H, T, D]``, the stores' rows stacked (R their rows together; each store's rows hold its
                own sequence at columns ``[0, segments[i].seq_len)``, T the longest); model dtype; pre-RoPE keys
                when the stores ask for them.
            segments: per store, its block's layout.
            scores: float32 ``[R, T]`` (``needs_scores`` only; each row's over its own sequence's columns).

        Raises:
            NotImplementedError: a store whose :meth:`write_key` is always None.
        """
        raise NotImplementedError

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rows: torch.Tensor | None,
        positions: torch.Tensor | None,
        rope: RotaryEmbedding,
    ) -> torch.Tensor | None:
        """A later step's attention over this layer's reused K/V and the fresh window, or None (then the engine
        calls :meth:`read` and attends itself; this default).

        Args:
            layer: layer index.
            q: ``[B_step, H, T_w, D]`` post-RoPE queries of the window; k, v: ``[B_step, H_kv, T_w, D]`` the
                window's fresh K (post-RoPE) and V, never padding.
            rows: int64 ``[B_step]``, the rows of the block-initial pass in this step (None = all, in order).
            positions: int64 ``[B_step, T_reused]`` RoPE positions of the reused columns (only with
                ``pre_rope_keys``).
            rope: the model's rotary embedding.

        Returns:
            ``[B_step, H, T_w, D]`` in q's dtype: softmax(q K^T / sqrt(D)) V over the reused real tokens and the
            window (GQA: query head h reads kv head ``h // (H / H_kv)``), the same as :meth:`read` + SDPA up to
            round-off.
        """
        return None

    def window_kv(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        segments: Segments,
        rows: torch.Tensor | None,
        positions: torch.Tensor | None,
        rope: RotaryEmbedding,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys (post-RoPE) and values a later step attends over, ``[B_step, H_kv, T_k, D]`` each, in
        sequence order: prefix mode reused ``[0, s)`` | fresh ``[s, T)``; dual mode reused ``[0, s)`` | fresh
        block ``[s, e)`` | reused suffix ``[e, T)``.

        Args: as :meth:`attend` (k, v: the window's fresh K/V), plus ``segments``, the block's layout.

        This default reads the layer (:meth:`read`), selects the step's rows, rotates pre-RoPE keys at their
        positions and concatenates. The caller uses the result within the layer's attention only: a store may
        hand out a scratch buffer that its next call overwrites.
        """
        k_reused, v_reused = self.read(layer)  # [B, H_kv, T_reused, D]
        if rows is not None:
            k_reused, v_reused = k_reused.index_select(0, rows), v_reused.index_select(0, rows)
        if self.pre_rope_keys:
            k_reused = rope.rotate(k_reused, positions)
        start = segments.block_start
        if segments.cache_mode == "prefix":
            return torch.cat([k_reused, k], dim=2), torch.cat([v_reused, v], dim=2)
        k_all = torch.cat([k_reused[:, :, :start], k, k_reused[:, :, start:]], dim=2)
        v_all = torch.cat([v_reused[:, :, :start], v, v_reused[:, :, start:]], dim=2)
        return k_all, v_all

    def batch_key(self, layer: int, device: torch.device) -> Hashable | None:
        """Stores whose keys are equal (and not None) give a later step's reused K/V of all their rows at once
        (:meth:`window_kv_batch`), so a running batch pays one set of tensor operations per layer for them, not
        one per request. None (this default): this store answers alone (:meth:`window_kv` or :meth:`attend`)."""
        return None

    def window_kv_batch(
        self, stores: list[KVStore], layer: int, key_len: int, positions: list[torch.Tensor | None] | None = None,
        rope: RotaryEmbedding | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The reused K/V of every row of ``stores`` (this one among them, all with this one's
        :meth:`batch_key`, every row of each taking part, in order), ``[R, H_kv, key_len, D]`` each: row ``r``
        holds its reused keys (post-RoPE) and values at their sequence columns and zeros elsewhere; the caller
        writes the fresh window over its columns. A fresh pair, the caller's to write into. ``positions`` (per
        store, int64 ``[B, T_reused]``, as :meth:`window_kv` gets them) and ``rope`` are what stores with
        ``pre_rope_keys`` rotate their keys with; the caller passes them always.

        Raises:
            NotImplementedError: a store whose :meth:`batch_key` is always None.
        """
        raise NotImplementedError

    def take_checks(self) -> torch.Tensor | None:
        """The verdict of the checks that ``write`` put off (:data:`DEFER_WRITE_CHECKS`) since the block-initial
        pass began, and forget it: bool 0-dim on the device, True when every check passed; None when none were put
        off (this default). When False, the caller runs the pass again with the checks read at once, which raises
        the error they stand for (or, for a false alarm, writes the same K/V)."""
        return None

    def attend_batch(
        self, stores: list[KVStore], layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        widths: list[int], positions: list[torch.Tensor | None] | None = None, rope: RotaryEmbedding | None = None,
    ) -> torch.Tensor | None:
        """A later step's attention for every row of ``stores`` (this one among them, all with this one's
        :meth:`batch_key`, every row of each taking part, in order) in one call, or None (this default: the
        caller reads them through :meth:`window_kv_batch`).

        Args: as :meth:`attend` for the rows together, ``[R, H, T_w, D]`` queries and ``[R, H_kv, T_w, D]`` fresh
        K/V with ``T_w`` the widest window; ``widths``: per store, its own window's columns (the others are
        padding of a merged forward and get no weight); ``positions`` and ``rope`` as :meth:`window_kv_batch`
        takes them.

        Returns:
            ``[R, H, T_w, D]`` in q's dtype, each row as :meth:`attend` of its store would give it at its own
            window's columns (padded query columns hold values nobody reads).
        """
        return None

    def use_pool(self, pool: KVPool | None) -> None:
        """Keep the K/V in ``pool`` (`service.engine.kv_pool.KVPool`, whose buffers a captured later step reads)
        from the next block-initial pass on, when this store can; this default cannot and keeps its own."""

    def clear(self) -> None:
        """Drop everything held (end of a request)."""

    def report(self) -> KVReport | None:
        """What holding the K/V cost over the request, for ``DecodeReport.kv``; None when nothing is accounted
        (the unquantized store). Quantized stores (`service.quant.store`) return effective bits and bytes."""
        return None


class FullPrecisionKVStore(KVStore):
    """The default store: keeps the K/V as they are (Fast-dLLM's unquantized cache reuse).

    It keeps each layer's whole sequence in order, ``[B, H_kv, T + 1, D]`` (post-RoPE keys, one spare column at
    the end), not only the reused columns: a later step of a running batch (`service.engine.batch`) puts the
    rows of many such stores side by side in one tensor per layer (:meth:`sequence_kv`) and writes the fresh
    window's K/V over the window's columns (which no later step reuses; the spare column takes the padded query
    columns of a merged forward and is never attended), so the rows of every request attend in one call with no
    per-request concatenation. :meth:`read` gives the reused columns as the protocol says. (A subclass that
    writes or reads its own way, with ``_layers`` holding the reused columns, is read through the protocol.)

    Where the K/V live: in buffers of its own, or, once :meth:`use_pool` gave it one, in a run of a
    `service.engine.kv_pool.KVPool` (the same layout; a captured later step reads the pool, `service.engine.graphs`).
    Either way a later block of the same shape is written in place.
    """

    def __init__(self) -> None:
        self._layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._sequence: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._segments: Segments | None = None
        self.pool: KVPool | None = None
        #: This store's vectors in :attr:`pool` (None: none held there).
        self.run: PoolRun | None = None
        self._zeroed: set[int] = set()  # layers written since the run was made (their spare column zeroed)

    @property
    def sequence_ordered(self) -> bool:  # type: ignore[override]
        """True unless a subclass writes, reads or rotates its own way (then the batch uses :meth:`window_kv`)."""
        cls = type(self)
        return (cls.write is FullPrecisionKVStore.write and cls.read is FullPrecisionKVStore.read
                and cls.window_kv is KVStore.window_kv and not self.pre_rope_keys)

    def use_pool(self, pool: KVPool | None) -> None:
        """Hold the K/V in ``pool`` from the next block-initial pass that makes its buffers on (None: buffers of its
        own); a store that writes or reads its own way (not :attr:`sequence_ordered`) keeps its own."""
        if self.sequence_ordered:
            self.pool = pool

    def write(self, layer, k, v, segments, scores=None) -> None:
        b, t = k.shape[0], k.shape[2]
        if self.pool is not None and self.pool.takes(k):
            if self.run is None or (self.run.rows, self.run.length) != (b, t + 1):
                self.clear()
                self.run = self.pool.allocate(b, t + 1)
            kk, vv = self.pool.view(self.run, layer)
            if layer not in self._zeroed:  # the run's vectors held another request's: its spare column is zeroed
                kk[:, :, -1].zero_()
                vv[:, :, -1].zero_()
                self._zeroed.add(layer)
            kk[:, :, :-1].copy_(k)
            vv[:, :, :-1].copy_(v)
            self._segments = segments
            return
        held = self._sequence.get(layer)
        if held is not None and held[0].shape[:2] == k.shape[:2] and held[0].shape[2] == t + 1 \
                and held[0].dtype == k.dtype and held[0].device == k.device:
            # A later block of the same sequence: written in place (the spare column keeps whatever it held: it is
            # never attended).
            held[0][:, :, :-1].copy_(k)
            held[1][:, :, :-1].copy_(v)
        else:  # F.pad copies, so the store never aliases the forward's activations.
            self._sequence[layer] = (torch.nn.functional.pad(k, (0, 0, 0, 1)),
                                     torch.nn.functional.pad(v, (0, 0, 0, 1)))
        self._segments = segments

    def read(self, layer):
        if self.run is None and layer not in self._sequence:
            return self._layers[layer]
        k, v = self.sequence_kv(layer)
        columns = self._segments.reused_columns.to(k.device)
        return k.index_select(2, columns), v.index_select(2, columns)

    @property
    def held_layers(self) -> list[int]:
        """The layers whose K/V it holds, ascending."""
        return sorted(self._zeroed if self.run is not None else self._sequence or self._layers)

    def sequence_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K (post-RoPE) and V over the whole sequence plus a spare column, ``[B, H_kv, T + 1, D]``:
        the reused columns as written, the window's columns holding whatever the last step put there (in the pool:
        views of its run, valid until the next block-initial write of any store, which may move it)."""
        if self.run is not None:
            return self.pool.view(self.run, layer)
        return self._sequence[layer]

    def clear(self) -> None:
        self._layers.clear()
        self._sequence.clear()
        self._segments = None
        if self.run is not None:
            self.pool.free(self.run)
            self.run = None
        self._zeroed.clear()
