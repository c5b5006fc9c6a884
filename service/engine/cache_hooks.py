"""The two KV hooks that connect the attention layers to a :class:`~service.engine.kv_store.KVStore`.

* :class:`BlockInitialWrite`: in the block-initial full pass every layer hands its reused columns to
  ``store.write`` as soon as its K/V exist (with attention scores when the store asks for them).
* :class:`ReuseRead`: in every later step of the block, a layer computes K/V only for the window (prefix mode: the
  active block and the suffix; dual mode: the active block) and attends over the reused K/V read from the store,
  put back in sequence order around the fresh window.

Fast-dLLM keeps keys before RoPE and rotates the whole key tensor at every call (golden SPEC 1.4, 2.4); here keys
are stored after RoPE, which gives the same values once rotated, unless the store asks for pre-RoPE keys
(``pre_rope_keys``, KVQuant), in which case the reused keys are rotated at their positions after ``read``.
A store that attends itself (``KVStore.attend``, the fused kernel path) is asked first.
"""

from __future__ import annotations

import itertools

import torch

from service.engine.kv_store import KVStore, Segments
from service.engine.models.layers import RotaryEmbedding
from service.engine.scores import attention_scores


class BlockInitialWrite:
    """KV hook of the block-initial pass: ``store.write(layer, k, v, segments, scores)`` for every layer.

    Args:
        store: the request's KV store.
        segments: the block's layout (rows = the rows in this pass).
        key_mask: bool ``[B, T]`` padding mask of the pass, or None.
    """

    def __init__(self, store: KVStore, segments: Segments, key_mask: torch.Tensor | None) -> None:
        self.store, self.segments, self.key_mask = store, segments, key_mask

    def __call__(self, layer, q, k_pre, k, v):
        scores = None
        if self.store.needs_scores:
            block = slice(self.segments.block_start, self.segments.block_end)
            scores = attention_scores(q[:, :, block], k, self.key_mask)  # float32 [B, T]
        self.store.write(layer, k_pre if self.store.pre_rope_keys else k, v, self.segments, scores)


def write_together(parts: list[tuple[object, slice]], q: torch.Tensor) -> tuple[list[WriteSet], list[int]]:
    """The block-initial writes of a merged forward that go together (issue 41): the parts (hook, rows of the
    forward) whose hook is a :class:`BlockInitialWrite` of a store with a `KVStore.write_key`, grouped by that key
    (and, for stores that need scores, by their block bounds and sequence length: the scores of a set are computed
    in one call over its rows, which must share their block's queries and keys). Returns the sets of two or more
    and the indices of the parts left to write alone."""
    kinds: dict = {}
    for i, (hook, _) in enumerate(parts):
        if isinstance(hook, BlockInitialWrite) and (key := hook.store.write_key()) is not None:
            seg = hook.segments
            shape = (seg.block_start, seg.block_end, seg.seq_len) if hook.store.needs_scores else None
            kinds.setdefault((key, shape), []).append(i)
    sets = [WriteSet([parts[i] for i in members], q.device) for members in kinds.values() if len(members) > 1]
    together = {i for members in kinds.values() if len(members) > 1 for i in members}
    return sets, [i for i in range(len(parts)) if i not in together]


class WriteSet:
    """Block-initial writes of several stores with one `KVStore.write_key`, made in one `KVStore.write_batch` per
    layer: their rows of the forward (a slice when they are consecutive, else an index made once), their keys up
    to the longest sequence, and for stores that need scores one :func:`attention_scores` over all their rows."""

    def __init__(self, parts: list[tuple[BlockInitialWrite, slice]], device: torch.device) -> None:
        self.hooks = [hook for hook, _ in parts]
        self.stores = [hook.store for hook in self.hooks]
        self.segments = [hook.segments for hook in self.hooks]
        self.width = max(seg.seq_len for seg in self.segments)
        spans = [rows for _, rows in parts]
        if all(a.stop == b.start for a, b in itertools.pairwise(spans)):
            self.rows: slice | torch.Tensor = slice(spans[0].start, spans[-1].stop)
        else:
            self.rows = torch.tensor([r for rows in spans for r in range(rows.start, rows.stop)], device=device)
        self.key_mask = None
        if any(hook.key_mask is not None for hook in self.hooks):
            self.key_mask = torch.cat([
                hook.key_mask if hook.key_mask is not None
                else torch.ones(rows.stop - rows.start, self.width, dtype=torch.bool, device=device)
                for hook, rows in zip(self.hooks, spans)])

    def _take(self, x: torch.Tensor) -> torch.Tensor:
        x = x[self.rows] if isinstance(self.rows, slice) else x.index_select(0, self.rows)
        return x if x.shape[2] == self.width else x[:, :, : self.width]

    def __call__(self, layer, q, k_pre, k, v) -> None:
        store = self.stores[0]
        keys = self._take(k)
        scores = None
        if store.needs_scores:
            seg = self.segments[0]
            scores = attention_scores(self._take(q)[:, :, seg.block_start:seg.block_end], keys, self.key_mask)
        store.write_batch(self.stores, layer, self._take(k_pre) if store.pre_rope_keys else keys, self._take(v),
                          self.segments, scores)


class ReuseRead:
    """KV hook of a cached step: the fresh window's K/V next to the reused K/V of the store.

    Args:
        store: the store written by this block's initial pass.
        segments: that pass's layout.
        rows: int64 ``[B_step]`` indices, into the rows of the initial pass, of the rows in this step (None = all).
        rope: the model's rotary embedding (to rotate pre-RoPE reused keys).
        reused_positions: int64 ``[B_step, T_reused]`` RoPE positions of the reused columns; needed (and only
            used) when the store keeps pre-RoPE keys.
    """

    def __init__(
        self, store: KVStore, segments: Segments, rows: torch.Tensor | None, rope: RotaryEmbedding,
        reused_positions: torch.Tensor | None,
    ) -> None:
        self.store, self.segments, self.rows, self.rope = store, segments, rows, rope
        self.reused_positions = reused_positions

    def __call__(self, layer, q, k_pre, k, v):
        fused = self.store.attend(layer, q, k, v, self.rows, self.reused_positions, self.rope)
        if fused is not None:  # the store attended straight from its packed cache: [B, H, T_w, D]
            return fused
        return self.store.window_kv(layer, k, v, self.segments, self.rows, self.reused_positions, self.rope)
