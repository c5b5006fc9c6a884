"""The paper's result matrix (Tables 1-2): models x cache modes x bits x methods, scored with lm-eval in-process.

``python -m evaluation matrix --models ... --tasks ... --cache-modes prefix,dual --bits 4,2
--methods none,kivi,kvquant,dllm_kvq --out DIR`` plans the cells (`plan_cells`): per model one **no-cache
reference** row (full recompute), and per cache mode a **cache-only** row (method ``none``) and one row per
quantized method and bit width. Each (cell, task) is one lm-eval run of the in-process model `DllmKvqLM` on one
loaded engine; its result goes to ``DIR/cells/<model>/<weights fingerprint>/<cell>/<task>-<inputs hash>.json`` as
soon as it finishes (written to a temporary file, then renamed), so an interrupted matrix **resumes** by skipping
finished files. The hash covers every input that changes the result (`cell_inputs`: weights, task, limit, few-shot,
decoding settings, the whole KV configuration with its artifact id), so a file is reused only by a run with the
same inputs (issue 17), and a retrained model of the same name does not reuse its predecessor's cells.
`plan_controls` (Table 3) and `plan_sides` (K-only / V-only rows) plan the ablations' cells; `evaluation.ablations`
renders them.

Per (cell, task) the file keeps the task score (the primary metric x 100, `primary_metric`), every metric, the
per-document response token ids and texts, the measured effective bits of the KV reports (mean nominal and
storage, K and V; bytes held), the configuration's configured bits (`service.quant.accounting.configured_bits`)
and the wall time. From those, `build_tables` compares each quantized row with the cache-only row of the same
model and mode, document by document: **exact match** (equal text, %) and **token agreement** (%, DESIGN.md;
`service.engine.agreement`); a cache-only row is compared with the no-cache row the same way.

`write_outputs` renders the paper's layout, one block per model and bit width (rows: no cache; prefix cache:
cache only, KIVI, KVQuant, dLLM-KVQ; dual cache: the same), a column per task and the average over tasks, with
the effective bits (configured, measured nominal and storage) and the agreement columns beside each row, as
``matrix.md``, ``matrix.csv`` and ``matrix.json``, and the plot of accuracy against KV memory
(`evaluation.plots.plot_tradeoff`, ``accuracy_vs_kv.png``).
Every number in them comes from the cell files; nothing is typed in by hand.

A ``dllm_kvq`` cell needs a policy table and a ``kvquant`` cell a fitted state for the model (fingerprint), cache
mode and bits; `find_artifacts` takes the newest matching one from the store (``--store``). Without one the cell
is skipped and listed under the table (the calibration job makes them: ``python -m calibration ...``).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import os
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from evaluation.controls import DEFAULT_RULES, is_fixed_rule, parse_rule, store_fixed_rule

log = logging.getLogger(__name__)

CACHE_MODES = ("prefix", "dual")


def quant_methods() -> tuple[str, ...]:
    """The registered methods that quantize (every plug-in with a quantizer, `service.quant.registry`), in
    registration order: the quantized rows of each block."""
    from service.quant.registry import method, methods

    return tuple(name for name in methods() if method(name).quantizer is not None)


def method_label(name: str) -> str:
    """How a row names a method: its plug-in's label (``"KIVI"``; ``"Cache only"`` for none)."""
    from service.quant.registry import method

    return method(name).title


MODE_LABELS = {"prefix": "Prefix cache", "dual": "Dual cache"}
REFERENCE_LABEL = "No cache (full recompute)"

#: Primary metric per task (lm-eval ``metric,filter`` key); other tasks use their first non-stderr metric.
PRIMARY_METRICS = {
    "gsm8k": "exact_match,flexible-extract",
    "gsm8k_local": "exact_match,flexible-extract",
    "humaneval": "pass@1,create_test",
    "humaneval_local": "pass@1,create_test",
    "mbpp": "pass_at_1,none",
    "minerva_math": "exact_match,none",
}


@dataclass(frozen=True)
class Cell:
    """One row of the matrix for one model: cache mode, method and bits (None for method ``none``).

    ``sides`` (``kv``, ``k``, ``v``: `KVQuantConfig.sides`) makes the K-only and V-only rows; ``rule``
    (``<score type>:<p>``, method ``dllm_kvq``) a fixed-K-rule control of Table 3 (`evaluation.controls`);
    ``key_bias_correction`` (`KVQuantConfig.key_bias_correction`) the rows with the key-bias correction.
    """

    model: str
    cache_mode: str
    method: str
    bits: int | None = None
    sides: str = "kv"
    rule: str | None = None
    key_bias_correction: bool = False

    @property
    def key(self) -> str:
        """Folder key: ``none``, ``prefix-none``, ``dual-kivi-4``, ``dual-kivi-4-konly``,
        ``dual-dllm_kvq-4-fixed-attention-p2`` ..."""
        if self.cache_mode == "none":
            return "none"
        key = f"{self.cache_mode}-{self.method}" + (f"-{self.bits}" if self.bits is not None else "")
        if self.sides != "kv":
            key += f"-{self.sides}only"
        if self.rule is not None:
            score_type, p = parse_rule(self.rule)
            key += f"-fixed-{score_type}-p{p}"
        if self.key_bias_correction:
            key += "-kbc"
        return key

    @property
    def label(self) -> str:
        if self.cache_mode == "none":
            return REFERENCE_LABEL
        label = "Fixed K rule" if self.rule is not None else method_label(self.method)
        return label + KEY_BIAS_LABEL if self.key_bias_correction else label


#: What a corrected row's label adds (`Cell.key_bias_correction`).
KEY_BIAS_LABEL = " + key-bias corr."
#: Legal values of the matrix's ``--key-bias-correction``: no corrected rows, only corrected rows, or each quantized
#: row followed by its corrected twin.
KEY_BIAS_CHOICES = ("off", "on", "both")


def with_key_bias(cells: list[Cell], choice: str) -> list[Cell]:
    """``cells`` with the key-bias correction as ``choice`` says (`KEY_BIAS_CHOICES`); only quantized rows with
    quantized keys (sides ``kv`` or ``k``) take it.

    Raises:
        ValueError: an unknown ``choice`` (the message lists the legal ones).
    """
    if choice not in KEY_BIAS_CHOICES:
        raise ValueError(f"unknown key-bias choice {choice!r}; legal: {', '.join(KEY_BIAS_CHOICES)}")
    out = []
    for cell in cells:
        takes = cell.method in quant_methods() and cell.sides != "v"
        if not takes or choice == "off":
            out.append(cell)
            continue
        if choice == "both":
            out.append(cell)
        out.append(replace(cell, key_bias_correction=True))
    return out


def plan_cells(models: Iterable[str], cache_modes: Iterable[str], bits: Iterable[int],
               methods: Iterable[str]) -> list[Cell]:
    """Every cell in run order: per model the no-cache row, then per mode cache-only and the quantized rows.

    The cache-only row of each mode is always planned (it is the reference of the agreement columns), whether or
    not ``methods`` names ``none``.

    Raises:
        ValueError: an unknown cache mode or method (the message lists the legal ones).
    """
    modes, methods = list(cache_modes), list(methods)
    for mode in modes:
        if mode not in CACHE_MODES:
            raise ValueError(f"unknown cache mode {mode!r}; legal: {', '.join(CACHE_MODES)}")
    for method in methods:
        if method not in ("none", *quant_methods()):
            raise ValueError(f"unknown method {method!r}; legal: none, {', '.join(quant_methods())}")
    cells = []
    for model in models:
        cells.append(Cell(model, "none", "none"))
        for mode in modes:
            cells.append(Cell(model, mode, "none"))
            for b in bits:
                cells.extend(Cell(model, mode, m, int(b)) for m in methods if m != "none")
    return cells


def plan_controls(models: Iterable[str], cache_modes: Iterable[str], bits: Iterable[int],
                  rules: Iterable[str] = DEFAULT_RULES) -> list[Cell]:
    """Table 3's cells (paper "Task-level K-policy controls"): per model, mode and bits the cache-only reference,
    KIVI K/V, one ``dllm_kvq`` cell per fixed K rule, and the fitted dLLM-KVQ policy.

    Raises:
        ValueError: an unknown cache mode or a bad rule (`evaluation.controls.parse_rule`).
    """
    rules = list(rules)
    for rule in rules:
        parse_rule(rule)
    cells = plan_cells(models, cache_modes, bits, ["kivi"])
    out = []
    for cell in cells:
        out.append(cell)
        if cell.method == "kivi":
            out += [Cell(cell.model, cell.cache_mode, "dllm_kvq", cell.bits, rule=r) for r in rules]
            out.append(Cell(cell.model, cell.cache_mode, "dllm_kvq", cell.bits))
    return out


def plan_sides(models: Iterable[str], cache_modes: Iterable[str], bits: Iterable[int],
               methods: Iterable[str]) -> list[Cell]:
    """The K/V ablation's cells: `plan_cells`, and after each quantized cell its K-only and V-only twins."""
    out = []
    for cell in plan_cells(models, cache_modes, bits, methods):
        out.append(cell)
        if cell.method in quant_methods():
            out += [Cell(cell.model, cell.cache_mode, cell.method, cell.bits, sides=s) for s in ("k", "v")]
    return out


def primary_metric(task: str, metrics: dict[str, Any]) -> str:
    """The metric key reported for ``task`` (`PRIMARY_METRICS`, else the first numeric non-stderr metric).

    Raises:
        KeyError: no usable metric in ``metrics``.
    """
    key = PRIMARY_METRICS.get(task)
    if key in metrics:
        return key
    for name, value in metrics.items():
        if "stderr" not in name and isinstance(value, (int, float)) and name not in ("sample_len",):
            return name
    raise KeyError(f"no score in lm-eval's results for task {task!r}: {sorted(metrics)}")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "model"


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def kv_summary(kv_reports: list) -> dict[str, float] | None:
    """Mean effective bits (nominal and storage, K and V) over a run's KV reports, the largest bytes held and the
    largest bf16 size of the same K/V (the cache-only row's footprint in bf16, for `evaluation.plots`)."""
    if not kv_reports:
        return None
    return {
        "k_nominal_bits": statistics.fmean(r.k_nominal_bits for r in kv_reports),
        "v_nominal_bits": statistics.fmean(r.v_nominal_bits for r in kv_reports),
        "k_storage_bits": statistics.fmean(r.k_storage_bits for r in kv_reports),
        "v_storage_bits": statistics.fmean(r.v_storage_bits for r in kv_reports),
        "bytes_held": max(r.bytes_held for r in kv_reports),
        "bf16_bytes": max(r.bf16_bytes for r in kv_reports),
    }


# ---- artifacts -----------------------------------------------------------------------------------------------
def find_artifacts(store, fingerprint: str) -> dict[tuple[str, str, int], str]:
    """Newest stored artifact per (method, cache mode, bits) fitted on the model with ``fingerprint``, for every
    registered method that applies one (an artifact without a cache mode, a KVQuant state, fits every mode).
    Table 3's fixed-rule tables (`evaluation.controls.is_fixed_rule`) are not fitted and never picked."""
    from service.quant.registry import method, methods

    found: dict[tuple[str, str, int], tuple[float, str]] = {}
    for name in methods(with_artifact=True):
        entry = method(name)
        for artifact_id in store.list(entry.store_kind):
            artifact = entry.artifact.from_bytes(store.get(entry.store_kind, artifact_id))
            if artifact.weights_fingerprint != fingerprint or is_fixed_rule(artifact):
                continue
            created = store.info(entry.store_kind, artifact_id).created_at
            for mode in [artifact.cache_mode] if artifact.cache_mode else CACHE_MODES:
                key = (name, mode, artifact.bits)
                if key not in found or created > found[key][0]:
                    found[key] = (created, artifact_id)
    return {key: artifact_id for key, (_, artifact_id) in found.items()}


# ---- running -------------------------------------------------------------------------------------------------
@dataclass
class MatrixSettings:
    """What every cell shares.

    Attributes:
        tasks: lm-eval task names; ``fewshot`` gives their ``num_fewshot`` (None: the task's default).
        limit: documents per task (None: all).
        block_length, threshold: decoding (paper: 32, 0.9).
        gen_length: ``max_gen_toks`` override for every task (None: each task's own).
        batch_size: rows per engine batch.
        chat_tasks: tasks run with lm-eval's ``apply_chat_template`` (instruction models' own task).
        confirm_run_unsafe_code: lm-eval's flag for code-executing tasks (sandbox note: `evaluation.tasks.humaneval`).
        store_url: store for policies and states, and for the scores (accuracy telemetry).
        include_path: folder of extra task YAMLs (`evaluation.tasks.write_task_dir`).
    """

    tasks: list[str]
    fewshot: dict[str, int] = field(default_factory=dict)
    limit: int | None = None
    block_length: int = 32
    threshold: float = 0.9
    gen_length: int | None = None
    batch_size: int = 1
    chat_tasks: frozenset[str] = frozenset()
    confirm_run_unsafe_code: bool = False
    store_url: str | None = None
    include_path: str | None = None

    def decoding(self, task: str) -> dict[str, Any]:
        """The settings that change ``task``'s result, for a cell file's key (`cell_inputs`). ``batch_size`` is
        not one: a batched row decodes exactly as it would alone (DESIGN.md)."""
        return {"limit": self.limit, "num_fewshot": self.fewshot.get(task), "gen_length": self.gen_length,
                "block_length": self.block_length, "threshold": self.threshold, "chat": task in self.chat_tasks}


def tasks_named_nowhere(tasks: list[str], include_path: str | None) -> list[str]:
    """The names in ``tasks`` that neither ``include_path``'s tasks define nor any of lm-eval's task YAML files
    (``lm_eval/tasks/**/*.yaml``) contains, in order: certainly unknown to lm-eval's TaskManager, which takes each
    name (task, group or tag) from a YAML file's text. Scanning those files for the bytes of a name takes seconds;
    indexing them in a TaskManager (`task_manager_for`) takes a minute or more on a small CPU. A name found in some
    file may still be unknown (inside another name, or a comment): `task_manager_for` decides those."""
    from pathlib import Path

    import lm_eval
    from lm_eval.tasks import TaskManager

    rest = list(tasks)
    if include_path:
        own = TaskManager(include_path=include_path, include_defaults=False)
        rest = [t for t in rest if t not in own.all_tasks]
    missing = {t.encode() for t in rest}
    for path in (Path(lm_eval.__file__).parent / "tasks").rglob("*.yaml"):
        if not missing:
            break
        text = path.read_bytes()
        missing = {name for name in missing if name not in text}
    return [t for t in rest if t.encode() in missing]


def task_manager_for(tasks: list[str], include_path: str | None):
    """lm-eval's TaskManager over ``include_path`` alone when it defines every task (indexing lm-eval's thousands
    of built-in tasks takes ~20 s on a small CPU), otherwise over the built-ins too."""
    from lm_eval.tasks import TaskManager

    if include_path:
        own = TaskManager(include_path=include_path, include_defaults=False)
        if all(t in own.all_tasks for t in tasks):
            return own
    return TaskManager(include_path=include_path) if include_path else TaskManager()


def cell_model_args(cell: Cell, settings: MatrixSettings, artifact_id: str | None) -> dict[str, Any]:
    """The in-process model's ``model_args`` for ``cell`` (`evaluation.model_args.EvalModelArgs`)."""
    model_args: dict[str, Any] = {
        "cache_mode": cell.cache_mode, "method": cell.method, "block_length": settings.block_length,
        "threshold": settings.threshold, "batch_size": settings.batch_size, "store": settings.store_url,
    }
    if cell.bits is not None:
        model_args["bits"] = cell.bits
    if cell.sides != "kv":
        model_args["sides"] = cell.sides
    if cell.key_bias_correction:
        model_args["key_bias_correction"] = True
    if artifact_id is not None:
        model_args["artifact_id"] = artifact_id
    return model_args


def cell_configured_bits(cell: Cell, settings: MatrixSettings, artifact_id: str | None, spec
                         ) -> dict[str, float] | None:
    """The configured bits ``{"k", "v"}`` of ``cell`` (`service.quant.accounting.configured_bits`, with the policy
    table its ``artifact_id`` names read from ``settings.store_url``); None for cache-only and KVQuant rows."""
    from evaluation.artifacts import load_artifact
    from evaluation.model_args import EvalModelArgs
    from service.quant.accounting import configured_bits

    config = EvalModelArgs(**cell_model_args(cell, settings, artifact_id)).kv_config
    return configured_bits(config, load_artifact(config, spec, settings.store_url, cell.cache_mode))


def cell_inputs(cell: Cell, task: str, settings: MatrixSettings, artifact_id: str | None,
                fingerprint: str) -> dict[str, Any]:
    """Everything that changes one (cell, task) result: the weights, the task and its decoding settings
    (`MatrixSettings.decoding`), the cache mode and the whole KV configuration, artifact id included (issue 17:
    a saved result is reused only when all of them match)."""
    from evaluation.model_args import EvalModelArgs

    args = EvalModelArgs(**cell_model_args(cell, settings, artifact_id))
    args.kv_config  # noqa: B018 - a cell that names no valid configuration fails here, before any work
    # The configuration's fields by name (not its serialized form, whose spelling may change between versions).
    kv = {"method": cell.method, "bits": cell.bits, "sides": cell.sides, "artifact_id": artifact_id,
          "k_group_size": args.k_group_size, "v_group_size": args.v_group_size}
    if cell.key_bias_correction:  # only when on: the inputs (and so the files) of every other cell stay as they were
        kv["key_bias_correction"] = True
    return {"fingerprint": fingerprint, "task": task, "cache_mode": cell.cache_mode, **settings.decoding(task),
            "kv": kv}


def cell_path(out_dir: Path, cell: Cell, task: str, inputs: dict[str, Any]) -> Path:
    """``out/cells/<model>/<fingerprint[:16]>/<cell key>/<task>-<inputs hash>.json``: keyed by the weights (a
    retrained model of the same name starts afresh) and by a hash of `cell_inputs`, so a run with another
    ``--limit``, few-shot count, decoding setting or artifact never reuses this file, and both stay on disk."""
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:12]
    return out_dir / "cells" / _slug(cell.model) / inputs["fingerprint"][:16] / cell.key / f"{task}-{digest}.json"


def run_cell_task(engine, cell: Cell, task: str, settings: MatrixSettings, task_manager,
                  artifact_id: str | None) -> dict[str, Any]:
    """Score one task under one cell with lm-eval and the in-process model; returns the cell file's content."""
    import lm_eval

    from evaluation.lm import DllmKvqLM

    lm = DllmKvqLM(engine=engine, **cell_model_args(cell, settings, artifact_id))
    started = time.perf_counter()
    results = lm_eval.simple_evaluate(
        model=lm, tasks=[task], task_manager=task_manager, limit=settings.limit,
        num_fewshot=settings.fewshot.get(task),
        gen_kwargs={"max_gen_toks": settings.gen_length} if settings.gen_length else None,
        apply_chat_template=task in settings.chat_tasks, confirm_run_unsafe_code=settings.confirm_run_unsafe_code,
        log_samples=False, bootstrap_iters=0,
    )
    seconds = time.perf_counter() - started
    metrics = {k: v for k, v in results["results"][task].items() if isinstance(v, (int, float))}
    metric = primary_metric(task, metrics)
    return {
        "model": cell.model, "fingerprint": engine.spec.fingerprint, "cell": asdict(cell), "task": task,
        "metric": metric, "score": 100.0 * float(metrics[metric]), "metrics": {k: float(v) for k, v in metrics.items()},
        "config": lm.args.kv_config.model_dump(mode="json"), "artifact_id": artifact_id,
        "inputs": cell_inputs(cell, task, settings, artifact_id, engine.spec.fingerprint),
        "settings": {"limit": settings.limit, "block_length": settings.block_length, "threshold": settings.threshold,
                     "gen_length": settings.gen_length, "batch_size": settings.batch_size,
                     "num_fewshot": settings.fewshot.get(task), "chat": task in settings.chat_tasks},
        "kv": kv_summary(lm.kv_reports), "configured_bits": cell_configured_bits(cell, settings, artifact_id, engine.spec),
        "seconds": seconds,
        "records": [{"doc_id": r.doc_id, "ids": list(r.ids), "text": r.text, "nfe": r.nfe}
                    for r in sorted(lm.records, key=lambda r: (r.doc_id is None, r.doc_id))],
    }


class MissingArtifacts(ValueError):
    """`run_matrix` with ``require_all``: cells whose policy table or KVQuant state is not in the store (the
    message lists each with the reason)."""


def run_matrix(cells: list[Cell], settings: MatrixSettings, out_dir: str | Path,
               load_engine: Callable[[str], Any], on_result: Callable[[dict[str, Any]], None] | None = None,
               task_manager=None, require_all: bool = False) -> dict[str, Any]:
    """Run every (cell, task) whose result with these inputs (`cell_inputs`) is not yet on disk, in order.

    Args:
        cells: from `plan_cells`, `plan_controls` or `plan_sides`.
        out_dir: the matrix folder (cell files under ``cells/``).
        load_engine: model name -> loaded `Engine` (called once per model: its weights' fingerprint keys the
            cell files).
        on_result: called with each new cell file's content (accuracy telemetry).
        task_manager: lm-eval's (`task_manager_for` when None).
        require_all: refuse to skip: a cell without its artifact raises `MissingArtifacts` once the model is loaded,
            before any of its cells runs (a model card must not get a table with rows missing).

    Returns:
        ``{"ran", "skipped", "already_done", "seconds", "fingerprints", "files"}`` (``fingerprints``: model ->
        weights; ``files``: the cell files of this run's settings, run or reused, for `write_outputs`).
    """
    from service.quant.registry import methods

    out = Path(out_dir)
    task_manager = task_manager or task_manager_for(settings.tasks, settings.include_path)
    store = None
    if settings.store_url:
        from service.store.base import open_store

        store = open_store(settings.store_url)
    done, ran, skipped, files = 0, [], [], []
    started = time.perf_counter()
    engines: dict[str, Any] = {}
    artifacts: dict[str, dict] = {}
    try:
        for cell in cells:
            if cell.model not in engines:
                engines[cell.model] = load_engine(cell.model)
                artifacts[cell.model] = find_artifacts(store, engines[cell.model].spec.fingerprint) if store else {}
                missing = [_missing_reason(c) for c in cells if c.model == cell.model and c.rule is None
                           and c.method in methods(with_artifact=True)
                           and (c.method, c.cache_mode, c.bits) not in artifacts[cell.model]]
                if require_all and missing:
                    raise MissingArtifacts(f"{cell.model}: " + "; ".join(missing))
            engine = engines[cell.model]
            artifact_id = None
            if cell.rule is not None:
                if store is None:
                    raise ValueError("a fixed K rule row needs a store (--store) to put its policy table in")
                artifact_id = store_fixed_rule(store, engine.spec, cell.cache_mode, cell.bits, cell.rule)
            elif cell.method in methods(with_artifact=True):
                artifact_id = artifacts[cell.model].get((cell.method, cell.cache_mode, cell.bits))
                if artifact_id is None:
                    reason = _missing_reason(cell).split(": ", 1)[1]
                    skipped.append({"model": cell.model, "cell": cell.key, "reason": reason})
                    log.warning("skip %s %s: %s", cell.model, cell.key, reason)
                    continue
            for task in settings.tasks:
                path = cell_path(out, cell, task, cell_inputs(cell, task, settings, artifact_id,
                                                              engine.spec.fingerprint))
                files.append(path)
                if path.exists():
                    done += 1
                    _add_configured_bits(path, cell, settings, artifact_id, engine.spec)
                    continue
                log.info("run %s %s %s", cell.model, cell.key, task)
                result = run_cell_task(engine, cell, task, settings, task_manager, artifact_id)
                _write_atomic(path, json.dumps(result))
                ran.append({"model": cell.model, "cell": cell.key, "task": task, "seconds": result["seconds"]})
                if on_result is not None:
                    on_result(result)
    finally:
        if store is not None:
            store.close()
    return {"ran": ran, "skipped": skipped, "already_done": done, "seconds": time.perf_counter() - started,
            "fingerprints": {model: engine.spec.fingerprint for model, engine in engines.items()},
            "files": [str(f) for f in files]}


def _add_configured_bits(path: Path, cell: Cell, settings: MatrixSettings, artifact_id: str | None, spec) -> None:
    """A cell file written before results carried ``configured_bits`` gets them (they follow from the cell's
    configuration alone, so nothing is rerun)."""
    result = json.loads(path.read_text())
    if "configured_bits" not in result:
        result["configured_bits"] = cell_configured_bits(cell, settings, artifact_id, spec)
        _write_atomic(path, json.dumps(result))


def _missing_reason(cell: Cell) -> str:
    """``dual-dllm_kvq-2: no policy table for (dual, 2-bit) in the store``."""
    from service.quant.registry import method

    return f"{cell.key}: no {method(cell.method).artifact.LABEL} for ({cell.cache_mode}, {cell.bits}-bit) in the store"


# ---- tables --------------------------------------------------------------------------------------------------
def load_results(out_dir: str | Path, fingerprints: Iterable[str] | None = None,
                 files: Iterable[str | Path] | None = None) -> list[dict[str, Any]]:
    """The cell files of ``files`` (a run's own, `run_matrix`), or every one under ``out_dir/cells``; only those of
    the given weights when ``fingerprints``."""
    paths = [Path(f) for f in files] if files is not None else sorted(Path(out_dir).glob("cells/*/*/*/*.json"))
    results = [json.loads(p.read_text()) for p in paths if p.exists()]
    if fingerprints is not None:
        keep = set(fingerprints)
        results = [r for r in results if r["fingerprint"] in keep]
    return results


def _agreement(rows: list[dict], refs: list[dict]) -> tuple[float, float, int] | None:
    """(exact match %, token agreement %, documents) of ``rows`` against ``refs``, matched by task and doc id."""
    from service.engine.agreement import exact_match, token_agreement

    ref = {(r["task"], rec["doc_id"]): rec for r in refs for rec in r["records"]}
    em, agree = [], []
    for r in rows:
        for rec in r["records"]:
            other = ref.get((r["task"], rec["doc_id"]))
            if other is not None:
                em.append(exact_match(rec["text"], other["text"]))
                agree.append(token_agreement(rec["ids"], other["ids"]))
    if not em:
        return None
    return 100.0 * statistics.fmean(em), 100.0 * statistics.fmean(agree), len(em)


def index_results(results: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict]]:
    """(model, cell key) -> that cell's results (one per task)."""
    by_cell: dict[tuple[str, str], list[dict]] = {}
    for r in results:
        by_cell.setdefault((r["model"], Cell(**r["cell"]).key), []).append(r)
    return by_cell


def table_row(by_cell: dict[tuple[str, str], list[dict]], tasks: list[str], model: str, cell: Cell,
              reference: Cell | None) -> dict[str, Any]:
    """One row: ``label``, ``cache_mode``, ``method``, ``bits``, ``sides``, ``rule``, ``scores`` (task -> score or
    None), ``average`` (None unless every task has a score), ``kv`` (effective bits measured over the run's reused
    tokens, mean of its requests'), ``configured_bits`` (``{"k", "v"}`` nominal bits the configuration sets on full
    groups, `service.quant.accounting.configured_bits`; None for cache-only and KVQuant rows), ``artifact_id``, and
    ``agreement`` against ``reference`` (``{"reference", "exact_match", "token_agreement", "documents"}``)."""
    rows = by_cell.get((model, cell.key), [])
    scores = {t: next((r["score"] for r in rows if r["task"] == t), None) for t in tasks}
    have = [s for s in scores.values() if s is not None]
    kvs = [r["kv"] for r in rows if r.get("kv")]
    kv = {k: statistics.fmean(x[k] for x in kvs) for k in kvs[0]} if kvs else None
    agreement = None
    if reference is not None and rows:
        got = _agreement(rows, by_cell.get((model, reference.key), []))
        if got is not None:
            agreement = {"reference": reference.label, "exact_match": got[0], "token_agreement": got[1],
                         "documents": got[2]}
    return {"label": cell.label, "cache_mode": cell.cache_mode, "method": cell.method, "bits": cell.bits,
            "sides": cell.sides, "rule": cell.rule, "key_bias_correction": cell.key_bias_correction, "scores": scores,
            "average": statistics.fmean(have) if have and len(have) == len(tasks) else None,
            "kv": kv, "configured_bits": next((r.get("configured_bits") for r in rows), None),
            "agreement": agreement, "artifact_id": next((r["artifact_id"] for r in rows), None),
            "seconds": sum(r["seconds"] for r in rows)}


def documents_per_task(results: list[dict[str, Any]]) -> dict[str, int | list[int]]:
    """task -> documents every row of it was scored on (a sorted list when rows differ, which a run's own cell
    files never do: they share `cell_inputs`' limit)."""
    counts: dict[str, set[int]] = {}
    for r in results:
        counts.setdefault(r["task"], set()).add(len(r["records"]))
    return {t: next(iter(c)) if len(c) == 1 else sorted(c) for t, c in sorted(counts.items())}


def documents_line(documents: dict[str, int | list[int]]) -> str:
    """The table's one statement of its documents."""
    if not documents:
        return "No rows."
    if any(isinstance(n, list) for n in documents.values()):
        return "Rows were scored on different documents: " + ", ".join(f"{t}: {n}" for t, n in documents.items())
    return "Every row: the same " + ", ".join(f"{n} documents of {t}" for t, n in documents.items()) + "."


def build_tables(results: list[dict[str, Any]], tasks: list[str] | None = None) -> dict[str, Any]:
    """The matrix as data: per model and bit width a block of rows (paper layout; module docstring; rows as
    `table_row`), and ``documents`` (`documents_per_task`)."""
    tasks = tasks or sorted({r["task"] for r in results})
    by_cell = index_results(results)
    models = list(dict.fromkeys(r["model"] for r in results))
    blocks = []
    for model in models:
        cells = [Cell(**r["cell"]) for r in results if r["model"] == model]
        bit_widths = sorted({c.bits for c in cells if c.bits is not None}, reverse=True) or [None]
        modes = [m for m in CACHE_MODES if any(c.cache_mode == m for c in cells)]
        for bits in bit_widths:
            reference = Cell(model, "none", "none")
            rows = [table_row(by_cell, tasks, model, reference, None)]
            for mode in modes:
                cache_only = Cell(model, mode, "none")
                rows.append(table_row(by_cell, tasks, model, cache_only, reference))
                for method in quant_methods():
                    for corrected in (False, True):
                        quant = Cell(model, mode, method, bits, key_bias_correction=corrected)
                        if (model, quant.key) in by_cell:
                            rows.append(table_row(by_cell, tasks, model, quant, cache_only))
            blocks.append({"model": model, "bits": bits, "rows": rows})
    return {"tasks": tasks, "blocks": blocks, "documents": documents_per_task(results)}


def _fmt(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _pair(k: float | None, v: float | None, digits: int = 2) -> str:
    """``K / V`` bits, or "—" when the row has none."""
    return "—" if k is None or v is None else f"{k:.{digits}f} / {v:.{digits}f}"


#: Decimals of configured bits wherever they are printed (a policy's figure reads the same in every report:
#: calibration summary, report, Table 4, matrix tables, model card).
CONFIGURED_DIGITS = 3


#: How the tables' bit columns read (docs/glossary.md, "Effective bits").
BITS_NOTE = ("K/V bits configured: the nominal bits the configuration sets on full groups, the figure every report of "
             "a policy shows (KVQuant: none, its outliers depend on the data); measured: nominal and storage bits "
             "over the run's reused tokens, where a segment shorter than a group still keeps p tokens at 16 bits.")


def render_markdown(tables: dict[str, Any], skipped: list[dict] | None = None) -> str:
    """Markdown: one table per (model, bits) in the paper's layout, with effective bits and agreement columns."""
    tasks = tables["tasks"]
    head = ["Method", *tasks, "Avg.", "K/V bits configured", "K/V bits measured (nominal)",
            "K/V bits measured (storage)", "Exact match %", "Token agr. %"]
    lines = []
    for block in tables["blocks"]:
        bits = f"{block['bits']}-bit KV" if block["bits"] is not None else "no quantized rows"
        lines += [f"### {block['model']} — {bits}", "", "| " + " | ".join(head) + " |",
                  "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
        mode = None
        for r in block["rows"]:
            if r["cache_mode"] != "none" and r["cache_mode"] != mode:
                mode = r["cache_mode"]
                lines.append(f"| *{MODE_LABELS[mode]}* |" + " |" * (len(head) - 1))
            kv, agr, conf = r["kv"] or {}, r["agreement"], r.get("configured_bits") or {}
            label = r["label"] if r["method"] == "none" else f"{r['label']} ({r['bits']}-bit)"
            cells = [label, *(_fmt(r["scores"][t]) for t in tasks), _fmt(r["average"]),
                     _pair(conf.get("k"), conf.get("v"), CONFIGURED_DIGITS),
                     _pair(kv.get("k_nominal_bits"), kv.get("v_nominal_bits")),
                     _pair(kv.get("k_storage_bits"), kv.get("v_storage_bits")),
                     _fmt(agr["exact_match"], 1) if agr else "—", _fmt(agr["token_agreement"], 1) if agr else "—"]
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", "Exact match and token agreement: quantized rows against the cache-only row of the same mode; "
                  "cache-only rows against the no-cache row. " + BITS_NOTE + " "
                  + documents_line(tables.get("documents", {})), ""]
    if skipped:
        lines += ["Skipped cells:", ""] + [f"- {s['model']} {s['cell']}: {s['reason']}" for s in skipped] + [""]
    return "\n".join(lines)


def render_csv(tables: dict[str, Any]) -> str:
    """CSV, one line per (model, bits block, row)."""
    tasks = tables["tasks"]
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["model", "block_bits", "cache_mode", "method", "bits", *tasks, "average", "k_configured_bits",
                     "v_configured_bits", "k_nominal_bits", "v_nominal_bits", "k_storage_bits", "v_storage_bits",
                     "exact_match", "token_agreement", "agreement_reference", "documents"])
    for block in tables["blocks"]:
        for r in block["rows"]:
            kv, agr, conf = r["kv"] or {}, r["agreement"] or {}, r.get("configured_bits") or {}
            writer.writerow([block["model"], block["bits"] or "", r["cache_mode"], r["method"], r["bits"] or "",
                             *(_csv(r["scores"][t]) for t in tasks), _csv(r["average"]),
                             _csv(conf.get("k")), _csv(conf.get("v")),
                             *(_csv(kv.get(k)) for k in ("k_nominal_bits", "v_nominal_bits", "k_storage_bits",
                                                          "v_storage_bits")),
                             _csv(agr.get("exact_match")), _csv(agr.get("token_agreement")),
                             agr.get("reference", ""), agr.get("documents", "")])
    return buf.getvalue()


def _csv(value: float | None) -> str:
    return "" if value is None else f"{value:.4f}"


#: The trade-off plot under the main tables (`evaluation.plots.plot_tradeoff`).
TRADEOFF_MARKDOWN = """
### Accuracy against KV memory

![Accuracy against KV memory]({png})

One column per cache mode, one point per method and code width (the rows above; methods with the same width and
score share one label); the black stars are the cache-only rows with their K/V counted in bf16, the dotted line
full recompute. Top: KV bytes held at the peak request; bottom: the measured nominal bits per element (mean of K
and V). What to look for: points above and to the left of the others keep more accuracy for less memory; a
method whose 2-bit point drops far below its 4-bit one does not survive that width on this model and task.
"""


def write_outputs(out_dir: str | Path, tasks: list[str] | None = None, skipped: list[dict] | None = None,
                  extra_markdown: str = "", extra_json: dict[str, Any] | None = None,
                  fingerprints: Iterable[str] | None = None, files: Iterable[str | Path] | None = None,
                  table: str = "main", rules: Iterable[str] = DEFAULT_RULES,
                  table4: list[dict[str, Any]] | None = None) -> dict[str, Path]:
    """Write ``<stem>.md``, ``.csv`` and ``.json`` from the cell files in ``out_dir``: ``files`` (a run's own) or
    every one, only those of the given weights when ``fingerprints``. ``table``: ``main`` (stem ``matrix``),
    ``3`` (``table3``, `evaluation.ablations.build_controls` over ``rules``) or ``kv`` (``kv_ablation``,
    `evaluation.ablations.build_sides` with ``table4``'s diagnostics)."""
    from evaluation import ablations

    out = Path(out_dir)
    results = load_results(out, fingerprints, files)
    tasks = tasks or sorted({r["task"] for r in results})
    if table == "3":
        stem, tables = "table3", ablations.build_controls(results, tasks, list(rules))
        md, text_csv = ablations.render_controls_markdown(tables, skipped), ablations.render_rows_csv(tables)
    elif table == "kv":
        stem, tables = "kv_ablation", ablations.build_sides(results, tasks, table4)
        md, text_csv = ablations.render_sides_markdown(tables, skipped), ablations.render_rows_csv(tables)
    else:
        from evaluation.plots import TRADEOFF_PNG, plot_tradeoff

        stem, tables = "matrix", build_tables(results, tasks)
        md, text_csv = render_markdown(tables, skipped), render_csv(tables)
        if plot_tradeoff(tables, out / TRADEOFF_PNG) is not None:
            md += TRADEOFF_MARKDOWN.format(png=TRADEOFF_PNG)
    paths = {"md": out / f"{stem}.md", "csv": out / f"{stem}.csv", "json": out / f"{stem}.json"}
    _write_atomic(paths["md"], md + extra_markdown)
    _write_atomic(paths["csv"], text_csv)
    _write_atomic(paths["json"], json.dumps({**tables, "skipped": skipped or [], **(extra_json or {})}, indent=1))
    return paths
