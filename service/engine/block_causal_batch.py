"""The running batch of a block-causal family (LLaDA2.x): requests join and leave between iterations; each
request's live rows make one pass per iteration, and the caller's plan groups the passes into forwards.

The runtime's loop (`service.runtime.loop`) drives it through the one running-batch protocol
(`service.engine.protocol.DecodeBatch`: ``passes``, ``run``, ``leave``, ``preemptible``, ``preempt``, ``resume``,
``failed``, ``forwards``, ``rows``); `service.engine.Engine` hands it out through the family's decoder
(:class:`BlockCausalDecoder`). Each row is a `service.engine.block_causal.Row`: the reference loop as a
generator that yields each forward's window and reveal rule and is sent its active block after the reveal, so a
row decodes token for token as it would alone whatever else is in the batch. Every row's reveal in a forward runs
on the device at once (`service.engine.block_causal.reveal_rows`) and is read back in one host read per forward;
the rows' sequences and their bookkeeping live on the host. K/V live in `CommittedKV` caches, a slot per row of a
forward (:class:`BlockCausalBatch`, "Caches").

Departures from `RunningBatch`: a forward's rows' windows are right-padded together whatever their kinds (a
pass is ``full`` when one of its rows commits columns); no pass is split by layers. A grammar-constrained row (structured output, tool
calls) reveals by its grammar's chain (`service.engine.block_causal.step_rows`) and never edits; a row that asks
for log-probabilities gets each token's as the forward that last wrote it gave it (a second host read, only
when such a row is in the forward). A quantized row's committing-block write checks are put off
(`service.engine.kv_store.DEFER_WRITE_CHECKS`) and their verdicts join the reveal's read
(`service.quant.committed.CommitWriter`); a row whose verdict is False runs its forward again alone with each
check read at once, and its request fails alone with what that raises (a false alarm, which raises nothing, goes
on with the reveal it had).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from service.engine.block_causal import (
    BlockCausalParams,
    BlockCausalResult,
    Call,
    ChecksFailed,
    Row,
    step_rows,
)
from service.engine.block_causal_graphs import RunLayers, can_graph
from service.engine.decode import CommittedIds, _row_generator
from service.engine.errors import EngineInputError
from service.engine.kv_store import DEFER_WRITE_CHECKS
from service.engine.models.llada2 import CommittedKV, LLaDA2Model
from service.engine.params import EDITING_FIELDS, RENOISING_FIELDS, DecodeParams, RowOptions
from service.engine.prefix_cache import Namespace, PrefixCache, PrefixHit, prefix_label
from service.engine.protocol import (
    CacheCost,
    Capabilities,
    SettingRule,
    after_iteration,
    honoured,
    only,
    refused_all,
)
from service.engine.report import DecodeReport, RowReport, Timings
from service.engine.response import cut_response


def settings_from(params: DecodeParams, options: RowOptions, editing: bool) -> BlockCausalParams:
    """The block-causal settings of a request made with the other families' settings.

    ``threshold`` as given, every position revealable in one step (steps per block = block length, the reference
    default for blocks of 32); a fixed schedule of ``steps`` over the response blocks: ``steps / blocks`` per block
    and no threshold; ``prefix``/``dual`` decode in ``block``; token editing (``editing``: the checkpoint is
    LLaDA2.1) with the reference's defaults, or with the editing settings given (`EDITING_FIELDS`), which turn it
    on for any LLaDA2 checkpoint as ``generate``'s flags do (`service.commands._block_causal`).
    """
    blocks = max(1, params.gen_length // params.block_length)
    steps = params.block_length if params.steps is None else max(1, params.steps // blocks)
    given = {name: getattr(params, name) for name in EDITING_FIELDS if getattr(params, name) is not None}
    return BlockCausalParams(
        gen_length=params.gen_length, block_length=params.block_length, steps=steps,
        threshold=math.inf if params.threshold is None else params.threshold,
        cache_mode="none" if params.cache_mode == "none" else "block", editing=editing or bool(given),
        temperature=options.temperature, **given,
    )


class NoStore:
    """The K/V store slot of a block-causal cohort: its K/V live in the batch's cache (nothing to report)."""

    def clear(self) -> None:
        """Nothing held outside the batch."""

    def report(self) -> None:
        """No quantized store: no KV report."""

    def commit(self, slot: int, start: int, end: int, block: int, row: int = 0) -> None:
        """Nothing to quantize: committed blocks stay as written."""


class BlockCausalCohort:
    """One request's rows (its ``n`` choices, or the rows of `generate_batch`): settings, state, callbacks.

    Args:
        model: the loaded model. prompts: token ids per row. settings: one :class:`BlockCausalParams` per row.
        mask_id, eos_ids: the model's. rows: per-row options (sampling seed; stop strings and ``max_tokens`` for
        the report). params: the request's settings as made (for the report; None: the rows' own). on_block:
        ``on_block(block, ids_per_row)`` each time every live row has decoded one more block. cancelled: per-row
        flags, polled after each iteration. kv_store: a `QuantizedKVStore` quantizes the rows' committed blocks
        in ``block`` mode with its quantizer and counts them in its report (`service.quant.committed`); None or
        another store: full precision. banned_ids: ids a constrained row never chooses (the model's
        `ModelSpec.banned_ids`; default the mask id).

    Raises:
        EngineInputError: an empty prompt or one holding the mask id.
    """

    def __init__(self, model: LLaDA2Model, prompts: list[list[int]], settings: list[BlockCausalParams],
                 mask_id: int, eos_ids: tuple[int, ...], rows: list[RowOptions] | None = None,
                 params: DecodeParams | None = None, on_block: Callable | None = None,
                 cancelled: Callable[[], list[bool]] | None = None, kv_store: object | None = None,
                 banned_ids: tuple[int, ...] | None = None) -> None:
        rows = rows if rows is not None else [RowOptions() for _ in prompts]
        if len(settings) != len(prompts) or len(rows) != len(prompts):
            raise EngineInputError(f"{len(settings)} settings and {len(rows)} row options for {len(prompts)} "
                                   "prompts; give one per prompt")
        device = model.embed.weight.device
        self.kv_dtype = model.embed.weight.dtype
        self.banned = torch.tensor(banned_ids if banned_ids is not None else (mask_id,), dtype=torch.long,
                                   device=device)
        self.params, self.eos_ids, self.row_options = params, tuple(eos_ids), rows
        self.on_block, self.cancelled = on_block, cancelled
        # A quantized store (`service.quant.store.QuantizedKVStore`) quantizes the committed blocks (its `commit`);
        # any other store slot holds nothing outside the batch's cache.
        self.store = kv_store if callable(getattr(kv_store, "commit", None)) else NoStore()
        self.rows = [Row(prompt, s, mask_id, eos_ids, _generator(o, device),
                         o.grammar.start(o.max_tokens, s.gen_length) if o.grammar is not None else None, o.logprobs)
                     for prompt, s, o in zip(prompts, settings, rows)]
        self.status = ["running"] * len(prompts)
        self.results: list[BlockCausalResult | None] = [None] * len(prompts)
        self.programs = [row.decode() for row in self.rows]
        self.calls: dict[int, Call] = {}
        self.started_s = time.perf_counter()
        self.finished_s: float | None = None
        self.first_block_s = 0.0
        self._emitted = 0
        # The prefix cache (`service.engine.prefix_cache`): per row, its hit (referenced until the cohort leaves);
        # the rows looked up; the rows whose whole prompt blocks go into the cache after their first forward.
        self.prefix_hits: dict[int, PrefixHit] = {}
        self._looked_up: set[int] = set()
        self._adopted: set[int] = set()
        self._to_insert: set[int] = set()
        for i in range(len(self.rows)):
            self.advance(i, None)

    @property
    def done(self) -> bool:
        """No row decodes any more."""
        return not self.calls

    def advance(self, i: int, revealed: tuple[list[int], list[int]] | None) -> None:
        """Send row ``i`` its forward's reveal (its block's ids and the written offsets; None: start it); record
        its next call, or its result when it is done."""
        try:
            self.calls[i] = self.programs[i].send(revealed)
        except StopIteration as finished:
            self.calls.pop(i, None)
            self.results[i] = finished.value
            self.status[i] = finished.value.finish_reason
            if self.done:
                self.finished_s = time.perf_counter()

    def poll_cancelled(self) -> None:
        """Rows whose flag is set stop now (their status ``cancelled``)."""
        flags = self.cancelled() if self.cancelled is not None else []
        for i, flag in enumerate(flags):
            if flag and i in self.calls:
                self.calls.pop(i)
                self.programs[i].close()
                self.status[i] = "cancelled"
        if self.done and self.finished_s is None:
            self.finished_s = time.perf_counter()

    def emit_blocks(self) -> None:
        """Call ``on_block`` for each block that every live row has now decoded."""
        live = [i for i, s in enumerate(self.status) if s != "cancelled"]
        ends = [row.decoded_end if i in self.calls else math.inf for i, row in enumerate(self.rows) if i in live]
        first = min(row.prompt_length for row in self.rows) // self.rows[0].block
        blocks = min(ends, default=math.inf)
        count = (len(range(first, self.rows[0].num_blocks)) if blocks == math.inf
                 else int(blocks) // self.rows[0].block - first)
        if count > self._emitted and self._emitted == 0:
            self.first_block_s = time.perf_counter() - self.started_s
        if self.on_block is not None:
            for block in range(self._emitted, count):
                end = None if blocks == math.inf else int(blocks)
                self.on_block(block, [self._committed(i, end) for i in range(len(self.rows))])
        self._emitted = max(self._emitted, count)

    def _committed(self, i: int, end: int | None) -> CommittedIds:
        """Row ``i``'s committed ids before column ``end`` for ``on_block``, with their log-probabilities when it
        asked for them."""
        ids = CommittedIds(self._ids(i, end))
        ids.logprobs = self.rows[i].response_logprobs(len(ids))
        return ids

    def _ids(self, i: int, end: int | None) -> list[int]:
        """Row ``i``'s response ids before column ``end`` (its whole result once it is done)."""
        if self.results[i] is not None:
            return self.results[i].generated_ids
        return self.rows[i].response(end)

    def report(self, decode_text: Callable[[list[int]], str | None]) -> DecodeReport:
        """The :class:`DecodeReport` of this cohort (ids cut by `service.engine.response.cut_response`)."""
        end = self.finished_s or time.perf_counter()
        total = end - self.started_s
        reports = []
        for i, options in enumerate(self.row_options):
            row = self.rows[i]
            ids = self.results[i].generated_ids if self.results[i] is not None else row.response()
            ignore_eos = self.params.ignore_eos if self.params is not None else False
            cut = cut_response(ids, self.eos_ids, ignore_eos, options.max_tokens, options.stop, decode_text)
            reports.append(RowReport(
                generated_ids=cut.ids, text=cut.text,
                finish_reason="cancelled" if self.status[i] == "cancelled" else cut.finish_reason,
                nfe=row.nfe, steps_per_block=[], reveals_per_step=row.reveals,
                tokens_per_second=len(cut.ids) / total if total > 0 else 0.0,
                logprobs=row.response_logprobs(len(cut.ids)),
            ))
        return DecodeReport(rows=reports, params=self.params,
                            timings=Timings(total_s=total, first_block_s=self.first_block_s), kv=self.store.report())

    def packs(self, i: int) -> bool:
        """Row ``i``'s committed blocks are held packed by the request's quantized store (``block`` mode)."""
        return not isinstance(self.store, NoStore) and self.rows[i].params.cache_mode == "block"

    def commit(self, i: int, slot: int) -> Any:
        """Row ``i``'s packed committed blocks and the columns it commits in its next call (cache slot ``slot``),
        a `service.quant.committed.Commit`; None when the row is not held packed (:meth:`packs`). A row whose
        prompt blocks go into the prefix cache packs them one block at a time (``pieces``)."""
        if not self.packs(i):
            return None
        call, row = self.calls[i], self.rows[i]
        commit = self.store.commit(slot, call.start, call.block_start, row.block, i)
        return dataclasses.replace(commit, pieces=row.block) if i in self._to_insert else commit

    # ---- the prefix cache (`service.engine.prefix_cache`) -------------------------------------------------------
    def prefix_namespace(self, i: int, model: str) -> Namespace | None:
        """What row ``i``'s cached blocks are keyed under (model fingerprint ``model``, dtype, block length, KV
        configuration), or None when the row cannot use the cache: cache mode ``none``, or a quantized store
        whose blocks quantized one by one would not be the codes the row makes (`KVQuantizer.block_separable`:
        dLLM-KVQ's scores read the active block's queries; K groups crossing a block)."""
        row = self.rows[i]
        if row.params.cache_mode != "block":
            return None
        dtype = f"{self.banned.device.type}:{self.kv_dtype}"
        if not self.packs(i):
            return Namespace(model, dtype, row.block, "none", prefix_label(None))
        quantizer = self.store.quantizer
        if not quantizer.block_separable(row.block):
            return None
        config = quantizer.config
        return Namespace(model, dtype, row.block, f"{config.model_dump_json()}|{self.store.artifact_id}",
                         prefix_label(config))

    def look_up_prefix(self, i: int, cache: PrefixCache, model: str) -> None:
        """Before row ``i``'s first forward (once): its longest cached run of whole prompt blocks; its first call
        then starts after them, and its own whole prompt blocks after them are inserted after that forward."""
        if i in self._looked_up:
            return
        self._looked_up.add(i)
        row, call = self.rows[i], self.calls.get(i)
        whole = row.prompt_length // row.block
        namespace = self.prefix_namespace(i, model)
        if call is None or namespace is None or call.start != 0 or row.nfe != 1 or whole == 0:
            return
        hit = cache.lookup(namespace, row.x[: row.prompt_length], whole)
        self.prefix_hits[i] = hit
        self.calls[i] = dataclasses.replace(call, start=hit.tokens)  # the committed pass runs over the rest
        if len(hit.blocks) < whole:
            self._to_insert.add(i)

    def adopt_prefix(self, i: int, slot: int, kv: CommittedKV, commit: Any, cache: PrefixCache | None = None,
                     ) -> None:
        """Row ``i``'s cached blocks into its first forward: the packed layers into its held blocks, joined into
        one run per layer (`KVQuantizer.concat`, made once per chain for every row reading it,
        `PrefixCache.joined`; read-only) and counted block by block in its accounting (a quantized row), or the
        K/V copied into its cache slot ``slot``."""
        hit = self.prefix_hits.get(i)
        if hit is None or not hit.blocks or hit.released or i in self._adopted:
            return  # (a preempted row gave its hit back: it resumes from column 0)
        self._adopted.add(i)  # once: a packed row's held blocks must not take them twice
        block = self.rows[i].block
        if commit is not None:
            for layer in range(len(hit.blocks[0].payload)):
                parts = [cached.payload[layer] for cached in hit.blocks]
                for part in parts:
                    commit.accounting.add(layer, part)
                run = None
                if cache is not None:
                    run = cache.joined(hit, layer, lambda parts=parts: commit.quantizer.concat(parts))
                if run is not None:
                    commit.held.add(layer, 0, hit.tokens, run)
                else:
                    for b, part in enumerate(parts):
                        commit.held.add(layer, b * block, (b + 1) * block, part)
            return
        for b, cached in enumerate(hit.blocks):
            start, end = b * block, (b + 1) * block
            for layer, payload in enumerate(cached.payload):
                kv.k[layer][slot, :, start:end] = payload[0]
                kv.v[layer][slot, :, start:end] = payload[1]

    def insert_prefix(self, i: int, slot: int, kv: CommittedKV, commit: Any, cache: PrefixCache) -> None:
        """After row ``i``'s first forward: its whole prompt blocks past its hit into the cache (per layer the
        packed run its store holds, or a copy of its K/V ``[H_kv, block, D]``)."""
        if i not in self._to_insert:
            return
        self._to_insert.discard(i)
        row, hit = self.rows[i], self.prefix_hits[i]
        blocks = []
        packed = ({layer: {start: p for start, _, p in runs} for layer, runs in commit.held.layers.items()}
                  if commit is not None else None)
        for b in range(len(hit.blocks), row.prompt_length // row.block):
            start, end = b * row.block, (b + 1) * row.block
            if packed is not None:
                payload = tuple(packed[layer][start] for layer in sorted(packed))
                nbytes = sum(p.nbytes + p.derived_nbytes for p in payload)
            else:
                payload = tuple((kv.k[layer][slot, :, start:end].clone(), kv.v[layer][slot, :, start:end].clone())
                                for layer in range(len(kv.k)))
                nbytes = sum(t.numel() * t.element_size() for pair in payload for t in pair)
            blocks.append((row.x[start:end], payload, nbytes))
        cache.insert(hit, blocks)
        if commit is not None:  # its own blocks, packed one by one for the cache, read as one run from now on
            for layer in commit.held.layers:
                commit.held.merge(layer, commit.start, commit.end)

    def release_prefix(self, cache: PrefixCache | None) -> None:
        """Give back the cached blocks this cohort read (it left the batch)."""
        if cache is None:
            return
        for hit in self.prefix_hits.values():
            cache.release(hit)
        self._to_insert.clear()


#: What the block-causal family can do: its forwards are the plan's (bounded by ``max_batched_tokens``), a wide
#: pass that commits columns is split by layers (not a row whose store packs committed blocks), and it is
#: preempted by recompute at a block boundary; no likelihood.
CAPABILITIES = Capabilities(likelihood=False, layer_split=True, preemption=True, plan_bounded=True,
                            cache_kind="committed", mask_kind="block_causal")

#: How LLaDA2 serves each `DecodeSettings` field (`settings_from` maps them to `BlockCausalParams`).
SETTINGS: dict[str, SettingRule] = {
    "cache_mode": honoured("none recomputes; prefix, dual and block decode with the append-only cache of "
                           "committed blocks"),
    "block_length": honoured("the reference's block_length"),
    "threshold": honoured("the reference's threshold; every position revealable in one step"),
    "steps": honoured("a fixed schedule of steps / blocks per block, no threshold"),
    "remasking": only(("low_confidence",), "the reference reveals by confidence only"),
    "ignore_eos": only((False,), "the reference loop ends a response after the block holding its EOS"),
    "dream_schedule": only(("origin",), "dream_schedule is a Dream setting (its schedule with cache mode none)"),
    "editing_threshold": honoured("LLaDA2.1's token editing: a revealed token is replaced when another is this "
                                  "confident; given on a 2.0 checkpoint, it turns editing on"),
    "max_post_steps": honoured("LLaDA2.1's token editing: most editing steps after a block is fully revealed"),
    "min_transfer": honoured("LLaDA2.1's token editing: fewest tokens revealed or edited a step"),
    **refused_all(RENOISING_FIELDS, "a DiffusionGemma setting: this family unmasks, it does not renoise"),
}


class BlockCausalDecoder:
    """The `service.engine.protocol.FamilyDecoder` of a block-causal family (LLaDA2.x).

    Args:
        model: the loaded model; spec: its `ModelSpec`.
    """

    capabilities = CAPABILITIES
    settings = SETTINGS

    def __init__(self, model: LLaDA2Model, spec: Any) -> None:
        self.model, self.spec, self.family = model, spec, spec.arch
        #: The later steps' runner of the batches made from now on (`service.engine.graphs.LaterSteps`: CUDA graphs
        #: of the full-precision later steps, `service.engine.block_causal_graphs`; None: eager, unpadded).
        self.later_steps = None
        #: The prefix cache across requests its batches share (`service.engine.prefix_cache`; set through
        #: `service.engine.Engine.prefix_cache`); None: none. A block-causal family's hook (DiffusionGemma's too).
        self.prefix_cache: PrefixCache | None = None

    def batch(self, plan: Any = None) -> BlockCausalBatch:
        """An empty :class:`BlockCausalBatch`; ``plan`` groups :meth:`BlockCausalBatch.step`'s passes into
        forwards; its requests read and fill :attr:`prefix_cache`, keyed under the weights' fingerprint."""
        return BlockCausalBatch(self.model, plan, self.prefix_cache, self.spec.fingerprint, self.later_steps)

    def cohort(self, prompts: list[list[int]], params: DecodeParams, rows: list[RowOptions],
               kv_store: object | None, on_block: Callable | None,
               cancelled: Callable[[], list[bool]] | None) -> BlockCausalCohort:
        """The request's :class:`BlockCausalCohort`, its settings mapped by :func:`settings_from`."""
        editing = self.model.config.editing
        settings = [settings_from(params, options, editing) for options in rows]
        return BlockCausalCohort(self.model, prompts, settings, self.spec.mask_id, self.spec.eos_ids, rows, params,
                                 on_block, cancelled, kv_store, tuple(self.spec.banned_ids))

    def report(self, cohort: BlockCausalCohort, decode_text: Callable[[list[int]], str | None]) -> DecodeReport:
        """The cohort's report (:meth:`BlockCausalCohort.report`)."""
        return cohort.report(decode_text)

    def cache_cost(self, prompt_len: int, params: DecodeParams, store_bytes: int, quantized: bool) -> CacheCost:
        """One row's K/V memory in a :class:`BlockCausalBatch` (class doc, "Caches"): a slot of ``2 x`` the
        batch's longest row in columns (``slot_columns``: twice the row's whole blocks, ``ceil((prompt_len +
        gen_length) / block_length)`` of them), per column every layer's K and V of the slot, plus one layer for
        the copy a regroup makes and two of the scratch that a cache holding packed rows keeps (its own and the
        one a regroup makes beside it); a row whose store packs its committed blocks (``quantized``, cache mode
        not ``none``: `BlockCausalCohort.packs`) has no per-layer K/V in the slot, only the scratch, and holds
        ``store_bytes`` in its store. With CUDA graphs' K/V pool (:attr:`later_steps`), a full-precision row counts
        its layers twice: a regroup makes the new cache's run in the pool beside the old caches' runs, whole, before
        they shrink (`service.engine.block_causal_graphs`, "Memory"), where the eager regroup copies layer by
        layer."""
        cfg = self.model.config
        layer_column = 2 * cfg.num_kv_heads * cfg.head_dim * self.model.embed.weight.element_size()
        blocks = -(-(prompt_len + params.gen_length) // params.block_length)
        packs = quantized and params.cache_mode != "none"
        pooled = can_graph(self.model, self.later_steps)
        layers = 2 if packs else (2 if pooled else 1) * cfg.num_layers + 3
        return CacheCost(store_bytes if packs else 0, layers * layer_column, 2 * blocks * params.block_length)


def _generator(options: RowOptions, device: torch.device) -> torch.Generator | None:
    """The row's RNG when it samples (seeded from its options), None when greedy: the other families' rule with
    their default settings (no random remasking here)."""
    return _row_generator(options, DecodeParams(), device)


@dataclass
class BlockCausalPass:
    """One cohort's part of an iteration, as the plan reads it (`service.engine.protocol.PlannedPass`): its live
    rows' next calls. ``kind`` is ``full`` when one of them commits columns (its window starts before its active
    block: the first call of a block, the prompt's included, or every call of cache mode ``none``), else
    ``window``; ``width`` the widest window, ``seq_len`` the farthest column. ``layers``, ``hidden``: the rest of
    a pass split by layers (`service.runtime.scheduler.split_by_layers`): the layers it has left and the hidden
    states ``[n, width, C]`` the previous piece reached."""

    cohort: BlockCausalCohort
    rows: list[int]
    kind: Literal["full", "window"]
    width: int
    seq_len: int
    layers: tuple[int, int] | None = None
    hidden: Any = None


class BlockCausalBatch:
    """The running batch of a block-causal model (module doc). ``failed`` lists ``(cohort, exception)`` of the last
    iteration's cohorts that failed alone; ``forwards`` and ``rows`` count its forwards and row-forwards.

    The caller keeps the running set, as `service.engine.batch.RunningBatch`'s (its class doc): each iteration
    runs the cohorts :meth:`passes` names, in the forwards the caller's plan groups their passes into (a pass the
    plan leaves out waits: its rows keep their K/V); ``cohorts`` is the set :meth:`join` keeps for a caller
    without one (:meth:`step`, which runs every pass in one forward; empty in the server).

    **Caches.** Each forward attends over one `CommittedKV` whose slots are its rows in order. A forward whose rows
    are those of a cache already held (the usual case: the same rows as the last iteration) runs on it as is;
    otherwise a cache of twice its longest row's columns is made for its rows and each full-precision row's
    committed K/V are moved into it from the cache that held them (once per change of the grouping, as when
    requests join or leave), one layer at a time: each layer of the old cache is replaced by a copy of the slots
    of its rows that stay, so no cache keeps the slot of a row that moved or left (a leaving cohort's slots go the
    same way), and a cache left with no row is dropped. Every row then holds one slot, at most the batch's longest
    row's twice in columns, plus one layer's copy while a regroup moves it (``peak_bytes`` records the most held;
    `BlockCausalDecoder.cache_cost` is what admission counts).

    **Preemption by recompute** (:meth:`preempt`): a cohort whose rows' next calls all commit (a block boundary;
    its store not packing committed blocks, `BlockCausalCohort.packs`) gives up its slots; it resumes with the same
    calls widened to start at column 0, which rebuild its committed K/V from its committed tokens (which never
    change, block-causal) before the block, as the block-initial pass of the bidirectional families does.

    **CUDA graphs** (``later_steps``, `service.engine.block_causal_graphs`): with a runner that captures where this
    model can be captured (`can_graph`), each full-precision cache is one run of the runner's K/V pool (its layer
    buffers are the run's views: every forward reads and writes them as its own), a regroup zeroes the new run and
    moves the rows into it as above, a shrink compacts the kept slots into the run's first ones (one layer's copy
    at a time) and the run gives the rest back; the later steps gather their rows from the pool and replay graphs.

    **Prefix cache** (``prefix_cache``, `service.engine.prefix_cache`): a row looks up its longest cached run of
    whole prompt blocks when its cohort's pass is first made (:meth:`passes`, so the plan sees the narrower pass),
    takes the cached K/V before its first forward and puts its own whole prompt blocks in after it; its cohort
    gives the blocks back when it leaves or is preempted.
    """

    def __init__(self, model: LLaDA2Model, plan: Any = None, prefix_cache: PrefixCache | None = None,
                 model_key: str = "", later_steps: Any = None) -> None:
        self.model = model
        self.plan = plan
        #: The later steps' runner (`service.engine.graphs.LaterSteps`; None: eager, unpadded): with capture on,
        #: the full-precision caches live in its K/V pool (`service.engine.block_causal_graphs`); a runner that
        #: captures where this model's forward cannot be captured (`can_graph`) is not used.
        graphed = can_graph(model, later_steps)
        self.later_steps = later_steps if graphed or (later_steps is not None and not later_steps.capture) else None
        self.pool = later_steps.pool if graphed else None
        #: Content-keyed committed K/V of prompts' whole blocks shared across requests (None: every request computes
        #: its whole prompt), keyed under ``model_key`` (the weights' fingerprint).
        self.prefix_cache, self.model_key = prefix_cache, model_key
        self.cohorts: list[BlockCausalCohort] = []
        self._live: list[BlockCausalCohort] = []  # the cohorts of the iteration :meth:`passes` started
        self._finished: list[BlockCausalCohort] = []
        self.failed: list[tuple[BlockCausalCohort, BaseException]] = []
        self.forwards = 0
        self.rows = 0
        self._caches: list[tuple[list[Row], CommittedKV]] = []  # each cache with the row of each slot
        self._owner: dict[int, tuple[CommittedKV, int]] = {}  # id(row) -> the cache and slot holding its K/V
        #: Most bytes the caches held at once, copies under way included (:meth:`_note_peak`).
        self.peak_bytes = 0
        # Cohorts between the pieces of a pass split by layers: the layer reached and the hidden states there.
        self._pieces: dict[BlockCausalCohort, tuple[int, torch.Tensor]] = {}

    @property
    def caches(self) -> list[CommittedKV]:
        """The caches held now (class doc, "Caches")."""
        return [cache for _, cache in self._caches]

    def join(self, cohort: BlockCausalCohort) -> None:
        """Add a request's rows to ``cohorts`` (the set :meth:`step` decodes); they take part from the next
        iteration."""
        self.cohorts.append(cohort)

    def leave(self, cohort: BlockCausalCohort) -> None:
        """Drop a request (finished, failed or cancelled): its rows' K/V are let go (a cache no row owns is
        dropped)."""
        if cohort in self.cohorts:
            self.cohorts.remove(cohort)
        self._forget(cohort)

    def _forget(self, cohort: BlockCausalCohort) -> None:
        cohort.release_prefix(self.prefix_cache)  # left or preempted: its cached blocks may go
        self._pieces.pop(cohort, None)
        for row in cohort.rows:
            self._owner.pop(id(row), None)
        self._release({id(row) for row in cohort.rows})  # its slots go now, not at the next regroup

    def preemptible(self, cohort: BlockCausalCohort) -> bool:
        """Whether :meth:`preempt` may take ``cohort`` out now (class doc): every live row's next call commits
        columns (a block boundary), it is not between the pieces of a split pass, and no row's committed blocks
        are held packed by its store."""
        return bool(cohort.calls) and cohort not in self._pieces and all(
            call.start < call.block_start or cohort.rows[i].params.cache_mode == "none"
            for i, call in cohort.calls.items()) and not any(cohort.packs(i) for i in cohort.calls)

    def preempt(self, cohort: BlockCausalCohort) -> dict[int, Call]:
        """Take ``cohort`` out between iterations and let its K/V go; returns its rows' next calls widened to
        start at column 0 (what :meth:`resume` gives back). Its host state (tokens, generators, grammar, streamed
        blocks) stays on it.

        Raises:
            ValueError: not :meth:`preemptible`.
        """
        if not self.preemptible(cohort):
            raise ValueError("a block-causal cohort is preempted only when every row's next call commits columns")
        if cohort in self.cohorts:
            self.cohorts.remove(cohort)
        self._forget(cohort)
        return {i: replace(call, start=0) for i, call in cohort.calls.items()}

    def resume(self, cohort: BlockCausalCohort, call: dict[int, Call]) -> None:
        """Give a preempted cohort back the calls :meth:`preempt` returned (its rows rebuild their committed K/V
        from column 0 in them)."""
        cohort.calls.update(call)

    def passes(self, cohorts: Sequence[BlockCausalCohort]) -> list[BlockCausalPass]:
        """Start an iteration of ``cohorts`` (the caller's running set, oldest first): one pass per cohort that
        still decodes (its live rows' next calls); one that is done finishes (:meth:`run` returns it)."""
        self.failed, self.forwards, self.rows = [], 0, 0
        self._live = list(cohorts)
        self._finished = [c for c in cohorts if c.done]
        out = []
        for cohort in cohorts:
            if cohort.done:
                continue
            if self.prefix_cache is not None:  # a row's first forward starts after its longest cached prefix
                for i in sorted(cohort.calls):
                    cohort.look_up_prefix(i, self.prefix_cache, self.model_key)
            calls = [cohort.calls[i] for i in sorted(cohort.calls)]
            full = any(c.start < c.block_start for c in calls) or not any(c.start for c in calls)
            reached, hidden = self._pieces.get(cohort, (0, None))
            out.append(BlockCausalPass(cohort, sorted(cohort.calls), "full" if full else "window",
                                       max(c.end - c.start for c in calls), max(c.end for c in calls),
                                       (reached, len(self.model.layers)) if reached else None, hidden))
        return out

    def step(self) -> list[BlockCausalCohort]:
        """One iteration of ``cohorts`` (`Engine.generate`, :func:`generate_batch`), every pass in one forward
        unless the batch was given a plan; returns as :meth:`run`."""
        passes = self.passes(self.cohorts)
        return self.run(self.plan(passes) if self.plan is not None else [passes] if passes else [])

    def run(self, forwards: list[list[BlockCausalPass]]) -> list[BlockCausalCohort]:
        """The iteration :meth:`passes` started, as planned: each group one forward over its passes' rows, each
        row sent its reveal; a pass the plan left out waits. Returns the cohorts that finished (they have left:
        :meth:`leave`). A cohort whose host step raises fails alone: it leaves and is listed in :attr:`failed`."""
        for group in forwards:
            layers = group[0].layers
            if layers is not None and any(p.cohort.packs(i) for p in group for i in p.rows):
                layers = None  # a packing store's write hooks run over a whole forward: such a pass is not split
            if layers is not None and layers == (0, len(self.model.layers)):
                layers = None
            self._run_group([(p.cohort, i) for p in group for i in p.rows if i in p.cohort.calls], group, layers)
        finished = after_iteration(self._live, self.failed, self.leave)
        self._live, self._finished = [], []
        return finished

    def _run_group(self, live: list[tuple[BlockCausalCohort, int]], group: list[BlockCausalPass] | None = None,
                   layers: tuple[int, int] | None = None) -> None:
        """One forward over the rows ``live`` ((cohort, row index) pairs), each row advanced with its reveal; with
        ``layers`` one piece of it (the passes of ``group`` split by layers): a piece before the last keeps each
        cohort's hidden states for the next, the last reveals."""
        if not live:
            return
        hidden = None
        if layers is not None:
            if layers[0] > 0:  # the previous pieces' hidden states, the group's rows in order, padded to one width
                width = max(p.width for p in group)
                hidden = torch.cat([torch.nn.functional.pad(p.hidden, (0, 0, 0, width - p.hidden.shape[1]))
                                    for p in group])
            if layers[1] < len(self.model.layers):
                self._run_piece(live, group, layers, hidden)
                return
        # Rows held packed by a quantized store take the last slots (`CommittedKV`'s packed slots).
        live = sorted(live, key=lambda ci: ci[0].packs(ci[1]))
        rows = [c.rows[i] for c, i in live]
        packed = sum(c.packs(i) for c, i in live)
        cache = self._cache_for(rows, packed)
        row_commits = [c.commit(i, slot) for slot, (c, i) in enumerate(live)]
        prefix = self.prefix_cache
        if prefix is not None:
            for slot, ((c, i), commit) in enumerate(zip(live, row_commits)):
                c.adopt_prefix(i, slot, cache, commit, prefix)
        commits = [x for x in row_commits if x is not None]
        hook = commits[0].hook(commits, self.model.rotate_keys, self.model.key_rotation) if commits else None
        cache.on_write = hook
        banned = next((c.banned for c, _ in live), None)
        deferred = DEFER_WRITE_CHECKS.set(True)  # the writes' checks join the reveal's read (module doc)
        try:
            revealed = step_rows(self.model, rows, [c.calls[i] for c, i in live], cache, banned,
                                 hook.take_checks if hook is not None else None, layers, hidden, self.later_steps)
        finally:
            DEFER_WRITE_CHECKS.reset(deferred)
            cache.on_write = None
        self.forwards += 1
        self.rows += len(rows)
        for p in group or ():
            self._pieces.pop(p.cohort, None)
        for slot, ((cohort, i), row_revealed, commit) in enumerate(zip(live, revealed, row_commits)):
            if cohort in [f for f, _ in self.failed]:
                continue
            if prefix is not None and not isinstance(row_revealed, (ChecksFailed, BaseException)):
                cohort.insert_prefix(i, slot, cache, commit, prefix)  # its K/V checked and final
            if isinstance(row_revealed, ChecksFailed):
                exc = self._checked_again(cohort, i, commit, banned)
                if exc is not None:
                    self.failed.append((cohort, exc))
                    continue
                row_revealed = row_revealed.revealed  # a false alarm: the same K/V were written
            if isinstance(row_revealed, BaseException):  # its grammar failed mid-decode: this request alone
                self.failed.append((cohort, row_revealed))
                continue
            try:
                cohort.advance(i, row_revealed)
            except Exception as exc:  # noqa: BLE001 -- this request's fault alone; the others go on
                self.failed.append((cohort, exc))

    def _run_piece(self, live: list[tuple[BlockCausalCohort, int]], group: list[BlockCausalPass],
                   layers: tuple[int, int], hidden: torch.Tensor | None) -> None:
        """A piece of the group's passes before the last layer: its layers write their K/V into the rows' slots,
        and each cohort keeps the hidden states its rows reached (cut to its own width) for its next piece. No
        row is revealed or advanced. A fault here is no one cohort's (the iteration's forward raised)."""
        rows = [c.rows[i] for c, i in live]
        cache = self._cache_for(rows, 0)
        if self.prefix_cache is not None:  # the first piece attends over the cached prefix too
            for slot, (c, i) in enumerate(live):
                c.adopt_prefix(i, slot, cache, None)
        reached = step_rows(self.model, rows, [c.calls[i] for c, i in live], cache, None, None, layers, hidden)
        self.forwards += 1
        self.rows += len(rows)
        offset = 0
        for p in group:
            n = len(p.rows)
            self._pieces[p.cohort] = (layers[1], reached[offset:offset + n, : p.width])
            offset += n

    def _checked_again(self, cohort: BlockCausalCohort, i: int, commit: Any,
                       banned: torch.Tensor | None) -> BaseException | None:
        """Row ``i`` of ``cohort``, whose put-off write checks failed, in a forward of its own with each check read
        at once (`service.quant.committed.Commit.alone`): what it raises (the cohort fails with it), or None for a
        false alarm. Its generator's state is put back, so that a false alarm decodes as if nothing happened."""
        row, call = cohort.rows[i], cohort.calls[i]
        alone = commit.alone()
        cache = BlockCausalBatch(self.model)._cache_for([row], 1)  # a scratch batch: no slot of ours moves
        cache.on_write = alone.hook([alone], self.model.rotate_keys, self.model.key_rotation)
        state = row.generator.get_state() if row.generator is not None else None
        self.forwards += 1
        try:
            step_rows(self.model, [row], [call], cache, banned)
        except Exception as exc:  # noqa: BLE001 -- the row's own fault, handed to the caller
            return exc
        finally:
            if state is not None:
                row.generator.set_state(state)
        return None

    def _cache_for(self, rows: list[Row], packed: int) -> CommittedKV:
        """The cache with one slot per row of ``rows``, in that order, the last ``packed`` of them held packed
        (no per-layer buffers: `CommittedKV`; class doc, "Caches"): a cache held with exactly these rows, else a
        new one of ``2 x`` their longest row's columns into which each full-precision row's K/V are moved from
        the cache that held them (rows new to the batch, or resumed, get zeroed slots), one layer at a time
        (:meth:`_release`)."""
        cfg, weight = self.model.config, self.model.embed.weight
        capacity = 2 * max(r.length for r in rows)
        for held_rows, cache in self._caches:
            if held_rows == rows and cache.k[0].shape[2] >= capacity and (
                    cache.scratch is None or cache.scratch[0].shape[2] >= capacity):
                return cache
        full = len(rows) - packed
        cache = CommittedKV(0, len(rows), cfg.num_kv_heads, capacity, cfg.head_dim, weight.dtype, weight.device,
                            packed)  # its layers are added one by one below
        # (new slot, the cache holding the row, its slot there) of each full-precision row held already
        moves = [(n, *held) for n, r in enumerate(rows[:full])
                 if (held := self._owner.get(id(r))) is not None and held[1] < held[0].k[0].shape[0]]
        shape = (full, cfg.num_kv_heads, capacity, cfg.head_dim)
        pooled = self.pool is not None and not packed and self.pool.takes(
            torch.empty((0, cfg.num_kv_heads, 0, cfg.head_dim), dtype=weight.dtype, device=weight.device))
        if pooled:  # one run of its slots in the pool's buffers (class doc, "CUDA graphs")
            run = self.pool.allocate(full, capacity)
            cache.k, cache.v = (RunLayers(self.pool, run, which, cfg.num_layers) for which in (0, 1))

        def build(layer: int) -> None:
            for new_buffers, name in ((cache.k, "k"), (cache.v, "v")):
                if pooled:
                    new_buffers[layer].zero_()  # a run holds what it held: zeroed as a new buffer is
                else:
                    new_buffers.append(torch.zeros(shape, dtype=weight.dtype, device=weight.device))
                self._note_peak(cache)
                for to, old, slot in moves:  # slot by slot: no copy beside the two; past a row's length it reads nothing
                    source = getattr(old, name)[layer]
                    width = min(capacity, source.shape[2])
                    new_buffers[layer][to, :, :width].copy_(source[slot, :, :width])

        self._caches.append((list(rows), cache))
        self._release({id(r) for r in rows}, build, cache)
        for slot, row in enumerate(rows):
            self._owner[id(row)] = (cache, slot)
        return cache

    def _release(self, gone: set[int], build: Callable[[int], None] | None = None,
                 new: CommittedKV | None = None) -> None:
        """Free the slots of the rows whose ids are ``gone`` in every held cache but ``new``, one layer at a time:
        each layer of such a cache is replaced by a copy of its other rows' slots (``build(layer)``, when given,
        first makes that layer of ``new`` from the old slots). A cache is never held with a slot of a row that
        moved or left, and a regroup holds at most one layer's copy more than its rows' slots (the bound
        `BlockCausalDecoder.cache_cost` counts); a cache left with no row is dropped."""
        shrink = []  # (cache, its rows, the rows it keeps, the full-precision slots it keeps)
        for held_rows, cache in self._caches:
            if cache is new or not any(id(r) in gone for r in held_rows):
                continue
            full = cache.k[0].shape[0]
            keep = [r for r in held_rows if id(r) not in gone]
            slots = torch.tensor([s for s, r in enumerate(held_rows[:full]) if id(r) not in gone], dtype=torch.long,
                                 device=cache.device)
            shrink.append((cache, held_rows, keep, slots))
        for layer in range(self.model.config.num_layers):
            if build is not None:
                build(layer)
            for cache, _, keep, slots in shrink:
                if len(slots) == cache.k[layer].shape[0]:
                    continue  # only packed rows went: their slots are in the scratch alone
                for buffers in (cache.k, cache.v):
                    kept = (buffers[layer].index_select(0, slots) if len(slots) else
                            buffers[layer].new_empty((0, *buffers[layer].shape[1:])))
                    self._note_peak(new, kept)
                    if isinstance(buffers, RunLayers):  # its run's first slots; the run shrinks below
                        buffers[layer][: len(slots)] = kept
                    else:
                        buffers[layer] = kept
        for cache, held_rows, keep, _ in shrink:
            if cache.scratch is not None:  # its content is rewritten at every layer: a smaller one, zeroed
                shape = (len(keep), *cache.scratch[0].shape[1:])
                scratch = None if len(keep) == cache.k[0].shape[0] else tuple(
                    torch.zeros(shape, dtype=t.dtype, device=t.device) for t in cache.scratch)
                self._note_peak(new, *(scratch or ()))
                cache.scratch = scratch
            held_rows[:] = keep
            for slot, row in enumerate(keep):
                self._owner[id(row)] = (cache, slot)
            if isinstance(cache.k, RunLayers):  # the slots that went are the pool's again
                if keep:
                    cache.k.run.rows = len(keep)
                else:
                    self.pool.free(cache.k.run)
        self._caches = [(r, c) for r, c in self._caches if r]
        self._note_peak(new)

    @property
    def held_bytes(self) -> int:
        """Bytes of the K/V caches held now (`CommittedKV.nbytes`, every held cache)."""
        return sum(cache.nbytes for _, cache in self._caches)

    def _note_peak(self, new: CommittedKV | None, *spare: torch.Tensor) -> None:
        """Record in :attr:`peak_bytes` the caches held now (``new`` among them while it is built) and the
        copies ``spare`` being made."""
        held = self.held_bytes + sum(t.numel() * t.element_size() for t in spare)
        if new is not None and all(c is not new for _, c in self._caches):
            held += new.nbytes
        self.peak_bytes = max(self.peak_bytes, held)


def generate_batch(
    model: LLaDA2Model,
    prompts: list[list[int]],
    params: list[BlockCausalParams],
    mask_id: int,
    eos_ids: tuple[int, ...],
    generators: list[torch.Generator | None] | None = None,
    kv_store: object | None = None,
    prefix_cache: PrefixCache | None = None,
    model_key: str = "",
    later_steps: Any = None,
) -> list[BlockCausalResult]:
    """Decode several prompts together, each with its own settings (`service.engine.block_causal`), one forward
    per iteration for every row still decoding; each row decodes as it would alone.

    Args:
        model: a loaded LLaDA2 model (eval mode). prompts: token ids per row, each non-empty, without ``mask_id``.
        params: one :class:`BlockCausalParams` per row. mask_id: the ``<|mask|>`` id. eos_ids: ids that end a
            response. generators: per row, the sampling generator when its temperature is above 0 (None: torch's
            default). kv_store: a `QuantizedKVStore` quantizes every ``block`` row's committed blocks (its report
            counts them); None: full precision. prefix_cache: read and filled by the ``block`` rows
            (`service.engine.prefix_cache`), keyed under ``model_key`` (the weights' fingerprint); None: none.
            later_steps: the later steps' runner (`service.engine.graphs.LaterSteps`; None: eager, unpadded).

    Returns:
        One :class:`BlockCausalResult` per prompt, in order (``kv_bytes``: the committed K/V the row held).

    Raises:
        EngineInputError: an empty prompt, one holding ``mask_id``, or ``params`` not one per prompt.
    """
    batch = BlockCausalBatch(model, prefix_cache=prefix_cache, model_key=model_key, later_steps=later_steps)
    seeded = [RowOptions(temperature=p.temperature) for p in params]
    cohort = BlockCausalCohort(model, prompts, params, mask_id, eos_ids, seeded, kv_store=kv_store)
    if generators:  # the caller's generators replace the rows' own
        for row, generator in zip(cohort.rows, generators):
            row.generator = generator if generator is not None else row.generator
    batch.join(cohort)
    with torch.inference_mode():
        while batch.cohorts:
            batch.step()
            if batch.failed:
                raise batch.failed[0][1]
    cfg = model.config
    per_column = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * model.embed.weight.element_size()
    for i, (row, result) in enumerate(zip(cohort.rows, cohort.results)):
        if cohort.packs(i):  # held packed by the quantized store
            result.kv_bytes = cohort.store.committed_bytes(i)
        elif row.params.cache_mode == "block":
            result.kv_bytes = row.committed * per_column
    return cohort.results


def generate(
    model: LLaDA2Model,
    prompt: list[int],
    params: BlockCausalParams,
    mask_id: int,
    eos_ids: tuple[int, ...],
    generator: torch.Generator | None = None,
    kv_store: object | None = None,
    prefix_cache: PrefixCache | None = None,
    model_key: str = "",
    later_steps: Any = None,
) -> BlockCausalResult:
    """Decode one prompt block-causally (:func:`generate_batch` of one row; ``kv_store``, ``prefix_cache``,
    ``model_key`` and ``later_steps`` as there).

    Raises:
        EngineInputError: an empty prompt, or one holding ``mask_id``.
    """
    return generate_batch(model, [prompt], [params], mask_id, eos_ids, [generator], kv_store, prefix_cache,
                          model_key, later_steps)[0]
