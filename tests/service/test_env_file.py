"""The settings read an env file (issue 45 item 5): ``.env`` in the working directory, the file docker compose reads,
so ``.env.example`` copied as ``.env`` applies to a server run without compose, with the documented precedence
flag > environment > .env > default; the file is valid for a shell's ``set -a; . ./.env`` as well, and its CPU
example serves the embedded model on the CPU."""

from __future__ import annotations

import subprocess

import pytest
from dotenv import dotenv_values

from service.__main__ import build_parser
from service.commands.serve import check_model_settings, settings_from_args
from service.config import Settings, default_store
from tests.support.paths import REPO

EXAMPLE = REPO / ".env.example"
MY_KEYS = {"DLLM_ADMIN_KEY": "my-own-admin-key-0123456789", "DLLM_API_KEYS": "my-own-api-key-0123456789"}


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A working directory whose .env the settings read (the suite turns the env file off: tests/conftest.py)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DLLM_ENV_FILE")
    for name in ("DLLM_MAX_N", "DLLM_SERVED_MODEL_NAME", "DLLM_STORE_URL", "DLLM_KV_QUANT"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def _serve(*flags: str) -> Settings:
    return settings_from_args(build_parser().parse_args(["serve", *flags]))


def test_flag_beats_environment_beats_env_file_beats_default(workdir, monkeypatch):
    assert _serve().max_n == Settings.model_fields["max_n"].default == 8
    # Compose's own variables and a removed setting in the file are ignored, as in the environment.
    (workdir / ".env").write_text("DLLM_MAX_N=3\nDLLM_KV_QUANT='{\"method\": \"kivi\", \"bits\": 2}'\n"
                                  "DLLM_PUBLISH_ADDRESS=0.0.0.0\nDLLM_SCHEDULER=legacy\nGRAFANA_ADMIN_PASSWORD=x\n"
                                  "DLLM_STORE_URL=redis://127.0.0.1:6390/0\n")
    settings = _serve()
    assert (settings.max_n, settings.kv_quant.method, settings.kv_quant.bits) == (3, "kivi", 2)
    monkeypatch.setenv("DLLM_MAX_N", "5")
    assert _serve().max_n == 5
    assert _serve("--max-n", "7").max_n == 7
    # The offline commands default to the store the server uses.
    assert default_store() == ("redis://127.0.0.1:6390/0", "dllm-kvq")


def test_dllm_env_file_names_another_file_and_empty_reads_none(workdir, monkeypatch):
    (workdir / ".env").write_text("DLLM_MAX_N=3\n")
    (workdir / "prod.env").write_text("DLLM_MAX_N=4\n")
    monkeypatch.setenv("DLLM_ENV_FILE", "prod.env")
    assert _serve().max_n == 4
    monkeypatch.setenv("DLLM_ENV_FILE", "")
    assert _serve().max_n == 8


def test_the_example_copied_as_env_is_read_by_serve_and_refused_only_for_its_placeholder_keys(workdir):
    (workdir / ".env").write_text(EXAMPLE.read_text())
    with pytest.raises(Exception) as refused:
        _serve()
    assert "admin_key" in str(refused.value) and "api_keys" in str(refused.value)
    settings = _serve("--admin-key", MY_KEYS["DLLM_ADMIN_KEY"], "--api-keys", MY_KEYS["DLLM_API_KEYS"])
    assert (settings.model, settings.device, settings.host) == ("GSAI-ML/LLaDA-8B-Instruct", "cuda", "127.0.0.1")
    assert settings.store_url == ".dllm-kvq/store"  # not someone's Redis on 6379


def cpu_example() -> str:
    """.env.example with its CPU model lines in place of the GPU ones, as the file says to edit it."""
    lines = []
    for line in EXAMPLE.read_text().splitlines():
        if line.startswith(("DLLM_MODEL=", "DLLM_DTYPE=", "DLLM_DEVICE=")):
            line = "#" + line
        elif line in ("#DLLM_MODEL=", "#DLLM_DTYPE=float32", "#DLLM_DEVICE=cpu"):
            line = line[1:]
        lines.append(line)
    text = "\n".join(lines) + "\n"
    assert text.count("\nDLLM_DEVICE=cpu\n") == 1, "the CPU example moved: update this edit"
    return text


@pytest.mark.integration
@pytest.mark.parametrize("variant", ["gpu", "cpu"])
def test_a_shell_sources_the_example_as_python_dotenv_reads_it(tmp_path, monkeypatch, variant):
    """``set -a; . ./.env`` in bash (it used to stop at the unquoted JSON of DLLM_KV_QUANT) gives every variable
    the value the server reads from the file, and the server reads that environment (no env file) as the same
    settings; the CPU example then serves the embedded model on the CPU."""
    env_file = tmp_path / ".env"
    env_file.write_text(EXAMPLE.read_text() if variant == "gpu" else cpu_example())
    script = "set -euo pipefail; set -a; . ./.env; set +a; env -0"
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, env={"PATH": "/usr/bin:/bin"},
                          check=False, timeout=60)
    assert done.returncode == 0, done.stderr.decode()
    sourced = dict(item.split("=", 1) for item in done.stdout.decode().split("\0") if "=" in item)
    from_file = {k: v for k, v in dotenv_values(env_file).items() if v is not None}
    assert from_file and all(sourced[key] == value for key, value in from_file.items()), (sourced, from_file)
    for key, value in {**sourced, **MY_KEYS}.items():
        if key.startswith("DLLM_"):
            monkeypatch.setenv(key, value)
    from_shell = Settings()  # the environment the shell exported, no env file (tests/conftest.py)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DLLM_ENV_FILE")
    for key in sourced:
        if key.startswith("DLLM_") and key not in MY_KEYS:
            monkeypatch.delenv(key)
    assert Settings() == from_shell  # the same file read as .env
    assert from_shell.kv_quant.method == "none" and from_shell.host == "127.0.0.1"
    if variant == "cpu":
        assert (from_shell.model, from_shell.device, from_shell.dtype) == (None, "cpu", "float32")
        assert check_model_settings(from_shell) is None
