"""The installed ``dllm-kvq`` console command dispatches to the same commands as the ``python -m`` forms."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # every test runs the installed console command as a process

CONSOLE = Path(sys.executable).with_name("dllm-kvq")


def run(*args: str) -> subprocess.CompletedProcess:
    if not CONSOLE.exists():
        pytest.fail(f"{CONSOLE} is missing: scripts/setup.sh installs the package with its console command")
    return subprocess.run([str(CONSOLE), *args], check=False, capture_output=True, text=True, timeout=300)


def test_usage_lists_every_command():
    result = run("--help")
    assert result.returncode == 0
    for command in ("serve", "generate", "policies", "calibrate", "evaluate"):
        assert f"\n  {command} " in result.stdout


def test_unknown_command_is_one_line_and_exit_2():
    result = run("serv")
    assert result.returncode == 2
    assert result.stderr.splitlines()[0] == (
        "dllm-kvq: unknown command 'serv'; legal: serve, generate, policies, calibrate, evaluate")


def test_generate_equals_python_m_service(tmp_path):
    args = ["generate", "--prompt-ids", "40,41,42", "--gen-length", "32", "--threshold", "0.9", "--cache-mode", "dual",
            "--json", "--threads", "1"]
    console = run(*args)
    module = subprocess.run([sys.executable, "-m", "service", *args], check=False, capture_output=True, text=True,
                            timeout=300)
    assert console.returncode == module.returncode == 0, console.stderr + module.stderr
    ids = [json.loads(out)["rows"][0]["generated_ids"] for out in (console.stdout, module.stdout)]
    assert ids[0] == ids[1] and ids[0]


@pytest.mark.parametrize("command", ["calibrate", "evaluate"])
def test_offline_commands_reach_their_parsers(command):
    result = run(command, "--help")
    assert result.returncode == 0, result.stderr
    assert "usage" in result.stdout.lower() or "commands" in result.stdout.lower()


def test_usage_and_errors_name_the_command_as_it_was_typed(tmp_path):
    """argparse's prog and the messages follow the invocation, in a form that runs again: the console command as
    typed (relative path), its bare name when its folder is on PATH (an activated venv), ``<python> -m ...`` for
    the module form; never ``python -m`` for a console run."""
    import os

    if not CONSOLE.exists():
        pytest.fail(f"{CONSOLE} is missing: scripts/setup.sh installs the package with its console command")
    home = CONSOLE.parents[2]
    typed = os.path.relpath(CONSOLE, home)  # .venv/bin/dllm-kvq
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}

    def stderr(argv, **extra):
        done = subprocess.run(argv, cwd=home, capture_output=True, text=True, timeout=300, check=False,
                              env={**env, **extra})
        assert done.returncode == 2
        return done.stderr

    assert stderr([typed, "calibrate", "--bogus"]).startswith(f"usage: {typed} calibrate ")
    assert stderr([typed, "generate"]).startswith(f"usage: {typed} generate ")
    on_path = stderr(["dllm-kvq", "evaluate", "matrix"], PATH=f"{CONSOLE.parent}{os.pathsep}{os.environ['PATH']}")
    assert on_path.startswith("usage: dllm-kvq evaluate matrix ")
    module = stderr([sys.executable, "-m", "calibration", "--bogus"])
    assert module.startswith("usage: ") and " -m calibration " in module.splitlines()[0]
    assert "dllm-kvq" not in module.splitlines()[0]
