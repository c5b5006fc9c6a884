"""The installed ``dllm-kvq`` console command dispatches to the same commands as the ``python -m`` forms."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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
