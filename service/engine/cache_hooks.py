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
