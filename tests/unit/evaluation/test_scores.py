"""Score reports: the body the server's /admin/eval_scores takes, and the store-only path (local directory)."""

import pytest

from evaluation.scores import ScoreReporter, score_report
from service.policy.store import KIND_EVAL_SCORES, open_store

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
