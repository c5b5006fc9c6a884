"""A tiny LLaDA with a word-level tokenizer, and a small lm-eval task whose references come from the engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from tests.support.fastdllm import llada_with_tokenizer

#: Prompts of the test task ("w<id>" words; the tiny model's greedy answers are deterministic).
PROMPTS = [f"w{10 + i} w{20 + 2 * i} w{30 + i} w{40 + i}" for i in range(6)]
#: Response tokens the task asks for (rounded up to 64 positions at block length 32).
MAX_GEN_TOKS = 40
STOP = "w377"


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return llada_with_tokenizer(tmp_path_factory.mktemp("eval-ckpt"))


@pytest.fixture(scope="session")
def engine(tiny_dir):
    from service.engine import Engine

    return Engine.load(tiny_dir)


def write_echo_task(folder: Path, answers: list[str], name: str = "tiny_echo") -> Path:
    """A generate_until task over PROMPTS whose targets are ``answers``; exact match, stop string STOP."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in zip(PROMPTS, answers)))
    cfg = {
        "task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test", "output_type": "generate_until", "doc_to_text": "{{prompt}}",
        "doc_to_target": "{{answer}}", "target_delimiter": "",
        "generation_kwargs": {"until": [STOP], "max_gen_toks": MAX_GEN_TOKS, "do_sample": False},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": 1.0},
    }
    (folder / f"{name}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return folder


def direct_answers(engine, cache_mode: str = "dual") -> list[str]:
    """What the engine decodes for PROMPTS when called directly (one prompt at a time), cut at STOP and at
    MAX_GEN_TOKS (the response rule the server applies to max_tokens; these references were uncut before)."""
    from service.engine.params import DecodeParams, RowOptions

    params = DecodeParams(gen_length=64, block_length=32, cache_mode=cache_mode, threshold=0.9)
    out = []
    for prompt in PROMPTS:
        row = engine.generate([engine.encode_prompt(prompt, chat=False)], params, [RowOptions(stop=(STOP,), max_tokens=MAX_GEN_TOKS)]
                              ).rows[0]
        out.append(row.text)
    return out


def write_choice_task(folder: Path, name: str = "tiny_choice") -> Path:
    """A multiple_choice task over PROMPTS (loglikelihood requests) in ``folder``, beside the echo task."""
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "label": 0}) + "\n" for p in PROMPTS))
    cfg = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
           "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "{{prompt}}",
           "doc_to_choice": ["w5", "w6"], "doc_to_target": "{{label}}",
           "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
           "metadata": {"version": 1.0}}
    (folder / f"{name}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return folder


def run_lm_eval_http(url: str, model: str, task_dir: Path, task: str, out: Path, limit: int):
    """``lm_eval --model local-completions`` on ``task`` (``limit`` documents) against the server at ``url``
    serving ``model`` (the command of docs/llada2.md and docs/diffusion_gemma.md); the finished process."""
    import os
    import subprocess
    import sys

    import httpx

    max_len = httpx.get(url + "/v1/models").json()["data"][0]["max_model_len"]
    args = f"model={model},base_url={url}/v1/completions,tokenizer_backend=remote,max_length={max_len},max_retries=1"
    return subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
                           "--include_path", str(task_dir), "--tasks", task, "--limit", str(limit),
                           "--output_path", str(out), "--log_samples"],
                          capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1"})


def http_echo_answers(out: Path, task: str = "tiny_echo") -> tuple[float, dict[int, str]]:
    """What a ``local-completions`` run wrote under ``out``: the task's exact match and each document's answer."""
    (results,) = out.glob("*/results_*.json")
    exact = json.loads(results.read_text())["results"][task]["exact_match,none"]
    (samples,) = out.glob(f"*/samples_{task}_*.jsonl")
    return exact, {s["doc_id"]: s["resps"][0][0] for s in map(json.loads, samples.read_text().splitlines())}
