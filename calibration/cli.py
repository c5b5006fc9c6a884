"""``python -m calibration collect | trace | diagnose | <a method's verb> | report | all``.

A registered method's calibration step is a verb of its own (its plug-in's `service.quant.plugin.CalibrationStep`,
read from the registry: this module names no method); ``report`` and ``all`` run every method's step.

Every verb takes the same settings (:class:`calibration.settings.JobSettings`, one flag each) and a store
(``--store``: ``redis://host:port/db`` or a directory; default the server's, ``DLLM_STORE_URL`` else
``.dllm-kvq/store``, so what calibration stores the server finds). Sharding for parallel runs (a Kubernetes Indexed Job):
``--shard I/N`` makes ``trace``, ``diagnose`` and a step that reads this shard's trajectories handle samples
``I::N``; then one run of a step that reads every sample's sums (or ``report``/``all``) merges them from the shared
store. Without a shared store, each shard writes its sums with ``diagnose --sums-out FILE`` and a step's own flag
may merge them (``fit --merge FILE ...``): the result equals one run over all samples (:mod:`calibration.fit`).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from calibration.settings import JobSettings
from service.commands import prog, store_url_arg
from service.config import DEFAULT_STORE_PREFIX, STORE_HELP, default_store

if TYPE_CHECKING:
    from calibration.job import RunSummary

#: Where ``report`` and ``all`` write without ``--out`` (reports go under runs/, which git ignores).
DEFAULT_OUT = Path("runs") / "calibration"


def _pair(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH (e.g. qa=data/qa.jsonl), got {text!r}")
    return name, path


def _shard(text: str) -> tuple[int, int]:
    index, sep, count = text.partition("/")
    try:
        i, n = int(index), int(count)
    except ValueError:
        i = n = -1
    if not sep or n < 1 or not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"expected I/N with 0 <= I < N (e.g. 0/4), got {text!r}")
    return i, n


#: Flags for settings whose flag name is not the field's.
FIELD_FLAGS = {"shard_index": "--shard", "shard_count": "--shard", "buckets": "--bucket"}
#: Settings whose flag `build_parser` declares by hand (not one flag made from the field).
OWN_FLAGS = ("model", "buckets", "pad_answers", "shard_index", "shard_count")
#: What a flag's help adds to its field's description.
HELP_MORE = {"rounds": "; the log and report say per sample whether the assignment settled: on the shipped corpus "
                       "most samples do not settle even in 12 rounds, benchmarks/trace_convergence.py"}


def _help(name: str) -> str:
    """A `JobSettings` field's description and default, for its flag's help."""
    info = JobSettings.model_fields[name]
    default = info.default
    shown = " ".join(map(str, default)) if isinstance(default, tuple) else default
    return f"{info.description} (default {shown})" if default is not None else str(info.description)


def _add_setting(add, name: str, info, default) -> None:
    """The flag of `JobSettings` field ``name``: a switch for a bool (default off), ``nargs="+"`` for a tuple
    (its ``choices``), else one value of the default's type (int for an optional field)."""
    flag = flag_of(name)
    if isinstance(default, bool):
        add(flag, action="store_true", help=f"{info.description} (default: off)")
    elif isinstance(default, tuple):
        choices = (info.json_schema_extra or {}).get("choices")
        add(flag, type=type(default[0]), nargs="+", choices=choices, default=list(default), help=_help(name))
    else:
        add(flag, type=int if default is None else type(default), default=default,
            help=_help(name) + HELP_MORE.get(name, ""))


def build_parser(methods: bool = True) -> argparse.ArgumentParser:
    """The ``calibrate`` parser: one flag per `JobSettings` field (help and default from the field), the store,
    the model's dtype, device and threads, and the report folder; with ``methods`` a verb per registered method's
    calibration step (`service.quant.registry.calibration_steps`: imports the quantizers, so torch), without it
    only the pipeline's own verbs (what ``--help`` and those verbs need)."""
    defaults = JobSettings()
    common = argparse.ArgumentParser(add_help=False)
    add = common.add_argument
    add("--model", default=None, help="checkpoint dir or HF repo id (default: the embedded model)")
    add("--store", default=None, type=store_url_arg, help=STORE_HELP)
    add("--store-prefix", default=None,
        help=f"Redis key prefix (default: DLLM_STORE_PREFIX, else {DEFAULT_STORE_PREFIX})")
    add("--bucket", type=_pair, action="append", default=[], metavar="NAME=PATH",
        help="a prompt-answer JSONL bucket (repeatable; default: the embedded model's training split for the "
             "embedded model, else the shipped offline corpus)")
    add("--pad-answers", action=argparse.BooleanOptionalAction, default=None,
        help="EOS-pad answers to a block multiple instead of cutting them (default: pad only for the embedded "
             "model's training split)")
    add("--shard", type=_shard, default=(0, 1), metavar="I/N", help="handle samples I::N (default 0/1)")
    for name, info in JobSettings.model_fields.items():
        if name not in OWN_FLAGS:
            _add_setting(add, name, info, getattr(defaults, name))
    add("--dtype", default="float32", help="float32 | bfloat16 | float16 (default float32); part of every work "
        "item's key, since trajectories and diagnostics depend on it")
    add("--device", default="cpu", help="cpu | cuda | cuda:N (default cpu)")
    add("--threads", type=int, default=1, help="torch threads (default 1)")
    add("--out", type=Path, default=DEFAULT_OUT,
        help="report directory of report and all: report.md and the activation bodies (default %(default)s, "
             "ignored by git like everything under runs/)")
    add("--no-progress", action="store_true", help="no progress bars (default: shown)")
    parser = argparse.ArgumentParser(prog=prog("calibration"), description=__doc__.split("\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="verb")
    collect = verbs.add_parser("collect", help="download the paper's corpus (needs internet and `datasets`)",
                               description="download the paper's calibration corpus into bucket JSONL files")
    collect.add_argument("--out", type=Path, required=True, help="directory for the bucket JSONL files (required)")
    helps = dict(VERB_HELP)
    steps = {}
    if methods:
        from service.quant.registry import calibration_steps

        steps = calibration_steps()
        helps = {"trace": helps["trace"], "diagnose": helps["diagnose"],
                 **{verb: entry.calibration.help for verb, entry in steps.items()}, **helps}
    for verb, helptext in helps.items():
        sub = verbs.add_parser(verb, parents=[common], help=helptext, description=helptext)
        if verb == "diagnose":
            sub.add_argument("--sums-out", type=Path,
                             help="also write this shard's merged sums to a JSON file (default: store only)")
        if verb in steps and steps[verb].calibration.flags is not None:
            from calibration.job import resolve

            resolve(steps[verb].calibration.flags)(sub)
    if not methods:
        parser.epilog = ("each registered method's calibration step is a verb too (`calibrate <verb> --help`; "
                         "`report` and `all` run every one)")
    return parser


#: The pipeline's own verbs (a method's calibration step adds its verb, `build_parser`).
VERB_HELP = {
    "trace": "TRACE trajectories of the calibration samples (stored)",
    "diagnose": "per-layer diagnostic sums along the stored trajectories",
    "report": "the calibration report and one activation body per fitted artifact, from the store",
    "all": "trace, diagnose, every registered method's calibration step and report in one run",
}


def settings_from(args: argparse.Namespace) -> JobSettings:
    """The `JobSettings` of parsed flags (`build_parser`: one flag per field)."""
    values = {name: getattr(args, name) for name in JobSettings.model_fields if name not in OWN_FLAGS}
    return JobSettings(
        model=args.model, buckets=dict(args.bucket), pad_answers=args.pad_answers,
        shard_index=args.shard[0], shard_count=args.shard[1],
        **{name: tuple(v) if isinstance(v, list) else v for name, v in values.items()},
    )


def write_activation_configs(summary: RunSummary, k_group_size: int, v_group_size: int, out: Path) -> list[Path]:
    """Write one ready-to-send configuration body (`service.quant.config`) per fitted artifact into
    ``out/activate/``.

    ``<method>-<cache mode>-<bits>bit.json`` for an artifact fitted for a cache mode (a key ``"<mode>/<bits>"``
    in `RunSummary.fitted`, e.g. ``<method>-dual-4bit.json``), ``<method>-<bits>bit.json`` for one fitted for every
    mode (``<method>-4bit.json``); the group sizes are written where the artifact type fixes them
    (`Artifact.activation_fields`). Activating one is a single ``PUT /admin/active/{cache_mode}`` with the file as
    the body (``curl --data @FILE``); the job itself still activates nothing.

    Returns:
        The written paths, sorted.
    """
    from service.quant.config import KVQuantConfig
    from service.quant.registry import method

    configs: dict[str, KVQuantConfig] = {}
    for name, ids in summary.fitted.items():
        fields = method(name).artifact.activation_fields()
        groups = {"k_group_size": k_group_size, "v_group_size": v_group_size}
        for key, artifact_id in ids.items():
            *mode, bits = key.split("/")
            configs["-".join([name, *mode, f"{bits}bit"])] = KVQuantConfig(
                method=name, bits=int(bits), artifact_id=artifact_id,
                **{f: v for f, v in groups.items() if f in fields})
    folder = out / "activate"
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, config in sorted(configs.items()):
        paths.append(folder / f"{name}.json")
        paths[-1].write_text(config.model_dump_json(exclude_none=True) + "\n")
    return paths


def print_summary(summary: RunSummary, seconds: float, out=None, store: str | None = None) -> None:
    """The end-of-run summary: what was computed or found done, ids, Table 4, time, and the store they are in
    (``store``: its location) (to ``out``, default stdout)."""
    out = out or sys.stdout
    print(f"\ncalibration finished in {seconds:.1f} s", file=out)
    if store:
        print(f"  stored in {store}", file=out)
    for kind in sorted(set(summary.computed) | set(summary.skipped)):
        print(f"  {kind}: {summary.computed.get(kind, 0)} computed, {summary.skipped.get(kind, 0)} already stored",
              file=out)
    if summary.seconds:
        print("  seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in summary.seconds.items()), file=out)
    if summary.fitted:
        from service.quant.registry import method

        for name, ids in summary.fitted.items():
            kind = method(name).store_kind
            for key, artifact_id in sorted(ids.items()):
                note = summary.notes.get(artifact_id)
                print(f"  {kind} {key}: {artifact_id}" + (f"  [{note}]" if note else ""), file=out)
    if summary.convergence:
        rows = summary.convergence
        settled = sum(1 for r in rows if r["settled"])
        changes = [abs(r["last_change"]) for r in rows if r["last_change"] is not None]
        change = (f"largest last-round objective change {max(changes):.4f} nats" if changes else
                  "one round each, so no change between rounds to report (--rounds 2 or more measures it)")
        print(f"  TRACE: {settled} of {len(rows)} samples settled (assignment unchanged) within the round limit; "
              f"{change}", file=out)
    for line in summary.not_applied:
        print(f"  {line}", file=out)
    if summary.report:
        print(f"  report: {summary.report}", file=out)
    if summary.activation_configs:
        print("  activation bodies (PUT /admin/active/{cache_mode}): " + ", ".join(summary.activation_configs),
              file=out)
    print(f"  nothing was activated; `{prog('service', 'policies')} activate <cache mode> <id or activation "
          "body>` activates one (--server URL for a running server, else this store)", file=out)


def flag_of(field: str) -> str:
    """The flag that sets a `JobSettings` field (``samples`` -> ``--samples``)."""
    return FIELD_FLAGS.get(field, "--" + field.replace("_", "-"))


def main(argv: list[str] | None = None) -> int:
    """Run ``calibrate <verb>``: 0 when done; 2, one line naming what is wrong and what to do, for bad input (a
    setting, the model, the store, a store holding nothing to fit or report on, ``collect`` without a network)."""
    argv = sys.argv[1:] if argv is None else argv
    # The pipeline's verbs and --help parse without the registry (it imports torch); a method's verb needs it.
    light = not argv or argv[0] in ("collect", "-h", "--help", *VERB_HELP)
    args = build_parser(methods=not light).parse_args(argv)
    name = prog("calibration", args.verb)
    if args.verb == "collect":
        from calibration.collect import CollectError, collect

        try:
            print(collect(args.out))
        except CollectError as exc:
            print(f"{name}: error: {exc}", file=sys.stderr)
            return 2
        return 0
    from pydantic import ValidationError

    from service.store.base import InvalidName, StoreError, StoreUnavailable, open_store

    try:
        settings = settings_from(args)
    except ValidationError as exc:
        reasons = [f"{flag_of(str(e['loc'][0]))}: {e['msg']}" if e["loc"] else e["msg"]
                   for e in exc.errors(include_url=False, include_input=False, include_context=False)]
        print(f"{name}: error: {'; '.join(reasons)}", file=sys.stderr)
        return 2
    # The job logs each sample's TRACE convergence (objective per round, settled or not) at INFO.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    started = time.perf_counter()
    try:
        store = open_store(*default_store(args.store, args.store_prefix))
    except InvalidName as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 2
    try:
        store.list("trajectory")  # opening contacts nothing (open_store); one read does, before the model loads
    except (StoreError, OSError) as exc:
        store.close()
        print(f"{name}: error: --store {store.location}: cannot read it ({exc}); start "
              "the store (redis-server) or give another --store", file=sys.stderr)
        return 2
    try:
        return _run_verb(args, settings, store, started)
    except StoreUnavailable as exc:
        print(f"{name}: error: --store {store.location}: the store went away ({exc})", file=sys.stderr)
        return 2
    except CalibrationInputError as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 2
    finally:
        store.close()


class CalibrationInputError(Exception):
    """Bad input found while running a verb: one line, exit 2."""


def _run_verb(args: argparse.Namespace, settings: JobSettings, store, started: float) -> int:
    """Load the model and run the verb (`main`, after the store answered)."""
    from calibration.job import CalibrationJob
    from service.engine import Engine, EngineInputError

    try:
        engine = Engine.load(settings.model, dtype=args.dtype, device=args.device, threads=args.threads)
    except EngineInputError as exc:
        raise CalibrationInputError(f"--model/--dtype/--device/--threads: {exc}") from None
    job = CalibrationJob(settings, store, engine, progress=not args.no_progress)
    try:
        _dispatch(args, job)
    except FileNotFoundError as exc:  # merged_sums: the store lacks the diagnostic sums fit and report read
        if args.verb in ("trace", "diagnose", "all"):
            raise
        raise CalibrationInputError(f"--store {store.location}: {exc} (`{prog('calibration', 'all')}` runs every "
                                    "step; use the same --model, --samples, --seed and schedule flags)") from None
    if args.verb in ("report", "all"):
        paths = write_activation_configs(job.summary, settings.k_group_size, job.v_group_size, args.out)
        job.summary.activation_configs = [str(p) for p in paths]
    print_summary(job.summary, time.perf_counter() - started, store=store.location)
    return 0


def _dispatch(args: argparse.Namespace, job) -> None:
    """Run the verb's step(s) of ``job``: a pipeline verb, or a method's calibration step (`CalibrationJob.run_step`)."""
    from service.quant.registry import calibration_steps

    if args.verb == "trace":
        job.trace()
    elif args.verb == "diagnose":
        ids = job.diagnose()
        if args.sums_out:
            merged = job.merged_sums(ids)
            args.sums_out.write_text(merged.model_dump_json())
    elif args.verb == "report":
        job.report(args.out)
    elif args.verb == "all":
        job.run_all(args.out)
    else:
        job.run_step(calibration_steps()[args.verb].name, args)


__all__ = ["build_parser", "main", "print_summary", "settings_from", "write_activation_configs"]
