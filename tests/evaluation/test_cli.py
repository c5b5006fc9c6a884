"""The launcher's argument handling: task folder injection and the protocol presets."""

from pathlib import Path

import pytest

from evaluation.cli import lm_eval_runs, main
from evaluation.protocol import PAPER, get_preset


def _dir(gsm8k_dir):
    return Path("/tasks") / (gsm8k_dir or "default")


def test_arguments_pass_through_with_our_task_folder():
    runs = lm_eval_runs(["--model", "dllm-kvq", "--tasks", "digit_ledger", "--limit", "4"], _dir)
    assert runs == [["run", "--model", "dllm-kvq", "--tasks", "digit_ledger", "--limit", "4",
                     "--include_path", "/tasks/default"]]
    runs = lm_eval_runs(["ls", "tasks", "--gsm8k-dir", "g"], _dir)
    assert runs == [["ls", "tasks", "--include_path", "/tasks/g"]]
    assert lm_eval_runs(["--include_path", "mine", "--tasks", "x"], _dir) == [["run", "--include_path", "mine",
                                                                                "--tasks", "x"]]


def test_paper_preset_runs_each_task_with_its_shots_and_the_decoding_settings():
    runs = lm_eval_runs(["--preset", "paper", "--model", "dllm-kvq", "--gen_kwargs", "threshold=0.8"], _dir)
    assert [(r[2], r[4]) for r in runs] == [("gsm8k", "5"), ("minerva_math", "4"), ("humaneval", "0"), ("mbpp", "3")]
    for r in runs:
        assert r[5:9] == ["--gen_kwargs", "max_gen_toks=256", "block_length=32", "threshold=0.9"]
        assert r[9:] == ["--model", "dllm-kvq", "--gen_kwargs", "threshold=0.8", "--include_path", "/tasks/default"]
    assert (PAPER.gen_length, PAPER.block_length, PAPER.threshold) == (256, 32, 0.9)


def test_unknown_preset_and_command():
    with pytest.raises(ValueError, match="legal: paper, paper-offline"):
        get_preset("fast")
    with pytest.raises(SystemExit):
        lm_eval_runs(["--preset", "fast"], _dir)
    assert main(["nope"]) == 2
