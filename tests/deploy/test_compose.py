"""docker-compose.yml and its CPU override, checked by the Compose v2 plugin itself (`docker compose config`)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from tests.deploy.tools import REPO, find_tool, run_tool

BASE = "docker-compose.yml"
CPU = "docker-compose.cpu.yml"
PROFILES = ["--profile", "calibration", "--profile", "evaluation"]


def compose_config(*files: str, cwd: Path = REPO) -> dict:
    """The fully resolved model of the given files with every profile on, as the plugin prints it."""
    args = [find_tool("docker-compose")]
    for f in files:
        args += ["-f", f]
    result = run_tool([*args, *PROFILES, "config", "--format", "json"], cwd=cwd)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def gpu_stack() -> dict:
    return compose_config(BASE)


@pytest.fixture(scope="module")
def cpu_stack() -> dict:
    return compose_config(BASE, CPU)


def test_every_compose_file_validates_quietly():
    for files in ([BASE], [BASE, CPU]):
        args = [find_tool("docker-compose")]
        for f in files:
            args += ["-f", f]
        result = run_tool([*args, *PROFILES, "config", "--quiet"])
        assert result.returncode == 0, (files, result.stderr)


def test_compose_rejects_an_unknown_key(tmp_path):
    # The same plugin fails on a misspelt key: the validation above is not vacuous.
    bad = tmp_path / "bad.yml"
    bad.write_text("services:\n  api:\n    restrat: always\n")
    result = run_tool([find_tool("docker-compose"), "-f", str(REPO / BASE), "-f", str(bad), "config", "-q"])
    assert result.returncode != 0 and "restrat" in result.stderr


def test_api_reserves_an_nvidia_gpu_and_is_supervised(gpu_stack):
    api = gpu_stack["services"]["api"]
    devices = api["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert api["command"] == ["serve"]
    assert api["restart"] == "unless-stopped"
    assert api["healthcheck"]["test"] == ["CMD", "python", "/usr/local/lib/dllm-kvq/healthcheck.py"]
    assert api["depends_on"]["redis"]["condition"] == "service_healthy"
    assert {"source": "hf-cache", "target": "/data/hf"}.items() <= api["volumes"][0].items()
    assert api["environment"]["DLLM_STORE_URL"] == "redis://redis:6379/0"
    assert api["build"]["args"]["TORCH_VARIANT"].startswith("cu")


def _seconds(duration: str) -> float:
    """Seconds of a Go duration as Compose prints it ("2m0s", "90s")."""
    units = {"h": 3600, "m": 60, "s": 1}
    return sum(float(n) * units[u] for n, u in re.findall(r"([0-9.]+)([hms])", duration))


def test_stop_grace_covers_the_server_drain(gpu_stack):
    # SIGTERM -> the server drains for DLLM_DRAIN_TIMEOUT_S; Docker must not SIGKILL before that ends.
    drain = float(_env_example()["DLLM_DRAIN_TIMEOUT_S"])
    assert _seconds(gpu_stack["services"]["api"]["stop_grace_period"]) >= drain + 10


def test_env_example_lists_every_setting_and_loads():
    from service.config import Settings

    text = (REPO / ".env.example").read_text()
    listed = re.findall(r"^#?\s*(DLLM_[A-Z0-9_]+)=", text, flags=re.MULTILINE)
    # The model's three settings are listed twice: the GPU example and the CPU one beside it (issue 45 item 5).
    twice = sorted(name for name in set(listed) if listed.count(name) > 1)
    assert twice == ["DLLM_DEVICE", "DLLM_DTYPE", "DLLM_MODEL"], "a setting is listed twice"
    assert set(listed) == {f"DLLM_{name.upper()}" for name in Settings.model_fields}
    # The uncommented values are legal settings (pydantic-settings reads the file as the server would), once the
    # operator replaced the placeholder keys; as shipped, the file is refused on its keys and on nothing else.
    from pydantic import ValidationError

    mine = {"admin_key": "my-own-admin-key-0123456789", "api_keys": ["my-own-api-key-0123456789"]}
    settings = Settings(_env_file=REPO / ".env.example", **mine)
    assert settings.device == "cuda" and settings.kv_quant.method == "none"
    with pytest.raises(ValidationError) as refused:
        Settings(_env_file=REPO / ".env.example")
    assert sorted(e["loc"][0] for e in refused.value.errors()) == ["admin_key", "api_keys"]


def test_every_shipped_placeholder_key_is_refused():
    """The key values that .env.example and the Kubernetes secret ship are the ones the server refuses."""
    from service.config import PLACEHOLDER_KEYS

    shipped = set(re.findall(r"replace-with-[\w-]+", (REPO / ".env.example").read_text()))
    shipped |= set(re.findall(r"replace-with-[\w-]+", (REPO / "deploy/k8s/11-secret.yaml").read_text()))
    assert shipped == set(PLACEHOLDER_KEYS)


def test_published_ports_listen_on_loopback_unless_an_address_is_set(tmp_path):
    for name in (BASE, CPU):
        shutil.copy(REPO / name, tmp_path / name)
    (tmp_path / "deploy").symlink_to(REPO / "deploy")
    for env_file, address in (("", "127.0.0.1"), ("DLLM_PUBLISH_ADDRESS=0.0.0.0\n", "0.0.0.0")):
        (tmp_path / ".env").write_text(env_file)
        stack = compose_config(BASE, cwd=tmp_path)
        published = {name: [p["host_ip"] for p in service.get("ports", [])]
                     for name, service in stack["services"].items() if service.get("ports")}
        assert sorted(published) == ["api", "grafana", "prometheus"]
        assert all(ips == [address] for ips in published.values()), published


def test_redis_keeps_an_append_only_file_on_a_volume(gpu_stack):
    redis = gpu_stack["services"]["redis"]
    assert redis["command"][:3] == ["redis-server", "--appendonly", "yes"]
    assert redis["volumes"][0]["source"] == "redis-data" and redis["volumes"][0]["target"] == "/data"
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]


def test_monitoring_mounts_exist_in_the_repository(gpu_stack):
    mounts = {
        name: [v["source"] for v in gpu_stack["services"][name]["volumes"] if v["type"] == "bind"]
        for name in ("prometheus", "grafana")
    }
    assert mounts["prometheus"] == [str(REPO / "deploy" / "prometheus")]
    assert sorted(mounts["grafana"]) == sorted(
        [str(REPO / "deploy" / "grafana" / "provisioning"), str(REPO / "deploy" / "grafana" / "dashboards")]
    )
    for sources in mounts.values():
        for source in sources:
            assert Path(source).is_dir(), source
    assert (REPO / "deploy" / "prometheus" / "prometheus.yml").is_file()


def test_jobs_are_one_shot_and_behind_profiles(gpu_stack):
    for name, profile, verb in (
        ("calibration", "calibration", "calibrate"),
        ("evaluation", "evaluation", "evaluate"),
    ):
        job = gpu_stack["services"][name]
        assert job["profiles"] == [profile]
        assert job["restart"] == "no"
        assert job["command"][0] == verb
    # Without the profiles, `up` starts only the long-running services.
    result = run_tool([find_tool("docker-compose"), "-f", BASE, "config", "--services"])
    assert result.returncode == 0
    assert sorted(result.stdout.split()) == ["api", "grafana", "prometheus", "redis"]


def test_cpu_override_drops_every_gpu_and_serves_the_embedded_default(cpu_stack):
    for name in ("api", "calibration", "evaluation"):
        service = cpu_stack["services"][name]
        assert "deploy" not in service or not service["deploy"].get("resources"), name
        assert service["build"]["args"]["TORCH_VARIANT"] == "cpu"
        # A CPU image on a CPU base by default, not on the Dockerfile's nvidia/cuda (issue 45 item 6).
        assert service["build"]["args"]["CUDA_BASE"] == "debian:bookworm", name
        assert service["environment"]["DLLM_DEVICE"] == "cpu"
        assert service["environment"]["DLLM_MODEL"] == ""
    from service.config import Settings

    # The override's settings are legal server settings, and "" means the embedded default.
    env = cpu_stack["services"]["api"]["environment"]
    settings = Settings(model=env["DLLM_MODEL"], device=env["DLLM_DEVICE"], dtype=env["DLLM_DTYPE"])
    assert settings.model is None


def test_env_example_feeds_the_stack(tmp_path):
    # A user's copy: .env from .env.example next to the compose files; the plugin reads it as the env file.
    for name in (BASE, CPU, ".env.example"):
        shutil.copy(REPO / name, tmp_path / name)
    (tmp_path / "deploy").symlink_to(REPO / "deploy")
    shutil.copy(REPO / ".env.example", tmp_path / ".env")
    stack = compose_config(BASE, cwd=tmp_path)
    env = stack["services"]["api"]["environment"]
    example = _env_example()
    for key, value in example.items():
        if key in ("DLLM_HOST", "DLLM_PORT", "DLLM_STORE_URL"):
            continue  # pinned by the compose file inside the stack
        assert env[key] == value, key
    assert env["DLLM_PORT"] == "8000" and env["DLLM_STORE_URL"] == "redis://redis:6379/0"


def _env_example() -> dict[str, str]:
    """The uncommented KEY=value lines of .env.example, as python-dotenv (the server's reader) reads them."""
    from dotenv import dotenv_values

    return {key: value for key, value in dotenv_values(REPO / ".env.example").items() if value is not None}


def test_calibration_commands_parse_with_the_calibration_cli(gpu_stack, cpu_stack):
    from calibration.cli import build_parser

    gpu = build_parser().parse_args(gpu_stack["services"]["calibration"]["command"][1:])
    assert gpu.verb == "all" and gpu.store == "redis://redis:6379/0" and gpu.model
    assert (gpu.device, gpu.dtype) == ("cuda", "bfloat16")  # the GPU it reserves is the one it uses
    cpu = build_parser().parse_args(cpu_stack["services"]["calibration"]["command"][1:])
    assert cpu.model is None and cpu.store == gpu.store  # None: the embedded default model


def test_evaluation_commands_parse_with_the_evaluation_cli(gpu_stack, cpu_stack):
    from evaluation.cli import matrix_parser

    for stack in (gpu_stack, cpu_stack):
        command = stack["services"]["evaluation"]["command"]
        assert command[:2] == ["evaluate", "matrix"]
        args = matrix_parser().parse_args(command[2:])
        # Scores go to the api service of the same stack, and the store is the stack's Redis.
        assert args.server == "http://api:8000" and args.store == "redis://redis:6379/0"
    assert matrix_parser().parse_args(cpu_stack["services"]["evaluation"]["command"][2:]).models == "embedded"
