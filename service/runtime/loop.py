"""The runtime's loop and life cycle: one worker thread owns the engine and runs admit -> plan -> run -> finish;
requests join the running batch at the next iteration and leave the moment they finish, admitted by KV memory
(issues #14 and #21; DESIGN.md flow 1). The decisions are the scheduler's pure functions
(`service.runtime.scheduler`); the engine's running batch (`service.engine.batch.RunningBatch`) runs each planned
iteration.

The HTTP side calls :meth:`Worker.submit` (from the event loop; never blocks, never runs torch work) and awaits
the job's future; the worker thread does everything that touches the model, as one loop: admit (move waiting
jobs into the running batch, :func:`~service.runtime.scheduler.plan_admission`), plan (the running requests' next
calls grouped into forwards, :func:`~service.runtime.scheduler.plan_forwards`), run (the running batch runs the
planned forwards), finish (set the results of the jobs that left). Rules:

* **Bounded queue.** At most ``max_queue`` jobs wait; one more raises :class:`QueueFull` (HTTP 429 + Retry-After).
* **Iterations.** The engine's `RunningBatch` runs every running request's next forward call, packed into as few
  forwards as the token budget allows (`service.runtime.scheduler.plan_forwards`). Requests with different
  prompt and response lengths, block lengths, thresholds or steps, temperatures, cache modes and KV
  configurations share them, each with its own KV store; each decodes exactly as it would alone. In an
  iteration where a request makes its first pass, the running requests' passes wait one iteration (never two in
  a row; `service.runtime.scheduler.first_passes_first`, the head-of-line rule), and a block-initial pass over
  more than ``layer_split_tokens`` tokens runs its layers over several iterations, so a request that arrives
  meanwhile waits for one piece of it (`service.runtime.scheduler.split_by_layers`). Likelihood requests are
  planned beside them by the same rules (issue 45): their forwards run piece by piece, wait under the
  head-of-line rule, and take turns within one piece's worth an iteration (:meth:`Worker._step_tasks`).
* **Admission by memory.** Before each iteration the head of the queue joins while the KV bytes of every running
  row plus its own, plus the transient memory of the largest forward with it, fit ``budget_bytes``
  (`service.runtime.scheduler`), and fewer than ``max_rows`` rows run. A request that could never fit, even
  alone, is refused at :meth:`Worker.submit` (:class:`RequestTooLarge`, HTTP 400 naming ``max_tokens`` or the
  prompt).
* **Forwards apart from KV.** The plan packs each iteration's passes into forwards of at most
  ``max_batched_tokens`` input tokens (`service.runtime.scheduler.plan_forwards`); the activation memory of such
  a forward (``forward_bytes``, measured once at start-up, `service.runtime.memory.MemoryModel.measure_forward`)
  is reserved off the budget, so admission counts KV bytes against what is left (a request whose own
  block-initial pass is larger than the token budget runs that pass alone and reserves its own transient).
* **Fairness without head-of-line blocking** (issue 22 item 5). First come, first served, except: while the
  head of the queue waits for memory, requests behind it that are smaller and fit now run beside the running
  ones (backfill), for at most ``backfill_s`` seconds of the head's wait; from then on the memory that frees up
  is reserved for the head (nobody passes it), so it starts within ``backfill_s`` plus the time the requests
  already running take to finish, and a small request never waits for a large one's whole run. With
  ``backfill_s`` None, strictly first come, first served.
* **Preemption** (issue 36 item 5). When the head of the queue does not fit beside the running requests, a
  larger running one that has held its memory longest leaves the batch at its next block boundary, its KV store
  freed, and waits right behind the head; it resumes later with the block-initial pass it was about to make, so
  its output is unchanged and nothing is computed twice (`service.runtime.preemption`: the rule; past
  ``max_preemptions`` preemptions of one request the next ones wait for 1, 2, 3 ... blocks of its progress, so a
  small request never waits for a large one's whole run; counted by ``dllm_preemptions_total``).
* **Snapshots.** A job carries the configuration snapshot taken at admission and its result names it, so a swap
  of the active configuration never changes a request already admitted.
* **Cancellation.** A cancelled job still waiting is dropped (its slot is free at once); a running one (client
  gone, timeout) leaves the batch at the next iteration and its store is cleared at once.
* **Faults.** A request whose decoding fails (its options, its KV store, its result) fails alone with
  :class:`BatchFailed` (HTTP 500 naming the cause), even when it is the iteration's only request; its grammar
  failing mid-decode (`service.engine.grammar.GrammarViolation`, HTTP 400 naming the schema's field) fails it
  alone too; the rest of the batch, likelihood tasks included, goes on and decodes as it would alone
  (`service.engine.batch`, "A failing row fails alone"). An iteration that raises outside every request fails
  its requests and the worker goes on. A device fault it cannot recover from (:func:`is_device_fault`) also fails every waiting
  job and makes the worker unhealthy (readiness 503; new jobs refused with :class:`WorkerUnavailable`).
* **Locking** (issue 34). The lock :meth:`Worker.submit` and :meth:`Worker.cancel` take on the event loop is held
  by the worker thread only for list work and the pure admission plan: probes of new configurations, cohort
  builds and finished jobs' reports and text run outside it (`benchmarks/loop_stall.py`).
* **One running set** (issue 34). The worker's running map is the only record of what runs: each iteration
  gives its cohorts to the batch (``passes(cohorts)``), which keeps no list of its own, and the batch hands back
  what left (``run`` returns the finished cohorts, ``failed`` the failed ones); the results are set after ``run``
  returns, so nothing of the worker (no callback, no lock) runs inside it.
* **Drain.** :meth:`Worker.drain` refuses new jobs and lets admitted ones finish up to a timeout (SIGTERM).
* **Shadow re-decode** (accuracy telemetry, issue #5 item 6): after a quantized job finishes, with probability
  ``shadow_rate`` the same request is queued again with the unquantized cache in a separate low-priority queue;
  shadow jobs join only when no user request waits, and only within the budget; their token agreement and exact
  match with the served output are recorded.
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
from typing import Any

from service.engine.agreement import exact_match, token_agreement
from service.engine.forward_cost import likelihood_work
from service.engine.grammar import GrammarViolation
from service.engine.kv_store import FullPrecisionKVStore, KVStore
from service.engine.params import DecodeParams, RowOptions
from service.engine.prefix_cache import PrefixCache
from service.engine.protocol import DecodeBatch, EngineLike
from service.engine.report import DecodeReport, RowReport
from service.quant.errors import KVQuantError
from service.quant.registry import method
from service.runtime.memory import MemoryModel
from service.runtime.preemption import DEFAULT_MAX_PREEMPTIONS, Holder, plan_preemption
from service.runtime.scheduler import (
    DEFAULT_MAX_BATCHED_TOKENS,
    Cost,
    Hold,
    TaskTurn,
    first_passes_first,
    forward_plan,
    forward_tokens,
    kv_held,
    likelihood_piece,
    likelihood_rows,
    plan_admission,
    take_turns,
    work_tokens,
)
from service.store.active import ConfigSnapshot
from service.store.config_check import ConfigInvalid
from service.telemetry import Telemetry

log = logging.getLogger(__name__)


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
    """What a finished job returns: its rows' report, the snapshot it ran with, the seconds it waited before it
    joined the batch (``queue_s``), and the most requests that ran together with it, itself included
    (``batch_size``)."""

    report: DecodeReport
    snapshot: ConfigSnapshot
    queue_s: float
    batch_size: int

    @property
    def row(self) -> RowReport:
        """The job's (first) row report."""
        return self.report.rows[0]


@dataclass(eq=False)
class Job:
    """One request from the API to the runner: one prompt decoded as ``len(rows)`` rows (``n`` choices: ``row``
    and ``more_rows``, rows of one cohort). The same object waits in the queue, is admitted by the scheduler and
    runs in the batch (``cohort``, ``cost``, ``joined_at``, ``peak_rows`` once it joined); its future carries the
    result.

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
    # When admission first found it at the head of the queue without the memory to start.
    blocked_at: float | None = None
    # Whether admission checked that it can ever fit the memory budget.
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
    # Whether its prompt, params and rows passed `service.engine.engine.validate_request` against the served model
    # (the API checks every job it makes, once): the worker then makes its cohort without checking again.
    validated: bool = False
    # Set by the worker when it joins the running batch: the engine's decoding state of its rows (a `Cohort`, or the
    # task's own), the memory reserved for it, when it joined, the most jobs that ran with it (itself included).
    cohort: Any = None
    cost: Cost | None = None
    joined_at: float | None = None
    peak_rows: int = 0
    # Preemption (`service.runtime.preemption`): when it last joined, how often it was preempted, and while it
    # waits preempted, the next call its cohort resumes with (`RunningBatch.preempt`).
    held_since: float | None = None
    preemptions: int = 0
    pending: Any = None
    # Blocks committed so far (counted by the worker's ``on_block``), and as many when it last joined: its progress
    # since then spaces the preemptions past the cap (`service.runtime.preemption.may_preempt`).
    blocks: int = 0
    joined_blocks: int = 0
    # A likelihood task's last turn (`Worker._step_tasks`: the one that ran longest ago goes first; 0: never ran).
    turn: int = 0

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


KVStoreFactory = Callable[[ConfigSnapshot], KVStore | None]


class Worker:
    """Owns the engine and runs the continuous scheduler; see the module docstring for the rules.

    Args:
        engine: the loaded engine.
        kv_store_factory: builds a job's KV store from its snapshot (None: the engine's full precision).
        telemetry: where metrics go.
        memory: the model's :class:`~service.runtime.memory.MemoryModel`.
        budget_bytes: KV bytes of running rows + the largest forward may not exceed this (>= 1).
        max_rows: most jobs running at once (``max_batch_size`` of the settings, >= 1).
        max_queue: most jobs waiting (>= 1).
        max_batched_tokens: most input tokens of one forward (None: `DEFAULT_MAX_BATCHED_TOKENS`).
        forward_bytes: activation bytes of a forward at ``max_batched_tokens`` (reserved off the budget, >= 0).
        backfill_s: how long a job blocked at the head lets smaller ones that fit pass it (None: never; >= 0).
        retry_after_s: sent with :class:`QueueFull`.
        shadow_rate: probability in [0, 1] of a shadow re-decode of a finished quantized job.
        shadow_queue: most shadow jobs waiting; more are dropped (counted).
        seed: seeds the shadow sampling (tests).
        max_work: most token-forwards one row may cost (`service.runtime.scheduler.work_tokens`); None: no ceiling.
        max_preemptions: how often one request may be preempted (`service.runtime.preemption`; 0: never).
        layer_split_tokens: a full pass of more input tokens runs its layers over several iterations
            (`service.runtime.scheduler.split_by_layers`; 0: never).
        prefix_cache: the engine's prefix cache (`service.engine.prefix_cache`), whose bytes count in the budget
            and which gives way (evicts unreferenced blocks) before a request waits for memory or is preempted;
            None: none.

    Raises:
        ValueError: a limit out of its range.
    """

    def __init__(
        self,
        engine: EngineLike,
        kv_store_factory: KVStoreFactory,
        telemetry: Telemetry,
        memory: MemoryModel,
        budget_bytes: int,
        max_rows: int = 8,
        max_queue: int = 64,
        max_batched_tokens: int | None = None,
        forward_bytes: int = 0,
        backfill_s: float | None = None,
        retry_after_s: int = 1,
        shadow_rate: float = 0.0,
        shadow_queue: int = 16,
        seed: int | None = None,
        max_work: int | None = None,
        max_preemptions: int = DEFAULT_MAX_PREEMPTIONS,
        layer_split_tokens: int = 0,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        if max_rows < 1 or max_queue < 1 or budget_bytes < 1:
            raise ValueError(f"max_rows, max_queue and budget_bytes must be >= 1, got {max_rows}, {max_queue}, "
                             f"{budget_bytes}")
        if forward_bytes < 0 or (backfill_s is not None and backfill_s < 0):
            raise ValueError(f"forward_bytes and backfill_s must be >= 0, got {forward_bytes}, {backfill_s}")
        if not 0.0 <= shadow_rate <= 1.0:
            raise ValueError(f"shadow_rate must be in [0, 1], got {shadow_rate}")
        if max_preemptions < 0:
            raise ValueError(f"max_preemptions must be >= 0, got {max_preemptions}")
        self.engine = engine
        self._kv_store_factory = kv_store_factory
        self.telemetry = telemetry
        self.memory, self.budget_bytes = memory, budget_bytes
        self.prefix_cache = prefix_cache
        #: Bytes the later steps' pools hold beyond their live runs (`service.engine.graphs.LaterSteps.unused_bytes`,
        #: set by `service.main`): counted beside the running requests, as the prefix cache's blocks are.
        self.pool_slack: Callable[[], int] = lambda: 0
        self.max_rows, self.max_queue = max_rows, max_queue
        self.max_batched_tokens, self.forward_bytes, self.backfill_s = max_batched_tokens, forward_bytes, backfill_s
        self._token_budget = DEFAULT_MAX_BATCHED_TOKENS if max_batched_tokens is None else max_batched_tokens
        # A family whose passes cannot be split by layers never has one split (`Capabilities.layer_split`).
        self.layer_split_tokens = layer_split_tokens if engine.capabilities.layer_split else 0
        self._plan = forward_plan(self._token_budget, split_tokens=self.layer_split_tokens,
                                  num_layers=engine.spec.num_layers)
        self._hold = Hold()  # the head-of-line rule's state (`service.runtime.scheduler.first_passes_first`)
        self._turns = 0  # likelihood calls made so far: each task's last one orders their turns (:meth:`_step_tasks`)
        self.retry_after_s = retry_after_s
        self.shadow_rate = shadow_rate
        self.shadow_queue = shadow_queue
        self._rng = random.Random(seed)
        self.max_work = max_work
        self.max_preemptions = max_preemptions
        # Jobs the plan preempted whose cohorts still have to leave the batch (:meth:`_join`, outside the lock).
        self._preempted: list[Job] = []
        self._queue: deque[Job] = deque()
        self._shadow: deque[Job] = deque()
        self._cond = threading.Condition()
        # The running jobs by their cohort, in the order they joined: the one running set. Each iteration gives the
        # batch its cohorts (`RunningBatch.passes`), which keeps no list of its own, and the batch hands back the
        # ones that finished or failed (the return of ``run``, ``failed``), so data flows one way and nothing of
        # ours runs inside ``run``. Mutated by the worker thread only, under the lock (other threads read it under
        # the lock: drain, counts; the worker thread reads it without).
        self._running: dict[Any, Job] = {}
        # Jobs admitted whose cohorts are being built, outside the lock (drain counts them as running).
        self._joining: list[Job] = []
        self._batch: DecodeBatch | None = None  # the engine's running batch, made on the worker thread
        self._accepting = True
        self._stopping = False
        #: Client jobs a drain cancelled because its timeout ran out (the exit status reports it).
        self.cut_by_drain = 0
        self.fault: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="dllm-kvq-worker", daemon=True)
        telemetry.kv_budget.set(budget_bytes)

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
            while (self._queue or self._joining or self._running) and time.monotonic() < deadline:
                self._cond.wait(timeout=max(0.0, deadline - time.monotonic()))
            left = [*self._queue, *self._joining, *self._running.values()]
            self.cut_by_drain += sum(job.served is None and not job.internal for job in left)
            for job in left:
                # The client gets a 503 that says why, not a connection cut by the server's own shutdown.
                _set_exception(job, WorkerUnavailable(f"the server is shutting down and the drain timeout "
                                                      f"({timeout_s:.0f} s) ran out before this request finished"))
                job.cancel()
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=max(1.0, deadline - time.monotonic()))
        return not left

    def stop(self) -> None:
        """Stop at once: cancel everything (used on shutdown after a drain, and in tests)."""
        self.drain(0.0)

    # ---- admission -------------------------------------------------------------------------------------------------
    def submit(self, job: Job) -> Job:
        """Admit a job (never blocks, never runs torch work: the async route calls it on the event loop).

        A configuration whose bytes per token are not measured yet is sized on the worker thread when the job
        comes up for admission, and refused there (the same :class:`RequestTooLarge`, through the job's future).

        Raises:
            RequestTooLarge: its work is over ``max_work`` (``field``: ``max_denoising_steps`` or
                ``max_post_steps`` when the request's own pass count makes it so, else ``steps`` under a fixed
                schedule, else ``max_tokens``); or its KV bytes and its own forward exceed the budget even alone (``field``
                ``max_tokens`` when a one-block response would fit, else ``prompt``).
            WorkerUnavailable: draining, or stopped by a device fault.
            QueueFull: ``max_queue`` jobs already wait.
        """
        if job.task is not None:
            work, field, lower = job.task.work, "prompt", "mc_num"
        else:
            work = work_tokens(len(job.prompt_ids), job.params) * len(job.rows)
            field = lower = "steps" if job.params.steps is not None else "max_tokens"
            for own in ("max_denoising_steps", "max_post_steps"):  # a request's own per-block pass count
                if getattr(job.params, own) and work > work_tokens(
                        len(job.prompt_ids), job.params.model_copy(update={own: None})) * len(job.rows):
                    field = lower = own  # makes its work: name it, not max_tokens
        if self.max_work is not None and work > self.max_work:
            raise RequestTooLarge(f"this request costs up to {work:,} token-forwards (forward calls x tokens), over "
                                  f"the server's ceiling of {self.max_work:,}: lower {lower} or shorten the prompt",
                                  field)
        if (job.task is not None or job.snapshot.config.method == "none"
                or self.memory.knows((job.snapshot.config, job.snapshot.cache_mode))):
            self._check_size(job)
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
        """Jobs in the running batch."""
        return len(self._running)

    def _purge_cancelled(self) -> None:
        """Drop cancelled waiting jobs (caller holds the lock)."""
        if any(j.cancelled for j in self._queue):
            for job in [j for j in self._queue if j.cancelled]:
                self._queue.remove(job)
                _set_exception(job, JobCancelled("cancelled before it started"))
            self.telemetry.waiting.set(len(self._queue))

    def _per_token(self, job: Job) -> float:
        return self.memory.kv_bytes_per_token(_config_key(job), lambda: self._store(job))

    def _cost(self, job: Job, rows: int | None = None, params: DecodeParams | None = None) -> Cost:
        """The memory of ``job`` (`service.runtime.scheduler.Cost`), all its rows, or ``rows`` of them; with
        ``params`` in place of its own."""
        if job.task is not None:  # full passes without cache: no KV held
            hidden, t = 0, len(job.task.ids)
            per_forward = self._task_rows(t)
            layers = self.engine.spec.num_layers
            if likelihood_piece(per_forward, t, 0, self.layer_split_tokens, layers,
                                self.memory.forward.layer_stages(t, layers)):
                # Its forwards run in pieces: the hidden states of a forward between pieces (and in a layer split
                # in parts its q/k/v), and those of a batch cut over several forwards, are held across iterations
                # beside the other requests' forwards.
                hidden = ((per_forward + job.task.mc_batch_size) * self.memory.hidden_bytes(t)
                          + per_forward * self.memory.qkv_bytes(t))
            return Cost(hidden, job.task.transient_bytes(self.memory.forward))
        params = params if params is not None else job.params
        one = self.memory.cost(len(job.prompt_ids), params, self._per_token(job), _config_key(job))
        # The family says what a row holds: its own store's bytes, or a slot in caches its batch shares.
        cache = self.engine.cache_cost(len(job.prompt_ids), params, one.kv, self.memory.quantized(_config_key(job)))
        rows = len(job.rows) if rows is None else rows
        kv = cache.kv * rows
        seq_len = len(job.prompt_ids) + params.gen_length
        if self.layer_split_tokens and rows * seq_len > self.layer_split_tokens:
            # Its block-initial passes are split by layers: the hidden states between two pieces are held across
            # an iteration, beside the other requests' forwards (`service.runtime.scheduler.split_by_layers`).
            kv += rows * self.memory.hidden_bytes(seq_len)
        return Cost(kv, one.transient * rows, cache.slot_bytes * rows, cache.slot_columns)  # n choices: n rows

    def _store(self, job: Job) -> KVStore:
        store = self._kv_store_factory(job.snapshot)
        return store if store is not None else FullPrecisionKVStore()

    def _check_size(self, job: Job) -> None:
        """Raise :class:`RequestTooLarge` if ``job`` could never fit the budget (see :meth:`submit`); else keep its
        cost on the job (``job.cost``: admission then reads it under the lock without measuring anything)."""
        job.sized = True
        cost = job.cost = self._cost(job)
        kv = kv_held([cost])
        if job.task is not None:
            if kv + cost.transient > self.budget_bytes:
                raise RequestTooLarge(f"this request's largest forward needs about {kv + cost.transient:,} "
                                      f"bytes, over the server's memory budget of {self.budget_bytes:,} bytes: "
                                      "shorten the prompt", "prompt")
            return
        if kv + max(cost.transient, self.forward_bytes) > self.budget_bytes:
            one_block = job.params.model_copy(update={"gen_length": job.params.block_length})
            short = self._cost(job, rows=1, params=one_block)
            fits_short = kv_held([short]) + max(short.transient, self.forward_bytes) <= self.budget_bytes
            field = "max_tokens" if fits_short else "prompt"
            single = self._cost(job, rows=1)
            if len(job.rows) > 1 and kv_held([single]) + max(single.transient, self.forward_bytes) <= self.budget_bytes:
                field = "n"  # one choice fits: the n choices' rows are what put it over
            # The forward reserve is a server setting: named as such, never blamed on the prompt (issue 36).
            reserve = max(cost.transient, self.forward_bytes)
            forward = ("its largest forward" if cost.transient >= self.forward_bytes else
                       "the forward reserve of --max-batched-tokens")
            raise RequestTooLarge(
                f"this request needs about {kv + reserve:,} bytes (KV {kv:,} + {forward} {reserve:,}), "
                f"over the server's memory budget of {self.budget_bytes:,} bytes even alone: "
                + {"n": f"its {len(job.rows)} choices do (one fits): lower n", "max_tokens": "shorten max_tokens",
                   "prompt": "shorten the prompt"}[field],
                field,
            )

    def _admit(self) -> list[Job] | None:
        """Choose the jobs that join the batch now by :func:`~service.runtime.scheduler.plan_admission` (module doc,
        fairness), waiting while nothing runs or waits; a job whose configuration was not measured yet is sized
        first (:meth:`_size_waiting`). Returns the chosen jobs (taken from their queues, held in ``_joining``
        until :meth:`_join` makes their cohorts), or None when the worker stops.

        Nothing slow runs under the lock the event loop takes (:meth:`submit`, :meth:`cancel`): the probes of new
        configurations run before it is taken, and under it only list work and the pure plan (costs were kept on
        each job when it was sized)."""
        while True:
            self._size_waiting()
            with self._cond:
                self._purge_cancelled()
                if any(not job.sized for queue in (self._queue, self._shadow) for job in queue):
                    continue  # arrived since: sized first, outside the lock
                chosen = self._choose()
                if chosen or self._running:
                    self._joining = chosen
                    return chosen
                if self._stopping:
                    return None
                self._cond.wait()

    def _size_waiting(self) -> None:
        """Size every waiting job not sized yet (the probe of its configuration, `MemoryModel.kv_bytes_per_token`),
        outside the lock; one that could never fit fails through its future."""
        with self._cond:
            unsized = [job for queue in (self._queue, self._shadow) for job in queue if not job.sized]
        for job in unsized:
            try:
                self._check_size(job)
            except (RequestTooLarge, KVQuantError) as exc:
                # A configuration the loaded family cannot run is found by its probe (DiffusionGemma's packed
                # canvases, `service.quant.canvas.check_geometry`): the request's fault (400), not the worker's.
                exc = _refused(job, exc) if isinstance(exc, KVQuantError) else exc
                with self._cond:
                    for queue in (self._queue, self._shadow):
                        if job in queue:
                            queue.remove(job)
                    self.telemetry.waiting.set(len(self._queue))
                _set_exception(job, exc)

    def _choose(self) -> list[Job]:
        """Take from the queues the jobs that join now (every waiting job is sized). Caller holds the lock."""
        blocked = False
        now = time.monotonic()
        taken: list[Job] = []
        running = [job.cost for job in self._running.values()]
        for queue in (self._queue, self._shadow):
            if queue is self._shadow and (self._queue or blocked):
                break  # shadow re-decodes only when no user request waits
            jobs = list(queue)
            budget = self._budget_beside_cache(running + [job.cost for job in taken], jobs[0].cost if jobs else None)
            chosen, head = plan_admission(
                [(job.cost, job.blocked_at) for job in jobs], running + [job.cost for job in taken],
                budget, now, self.forward_bytes, self.max_rows, self.backfill_s)
            if head is not None and queue is self._queue and self._preempt_for(jobs[head], [jobs[i] for i in chosen]):
                running = [job.cost for job in self._running.values()]
                jobs = list(queue)
                chosen, head = plan_admission(
                    [(job.cost, job.blocked_at) for job in jobs], running + [job.cost for job in taken],
                    budget, now, self.forward_bytes, self.max_rows, self.backfill_s)
            if head is not None:  # blocked by the running requests (or by those joining before it)
                blocked = True
                jobs[head].blocked_at = jobs[head].blocked_at or now
            for i in chosen:
                queue.remove(jobs[i])
                taken.append(jobs[i])
        self.telemetry.memory_waiting.set(len(self._queue) if blocked else 0)
        self.telemetry.waiting.set(len(self._queue))
        return taken

    def _budget_beside_cache(self, running: list[Cost], head: Cost | None) -> int:
        """The budget left to requests beside the prefix cache, after the cache gave way: it evicts its least
        recently used unreferenced blocks until ``running`` (the running requests and those joining) and the head
        of the queue ``head`` fit beside what it keeps (its blocks count in the budget; a referenced block, read by
        a running row, stays). Caller holds the lock; eviction is dictionary work, no device work."""
        cache, budget = self.prefix_cache, self.budget_bytes - self.pool_slack()
        if cache is None:
            return budget
        wanted = [*running, head] if head is not None else running
        transient = max([self.forward_bytes, *(c.transient for c in wanted)])
        over = kv_held(wanted) + transient + cache.held_bytes - budget
        if over > 0:
            cache.evict(over)
        return budget - cache.held_bytes

    def _preempt_for(self, head: Job, joining: list[Job]) -> bool:
        """Preempt the running jobs the rule names for ``head`` (`service.runtime.preemption.plan_preemption`):
        each leaves the running set now and waits right behind ``head`` (a shadow job at the front of its own
        queue); its cohort leaves the batch in :meth:`_join`, outside the lock. Returns whether any was preempted.
        Caller holds the lock."""
        if self.max_preemptions == 0:
            return False
        pausable = self.engine.capabilities.preemption
        jobs = list(self._running.values())
        holders = [Holder(job.cost, job.held_since or 0.0, job.preemptions, pausable and job.task is None,
                          pausable and job.task is None and self._batch.preemptible(job.cohort),
                          job.blocks - job.joined_blocks)
                   for job in jobs]
        holders += [Holder(job.cost, 0.0, 0, False, False) for job in joining]
        budget = self.budget_bytes - (self.prefix_cache.held_bytes if self.prefix_cache is not None else 0)
        budget -= self.pool_slack()
        victims = [jobs[i] for i in plan_preemption(head.cost, holders, budget, self.forward_bytes,
                                                    self.max_preemptions)]
        place = self._queue.index(head) + 1
        for job in victims:
            del self._running[job.cohort]
            job.preemptions += 1
            job.blocked_at = None
            self._preempted.append(job)
            if job.served is None:
                self._queue.insert(place, job)
                place += 1
            else:
                self._shadow.appendleft(job)
            self.telemetry.preemptions.inc()
        if victims:
            log.info("preempted %d running request(s) for the head of the queue", len(victims))
            self._publish()
        return bool(victims)

    def _join(self, jobs: list[Job]) -> None:
        """Take the preempted jobs' cohorts out of the batch (their stores freed, their next calls kept on them),
        make the chosen jobs' cohorts (outside the lock) and add them to the running set, a preempted one with the
        call it stopped at given back to the batch; a job the engine refuses fails alone."""
        for job in self._preempted:
            job.pending = self._batch.preempt(job.cohort)
        self._preempted = []
        made: list[tuple[Job, Any]] = []
        for job in jobs:
            if job.pending is not None:
                made.append((job, job.cohort))
                continue
            try:
                made.append((job, self._cohort(job)))
            except KVQuantError as exc:  # a configuration the family's cache refuses: bad input (400), alone
                _set_exception(job, _refused(job, exc))
            except Exception as exc:  # noqa: BLE001 -- a request the engine refuses fails alone (validated before)
                _set_exception(job, BatchFailed(f"decoding failed: {type(exc).__name__}: {exc}"))
        now = time.monotonic()
        with self._cond:
            self._joining = []
            for job, cohort in made:
                if job.joined_at is None:
                    job.joined_at = now
                job.cohort, job.held_since, job.joined_blocks = cohort, now, job.blocks
                job.peak_rows = max(job.peak_rows, len(self._running) + 1)
                self._running[cohort] = job
        for job, cohort in made:
            resumed, job.pending = job.pending, None
            if resumed is not None:
                self._batch.resume(cohort, resumed)  # preempted: resumes with the call it stopped at
            elif job.served is None and not job.internal:
                self.telemetry.queue_time.observe(now - job.admitted_at)

    def _cohort(self, job: Job) -> Any:
        """The engine's decoding state of ``job``'s rows (or its task's own)."""

        def on_block(block: int, ids: list[list[int]]) -> None:
            job.blocks += 1
            if job.first_block_at is None:
                job.first_block_at = time.monotonic()
            if job.on_block is not None and not job.cancelled:
                job.on_block(block, ids)

        if job.task is not None:
            return job.task.cohort(self.engine, lambda: job.cancelled)
        rows = job.rows
        return self.engine.cohort([job.prompt_ids] * len(rows), job.params, rows, self._store(job), on_block,
                                  lambda: [job.cancelled] * len(rows), validated=job.validated)

    # ---- the thread: admit -> plan -> run -> finish ----------------------------------------------------------------
    def _loop(self) -> None:
        self._batch = self.engine.batch()
        while True:
            chosen = self._admit()
            if chosen is None:
                return
            self._join(chosen)
            with self._cond:
                if not self._running:
                    continue
                self._publish()
            try:
                # The one running set goes to the batch; the likelihood tasks' next calls are planned beside its
                # passes under the same head-of-line rule and run after its forwards (:meth:`_step_tasks`).
                cohorts = [job.cohort for job in self._running.values() if job.task is None]
                turns = [TaskTurn(job.cohort) for job in self._running.values() if job.task is not None]
                passes, self._hold = first_passes_first(self._batch.passes(cohorts) + turns, self._hold)
                forwards = self._plan([p for p in passes if not isinstance(p, TaskTurn)])
                finished = self._batch.run(forwards)
                self._settle(finished, self._batch.failed)
                calls, rows = self._step_tasks({p.cohort for p in passes if isinstance(p, TaskTurn)},
                                               self._token_budget - sum(forward_tokens(group) for group in forwards))
            except Exception as exc:  # noqa: BLE001 -- a failed forward fails its requests; the worker goes on
                self._fail_batch(exc)
                if self.fault is not None:
                    return
                continue
            self.telemetry.forwards.observe(self._batch.forwards + calls)
            self.telemetry.row_forwards.inc(self._batch.rows + rows)
            with self._cond:
                self._publish()
                self._cond.notify_all()

    def _settle(self, finished: list[Any], failed: list[tuple[Any, BaseException]]) -> None:
        """What the iteration handed back (the batch has let these cohorts go): the failed ones' requests fail
        alone, then the finished ones' results are set (:meth:`_finished`), before the tasks' forwards. A device
        fault among the failures is raised (the loop fails everything and stops)."""
        for _cohort, exc in failed:
            if is_device_fault(exc):
                raise exc
        if failed:
            with self._cond:
                for cohort, exc in failed:
                    job = self._running.get(cohort)
                    if job is not None:
                        self._fail_running(job, exc)
                self._cond.notify_all()
        for cohort in finished:
            self._finished(cohort)

    def _step_tasks(self, due: set, tokens_left: int) -> tuple[int, int]:
        """The likelihood tasks' share of the iteration (issue 45 items 7-8), planned as decoding work is: of the
        running tasks the head-of-line rule let run (``due``, their cohorts), the ones that ran longest ago take
        their turns (`service.runtime.scheduler.take_turns`) while their calls stay within the iteration's
        allowance (``layer_split_tokens`` with a split, else ``tokens_left`` of ``max_batched_tokens`` after the
        decoding forwards; the first always runs, so each advances). A call is the next piece of the task's
        forward (`service.runtime.scheduler.likelihood_piece`: whole layers, or parts of a layer when one is
        over the split): its rows fixed for the task (`service.runtime.scheduler.likelihood_rows`) within the
        memory reserved for one forward (the larger of the task's own transient and the forward reserve,
        `PromptLikelihood.bytes`), its work counted as a decoding pass's piece is, its attention included
        (`service.engine.forward_cost.likelihood_work`). A finished task leaves at once, a failing one fails alone. Returns the model calls
        made and their rows (counted in ``dllm_forwards_per_iteration``)."""
        jobs = sorted((j for j in self._running.values() if j.task is not None and j.cohort in due),
                      key=lambda j: j.turn)
        split, layers = self.layer_split_tokens, self.engine.spec.num_layers
        planned = []
        for job in jobs:
            task = job.cohort
            try:
                call = task.next_call(self._task_rows(task.seq_len), max(job.cost.transient, self.forward_bytes))
            except Exception as exc:  # noqa: BLE001 -- this request's fault alone (a device fault is raised on)
                self._task_failed(job, exc)
                continue
            tokens = 0 if call is None else call.rows * task.seq_len
            piece = None if call is None else likelihood_piece(call.rows, task.seq_len, call.at, split, layers,
                                                               task.stages)
            work = 0.0 if call is None else likelihood_work(tokens, piece or (call.at, 2 * tokens * layers),
                                                            task.stages)
            planned.append((job, call, piece, work))
        chosen = take_turns([w for _, _, _, w in planned], split if split else tokens_left)
        calls = rows = 0
        for job, call, piece, _ in (planned[i] for i in chosen):
            self._turns += 1
            job.turn = self._turns
            try:
                more = job.cohort.step(units=piece)
            except Exception as exc:  # noqa: BLE001 -- this request's fault alone (a device fault is raised on)
                self._task_failed(job, exc)
                continue
            if call is not None:
                calls, rows = calls + 1, rows + call.rows
            if not more:
                self._finished(job.cohort)
        return calls, rows

    def _task_failed(self, job: Job, exc: Exception) -> None:
        """A likelihood task raised: it fails alone (a device fault is raised on: the loop fails everything)."""
        if is_device_fault(exc):
            raise exc
        with self._cond:
            self._fail_running(job, exc)
            self._cond.notify_all()

    def _task_rows(self, seq_len: int) -> int:
        """Rows of each forward of a likelihood task over ``seq_len`` tokens (`scheduler.likelihood_rows`)."""
        return likelihood_rows(seq_len, self._token_budget, self.layer_split_tokens, self.engine.spec.num_layers)

    def _finished(self, cohort: Any) -> None:
        """A cohort finished (it left the batch, or its task is done): its request's result is set now. The
        result (its report, its text) is made outside the lock; the lock is taken only to let the job go. A result
        that cannot be made (its report raised) fails that request alone."""
        job = self._running.get(cohort)  # the worker thread is the only writer
        if job is None:
            return
        try:
            outcome = self._outcome(job)
        except Exception as exc:  # noqa: BLE001 -- this request's fault alone
            with self._cond:
                self._fail_running(job, exc)
                self._cond.notify_all()
            return
        with self._cond:
            del self._running[cohort]
            self._publish()  # the gauges drop before the result is out
            self._cond.notify_all()
        if isinstance(outcome, BaseException):
            _set_exception(job, outcome)
        elif outcome is not None:
            _set_result(job, outcome)
        if isinstance(outcome, JobResult) and not job.internal:
            self._maybe_shadow(job, outcome.row)

    def _publish(self) -> None:
        for job in self._running.values():
            job.peak_rows = max(job.peak_rows, len(self._running))
        self.telemetry.running.set(len(self._running))
        reserved = kv_held([job.cost for job in self._running.values()]) + self.pool_slack()
        self.telemetry.kv_reserved.set(reserved)
        self.telemetry.kv_usage.set(min(1.0, reserved / self.budget_bytes))

    def _outcome(self, job: Job) -> Any:
        """What a finished job's future gets: its task's scores, its :class:`JobResult`, or :class:`JobCancelled`;
        None for a shadow job (its agreement is recorded here). Runs outside the lock (reports decode text)."""
        if job.task is not None:
            if job.cancelled or job.cohort.cancelled:
                return JobCancelled("cancelled while running")
            return job.cohort.scores()
        report: DecodeReport = self.engine.report(job.cohort)
        if job.cancelled or report.rows[0].finish_reason == "cancelled":
            return JobCancelled("cancelled while running")
        if job.served is not None:
            self._record_shadow(job, report)
            return None
        if not job.internal:
            self.telemetry.batch_size.observe(job.peak_rows)
            self.telemetry.observe_report(report, job.snapshot.cache_mode, job.snapshot.config, job.params.cache_mode)
        return JobResult(report, job.snapshot, job.joined_at - job.admitted_at, job.peak_rows)

    def _fail_running(self, job: Job, exc: BaseException) -> None:
        """One request failed (its options, its KV store, its result): it fails alone with a 500 naming the
        cause; its grammar failing mid-decode is the request's own error (400 naming its field, not a worker
        fault); the others go on (issues 13, 21). Caller holds the lock; the batch already let it go."""
        self._running.pop(job.cohort, None)
        if isinstance(exc, GrammarViolation):
            log.warning("a request's grammar failed mid-decode (%d others go on): %s", len(self._running), exc)
            _set_exception(job, exc)
            return
        self.telemetry.worker_faults.labels("false").inc()
        log.error("a request failed alone (%d others go on)", len(self._running), exc_info=exc)
        _set_exception(job, BatchFailed(f"decoding failed: {type(exc).__name__}: {exc}"))

    def _fail_batch(self, exc: BaseException) -> None:
        """An iteration raised: every running request fails; a device fault also fails the waiting ones and stops
        the worker."""
        fatal = is_device_fault(exc)
        self.telemetry.worker_faults.labels(str(fatal).lower()).inc()
        log.exception("an iteration of %d requests failed (device fault: %s)", len(self._running), fatal)
        error = BatchFailed(f"decoding failed: {type(exc).__name__}: {exc}")
        with self._cond:
            for job in self._running.values():
                if job.task is None:  # a task is not in the batch and holds no store
                    self._batch.leave(job.cohort)
                _set_exception(job, error)
            self._running = {}
            self._publish()
            if fatal:
                self.fault = exc
                self.telemetry.ready.set(0)
                for job in self._queue:
                    _set_exception(job, WorkerUnavailable(f"the server hit a device fault ({exc})"))
                self._queue.clear()
                self._shadow.clear()
                self.telemetry.waiting.set(0)
            self._cond.notify_all()

    # ---- shadow re-decode ------------------------------------------------------------------------------------------
    def _maybe_shadow(self, job: Job, row: RowReport) -> None:
        if job.snapshot.config.method == "none" or self.shadow_rate == 0.0:
            return
        if job.row.seed is None and self.engine.capabilities.mask_kind == "renoising":
            # A renoising row always samples (its canvas starts random) and, without a seed, draws a fresh one:
            # a re-decode would draw other canvases, so its agreement would measure sampling, not the cache.
            return
        if self._rng.random() >= self.shadow_rate:
            return
        shadow = Job(job.prompt_ids, job.params, job.row, job.snapshot.unquantized(),
                     served=(row.generated_ids, row.text), validated=job.validated)
        # The telemetry labels are those of the served configuration, which the shadow snapshot keeps as origin.
        with self._cond:
            if len(self._shadow) >= self.shadow_queue or not self._accepting:
                self.telemetry.shadow_dropped.inc()
                return
            self._shadow.append(shadow)
            self._cond.notify_all()

    def _record_shadow(self, job: Job, report: DecodeReport) -> None:
        row = report.rows[0]
        served_ids, served_text = job.served
        origin = job.snapshot.origin
        agreement = token_agreement(served_ids, row.generated_ids)
        if served_text is not None and row.text is not None:
            exact = exact_match(served_text, row.text)
        else:
            exact = served_ids == row.generated_ids
        self.telemetry.observe_shadow(origin.config, origin.cache_mode, agreement, exact)


def _set_result(job: Job, result: JobResult) -> None:
    if not job.future.done():
        job.future.set_result(result)


def _set_exception(job: Job, exc: BaseException) -> None:
    if not job.future.done():
        job.future.set_exception(exc)


def _refused(job: Job, exc: KVQuantError) -> ConfigInvalid:
    """The 400 of a K/V configuration the loaded family cannot run (``exc`` from its cache or the admission probe),
    naming the ``kv_quant`` field: a file flag of the CLI's message is the artifact's id on the server."""
    field = exc.field or "method"
    if field.endswith("_file"):
        field = method(job.snapshot.config.method).spelling("artifact_id")
    return ConfigInvalid(f"kv_quant.{field}", f"{exc} (the loaded model's family cannot run this configuration)")


def _config_key(job: Job) -> tuple:
    """The key of ``job``'s K/V configuration in the memory model (`MemoryModel.kv_bytes_per_token`)."""
    return job.snapshot.config, job.snapshot.cache_mode
