"""The Dockerfile: hadolint clean, the facts the issue asks for, and its helper scripts run outside a container."""

from __future__ import annotations

import fnmatch
import http.server
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.deploy.tools import REPO, find_tool, run_tool

DOCKERFILE = REPO / "Dockerfile"
ENTRYPOINT = REPO / "deploy" / "docker" / "entrypoint.sh"
HEALTHCHECK = REPO / "deploy" / "docker" / "healthcheck.py"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per Dockerfile instruction, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_hadolint_passes_with_every_finding_fatal():
    result = run_tool(
        [
            find_tool("hadolint"),
            "--config",
            str(REPO / ".hadolint.yaml"),
            "--failure-threshold",
            "info",
            "--no-color",
            str(DOCKERFILE),
        ]
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    # The same linter and settings fail on a root `latest` image with a cd: the check above is not vacuous.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN cd /tmp && echo hi\n")
    result = run_tool([find_tool("hadolint"), "--config", str(REPO / ".hadolint.yaml"), str(bad)])
    assert result.returncode != 0
    assert "DL3007" in result.stdout and "DL3003" in result.stdout


def test_image_is_cuda_based_non_root_with_hf_volume_and_readiness_healthcheck():
    ins = _instructions()
    args = {(k, v) for k, v in ins}
    base_default = next(v for k, v in ins if k == "ARG" and v.startswith("CUDA_BASE="))
    assert base_default.split("=", 1)[1].startswith("nvidia/cuda:")
    # Both stages build on the CUDA base; torch comes from the variant's wheel index (cu* by default).
    assert [v for k, v in ins if k == "FROM"] == ["${CUDA_BASE} AS build", "${CUDA_BASE} AS runtime"]
    assert ("ARG", "TORCH_VARIANT=cu128") in args
    assert any(k == "RUN" and "download.pytorch.org/whl/${TORCH_VARIANT}" in v for k, v in ins)
    # Non-root: the last USER is a numeric uid other than 0.
    user = [v for k, v in ins if k == "USER"][-1]
    assert re.fullmatch(r"[1-9]\d*:[1-9]\d*", user), user
    env = " ".join(v for k, v in ins if k == "ENV")
    assert "HF_HOME=/data/hf" in env
    volumes = " ".join(v for k, v in ins if k == "VOLUME")
    assert '"/data/hf"' in volumes
    healthcheck = next(v for k, v in ins if k == "HEALTHCHECK")
    assert "/usr/local/lib/dllm-kvq/healthcheck.py" in healthcheck
    assert "/health/ready" in HEALTHCHECK.read_text()
    assert ("ENTRYPOINT", '["tini", "--", "dllm-kvq"]') in args
    assert ("CMD", '["serve"]') in args


def test_every_copied_path_exists_and_is_not_dockerignored():
    ignore = [p for p in (REPO / ".dockerignore").read_text().splitlines() if p and not p.startswith("#")]
    excluded = [p.rstrip("/") for p in ignore if not p.startswith("!")]
    for kind, value in _instructions():
        if kind != "COPY" or "--from=" in value:
            continue
        sources = [w for w in value.split() if not w.startswith("--")][:-1]
        for source in sources:
            assert (REPO / source).exists(), f"COPY {source}: not in the repository"
            parts = Path(source).parts
            prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
            hit = [p for p in excluded for pre in prefixes if fnmatch.fnmatch(pre, p.lstrip("/"))]
            assert not hit, f"COPY {source} is excluded by .dockerignore {hit}"


def _entrypoint(
    *args: str, path_first: Path | None = None, env_extra: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run the image's entrypoint script outside a container, with this environment's python on PATH (or
    ``path_first`` before it)."""
    path = f"{Path(sys.executable).parent}:/usr/bin:/bin"
    if path_first is not None:
        path = f"{path_first}:{path}"
    env = {"PATH": path, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run(
        ["sh", str(ENTRYPOINT), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_entrypoint_passes_other_commands_through_with_their_status():
    result = _entrypoint("python", "-c", "import sys; print('ran'); sys.exit(3)")
    assert result.returncode == 3 and result.stdout.strip() == "ran"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((), "-m service serve"),
        (("serve", "--port", "9000"), "-m service serve --port 9000"),
        (("calibrate", "all", "--samples", "2"), "-m calibration all --samples 2"),
        (("evaluate", "matrix", "--bits", "4,2"), "-m evaluation matrix --bits 4,2"),
        (("policies", "export", "/data/p"), "-m service policies export /data/p"),
    ],
)
def test_entrypoint_maps_each_job_to_its_module(tmp_path, args, expected):
    # A stand-in `python` first on PATH prints the arguments it was given and whether it replaced the shell
    # (exec: its parent is the test, not the entrypoint's shell, so SIGTERM reaches it).
    (tmp_path / "python").write_text('#!/bin/sh\necho "$PPID $*"\n')
    (tmp_path / "python").chmod(0o755)
    result = _entrypoint(*args, path_first=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{os.getpid()} {expected}"


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):
        self.send_response(self.status if self.path == "/health/ready" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.parametrize(("status", "expected"), [(200, 0), (503, 1)])
def test_healthcheck_exit_status_follows_readiness(status, expected):
    handler = type("H", (_Health,), {"status": status})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {"DLLM_PORT": str(server.server_address[1])}
        result = subprocess.run(
            [sys.executable, str(HEALTHCHECK)],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    finally:
        server.shutdown()
    assert result.returncode == expected, result.stderr
    if expected:
        assert "answered 503" in result.stderr


def test_healthcheck_fails_when_nothing_listens():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    port = server.server_address[1]
    server.server_close()  # the port is now closed: connection refused
    result = subprocess.run(
        [sys.executable, str(HEALTHCHECK)],
        env={"DLLM_PORT": str(port)},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 1 and "not ready" in result.stderr


def test_entrypoint_reaches_the_real_evaluation_cli():
    # The real program behind `evaluate` (the server and calibration jobs run for real in test_real_scrape.py
    # and test_calibration_job.py).
    result = _entrypoint("evaluate", "matrix", "--help", env_extra={"PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: python -m evaluation matrix")
