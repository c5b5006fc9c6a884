"""The Dockerfile: hadolint clean, the facts the issue asks for, and its helper scripts run outside a container."""

from __future__ import annotations

import fnmatch
import http.server
import json
import re
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

import pytest

from tests.deploy.tools import CONSOLE, REPO, find_tool, run_tool

DOCKERFILE = REPO / "Dockerfile"
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


@pytest.mark.parametrize("dockerfile", [DOCKERFILE, REPO / "deploy" / "docker" / "redis" / "Dockerfile"],
                         ids=["image", "redis"])
def test_hadolint_passes_with_every_finding_fatal(dockerfile):
    result = run_tool(
        [
            find_tool("hadolint"),
            "--config",
            str(REPO / ".hadolint.yaml"),
            "--failure-threshold",
            "info",
            "--no-color",
            str(dockerfile),
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


def _stages() -> dict[str, list[tuple[str, str]]]:
    """Instructions per build stage, by the stage's ``AS`` name."""
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for kind, value in _instructions():
        if kind == "FROM":
            current = stages.setdefault(value.split()[-1], [])
        current.append((kind, value))
    return stages


def test_image_is_cuda_based_non_root_with_hf_volume_and_readiness_healthcheck():
    ins = _instructions()
    args = {(k, v) for k, v in ins}
    base_default = next(v for k, v in ins if k == "ARG" and v.startswith("CUDA_BASE="))
    assert base_default.split("=", 1)[1].startswith("nvidia/cuda:")
    # The build stages and the runtime start from the CUDA base; torch comes from the variant's wheel index (cu* by
    # default) unless TORCH_INDEX_URL or a wheel in deploy/docker/wheels says otherwise.
    assert [v for k, v in ins if k == "FROM"] == [
        "${CUDA_BASE} AS torch", "torch AS requirements", "torch AS deps", "deps AS wheel", "${CUDA_BASE} AS runtime"
    ]
    assert ("ARG", "TORCH_VARIANT=cu128") in args
    assert ("ARG", "TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}") in args
    torch_step = next(v for k, v in ins if k == "RUN" and '"torch==${TORCH_VERSION}"' in v)
    assert '--index-url "${TORCH_INDEX_URL}"' in torch_step
    assert "source=deploy/docker/wheels" in torch_step and (REPO / "deploy/docker/wheels").is_dir()
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
    assert ("CMD", '["serve"]') in args


def test_the_entrypoint_is_the_packaged_console_command():
    # The image once shipped a shell script under the console command's name; the venv's console script came
    # first on PATH and imported a package the image never copied (ModuleNotFoundError on every start).
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    ((name, target),) = pyproject["project"]["scripts"].items()
    entrypoint = json.loads(next(v for k, v in _instructions() if k == "ENTRYPOINT"))
    assert entrypoint == ["tini", "--", name]
    # Nothing else in the image is installed under that name: the only dllm-kvq is the wheel's console script.
    for kind, value in _instructions():
        if kind == "COPY":
            assert not value.split()[-1].endswith(f"/{name}"), value
    runtime = _stages()["runtime"]
    install = next(v for k, v in runtime if k == "RUN" and "/dist/*.whl" in v)
    assert f"{name} --help" in install
    # The wheel arrives by COPY (its content is the cache key), never by a RUN mount from the wheel stage, whose
    # content a builder's cache may ignore: a changed wheel would meet a cached install and a stale image.
    assert ("COPY", "--from=wheel /dist /tmp/dist") in runtime
    assert not any(k == "RUN" and "from=wheel" in v for k, v in runtime)
    # The console command's own module is in a package the wheel stage copies (checked in full below).
    assert target.split(".")[0] in _copied_packages()


def _copied_packages() -> set[str]:
    """Top-level directories the wheel stage copies from the build context."""
    out = set()
    for kind, value in _stages()["wheel"]:
        if kind == "COPY" and "--from=" not in value:
            out.update(w for w in value.split()[:-1] if not w.startswith("--") and (REPO / w).is_dir())
    return out


def test_the_wheel_stage_copies_every_package_pyproject_lists():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    # Each top-level package the patterns select in this checkout (what `pip install .` here would ship).
    packages = {p.parent.name for p in REPO.glob("*/__init__.py") if any(fnmatch.fnmatch(p.parent.name, pat)
                                                                         for pat in patterns)}
    assert packages >= {"dllm_kvq", "service", "calibration", "evaluation"}
    missing = packages - _copied_packages()
    assert not missing, f"the Dockerfile's wheel stage does not COPY {sorted(missing)}"


def test_dependencies_install_before_any_source_is_copied():
    # Layer caching: a change to the project's code (or to pyproject.toml outside its dependency list) must not
    # reinstall torch and the dependencies, so the stages that install them copy only these two files, and the
    # deps stage sees pyproject.toml only as the requirements stage's extracted list.
    stages = _stages()
    for name, allowed in (("torch", {"deploy/docker/pip.sh"}), ("requirements", {"pyproject.toml"}), ("deps", set())):
        copied = {w for k, v in stages[name] if k == "COPY" and "--from=" not in v
                  for w in v.split()[:-1] if not w.startswith("--")}
        assert copied <= allowed, (name, copied)
    assert any(k == "COPY" and v.startswith("--from=requirements ") for k, v in stages["deps"])


def test_every_copied_path_exists_and_is_not_dockerignored():
    ignore = [p for p in (REPO / ".dockerignore").read_text().splitlines() if p and not p.startswith("#")]
    excluded = [p.rstrip("/") for p in ignore if not p.startswith("!")]
    for kind, value in _instructions():
        if kind not in ("COPY", "RUN"):
            continue
        if kind == "COPY":
            if "--from=" in value:
                continue
            sources = [w for w in value.split() if not w.startswith("--")][:-1]
        else:  # a bind mount of the build context
            sources = re.findall(r"--mount=type=bind,source=([^,\s]+)", value)
        for source in sources:
            assert (REPO / source).exists(), f"{kind} {source}: not in the repository"
            parts = Path(source).parts
            prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
            hit = [p for p in excluded for pre in prefixes if fnmatch.fnmatch(pre, p.lstrip("/"))]
            assert not hit, f"{kind} {source} is excluded by .dockerignore {hit}"


@pytest.mark.parametrize(
    "args",
    [
        ("serve", "--help"),
        ("calibrate", "all", "--help"),
        ("evaluate", "matrix", "--help"),
        ("policies", "export", "--help"),
    ],
)
@pytest.mark.integration  # the console command as a process
def test_the_console_command_runs_each_job_the_image_documents(args):
    # What `docker run IMAGE <job> ...` runs: the entrypoint's program with the job's arguments.
    result = subprocess.run(
        [str(CONSOLE), *args],
        cwd=REPO,
        env={"PATH": f"{CONSOLE.parent}:/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: dllm-kvq " + args[0]), result.stdout[:200]


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):
        self.send_response(self.status if self.path == "/health/ready" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.integration  # the healthcheck script as a process
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


@pytest.mark.integration  # the healthcheck script as a process
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
