"""``python -m service generate`` as a user runs it: plain and JSON output, bad input. The golden JSON report runs
a real subprocess; the other cases call the same ``main`` in this process (`tests.support.cli`), which saves an
interpreter start and a torch import per call."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.cli import service_main
from tests.support.fastdllm import CKPT, REPO_ROOT, golden


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "service", "generate", "--threads", "1", *args],
        check=False, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
    )


def _main(*args: str) -> subprocess.CompletedProcess:
    return service_main("generate", "--threads", "1", *args)


def _run(run_id: str) -> dict:
    family = run_id.split("_")[0]
    return next(r for r in golden(f"{family}_generate.json")["runs"] if r["id"] == run_id)


@pytest.mark.integration  # the real subprocess of `generate`
def test_json_report_matches_golden_fixed_steps_dream_prefix():
    run = _run("dream_p17_g64_fixed_prefix")
    out = _cli(
        "--model", str(CKPT["dream"]), "--prompt-ids", ",".join(map(str, run["prompt_ids"])), "--gen-length", "64",
        "--cache-mode", "prefix", "--steps", "32", "--ignore-eos", "--json",
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    row = report["rows"][0]
    assert row["generated_ids"] == run["generated_ids"] and row["nfe"] == run["nfe"] == 32
    assert row["text"] is None  # no tokenizer files in this checkpoint
    assert report["params"]["cache_mode"] == "prefix" and report["params"]["steps"] == 32


def test_plain_output_is_ids_and_a_report_line():
    run = _run("llada_p5_g64_threshold_nocache")
    out = _main(
        "--model", str(CKPT["llada"]), "--prompt-ids", ",".join(map(str, run["prompt_ids"])), "--gen-length", "64",
        "--cache-mode", "none", "--threshold", "0.9",
    )
    assert out.returncode == 0, out.stderr
    ids_line, report_line = out.stdout.strip().splitlines()
    assert [int(t) for t in ids_line.split(",")] == run["generated_ids"]
    assert report_line.startswith("[finish=length tokens=64 nfe=55 steps/block=")


def test_text_prompt_with_tokenizer_and_chat(llada_with_tokenizer):
    out = _main("--model", str(llada_with_tokenizer), "--prompt", "w5 w6 w7", "--chat", "--gen-length", "32", "--json")
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout)["rows"][0]
    assert row["text"] == " ".join(f"w{i}" for i in row["generated_ids"] if i not in (81, 348))


def test_bad_input_exits_2_with_what_is_legal():
    out = _main("--model", str(CKPT["llada"]), "--prompt-ids", "1,2", "--gen-length", "48")
    assert out.returncode == 2
    assert "not a multiple of block_length" in out.stderr
    out = _main("--model", str(CKPT["llada"]), "--prompt-ids", "1,x")
    assert out.returncode == 2 and "comma-separated token ids" in out.stderr
    # Settings the pydantic models refuse are named plainly, without pydantic's dump and links.
    out = _main("--model", str(CKPT["llada"]), "--prompt-ids", "1,2", "--gen-length", "0")
    assert out.returncode == 2 and "gen_length: Input should be greater than 0" in out.stderr
    assert "errors.pydantic.dev" not in out.stderr and "input_value" not in out.stderr
