"""Every command's ordinary mistakes are one line on stderr saying what is wrong and what to do, exit 2, no
traceback (issue 23 item 3); ``--help`` imports neither torch nor transformers, and every flag has a description
and a default."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cli import console_main

REPO = Path(__file__).resolve().parents[2]


def console(*args: str, **env: str) -> subprocess.CompletedProcess:
    """``dllm-kvq ...`` (the installed console command's code) in this process (`tests.support.cli`); the real
    console subprocess of every command is tested in test_console.py."""
    return console_main(*args, env={"HF_HUB_OFFLINE": "1", **env})


def console_process(*args: str, **env: str) -> subprocess.CompletedProcess:
    """``python -m dllm_kvq.cli ...`` in a subprocess, where a fresh interpreter is what is checked."""
    return subprocess.run([sys.executable, "-m", "dllm_kvq.cli", *args], capture_output=True, text=True,
                          timeout=600, check=False, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **env})


def one_line(result: subprocess.CompletedProcess) -> str:
    """The single stderr line of a refused command (asserting exit 2 and no traceback)."""
    assert result.returncode == 2, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


# ---- serve: checked before the model loads --------------------------------------------------------------------


def test_serve_a_model_path_that_does_not_exist(capsys, monkeypatch):
    from service.__main__ import build_parser
    from service.commands.serve import run

    monkeypatch.delenv("DLLM_MODEL", raising=False)
    assert run(build_parser().parse_args(["serve", "--port", "0", "--model", "/nonexistent/model"])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [("error: --model / DLLM_MODEL: no checkpoint at /nonexistent/model: /nonexistent/model does not "
                   "exist; pass a checkpoint directory (config.json + safetensors) or an 'org/name' repo id in the "
                   "Hugging Face cache")]


def test_serve_a_hub_id_that_is_not_in_the_cache(capsys, monkeypatch, tmp_path):
    from service.__main__ import build_parser
    from service.commands.serve import run

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert run(build_parser().parse_args(["serve", "--port", "0", "--model", "nobody-here/no-such-model"])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --model / DLLM_MODEL: 'nobody-here/no-such-model' is not in "
                                               "the local Hugging Face cache")
    assert "hf download nobody-here/no-such-model" in err[0]


def test_serve_cuda_on_a_host_without_it(capsys):
    import torch

    from service.__main__ import build_parser
    from service.commands.serve import run

    if torch.cuda.is_available():
        pytest.skip("this host has CUDA: the mistake is one of CPU hosts")
    assert run(build_parser().parse_args(["serve", "--port", "0", "--device", "cuda"])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --device / DLLM_DEVICE: device 'cuda' asked for but CUDA is not available here; use cpu"]


def test_generate_a_model_path_that_does_not_exist():
    line = one_line(console("generate", "--model", "/nonexistent/model", "--prompt", "hi"))
    assert "/nonexistent/model does not exist" in line


def test_generate_an_unknown_kv_method_names_the_legal_ones():
    line = one_line(console("generate", "--prompt-ids", "1,2", "--kv-quant", "kivvi"))
    assert "kivvi" in line and "'kivi'" in line and "'dllm_kvq'" in line


# ---- calibrate --------------------------------------------------------------------------------------------------


def test_calibrate_zero_samples_names_the_flag(tmp_path):
    line = one_line(console("calibrate", "all", "--samples", "0", "--store", str(tmp_path / "s")))
    assert line.endswith("calibrate all: error: --samples: Input should be greater than 0")


def test_calibrate_a_model_path_that_does_not_exist_says_so(tmp_path):
    line = one_line(console("calibrate", "all", "--model", "/nonexistent", "--store", str(tmp_path / "s"),
                            "--no-progress"))
    assert "/nonexistent does not exist" in line and "Hugging Face cache (HF_HOME)" not in line


@pytest.mark.parametrize("verb", ["fit", "report"])
def test_calibrate_fit_and_report_on_an_empty_store(tmp_path, verb):
    store = tmp_path / "empty"
    line = one_line(console("calibrate", verb, "--store", str(store), "--no-progress", "--samples", "2"))
    assert f"--store {store}" in line and "no diagnostic sums" in line and "calibrate all" in line


def test_calibrate_fit_merge_of_a_missing_file(tmp_path):
    line = one_line(console("calibrate", "fit", "--merge", str(tmp_path / "sums-0.json"), "--store",
                            str(tmp_path / "s")))
    assert f"--merge {tmp_path / 'sums-0.json'}: no such file" in line


@pytest.mark.integration  # the offline switch is read when `datasets` is imported: a fresh interpreter
def test_calibrate_collect_without_network_or_datasets(tmp_path):
    """Offline (the hub blocked) or without the `datasets` package: one line saying what collect needs."""
    result = console_process("calibrate", "collect", "--out", str(tmp_path / "buckets"), HF_DATASETS_OFFLINE="1")
    line = one_line(result)
    assert "collect" in line


# ---- policies (more in test_policies_cli.py) --------------------------------------------------------------------


def test_policies_import_of_a_missing_folder_fails(tmp_path):
    line = one_line(console("policies", "import", "/nonexistent", "--store", str(tmp_path / "s")))
    assert "/nonexistent: no such directory" in line
    assert not (tmp_path / "s").exists()


# ---- evaluate ---------------------------------------------------------------------------------------------------


def test_evaluate_an_unknown_command_is_named():
    line = one_line(console("evaluate", "foo"))
    assert "unknown command 'foo'; legal: lm-eval, tasks, matrix, push-scores" in line


def test_evaluate_bad_in_process_model_args_before_lm_eval_starts():
    """Checked before lm-eval runs (it indexes its tasks first): lm_eval is never imported."""
    from evaluation.cli import CommandError, check_in_process_model_args

    with pytest.raises(CommandError, match=r"--model_args: unknown model_args \['cache'\]; legal: "):
        check_in_process_model_args(["--model", "dllm-kvq", "--model_args", "cache=dual"])
    with pytest.raises(CommandError, match="threshold"):
        check_in_process_model_args(["--model", "dllm-kvq", "--model_args", "threshold=2"])
    with pytest.raises(CommandError, match="/nonexistent/ckpt does not exist"):
        check_in_process_model_args(["--model", "dllm-kvq", "--model_args", "model=/nonexistent/ckpt"])
    check_in_process_model_args(["--model", "dllm-kvq", "--model_args", "model=embedded,cache_mode=dual,bits=2"])
    result = console("evaluate", "lm-eval", "--model", "dllm-kvq", "--model_args", "cache=dual", "--tasks",
                     "digit_ledger", "--limit", "1")
    assert "unknown model_args ['cache']" in one_line(result)


# ---- --help, --version ------------------------------------------------------------------------------------------

HELPS = [["serve"], ["generate"], ["policies"], ["policies", "list"], ["policies", "activate"], ["calibrate"],
         ["calibrate", "all"], ["evaluate"], ["evaluate", "matrix"], ["evaluate", "tasks"], ["evaluate", "push-scores"]]


@pytest.mark.integration  # a fresh interpreter: what --help imports
def test_help_imports_neither_torch_nor_transformers():
    code = """
import json, sys
from dllm_kvq.cli import main
heavy = {}
for words in json.loads(sys.argv[1]):
    try:
        main([*words, "--help"])
    except SystemExit:
        pass
    heavy[" ".join(words)] = sorted(m for m in ("torch", "transformers", "lm_eval") if m in sys.modules)
print(json.dumps(heavy), file=sys.stderr)
"""
    done = subprocess.run([sys.executable, "-c", code, json.dumps(HELPS)], capture_output=True, text=True,
                          timeout=300, check=True, cwd=REPO)
    heavy = json.loads(done.stderr.strip().splitlines()[-1])
    assert heavy == {" ".join(words): [] for words in HELPS}


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Every argparse parser of every command, by the words that reach it."""
    from calibration.cli import build_parser as calibrate
    from evaluation.cli import matrix_parser
    from service.__main__ import build_parser as service

    found: dict[str, argparse.ArgumentParser] = {}

    def walk(name: str, parser: argparse.ArgumentParser) -> None:
        found[name] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for word, sub in action.choices.items():
                    walk(f"{name} {word}", sub)

    walk("service", service())
    walk("calibrate", calibrate())
    walk("evaluate matrix", matrix_parser())
    return found


def test_every_flag_has_a_description_and_a_default():
    """Every option's help says what it is and its default (or that it is required); no issue numbers in help."""
    missing = []
    for name, parser in _parsers().items():
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            text = (action.help or "") % {"default": action.default, "prog": parser.prog} if action.help else ""
            if not text.strip():
                missing.append(f"{name} {action.dest}: no help")
            elif action.option_strings and "default" not in text and "required" not in text and not action.required:
                missing.append(f"{name} {'/'.join(action.option_strings)}: no default in {text!r}")
            if "issue" in text.lower():
                missing.append(f"{name} {action.dest}: names an issue")
        if "(issue" in (parser.description or ""):
            missing.append(f"{name}: the description names an issue")
    assert missing == []


def test_version():
    from importlib.metadata import version

    result = console("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"dllm-kvq {version('dllm-kvq')}"


def test_evaluate_matrix_an_unknown_task_before_any_cell(tmp_path):
    """An unknown task is one line naming it, before any model loads or cell runs (nothing in --out but the
    offline task files)."""
    out = tmp_path / "matrix"
    line = one_line(console("evaluate", "matrix", "--tasks", "nosuchtask", "--limit", "1", "--out", str(out)))
    assert "--tasks: unknown task(s) nosuchtask" in line
    assert not [p for p in out.rglob("*") if p.is_file() and "tasks" not in p.relative_to(out).parts]


def test_the_light_settings_module_names_the_embedded_split_where_the_engine_has_it():
    """`calibration.settings` spells the embedded training split's path without importing the engine (torch)."""
    from calibration.settings import EMBEDDED_TRAIN_SPLIT
    from service.engine.loading import EMBEDDED_DIR

    assert EMBEDDED_TRAIN_SPLIT == EMBEDDED_DIR / "task" / "train_sample.jsonl" and EMBEDDED_TRAIN_SPLIT.is_file()


def test_python_dash_m_dllm_kvq_is_the_console_command(capsys):
    """``python -m dllm_kvq`` runs what ``dllm-kvq`` runs (its usage, exit 0 for --help)."""
    import runpy

    argv, sys.argv = sys.argv, ["dllm_kvq", "--help"]
    try:
        with pytest.raises(SystemExit) as stop:
            runpy.run_module("dllm_kvq", run_name="__main__")
    finally:
        sys.argv = argv
    assert stop.value.code == 0 and "usage: dllm-kvq <command>" in capsys.readouterr().out
