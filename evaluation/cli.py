"""``python -m evaluation``: the lm-eval launcher, the offline task writer and the result matrix.

Subcommands:

``lm-eval [--preset NAME] [--gsm8k-dir DIR] <lm-eval arguments>``
    Registers the in-process model ``dllm-kvq`` (`evaluation.lm`), writes the offline tasks
    (`evaluation.tasks`) and adds their folder as ``--include_path`` (unless one is given), then hands every other
    argument to lm-eval's own CLI unchanged. With ``--preset`` (`evaluation.protocol`: ``paper``,
    ``paper-offline``) it runs lm-eval once per preset task with that task's ``--num_fewshot`` and the preset's
    ``--gen_kwargs`` (gen length, block length, threshold); arguments given after it still win.
``tasks --out DIR [--gsm8k-dir DIR]``
    Writes the offline task YAMLs to DIR (to pass as lm-eval's ``--include_path`` yourself).
``matrix ...``
    The paper's result matrix (`evaluation.matrix`); ``--help`` lists the options.
``push-scores RESULTS_JSON [--server URL] [--store URL] [--cache-mode M --kv-quant JSON]``
    Sends the task scores of an lm-eval results file to the server's evaluation-score endpoint (accuracy
    telemetry; `evaluation.scores`).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path

from evaluation.protocol import PRESETS, get_preset
from service.commands import prog, store_url_arg
from service.config import STORE_HELP, default_store

#: Where the offline task YAMLs live for lm-eval's ``--include_path``: written by ``scripts/setup.sh`` (and by
#: ``evaluate tasks --out``), rewritten by the launcher on every run that gives no ``--include_path``; under the
#: working directory's ``.dllm-kvq/``, as the default store is (the YAMLs name this checkout's data files).
DEFAULT_TASK_DIR = Path(".dllm-kvq") / "lm-eval-tasks"


def _csv_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _methods(args) -> list[str]:
    """``--methods``, or every registered method (`service.quant.registry`) when not given."""
    if args.methods is not None:
        return _csv_list(args.methods)
    from service.quant.registry import methods

    return list(methods())


def _task_dir(out: Path, gsm8k_dir: str | None) -> Path:
    from evaluation.embedded_task import embedded_task_configs
    from evaluation.tasks import write_task_dir

    return write_task_dir(out, gsm8k_dir, extra=embedded_task_configs())


#: lm-eval's name of the in-process model (`evaluation.lm.MODEL_NAME`; not imported: it loads torch and lm-eval).
IN_PROCESS_MODEL = "dllm-kvq"
#: lm-eval's models that talk to a server over HTTP (their ``base_url`` model_arg names it).
HTTP_MODELS = ("local-completions", "local-chat-completions")


def _split_flags(args: list[str], flags: tuple[str, ...]) -> list[str]:
    """``--flag=value`` as ``--flag value`` for ``flags`` (lm-eval takes both; the launcher reads them)."""
    out = []
    for a in args:
        name, sep, value = a.partition("=")
        out += [name, value] if sep and name in flags else [a]
    return out


def _value(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args[:-1] else None


def parse_model_args(text: str | None) -> dict:
    """lm-eval's ``--model_args``: ``key=value,...`` or a JSON object, as a dict ({} when absent).

    Raises:
        CommandError: a JSON object that does not parse.
    """
    import json

    if not text or not text.strip():
        return {}
    if text.strip().startswith("{"):
        try:
            return json.loads(text)
        except ValueError as exc:
            raise CommandError(f"--model_args: not a JSON object ({exc})") from None
    return dict(part.split("=", 1) for part in text.split(",") if "=" in part)


def with_model_name(args: list[str]) -> list[str]:
    """lm-eval names its output folder after ``model=`` in ``--model_args`` (a random name without one): an
    in-process run of the embedded default model gets ``model=embedded``, so its results land in
    ``<output_path>/embedded/results_*.json`` as the HTTP runs' do."""
    import json

    if _value(args, "--model") != IN_PROCESS_MODEL:
        return args
    text = _value(args, "--model_args")
    if "model" in parse_model_args(text):
        return args
    if text is None:
        return [*args, "--model_args", "model=embedded"]
    i = args.index("--model_args") + 1
    named = (json.dumps({"model": "embedded", **json.loads(text)}) if text.strip().startswith("{")
             else ",".join(filter(None, ["model=embedded", text.strip()])))
    return [*args[:i], named, *args[i + 1:]]


def lm_eval_runs(argv: list[str], task_dir: Callable[[str | None], Path]) -> list[list[str]]:
    """The lm-eval CLI argument lists the ``lm-eval`` subcommand runs, in order (module docstring).

    Args:
        argv: the subcommand's arguments (ours and lm-eval's, mixed).
        task_dir: gsm8k folder or None -> folder of the written offline tasks (called only without
            ``--include_path``).
    """
    parser = argparse.ArgumentParser(prog=prog("evaluation", "lm-eval"), add_help=False)
    parser.add_argument("--preset", choices=sorted(PRESETS))
    parser.add_argument("--gsm8k-dir", help="folder with GSM8K-format train.jsonl and test.jsonl (gsm8k_local)")
    ours, rest = parser.parse_known_args(argv)
    rest = with_model_name(_split_flags(rest, ("--model", "--model_args")))
    if "--include_path" not in rest:
        rest += ["--include_path", str(task_dir(ours.gsm8k_dir))]
    command = "run"
    if rest and rest[0] in ("ls", "validate", "run"):
        command, rest = rest[0], rest[1:]
    if not ours.preset:
        return [[command, *rest]]
    preset = get_preset(ours.preset)
    # Preset first so that the caller's own --gen_kwargs / --num_fewshot, given later, override it.
    return [[command, "--tasks", task, "--num_fewshot", str(shots), "--gen_kwargs", *preset.gen_kwargs(), *rest]
            for task, shots in preset.tasks.items()]


def check_server(args: list[str]) -> None:
    """For lm-eval's HTTP models: the server of ``base_url`` answers (any HTTP status) before lm-eval starts, so a
    server that is not running is one line naming the URL, not lm-eval's retries and a ConnectionError traceback.

    Raises:
        CommandError: no ``base_url``, or nothing answers there.
    """
    import httpx

    if _value(args, "--model") not in HTTP_MODELS:
        return
    url = parse_model_args(_value(args, "--model_args")).get("base_url")
    if not url:
        raise CommandError(f"--model_args: {_value(args, '--model')} needs base_url=http://HOST:PORT/v1/... (the "
                           "server's completions or chat completions URL)")
    try:
        httpx.get(str(url), timeout=10)
    except httpx.HTTPError as exc:
        raise CommandError(f"--model_args base_url={url}: cannot reach the server ({exc or type(exc).__name__}); "
                           f"start it (`{prog('service', 'serve')}`) or fix base_url") from None


def check_chat_template(args: list[str]) -> None:
    """The embedded model's tasks (`evaluation.embedded_task.EMBEDDED_TASKS`) run with lm-eval's
    ``--apply_chat_template``: the model answers chat turns only, and without the template every answer is wrong
    (the task scores 0 with no other sign). The matrix always applies it; here its absence is refused.

    Raises:
        CommandError: a run of an embedded task without ``--apply_chat_template``.
    """
    from evaluation.embedded_task import EMBEDDED_TASKS

    if args[:1] != ["run"] or "--apply_chat_template" in args:
        return
    chat = [t for t in _csv_list(_value(args, "--tasks") or "") if t in EMBEDDED_TASKS]
    if chat:
        raise CommandError(f"--tasks {','.join(chat)}: the embedded model answers only chat turns, so without "
                           "--apply_chat_template every answer is wrong and the task scores 0; add "
                           "--apply_chat_template")


def check_in_process_model_args(args: list[str]) -> None:
    """For the in-process model ``dllm-kvq``: its ``--model_args`` (`evaluation.model_args.EvalModelArgs`) and the
    checkpoint they name, checked before lm-eval starts.

    Raises:
        CommandError: an unknown key or a bad value (naming it and what is legal), or no checkpoint there.
    """
    if _value(args, "--model") != IN_PROCESS_MODEL:
        return
    from evaluation.model_args import EvalModelArgs, ModelArgsError
    from service.engine.errors import EngineInputError
    from service.engine.loading import resolve_checkpoint_dir

    try:
        parsed = EvalModelArgs.parse(parse_model_args(_value(args, "--model_args")))
        resolve_checkpoint_dir(parsed.checkpoint)
    except (ModelArgsError, EngineInputError) as exc:
        raise CommandError(f"--model_args: {exc}") from None


def with_server_model_args(args: list[str]) -> list[str]:
    """For lm-eval's HTTP models, the ``--model_args`` lm-eval cannot find out by itself:

    - ``max_length``: lm-eval's API models read the context length only from this model_arg (default 2048) and
      never from the server; the launcher adds the server's ``max_model_len`` (``GET /v1/models``) unless given;
    - ``tokenizer_backend=huggingface`` when ``tokenizer=`` names a local tokenizer and no backend is given:
      ``local-completions`` otherwise detects the server's remote tokenizer, keeps ``tokenizer=`` as a local one
      and hands it the chat message lists meant for the server (``TypeError: TextEncodeInput must be ...``).

    Arguments are returned unchanged for other models, or when the server does not answer ``/v1/models``
    (`check_server` reports an unreachable server).
    """
    import json
    import os

    import httpx

    if _value(args, "--model") not in HTTP_MODELS:
        return args
    text = _value(args, "--model_args") or ""
    given = parse_model_args(text)
    extra: dict[str, str] = {}
    if "tokenizer" in given and "tokenizer_backend" not in given:
        extra["tokenizer_backend"] = "huggingface"
    url = str(given.get("base_url", ""))
    if "max_length" not in given and "/v1" in url:
        key = os.environ.get("OPENAI_API_KEY")  # what lm-eval's local models send
        try:
            models = httpx.get(url[:url.index("/v1") + 3] + "/models", timeout=10,
                               headers={"Authorization": f"Bearer {key}"} if key else None).json()
            extra["max_length"] = str(int(models["data"][0]["max_model_len"]))
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
            pass  # not this server (or not answering): lm-eval's default stands
    if not extra:
        return args
    named = (json.dumps({**given, **extra}) if text.strip().startswith("{")
             else ",".join(filter(None, [text.strip(), *(f"{k}={v}" for k, v in extra.items())])))
    i = args.index("--model_args") + 1
    return [*args[:i], named, *args[i + 1:]]


def run_lm_eval(argv: list[str]) -> int:
    """The ``lm-eval`` subcommand: register ``dllm-kvq``, then lm-eval's own CLI once per run. Bad input (an
    unknown task or model_arg, an artifact that does not fit, a server that does not answer) is one line."""
    import requests
    from lm_eval.__main__ import cli_evaluate

    import evaluation.lm  # noqa: F401 - registers the dllm-kvq model with lm-eval
    from evaluation.model_args import ModelArgsError
    from service.artifacts.base import ArtifactMismatch
    from service.store.base import StoreError

    runs = lm_eval_runs(argv, lambda gsm8k_dir: _task_dir(DEFAULT_TASK_DIR, gsm8k_dir))
    for args in runs:  # every run's input checked before lm-eval starts (it indexes its tasks first: a minute)
        check_in_process_model_args(args)
        check_server(args)
        check_chat_template(args)
    for args in runs:
        sys.argv = ["lm-eval", *with_server_model_args(args)]
        try:
            cli_evaluate()
        except (ModelArgsError, ArtifactMismatch, StoreError) as exc:
            raise CommandError(f"--model_args: {exc}") from None
        except requests.exceptions.ConnectionError as exc:
            url = parse_model_args(_value(args, "--model_args")).get("base_url")
            raise CommandError(f"--model_args base_url={url}: the server stopped answering ({exc})") from None
        except ValueError as exc:
            if str(exc).startswith("Tasks not found"):
                raise CommandError(f"--tasks: {exc}; `{prog('evaluation', 'lm-eval')} ls tasks` lists them (ours are "
                                   f"in {_value(args, '--include_path')})") from None
            raise CommandError(str(exc).replace("\n", " ")) from None
    return 0


def run_tasks(argv: list[str]) -> int:
    """The ``tasks`` subcommand: write the offline task YAMLs."""
    parser = argparse.ArgumentParser(prog=prog("evaluation", "tasks"))
    parser.add_argument("--out", required=True, help="folder to write <task>.yaml files into (required)")
    parser.add_argument("--gsm8k-dir", help="folder with GSM8K-format train.jsonl and test.jsonl (default: none, "
                                            "no gsm8k_local task)")
    args = parser.parse_args(argv)
    out = _task_dir(Path(args.out), args.gsm8k_dir)
    print("\n".join(sorted(str(p) for p in out.glob("*.yaml"))))
    return 0


def matrix_parser() -> argparse.ArgumentParser:
    """The ``matrix`` subcommand's flags (each with its default in the help)."""
    from evaluation.controls import DEFAULT_RULES

    parser = argparse.ArgumentParser(
        prog=prog("evaluation", "matrix"),
        description="Run the paper's result matrix with lm-eval in-process; resumes from --out.")
    parser.add_argument("--table", choices=TABLES, default="main",
                        help="main: Tables 1-2 (methods x bits x cache modes, matrix.*); 3: the K-policy controls of "
                             "Table 3 (table3.*, needs --store); kv: K-only and V-only rows per method and bits "
                             "(kv_ablation.*; default %(default)s)")
    parser.add_argument("--controls", dest="table", action="store_const", const="3",
                        help="same as --table 3 (default: off)")
    parser.add_argument("--rules", default=",".join(DEFAULT_RULES),
                        help="fixed K rules of --table 3, <score type>:<p> (default %(default)s)")
    parser.add_argument("--models", default="embedded",
                        help="comma list of checkpoints (dir or HF id); 'embedded' = the embedded default model "
                             "(default %(default)s)")
    parser.add_argument("--tasks", required=True, help="comma list of lm-eval task names (required)")
    parser.add_argument("--cache-modes", default="prefix,dual", help="comma list of cache modes (default %(default)s)")
    parser.add_argument("--bits", default="4,2", help="comma list of bit widths, 2, 4, 8 (default %(default)s)")
    parser.add_argument("--methods", default=None,
                        help="comma list of quantization methods; none is the cache-only row (default: every "
                             "registered method: none,kivi,kvquant,dllm_kvq)")
    parser.add_argument("--key-bias-correction", choices=("off", "on", "both"), default="off",
                        help="quantized rows with the key-bias correction (service.quant.key_bias): off, on (only "
                             "corrected rows) or both (each row and its corrected twin; default %(default)s)")
    parser.add_argument("--out", required=True, help="matrix folder (cell files, matrix.md/.csv/.json; required)")
    parser.add_argument("--limit", type=int, help="documents per task (default: all)")
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help="take few-shot counts, gen length, block length and threshold from a protocol "
                             "(default: none, the flags below)")
    parser.add_argument("--num-fewshot", type=int,
                        help="few-shot count for tasks without a preset value (default: each task's own)")
    parser.add_argument("--gen-length", type=int, help="max_gen_toks for every task (default: each task's own)")
    parser.add_argument("--block-length", type=int, default=32, help="decoding block length (default %(default)s)")
    parser.add_argument("--threshold", type=float, default=0.9,
                        help="confidence threshold of parallel decoding (default %(default)s)")
    parser.add_argument("--batch-size", type=int, default=1, help="rows decoded together (default %(default)s)")
    parser.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (default %(default)s)")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (default %(default)s)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's own)")
    parser.add_argument("--chat-tasks", default="",
                        help="comma list of tasks run with the chat template (the embedded task always is; "
                             "default: no others)")
    parser.add_argument("--confirm-run-unsafe-code", action="store_true",
                        help="allow code-executing tasks (humaneval, mbpp); run them in a sandbox (default: refused)")
    parser.add_argument("--store", type=store_url_arg, help="policies, states and scores: " + STORE_HELP)
    parser.add_argument("--gsm8k-dir", help="folder with GSM8K-format train.jsonl and test.jsonl (default: none, "
                                            "no gsm8k_local task)")
    parser.add_argument("--from-calibration", metavar="RUN_ID",
                        help="add Table 4 (trajectory-level diagnostics) from a calibration run in --store "
                             "(default: none)")
    parser.add_argument("--server", help="server base URL to push each finished score to, accuracy telemetry "
                                         "(default: none)")
    parser.add_argument("--card", metavar="DIR",
                        help="model folder whose card gets the table (quantization.json + README section; one "
                             "model; default: none)")
    parser.add_argument("--admin-key-env", default="DLLM_ADMIN_KEY",
                        help="environment variable holding the server's admin key (default DLLM_ADMIN_KEY)")
    return parser


class CommandError(Exception):
    """Bad input of a subcommand: printed as one line (naming the flag), exit status 2, no traceback."""


#: ``--table`` -> (output file stem, what it is).
TABLES = ("main", "3", "kv")
STEMS = {"main": "matrix", "3": "table3", "kv": "kv_ablation"}


def check_matrix_inputs(args: argparse.Namespace, tasks: list[str]) -> None:
    """Every input of ``matrix`` checked before any work (issue 17): models, bits, cache modes, methods, rules, the
    store, the calibration run, the card folder, the task folder and the admin key.

    Raises:
        CommandError: the first bad input, naming its flag and what was looked for where.
    """
    import os

    from evaluation.calibration_table import calibration_record
    from evaluation.controls import parse_rule

    if not tasks:
        raise CommandError("--tasks is empty; give a comma list of lm-eval task names (e.g. digit_ledger)")
    for name in _csv_list(args.models):
        if name != "embedded" and (name.startswith((".", "/", "~")) or Path(name).exists()) \
                and not Path(name).expanduser().is_dir():
            raise CommandError(f"--models {name}: no checkpoint folder at {Path(name).expanduser().resolve()}")
    for bits in _csv_list(args.bits):
        if bits not in ("2", "4", "8"):
            raise CommandError(f"--bits {bits}: legal bit widths are 2, 4, 8")
    try:
        from evaluation.matrix import plan_cells

        plan_cells(["m"], _csv_list(args.cache_modes), [], _methods(args))
        for rule in _csv_list(args.rules):
            parse_rule(rule)
    except ValueError as exc:
        flag = "--rules" if "K rule" in str(exc) else "--cache-modes" if "cache mode" in str(exc) else "--methods"
        raise CommandError(f"{flag}: {exc}") from None
    if args.gsm8k_dir and not Path(args.gsm8k_dir).is_dir():
        raise CommandError(f"--gsm8k-dir: no folder at {Path(args.gsm8k_dir).resolve()}")
    if args.card and not Path(args.card).is_dir():
        raise CommandError(f"--card: no model folder at {Path(args.card).resolve()}")
    if args.card and len(_csv_list(args.models)) != 1:
        raise CommandError(f"--card writes one model's card; --models names {len(_csv_list(args.models))}")
    if args.table == "3" and not args.store:
        raise CommandError("--table 3 needs --store: the fixed K rules are policy tables put in the store, and the "
                           "fitted policy is read from it")
    if args.server and args.admin_key_env not in os.environ:
        raise CommandError(f"--server {args.server} needs the admin key in the environment variable "
                           f"{args.admin_key_env} (--admin-key-env); it is not set")
    if args.server:
        import httpx

        try:
            httpx.get(f"{args.server.rstrip('/')}/health", timeout=10)
        except httpx.HTTPError as exc:
            raise CommandError(f"--server {args.server}: cannot reach it ({exc or type(exc).__name__}); start the "
                               f"server (`{prog('service', 'serve')}`) or leave out --server") from None
    if args.store:
        from service.store.base import InvalidName, StoreUnavailable, open_store

        store = None
        try:
            store = open_store(args.store)
            store.list("policy")  # opening contacts nothing (open_store); one read does
        except (InvalidName, StoreUnavailable, OSError) as exc:
            raise CommandError(f"--store {args.store}: cannot read it ({exc})") from None
        finally:
            if store is not None:
                store.close()
    if args.from_calibration:
        try:
            calibration_record(args.store, args.from_calibration)
        except ValueError as exc:
            raise CommandError(str(exc)) from None


def run_matrix_command(argv: list[str]) -> int:
    """The ``matrix`` subcommand (``--table main|3|kv``)."""
    from evaluation import matrix
    from evaluation.embedded_task import EMBEDDED_TASKS

    args = matrix_parser().parse_args(argv)
    args.store = default_store(args.store)[0]
    tasks = _csv_list(args.tasks)
    check_matrix_inputs(args, tasks)
    preset = get_preset(args.preset) if args.preset else None
    fewshot = {t: args.num_fewshot for t in tasks if args.num_fewshot is not None}
    if preset:
        fewshot.update({t: n for t, n in preset.tasks.items() if t in tasks})
    settings = matrix.MatrixSettings(
        tasks=tasks, fewshot=fewshot, limit=args.limit,
        block_length=preset.block_length if preset else args.block_length,
        threshold=preset.threshold if preset else args.threshold,
        gen_length=preset.gen_length if preset else args.gen_length, batch_size=args.batch_size,
        chat_tasks=frozenset(_csv_list(args.chat_tasks)) | frozenset(EMBEDDED_TASKS),
        confirm_run_unsafe_code=args.confirm_run_unsafe_code, store_url=args.store,
        include_path=str(_task_dir(Path(args.out) / "tasks", args.gsm8k_dir)),
    )
    # Names in no task file are refused after a text scan (seconds); the rest after lm-eval's indexing (a minute).
    unknown = matrix.tasks_named_nowhere(tasks, settings.include_path)
    task_manager = None if unknown else matrix.task_manager_for(tasks, settings.include_path)
    unknown = unknown or [t for t in tasks if t not in task_manager.all_tasks]
    if unknown:
        raise CommandError(f"--tasks: unknown task(s) {', '.join(unknown)}; looked in lm-eval's tasks and "
                           f"{settings.include_path} (the offline tasks; --gsm8k-dir for gsm8k_local)")
    models, modes = _csv_list(args.models), _csv_list(args.cache_modes)
    bits, methods, rules = [int(b) for b in _csv_list(args.bits)], _methods(args), _csv_list(args.rules)
    if args.table == "3":
        cells = matrix.plan_controls(models, modes, bits, rules)
    elif args.table == "kv":
        cells = matrix.plan_sides(models, modes, bits, methods)
    else:
        cells = matrix.plan_cells(models, modes, bits, methods)
    cells = matrix.with_key_bias(cells, args.key_bias_correction)

    def load_engine(name: str):
        from service.engine import Engine

        return Engine.load(None if name == "embedded" else name, args.dtype, args.device, args.threads)

    on_result = None
    if args.server or args.store:
        from evaluation.scores import ScoreReporter

        on_result = ScoreReporter(server_url=args.server, admin_key_env=args.admin_key_env, store_url=args.store)
    started = time.perf_counter()
    try:
        # A card is written only with every row of its table: a missing artifact stops the run before any cell.
        summary = matrix.run_matrix(cells, settings, args.out, load_engine, on_result, task_manager=task_manager,
                                    require_all=bool(args.card))
    except matrix.MissingArtifacts as exc:
        raise CommandError(f"--card {args.card}: the table would lack rows ({exc}); fit them first "
                           f"(`{prog('calibration', 'all')} --store {args.store}`); no cell ran and the card was "
                           "not written") from None
    if args.card and summary["skipped"]:
        raise CommandError(f"--card {args.card}: rows were skipped ({'; '.join(s['cell'] for s in summary['skipped'])}"
                           "); the card was not written")
    extra_md, extra_json = _calibration_extras(args, summary["files"])
    paths = matrix.write_outputs(args.out, tasks, summary["skipped"], extra_md,
                                 {**extra_json, "run": {**summary, "wall_seconds": time.perf_counter() - started}},
                                 files=summary["files"], table=args.table, rules=rules,
                                 table4=extra_json.get("table4"))
    if args.card:
        # Table 4 and the per-layer policies go on the card once, with the main table.
        text = paths["md"].read_text()
        _write_card(args, argv, matrix.load_results(args.out, files=summary["files"]),
                    text if args.table == "main" else text.removesuffix(extra_md))
    print(paths["md"].read_text())
    print(f"ran {len(summary['ran'])} (cell, task) runs in {summary['seconds']:.1f} s; "
          f"{summary['already_done']} already done with the same settings; {len(summary['skipped'])} cells skipped")
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def _calibration_extras(args: argparse.Namespace, files: list[str]) -> tuple[str, dict]:
    """Table 4 (``--from-calibration``) and the per-layer tables of the fitted dLLM-KVQ policies the run used
    (read from ``--store``; with the calibration run's win rates when it fitted them), as markdown and JSON."""
    from calibration.policy_tables import per_layer_markdown
    from evaluation.calibration_table import calibration_record, table4_markdown, table4_rows
    from evaluation.matrix import load_results
    from service.artifacts.policy import PolicyTable
    from service.store.base import KIND_POLICY, open_store

    md, data = "", {}
    fit_layers = {}
    if args.from_calibration:
        rows = table4_rows(args.store, args.from_calibration)
        md, data["table4"] = "\n" + table4_markdown(rows), rows
        _, record = calibration_record(args.store, args.from_calibration)
        fit_layers = {pid: record.get("layers", {}).get(key) for key, pid in record.get("policies", {}).items()}
    used = sorted({r["artifact_id"] for r in load_results(args.out, files=files)
                   if r["cell"]["method"] == "dllm_kvq" and not r["cell"].get("rule")})
    if used and args.store:
        store = open_store(args.store)
        try:
            tables = {pid: store.get_model(KIND_POLICY, pid, PolicyTable) for pid in used}
        finally:
            store.close()
        data["policies"] = {pid: t.model_dump(mode="json") for pid, t in tables.items()}
        md += "\n### Per-layer dLLM-KVQ policies\n\n"
        for pid, table in sorted(tables.items(), key=lambda x: (x[1].cache_mode, -x[1].bits)):
            md += "\n".join(per_layer_markdown(f"{table.cache_mode} cache, {table.bits}-bit", table,
                                                fit_layers.get(pid))) + "\n"
    return md, data


def _write_card(args: argparse.Namespace, argv: list[str], results: list[dict], markdown: str) -> None:
    """``--card``: this table into the model card (`evaluation.card`), from this run's cell files of one model."""
    import platform
    import shlex

    from evaluation.card import write_card

    fingerprints = {r["fingerprint"] for r in results}
    if len(fingerprints) != 1:
        raise CommandError(f"--card needs the cells of exactly one model, found {len(fingerprints)} fingerprints")
    if args.table == "main":
        import shutil

        from evaluation.plots import TRADEOFF_PNG

        if (Path(args.out) / TRADEOFF_PNG).is_file():  # the card's markdown links it by this name
            shutil.copyfile(Path(args.out) / TRADEOFF_PNG, Path(args.card) / TRADEOFF_PNG)
    host = (f"{platform.machine()} CPU" if args.device == "cpu" else args.device) + (
        f", {args.threads} torch thread(s)" if args.threads else "")
    # The command in the form the docs give, whichever form ran it, so the card does not change with it.
    write_card(args.card, markdown=markdown, fingerprint=fingerprints.pop(), documents=args.limit,
               command=".venv/bin/dllm-kvq evaluate matrix " + shlex.join(argv), host=host, table=args.table)


def run_push_scores(argv: list[str]) -> int:
    """The ``push-scores`` subcommand: an lm-eval results file's scores to the server and/or the store."""
    import json

    parser = argparse.ArgumentParser(prog=prog("evaluation", "push-scores"),
                                     description="Send the task scores of an lm-eval results_*.json file to the "
                                                 "server's /admin/eval_scores (and so the store).")
    parser.add_argument("results", help="lm-eval's results_*.json (from --output_path)")
    parser.add_argument("--server", help="server base URL, admin key in --admin-key-env (default: none, the store)")
    parser.add_argument("--admin-key-env", default="DLLM_ADMIN_KEY",
                        help="environment variable holding the server's admin key (default %(default)s)")
    parser.add_argument("--store", type=store_url_arg, help="used when no --server is given: " + STORE_HELP)
    parser.add_argument("--cache-mode", choices=["none", "prefix", "dual"],
                        help="the cache mode the scores ran with (default: read from the results file)")
    parser.add_argument("--kv-quant", type=json.loads, help='the KVQuantConfig as JSON, e.g. {"method": "kivi"}; '
                        "with --cache-mode, needed for a results file of an HTTP run (it does not record them; "
                        "default: read from the results file)")
    args = parser.parse_args(argv)
    import httpx

    from evaluation.scores import ScoreReporter, ScoreReportError, reports_from_lm_eval

    store = args.store if args.server else default_store(args.store)[0]
    try:
        reporter = ScoreReporter(server_url=args.server, admin_key_env=args.admin_key_env, store_url=store)
    except KeyError:
        raise CommandError(f"--server {args.server} needs the admin key in the environment variable "
                           f"{args.admin_key_env} (--admin-key-env); it is not set") from None
    try:
        results = json.loads(Path(args.results).read_text())
    except (OSError, ValueError) as exc:
        raise CommandError(f"RESULTS_JSON {args.results}: cannot read an lm-eval results file ({exc})") from None
    try:
        reports = reports_from_lm_eval(results, args.cache_mode, args.kv_quant)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    for report in reports:
        try:
            print(report["task"], reporter.send(report))
        except ScoreReportError as exc:
            hint = (f"; is {args.admin_key_env} (--admin-key-env) the server's admin key?"
                    if exc.status in (401, 403) else "")
            raise CommandError(f"--server {args.server}: {exc}{hint}") from None
        except httpx.HTTPError as exc:
            raise CommandError(f"--server {args.server}: cannot reach it ({exc})") from None
    return 0


COMMANDS = {"lm-eval": run_lm_eval, "tasks": run_tasks, "matrix": run_matrix_command, "push-scores": run_push_scores}


def user_errors() -> tuple[type[Exception], ...]:
    """The exceptions that are the user's input or setting (one line, exit 2); imported only when one is raised,
    so that ``--help`` stays light."""
    import httpx

    from evaluation.scores import ScoreReportError
    from service.store.base import InvalidName

    return CommandError, ScoreReportError, httpx.HTTPError, InvalidName


def main(argv: list[str] | None = None) -> int:
    """Run ``evaluate <command>``: its exit status; 2 and one line for bad input, an unknown command named."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        print(f"commands: {', '.join(COMMANDS)}")
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"{prog('evaluation')}: error: unknown command {argv[0]!r}; legal: {', '.join(COMMANDS)} "
              f"(`{prog('evaluation')} --help` describes them)", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return COMMANDS[argv[0]](argv[1:])
    except Exception as exc:
        if not isinstance(exc, user_errors()):
            raise
        import httpx

        # A refused or unreachable server during a matrix run is the user's setting too: one line, naming the URL
        # (httpx's own message does not).
        where = ""
        if isinstance(exc, httpx.HTTPError):
            try:
                where = f"{exc.request.url}: "
            except RuntimeError:  # an error raised before any request was made
                pass
        print(f"{prog('evaluation', argv[0])}: error: {where}{exc}", file=sys.stderr)
        return 2
