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
from service.engine.decode import CommittedIds, _row_generator
from service.engine.errors import EngineInputError
from service.engine.kv_store import DEFER_WRITE_CHECKS
from service.engine.models.llada2 import CommittedKV, LLaDA2Model
from service.engine.params import DecodeParams, RowOptions
from service.engine.protocol import Capabilities, SettingRule, honoured, only
from service.engine.report import DecodeReport, RowReport, Timings
from service.engine.response import cut_response


def settings_from(params: DecodeParams, options: RowOptions, editing: bool) -> BlockCausalParams:
    """The block-causal settings of a request made with the other families' settings.

    ``threshold`` as given, every position revealable in one step (steps per block = block length, the reference
    default for blocks of 32); a fixed schedule of ``steps`` over the response blocks: ``steps / blocks`` per block
    and no threshold; ``prefix``/``dual`` decode in ``block``; editing with the reference's defaults when the
    checkpoint is LLaDA2.1.
    """
    blocks = max(1, params.gen_length // params.block_length)
    steps = params.block_length if params.steps is None else max(1, params.steps // blocks)
    return BlockCausalParams(
        gen_length=params.gen_length, block_length=params.block_length, steps=steps,
        threshold=math.inf if params.threshold is None else params.threshold,
        cache_mode="none" if params.cache_mode == "none" else "block", editing=editing,
        temperature=options.temperature,
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
        self.banned = torch.tensor(banned_ids if banned_ids is not None else (mask_id,), dtype=torch.long,
                                   device=device)
        self.params, self.eos_ids, self.row_options = params, tuple(eos_ids), rows
        self.on_block, self.cancelled = on_block, cancelled
        # A quantized store (`service.quant.store.QuantizedKVStore`) quantizes the committed blocks (its `commit`);
        # any other store slot holds nothing outside the batch's cache.
        self.store = kv_store if callable(getattr(kv_store, "commit", None)) else NoStore()
        self.rows = [Row(prompt, s, mask_id, eos_ids, _generator(o, device),
                         o.grammar.start() if o.grammar is not None else None, o.logprobs)
                     for prompt, s, o in zip(prompts, settings, rows)]
        self.status = ["running"] * len(prompts)
        self.results: list[BlockCausalResult | None] = [None] * len(prompts)
        self.programs = [row.decode() for row in self.rows]
        self.calls: dict[int, Call] = {}
        self.started_s = time.perf_counter()
        self.finished_s: float | None = None
        self.first_block_s = 0.0
        self._emitted = 0
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
        a `service.quant.committed.Commit`; None when the row is not held packed (:meth:`packs`)."""
        if not self.packs(i):
            return None
        call, row = self.calls[i], self.rows[i]
        return self.store.commit(slot, call.start, call.block_start, row.block, i)


#: What the block-causal family can do: its forwards are the plan's (bounded by ``max_batched_tokens``), and it is
#: preempted by recompute at a block boundary; no likelihood, no layer split (its forward runs every layer).
CAPABILITIES = Capabilities(likelihood=False, layer_split=False, preemption=True, plan_bounded=True,
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

    def batch(self, plan: Any = None) -> BlockCausalBatch:
        """An empty :class:`BlockCausalBatch`; ``plan`` groups :meth:`BlockCausalBatch.step`'s passes into
        forwards."""
        return BlockCausalBatch(self.model, plan)

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


def _generator(options: RowOptions, device: torch.device) -> torch.Generator | None:
    """The row's RNG when it samples (seeded from its options), None when greedy: the other families' rule with
    their default settings (no random remasking here)."""
    return _row_generator(options, DecodeParams(), device)


@dataclass
class BlockCausalPass:
    """One cohort's part of an iteration, as the plan reads it (`service.engine.protocol.PlannedPass`): its live
    rows' next calls. ``kind`` is ``full`` when one of them commits columns (its window starts before its active
    block: the first call of a block, the prompt's included, or every call of cache mode ``none``), else
    ``window``; ``width`` the widest window, ``seq_len`` the farthest column. Never split by layers (``layers``
    stays None: `Capabilities.layer_split` is False)."""

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
    otherwise a cache is made for its rows and each full-precision row's committed K/V are copied into it from the
    cache that held them (once per change of the grouping, as when requests join or leave). A cache no live row
    owns any more is dropped.

    **Preemption by recompute** (:meth:`preempt`): a cohort whose rows' next calls all commit (a block boundary;
    its store not packing committed blocks, `BlockCausalCohort.packs`) gives up its slots; it resumes with the same
    calls widened to start at column 0, which rebuild its committed K/V from its committed tokens (which never
    change, block-causal) before the block, as the block-initial pass of the bidirectional families does.
    """

    def __init__(self, model: LLaDA2Model, plan: Any = None) -> None:
        self.model = model
        self.plan = plan
        self.cohorts: list[BlockCausalCohort] = []
        self._live: list[BlockCausalCohort] = []  # the cohorts of the iteration :meth:`passes` started
        self._finished: list[BlockCausalCohort] = []
        self.failed: list[tuple[BlockCausalCohort, BaseException]] = []
        self.forwards = 0
        self.rows = 0
        self._caches: list[tuple[list[Row], CommittedKV]] = []  # each cache with the row of each slot
        self._owner: dict[int, tuple[CommittedKV, int]] = {}  # id(row) -> the cache and slot holding its K/V

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
        for row in cohort.rows:
            self._owner.pop(id(row), None)
        held = {id(cache) for cache, _ in self._owner.values()}
        self._caches = [(rows, cache) for rows, cache in self._caches if id(cache) in held]

    def preemptible(self, cohort: BlockCausalCohort) -> bool:
        """Whether :meth:`preempt` may take ``cohort`` out now (class doc): every live row's next call commits
        columns (a block boundary) and no row's committed blocks are held packed by its store."""
        return bool(cohort.calls) and all(
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
            calls = [cohort.calls[i] for i in sorted(cohort.calls)]
            full = any(c.start < c.block_start for c in calls) or not any(c.start for c in calls)
            out.append(BlockCausalPass(cohort, sorted(cohort.calls), "full" if full else "window",
                                       max(c.end - c.start for c in calls), max(c.end for c in calls)))
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
        finished: list[BlockCausalCohort] = []
        for group in forwards:
            self._run_group([(p.cohort, i) for p in group for i in p.rows if i in p.cohort.calls])
        for cohort in self._live:
            if cohort in [f for f, _ in self.failed]:
                self.leave(cohort)
                continue
            try:
                cohort.poll_cancelled()
                cohort.emit_blocks()
            except Exception as exc:  # noqa: BLE001 -- a callback of this request failed: it fails alone
                self.failed.append((cohort, exc))
                self.leave(cohort)
                continue
            if cohort.done:
                self.leave(cohort)
                finished.append(cohort)
        self._live, self._finished = [], []
        return finished

    def _run_group(self, live: list[tuple[BlockCausalCohort, int]]) -> None:
        """One forward over the rows ``live`` ((cohort, row index) pairs), each row advanced with its reveal."""
        if not live:
            return
        # Rows held packed by a quantized store take the last slots (`CommittedKV`'s packed slots).
        live = sorted(live, key=lambda ci: ci[0].packs(ci[1]))
        rows = [c.rows[i] for c, i in live]
        packed = sum(c.packs(i) for c, i in live)
        cache = self._cache_for(rows, packed)
        row_commits = [c.commit(i, slot) for slot, (c, i) in enumerate(live)]
        commits = [x for x in row_commits if x is not None]
        hook = commits[0].hook(commits, self.model.rotate_keys) if commits else None
        cache.on_write = hook
        banned = next((c.banned for c, _ in live), None)
        deferred = DEFER_WRITE_CHECKS.set(True)  # the writes' checks join the reveal's read (module doc)
        try:
            revealed = step_rows(self.model, rows, [c.calls[i] for c, i in live], cache, banned,
                                 hook.take_checks if hook is not None else None)
        finally:
            DEFER_WRITE_CHECKS.reset(deferred)
            cache.on_write = None
        self.forwards += 1
        self.rows += len(rows)
        for (cohort, i), row_revealed, commit in zip(live, revealed, row_commits):
            if cohort in [f for f, _ in self.failed]:
                continue
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

    def _checked_again(self, cohort: BlockCausalCohort, i: int, commit: Any,
                       banned: torch.Tensor | None) -> BaseException | None:
        """Row ``i`` of ``cohort``, whose put-off write checks failed, in a forward of its own with each check read
        at once (`service.quant.committed.Commit.alone`): what it raises (the cohort fails with it), or None for a
        false alarm. Its generator's state is put back, so that a false alarm decodes as if nothing happened."""
        row, call = cohort.rows[i], cohort.calls[i]
        alone = commit.alone()
        cache = BlockCausalBatch(self.model)._cache_for([row], 1)  # a scratch batch: no slot of ours moves
        cache.on_write = alone.hook([alone], self.model.rotate_keys)
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
        (no per-layer buffers: `CommittedKV`; class doc, "Caches"): a cache held with exactly these rows when its
        columns cover every window, else a new one into which each full-precision row's K/V are copied from the
        cache that held them (rows new to the batch, or resumed, get zeroed slots)."""
        cfg, weight = self.model.config, self.model.embed.weight
        capacity = 2 * max(r.length for r in rows)
        for held_rows, cache in self._caches:
            if held_rows == rows and cache.k[0].shape[2] >= capacity and (
                    cache.scratch is None or cache.scratch[0].shape[2] >= capacity):
                return cache
        olds = [cache for _, cache in self._caches]
        capacity = max([capacity, *(c.k[0].shape[2] for c in olds)])
        full = len(rows) - packed
        cache = CommittedKV(cfg.num_layers, len(rows), cfg.num_kv_heads, capacity, cfg.head_dim, weight.dtype,
                            weight.device, packed)
        for old in olds:  # the full-precision rows that stay keep their committed K/V
            kept = [(n, slot) for n, r in enumerate(rows[:full])
                    if (held := self._owner.get(id(r))) is not None and held[0] is old
                    and (slot := held[1]) < old.k[0].shape[0]]
            if not kept:
                continue
            to, src = (torch.tensor(list(x), device=weight.device) for x in zip(*kept))
            for buffers, old_buffers in ((cache.k, old.k), (cache.v, old.v)):
                for layer in range(len(buffers)):
                    width = old_buffers[layer].shape[2]
                    buffers[layer][:, :, :width].index_copy_(0, to, old_buffers[layer].index_select(0, src))
        for slot, row in enumerate(rows):
            self._owner[id(row)] = (cache, slot)
        self._caches.append((list(rows), cache))
        held = {id(c) for c, _ in self._owner.values()}
        self._caches = [(r, c) for r, c in self._caches if id(c) in held]
        return cache


def generate_batch(
    model: LLaDA2Model,
    prompts: list[list[int]],
    params: list[BlockCausalParams],
    mask_id: int,
    eos_ids: tuple[int, ...],
    generators: list[torch.Generator | None] | None = None,
    kv_store: object | None = None,
) -> list[BlockCausalResult]:
    """Decode several prompts together, each with its own settings (`service.engine.block_causal`), one forward
    per iteration for every row still decoding; each row decodes as it would alone.

    Args:
        model: a loaded LLaDA2 model (eval mode). prompts: token ids per row, each non-empty, without ``mask_id``.
        params: one :class:`BlockCausalParams` per row. mask_id: the ``<|mask|>`` id. eos_ids: ids that end a
            response. generators: per row, the sampling generator when its temperature is above 0 (None: torch's
            default). kv_store: a `QuantizedKVStore` quantizes every ``block`` row's committed blocks (its report
            counts them); None: full precision.

    Returns:
        One :class:`BlockCausalResult` per prompt, in order (``kv_bytes``: the committed K/V the row held).

    Raises:
        EngineInputError: an empty prompt, one holding ``mask_id``, or ``params`` not one per prompt.
    """
    batch = BlockCausalBatch(model)
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
) -> BlockCausalResult:
    """Decode one prompt block-causally (:func:`generate_batch` of one row; ``kv_store`` as there).

    Raises:
        EngineInputError: an empty prompt, or one holding ``mask_id``.
    """
    return generate_batch(model, [prompt], [params], mask_id, eos_ids, [generator], kv_store)[0]
