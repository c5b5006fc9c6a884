"""The worker: one thread owns the engine, takes admitted jobs from a bounded queue and decodes them in batches.

DESIGN.md flow 1. The HTTP side calls :meth:`Worker.submit` (from the event loop; never blocks) and awaits the
job's future; the worker thread does everything that touches the model. Rules:

* **Bounded queue.** At most ``max_queue`` jobs wait; one more raises :class:`QueueFull` (HTTP 429 + Retry-After).
* **Batching.** The worker takes the oldest job and every queued job compatible with it (same `DecodeParams`:
  response length, block length, cache mode, threshold or steps; and the same KV quantization snapshot), in
  queue order, up to ``max_batch_size``, waiting up to ``batch_wait_s`` for more to arrive. Temperature, seed and
  stop strings are per row (`RowOptions`). The engine guarantees a row decodes the same alone or batched.
* **Snapshots.** A job carries the configuration snapshot taken at admission and its result names it, so a swap
  of the active configuration never changes a request already admitted.
* **Cancellation.** A cancelled job still waiting is dropped (its slot is free at once); a running row is reported
  to the engine through ``cancelled``; a batch whose rows are all cancelled is abandoned at the next committed
  block.
* **Faults.** An exception in a batch fails that batch's jobs (:class:`BatchFailed`, HTTP 500) and the worker goes
  on. A device fault it cannot recover from (:func:`is_device_fault`) also fails every waiting job and makes the
  worker unhealthy (readiness 503; new jobs refused with :class:`WorkerUnavailable`).
* **Drain.** :meth:`Worker.drain` refuses new jobs and lets admitted ones finish up to a timeout (SIGTERM).
* **Shadow re-decode** (accuracy telemetry, issue #5 item 6): after a quantized job finishes, with probability
  ``shadow_rate`` the same request is queued again with the unquantized cache in a separate low-priority queue,
  run only when no normal job waits; its token agreement and exact match with the served output are recorded.
"""

from __future__ import annotations

import concurrent.futures
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from service.admission import work_tokens
from service.engine.agreement import exact_match, token_agreement
from service.engine.batch import spans
from service.engine.kv_store import KVStore
from service.engine.params import DecodeParams, RowOptions
from service.engine.report import DecodeReport, RowReport
from service.engine.spec import ModelSpec
from service.store.active import ConfigSnapshot
from service.telemetry import Telemetry

log = logging.getLogger(__name__)


class EngineLike(Protocol):
    """What the worker needs of `service.engine.Engine` (a fake engine in HTTP-shape tests has the same)."""

    spec: ModelSpec

    def generate(
        self,
        prompts: list[list[int]],
        params: DecodeParams,
        rows: list[RowOptions] | None = None,
        kv_store: KVStore | None = None,
        on_block: Callable[[int, list[list[int]]], None] | None = None,
        cancelled: Callable[[], list[bool]] | None = None,
    ) -> DecodeReport: ...

    def decode_text(self, ids: list[int]) -> str | None: ...

    # The continuous scheduler's interface (`service.engine.batch`): an empty batch, a request's cohort, its report.
    def batch(self) -> Any: ...

    def cohort(
        self,
        prompts: list[list[int]],
        params: DecodeParams,
        rows: list[RowOptions] | None = None,
        kv_store: KVStore | None = None,
        on_block: Callable[[int, list[list[int]]], None] | None = None,
        cancelled: Callable[[], list[bool]] | None = None,
    ) -> Any: ...

    def report(self, cohort: Any) -> DecodeReport: ...

    # A prompt's per-token likelihood (`service.engine.likelihood.PromptLikelihood`: ``step()``, ``scores()``).
    def likelihood(self, ids: list[int], mc_num: int, mc_batch_size: int, seed: int, top_k: int = 0,
                   cancelled: Callable[[], bool] | None = None) -> Any: ...


class WorkerError(Exception):
    """Base of the errors a job can end with."""


class QueueFull(WorkerError):
    """The queue holds ``max_queue`` jobs; retry after ``retry_after_s`` seconds."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestTooLarge(WorkerError):
    """The request needs more memory than the whole budget, even alone; ``field`` names what to shorten
    (``max_tokens`` or ``prompt``)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


class WorkerUnavailable(WorkerError):
    """The worker is draining or stopped by a device fault: no new jobs."""


class BatchFailed(WorkerError):
    """The batch this job ran in raised; the worker lives on."""


class DeviceFault(RuntimeError):
    """An accelerator error after which the worker cannot trust the device (raised by engines or wrappers)."""


class JobCancelled(WorkerError):
    """The client went away (or the request timed out) before the job finished."""


# Messages of torch/CUDA errors after which the CUDA context is unusable (an OOM is not among them: the next,
# smaller batch can succeed).
_FATAL_MARKERS = ("CUDA error", "device-side assert", "illegal memory access", "CUBLAS_STATUS", "NCCL error",
                  "unspecified launch failure")


def is_device_fault(exc: BaseException) -> bool:
    """True if ``exc`` means the device is unusable (a :class:`DeviceFault`, or a CUDA error other than OOM)."""
    if isinstance(exc, DeviceFault):
        return True
    if type(exc).__name__ == "OutOfMemoryError":
        return False
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _FATAL_MARKERS)


@dataclass(frozen=True)
class JobResult:
    """What a finished job returns: its row of the batch report, the snapshot it ran with, times in seconds."""

    report: DecodeReport  # a view of the job's rows of the batch's report (params, timings and kv are the batch's)
    snapshot: ConfigSnapshot
    queue_s: float
    batch_size: int

    @property
    def row(self) -> RowReport:
        """The job's (first) row report."""
        return self.report.rows[0]


@dataclass(eq=False)
class Job:
    """One admitted request: one prompt decoded as ``len(rows)`` rows (``n`` choices: ``row`` and ``more_rows``,
    rows of one cohort).

    ``on_block(block_index, ids)`` is called from the worker thread with the response ids committed so far, one
    list per row of the job; it must not block (the HTTP side hands it to its event loop).
    """

    prompt_ids: list[int]
    params: DecodeParams
    row: RowOptions
    snapshot: ConfigSnapshot
    on_block: Callable[[int, list[list[int]]], None] | None = None
    admitted_at: float = field(default_factory=time.monotonic)
    cancel_event: threading.Event = field(default_factory=threading.Event)
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    first_block_at: float | None = None
    # When the continuous scheduler first found it at the head of the queue without the memory to start.
    blocked_at: float | None = None
    # Whether the continuous scheduler checked that it can ever fit its memory budget.
    sized: bool = False
    # Shadow jobs: the served ids and text to compare against (None for normal jobs).
    served: tuple[list[int], str | None] | None = None
    # The start-up readiness probe: not a user request, so not in the request metrics.
    internal: bool = False
    # Work other than decoding (`service.engine.likelihood.LikelihoodTask`): run as a cohort of its own, its result
    # is the cohort's ``scores()``; ``params`` and ``row`` are then unused.
    task: Any = None
    # The other choices of the same prompt (n > 1, issue 25): decoded with ``row`` as rows of one cohort.
    more_rows: tuple[RowOptions, ...] = ()

    @property
    def rows(self) -> list[RowOptions]:
        """The job's rows: ``row``, then ``more_rows``."""
        return [self.row, *self.more_rows]

    def cancel(self) -> None:
        """Mark the job cancelled (thread-safe, idempotent)."""
        self.cancel_event.set()

    @property
    def cancelled(self) -> bool:
        """Whether the job was cancelled."""
        return self.cancel_event.is_set()

    @property
    def batch_key(self) -> tuple[Any, ...]:
        """Jobs with equal keys can share a batch: decode params, snapshot, shadow or not, internal or not."""
        return (self.params, self.snapshot.config, self.snapshot.cache_mode, self.served is None, self.internal,
                None if self.task is None else id(self))  # a task runs alone


class _AllCancelled(Exception):
    """Raised from ``on_block`` to abandon a batch whose every row is cancelled."""


KVStoreFactory = Callable[[ConfigSnapshot], KVStore | None]


class Worker:
    """Owns the engine; see the module docstring for the rules.

    Args:
        engine: the loaded engine.
        kv_store_factory: builds the KV store of a batch from its snapshot (None: the engine's full precision).
        telemetry: where metrics go.
        max_batch_size, max_queue: limits (>= 1).
        batch_wait_s: how long to wait for compatible jobs to fill a batch.
        retry_after_s: sent with :class:`QueueFull`.
        shadow_rate: probability in [0, 1] of a shadow re-decode of a finished quantized job.
        shadow_queue: most shadow jobs waiting; more are dropped (counted).
        seed: seeds the shadow sampling (tests).
        max_work: most token-forwards one row may cost (`service.admission.work_tokens`); None: no ceiling.
    """

    def __init__(
        self,
        engine: EngineLike,
        kv_store_factory: KVStoreFactory,
        telemetry: Telemetry,
        max_batch_size: int = 8,
        max_queue: int = 64,
        batch_wait_s: float = 0.005,
        retry_after_s: int = 1,
        shadow_rate: float = 0.0,
        shadow_queue: int = 16,
        seed: int | None = None,
        max_work: int | None = None,
    ) -> None:
        if max_batch_size < 1 or max_queue < 1:
            raise ValueError(f"max_batch_size and max_queue must be >= 1, got {max_batch_size}, {max_queue}")
        if not 0.0 <= shadow_rate <= 1.0:
            raise ValueError(f"shadow_rate must be in [0, 1], got {shadow_rate}")
        self.engine = engine
        self._kv_store_factory = kv_store_factory
        self.telemetry = telemetry
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.batch_wait_s = batch_wait_s
        self.retry_after_s = retry_after_s
        self.shadow_rate = shadow_rate
        self.shadow_queue = shadow_queue
        self._rng = random.Random(seed)
        self.max_work = max_work
        self._queue: deque[Job] = deque()
        self._shadow: deque[Job] = deque()
        self._cond = threading.Condition()
        self._running: list[Job] = []
        self._accepting = True
        self._stopping = False
        #: Client jobs a drain cancelled because its timeout ran out (the exit status reports it).
        self.cut_by_drain = 0
        self.fault: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="dllm-kvq-worker", daemon=True)

    # ---- life cycle ------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the worker thread."""
        self._thread.start()

    @property
    def healthy(self) -> bool:
        """False after an unrecoverable device fault or once the thread is gone (jobs submitted before
        :meth:`start` wait for it)."""
        started = self._thread.ident is not None
        return self.fault is None and (not started or self._thread.is_alive())

    @property
    def accepting(self) -> bool:
        """Whether :meth:`submit` admits jobs (not draining, no device fault)."""
        return self._accepting and self.healthy

    def stop_accepting(self) -> None:
        """Refuse new jobs from now on (SIGTERM: readiness fails at once; admitted jobs go on)."""
        with self._cond:
            self._accepting = False

    def drain(self, timeout_s: float) -> bool:
        """Refuse new jobs, let admitted ones finish for up to ``timeout_s``, then cancel the rest and stop.

        Returns True if everything admitted finished in time.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._accepting = False
            self._shadow.clear()
            while (self._queue or self._running) and time.monotonic() < deadline:
                self._cond.wait(timeout=max(0.0, deadline - time.monotonic()))
            finished = not (self._queue or self._running)
            self.cut_by_drain += sum(job.served is None and not job.internal for job in [*self._queue, *self._running])
            for job in [*self._queue, *self._running]:
                # The client gets a 503 that says why, not a connection cut by the server's own shutdown.
                _set_exception(job, WorkerUnavailable(f"the server is shutting down and the drain timeout "
                                                      f"({timeout_s:.0f} s) ran out before this request finished"))
                job.cancel()
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=max(1.0, deadline - time.monotonic()))
        return finished

    def stop(self) -> None:
        """Stop at once: cancel everything (used on shutdown after a drain, and in tests)."""
        self.drain(0.0)

    # ---- admission -------------------------------------------------------------------------------------------------
    def submit(self, job: Job) -> Job:
        """Admit a job (never blocks).

        Raises:
            RequestTooLarge: its work is over ``max_work`` (``field``: ``steps`` under a fixed schedule, else
                ``max_tokens``).
            WorkerUnavailable: draining, or stopped by a device fault.
            QueueFull: ``max_queue`` jobs already wait.
        """
        if job.task is not None:
            work, field, lower = job.task.work, "prompt", "mc_num"
        else:
            work = work_tokens(len(job.prompt_ids), job.params) * len(job.rows)
            field = lower = "steps" if job.params.steps is not None else "max_tokens"
        if self.max_work is not None and work > self.max_work:
            raise RequestTooLarge(f"this request costs up to {work:,} token-forwards (forward calls x tokens), over "
                                  f"the server's ceiling of {self.max_work:,}: lower {lower} or shorten the prompt",
                                  field)
        with self._cond:
            if not self.accepting:
                reason = "is shutting down" if self.fault is None else f"hit a device fault ({self.fault})"
                raise WorkerUnavailable(f"the server {reason}; no new requests are accepted")
            self._purge_cancelled()
            if len(self._queue) >= self.max_queue:
                raise QueueFull(
                    f"the queue is full ({self.max_queue} requests waiting); retry after {self.retry_after_s} s",
                    self.retry_after_s,
                )
            self._queue.append(job)
            self.telemetry.waiting.set(len(self._queue))
            self._cond.notify_all()
        return job

    def cancel(self, job: Job) -> None:
        """Cancel a job; if it still waits, its slot is freed now."""
        job.cancel()
        with self._cond:
            self._purge_cancelled()
            self._cond.notify_all()

    @property
    def num_waiting(self) -> int:
        """Jobs in the queue."""
        return len(self._queue)

    @property
    def num_running(self) -> int:
        """Jobs in the batch being decoded."""
        return len(self._running)

    def _purge_cancelled(self) -> None:
        """Drop cancelled waiting jobs (caller holds the lock)."""
        if any(j.cancelled for j in self._queue):
            for job in [j for j in self._queue if j.cancelled]:
                self._queue.remove(job)
                _set_exception(job, JobCancelled("cancelled before it started"))
            self.telemetry.waiting.set(len(self._queue))

    # ---- the thread ------------------------------------------------------------------------------------------------
    def _next_batch(self) -> list[Job] | None:
        """Wait for work; return the next batch (normal jobs first, then shadow jobs), or None to stop."""
        with self._cond:
            while True:
                self._purge_cancelled()
                if self._queue:
                    break
                if self._shadow:
                    return self._take(self._shadow)
                if self._stopping:
                    return None
                self._cond.wait()
            deadline = time.monotonic() + self.batch_wait_s
            # Wait briefly for more compatible jobs, unless the batch is already full.
            while time.monotonic() < deadline and not self._stopping:
                head = self._queue[0]
                if sum(1 for j in self._queue if j.batch_key == head.batch_key) >= self.max_batch_size:
                    break
                self._cond.wait(timeout=deadline - time.monotonic())
                self._purge_cancelled()
                if not self._queue:
                    return []
            batch = self._take(self._queue)
            self._running = batch
            self.telemetry.waiting.set(len(self._queue))
            self.telemetry.running.set(len(batch))
            return batch

    def _take(self, queue: deque[Job]) -> list[Job]:
        """Remove and return the head of ``queue`` and its compatible followers, up to max_batch_size."""
        key = queue[0].batch_key
        batch = [j for j in queue if j.batch_key == key][: self.max_batch_size]
        for job in batch:
            queue.remove(job)
        return batch

    def _loop(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            if not batch:
                continue
            try:
                self._run(batch)
            finally:
                with self._cond:
                    self._running = []
                    self.telemetry.running.set(0)
                    self._cond.notify_all()
            if self.fault is not None:
                return

    def _run(self, batch: list[Job]) -> None:
        started = time.monotonic()
        is_shadow = batch[0].served is not None
        observed = not is_shadow and not batch[0].internal
        if observed:
            self.telemetry.batch_size.observe(len(batch))
            for job in batch:
                self.telemetry.queue_time.observe(started - job.admitted_at)

        spans = _spans(batch)

        def on_block(block: int, ids: list[list[int]]) -> None:
            if all(j.cancelled for j in batch):
                raise _AllCancelled
            now = time.monotonic()
            for job, span in zip(batch, spans, strict=True):
                if job.first_block_at is None:
                    job.first_block_at = now
                if job.on_block is not None and not job.cancelled:
                    job.on_block(block, ids[span])

        if batch[0].task is not None:
            self._run_task(batch[0])
            return
        snapshot = batch[0].snapshot
        try:
            report = self.engine.generate(
                [j.prompt_ids for j in batch for _ in j.rows],
                batch[0].params,
                rows=[r for j in batch for r in j.rows],
                kv_store=self._kv_store_factory(snapshot),
                on_block=on_block,
                cancelled=lambda: [j.cancelled for j in batch for _ in j.rows],
            )
        except _AllCancelled:
            for job in batch:
                _set_exception(job, JobCancelled("cancelled while running"))
            return
        except Exception as exc:  # one batch's failure must not stop the worker (unless the device is gone)
            fatal = is_device_fault(exc)
            self.telemetry.worker_faults.labels(str(fatal).lower()).inc()
            log.exception("batch of %d failed (device fault: %s)", len(batch), fatal)
            error = BatchFailed(f"decoding failed: {type(exc).__name__}: {exc}")
            for job in batch:
                _set_exception(job, error)
            if fatal:
                self._fail_everything(exc)
            return
        if is_shadow:
            self._record_shadow(batch, report)
            return
        if observed:
            self.telemetry.observe_report(report, snapshot.cache_mode, snapshot.config)
        for job, span in zip(batch, spans, strict=True):
            if job.cancelled:
                _set_exception(job, JobCancelled("cancelled while running"))
                continue
            own = DecodeReport(rows=report.rows[span], params=report.params, timings=report.timings, kv=report.kv)
            _set_result(job, JobResult(own, snapshot, started - job.admitted_at, len(batch)))
            if observed:
                self._maybe_shadow(job, report.rows[span.start])

    def _run_task(self, job: Job) -> None:
        """A job's task alone in a batch of its own, to the end (the batch scheduler)."""
        cohort = job.task.cohort(self.engine, lambda: job.cancelled)
        try:
            while cohort.step():
                pass
        except Exception as exc:  # noqa: BLE001 -- as a failed batch
            _set_exception(job, BatchFailed(f"decoding failed: {type(exc).__name__}: {exc}"))
            return
        if job.cancelled or cohort.cancelled:
            _set_exception(job, JobCancelled("cancelled while running"))
        else:
            _set_result(job, cohort.scores())

    def _fail_everything(self, exc: BaseException) -> None:
        with self._cond:
            self.fault = exc
            self.telemetry.ready.set(0)
            for job in self._queue:
                _set_exception(job, WorkerUnavailable(f"the server hit a device fault ({exc})"))
            self._queue.clear()
            self._shadow.clear()
            self.telemetry.waiting.set(0)

    # ---- shadow re-decode ------------------------------------------------------------------------------------------
    def _maybe_shadow(self, job: Job, row: RowReport) -> None:
        if job.snapshot.config.method == "none" or self.shadow_rate == 0.0:
            return
        if self._rng.random() >= self.shadow_rate:
            return
        shadow = Job(job.prompt_ids, job.params, job.row, job.snapshot.unquantized(), served=(row.generated_ids,
                                                                                              row.text))
        # The telemetry labels are those of the served configuration, which the shadow snapshot keeps as origin.
        with self._cond:
            if len(self._shadow) >= self.shadow_queue or not self._accepting:
                self.telemetry.shadow_dropped.inc()
                return
            self._shadow.append(shadow)
            self._cond.notify_all()

    def _record_shadow(self, batch: list[Job], report: DecodeReport) -> None:
        for job, row in zip(batch, report.rows, strict=True):
            served_ids, served_text = job.served
            origin = job.snapshot.origin
            agreement = token_agreement(served_ids, row.generated_ids)
            if served_text is not None and row.text is not None:
                exact = exact_match(served_text, row.text)
            else:
                exact = served_ids == row.generated_ids
            self.telemetry.observe_shadow(origin.config, origin.cache_mode, agreement, exact)


def _spans(batch: list[Job]) -> list[slice]:
    """Each job's rows in a batch whose rows are the jobs' rows in order."""
    return spans(len(job.rows) for job in batch)


def _set_result(job: Job, result: JobResult) -> None:
    if not job.future.done():
        job.future.set_result(result)


def _set_exception(job: Job, exc: BaseException) -> None:
    if not job.future.done():
        job.future.set_exception(exc)
