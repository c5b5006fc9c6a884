"""lm-eval against ``python -m service serve`` (embedded model, real uvicorn process, the suite's own Redis
under its own key prefix): every lm-eval command of docs/evaluation.md's "lm-eval over HTTP" (plain ``lm_eval`` and
the launcher; chat completions, completions with the chat template through the server's or the checkpoint's
tokenizer, completions without one) runs as documented and answers as the in-process model does on the same
slice, with the server's context length; the likelihood payload is answered, and scores reach /metrics
and the store."""

from __future__ import annotations

import itertools
import json
import os
import shlex
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import lm_eval
import pytest
from lm_eval.api.instance import Instance
from lm_eval.models.openai_completions import LocalCompletionsAPI

from evaluation.embedded_task import embedded_task_configs
from evaluation.lm import DllmKvqLM
from evaluation.matrix import task_manager_for
from evaluation.scores import ScoreReporter
from evaluation.tasks import write_task_dir
from service.engine import Engine
from service.store.base import KIND_EVAL_SCORES
from service.store.redis_store import RedisStore
from tests.api.test_server_process import metric_sum, metrics
from tests.support.apps import ADMIN_KEY
from tests.support.paths import REPO
from tests.support.processes import SHARED_REDIS_URL, ServerProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]
LIMIT = 16  # the documented command's --limit
PAGE = REPO / "docs" / "evaluation.md"  # tests/docs/test_doc_blocks.py leaves this page's HTTP chat block to us


def documented_commands() -> list[str]:
    """Every command line of the bash blocks in docs/evaluation.md's "lm-eval over HTTP" section that the doc tests
    run (a block marked ``doc-test: skip=`` is left out here too)."""
    text = PAGE.read_text()
    section = text[text.index("## lm-eval over HTTP"):text.index("## lm-eval in-process")]
    lines = []
    pieces = section.split("```bash")
    for before, block in itertools.pairwise(pieces):
        if "doc-test: skip=" in before.rstrip().splitlines()[-1]:
            continue  # a block the doc tests skip (too long here, or another program's commands) runs here neither
        lines += block[:block.index("```")].replace("\\\n", " ").strip().splitlines()
    return lines


LM_EVAL_COMMANDS = [c for c in documented_commands() if " --model " in c]


def readme_command(model: str) -> list[str]:
    """The documented launcher command (docs/evaluation.md, "lm-eval over HTTP") for ``--model <model>``, as argv."""
    (line,) = [c for c in LM_EVAL_COMMANDS if "dllm-kvq evaluate lm-eval" in c and f"--model {model} " in c]
    return shlex.split(line)


@pytest.fixture(scope="module")
def prefix():
    p = f"test-eval-{uuid.uuid4().hex[:8]}"
    yield p
    RedisStore(SHARED_REDIS_URL, prefix=p).delete_everything()


@pytest.fixture(scope="module")
def server(tmp_path_factory, prefix):
    srv = ServerProcess({"DLLM_STORE_URL": SHARED_REDIS_URL, "DLLM_STORE_PREFIX": prefix, "DLLM_ADMIN_KEY": ADMIN_KEY,
                         "DLLM_THREADS": "1"},
                        log_path=tmp_path_factory.mktemp("eval-server") / "server.log").start(timeout_s=180)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def engine():
    return Engine.load(None, threads=1)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    return write_task_dir(tmp_path_factory.mktemp("tasks"), extra=embedded_task_configs())


def _samples(out: Path, task: str) -> dict[int, list]:
    (path,) = out.glob(f"*/samples_{task}_*.jsonl")
    return {s["doc_id"]: s["resps"] for s in map(json.loads, path.read_text().splitlines())}


def _in_process(engine, task_dir, task, batch_size, limit=LIMIT, **kwargs):
    lm = DllmKvqLM(engine=engine, batch_size=batch_size, cache_mode="dual")
    res = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=task_manager_for([task], str(task_dir)),
                                  limit=limit, bootstrap_iters=0, **kwargs)
    return res, lm


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A working directory where the section's first block (writing the task folder) has run, as after setup."""
    (tasks,) = [c for c in documented_commands() if " evaluate tasks " in c]
    assert tasks == ".venv/bin/dllm-kvq evaluate tasks --out .dllm-kvq/lm-eval-tasks"
    folder = tmp_path_factory.mktemp("workdir")
    subprocess.run([sys.executable, "-m", "evaluation", *shlex.split(tasks)[2:]], cwd=folder, check=True,
                   capture_output=True, timeout=300)
    assert (folder / ".dllm-kvq" / "lm-eval-tasks" / "digit_ledger.yaml").is_file()
    return folder


SLICE = 2  # documents per documented command here


def _values(results: dict) -> dict:
    """A task's metric values (standard errors depend on lm-eval's bootstrap setting, not on the answers)."""
    return {k: v for k, v in results.items() if isinstance(v, float) and "stderr" not in k}


def _command_id(line: str) -> str:
    """``lm_eval-local-completions-digit_ledger-template-remote``: program, model, task, template, tokenizer."""
    argv = shlex.split(line)
    args = dict(part.split("=", 1) for part in argv[argv.index("--model_args") + 1].split(","))
    return "-".join(filter(None, [argv[0].split("/")[-1], argv[argv.index("--model") + 1],
                                  argv[argv.index("--tasks") + 1],
                                  "template" if "--apply_chat_template" in argv else "",
                                  args.get("tokenizer_backend", "")]))


@pytest.mark.parametrize("line", LM_EVAL_COMMANDS, ids=[_command_id(c) for c in LM_EVAL_COMMANDS])
def test_documented_command_runs_and_answers_as_in_process(line, server, engine, task_dir, workdir, tmp_path):
    argv = shlex.split(line)
    program = {".venv/bin/lm_eval": ["-m", "lm_eval"], ".venv/bin/dllm-kvq": ["-m"]}[argv[0]]
    if argv[0] == ".venv/bin/dllm-kvq":
        assert argv[1:3] == ["evaluate", "lm-eval"]
        argv = ["evaluation", *argv[2:]]
    else:
        argv = argv[1:]
    argv = [a.replace("http://127.0.0.1:8000", server.url).replace("tokenizer=service/", f"tokenizer={REPO}/service/")
            for a in argv]
    argv[argv.index("--limit") + 1] = str(SLICE)
    out = tmp_path / "out"
    # lm-eval 0.4's --log_samples hashes each prompt as a string; with the remote tokenizer and the chat template the
    # prompt is a message list and it raises (documented in docs/evaluation.md): that run is checked by its score.
    samples = not ("tokenizer_backend=remote" in line and "--apply_chat_template" in argv)
    done = subprocess.run([sys.executable, *program, *argv, "--output_path", str(out),
                           *(["--log_samples"] if samples else [])],
                          cwd=workdir, capture_output=True, text=True, timeout=900, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    task = argv[argv.index("--tasks") + 1]
    (results,) = out.glob("*/results_*.json")
    scores = json.loads(results.read_text())["results"][task]
    if "local-completions" in argv:
        # The prompt's tokens are counted against the server's context, not lm-eval's default of 2048.
        context = httpx.get(server.url + "/v1/models").json()["data"][0]["max_model_len"]
        assert f"Using max length {context} - 1" in done.stderr
    # The same prompts (the chat template applied by the server, by /tokenize or by the tokenizer files) and the
    # same answers as the in-process model.
    gen = {"max_gen_toks": 32} if task == "gsm8k_local" else None
    local, lm = _in_process(engine, task_dir, task, batch_size=SLICE, limit=SLICE, gen_kwargs=gen,
                            apply_chat_template="--apply_chat_template" in argv)
    assert _values(scores) and _values(scores) == _values(local["results"][task])
    if samples:
        assert _samples(out, task) == {r.doc_id: [[r.text]] for r in lm.records}
    if task == "digit_ledger":
        assert any(r.text.strip() for r in lm.records)  # not two blanks compared


def test_chat_command_from_the_readme_equals_in_process(server, engine, task_dir, tmp_path):
    # The documented command (the console command is `python -m evaluation`), with this server's port and the
    # test's output folders.
    cmd = readme_command("local-chat-completions")
    assert cmd[:3] == [".venv/bin/dllm-kvq", "evaluate", "lm-eval"] and cmd[cmd.index("--limit") + 1] == "16"
    cmd = [sys.executable, "-m", "evaluation", *cmd[2:]]
    cmd = [a.replace("http://127.0.0.1:8000", server.url) for a in cmd]
    out = tmp_path / "http"
    cmd += ["--output_path", str(out), "--log_samples", "--include_path", str(task_dir)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    (results,) = out.glob("*/results_*.json")
    http_score = json.loads(results.read_text())["results"]["digit_ledger"]["exact_match,none"]

    res, lm = _in_process(engine, task_dir, "digit_ledger", batch_size=8, apply_chat_template=True)
    assert res["results"]["digit_ledger"]["exact_match,none"] == http_score
    assert 0.0 < http_score  # the embedded model solves some questions: the comparison is not of two blanks
    http = _samples(out, "digit_ledger")
    assert {r.doc_id: [[r.text]] for r in lm.records} == http


@pytest.mark.parametrize("gen", [
    {"max_gen_toks": 32},
    # The server's extra request fields, given the same way to both paths: a quantized prefix cache.
    {"max_gen_toks": 32, "cache_mode": "prefix", "kv_quant": {"method": "kivi", "bits": 2}},
], ids=["default", "prefix-kivi2"])
def test_completions_with_remote_tokenizer_equal_in_process(server, engine, task_dir, gen):
    manager = task_manager_for(["gsm8k_local"], str(task_dir))
    http = lm_eval.simple_evaluate(
        model="local-completions", task_manager=manager,
        model_args=f"model=embedded,base_url={server.url}/v1/completions,tokenizer_backend=remote,max_retries=1",
        tasks=["gsm8k_local"], limit=3, gen_kwargs=dict(gen), bootstrap_iters=0, log_samples=True)
    lm = DllmKvqLM(engine=engine, batch_size=3)
    local = lm_eval.simple_evaluate(model=lm, tasks=["gsm8k_local"], limit=3, gen_kwargs=dict(gen), bootstrap_iters=0,
                                    task_manager=manager, log_samples=True)
    assert http["results"]["gsm8k_local"] == local["results"]["gsm8k_local"]
    assert [s["resps"] for s in http["samples"]["gsm8k_local"]] == [s["resps"] for s in local["samples"]["gsm8k_local"]]
    assert any(s["resps"][0][0].strip() for s in local["samples"]["gsm8k_local"])
    if "kv_quant" in gen:
        assert lm.kv_reports and all(r.k_nominal_bits == 2.0 for r in lm.kv_reports)


def test_likelihood_payload_is_answered(server):
    """lm-eval's own likelihood request (echo, logprobs 1, max_tokens 1): the prompt's tokens scored, then the one
    generated token (which lm-eval drops); tests/api/test_likelihood_http.py checks the values."""
    api = LocalCompletionsAPI(model="embedded", base_url=f"{server.url}/v1/completions", tokenizer_backend="remote",
                              max_retries=1)
    payload = api._create_payload([[10, 11, 12, 13]], generate=False)
    assert payload["echo"] is True and payload["logprobs"] == 1 and payload["max_tokens"] == 1
    r = httpx.post(f"{server.url}/v1/completions", json=payload, timeout=120)
    assert r.status_code == 200, r.text
    logprobs = r.json()["choices"][0]["logprobs"]
    assert len(logprobs["token_logprobs"]) == 5 and logprobs["token_logprobs"][0] is None
    assert all(len(top) >= 1 for top in logprobs["top_logprobs"][1:])
    ((value, greedy),) = api.loglikelihood([Instance("loglikelihood", {}, ("copy: 1 2", " 1 2"), 0)],
                                           disable_tqdm=True)
    assert value < 0 and greedy is False


def test_scores_reach_metrics_and_the_store(server, engine, task_dir, prefix, monkeypatch):
    from evaluation.matrix import Cell, MatrixSettings, run_cell_task

    settings = MatrixSettings(tasks=["digit_ledger"], limit=4, chat_tasks=frozenset({"digit_ledger"}))
    result = run_cell_task(engine, Cell("embedded", "prefix", "kivi", 4), "digit_ledger", settings,
                           task_manager_for(["digit_ledger"], str(task_dir)), None)
    monkeypatch.setenv("DLLM_ADMIN_KEY", ADMIN_KEY)
    artifact_id = ScoreReporter(server_url=server.url)(result)
    labels = {"task": "digit_ledger", "metric": "exact_match,none", "method": "kivi", "bits": "4",
              "cache_mode": "prefix"}
    assert metric_sum(metrics(server.url), "dllm_eval_score", **labels) == pytest.approx(result["score"] / 100)
    stored = RedisStore(SHARED_REDIS_URL, prefix=prefix).get_json(KIND_EVAL_SCORES, artifact_id)
    assert stored["task"] == "digit_ledger" and stored["scores"]["exact_match,none"] == result["score"] / 100
    assert stored["kv_quant"]["method"] == "kivi" and stored["details"]["kv"]["k_nominal_bits"] == 4.0
