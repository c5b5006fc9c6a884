"""The continuous scheduler: requests join a running batch at the next iteration and leave the moment they finish,
admitted by KV memory (issue #14; DESIGN.md flow 1).

It keeps the :class:`~service.worker.Worker` life cycle (bounded queue and 429, cancellation, drain, device-fault
handling, shadow re-decodes) and replaces how work is taken:

* **Iterations.** One thread owns the engine's `RunningBatch`; each iteration runs every running request's next
  forward call, packed into as few forwards as the token budget allows (`service.engine.batch`). Requests with different prompt and
  response lengths, block lengths, thresholds or steps, temperatures, cache modes and KV configurations share
  them, each with its own KV store; each decodes exactly as it would alone.
* **Admission by memory.** Before each iteration the head of the queue joins while the KV bytes of every running
  row plus its own, plus the transient memory of the largest forward with it, fit ``budget_bytes``
  (`service.admission`), and fewer than ``max_rows`` rows run. A request that could never fit, even alone, is
  refused at :meth:`submit` (:class:`RequestTooLarge`, HTTP 400 naming ``max_tokens`` or the prompt).
* **Forwards apart from KV.** The running batch packs each iteration's passes into forwards of at most
  ``max_batched_tokens`` input tokens (`service.engine.batch`); the activation memory of such a forward
  (``forward_bytes``, measured once at start-up, `service.admission.MemoryModel.measure_forward`) is reserved
  off the budget, so admission counts KV bytes against what is left (a request whose own block-initial pass is
  larger than the token budget runs that pass alone and reserves its own transient).
* **Fairness without head-of-line blocking** (issue 22 item 5). First come, first served, except: while the
  head of the queue waits for memory, requests behind it that are smaller and fit now run beside the running
  ones (backfill), for at most ``backfill_s`` seconds of the head's wait; from then on the memory that frees up
  is reserved for the head (nobody passes it), so it starts within ``backfill_s`` plus the time the requests
  already running take to finish, and a small request never waits for a large one's whole run. With
  ``backfill_s`` None, strictly first come, first served. Shadow re-decodes join only when no user request
  waits, and only within the budget.
* **Faults.** A request whose decoding raises (its options, its KV store) fails alone with a 500 naming the
  cause; the rest of the batch goes on (`service.engine.batch`). A device fault fails everything.
* **Leaving.** A finished request (EOS, its length, cancellation or disconnect) leaves at the next iteration and
  its store is cleared at once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from service.admission import Cost, MemoryModel, plan_admission
from service.engine.kv_store import FullPrecisionKVStore, KVStore
from service.engine.report import DecodeReport
from service.telemetry import Telemetry
from service.worker import (
    BatchFailed,
    EngineLike,
    Job,
    JobCancelled,
    JobResult,
    KVStoreFactory,
    RequestTooLarge,
    Worker,
    _set_exception,
    _set_result,
    is_device_fault,
)

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Running:
    """A job in the batch: its cohort, its reserved cost, when it joined, and the most rows that ran with it."""

    job: Job
    cohort: object
    cost: Cost
    joined_at: float
    peak_rows: int


class ContinuousWorker(Worker):
    """See the module docstring. Arguments as :class:`~service.worker.Worker`, plus:

    Args:
        memory: the model's :class:`~service.admission.MemoryModel`.
        budget_bytes: KV bytes of running rows + the largest forward may not exceed this.
        max_rows: most rows running at once (``max_batch_size`` of the settings).
        max_batched_tokens: most input tokens of one forward (None: the engine's default).
        forward_bytes: activation bytes of a forward at ``max_batched_tokens`` (reserved off the budget).
        backfill_s: how long a request blocked at the head lets smaller ones that fit pass it (None: never).
    """

    def __init__(self, engine: EngineLike, kv_store_factory: KVStoreFactory, telemetry: Telemetry,
                 memory: MemoryModel, budget_bytes: int, max_rows: int = 8, max_batched_tokens: int | None = None,
                 forward_bytes: int = 0, backfill_s: float | None = None, **kw) -> None:
        super().__init__(engine, kv_store_factory, telemetry, max_batch_size=max_rows, **kw)
        if budget_bytes < 1:
            raise ValueError(f"budget_bytes must be >= 1, got {budget_bytes}")
        if forward_bytes < 0 or (backfill_s is not None and backfill_s < 0):
            raise ValueError(f"forward_bytes and backfill_s must be >= 0, got {forward_bytes}, {backfill_s}")
        self.memory, self.budget_bytes = memory, budget_bytes
        self.max_batched_tokens, self.forward_bytes, self.backfill_s = max_batched_tokens, forward_bytes, backfill_s
        self._batch = None
        self._members: list[_Running] = []
        telemetry.kv_budget.set(budget_bytes)

    # ---- admission -------------------------------------------------------------------------------------------------
    def _per_token(self, job: Job) -> float:
        return self.memory.kv_bytes_per_token((job.snapshot.config, job.snapshot.cache_mode), lambda: self._store(job))

    def _cost(self, job: Job) -> Cost:
        if job.task is not None:  # full passes without cache: no KV held
            return Cost(0, job.task.transient_bytes(self.memory.forward))
        one = self.memory.cost(len(job.prompt_ids), job.params, self._per_token(job))
        return Cost(one.kv * len(job.rows), one.transient * len(job.rows))  # n choices: n rows

    def _store(self, job: Job) -> KVStore:
        store = self._kv_store_factory(job.snapshot)
        return store if store is not None else FullPrecisionKVStore()

    def submit(self, job: Job) -> Job:
        """As :meth:`Worker.submit`, and first: refuse a request that could never fit the budget. Never runs torch
        work (the async route calls it on the event loop): a configuration whose bytes per token are not measured
        yet is sized on the worker thread when the request comes up for admission, and refused there (the same
        error, through the job's future).

        Raises:
            RequestTooLarge: its KV bytes and its own forward exceed the budget even alone (``field``
                ``max_tokens`` when a one-block response would fit, else ``prompt``).
        """
        if (job.task is not None or job.snapshot.config.method == "none"
                or self.memory.knows((job.snapshot.config, job.snapshot.cache_mode))):
            self._check_size(job)
        return super().submit(job)

    def _check_size(self, job: Job) -> None:
        """Raise :class:`RequestTooLarge` if ``job`` could never fit the budget (see :meth:`submit`)."""
        job.sized = True
        cost = self._cost(job)
        if job.task is not None:
            if cost.transient > self.budget_bytes:
                raise RequestTooLarge(f"this request's largest forward needs about {cost.transient:,} bytes, over "
                                      f"the server's memory budget of {self.budget_bytes:,} bytes: shorten the prompt",
                                      "prompt")
            return
        if cost.kv + max(cost.transient, self.forward_bytes) > self.budget_bytes:
            one_block = job.params.model_copy(update={"gen_length": job.params.block_length})
            short = self.memory.cost(len(job.prompt_ids), one_block, self._per_token(job))
            fits_short = short.kv + max(short.transient, self.forward_bytes) <= self.budget_bytes
            field = "max_tokens" if fits_short else "prompt"
            raise RequestTooLarge(
                f"this request needs about {cost.kv + cost.transient:,} bytes (KV {cost.kv:,} + its largest "
                f"forward {cost.transient:,}), over the server's memory budget of {self.budget_bytes:,} bytes even "
                f"alone: shorten {'max_tokens' if fits_short else 'the prompt'}",
                field,
            )

    def _admit(self) -> list[_Running]:
        """Move jobs from the queues into the batch by :func:`~service.admission.plan_admission` (module doc,
        fairness); a job whose configuration was not measured yet is sized first, here on the worker thread.
        Caller holds the lock."""
        joined = []
        self._purge_cancelled()
        blocked = False
        now = time.monotonic()
        for queue in (self._queue, self._shadow):
            if queue is self._shadow and (self._queue or blocked):
                break  # shadow re-decodes only when no user request waits
            for job in [j for j in queue if not j.sized]:
                try:
                    self._check_size(job)
                except RequestTooLarge as exc:
                    queue.remove(job)
                    _set_exception(job, exc)
            jobs = list(queue)
            costs = [self._cost(job) for job in jobs]
            chosen, head = plan_admission(
                [(cost, job.blocked_at) for cost, job in zip(costs, jobs)], [m.cost for m in self._members],
                self.budget_bytes, now, self.forward_bytes, self.max_batch_size, self.backfill_s)
            if head is not None:  # blocked by the running requests (or by those joining before it)
                blocked = True
                jobs[head].blocked_at = jobs[head].blocked_at or now
            for i in chosen:
                queue.remove(jobs[i])
                member = self._join(jobs[i], costs[i])
                if member is not None:
                    joined.append(member)
        self.telemetry.memory_waiting.set(len(self._queue) if blocked else 0)
        self.telemetry.waiting.set(len(self._queue))
        return joined

    def _join(self, job: Job, cost: Cost) -> _Running | None:
        """Make the job's cohort and add it to the batch (a job the engine refuses fails alone)."""

        def on_block(block: int, ids: list[list[int]]) -> None:
            if job.first_block_at is None:
                job.first_block_at = time.monotonic()
            if job.on_block is not None and not job.cancelled:
                job.on_block(block, ids)

        try:
            if job.task is not None:
                cohort = job.task.cohort(self.engine, lambda: job.cancelled)
            else:
                rows = job.rows
                cohort = self.engine.cohort([job.prompt_ids] * len(rows), job.params, rows, self._store(job), on_block,
                                            lambda: [job.cancelled] * len(rows))
        except Exception as exc:  # noqa: BLE001 -- a request the engine refuses fails alone (validated before)
            _set_exception(job, BatchFailed(f"decoding failed: {type(exc).__name__}: {exc}"))
            return None
        now = time.monotonic()
        member = _Running(job, cohort, cost, now, len(self._members) + 1)
        self._members.append(member)
        self._running = [m.job for m in self._members]
        if job.task is None:  # a task steps itself after each iteration (:meth:`_step_tasks`)
            self._batch.join(cohort)
        if job.served is None and not job.internal:
            self.telemetry.queue_time.observe(now - job.admitted_at)
        return member

    # ---- the thread ------------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        self._batch = self.engine.batch(self.max_batched_tokens) if self.max_batched_tokens else self.engine.batch()
        while True:
            with self._cond:
                while True:
                    self._admit()
                    if self._members:
                        break
                    if self._stopping:
                        return
                    self._cond.wait()
                self._publish()
            try:
                self._batch.step(on_done=self._finished)
                self._step_tasks()
            except Exception as exc:  # noqa: BLE001 -- a failed forward fails its requests; the worker goes on
                self._fail_batch(exc)
                if self.fault is not None:
                    return
                continue
            self.telemetry.forwards.observe(self._batch.forwards)
            self.telemetry.row_forwards.inc(getattr(self._batch, "rows", 0))
            for cohort, exc in self._batch.failed:
                if is_device_fault(exc):
                    self._fail_batch(exc)
                    return
            with self._cond:
                for cohort, exc in self._batch.failed:
                    self._fail_member(next(m for m in self._members if m.cohort is cohort), exc)
                self._publish()
                self._cond.notify_all()

    def _step_tasks(self) -> None:
        """One forward of every running task (`service.worker.Job.task`); a finished one leaves at once, a failing
        one fails alone."""
        for member in [m for m in self._members if m.job.task is not None]:
            try:
                more = member.cohort.step()
            except Exception as exc:
                if is_device_fault(exc):
                    raise
                with self._cond:
                    self._fail_member(member, exc)
                    self._cond.notify_all()
                continue
            if not more:
                self._finished(member.cohort)

    def _finished(self, cohort) -> None:
        """A cohort left the batch: its request's result is set now, before the iteration's other forwards."""
        with self._cond:
            self._finish(next(m for m in self._members if m.cohort is cohort))
            self._cond.notify_all()

    def _publish(self) -> None:
        for member in self._members:
            member.peak_rows = max(member.peak_rows, len(self._members))
        self.telemetry.running.set(len(self._members))
        self.telemetry.kv_reserved.set(sum(m.cost.kv for m in self._members))

    def _finish(self, member: _Running) -> None:
        self._members.remove(member)
        self._running = [m.job for m in self._members]
        job = member.job
        if job.task is not None:
            if job.cancelled or member.cohort.cancelled:
                _set_exception(job, JobCancelled("cancelled while running"))
            else:
                _set_result(job, member.cohort.scores())
            return
        report: DecodeReport = self.engine.report(member.cohort)
        if job.cancelled or report.rows[0].finish_reason == "cancelled":
            _set_exception(job, JobCancelled("cancelled while running"))
            return
        if job.served is not None:
            self._record_shadow([job], report)
            return
        if not job.internal:
            self.telemetry.batch_size.observe(member.peak_rows)
            self.telemetry.observe_report(report, job.snapshot.cache_mode, job.snapshot.config)
        _set_result(job, JobResult(report, job.snapshot, member.joined_at - job.admitted_at, member.peak_rows))
        if not job.internal:
            self._maybe_shadow(job, report.rows[0])

    def _fail_member(self, member: _Running, exc: BaseException) -> None:
        """One request raised (its options, its KV store): it fails alone with a 500 naming the cause; the others
        go on (issue 13). Caller holds the lock; the batch already let it go."""
        self.telemetry.worker_faults.labels("false").inc()
        log.error("a request failed alone (%d others go on)", len(self._members) - 1, exc_info=exc)
        self._members.remove(member)
        self._running = [m.job for m in self._members]
        _set_exception(member.job, BatchFailed(f"decoding failed: {type(exc).__name__}: {exc}"))

    def _fail_batch(self, exc: BaseException) -> None:
        fatal = is_device_fault(exc)
        self.telemetry.worker_faults.labels(str(fatal).lower()).inc()
        log.exception("an iteration of %d requests failed (device fault: %s)", len(self._members), fatal)
        error = BatchFailed(f"decoding failed: {type(exc).__name__}: {exc}")
        with self._cond:
            for member in self._members:
                self._batch.leave(member.cohort)
                _set_exception(member.job, error)
            self._members, self._running = [], []
            self._publish()
            self._cond.notify_all()
        if fatal:
            self._fail_everything(exc)
