"""The sharded calibration of deploy/k8s/calibration, run outside Kubernetes: the shard Job's command for each
completion index and then the merge Job's command, exactly as the manifests write them (variables expanded from
their ConfigMap), through the image's entrypoint (the `dllm-kvq` console command). Two shards make the same policy as one run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.calibration.test_job import CKPT, token_id_bucket
from tests.deploy.test_k8s import calibration_jobs, job_args
from tests.deploy.tools import CONSOLE, REPO

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def run_pod(args: list[str], env: dict[str, str], extra: list[str]) -> str:
    """One pod: the container args with $(VAR) expanded as the kubelet does, run by the image entrypoint."""
    expanded = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in args]
    process_env = {
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
    }
    done = subprocess.run(
        [str(CONSOLE), *expanded, *extra],
        cwd=REPO,
        env=process_env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def policy_lines(stdout: str) -> list[str]:
    """The summary's `policy <cache mode>/<bits>: <id>` lines (Table 4 figures cut off)."""
    return sorted(
        line.split("[")[0].strip() for line in stdout.splitlines() if line.strip().startswith("policy ")
    )


def calibrate(tmp_path: Path, name: str, shards: int) -> tuple[list[str], list[str]]:
    """Every shard pod, then the merge pod, on a fresh shared directory store; (policy lines, stored ids)."""
    settings, shard_job, merge_job = calibration_jobs()
    store = tmp_path / name
    # The manifests' settings with a tiny checkpoint and few samples in place of an 8B model and 256 samples.
    env = {
        **settings,
        "MODEL": str(CKPT),
        "DTYPE": "float32",
        "DEVICE": "cpu",
        "STORE": str(store),
        "SAMPLES": "3",
        "ROUNDS": "1",
        "MAX_ANSWER_LENGTH": "64",
        "SHARDS": str(shards),
    }
    extra = [
        "--bucket",
        f"qa={token_id_bucket(tmp_path / 'qa.jsonl')}",
        "--cache-modes",
        "dual",
        "--bits",
        "4",
    ]
    for index in range(shards):
        run_pod(job_args(shard_job), {**env, "JOB_COMPLETION_INDEX": str(index)}, extra)
    lines = policy_lines(run_pod(job_args(merge_job), env, extra))
    stored = sorted(p.name for p in (store / "artifacts" / "policy").iterdir())
    return lines, stored


def test_two_shards_and_a_merge_make_the_policy_of_one_run(tmp_path):
    sharded_lines, sharded_ids = calibrate(tmp_path, "sharded", shards=2)
    whole_lines, whole_ids = calibrate(tmp_path, "whole", shards=1)
    assert len(sharded_lines) == 1 and sharded_lines[0].startswith("policy dual/4: policy-")
    # Policies are content-addressed: the same id is the same policy table, byte for byte.
    assert sharded_lines == whole_lines
    assert sharded_ids == whole_ids and len(sharded_ids) == 1
    sharded = (tmp_path / "sharded" / "artifacts" / "policy" / sharded_ids[0]).read_bytes()
    assert sharded == (tmp_path / "whole" / "artifacts" / "policy" / whole_ids[0]).read_bytes()
