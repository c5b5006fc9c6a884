"""Score reports: the body the server's /admin/eval_scores takes, and the store-only path (local directory)."""

import pytest

from evaluation.scores import ScoreReporter, reports_from_lm_eval, score_report
from service.store.base import KIND_EVAL_SCORES, open_store

RESULT = {
    "task": "digit_ledger", "model": "embedded", "fingerprint": "abc", "metric": "exact_match,none", "score": 50.0,
    "metrics": {"exact_match,none": 0.5, "exact_match_stderr,none": 0.1, "sample_len": 4},
    "config": {"method": "kivi", "bits": 2}, "cell": {"cache_mode": "dual"}, "settings": {"limit": 4},
    "kv": {"k_nominal_bits": 2.0}, "seconds": 1.5, "records": [{}, {}, {}, {}],
}


def test_report_body_keeps_scores_and_labels_only():
    body = score_report(RESULT)
    assert body["scores"] == {"exact_match,none": 0.5}
    assert (body["task"], body["cache_mode"], body["kv_quant"]["method"], body["limit"]) == ("digit_ledger", "dual",
                                                                                             "kivi", 4)
    assert body["details"]["documents"] == 4 and body["model_fingerprint"] == "abc"


def test_store_only_reporter_writes_an_eval_scores_artifact(tmp_path):
    reporter = ScoreReporter(store_url=str(tmp_path))
    artifact_id = reporter(RESULT)
    store = open_store(str(tmp_path))
    assert store.list(KIND_EVAL_SCORES) == [artifact_id] == reporter.sent
    assert store.get_json(KIND_EVAL_SCORES, artifact_id)["scores"] == {"exact_match,none": 0.5}


def test_server_reporter_needs_the_admin_key(monkeypatch):
    monkeypatch.delenv("DLLM_ADMIN_KEY", raising=False)
    with pytest.raises(KeyError, match="set DLLM_ADMIN_KEY"):
        ScoreReporter(server_url="http://127.0.0.1:1")


def _lm_eval_results(model, model_args, gen_kwargs):
    return {"config": {"model": model, "model_args": model_args, "gen_kwargs": gen_kwargs, "limit": 16.0},
            "results": {"digit_ledger": {"alias": "digit_ledger", "sample_len": 16, "exact_match,none": 0.75,
                                         "exact_match_stderr,none": 0.1}}, "n-samples": {"digit_ledger": {}}}


def test_reports_from_an_in_process_lm_eval_run_read_the_model_args():
    (report,) = reports_from_lm_eval(_lm_eval_results("dllm-kvq", "cache_mode=prefix,method=kivi,bits=2", {}))
    assert report["cache_mode"] == "prefix" and report["kv_quant"]["method"] == "kivi"
    assert report["kv_quant"]["bits"] == 2 and report["scores"] == {"exact_match,none": 0.75}
    assert report["limit"] == 16


def test_reports_from_an_http_run_need_the_configuration_unless_the_requests_carried_it():
    with pytest.raises(ValueError, match="pass --cache-mode and --kv-quant"):
        reports_from_lm_eval(_lm_eval_results("local-chat-completions", {"base_url": "x"}, {}))
    (report,) = reports_from_lm_eval(_lm_eval_results("local-completions", {}, {"cache_mode": "dual",
                                                                                "kv_quant": {"method": "kivi"}}))
    assert (report["cache_mode"], report["kv_quant"]) == ("dual", {"method": "kivi"})
    (report,) = reports_from_lm_eval(_lm_eval_results("local-chat-completions", {}, {}), "none", {"method": "none"})
    assert report["cache_mode"] == "none"


def test_push_scores_command_stores_each_task(tmp_path):
    import json

    from evaluation.cli import main

    path = tmp_path / "results.json"
    path.write_text(json.dumps(_lm_eval_results("dllm-kvq", {"cache_mode": "dual"}, {})))
    assert main(["push-scores", str(path), "--store", str(tmp_path / "store")]) == 0
    assert len(open_store(str(tmp_path / "store")).list(KIND_EVAL_SCORES)) == 1
