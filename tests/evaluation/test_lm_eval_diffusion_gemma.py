"""lm-eval on DiffusionGemma, on the tiny checkpoint (tests/data/diffusion_gemma/dgemma-tiny: tokenizer, chat
template): the in-process model ``dllm-kvq`` decodes ``generate_until`` requests as the engine does each alone
(renoising settings as model_args), lm-eval's ``local-completions`` over HTTP against a real server answers the
same (the server's renoising defaults as DLLM_* settings), and likelihood requests are refused in both paths (the
family has no ELBO; the server's refusal is a 400 naming ``logprobs``)."""

from __future__ import annotations

import re
from pathlib import Path

import lm_eval
import pytest
from lm_eval.api.instance import Instance
from lm_eval.tasks import TaskManager

from evaluation.lm import DllmKvqLM
from service.engine.errors import EngineInputError
from service.engine.params import DecodeParams, RowOptions, response_length
from tests.evaluation.conftest import (
    MAX_GEN_TOKS,
    PROMPTS,
    STOP,
    http_echo_answers,
    run_lm_eval_http,
    write_choice_task,
    write_echo_task,
)
from tests.support.llada2 import start_llada2_server
from tests.support.paths import REPO

TINY = REPO / "tests" / "data" / "diffusion_gemma" / "dgemma-tiny"
#: In process (`Engine.check_likelihood`): the family has no likelihood.
NO_LIKELIHOOD = "not implemented for diffusion_gemma models"
#: lm-eval's own default seed (its local-completions sends it; the in-process model_args' default is the same).
SEED = 1234
STEPS = 3
LIMIT = 2


@pytest.fixture(scope="module")
def lm():
    return DllmKvqLM(model=str(TINY), max_denoising_steps=STEPS, batch_size=2, threads=1)


def _requests(prompts=PROMPTS[:LIMIT]) -> list[Instance]:
    return [Instance("generate_until", {}, (p, {"until": [STOP], "max_gen_toks": MAX_GEN_TOKS}), i)
            for i, p in enumerate(prompts)]


def _alone(engine, prompt: str) -> str:
    """What the engine decodes for ``prompt`` alone, cut as lm-eval's request asks."""
    params = DecodeParams(gen_length=response_length(MAX_GEN_TOKS, 32), max_denoising_steps=STEPS)
    row = RowOptions(seed=SEED, max_tokens=MAX_GEN_TOKS, stop=(STOP,))
    return engine.generate([engine.encode_prompt(prompt, chat=False)], params, [row]).rows[0].text


def test_generate_until_decodes_as_the_engine_alone(lm):
    assert lm.engine.spec.arch == "diffusion_gemma"
    expected = [_alone(lm.engine, p) for p in PROMPTS[:LIMIT]]
    assert all(t.strip() for t in expected)  # not blanks compared
    assert lm.generate_until(_requests(), disable_tqdm=True) == expected  # two rows in one batch: each as alone
    assert [r.nfe > 0 for r in lm.records] == [True] * LIMIT


def test_likelihood_is_refused(lm):
    with pytest.raises(EngineInputError, match=re.escape(NO_LIKELIHOOD)):
        lm.loglikelihood([Instance("loglikelihood", {}, ("w5 w6", " w7"), 0)], disable_tqdm=True)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory, lm):
    """``tiny_echo`` (generate_until; references: the engine's own answers, so exact match is 1) and
    ``tiny_choice`` (multiple_choice: loglikelihood requests)."""
    folder = write_echo_task(tmp_path_factory.mktemp("dgemma-tasks"), [_alone(lm.engine, p) for p in PROMPTS])
    return write_choice_task(folder)


@pytest.mark.integration  # lm-eval's evaluate reports its environment: torch's collect_env runs pip as a process
def test_simple_evaluate_in_process_runs_to_results(lm, task_dir):
    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    lm.records.clear()
    res = lm_eval.simple_evaluate(model=lm, tasks=["tiny_echo"], task_manager=manager, limit=LIMIT,
                                  bootstrap_iters=0)
    assert res["results"]["tiny_echo"]["exact_match,none"] == 1.0
    assert len(lm.records) == LIMIT


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_llada2_server(TINY, tmp_path_factory.mktemp("dgemma-eval-server"),
                              DLLM_MAX_DENOISING_STEPS=str(STEPS))
    yield srv
    srv.stop()


def _lm_eval(server, task_dir: Path, task: str, out: Path):
    return run_lm_eval_http(server.url, "dgemma-tiny", task_dir, task, out, LIMIT)


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
    assert done.returncode != 0
    assert "400 Client Error" in done.stderr and "not defined for DiffusionGemma" in done.stderr, \
        done.stderr[-3000:]
    assert '"param":"logprobs"' in done.stderr
    assert not list((tmp_path / "out").glob("*/results_*.json"))
