"""benchmarks/gpu_check.sh --dry-run: every step of the GPU check at a tiny shape on the CPU (issue 41), so the
script cannot rot between the days a GPU is lent; with the packages the device lacks refused on import
(benchmarks/absent/sitecustomize.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.support.paths import REPO as REPO_ROOT

pytestmark = pytest.mark.integration  # starts a shell script and the Python processes of its steps

RAW = ("device.txt", "tests.txt", "iteration_cost.txt", "decode_4k_8.txt", "later_step.json", "llada2.json",
       "table.txt")


def test_every_step_runs_dry_and_the_check_ends_with_one_table(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out")}
    env.pop("FASTDLLM_DIR", None)  # the reference's code, which the repository does not hold: its own test
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry-run"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "ended with status" not in done.stdout
    for name in RAW:
        assert (tmp_path / "out" / name).stat().st_size > 0, name
    table = (tmp_path / "out" / "table.txt").read_text()
    assert table.count("| target") == 1 and "DRY RUN" in table
    lines = [line for line in table.splitlines() if line.startswith("| ") and "| target" not in line]
    for wanted in ("tests on the device", "1 rows, unquantized", "64 rows, KIVI 4-bit", "eager over replayed",
                   "35% of HBM peak", "KIVI 4-bit time", "KIVI 2-bit time", "dLLM-KVQ 4-bit time vs KIVI",
                   "dLLM-KVQ 2-bit time vs KIVI", "Fast-dLLM reference", "LLaDA2.0-mini shape, block mode, 32 rows, kivi"):
        assert any(wanted in line for line in lines), wanted
    # every step wrote its figures: the one row without them is the reference's, whose code is not here
    assert [line for line in lines if "NOT RUN" in line] == [line for line in lines if "Fast-dLLM" in line]
    # the dry run only collects the device's tests: its row says so, never PASS
    tests_row = next(line for line in lines if "tests on the device" in line)
    assert re.search(r"\| collected \d+ \|$", tests_row.rstrip()), tests_row
    assert all(line.rstrip().endswith(("PASS |", "FAIL |", "recorded |", "NOT RUN |")) for line in lines
               if line != tests_row)


def _stand_in_checkout(tmp_path, status: int):
    """A copy of the script in a checkout whose .venv/bin/python is a stand-in that records its arguments and
    exits with ``status`` on the tests step (0 on the others)."""
    root = tmp_path / "checkout"
    (root / "benchmarks").mkdir(parents=True)
    shutil.copy(REPO_ROOT / "benchmarks" / "gpu_check.sh", root / "benchmarks")
    python = root / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\necho "$0 $*" >> "{tmp_path}/calls.txt"\n'
                      f'case "$*" in *pytest*) exit {status};; esac\nexit 0\n')
    python.chmod(0o755)
    return root


def test_the_default_interpreter_is_the_checkout_s_venv_and_a_quick_failure_is_not_called_a_timeout(tmp_path):
    """PYTHON defaulted to the system python3, which a scripts/setup.sh install leaves without torch; and a step
    that failed at once was reported as "ended with status 4 (124: its timeout)"."""
    root = _stand_in_checkout(tmp_path, status=4)
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"} | {"OUT": str(tmp_path / "out")}
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry-run"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert calls and all(line.startswith((f"{root}/.venv/bin/python ", ".venv/bin/python "))
                         for line in calls), calls
    assert "python: .venv/bin/python" in (tmp_path / "out" / "device.txt").read_text()
    assert done.returncode == 1 and "tests ended with status 4" in done.stdout, done.stdout
    assert "timeout" not in done.stdout.split("tests ended with status 4")[1].splitlines()[0], done.stdout
    # PYTHON still overrides the default
    other = _stand_in_checkout(tmp_path / "other", status=0) / ".venv" / "bin" / "python"
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry-run"], cwd=root,
                          env={**env, "PYTHON": str(other)}, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stdout
    assert (tmp_path / "other" / "calls.txt").read_text()


def test_the_dry_run_refuses_what_the_device_lacks(tmp_path):
    """The dry run's guard is real: a step that imported fastapi would fail."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "benchmarks" / "absent"), "DLLM_ABSENT": "fastapi,redis"}
    done = subprocess.run([sys.executable, "-c", "import fastapi"], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode != 0 and "absent on the GPU device" in done.stderr


@pytest.mark.skipif(not os.environ.get("FASTDLLM_DIR"), reason="FASTDLLM_DIR names no Fast-dLLM checkout (its "
                    "code is not in this repository; benchmarks/gpu_check.sh)")
def test_the_reference_row_runs_dry_with_the_reference_s_code(tmp_path):
    """With FASTDLLM_DIR the dry run compares with the reference's own generate_with_dual_cache: token-identical
    on the same weights (the tiny shape's speed means nothing)."""
    pytest.importorskip("einops")  # the reference's model imports it
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out")}
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry-run"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = json.loads((tmp_path / "out" / "fastdllm_reference.json").read_text())
    assert found["identical"] is True
    row = next(line for line in (tmp_path / "out" / "table.txt").read_text().splitlines() if "Fast-dLLM" in line)
    assert "identical: True" in row and "NOT RUN" not in row
