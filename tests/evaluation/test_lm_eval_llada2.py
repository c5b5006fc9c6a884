"""lm-eval on LLaDA2 (issue 31 item 7), on the tiny chat checkpoint (tests/data/llada2/llada2-tiny-chat: byte-level
tokenizer, chat template): the in-process model ``dllm-kvq`` decodes ``generate_until`` requests as the engine does
alone in each cache mode the family takes, and lm-eval's ``local-completions`` over HTTP against a real server
answers the same; likelihood requests are refused in both paths with the one reason the engine gives (LLaDA2's
ELBO over its block-causal mask is not implemented), the server's as a 400."""

from __future__ import annotations

import re
from pathlib import Path

import lm_eval
import pytest
from lm_eval.api.instance import Instance
from lm_eval.tasks import TaskManager

from evaluation.lm import DllmKvqLM
from service.engine.errors import EngineInputError
from service.engine.params import DecodeParams, RowOptions
from tests.evaluation.conftest import (
    MAX_GEN_TOKS,
    PROMPTS,
    STOP,
    http_echo_answers,
    run_lm_eval_http,
    write_choice_task,
    write_echo_task,
)
from tests.support.llada2 import LLADA2_CHAT, start_llada2_server

#: What the refusal of likelihood on a block-causal model says in process (`Engine.check_likelihood`) and in the
#: server's 400 (echo with logprobs: "... scores the prompt with the ELBO, which is not implemented for ...").
NO_LIKELIHOOD = "not implemented for llada2 models"
LIMIT = 2


@pytest.fixture(scope="module")
def lm():
    return DllmKvqLM(model=str(LLADA2_CHAT), cache_mode="block", batch_size=2)


def _requests(prompts=PROMPTS[:LIMIT]) -> list[Instance]:
    return [Instance("generate_until", {}, (p, {"until": [STOP], "max_gen_toks": MAX_GEN_TOKS}), i)
            for i, p in enumerate(prompts)]


def _alone(engine, prompt: str, cache_mode: str) -> str:
    """What the engine decodes for ``prompt`` alone (64 positions: MAX_GEN_TOKS in whole blocks), cut as lm-eval's
    request asks."""
    params = DecodeParams(gen_length=64, block_length=32, cache_mode=cache_mode, threshold=0.9)
    row = RowOptions(max_tokens=MAX_GEN_TOKS, stop=(STOP,))
    return engine.generate([engine.encode_prompt(prompt, chat=False)], params, [row]).rows[0].text


def test_generate_until_decodes_as_the_engine_alone_in_each_cache_mode(lm):
    assert lm.engine.spec.arch == "llada2"
    expected = [_alone(lm.engine, p, "block") for p in PROMPTS[:LIMIT]]
    assert all(t.strip() for t in expected)  # not blanks compared
    assert lm.generate_until(_requests(), disable_tqdm=True) == expected
    assert [r.nfe > 0 for r in lm.records] == [True] * LIMIT
    # none (full recompute) gives the exact cache's tokens; prefix and dual (the model_args' default) decode as block.
    for mode in ("none", "prefix", "dual"):
        other = DllmKvqLM(engine=lm.engine, cache_mode=mode, batch_size=2)
        assert other.generate_until(_requests(), disable_tqdm=True) == expected, mode
    assert DllmKvqLM(engine=lm.engine).args.cache_mode == "dual"


def test_likelihood_is_refused_with_the_servers_reason(lm):
    with pytest.raises(EngineInputError, match=re.escape(NO_LIKELIHOOD)):
        lm.loglikelihood([Instance("loglikelihood", {}, ("w5 w6", " w7"), 0)], disable_tqdm=True)
    with pytest.raises(EngineInputError, match=re.escape(NO_LIKELIHOOD)):
        lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("w5 w6 w7",), 0)], disable_tqdm=True)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory, lm):
    """``tiny_echo`` (generate_until; references: the engine's own answers, so exact match is 1) and
    ``tiny_choice`` (multiple_choice: loglikelihood requests)."""
    folder = write_echo_task(tmp_path_factory.mktemp("llada2-tasks"), [_alone(lm.engine, p, "block") for p in PROMPTS])
    return write_choice_task(folder)


@pytest.mark.integration  # lm-eval's evaluate reports its environment: torch's collect_env runs pip as a process
def test_simple_evaluate_in_process_runs_to_results(lm, task_dir):
    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    lm.records.clear()
    res = lm_eval.simple_evaluate(model=lm, tasks=["tiny_echo"], task_manager=manager, limit=LIMIT,
                                  bootstrap_iters=0)
    assert res["results"]["tiny_echo"]["exact_match,none"] == 1.0
    assert len(lm.records) == LIMIT
    with pytest.raises(EngineInputError, match=re.escape(NO_LIKELIHOOD)):
        lm_eval.simple_evaluate(model=lm, tasks=["tiny_choice"], task_manager=manager, limit=LIMIT,
                                bootstrap_iters=0)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_llada2_server(LLADA2_CHAT, tmp_path_factory.mktemp("llada2-eval-server"))
    yield srv
    srv.stop()


def _lm_eval(server, task_dir: Path, task: str, out: Path):
    return run_lm_eval_http(server.url, "llada2-tiny-chat", task_dir, task, out, LIMIT)


@pytest.mark.integration
@pytest.mark.slow
def test_local_completions_over_http_answers_as_in_process(server, lm, task_dir, tmp_path):
    done = _lm_eval(server, task_dir, "tiny_echo", tmp_path / "out")
    assert done.returncode == 0, done.stderr[-3000:]
    exact, http = http_echo_answers(tmp_path / "out")
    assert exact == 1.0
    assert http == dict(enumerate(lm.generate_until(_requests(), disable_tqdm=True)))


@pytest.mark.integration
@pytest.mark.slow
def test_loglikelihood_task_over_http_reports_the_servers_400(server, task_dir, tmp_path):
    done = _lm_eval(server, task_dir, "tiny_choice", tmp_path / "out")
    # lm-eval logs the server's error body (a WARNING naming the field), then stops on requests' HTTPError.
    assert done.returncode != 0
    assert "400 Client Error" in done.stderr and NO_LIKELIHOOD in done.stderr, done.stderr[-3000:]
    assert '"param":"logprobs"' in done.stderr
    assert not list((tmp_path / "out").glob("*/results_*.json"))
