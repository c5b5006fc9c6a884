"""The launcher's argument handling: task folder injection and the protocol presets."""

from pathlib import Path

import pytest

from evaluation.cli import lm_eval_runs, main
from evaluation.protocol import PAPER, get_preset
from service.commands import prog


def _dir(gsm8k_dir):
    return Path("/tasks") / (gsm8k_dir or "default")


def test_arguments_pass_through_with_our_task_folder():
    runs = lm_eval_runs(["--model", "dllm-kvq", "--tasks", "digit_ledger", "--limit", "4"], _dir)
    assert runs == [["run", "--model", "dllm-kvq", "--tasks", "digit_ledger", "--limit", "4",
                     "--model_args", "model=embedded", "--include_path", "/tasks/default"]]
    runs = lm_eval_runs(["ls", "tasks", "--gsm8k-dir", "g"], _dir)
    assert runs == [["ls", "tasks", "--include_path", "/tasks/g"]]
    assert lm_eval_runs(["--include_path", "mine", "--tasks", "x"], _dir) == [["run", "--include_path", "mine",
                                                                                "--tasks", "x"]]


def test_paper_preset_runs_each_task_with_its_shots_and_the_decoding_settings():
    runs = lm_eval_runs(["--preset", "paper", "--model", "dllm-kvq", "--gen_kwargs", "threshold=0.8"], _dir)
    assert [(r[2], r[4]) for r in runs] == [("gsm8k", "5"), ("minerva_math", "4"), ("humaneval", "0"), ("mbpp", "3")]
    for r in runs:
        assert r[5:9] == ["--gen_kwargs", "max_gen_toks=256", "block_length=32", "threshold=0.9"]
        assert r[9:] == ["--model", "dllm-kvq", "--gen_kwargs", "threshold=0.8", "--model_args", "model=embedded",
                         "--include_path", "/tasks/default"]
    assert (PAPER.gen_length, PAPER.block_length, PAPER.threshold) == (256, 32, 0.9)


def test_unknown_preset_and_command():
    with pytest.raises(ValueError, match="legal: paper, paper-offline"):
        get_preset("fast")
    with pytest.raises(SystemExit):
        lm_eval_runs(["--preset", "fast"], _dir)
    assert main(["nope"]) == 2


@pytest.mark.parametrize(("given", "passed"), [
    (["--model_args", "cache_mode=dual,method=kivi"], ["--model_args", "model=embedded,cache_mode=dual,method=kivi"]),
    (["--model_args=cache_mode=dual"], ["--model_args", "model=embedded,cache_mode=dual"]),
    (["--model_args", '{"cache_mode": "dual"}'], ["--model_args", '{"model": "embedded", "cache_mode": "dual"}']),
    (["--model_args", "model=/ckpt,cache_mode=dual"], ["--model_args", "model=/ckpt,cache_mode=dual"]),
])
def test_the_in_process_model_is_named_so_lm_eval_writes_a_stable_folder(given, passed):
    """lm-eval names its output folder after model= (a random name without it): <output_path>/embedded/."""
    runs = lm_eval_runs(["--model", "dllm-kvq", *given, "--tasks", "t"], _dir)
    assert runs == [["run", "--model", "dllm-kvq", *passed, "--tasks", "t", "--include_path", "/tasks/default"]]
    # HTTP models name themselves (model= is the served name); nothing is added.
    http = ["--model", "local-completions", "--model_args", "base_url=http://h/v1/completions", "--tasks", "t"]
    assert lm_eval_runs(http, _dir) == [["run", *http, "--include_path", "/tasks/default"]]


def test_the_embedded_model_arg_loads_the_embedded_model():
    from evaluation.model_args import EvalModelArgs

    assert EvalModelArgs.parse({"model": "embedded"}).checkpoint is None
    assert EvalModelArgs.parse({"model": "/ckpt"}).checkpoint == "/ckpt"


#: The launcher as a message names it (as this test's python runs it).
LM_EVAL = prog("evaluation", "lm-eval")


def _one_line(capsys, argv) -> str:
    """The error line (the last on stderr: lm-eval logs its warnings there before it) of a run that exits 2."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    return err.splitlines()[-1]


def test_an_http_run_against_a_server_that_is_not_running_is_one_line(capsys):
    from tests.support.processes import free_port

    url = f"http://127.0.0.1:{free_port()}/v1/chat/completions"
    err = _one_line(capsys, ["lm-eval", "--model", "local-chat-completions", "--model_args",
                             f"model=embedded,base_url={url}", "--tasks", "digit_ledger", "--limit", "2"])
    assert err.startswith(f"{LM_EVAL}: error: --model_args base_url={url}: cannot reach the server")
    assert err.endswith(f"start it (`{prog('service', 'serve')}`) or fix base_url")


@pytest.mark.slow
def test_a_misspelled_task_or_model_arg_is_one_line(capsys):
    err = _one_line(capsys, ["lm-eval", "--model", "dllm-kvq", "--tasks", "digit_ledgr", "--limit", "1"])
    assert err.startswith(f"{LM_EVAL}: error: --tasks: Tasks not found: ") and "ls tasks" in err
    err = _one_line(capsys, ["lm-eval", "--model", "dllm-kvq", "--model_args", "cache=dual", "--tasks",
                             "digit_ledger", "--limit", "1"])
    assert err.startswith(f"{LM_EVAL}: error: --model_args: unknown model_args ['cache']; legal: ")


def test_http_model_args_lm_eval_cannot_find_out_itself():
    from evaluation.cli import with_server_model_args
    from tests.support.processes import free_port

    nowhere = f"http://127.0.0.1:{free_port()}/v1/completions"  # no server: no max_length to read
    args = ["--model", "local-completions", "--model_args", f"model=embedded,base_url={nowhere},tokenizer=t"]
    # A local tokenizer named without a backend: local-completions would detect the server's remote one instead.
    assert with_server_model_args(args)[-1] == f"model=embedded,base_url={nowhere},tokenizer=t,tokenizer_backend=huggingface"
    given = ["--model", "local-completions", "--model_args",
             f'{{"base_url": "{nowhere}", "tokenizer": "t", "tokenizer_backend": "remote", "max_length": 99}}']
    assert with_server_model_args(given) == given
    assert with_server_model_args(["--model", "dllm-kvq", "--model_args", "tokenizer=t"]) == [
        "--model", "dllm-kvq", "--model_args", "tokenizer=t"]


def test_an_embedded_task_without_the_chat_template_is_refused_in_one_line(capsys):
    """Plain lm-eval on the chat-trained embedded model without --apply_chat_template used to score 0 with no word;
    the launcher refuses such a run before lm-eval starts, saying why."""
    from evaluation.cli import check_chat_template

    err = _one_line(capsys, ["lm-eval", "--model", "dllm-kvq", "--tasks", "gsm8k_local,digit_ledger_choice",
                             "--limit", "1"])
    assert err == (f"{LM_EVAL}: error: --tasks digit_ledger_choice: the embedded model answers only chat turns, so "
                   "without --apply_chat_template every answer is wrong and the task scores 0; add "
                   "--apply_chat_template")
    for argv in (["--tasks", "digit_ledger", "--apply_chat_template"], ["--tasks", "gsm8k_local"], ["ls", "tasks"]):
        for run in lm_eval_runs(["--model", "dllm-kvq", *argv], _dir):
            check_chat_template(run)  # a run with the template, of another task, or no run: passes
