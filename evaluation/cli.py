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
from service.commands import store_url_arg

#: Where the launcher writes the offline task YAMLs when no ``--include_path`` is given.
DEFAULT_TASK_DIR = Path.home() / ".cache" / "dllm-kvq" / "lm-eval-tasks"


def _csv_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _task_dir(out: Path, gsm8k_dir: str | None) -> Path:
    from evaluation.embedded_task import embedded_task_configs
    from evaluation.tasks import write_task_dir

    return write_task_dir(out, gsm8k_dir, extra=embedded_task_configs())


def lm_eval_runs(argv: list[str], task_dir: Callable[[str | None], Path]) -> list[list[str]]:
    """The lm-eval CLI argument lists the ``lm-eval`` subcommand runs, in order (module docstring).

    Args:
        argv: the subcommand's arguments (ours and lm-eval's, mixed).
        task_dir: gsm8k folder or None -> folder of the written offline tasks (called only without
            ``--include_path``).
    """
    parser = argparse.ArgumentParser(prog="python -m evaluation lm-eval", add_help=False)
    parser.add_argument("--preset", choices=sorted(PRESETS))
    parser.add_argument("--gsm8k-dir", help="folder with GSM8K-format train.jsonl and test.jsonl (gsm8k_local)")
    ours, rest = parser.parse_known_args(argv)
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


def run_lm_eval(argv: list[str]) -> int:
    """The ``lm-eval`` subcommand: register ``dllm-kvq``, then lm-eval's own CLI once per run."""
    from lm_eval.__main__ import cli_evaluate

    import evaluation.lm  # noqa: F401 - registers the dllm-kvq model with lm-eval

    for args in lm_eval_runs(argv, lambda gsm8k_dir: _task_dir(DEFAULT_TASK_DIR, gsm8k_dir)):
        sys.argv = ["lm-eval", *args]
        cli_evaluate()
    return 0


def run_tasks(argv: list[str]) -> int:
    """The ``tasks`` subcommand: write the offline task YAMLs."""
    parser = argparse.ArgumentParser(prog="python -m evaluation tasks")
    parser.add_argument("--out", required=True, help="folder to write <task>.yaml files into")
    parser.add_argument("--gsm8k-dir", help="folder with GSM8K-format train.jsonl and test.jsonl")
    args = parser.parse_args(argv)
    out = _task_dir(Path(args.out), args.gsm8k_dir)
    print("\n".join(sorted(str(p) for p in out.glob("*.yaml"))))
    return 0


def matrix_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m evaluation matrix",
        description="Run the paper's result matrix with lm-eval in-process; resumes from --out.")
    parser.add_argument("--models", default="embedded",
                        help="comma list of checkpoints (dir or HF id); 'embedded' = the embedded default model")
    parser.add_argument("--tasks", required=True, help="comma list of lm-eval task names")
    parser.add_argument("--cache-modes", default="prefix,dual")
    parser.add_argument("--bits", default="4,2")
    parser.add_argument("--methods", default="none,kivi,kvquant,dllm_kvq")
    parser.add_argument("--out", required=True, help="matrix folder (cell files, matrix.md/.csv/.json)")
    parser.add_argument("--limit", type=int, help="documents per task (default: all)")
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help="take few-shot counts, gen length, block length and threshold from a protocol")
    parser.add_argument("--num-fewshot", type=int, help="few-shot count for tasks without a preset value")
    parser.add_argument("--gen-length", type=int, help="max_gen_toks for every task (default: each task's own)")
    parser.add_argument("--block-length", type=int, default=32)
    parser.add_argument("--threshold", type=float, default=0.9)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--chat-tasks", default="",
                        help="comma list of tasks run with the chat template (the embedded task always is)")
    parser.add_argument("--confirm-run-unsafe-code", action="store_true",
                        help="allow code-executing tasks (humaneval, mbpp); run them in a sandbox")
    parser.add_argument("--store", type=store_url_arg, help="store URL (redis://... or a directory): policies, states, scores")
    parser.add_argument("--gsm8k-dir", help="folder with GSM8K-format train.jsonl and test.jsonl")
    parser.add_argument("--from-calibration", metavar="RUN_ID",
                        help="add Table 4 (trajectory-level diagnostics) from a calibration run in --store")
    parser.add_argument("--server", help="server base URL to push each finished score to (accuracy telemetry)")
    parser.add_argument("--card", metavar="DIR",
                        help="model folder whose card gets the table (quantization.json + README section; one model)")
    parser.add_argument("--admin-key-env", default="DLLM_ADMIN_KEY",
                        help="environment variable holding the server's admin key (default DLLM_ADMIN_KEY)")
    return parser


def run_matrix_command(argv: list[str]) -> int:
    """The ``matrix`` subcommand."""
    from evaluation import matrix
    from evaluation.embedded_task import EMBEDDED_TASKS

    args = matrix_parser().parse_args(argv)
    tasks = _csv_list(args.tasks)
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
    cells = matrix.plan_cells(_csv_list(args.models), _csv_list(args.cache_modes),
                              [int(b) for b in _csv_list(args.bits)], _csv_list(args.methods))

    def load_engine(name: str):
        from service.engine import Engine

        return Engine.load(None if name == "embedded" else name, args.dtype, args.device, args.threads)

    on_result = None
    if args.server or args.store:
        from evaluation.scores import ScoreReporter

        on_result = ScoreReporter(server_url=args.server, admin_key_env=args.admin_key_env, store_url=args.store)
    started = time.perf_counter()
    summary = matrix.run_matrix(cells, settings, args.out, load_engine, on_result)
    extra_md, extra_json = "", {}
    if args.from_calibration:
        from evaluation.calibration_table import table4_markdown, table4_rows

        rows = table4_rows(args.store, args.from_calibration)
        extra_md, extra_json = "\n" + table4_markdown(rows), {"table4": rows}
    paths = matrix.write_outputs(args.out, tasks, summary["skipped"], extra_md,
                                 {**extra_json, "run": {**summary, "wall_seconds": time.perf_counter() - started}},
                                 fingerprints=summary["fingerprints"].values())
    if args.card:
        _write_card(args, argv, matrix.load_results(args.out, summary["fingerprints"].values()),
                    paths["md"].read_text())
    print(paths["md"].read_text())
    print(f"ran {len(summary['ran'])} (cell, task) runs in {summary['seconds']:.1f} s; "
          f"{summary['already_done']} already done; {len(summary['skipped'])} cells skipped")
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def _write_card(args: argparse.Namespace, argv: list[str], results: list[dict], markdown: str) -> None:
    """``--card``: the matrix into the model card (`evaluation.card`), from this run's cell files of one model."""
    import platform
    import shlex

    from evaluation.card import write_card

    fingerprints = {r["fingerprint"] for r in results}
    if len(fingerprints) != 1:
        raise SystemExit(f"--card needs the cells of exactly one model, found {len(fingerprints)} fingerprints")
    host = (f"{platform.machine()} CPU" if args.device == "cpu" else args.device) + (
        f", {args.threads} torch thread(s)" if args.threads else "")
    write_card(args.card, markdown=markdown, fingerprint=fingerprints.pop(), documents=args.limit,
               command="python -m evaluation matrix " + shlex.join(argv),
               wall_seconds=sum(r["seconds"] for r in results), host=host)


def run_push_scores(argv: list[str]) -> int:
    """The ``push-scores`` subcommand: an lm-eval results file's scores to the server and/or the store."""
    import json

    from evaluation.scores import ScoreReporter, reports_from_lm_eval

    parser = argparse.ArgumentParser(prog="python -m evaluation push-scores",
                                     description="Send the task scores of an lm-eval results_*.json file to the "
                                                 "server's /admin/eval_scores (and so the store).")
    parser.add_argument("results", help="lm-eval's results_*.json (from --output_path)")
    parser.add_argument("--server", help="server base URL (admin key in --admin-key-env)")
    parser.add_argument("--admin-key-env", default="DLLM_ADMIN_KEY")
    parser.add_argument("--store", type=store_url_arg, help="store URL, used when no server is given")
    parser.add_argument("--cache-mode", choices=["none", "prefix", "dual"])
    parser.add_argument("--kv-quant", type=json.loads, help='the KVQuantConfig as JSON, e.g. {"method": "kivi"}')
    args = parser.parse_args(argv)
    reporter = ScoreReporter(server_url=args.server, admin_key_env=args.admin_key_env, store_url=args.store)
    results = json.loads(Path(args.results).read_text())
    for report in reports_from_lm_eval(results, args.cache_mode, args.kv_quant):
        print(report["task"], reporter.send(report))
    return 0


COMMANDS = {"lm-eval": run_lm_eval, "tasks": run_tasks, "matrix": run_matrix_command, "push-scores": run_push_scores}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(__doc__)
        print(f"commands: {', '.join(COMMANDS)}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return COMMANDS[argv[0]](argv[1:])
