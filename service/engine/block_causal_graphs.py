"""LLaDA2's later steps at a bucket's shapes, over committed K/V at fixed addresses: what a CUDA graph replays
(issue 41, item 4; the LLaDA/Dream side is `service.engine.graphs`).

A later step of a block-causal row (cache mode ``block``, `service.engine.block_causal`) runs its active block
alone over its committed K/V: the call's window starts at its block (``Call.start == Call.block_start``). Its
forward writes the window's K/V nowhere that is read again: the block's first forward of the next block recomputes
the block before committing it (`Row.call`). So the step needs only to *read* each row's committed columns and to
attend them beside the window's fresh K/V, which is what :class:`GatheredCommitted` does in the place of
`CommittedKV.layer_kv`: every layer gathers the rows' ``[R, H_kv, key_len, D]`` keys and values from flat
``[N, D]`` buffers by an index it makes at layer 0 from an input tensor (each row's ``(start, columns)``, as
`service.engine.kv_pool.PooledReuse`), and copies the window's K/V over the window's columns (its positions).
The block-causal mask hides every column past a row's active block, so what the gathered buffer holds there (a
slot's later columns, the last column repeated past its capacity, a padded row's null vectors) gets no weight.

**Buckets.** Rows are padded up to the next of `service.engine.graphs.ROW_BUCKETS` (a padded row: token 0 at
positions ``0 .. W-1``, block length 1, reading the null row ``(0, 1)``; its logits are dropped) and the keys up to
a multiple of ``key_step``; the window is the widest block (not rounded: LLaDA2's blocks are the request's
``block_length``, a handful of values). A graph is keyed by (bucket, LM-head columns) and the pool's generation.

**Fixed addresses.** With capture on, every full-precision `CommittedKV` of a batch keeps its per-layer buffers in
the runner's `service.engine.kv_pool.KVPool`: a cache of B slots of ``capacity`` columns is one run of B rows
(:class:`RunLayers`: its layer views *are* the cache's ``[B, H_kv, capacity, D]`` buffers, so every eager forward
reads and writes them as before), and a later step reads the pool's buffers, which rows given by the input. A
cache holding packed rows (a quantized store, `service.quant.committed`) keeps its own buffers and its later steps
run eagerly, unpadded (pooling the packed codes is not done here).

**Which models.** On CUDA only where every MoE layer's ``grouped_mm`` runs CUDA's grouped kernel (:func:`can_graph`:
bfloat16 on compute capability 9 or 10); torch's fallback elsewhere reads its offsets on the host inside the op, so
those later steps run eagerly.

**Memory.** The graphs' private memory pools are `LaterSteps.bytes_held`, reserved and reported as the other
families' (the engine's one runner serves every family). The K/V pool holds each cache's slots exactly, but a
regroup (`BlockCausalBatch._cache_for`: rows that were not together in the last forward) makes the new cache's run
whole, every layer, beside the old caches' runs before they shrink, where the eager regroup copies one layer at a
time: for that moment the moved rows are held twice. `BlockCausalDecoder.cache_cost` counts a full-precision row's
layers twice when its decoder has the pool, so admission's bound holds (measured against the eager caches' peak:
`benchmarks/graph_keys.py --model llada2 --check`). A leaving request's slots are compacted in place (one layer's
copy at a time) and its run shrinks.

**On the CPU** (capture off) the same gather runs eagerly at the bucket's shapes over each cache's own buffers
(tests prove its tokens are the unpadded forward's); `service.engine.graphs.EagerGraphs` runs the pooled,
captured path with a stand-in per graph (`benchmarks/graph_keys.py --model llada2`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from service.engine.batch import Bucket
from service.engine.graphs import ROW_BUCKETS, round_up
from service.engine.kv_pool import KVPool, PoolRun, window_flat_index


class RunLayers(Sequence):
    """A pooled `CommittedKV`'s per-layer K (``which`` 0) or V (1) buffers: layer ``l`` is the pool's view of
    ``run`` in layer ``l``, ``[B, H_kv, capacity, D]``, looked up at each access (a run moves when the pool
    closes gaps; the view follows it)."""

    def __init__(self, pool: KVPool, run: PoolRun, which: int, layers: int) -> None:
        self.pool, self.run, self.which, self.layers = pool, run, which, layers

    def __len__(self) -> int:
        return self.layers

    def __getitem__(self, layer):
        if isinstance(layer, slice):
            return [self[i] for i in range(*layer.indices(self.layers))]
        if not -self.layers <= layer < self.layers:
            raise IndexError(layer)
        return self.pool.view(self.run, layer % self.layers)[self.which]


class GatheredCommitted:
    """The cache of a bucketed later step (module doc), in `CommittedKV`'s place for `LLaDA2Model.forward`.

    Args:
        buffers: layer -> its K and V as flat ``[N, D]`` buffers (the pool's, or a cache's own viewed flat).
        where: int64 ``[R, 2]``, each row's first vector and columns in them (a padded row: ``(0, 1)``).
        key_len: keys per row (the bucket's); heads: H_kv.
    """

    def __init__(self, buffers: Callable[[int], tuple[torch.Tensor, torch.Tensor]], where: torch.Tensor,
                 key_len: int) -> None:
        self.buffers, self.where, self.columns = buffers, where, key_len
        self.device = where.device
        self.scratch = self.on_write = None
        self._index = self._flat = None

    def graph_inputs(self) -> tuple[torch.Tensor, ...]:
        """The tensors a graph's replay refreshes (`LaterSteps.keyed`)."""
        return (self.where,)

    def layer_kv(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pre: torch.Tensor,
                 index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        """``CommittedKV.layer_kv`` without the write: the rows' committed K/V gathered, the window's K/V ``[R,
        H_kv, W, D]`` copied over its columns (``index``: the forward's positions, ``[R, H_kv, W, D]``); no bias."""
        r, h, _, d = k.shape
        if layer == 0:  # once per forward; every layer reads the same rows (a graph records it with the rest)
            column = torch.arange(self.columns, device=k.device)[None, None, :]
            start, length = self.where[:, 0, None, None], self.where[:, 1, None, None]
            head = torch.arange(h, device=k.device)[None, :, None]
            self._index = (start + head * length + torch.minimum(column, length - 1)).reshape(-1)
            self._flat = window_flat_index(index[:, :1, :, :1], h, self.columns)
        k_buf, v_buf = self.buffers(layer)
        kk, vv = (b.index_select(0, self._index) for b in (k_buf, v_buf))
        kk.index_copy_(0, self._flat, k.reshape(-1, d))
        vv.index_copy_(0, self._flat, v.reshape(-1, d))
        return kk.view(r, h, self.columns, d), vv.view(r, h, self.columns, d), None


def can_graph(model, runner) -> bool:
    """Whether ``runner`` (a `service.engine.graphs.LaterSteps`, or None) replays ``model``'s later steps from
    graphs: it captures on the model's device (`EagerGraphs`' stand-ins: any device), and on CUDA every MoE layer's
    ``grouped_mm`` takes CUDA's grouped kernel, which reads its group offsets on the device (bfloat16 on compute
    capability 9 or 10, `SparseMoE._grouped`'s strides); elsewhere torch's fallback copies the offsets to the host,
    which a capture forbids, and the later steps run eagerly, unpadded."""
    from service.engine.models.llada2 import SparseMoE

    device = model.embed.weight.device
    if runner is None or not runner.capture or not runner._can_capture(device):
        return False
    if device.type != "cuda":
        return True  # no capture happens there: the stand-ins run eagerly
    moes = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoE)]
    dtype = model.embed.weight.dtype
    probe = torch.empty((0, model.config.width), dtype=dtype)
    return not moes or (dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] in (9, 10)
                        and all(moe._grouped(probe) for moe in moes))


def is_later_step(calls: Sequence, cache, layers: tuple[int, int] | None) -> bool:
    """Whether a forward of ``calls`` over ``cache`` is a later step :func:`later_step` runs: every call's window
    is its active block, the whole model runs, and no hook reads the cache (no packed rows)."""
    return (layers is None and cache.scratch is None and cache.on_write is None and len(cache.k) > 0
            and all(c.start == c.block_start for c in calls))


def later_step(runner, model, ids: torch.Tensor, starts: list[int], blocks: torch.Tensor, at: torch.Tensor,
               cache) -> torch.Tensor:
    """The later step's logits ``[B, N, V]`` (float32) at ``at`` int64 ``[B, N]``, from the bucketed forward
    (module doc): replayed by ``runner`` (a `service.engine.graphs.LaterSteps`) when it captures and ``cache``
    lives in its pool, else run eagerly at the bucket's shapes over the cache's own buffers.

    Args:
        ids: int64 ``[B, W]``, each row's window (its active block, right-padded); starts: each row's first
            column; blocks: int64 ``[B]``, block lengths; cache: the rows' `CommittedKV`, slot ``i`` row ``i``.
    """
    b, w = ids.shape
    device = ids.device
    rows = next((n for n in ROW_BUCKETS if n >= b), b)
    bucket = Bucket(rows, w, round_up(max(starts) + w, runner.key_step))
    extra = rows - b
    pooled = runner.capture and isinstance(cache.k, RunLayers) and cache.k.pool is runner.pool
    slot = cache.k[0].shape[1] * cache.k[0].shape[2]  # vectors per slot (H_kv x capacity)
    first = cache.k.run.start if pooled else 0
    where = torch.tensor([(first + i * slot, cache.k[0].shape[2]) for i in range(b)] + [(0, 1)] * extra,
                         device=device)
    d = cache.k[0].shape[3]
    if pooled:
        source = runner.pool.buffers
    else:
        def source(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            return cache.k[layer].view(-1, d), cache.v[layer].view(-1, d)
    positions = torch.tensor(starts, device=device)[:, None] + torch.arange(w, device=device)
    if extra:
        ids = F.pad(ids, (0, 0, 0, extra))
        positions = torch.cat([positions, torch.arange(w, device=device).expand(extra, w)])
        blocks = F.pad(blocks, (0, extra), value=1)
        at = F.pad(at, (0, 0, 0, extra))
    inputs = {"input_ids": ids, "positions": positions, "block_length": blocks,
              "cache": GatheredCommitted(source, where, bucket.key_len)}
    if pooled:
        return runner.keyed(model, (bucket, at.shape[1]), inputs, at, b)
    runner.eager += 1
    return model(**inputs, logits_at=at)[:b]
