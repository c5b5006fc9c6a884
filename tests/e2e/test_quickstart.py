"""The Quickstart (docs/quickstart.md) end to end: ``examples/quickstart.sh`` (the page's commands, one per step) against the
suite's own ``redis-server`` (an empty database, flushed after) and a real
``python -m service serve`` process, with small calibration settings, fp32, one thread. The checks are on
outcomes: the configuration each answer ran with is the one activated, the metrics move, the table has every
row, the served score equals the in-process one, and on the fixed 32-question held-out slice the table's
unquantized rows equal the figures the embedded model's card measured (``slice`` in its ``measurements.json``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from tests.support.paths import REPO
from tests.support.processes import SHARED_REDIS_URL, free_port

# The whole flow runs once, in the module fixture, under the first test's clock: more than the default 600 s.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1500)]
MEASUREMENTS = REPO / "service" / "assets" / "embedded" / "measurements.json"
ADMIN_KEY = "e2e-quickstart-admin-key-0123"
ROWS = ["No cache (full recompute)", "Cache only", "KIVI", "KVQuant", "dLLM-KVQ"]


@pytest.fixture(scope="module")
def store_url():
    """Database 1 of the suite's own redis-server (tests/conftest.py), flushed afterwards."""
    url = SHARED_REDIS_URL.rsplit("/", 1)[0] + "/1"
    client = redis.Redis.from_url(url)
    assert client.dbsize() == 0
    yield url
    client.flushdb()


@pytest.fixture(scope="module")
def run(tmp_path_factory, store_url):
    """Run the quickstart script once; returns its output folder."""
    runs = tmp_path_factory.mktemp("quickstart")
    env = {**os.environ, "PY": sys.executable, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "HF_DATASETS_OFFLINE": "1", "PORT": str(free_port()), "STORE": store_url, "RUNS": str(runs),
           "DLLM_ADMIN_KEY": ADMIN_KEY, "ASK_QUESTIONS": "4", "LIMIT": "32",
           "CALIBRATION_ARGS": "--samples 2 --rounds 1 --cache-modes dual --bits 2 --kvquant-bits 2"}
    # Own process group, so that a timeout also ends the server the script started.
    proc = subprocess.Popen(["bash", "examples/quickstart.sh"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=1200)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    (runs / "quickstart.out").write_text(out)
    assert proc.returncode == 0, out[-4000:] + (runs / "server.log").read_text(errors="replace")[-3000:]
    return runs


def _metrics(path: Path) -> dict:
    out = {}
    for family in text_string_to_metric_families(path.read_text()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(samples: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def _json(path: Path):
    return json.loads(path.read_text())


def test_each_answer_ran_with_the_configuration_activated(run):
    body = _json(run / "calibration" / "activate" / "dllm_kvq-dual-2bit.json")
    assert body["method"] == "dllm_kvq" and body["bits"] == 2 and body["policy_id"].startswith("policy-")
    first, kivi, back = (_json(run / f"activate-{n}.json") for n in ("dllm_kvq", "kivi", "back"))
    # The store had no active entry (old null, as /admin/audit records it); the server served its default.
    assert first["new"]["policy_id"] == body["policy_id"] and first["old"] is None
    assert first["served_before"] == {"method": "none"}
    assert kivi["old"]["policy_id"] == body["policy_id"] and kivi["new"]["method"] == "kivi"
    assert back["old"]["method"] == "kivi" and back["new"]["policy_id"] == body["policy_id"]

    asked = _json(run / "ask-dllm_kvq.json")
    served = [a["kv_config"] for a in asked["answers"] if a["kv_config"]] + [asked["tokens_per_s"]["dual"]["kv_config"]]
    assert len(served) == 6  # 4 chat answers, the completion, the dual tokens/s pass
    for config in served:
        assert config["source"] == "active" and config["cache_mode"] == "dual"
        assert {k: config["kv_quant"].get(k) for k in body} == body
    for mode in ("none", "prefix"):  # nothing was activated for them: unquantized
        assert asked["tokens_per_s"][mode]["kv_config"]["kv_quant"]["method"] == "none"
    own = asked["tokens_per_s"]["dual-unquantized"]["kv_config"]  # the request's own configuration wins
    assert own["source"] == "request" and own["kv_quant"]["method"] == "none"
    assert _json(run / "ask-kivi.json")["tokens_per_s"]["dual"]["kv_config"]["kv_quant"]["method"] == "kivi"
    for answer in asked["answers"]:  # well-formed: digits, cut at the end of turn or at the window's end
        assert set(answer["text"]) <= set("0123456789 ") and 0 < answer["completion_tokens"] <= 64
        assert answer["finish_reason"] in ("stop", "length")
        assert answer["finish_reason"] == "stop" or answer["completion_tokens"] == 64


def test_the_metrics_move(run):
    before, quantized, kivi, end = (_metrics(run / f"metrics-{n}.txt") for n in ("before", "dllm_kvq", "kivi", "end"))
    policy = _json(run / "calibration" / "activate" / "dllm_kvq-dual-2bit.json")["policy_id"]
    ours = {"method": "dllm_kvq", "bits": "2", "cache_mode": "dual", "policy": policy}
    assert _value(quantized, "dllm_generation_tokens_total") > _value(before, "dllm_generation_tokens_total")
    assert _value(before, "dllm_kv_bytes_held", **ours) == 0 and _value(quantized, "dllm_kv_bytes_held", **ours) > 0
    held, bf16 = _value(quantized, "dllm_kv_bytes_held", **ours), _value(quantized, "dllm_kv_bf16_bytes", **ours)
    assert 0 < held < bf16 / 2  # 2-bit codes and their scales: under half of bf16
    k_bits = _value(quantized, "dllm_kv_effective_bits", tensor="k", accounting="nominal", **ours)
    assert 2.0 <= k_bits <= 2.9  # the policy's protected tokens, within its cap
    assert _value(quantized, "dllm_active_config_info", cache_mode="dual", method="dllm_kvq", policy=policy) == 1
    assert _value(quantized, "dllm_shadow_token_agreement_count", **ours) > 0  # agreement measured online
    kivi_labels = {"method": "kivi", "bits": "2", "cache_mode": "dual"}
    assert _value(kivi, "dllm_kv_effective_bits", tensor="k", accounting="nominal", **kivi_labels) == 2.0
    assert _value(kivi, "dllm_active_config_info", cache_mode="dual", method="kivi") == 1
    assert _value(end, "dllm_config_changes_total", cache_mode="dual") == 3
    assert _value(end, "dllm_active_config_info", cache_mode="dual", method="dllm_kvq", policy=policy) == 1
    assert _value(end, "dllm_eval_score", task="digit_ledger", method="dllm_kvq", bits="2", cache_mode="dual") > 0


def test_table_rows_served_score_and_the_cards_slice(run):
    table = _json(run / "matrix" / "matrix.json")
    (block,) = table["blocks"]
    rows = {r["label"]: r for r in block["rows"]}
    assert list(rows) == ROWS and all(r["scores"]["digit_ledger"] is not None for r in rows.values())
    assert all(rows[label]["kv"]["bytes_held"] > 0 for label in ROWS[2:])
    md = (run / "matrix" / "matrix.md").read_text()
    assert all(f"| {label}" in md for label in ROWS)
    # The calibration run's diagnostics (--from-calibration latest) for the policy that was activated and served.
    policy = _json(run / "calibration" / "activate" / "dllm_kvq-dual-2bit.json")["policy_id"]
    assert "Table 4" in md and [r["policy_id"] for r in table["table4"]] == [policy]

    measured = _json(MEASUREMENTS)  # by scripts/validate_embedded.py, shown on the model card
    assert "slice" in measured, "measurements.json has no fixed slice: rerun scripts/validate_embedded.py --out ..."
    fixed = measured["slice"]
    assert {"none", "dual"} <= set(fixed["exact_match"]), "the card's slice needs the none and dual modes measured"
    assert fixed["questions"] == 32
    assert rows["No cache (full recompute)"]["scores"]["digit_ledger"] == pytest.approx(100 * fixed["exact_match"]["none"])
    assert rows["Cache only"]["scores"]["digit_ledger"] == pytest.approx(100 * fixed["exact_match"]["dual"])

    # Over HTTP (lm-eval local-chat-completions, the activated 2-bit dLLM-KVQ policy) = in-process, text for text.
    (results,) = (run / "lm-eval").glob("*/results_*.json")
    served = _json(results)["results"]["digit_ledger"]["exact_match,none"]
    assert 100 * served == pytest.approx(rows["dLLM-KVQ"]["scores"]["digit_ledger"])
    (samples,) = (run / "lm-eval").glob("*/samples_digit_ledger_*.jsonl")
    http = {s["doc_id"]: s["resps"][0][0] for s in map(json.loads, samples.read_text().splitlines())}
    (cell_file,) = (run / "matrix" / "cells" / "embedded").glob("*/dual-dllm_kvq-2/digit_ledger-*.json")  # per weights
    cell = _json(cell_file)
    assert cell["artifact_id"] == policy
    assert {r["doc_id"]: r["text"] for r in cell["records"]} == http and len(http) == 32
    assert "digit_ledger" in (run / "quickstart.out").read_text()
