"""Kubernetes manifests: `kubernetes-validate --strict` on every file, and the facts that tie them to the server."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy.tools import REPO, find_tool, run_tool

K8S = REPO / "deploy" / "k8s"
MANIFESTS = sorted(K8S.rglob("*.yaml"))
# The oldest Kubernetes still commonly run, and the newest the validator knows.
VERSIONS = ["1.29.0", None]


def documents() -> dict[tuple[str, str], dict]:
    """Every manifest document keyed by (kind, name)."""
    out = {}
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


@pytest.mark.integration  # kubernetes-validate is a Python program: a fresh interpreter per call
@pytest.mark.parametrize("version", VERSIONS, ids=lambda v: v or "latest")
def test_every_manifest_validates_strictly(version):
    assert len(MANIFESTS) >= 6
    args = [find_tool("kubernetes-validate"), "--strict"]
    if version:
        args += ["-k", version]
    result = run_tool([*args, *map(str, MANIFESTS)])
    assert result.returncode == 0, result.stdout + result.stderr
    # A kind without a schema only warns; every document here must really have been checked.
    assert "WARN" not in result.stdout + result.stderr, result.stdout + result.stderr
    checked = result.stdout.count(" passed for resource ")
    assert checked == len(documents()), result.stdout


@pytest.mark.integration  # kubernetes-validate as a process, as above
def test_strict_validation_rejects_a_misspelt_field(tmp_path):
    # The validator is strict: an unknown field deep in a pod template fails (the check above can fail).
    deployment = documents()[("Deployment", "dllm-kvq-api")]
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {"path": "/"}
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(deployment))
    result = run_tool([find_tool("kubernetes-validate"), "--strict", str(bad)])
    assert result.returncode != 0 and "httpGett" in result.stdout + result.stderr


def test_api_probes_drain_and_gpu():
    docs = documents()
    pod = docs[("Deployment", "dllm-kvq-api")]["spec"]["template"]
    (api,) = pod["spec"]["containers"]
    assert api["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    assert api["startupProbe"]["httpGet"]["path"] == "/health/ready"
    assert api["livenessProbe"]["httpGet"]["path"] == "/health"
    assert api["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    # preStop sleep, then SIGTERM and the drain: the grace period must cover both with margin.
    pre_stop = float(api["lifecycle"]["preStop"]["exec"]["command"][1])
    drain = float(docs[("ConfigMap", "dllm-kvq-config")]["data"]["DLLM_DRAIN_TIMEOUT_S"])
    assert pod["spec"]["terminationGracePeriodSeconds"] >= pre_stop + drain + 10
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(api["ports"][0]["containerPort"])
    assert annotations["prometheus.io/path"] == "/metrics"
    assert {
        e["configMapRef"]["name"] if "configMapRef" in e else e["secretRef"]["name"] for e in api["envFrom"]
    } == {"dllm-kvq-config", "dllm-kvq-secrets"}
    service = docs[("Service", "dllm-kvq-api")]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()


def test_configmap_and_secret_are_legal_server_settings(monkeypatch):
    from service.config import Settings

    docs = documents()
    config = docs[("ConfigMap", "dllm-kvq-config")]["data"]
    secret = docs[("Secret", "dllm-kvq-secrets")]["stringData"]
    assert "DLLM_ADMIN_KEY" in secret
    fields = {f"DLLM_{name.upper()}" for name in Settings.model_fields}
    assert set(config) <= fields and set(secret) <= fields
    # The pod's environment (envFrom: ConfigMap, then Secret), read by the server's own settings object: refused
    # on the secret's placeholder keys alone as shipped, legal once the operator put real keys there.
    from pydantic import ValidationError

    for key, value in {**config, **secret}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValidationError) as refused:
        Settings()
    assert sorted(e["loc"][0] for e in refused.value.errors()) == ["admin_key", "api_keys"]
    monkeypatch.setenv("DLLM_ADMIN_KEY", "my-own-admin-key-0123456789")
    monkeypatch.setenv("DLLM_API_KEYS", "my-own-api-key-0123456789")
    settings = Settings()
    assert settings.store_url == "redis://dllm-kvq-redis:6379/0"
    assert settings.device == "cuda"
    redis = docs[("Service", "dllm-kvq-redis")]
    assert settings.store_url.split("//")[1].split(":")[0] == redis["metadata"]["name"]


def test_autoscaler_scales_the_api_on_an_exported_queue_gauge():
    from tests.deploy.test_monitoring import exported_series_names

    docs = documents()
    hpa = docs[("HorizontalPodAutoscaler", "dllm-kvq-api")]
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "dllm-kvq-api",
    }
    (metric,) = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    assert metric["type"] == "Pods" and name in exported_series_names()
    rules = yaml.safe_load(docs[("ConfigMap", "dllm-kvq-adapter-rules")]["data"]["config.yaml"])["rules"]
    assert any(rule["name"]["as"] == name for rule in rules)


def test_redis_persists_with_an_append_only_file():
    redis = documents()[("StatefulSet", "dllm-kvq-redis")]
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    assert container["args"][:3] == ["redis-server", "--appendonly", "yes"]
    assert redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"


def calibration_jobs() -> tuple[dict, dict, dict]:
    docs = documents()
    return (
        docs[("ConfigMap", "dllm-kvq-calibration")]["data"],
        docs[("Job", "dllm-kvq-calibration-shards")],
        docs[("Job", "dllm-kvq-calibration-merge")],
    )


def job_args(job: dict) -> list[str]:
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["envFrom"] == [{"configMapRef": {"name": "dllm-kvq-calibration"}}]
    return container["args"]


def test_calibration_is_an_indexed_job_of_shards_and_a_merge_with_the_same_settings():
    settings, shards, merge = calibration_jobs()
    assert shards["spec"]["completionMode"] == "Indexed"
    assert shards["spec"]["completions"] == int(settings["SHARDS"])
    shard_args, merge_args = job_args(shards), job_args(merge)
    assert shard_args[:2] == ["calibrate", "diagnose"] and merge_args[:2] == ["calibrate", "fit"]
    # Every shard and the merge run with the same settings; only the shard flag differs.
    i = shard_args.index("--shard")
    assert shard_args[i + 1] == "$(JOB_COMPLETION_INDEX)/$(SHARDS)"
    assert shard_args[2:i] + shard_args[i + 2 :] == merge_args[2:]
    # Every $(VAR) the args use is defined by the settings ConfigMap (or the Job controller).
    used = set(re.findall(r"\$\((\w+)\)", " ".join(shard_args + merge_args)))
    assert used == set(settings) | {"JOB_COMPLETION_INDEX"}


def test_calibration_flags_are_the_calibration_cli_s():
    from calibration.cli import build_parser

    # The CLI parses each Job's args once the variables are expanded (the image entrypoint strips `calibrate`).
    settings, shards, merge = calibration_jobs()
    env = {**settings, "JOB_COMPLETION_INDEX": "3"}
    for job in (shards, merge):
        args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in job_args(job)[1:]]
        parsed = build_parser().parse_args(args)
        assert parsed.store == settings["STORE"] and parsed.samples == int(settings["SAMPLES"])
    assert build_parser().parse_args(
        [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in job_args(shards)[1:]]
    ).shard == (3, int(settings["SHARDS"]))


@pytest.mark.integration  # the job's command as a process
def test_model_download_job_fills_the_cache_the_api_reads():
    docs = documents()
    job = docs[("Job", "dllm-kvq-model-download")]["spec"]["template"]["spec"]
    (container,) = job["containers"]
    # `command` replaces the image's entrypoint (the dllm-kvq console command, which runs only its own jobs).
    assert container["command"] == ["hf", "download", "$(DLLM_MODEL)"] and "args" not in container
    assert "DLLM_MODEL" in docs[("ConfigMap", "dllm-kvq-config")]["data"]
    (volume,) = job["volumes"]
    api = docs[("Deployment", "dllm-kvq-api")]["spec"]["template"]["spec"]
    assert volume in api["volumes"] and container["volumeMounts"][0] in api["containers"][0]["volumeMounts"]
    # The command exists where the project is installed, next to the console command (huggingface_hub's CLI).
    result = subprocess.run(
        [str(Path(sys.executable).parent / "hf"), "download", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0 and "usage: hf" in result.stdout.lower(), result.stderr  # hub 1.x: "Usage:"
