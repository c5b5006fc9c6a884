"""A real scrape: Debian's Prometheus server on loopback, running deploy/prometheus/prometheus.yml (targets
pointed at a local server) and the alert rules, scrapes a real dllm-kvq server started through the image's
entrypoint (the `dllm-kvq` console command); its HTTP API then answers the effective-bits query with the value the server reported, and
every dashboard query parses and runs."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.test_monitoring import dashboard_exprs, label_names, metric_names, rule_exprs
from tests.deploy.tools import CONSOLE, REPO, find_tool

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HEALTHCHECK = REPO / "deploy" / "docker" / "healthcheck.py"
# Labels Prometheus adds to every scraped series (the target's and the scrape config's) and the bucket label.
TARGET_LABELS = {"instance", "job", "service", "le"}
# Grafana's template variables, as Grafana would expand them for "All" over the last hour.
GRAFANA_VARS = {"$__rate_interval": "1m", "$__range": "1h", "$instance": ".*"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, body: dict | None = None, timeout: float = 120) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def wait_until(
    check, timeout: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None
):
    """Poll ``check()`` until it returns a truthy value; fail with the process log when it never does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"{what}: process exited with {proc.returncode}\n{log.read_text() if log else ''}")
        value = check()
        if value:
            return value
        time.sleep(0.5)
    pytest.fail(f"{what}: not within {timeout} s\n{log.read_text()[-4000:] if log else ''}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture()
def server(tmp_path):
    """The server on the embedded default model, started as the container starts it (the entrypoint `dllm-kvq serve`)."""
    port = free_port()
    env = {
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        # The package as this checkout has it (CI installs it editable; the image installs the wheel).
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "DLLM_HOST": "127.0.0.1",
        "DLLM_PORT": str(port),
        "DLLM_DEVICE": "cpu",
        "DLLM_THREADS": "1",
        "DLLM_STORE_URL": str(tmp_path / "store"),
        "DLLM_CREATE_STORE": "true",  # a fresh store of its own
        # Every quantized request is decoded again unquantized, so the agreement series exist too.
        "DLLM_SHADOW_RATE": "1.0",
    }
    log = tmp_path / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(CONSOLE), "serve"], cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        # Ready as the container's HEALTHCHECK sees it: the image's own probe script exits 0.
        def healthy() -> bool:
            probe = subprocess.run(
                [sys.executable, str(HEALTHCHECK)],
                env={"DLLM_PORT": str(port)},
                capture_output=True,
                timeout=30,
                check=False,
            )
            return probe.returncode == 0

        wait_until(healthy, 180, "server readiness", proc, log)
        yield f"http://127.0.0.1:{port}", port
    finally:
        stop(proc)


@pytest.fixture()
def prometheus(tmp_path, server):
    """Debian's prometheus running the stack's own config, its api target rewritten to the local server."""
    _, server_port = server
    prom_port = free_port()
    config = yaml.safe_load((REPO / "deploy" / "prometheus" / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = "1s"
    config["rule_files"] = [str(REPO / "deploy" / "prometheus" / rule) for rule in config["rule_files"]]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    jobs["dllm-kvq-api"]["scrape_interval"] = "1s"
    jobs["dllm-kvq-api"]["static_configs"][0]["targets"] = [f"127.0.0.1:{server_port}"]
    jobs["prometheus"]["static_configs"][0]["targets"] = [f"127.0.0.1:{prom_port}"]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    log = tmp_path / "prometheus.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                find_tool("prometheus"),
                f"--config.file={path}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{prom_port}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{prom_port}"
    try:

        def up() -> bool:
            try:
                return urllib.request.urlopen(f"{base}/-/ready", timeout=2).status == 200
            except OSError:
                return False

        wait_until(up, 60, "prometheus readiness", proc, log)
        yield base
    finally:
        stop(proc)


def live_labels(url: str) -> dict[str, set[str]]:
    """Series name -> label names, from the server's live /metrics (series that have samples only)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    return labels


def query(base: str, expr: str) -> dict:
    return http_json(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr}), timeout=30)


def test_prometheus_scrapes_the_effective_bits_the_server_reported(server, prometheus):
    url, port = server
    # One quantized request: KIVI at 2 bits on the dual cache; the report carries its effective bits.
    answer = http_json(
        f"{url}/generate",
        {
            "prompt": "The capital of France is",
            "max_tokens": 16,
            "cache_mode": "dual",
            "kv_quant": {"method": "kivi", "bits": 2},
        },
    )
    kv = answer["kv"]
    assert kv["k_nominal_bits"] > 0

    expr = (
        'dllm_kv_effective_bits{method="kivi", bits="2", cache_mode="dual", tensor="k", accounting="nominal"}'
    )

    def scraped():
        result = query(prometheus, expr)["data"]["result"]
        return result or None

    (series,) = wait_until(scraped, 30, "effective bits in Prometheus")
    assert series["metric"]["job"] == "dllm-kvq-api"
    assert series["metric"]["instance"] == f"127.0.0.1:{port}"
    assert float(series["value"][1]) == pytest.approx(kv["k_nominal_bits"], rel=1e-6)
    storage = query(prometheus, expr.replace('"nominal"', '"storage"'))["data"]["result"]
    assert float(storage[0]["value"][1]) == pytest.approx(kv["k_storage_bits"], rel=1e-6)

    # The target is healthy and the stack's alert rules are loaded, none firing on a healthy server.
    targets = http_json(f"{prometheus}/api/v1/targets")["data"]["activeTargets"]
    api = [t for t in targets if t["labels"]["job"] == "dllm-kvq-api"]
    assert [t["health"] for t in api] == ["up"]
    groups = http_json(f"{prometheus}/api/v1/rules")["data"]["groups"]
    loaded = {rule["name"] for group in groups for rule in group["rules"]}
    expected = {
        rule["alert"]
        for group in yaml.safe_load((REPO / "deploy" / "prometheus" / "alerts.yml").read_text())["groups"]
        for rule in group["rules"]
    }
    assert loaded == expected
    assert all(rule["health"] == "ok" for group in groups for rule in group["rules"])
    assert query(prometheus, "dllm_ready")["data"]["result"][0]["value"][1] == "1"

    # The shadow re-decode (unquantized) of that request lands as agreement series of its configuration.
    shadow = 'dllm_shadow_token_agreement_count{method="kivi", bits="2", cache_mode="dual"}'
    (agreement,) = wait_until(
        lambda: query(prometheus, shadow)["data"]["result"] or None, 60, "shadow agreement"
    )
    assert float(agreement["value"][1]) == 1.0

    # Every label a query or rule matches on or groups by exists on the series it selects (checked where the
    # live /metrics has samples of every series the query names).
    labels = live_labels(url)
    checked = 0
    for expr in [*dashboard_exprs(), *rule_exprs()]:
        names = metric_names(expr) - {"up"}
        if names and names <= set(labels):
            available = set().union(*(labels[n] for n in names)) | TARGET_LABELS
            assert label_names(expr) <= available, (expr, label_names(expr) - available)
            checked += 1
    assert checked >= 20

    # Every dashboard query runs on the real server's data (Grafana's variables expanded as Grafana would).
    for expr in dashboard_exprs():
        for name, value in GRAFANA_VARS.items():
            expr = expr.replace(name, value)
        answer = query(prometheus, expr)
        assert answer["status"] == "success", (expr, answer)
