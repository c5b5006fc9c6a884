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
