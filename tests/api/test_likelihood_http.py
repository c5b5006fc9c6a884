"""Issue 25, item 2: likelihoods over HTTP. ``/v1/completions`` with ``echo``, ``logprobs`` and ``max_tokens`` 0 (or
lm-eval's 1) scores the prompt's tokens with the in-process model's Monte-Carlo ELBO, so that lm-eval's
``local-completions`` computes the same ``loglikelihood`` and ``is_greedy`` as the in-process model, and the
multiple-choice variant of the embedded task gets the same accuracy over HTTP as in-process, on the same documents
and seeds. Against ``python -m service serve`` (embedded model), through the openai client and lm-eval."""

from __future__ import annotations

import lm_eval
import openai
import pytest
from lm_eval.api.instance import Instance
from lm_eval.models.openai_completions import LocalCompletionsAPI

from evaluation.embedded_choice import TASK
from evaluation.embedded_task import embedded_task_configs
from evaluation.likelihood import mc_loglikelihood
from evaluation.lm import DllmKvqLM
from evaluation.matrix import task_manager_for
from evaluation.tasks import write_task_dir
from service.engine import Engine
from tests.support.paths import REPO
from tests.support.processes import embedded_server

pytestmark = [pytest.mark.integration, pytest.mark.slow]
MC = 4  # Monte-Carlo samples on both paths (the server's DLLM_LIKELIHOOD_MC_NUM, the in-process mc_num)
#: The estimator's tolerance between the two paths: the same draws and the same forwards in two processes; the
#: per-token values are differences of estimates, summed back (float64 rounding).
TOL = 1e-6
TOKENIZER = str(REPO / "service/assets/embedded")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with embedded_server(tmp_path_factory.mktemp("likelihood"), "likelihood", DLLM_LIKELIHOOD_MC_NUM=str(MC),
                         DLLM_LIKELIHOOD_MC_BATCH_SIZE=str(MC)) as srv:
        yield srv


@pytest.fixture(scope="module")
def engine():
    return Engine.load(None, threads=1)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_echo_scores_every_split_as_the_in_process_estimate(client, engine):
    ids = engine.tokenizer("copy: 3 1 4 1 5<|eot_id|> 3 1 4")["input_ids"]
    out = client.completions.create(model="embedded", prompt=ids, echo=True, logprobs=2, max_tokens=0,
                                    extra_body={"mc_num": MC})
    choice = out.choices[0]
    values = choice.logprobs.token_logprobs
    assert choice.text == engine.tokenizer.decode(ids) and choice.finish_reason == "length"
    assert len(values) == len(ids) and values[0] is None and out.usage.completion_tokens == 0
    assert choice.logprobs.tokens == [engine.tokenizer.decode([t]) for t in ids]
    for c in range(1, len(ids)):  # whatever split the client sums from, the in-process value
        expected = mc_loglikelihood(engine.model, ids[:c], ids[c:], mask_id=engine.spec.mask_id, mc_num=MC,
                                    mc_batch_size=MC, seed=1234)
        assert sum(values[c:]) == pytest.approx(expected, abs=TOL)
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs[1:])
    # Another seed, another estimate; more samples, another estimate; a text prompt the same as its ids.
    assert client.completions.create(model="embedded", prompt=ids, echo=True, logprobs=0, max_tokens=0,
                                     seed=7).choices[0].logprobs.token_logprobs != values
    text = client.completions.create(model="embedded", prompt=engine.tokenizer.decode(ids), echo=True, logprobs=2,
                                     max_tokens=0)
    assert text.choices[0].logprobs.token_logprobs == values


def test_lm_eval_local_completions_equals_in_process(server, engine):
    requests = [Instance("loglikelihood", {}, (context, continuation), i) for i, (context, continuation) in
                enumerate([("copy: 1 2 3", " 1 2 3"), ("copy: 1 2 3", " 4 5 6"), ("next: 4 1", " 5 2")])]
    api = LocalCompletionsAPI(model="embedded", base_url=f"{server.url}/v1/completions",
                              tokenizer_backend="huggingface", tokenizer=TOKENIZER, max_retries=1)
    http = api.loglikelihood(requests, disable_tqdm=True)
    local = DllmKvqLM(engine=engine, mc_num=MC, mc_batch_size=MC).loglikelihood(requests, disable_tqdm=True)
    assert [g for _, g in http] == [g for _, g in local]
    assert [v for v, _ in http] == pytest.approx([v for v, _ in local], abs=TOL)
    assert len({round(v, 3) for v, _ in http}) == 3  # three different values: not a constant


def test_multiple_choice_task_accuracy_over_http_equals_in_process(server, engine, tmp_path):
    manager = task_manager_for([TASK], str(write_task_dir(tmp_path / "tasks", extra=embedded_task_configs())))
    # Each HTTP request scores every split of its ~110 tokens (the server cannot know lm-eval's): ~110 forwards
    # where the in-process model makes one, so the slice is small.
    common = {"tasks": [TASK], "task_manager": manager, "limit": 3, "bootstrap_iters": 0, "apply_chat_template": True,
              "log_samples": True}
    http = lm_eval.simple_evaluate(
        model="local-completions", model_args=f"model=embedded,base_url={server.url}/v1/completions,"
        f"tokenizer_backend=huggingface,tokenizer={TOKENIZER},max_retries=1", **common)
    local = lm_eval.simple_evaluate(model=DllmKvqLM(engine=engine, mc_num=MC, mc_batch_size=MC), **common)
    assert http["results"][TASK]["acc,none"] == local["results"][TASK]["acc,none"]
    scores = [r[0][0] for s in http["samples"][TASK] for r in s["resps"]]
    assert scores == pytest.approx([r[0][0] for s in local["samples"][TASK] for r in s["resps"]], abs=TOL)
    assert len(scores) == 12 and len(set(scores)) == 12
