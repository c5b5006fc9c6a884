"""A store URL with an unknown scheme in ``DLLM_STORE_URL`` (not a flag) is one line naming the variable and exit
status 2 in every offline command, never a traceback (a flag is already checked by argparse)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.paths import REPO

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("argv", [
    ["-m", "service", "policies", "export", "{tmp}/out"],
    ["-m", "calibration", "report", "--out", "{tmp}/out"],
    ["-m", "evaluation", "matrix", "--tasks", "digit_ledger", "--out", "{tmp}/out"],
], ids=["policies", "calibration", "evaluation"])
def test_a_bad_env_store_url_is_one_line_naming_the_variable(tmp_path, argv):
    env = {**os.environ, "DLLM_STORE_URL": "dir:///x", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, *(a.format(tmp=tmp_path) for a in argv)], capture_output=True, text=True,
                         env=env, cwd=REPO, timeout=300, check=False)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "Traceback" not in run.stderr and "DLLM_STORE_URL" in run.stderr, run.stderr
    assert "dir:" in run.stderr.strip().splitlines()[-1], run.stderr
