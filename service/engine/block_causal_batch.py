"""The running batch of a block-causal family (LLaDA2.x): requests join and leave between iterations, and every
live row of every request takes part in the iteration's one forward.

The runtime's loop (`service.runtime.loop`) drives it through the interface of `service.engine.batch.RunningBatch`
(``join``, ``leave``, ``passes``, ``run``, ``failed``, ``forwards``, ``rows``, ``cohorts``); `service.engine.Engine`
hands it out for a block-causal model. Each row is a `service.engine.block_causal.Row`: the reference loop as a
generator that yields each forward's window and reveal rule and is sent its active block after the reveal, so a
row decodes token for token as it would alone whatever else is in the batch. Every row's reveal runs on the device
at once (`service.engine.block_causal.reveal_rows`) and is read back in one host read per iteration; the rows'
sequences and their bookkeeping live on the host. K/V live in one `CommittedKV` with a slot per live row
(grown when requests join, compacted when they leave, never per iteration).

Departures from `RunningBatch`: the iteration is one forward whatever the plan (``run`` ignores the caller's
grouping: the rows' windows are right-padded together). A grammar-constrained row (structured output, tool
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
from typing import Any

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


#: What the block-causal family can do today (issue 42 item 3 plans its forwards).
CAPABILITIES = Capabilities(likelihood=False, layer_split=False, preemption=False, plan_bounded=False,
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
        """An empty :class:`BlockCausalBatch` (its one forward per iteration ignores ``plan``)."""
        return BlockCausalBatch(self.model)

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


class BlockCausalBatch:
    """The running batch of a block-causal model (module doc). ``failed`` lists ``(cohort, exception)`` of the last
    iteration's cohorts that failed alone; ``forwards`` and ``rows`` count its forwards and row-forwards.

    The caller keeps the running set, as `service.engine.batch.RunningBatch`'s (its class doc): each iteration
    runs the cohorts :meth:`passes` names; ``cohorts`` is the set :meth:`join` keeps for a caller without one
    (:meth:`step`; empty in the server)."""

    def __init__(self, model: LLaDA2Model) -> None:
        self.model = model
        self.cohorts: list[BlockCausalCohort] = []
        self._live: list[BlockCausalCohort] = []  # the cohorts of the iteration :meth:`passes` started
        self.failed: list[tuple[BlockCausalCohort, BaseException]] = []
        self.forwards = 0
        self.rows = 0
        self._cache: CommittedKV | None = None
        self._slots: list[Row] = []  # the row of each cache slot

    def join(self, cohort: BlockCausalCohort) -> None:
        """Add a request's rows to ``cohorts`` (the set :meth:`step` decodes); they take part from the next
        iteration."""
        self.cohorts.append(cohort)

    def leave(self, cohort: BlockCausalCohort) -> None:
        """Drop a request (finished, failed or cancelled); its slots go at the next iteration that runs without
        its rows."""
        if cohort in self.cohorts:
            self.cohorts.remove(cohort)

    def preemptible(self, cohort: BlockCausalCohort) -> bool:
        """Never (yet): the rows' committed K/V live in the batch's shared cache."""
        return False

    def preempt(self, cohort: BlockCausalCohort) -> Any:
        """Raises ValueError: a block-causal cohort is not :meth:`preemptible`."""
        raise ValueError("a block-causal cohort cannot be preempted")

    def resume(self, cohort: BlockCausalCohort, call: Any) -> None:
        """Raises ValueError: nothing was preempted (:meth:`preempt`)."""
        raise ValueError("a block-causal cohort cannot be preempted")

    def passes(self, cohorts: Sequence[BlockCausalCohort]) -> list:
        """Start an iteration of ``cohorts`` (the caller's running set, oldest first); its calls are made in
        :meth:`run` (one forward), so nothing for a plan to group."""
        self._live = list(cohorts)
        return []

    def step(self) -> list[BlockCausalCohort]:
        """One iteration of ``cohorts`` (`Engine.generate`, :func:`generate_batch`); returns as :meth:`run`."""
        self.passes(self.cohorts)
        return self.run()

    def run(self, forwards: list | None = None) -> list[BlockCausalCohort]:
        """The iteration :meth:`passes` started: one forward over every live row of its cohorts, each row sent
        its logits. Returns the cohorts that finished (they have left: :meth:`leave`). A cohort whose host step
        raises fails alone: it leaves and is listed in :attr:`failed`."""
        self.failed, self.forwards, self.rows = [], 0, 0
        finished: list[BlockCausalCohort] = []
        live = [(c, i) for c in self._live for i in sorted(c.calls)]
        if live:
            # Rows held packed by a quantized store take the last slots (`CommittedKV`'s packed slots).
            live.sort(key=lambda ci: ci[0].packs(ci[1]))
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
            self.forwards, self.rows = 1, len(rows)
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
        self._live = []
        return finished

    def _checked_again(self, cohort: BlockCausalCohort, i: int, commit: Any,
                       banned: torch.Tensor | None) -> BaseException | None:
        """Row ``i`` of ``cohort``, whose put-off write checks failed, in a forward of its own with each check read
        at once (`service.quant.committed.Commit.alone`): what it raises (the cohort fails with it), or None for a
        false alarm. Its generator's state is put back, so that a false alarm decodes as if nothing happened."""
        row, call = cohort.rows[i], cohort.calls[i]
        alone = commit.alone()
        cache = BlockCausalBatch(self.model)._cache_for([row], 1)
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
        (no per-layer buffers: `CommittedKV`): the full-precision slots of rows that left are dropped and new
        rows get zeroed slots (both only when the set of rows changes); the columns cover every window."""
        cfg, weight = self.model.config, self.model.embed.weight
        capacity = 2 * max(r.length for r in rows)
        old = self._cache
        if old is not None and rows == self._slots and old.k[0].shape[2] >= capacity and (
                old.scratch is None or old.scratch[0].shape[2] >= capacity):
            return old
        if old is not None:
            capacity = max(capacity, old.k[0].shape[2])
        full = len(rows) - packed
        cache = CommittedKV(cfg.num_layers, len(rows), cfg.num_kv_heads, capacity, cfg.head_dim, weight.dtype,
                            weight.device, packed)
        held = {id(r): s for s, r in enumerate(self._slots[: old.k[0].shape[0]])} if old is not None else {}
        kept = [(n, held[id(r)]) for n, r in enumerate(rows[:full]) if id(r) in held]
        if kept:  # the full-precision rows that stay keep their committed K/V
            to, src = (torch.tensor(list(x), device=weight.device) for x in zip(*kept))
            for buffers, olds in ((cache.k, old.k), (cache.v, old.v)):
                for layer in range(len(buffers)):
                    width = olds[layer].shape[2]
                    buffers[layer][:, :, :width].index_copy_(0, to, olds[layer].index_select(0, src))
        self._cache, self._slots = cache, list(rows)
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
