"""The calibration job: corpus -> TRACE -> diagnostics -> each registered method's fit, through a store.

DESIGN.md flow 2. Every shared step is a method of :class:`CalibrationJob` (and a CLI verb, :mod:`calibration.cli`);
a method's fit is its plug-in's calibration step (`service.quant.plugin.CalibrationStep`, run by
:meth:`CalibrationJob.run_step`), in a module of its own (``calibration/<name>_fit.py``, which documents the kinds
it stores). The job names no method. Its own artifacts go to a :class:`service.store.base.Store` (Redis or a local
directory), immutable:

==================  ========================================================================================
kind                id and content
==================  ========================================================================================
trajectory          ``trace-<h>``, h = hash of the inputs (sample ids, model fingerprint, dtype, schedule, rounds);
                    the :class:`~calibration.trace.Trajectory` JSON, which those inputs determine
calibration_sums    ``diag-<h>``, h = hash of (trajectory id, diagnose settings); one sample's
                    :class:`~calibration.fit.DiagnosticSums`
==================  ========================================================================================

Work items are keyed by their inputs (:meth:`CalibrationJob.input_key`), so a rerun finds what is done and skips
it; each artifact is written whole by the store (temp file + rename, or one Redis SET), so a failed run leaves
finished items and nothing half-written. The job never activates anything: the admin endpoint does.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import platform
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from tqdm.auto import tqdm

from calibration.block_causal import MODE as BLOCK_CAUSAL_MODE
from calibration.block_causal import diagnose_block_causal
from calibration.corpus import HFEncoder, Sample, mixed_chat
from calibration.diagnose import DiagnoseSettings, diagnose_trajectory
from calibration.fit import DiagnosticSums
from calibration.forward import capture_pre_rope, logits_forward
from calibration.report import write_run_report
from calibration.settings import EMBEDDED_TRAIN_SPLIT, JobSettings  # noqa: F401 - EMBEDDED_TRAIN_SPLIT re-exported
from calibration.trace import Trajectory, rollout, trace
from service.artifacts.base import Provenance, canonical_json, default_v_group_size
from service.engine import Engine
from service.engine.families import capabilities_of
from service.quant.registry import calibration_steps, method
from service.store.base import KIND_CALIBRATION_SUMS, KIND_TRAJECTORY, Store

log = logging.getLogger(__name__)
CODE_VERSION = "dllm-kvq calibration 2"

T = TypeVar("T")


def input_key(prefix: str, inputs: Any) -> str:
    """A work item's id: ``prefix-`` + 32 hex digits of SHA-256 over the canonical JSON of its inputs."""
    return f"{prefix}-" + hashlib.sha256(canonical_json(inputs)).hexdigest()[:32]


@dataclass
class RunSummary:
    """What a run did: ids per step, how many items were computed vs found done, and seconds per step."""

    trajectories: list[str] = field(default_factory=list)
    sums: list[str] = field(default_factory=list)
    #: Per method, the ids of its fitted artifacts by what each was fitted for (``"dual/4"``, ``"2"``).
    fitted: dict[str, dict[str, str]] = field(default_factory=dict)
    #: Per artifact id, what the end-of-run summary adds to its line (its fit's Table 4 win rates).
    notes: dict[str, str] = field(default_factory=dict)
    table4: dict[str, dict[str, float]] = field(default_factory=dict)
    computed: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    report: str | None = None
    activation_configs: list[str] = field(default_factory=list)
    convergence: list[dict[str, Any]] = field(default_factory=list)
    fit_layers: dict[str, list[dict]] = field(default_factory=dict)
    #: One line per step that does not apply to the model (a block-causal model's TRACE and report).
    not_applied: list[str] = field(default_factory=list)


def resolve(ref: Callable | str) -> Callable:
    """A calibration step's function (`CalibrationStep.fit`, ``flags``): the function, or the one its
    ``"module:qualified.name"`` names."""
    if callable(ref):
        return ref
    module, _, qualname = ref.partition(":")
    target: Any = importlib.import_module(module)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


class CalibrationJob:
    """One calibration run on one model and one store (module docstring).

    Args:
        settings: the run's settings.
        store: where artifacts go.
        engine: an already loaded engine (else ``Engine.load(settings.model)``).
        progress: show progress bars.
    """

    def __init__(self, settings: JobSettings, store: Store, engine: Engine | None = None,
                 progress: bool = True) -> None:
        self.settings = settings
        self.store = store
        self.engine = engine or Engine.load(settings.model)
        self.progress = progress
        self.summary = RunSummary()
        self._samples: list[Sample] | None = None
        self._trajectory_ids: list[str] | None = None
        #: A block-causal model (LLaDA2): no trajectories, diagnostics over exact committed blocks
        #: (`calibration.block_causal`).
        self.block_causal = capabilities_of(self.spec.arch).cache_kind == "committed"

    def note(self, line: str) -> None:
        """Say once that a step does not apply (`RunSummary.not_applied`, printed by the CLI, and the log)."""
        if line not in self.summary.not_applied:
            self.summary.not_applied.append(line)
            log.info("%s", line)

    # ---- helpers ---------------------------------------------------------------------------------------------
    @property
    def spec(self):
        return self.engine.spec

    @property
    def v_group_size(self) -> int:
        return self.settings.v_group_size or default_v_group_size(self.spec.head_dim)

    def _bar(self, items: Iterable[T], description: str, total: int | None = None) -> Iterable[T]:
        return tqdm(items, desc=description, total=total, disable=not self.progress, leave=False)

    def cached(self, kind: str, key: str, compute: Callable[[], bytes]) -> str:
        """Store ``compute()`` under ``key`` unless it is there; count computed vs skipped items."""
        if self.store.exists(kind, key):
            self.summary.skipped[kind] = self.summary.skipped.get(kind, 0) + 1
        else:
            self.store.put(kind, compute(), key)
            self.summary.computed[kind] = self.summary.computed.get(kind, 0) + 1
        return key

    def timed(self, step: str, started: float) -> None:
        self.summary.seconds[step] = self.summary.seconds.get(step, 0.0) + time.perf_counter() - started

    def input_key(self, prefix: str, inputs: dict[str, Any]) -> str:
        """A work item's id (:func:`input_key`) over ``inputs`` and the job's code version, so that a changed job
        recomputes what it changed."""
        return input_key(prefix, {**inputs, "code": CODE_VERSION})

    def provenance(self, data: str) -> Provenance:
        return Provenance(data=data, code=f"{CODE_VERSION}; torch {torch.__version__}; python "
                                         f"{platform.python_version()}",
                          created_at=None, details={"settings": self.settings.model_dump(
                              mode="json", exclude={"shard_index", "shard_count"})})

    # ---- corpus ----------------------------------------------------------------------------------------------
    def samples(self) -> list[Sample]:
        """Every calibration sample (``mixed_chat`` over the buckets), before sharding."""
        if self._samples is None:
            tokenizer = self.engine.tokenizer
            encoder = HFEncoder(tokenizer, eos_id=self.spec.eos_ids[-1]) if tokenizer is not None else None
            self._samples = mixed_chat(
                self.settings.bucket_paths(), self.settings.samples, encoder,
                block_length=self.settings.block_length, max_answer_length=self.settings.max_answer_length,
                seed=self.settings.seed, pad_id=self.spec.eos_ids[0] if self.settings.pads_answers else None,
            )
        return self._samples

    def trajectory_key(self, sample: Sample) -> str:
        s = self.settings
        return input_key("trace", {
            "prompt_ids": list(sample.prompt_ids), "answer_ids": list(sample.answer_ids),
            "fingerprint": self.spec.fingerprint, "dtype": str(self.engine.dtype), "block_length": s.block_length,
            "steps_per_block": s.steps_per_block, "rounds": s.rounds, "code": CODE_VERSION,
        })

    def shard(self, items: list[T]) -> list[T]:
        return items[self.settings.shard_index::self.settings.shard_count]

    # ---- steps -----------------------------------------------------------------------------------------------
    def trace(self) -> list[str]:
        """TRACE every sample of this shard; returns the trajectory ids (``trajectory`` kind). Later steps of the
        same run call it again and get the ids without another look at the store."""
        if self._trajectory_ids is not None:
            return self._trajectory_ids
        if self.block_causal:
            self.note(f"trace: does not apply to a block-causal model ({self.spec.arch}): committed blocks are "
                       "exact, so there is no stale reuse to reconstruct; diagnose reads each block over its exact "
                       "committed text")
            self._trajectory_ids = []
            return []
        started = time.perf_counter()
        forward = logits_forward(self.engine.model)
        ids = []
        for sample in self._bar(self.shard(self.samples()), "trace"):
            def compute(sample=sample) -> bytes:
                result = trace(sample.prompt_ids, sample.answer_ids, forward, self.spec.mask_id, self.spec.fingerprint,
                               steps_per_block=self.settings.steps_per_block, block_length=self.settings.block_length,
                               max_rounds=self.settings.rounds, batch_size=self.settings.batch_size)
                return canonical_json(result.model_dump(mode="json"))
            ids.append(self.cached(KIND_TRAJECTORY, self.trajectory_key(sample), compute))
            row = convergence_row(ids[-1], self.load_trajectory(ids[-1]), self.settings.rounds)
            self.summary.convergence.append(row)
            log.info("TRACE %s: objective per round %s nats; %s", row["trajectory"],
                     ", ".join(f"{o:.4f}" for o in row["objectives"]),
                     {True: f"settled after {row['rounds']} round(s)", None: "settling not recorded",
                      False: f"not settled at the {row['rounds']}-round limit ("
                             + (f"last change {row['last_change']:+.4f})" if row["last_change"] is not None else
                                "one round: no change between rounds to measure)")}[row["settled"]])
        self.summary.trajectories = self._trajectory_ids = ids
        self.timed("trace", started)
        return ids

    def load_trajectory(self, trajectory_id: str) -> Trajectory:
        return self.store.get_model(KIND_TRAJECTORY, trajectory_id, Trajectory)

    def diagnose_settings(self) -> DiagnoseSettings:
        s = self.settings
        modes = s.cache_modes
        if self.block_causal:  # one cache mode: prefix, which cache mode block serves
            if set(modes) != {BLOCK_CAUSAL_MODE}:
                self.note(f"cache modes: a block-causal model's committed blocks are its reused prefix: policies "
                           f"are fitted for {BLOCK_CAUSAL_MODE} only (what cache mode block serves)")
            modes = (BLOCK_CAUSAL_MODE,)
        return DiagnoseSettings(cache_modes=modes, bits=s.bits, k_group_size=s.k_group_size)

    def sums_key(self, trajectory_id: str) -> str:
        """The sums' id of a trajectory (a block-causal model: of the sample, whose trajectory key names it)."""
        inputs = {"trajectory": trajectory_id, "settings": self.diagnose_settings().as_dict(), "code": CODE_VERSION}
        if self.block_causal:
            inputs["block_causal"] = True
        return input_key("diag", inputs)

    def diagnose(self) -> list[str]:
        """Diagnostic sums of every trajectory of this shard (traced first if missing); returns the sums ids."""
        trajectory_ids = self.trace()
        started = time.perf_counter()
        settings = self.diagnose_settings()
        ids = []
        if self.block_causal:
            for sample in self._bar(self.shard(self.samples()), "diagnose"):
                key = self.trajectory_key(sample)

                def compute(sample=sample, key=key) -> bytes:
                    sums = diagnose_block_causal(self.engine.model, self.spec, sample.prompt_ids, sample.answer_ids,
                                                 key, settings, self.settings.block_length,
                                                 self.settings.steps_per_block)
                    return canonical_json(sums.model_dump(mode="json"))
                ids.append(self.cached(KIND_CALIBRATION_SUMS, self.sums_key(key), compute))
        for trajectory_id in self._bar(trajectory_ids, "diagnose"):
            def compute(trajectory_id=trajectory_id) -> bytes:
                sums = diagnose_trajectory(self.engine.model, self.spec, self.load_trajectory(trajectory_id),
                                           trajectory_id, settings)
                return canonical_json(sums.model_dump(mode="json"))
            ids.append(self.cached(KIND_CALIBRATION_SUMS, self.sums_key(trajectory_id), compute))
        self.summary.sums = ids
        self.timed("diagnose", started)
        return ids

    def all_sums_ids(self) -> list[str]:
        """Sums ids of every sample (all shards): what ``fit`` merges."""
        return [self.sums_key(self.trajectory_key(sample)) for sample in self.samples()]

    def merged_sums(self, sums_ids: list[str]) -> DiagnosticSums:
        """Merge stored per-sample sums (they must all be there: run ``diagnose`` on every shard first)."""
        missing = [i for i in sums_ids if not self.store.exists(KIND_CALIBRATION_SUMS, i)]
        if missing:
            raise FileNotFoundError(
                f"{len(missing)} of {len(sums_ids)} samples have no diagnostic sums in {self.store.url} "
                f"(first: {missing[0]}); run `diagnose` for every shard first"
            )
        merged = None
        for sums_id in sums_ids:
            sums = self.store.get_model(KIND_CALIBRATION_SUMS, sums_id, DiagnosticSums)
            merged = sums if merged is None else merged.merge(sums)
        return merged

    def run_step(self, name: str, args: Any = None) -> dict[str, Any]:
        """Run method ``name``'s calibration step (its plug-in's, `service.quant.plugin.CalibrationStep`) and record
        the ids of what it fitted in the summary; returns its artifacts by what each was fitted for.

        Raises:
            the registry's error for an unknown name (`service.quant.registry.method`); ValueError: the method has
            no calibration step.
        """
        step = method(name).calibration
        if step is None:
            raise ValueError(f"method {name!r} has no calibration step")
        artifacts = resolve(step.fit)(self, args)
        self.summary.fitted.setdefault(name, {}).update({key: a.id for key, a in artifacts.items()})
        return artifacts

    def run_steps(self) -> dict[str, dict[str, Any]]:
        """Every registered method's calibration step (`service.quant.registry.calibration_steps`), in
        registration order; their artifacts by method."""
        return {entry.name: self.run_step(entry.name) for entry in calibration_steps().values()}

    def report(self, out: str | Path) -> Path:
        """Write the markdown report with plots into ``out`` (every method's artifacts are fitted first if
        missing, :meth:`run_steps`)."""
        fitted = self.run_steps()  # the report shows this run's artifacts
        if self.block_causal:
            self.note("report: not written for a block-causal model yet (its plots read TRACE trajectories); the "
                       "policies, states and activation bodies are made")
            return Path(out)
        started = time.perf_counter()
        keys = [self.trajectory_key(sample) for sample in self.samples()]
        trajectory = self.load_trajectory(keys[0])
        convergence = [convergence_row(key, self.load_trajectory(key), self.settings.rounds) for key in keys]
        settings = self.settings.model_dump(mode="json") | {"model": self.spec.model_id}
        path = write_run_report(Path(out), fitted, self.summary.table4, self.engine.model, trajectory, settings,
                                self.summary.seconds, fit_layers=self.summary.fit_layers, convergence=convergence)
        self.timed("report", started)
        self.summary.report = str(path)
        return path

    def run_all(self, out: str | Path) -> RunSummary:
        """trace -> diagnose -> every method's calibration step -> report; returns the summary."""
        self.diagnose()
        self.report(out)
        return self.summary

    def cache_traces(self, trajectory_ids: list[str]):
        """Pre-RoPE K/V (and Fisher weights when asked) of every block-initial state of the trajectories, where
        the block-initial pass writes the cache that later steps reuse."""
        traces = []
        for trajectory_id in self._bar(trajectory_ids, "cache traces"):
            trajectory = self.load_trajectory(trajectory_id)
            schedule = trajectory.schedule
            states = rollout(trajectory.prompt_ids, trajectory.answer_ids, trajectory.assignment, schedule,
                             self.spec.mask_id)
            offset = len(trajectory.prompt_ids)
            for block in range(schedule.num_blocks):
                state = states[block * schedule.steps_per_block]
                targets = None
                if self.settings.fisher:
                    targets = torch.full_like(state, -100)
                    masked = state == self.spec.mask_id
                    targets[masked] = torch.tensor([-100] * offset + list(trajectory.answer_ids))[masked]
                traces.append(capture_pre_rope(self.engine.model, state.to(self.engine.device), targets))
        return traces


def convergence_row(trajectory_id: str, trajectory: Trajectory, round_limit: int) -> dict[str, Any]:
    """One sample's TRACE refinement: objective per round (nats), rounds run, whether the assignment settled, and
    the last round's change of the objective (None after a single round: there is no change to measure). A
    trajectory stored before ``settled`` was recorded counts as
    settled when it stopped before the limit (only a stable assignment stops it early)."""
    settled = trajectory.settled
    if settled is None and trajectory.rounds < round_limit:
        settled = True
    objectives = list(trajectory.objectives)
    return {"trajectory": trajectory_id, "rounds": trajectory.rounds, "objectives": objectives, "settled": settled,
            "last_change": objectives[-1] - objectives[-2] if len(objectives) > 1 else None}

