"""Later steps replayed from CUDA graphs (issue 41, item 4): the forward that repeats, captured once and replayed.

A later step of a running batch (a window pass of the dual or prefix cache, `service.engine.batch`) runs the same
operations every time with new values: the window's tokens and positions, the key mask, where the window's K/V
go, the rows whose reused K/V it reads, the columns the LM head reads. In eager mode a GPU pays a kernel launch
for each of its ~2,100-2,600 tensor operations (issue 41 measured 46 ms per iteration against a 3.4 ms weight read
at LLaDA-8B's shape); a captured CUDA graph launches them all at once. Fast-dLLM-style servers do the same: vLLM
captures full graphs over persistent buffers (its paged KV cache), SGLang one graph per batch size.

**Buckets.** A window group runs at its :class:`Bucket`'s shapes: rows rounded up to the next of
:data:`ROW_BUCKETS`, keys (the longest sequence + its spare column) up to a multiple of ``key_step``, the window
width up to a multiple of ``width_step`` (`service.engine.batch._inputs` pads them; a padded row's input is the
pad id at position 0, it sees only the spare key column, and its logits are dropped; padded key columns get no
weight). The LM head reads the columns it would eagerly, padded rows added; in a graph their count per row is
rounded up to a power of two (a shape of its own), the extra entries listed as padding.

**The pool: K/V at fixed addresses.** With capture on, the full-precision stores of a batch's cohorts keep their
K/V in :attr:`LaterSteps.pool` (`service.engine.kv_pool`: per layer one K and one V buffer, each store a run in
them, laid out as its own buffer was), and a graphed forward gathers its rows from those buffers by an index it
makes from an input tensor, each row's ``(start, T + 1)`` (`service.engine.kv_pool.PooledReuse`). So nothing a
graph reads depends on which requests run: a graph is keyed by its shape (bucket and LM-head columns) and the
pool's :attr:`~service.engine.kv_pool.KVPool.generation` (which changes only when the pool's buffers are made
anew: grown, or shrunk, "Memory"), and a
batch whose requests join and leave replays the graphs it has. Why a gather by index and not rows kept in the
first slots: the rows of one forward are the plan's passes in the plan's order (`service.runtime.scheduler`), and
several forwards read one pool in an iteration; an index costs one ``index_select`` per layer and tensor, the copy
the eager path's concatenation makes, and moves nothing when a row leaves. Why runs of each store's own length and
not slots of the longest: a slot pool holds every row at the longest length, over what admission counts.

**Capture (CUDA).** Graphs are captured lazily: the first forward of a shape runs eagerly, over the same pooled
inputs (its warm-up: RoPE's table for the bucket's length, the allocator, the libraries' kernels for those shapes),
the next forward of a key is captured and every later one replays (one eager forward per shape is the bounded
warm-up; a capture is one forward recorded and run once). The graph's persistent inputs are the forward's own
tensors of the capture (ids, positions, key mask, the window's destination columns, the rows' runs, the LM head's
columns): each replay copies the step's values into them; its outputs (the logits) are the graph's own buffer,
read by the reveal before the next replay. A group that reads anything else (a store of some rows only,
``Pass.selection``; quantized stores of several batch keys, or beside full-precision ones; a quantized store
whose layers are not pooled: KVQuant, a PyTorch-path store) runs eagerly, unpadded. LLaDA2's full-precision later
steps are graphed with the same pool and keys (:meth:`LaterSteps.keyed`; their bucketing and gather:
`service.engine.block_causal_graphs`); its quantized ones stay eager.

**Quantized later steps: the packed pool.** KIVI's and dLLM-KVQ's stores on the fused kernel's path (one launch
per layer for all their rows, `service.quant.kernels.attention`) read packed tensors of their own, which eagerly
are concatenated at every later step (`service.quant.kernels.parts.stores_side_by_side`): addresses that change
with the set of stores. With capture on they hold them in :attr:`KVPool.packed`
(`service.engine.packed_pool`): one buffer per packed tensor name and layer (the K and V code streams in int32
words, K's statistics per group, V's per slot, dLLM-KVQ's protected K rows and ``k_row``, the block's
``group_of_slot`` and ``slot_of``), each store a run sized by its layout at its block-initial write (a new block
takes new runs: prefix mode's reused length grows block by block), and what the store holds are views of its
runs, so its eager paths read the same values. A graphed forward of such stores attends through
`service.quant.pooled.PooledPacked`: per layer one launch over the pool's buffers, each row's part of the
kernel's table (its window width, reused length, first slot, K group and protected row, the byte offsets of its
K and V streams: the runs' starts) an int32 input ``[L, R, PART_INFO]`` and each row's first ``slot_of`` entry an
int32 input ``[R]``, both copied in before the replay; a padded row is an empty part (width 1, reused length 0);
the launch's window width and tile length are the bucket's. The kernel's indices stay local to each part, so the
values read are the ones the eager launch reads. So such a graph too is keyed by its shape and the pools'
generations (:attr:`LaterSteps.generation`).

**Memory.** Each graph keeps a private memory pool (the forward's intermediates at the bucket's shapes);
:attr:`LaterSteps.bytes_held` is their sum (CUDA's reserved bytes before and after each capture), which the
server reserves out of its KV budget (``DLLM_CUDA_GRAPH_BYTES``) and reports. At most ``max_graphs`` graphs are
kept (least recently used first out), and none is captured past ``max_bytes``. The K/V pool holds exactly the runs
admission counted for its requests, its buffers at most ``max_tokens`` tokens unless admission asks for more
(`service.engine.kv_pool`, "Memory"); the packed pool's runs hold the stores' packed tensors (what admission
measured for their configuration) and the kernel's int32 maps (`service.engine.packed_pool`, "Memory"). Before
each window forward both pools shrink when their live runs fill less than a quarter of them
(:meth:`KVPool.shrink`, :meth:`~service.engine.packed_pool.PackedPool.shrink`: a new generation), and what they
hold past their live runs (:attr:`LaterSteps.unused_bytes`) admission counts beside the running requests
(`service.runtime.loop.Worker`, ``pool_slack``).

**On the CPU** (or with capture off) :class:`LaterSteps` runs the same padding eagerly, with no pool: the tests
prove that the bucketed, padded forward gives the tokens of the unpadded one (`tests/engine/test_graphs.py`), and
:class:`EagerGraphs` runs the pooled, captured path with a stand-in for each graph, so its keys are counted on the
CPU (`benchmarks/graph_keys.py`; quantized stores under Triton's interpreter, `tests/engine/test_packed_pool.py`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from service.engine.batch import Bucket, _inputs, run_forward
from service.engine.decode import Pass
from service.engine.kv_pool import KVPool
from service.engine.models import DiffusionLM
from service.engine.packed_pool import PackedPool

#: Row counts a later-step forward is padded up to (the largest: rows beyond it run at their own count).
ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


def round_up(n: int, step: int) -> int:
    """``n`` rounded up to a multiple of ``step`` (both >= 1)."""
    return -(-n // step) * step


def bucket_of(group: list[Pass], key_step: int = 256, width_step: int = 32) -> Bucket:
    """The bucket of a window group (module doc): rows up to the next of :data:`ROW_BUCKETS` (or their own count
    past the largest), the widest pass up to a multiple of ``width_step``, the longest sequence + 1 up to a
    multiple of ``key_step``."""
    rows = sum(len(p.rows) for p in group)
    rows = next((b for b in ROW_BUCKETS if b >= rows), rows)
    width = round_up(max(p.width for p in group), width_step)
    return Bucket(rows, width, round_up(max(p.seq_len for p in group) + 1, key_step))


def graphable(group: list[Pass], pool: KVPool | None) -> bool:
    """Whether a captured graph can run ``group``: a window group over every layer whose every pass reads all the
    rows of a store held in ``pool``: full-precision stores in its runs, or quantized stores of one fused batch key
    in its packed pool (module doc)."""
    if pool is None or group[0].kind != "window" or group[0].layers is not None or any(
            p.selection is not None for p in group):
        return False
    if all(p.hook is None and getattr(p.cohort.store, "pool", None) is pool and p.cohort.store.run is not None
           for p in group):
        return True
    stores = [p.cohort.store for p in group]
    if pool.packed is None or not all(getattr(s, "pooled_in", None) is not None and s.pooled_in(pool.packed)
                                      for s in stores):
        return False
    device = group[0].input_ids.device
    key = stores[0].batch_key(0, device)
    return key is not None and all(s.batch_key(0, device) == key for s in stores[1:])


@dataclass
class _Graph:
    """One captured forward: the graph, its input tensors (filled before each replay) and its logits."""

    graph: torch.cuda.CUDAGraph
    inputs: dict
    logits_at: torch.Tensor
    logits: torch.Tensor
    bytes: int
    #: RoPE's table the graph reads (`RotaryEmbedding.table`): kept alive should a longer sequence replace it.
    table: tuple


class LaterSteps:
    """The later-step forward of a running batch, bucketed and (on CUDA, with ``capture``) replayed from a graph
    per shape (module doc). Called as `service.engine.batch.run_forward` is (its drop-in
    `RunningBatch.forward_call`); groups that are not window groups run through ``run_forward`` unchanged.

    Args:
        capture: capture and replay CUDA graphs (only on CUDA tensors), with the stores' K/V in :attr:`pool`;
            False: pad and run eagerly, no pool.
        key_step, width_step: the buckets' key and width steps (:func:`bucket_of`).
        max_graphs: graphs kept at most; max_bytes: no capture once the graphs hold this many bytes.
        max_tokens: the tokens the pool's buffers grow to unasked (`service.engine.kv_pool.KVPool`; None: no limit).

    Attributes:
        pool: the K/V pool of the batches' full-precision stores, its ``packed`` pool the quantized stores' (None
            without ``capture``).
        captures, replays, eager: counts of forwards captured, replayed, run eagerly (padded or not).
    """

    def __init__(self, capture: bool, key_step: int = 256, width_step: int = 32, max_graphs: int = 32,
                 max_bytes: int = 4 << 30, max_tokens: int | None = None) -> None:
        if key_step < 1 or width_step < 1 or max_graphs < 1 or max_bytes < 0:
            raise ValueError("key_step, width_step and max_graphs are >= 1 and max_bytes >= 0, got "
                             f"{key_step}, {width_step}, {max_graphs}, {max_bytes}")
        self.capture, self.key_step, self.width_step = capture, key_step, width_step
        self.max_graphs, self.max_bytes = max_graphs, max_bytes
        self.pool = KVPool(max_tokens) if capture else None
        if self.pool is not None:
            self.pool.packed = PackedPool()
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self._seen: set[tuple] = set()
        self.captures = self.replays = self.eager = 0

    @property
    def bytes_held(self) -> int:
        """Bytes the kept graphs' memory pools hold (CUDA's reserved bytes each capture added)."""
        return sum(g.bytes for g in self._graphs.values())

    @property
    def unused_bytes(self) -> int:
        """Bytes the pools hold beyond their live runs (freed runs' space, module doc "Memory"; 0 without a
        pool): what admission counts beside the running requests' costs."""
        return sum(p.bytes_held - p.live_bytes for p in self._pools())

    def _pools(self) -> list:
        """The K/V pool and its packed pool, those there are (none without ``capture``)."""
        return [p for p in (self.pool, getattr(self.pool, "packed", None)) if p is not None]

    def __call__(self, model: DiffusionLM, group: list[Pass], pad_id: int, columns: list[list[int]] | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if group[0].kind != "window" or group[0].layers is not None:
            return run_forward(model, group, pad_id, columns)
        if self.pool is not None:  # between forwards: give back what freed runs left (module doc, "Memory")
            for pool in self._pools():
                pool.shrink()
        bucket = bucket_of(group, self.key_step, self.width_step)
        capturing = self.capture and self._can_capture(group[0].input_ids.device)
        if not (capturing and graphable(group, self.pool)):
            self.eager += 1
            if capturing:  # not graphable: as without graphs
                return run_forward(model, group, pad_id, columns)
            return run_forward(model, group, pad_id, columns, bucket)
        return self._replayed(model, group, pad_id, bucket, columns)

    @staticmethod
    def _can_capture(device: torch.device) -> bool:
        """Whether forwards on ``device`` can be captured (CUDA)."""
        return device.type == "cuda"

    @property
    def generation(self) -> tuple[int, int]:
        """The pools' generations (K/V, packed): a graph reads the buffers of its own."""
        packed = self.pool.packed
        return self.pool.generation, packed.generation if packed is not None else 0

    def _drop_stale(self) -> None:
        """Forget the graphs captured over the pools' buffers before they were made anew (module doc)."""
        for key in [k for k in self._graphs if k[1] != self.generation]:
            del self._graphs[key]
        if len(self._seen) > 4 * self.max_graphs:
            self._seen.clear()

    def _replayed(self, model: DiffusionLM, group: list[Pass], pad_id: int, bucket: Bucket,
                  columns: list[list[int]] | None):
        self._drop_stale()
        at = self._at(group, group[0].input_ids.device)
        head_at, listed = self._head_columns(group, at, columns)
        rows = at.shape[0]
        shape = (bucket, head_at.shape[1])
        key = (shape, self.generation)
        found = self._graphs.get(key)
        if found is None:
            inputs = _inputs(model, group, pad_id, bucket, self.pool)
            logits_at = F.pad(head_at, (0, 0, 0, bucket.rows - rows))
            if shape not in self._seen or self.bytes_held >= self.max_bytes:
                self._seen.add(shape)  # a shape's first forward: the eager warm-up
                self.eager += 1
                return model(**inputs, logits_at=logits_at)[:rows], inputs["input_ids"][:rows].gather(1, at), listed
            table = model.rope.table(bucket.key_len, logits_at.device)
            graph, logits, held = self._record(model, inputs, logits_at)
            graph.replay()  # the capture records without running: this step's values
            self.captures += 1
            found = self._graphs[key] = _Graph(graph, inputs, logits_at, logits, held, table)
            while len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
            fresh = _inputs(model, group, pad_id, bucket, self.pool)
            for name in ("input_ids", "positions", "key_mask"):
                found.inputs[name].copy_(fresh[name])
            for held, new in zip(found.inputs["kv_hook"].inputs(), fresh["kv_hook"].inputs()):
                held.copy_(new)
            found.logits_at[:rows].copy_(head_at)
            found.graph.replay()
            self.replays += 1
        return found.logits[:rows], found.inputs["input_ids"][:rows].gather(1, at), listed

    def keyed(self, model: DiffusionLM, shape: tuple, inputs: dict, logits_at: torch.Tensor, rows: int,
              ) -> torch.Tensor:
        """A forward at ``shape``'s shapes over the pool, replayed from a graph keyed by ``shape`` and the pools'
        generations, with the warm-up and capture of :meth:`_replayed` (LLaDA2's later steps,
        `service.engine.block_causal_graphs`): ``inputs`` are the model's keyword arguments, every tensor (and
        every tensor an object's ``graph_inputs()`` names) an input a replay refreshes; the logits of the first
        ``rows`` rows come back (the graph's own buffer, valid until its next replay)."""
        self._drop_stale()
        key = (shape, self.generation)
        found = self._graphs.get(key)
        if found is None:
            if shape not in self._seen or self.bytes_held >= self.max_bytes:
                self._seen.add(shape)  # a shape's first forward: the eager warm-up
                self.eager += 1
                return model(**inputs, logits_at=logits_at)[:rows]
            graph, logits, held = self._record(model, inputs, logits_at)
            graph.replay()  # the capture records without running: this step's values
            self.captures += 1
            found = self._graphs[key] = _Graph(graph, inputs, logits_at, logits, held, ())
            while len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)
            return found.logits[:rows]
        self._graphs.move_to_end(key)
        for name, value in inputs.items():
            held = found.inputs[name]
            if isinstance(value, torch.Tensor):
                held.copy_(value)
            elif hasattr(value, "graph_inputs"):
                for mine, fresh in zip(held.graph_inputs(), value.graph_inputs()):
                    mine.copy_(fresh)
        found.logits_at.copy_(logits_at)
        found.graph.replay()
        self.replays += 1
        return found.logits[:rows]

    @staticmethod
    def _at(group: list[Pass], device) -> torch.Tensor:
        """Each real row's reveal columns in the input, ``[R, reveal]`` (as `run_forward` makes them)."""
        reveal = max(p.reveal_width for p in group)
        cols = torch.arange(reveal, device=device)[None, :]
        last = torch.tensor([p.reveal_width - 1 for p in group for _ in p.rows], device=device)[:, None]
        offsets = torch.tensor([p.logits_offset for p in group for _ in p.rows], device=device)[:, None]
        return torch.minimum(cols, last) + offsets

    @staticmethod
    def _head_columns(group: list[Pass], at: torch.Tensor, columns: list[list[int]] | None,
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The input columns the LM head reads, int64 ``[R, M]``, and the window columns they are (None: every
        reveal column, ``at`` itself), as `run_forward` makes them from ``columns`` but with M rounded up to a
        power of two (at most the reveal width), so that one graph serves every step whose longest list fits:
        the extra entries repeat a row's last column and are listed as padding (the reveal width)."""
        if columns is None:
            return at, None
        reveal = at.shape[1]
        most = min(reveal, 1 << (max(len(c) for c in columns) - 1).bit_length())
        offsets = [p.logits_offset for p in group for _ in p.rows]
        both = torch.tensor([[c + [reveal] * (most - len(c)) for c in columns],
                             [[j + o for j in c + [c[-1]] * (most - len(c))] for c, o in zip(columns, offsets)]],
                            device=at.device)
        return both[1], both[0]

    @staticmethod
    def _record(model: DiffusionLM, inputs: dict, logits_at: torch.Tensor):
        """Capture ``model(**inputs, logits_at=logits_at)`` as a CUDA graph: (the graph, its logits, the bytes its
        private memory pool took, CUDA's reserved bytes before and after)."""
        device = logits_at.device
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_reserved(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # a private pool per graph: dropping the graph frees it
            logits = model(**inputs, logits_at=logits_at)
        return graph, logits, max(0, torch.cuda.memory_reserved(device) - before)


class _StandIn:
    """A captured graph's stand-in where none can be captured: its replay runs the captured call again over the
    same input tensors (what a CUDA graph's replay reads) and writes the same output tensor."""

    def __init__(self, model: DiffusionLM, inputs: dict, logits_at: torch.Tensor) -> None:
        self.model, self.inputs, self.logits_at = model, inputs, logits_at
        self.logits = model(**inputs, logits_at=logits_at)

    def replay(self) -> None:
        self.logits.copy_(self.model(**self.inputs, logits_at=self.logits_at))


class EagerGraphs(LaterSteps):
    """:class:`LaterSteps` with capture on, on any device, its graphs :class:`_StandIn` stand-ins: the pool, the
    keys, the warm-ups, the persistent inputs refreshed before each replay and the graphs dropped when the pool
    grows run on the CPU (tests; ``captures`` counts the keys a GPU would capture, `benchmarks/graph_keys.py`)."""

    def __init__(self, key_step: int = 256, width_step: int = 32, max_graphs: int = 32,
                 max_tokens: int | None = None) -> None:
        super().__init__(capture=True, key_step=key_step, width_step=width_step, max_graphs=max_graphs,
                         max_tokens=max_tokens)

    @staticmethod
    def _can_capture(device: torch.device) -> bool:
        return True

    @staticmethod
    def _record(model: DiffusionLM, inputs: dict, logits_at: torch.Tensor):
        graph = _StandIn(model, inputs, logits_at)
        return graph, graph.logits, 0
