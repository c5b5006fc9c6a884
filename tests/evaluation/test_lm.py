"""The in-process lm-eval model ``dllm-kvq`` on a tiny LLaDA: lm-eval -> model -> engine -> lm-eval's metric."""

from __future__ import annotations

import lm_eval
import pytest
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model
from lm_eval.tasks import TaskManager

from evaluation.likelihood import mc_loglikelihood
from evaluation.lm import MODEL_NAME, DllmKvqLM
from service.engine.params import DecodeParams, RowOptions
from tests.evaluation.conftest import PROMPTS, STOP, direct_answers, write_echo_task


@pytest.fixture(scope="module")
def answers(engine):
    return direct_answers(engine)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory, answers):
    # Right answers except the last document: exact match must be 5/6.
    return write_echo_task(tmp_path_factory.mktemp("task"), answers[:-1] + ["w1 w2 w3"])


def _evaluate(lm, task_dir):
    # include_defaults=False: indexing lm-eval's thousands of built-in tasks takes ~20 s and is not needed.
    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    return lm_eval.simple_evaluate(model=lm, tasks=["tiny_echo"], task_manager=manager, log_samples=False,
                                   bootstrap_iters=0)["results"]["tiny_echo"]


def test_registered_under_its_name():
    assert get_model(MODEL_NAME) is DllmKvqLM


@pytest.mark.integration  # lm-eval's evaluate reports its environment: torch's collect_env runs pip as a process
def test_scores_through_lm_eval_equal_direct_decoding_and_batch_size_does_not_matter(engine, task_dir, answers):
    assert any(STOP in direct for direct in direct_answers_uncut(engine))  # the stop string really cuts something
    scores, records = {}, {}
    for batch_size in (1, 8):
        lm = DllmKvqLM(engine=engine, cache_mode="dual", batch_size=batch_size)
        scores[batch_size] = _evaluate(lm, task_dir)["exact_match,none"]
        records[batch_size] = sorted((r.doc_id, r.ids, r.text) for r in lm.records)
        assert [r.text for r in sorted(lm.records, key=lambda r: r.doc_id)] == answers
        assert all(STOP not in r.text for r in lm.records)
    assert scores[1] == scores[8] == pytest.approx(5 / 6)
    assert records[1] == records[8]


def direct_answers_uncut(engine):
    params = DecodeParams(gen_length=64, block_length=32, cache_mode="dual", threshold=0.9)
    return [engine.generate([engine.encode_prompt(p, chat=False)], params).rows[0].text for p in PROMPTS]


def test_response_window_is_max_gen_toks_rounded_up_to_blocks(engine):
    # Decoded in whole blocks (17 -> 32 positions), cut back to 17 tokens as the server cuts max_tokens (issue 13;
    # this compared with the uncut 32 positions before).
    lm = DllmKvqLM(engine=engine, cache_mode="prefix", block_length=16)
    req = Instance("generate_until", {}, (PROMPTS[0], {"until": [], "max_gen_toks": 17}), 0)
    (text,) = lm.generate_until([req], disable_tqdm=True)
    direct = engine.generate([engine.encode_prompt(PROMPTS[0], chat=False)],
                             DecodeParams(gen_length=32, block_length=16, cache_mode="prefix", threshold=0.9),
                             [RowOptions(max_tokens=17)]).rows[0]
    assert text == direct.text and lm.records[0].ids == tuple(direct.generated_ids)
    assert len(direct.generated_ids) <= 17
    # gen_kwargs carry the server's decoding fields too, so one --gen_kwargs serves both paths.
    req = Instance("generate_until", {}, (PROMPTS[0], {"until": [], "max_gen_toks": 17, "block_length": 32,
                                                       "cache_mode": "none"}), 0)
    (text,) = lm.generate_until([req], disable_tqdm=True)
    direct = engine.generate([engine.encode_prompt(PROMPTS[0], chat=False)],
                             DecodeParams(gen_length=32, block_length=32, cache_mode="none", threshold=0.9),
                             [RowOptions(max_tokens=17)]).rows[0]
    assert text == direct.text


def test_kv_quantization_reaches_the_engine_and_reports_effective_bits(engine):
    lm = DllmKvqLM(engine=engine, cache_mode="dual", method="kivi", bits=2, batch_size=3)
    reqs = [Instance("generate_until", {}, (p, {"until": [], "max_gen_toks": 32}), i) for i, p in enumerate(PROMPTS)]
    lm.generate_until(reqs, disable_tqdm=True)
    assert len(lm.kv_reports) == 2 and all(r.k_nominal_bits == 2.0 and r.v_nominal_bits == 2.0 for r in lm.kv_reports)
    assert all(r.k_storage_bits > 2.0 for r in lm.kv_reports)  # scales and zeros cost storage


def test_loglikelihood_is_the_mc_estimate_and_independent_of_batching(engine):
    lm = DllmKvqLM(engine=engine, mc_num=8, mc_batch_size=4, seed=3)
    reqs = [Instance("loglikelihood", {}, ("w5 w6", " w7 w8"), 0), Instance("loglikelihood", {}, ("w9", " w10"), 1)]
    both = lm.loglikelihood(reqs, disable_tqdm=True)
    alone = lm.loglikelihood(reqs[1:], disable_tqdm=True)
    assert both[1] == alone[0]
    expected = mc_loglikelihood(engine.model, [5, 6], [7, 8], mask_id=engine.spec.mask_id, mc_num=8,
                                mc_batch_size=4, seed=3)
    assert both[0] == (pytest.approx(expected), False)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"cache_mod": "dual"}, "unknown model_args \\['cache_mod'\\]; legal: cache_mode, .*model, dtype"),
    ({"steps": 8, "threshold": 0.9}, "exactly one of threshold"),  # steps alone replaces the threshold
    ({"method": "dllm_kvq"}, "needs exactly one of policy_id or policy_file"),
    ({"method": "gptq"}, "none', 'kivi', 'kvquant' or 'dllm_kvq'"),
    ({"batch_size": "auto"}, "batch_size must be a positive integer"),
])
def test_bad_model_args_name_the_legal_values(engine, kwargs, match):
    with pytest.raises(ValueError, match=match):
        DllmKvqLM(engine=engine, **kwargs)


def test_unsupported_sampling_knobs_are_refused(engine):
    lm = DllmKvqLM(engine=engine)
    req = Instance("generate_until", {}, (PROMPTS[0], {"until": [], "top_p": 0.9}), 0)
    with pytest.raises(ValueError, match="top_p=0.9 is not supported"):
        lm.generate_until([req], disable_tqdm=True)


def test_rows_sample_with_their_seed(engine):
    lm = DllmKvqLM(engine=engine, seed=11)
    req = Instance("generate_until", {}, (PROMPTS[1], {"until": [], "max_gen_toks": 32, "do_sample": True, "temperature": 1.0}), 0)
    (text,) = lm.generate_until([req], disable_tqdm=True)
    direct = engine.generate([engine.encode_prompt(PROMPTS[1], chat=False)],
                             DecodeParams(gen_length=32, block_length=32, cache_mode="dual", threshold=0.9),
                             [RowOptions(temperature=1.0, seed=11)]).rows[0]
    assert text == direct.text


def test_lm_evals_own_models_stay_registered():
    assert get_model("local-completions").__name__ == "LocalCompletionsAPI"
    assert get_model("dummy").__name__ == "DummyLM"


def test_a_policy_fitted_for_another_cache_mode_is_refused(engine, tmp_path):
    """The model passes its cache mode to the one resolver, as the server does: a dual-cache policy with
    cache_mode=prefix is refused at construction, and per request when gen_kwargs switch the cache mode."""
    from service.artifacts.base import ArtifactMismatch, Provenance
    from service.artifacts.policy import LayerPolicy, PolicyTable

    spec = engine.spec
    table = PolicyTable(model_id=spec.model_id, weights_fingerprint=spec.fingerprint, cache_mode="dual", bits=2,
                        k_group_size=32, v_group_size=16, k_bit_cap=4.9, provenance=Provenance(data="-", code="tests"),
                        layers=[LayerPolicy(score_type="hybrid", p=1)] * spec.num_layers)
    path = tmp_path / "policy.json"
    path.write_text(table.to_json())
    with pytest.raises(ArtifactMismatch, match="cache_mode: the artifact has 'dual', the configuration asks for "
                                               "'prefix'"):
        DllmKvqLM(engine=engine, cache_mode="prefix", method="dllm_kvq", bits=2, policy_file=str(path))
    lm = DllmKvqLM(engine=engine, cache_mode="dual", method="dllm_kvq", bits=2, policy_file=str(path))
    req = Instance("generate_until", {}, (PROMPTS[0], {"until": [], "max_gen_toks": 32, "cache_mode": "prefix"}), 0)
    with pytest.raises(ArtifactMismatch, match="cache_mode"):
        lm.generate_until([req], disable_tqdm=True)
