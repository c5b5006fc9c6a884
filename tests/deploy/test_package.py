"""What the image installs: the Dockerfile runs `pip install .` (a built wheel, not the source tree), so every
file the packages use at run time (the embedded default model, corpora, task files) must be in the wheel."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest

from tests.deploy.tools import REPO, run_tool

pytestmark = pytest.mark.integration  # builds the wheel in a pip process

PACKAGES = ("service", "calibration", "evaluation", "dllm_kvq")


def test_wheel_carries_every_tracked_file_of_the_packages(tmp_path):
    tracked = subprocess.run(
        ["git", "ls-files", *PACKAGES], cwd=REPO, capture_output=True, text=True, check=True
    )
    files = {f for f in tracked.stdout.split() if "__pycache__" not in f}
    assert any(f.endswith(".py") for f in files) and any(not f.endswith(".py") for f in files)
    # Built as the image builds it: pip's isolated build with the build-system requirements of pyproject.toml.
    result = run_tool(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            str(REPO),
            "-w",
            str(tmp_path),
        ],
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    (wheel,) = tmp_path.glob("dllm_kvq-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        shipped = set(archive.namelist())
    missing = sorted(files - shipped)
    assert not missing, (
        f"tracked but not in the wheel (add them to [tool.setuptools.package-data]): {missing}"
    )
