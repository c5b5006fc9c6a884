"""End to end: ``python -m calibration all --samples 2 --rounds 1`` on the tiny LLaDA checkpoint, as a user runs
it, with a real Redis store (own key prefix, removed afterwards) and with a directory store plus shard files."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest
import redis

from calibration.cli import main
from calibration.fit import DiagnosticSums
from service.artifacts.kvquant_state import KVQuantState
from service.artifacts.policy import PolicyTable, nominal_k_bits
from service.engine import Engine
from service.store.base import KIND_KVQUANT_STATE, KIND_POLICY, KIND_TRAJECTORY, open_store
from tests.calibration.test_job import CKPT, token_id_bucket
from tests.support.apps import ADMIN_KEY
from tests.support.paths import REPO
from tests.support.processes import SHARED_REDIS_URL, ServerProcess

ROOT = REPO
REDIS_URL = SHARED_REDIS_URL


def _run(*args: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "calibration", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture
def redis_prefix():
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.ConnectionError:
        pytest.fail(f"the suite's redis-server at {REDIS_URL} does not answer")
    prefix = f"test-calibration-{uuid.uuid4().hex[:8]}"
    yield prefix
    for key in client.scan_iter(f"{prefix}:*"):
        client.delete(key)


@pytest.mark.slow
@pytest.mark.integration
def test_calibration_all_writes_policies_and_states_into_redis(tmp_path, redis_prefix):
    bucket = token_id_bucket(tmp_path / "qa.jsonl")
    out = _run("all", "--model", str(CKPT), "--bucket", f"qa={bucket}", "--samples", "2", "--rounds", "1",
               "--store", REDIS_URL, "--store-prefix", redis_prefix, "--out", str(tmp_path / "report"),
               "--no-progress")
    assert "nothing was activated" in out and "policy dual/4: policy-" in out
    store = open_store(REDIS_URL, prefix=redis_prefix)
    spec = Engine.load(CKPT).spec
    policies = [store.get_model(KIND_POLICY, i, PolicyTable) for i in store.list(KIND_POLICY)]
    assert sorted((p.cache_mode, p.bits) for p in policies) == [("dual", 2), ("dual", 4), ("prefix", 2), ("prefix", 4)]
    for policy in policies:
        policy.validate_for(spec)
        assert policy.k_bit_cap == {2: 2.9, 4: 4.9}[policy.bits]
    states = [KVQuantState.from_bytes(store.get(KIND_KVQUANT_STATE, i)) for i in store.list(KIND_KVQUANT_STATE)]
    assert sorted(s.bits for s in states) == [2, 4]
    for state in states:
        state.validate_for(spec)
    assert len(store.list(KIND_TRAJECTORY)) == 2
    assert store.list_active() == []  # the job never activates anything
    report = (tmp_path / "report" / "report.md").read_text()
    assert "Table 4" in report and "policy_map.png" in report
    # Per-layer policy tables: per policy, one row per layer with its score type, p and nominal K bits.
    for policy in policies:
        section = report.split(f"#### {policy.cache_mode}/{policy.bits}\n")[1].split("####")[0]
        assert f"Policy `{policy.id}`" in section
        for i, layer in enumerate(policy.layers):
            nominal = nominal_k_bits(policy.bits, policy.k_group_size, layer.p)
            assert f"| {i} | {layer.score_type if layer.p else '— (all low-bit)'} | {layer.p} | {nominal:.3f} |" \
                in section
    # TRACE convergence: a row per sample with its objective per round, in the report and the summary.
    convergence = report.split("## TRACE convergence")[1].split("## Trajectory")[0]
    assert "within the limit of 1 refinement round(s)" in convergence and convergence.count("| `trace-") == 2
    assert " of 2 samples settled (assignment unchanged) within the round limit" in out
    # One round: no change between rounds exists, so none is printed as +0.0000.
    assert "no change between rounds to report" in out and "+0.0000" not in out + convergence
    # K/V pictures only where they show something: the reuse error of every layer and head, and the surfaces of
    # the head with the largest K error (named in the report).
    (surfaces,) = sorted(p.name for p in (tmp_path / "report").glob("kv_surfaces_*.png"))
    assert surfaces.endswith("_block0.png") and f"![K and V surfaces]({surfaces})" in report
    assert "What to look for" in report and "A tie is not a win" in report
    for name in ("policy_map.png", "win_rates.png", "reuse_error.png", surfaces):
        assert (tmp_path / "report" / name).stat().st_size > 10_000
    _activate_and_serve(tmp_path, redis_prefix, next(p for p in policies if (p.cache_mode, p.bits) == ("dual", 4)))
    rerun = _run("fit", "--model", str(CKPT), "--bucket", f"qa={bucket}", "--samples", "2", "--rounds", "1",
                 "--store", REDIS_URL, "--store-prefix", redis_prefix, "--no-progress")
    assert all(f"policy {p.cache_mode}/{p.bits}: {p.id}" in rerun for p in policies)


def test_shard_files_merge_with_fit_merge(tmp_path, capsys):
    bucket = token_id_bucket(tmp_path / "qa.jsonl")
    common = ["--model", str(CKPT), "--bucket", f"qa={bucket}", "--samples", "3", "--rounds", "1",
              "--bits", "4", "--cache-modes", "dual", "--no-progress"]
    files = []
    for index in range(2):  # each shard its own store, as pods without a shared one
        files.append(tmp_path / f"sums-{index}.json")
        main(["diagnose", *common, "--shard", f"{index}/2", "--store", str(tmp_path / f"store-{index}"),
              "--sums-out", str(files[-1])])
    assert [len(DiagnosticSums.model_validate_json(f.read_text()).samples) for f in files] == [2, 1]
    capsys.readouterr()
    main(["fit", *common, "--store", str(tmp_path / "merged"), "--merge", *map(str, files)])
    merged = capsys.readouterr().out
    main(["diagnose", *common, "--store", str(tmp_path / "whole")])
    main(["fit", *common, "--store", str(tmp_path / "whole")])
    whole = capsys.readouterr().out
    line = next(x for x in whole.splitlines() if "policy dual/4" in x).split("[")[0].strip()
    assert line.startswith("policy dual/4: policy-") and line in merged
    with pytest.raises(SystemExit):
        main(["diagnose", *common, "--shard", "2/2"])
    assert "expected I/N with 0 <= I < N" in capsys.readouterr().err


def _activate_and_serve(tmp_path: Path, prefix: str, policy: PolicyTable) -> None:
    """The server (a real ``python -m service serve`` on the same store) activates the fitted policy through the
    admin endpoint and serves a request with it."""
    server = ServerProcess({"DLLM_MODEL": str(CKPT), "DLLM_STORE_URL": REDIS_URL, "DLLM_STORE_PREFIX": prefix,
                            "DLLM_ADMIN_KEY": ADMIN_KEY, "DLLM_THREADS": "1"}, log_path=tmp_path / "server.log")
    server.start()
    try:
        config = {"method": "dllm_kvq", "bits": 4, "k_group_size": policy.k_group_size, "policy_id": policy.id}
        answer = httpx.put(f"{server.url}/admin/active/dual", json=config, timeout=30,
                           headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert answer.status_code == 200, answer.text
        assert answer.json()["new"]["policy_id"] == policy.id
        generated = httpx.post(f"{server.url}/generate", timeout=120, json={
            "prompt": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14], "max_tokens": 64, "cache_mode": "dual"}).json()
        assert "kv" in generated, generated
        assert generated["kv"]["policy_id"] == policy.id and generated["rows"][0]["generated_ids"]
        # The nominal K bits served are those of the fitted per-layer budgets (above 4 when a layer protects).
        assert (generated["kv"]["k_nominal_bits"] > 4.0) == any(layer.p for layer in policy.layers)
    finally:
        server.stop()
