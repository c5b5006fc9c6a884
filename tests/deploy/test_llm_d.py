"""The llm-d / Gateway API Inference Extension example (deploy/llm-d/), validated offline: the endpoint picker's
standard objects with `kubernetes-validate --strict`, the InferencePool and HTTPRoute against their trimmed
schemas (tests/deploy/schemas/), and the facts that tie them to the server: the pool selects the api pods on
their port, names the picker's Service, and the picker reads series the server exports, with the queue and KV
scorers and no prefix scorer (issue 34)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.deploy.tools import REPO, find_tool, run_tool

LLM_D = REPO / "deploy" / "llm-d"
SCHEMAS = Path(__file__).parent / "schemas"
CUSTOM = {"InferencePool": "inferencepool-v1.json", "HTTPRoute": "httproute-v1.json"}


def documents() -> dict[tuple[str, str], dict]:
    out = {}
    for path in sorted(LLM_D.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


@pytest.mark.integration
def test_the_endpoint_picker_validates_strictly(tmp_path):
    standard = [doc for (kind, _), doc in documents().items() if kind not in CUSTOM]
    assert {doc["kind"] for doc in standard} >= {"Deployment", "Service", "ConfigMap", "Role", "RoleBinding"}
    path = tmp_path / "standard.yaml"
    path.write_text(yaml.safe_dump_all(standard))
    result = run_tool([find_tool("kubernetes-validate"), "--strict", str(path)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARN" not in result.stdout + result.stderr, result.stdout + result.stderr
    assert result.stdout.count(" passed for resource ") == len(standard), result.stdout


@pytest.mark.parametrize("kind", sorted(CUSTOM))
def test_the_gateway_objects_match_their_schemas(kind):
    schema = json.loads((SCHEMAS / CUSTOM[kind]).read_text())
    found = [doc for (k, _), doc in documents().items() if k == kind]
    assert found
    for doc in found:
        jsonschema.validate(doc, schema)
    # The schema is strict: a misspelt field fails (the check above can fail).
    bad = json.loads(json.dumps(found[0]))
    bad["spec"]["rulez" if kind == "HTTPRoute" else "targetPort"] = 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_the_pool_routes_to_the_api_pods_through_the_picker_on_our_series():
    from service.telemetry import Telemetry

    docs = documents()
    api = yaml.safe_load_all((REPO / "deploy" / "k8s" / "30-api.yaml").read_text())
    api_pod = next(d for d in api if d and d["kind"] == "Deployment")["spec"]["template"]
    (pool,) = [d for (k, _), d in docs.items() if k == "InferencePool"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= api_pod["metadata"]["labels"].items()
    assert pool["spec"]["targetPorts"][0]["number"] == api_pod["spec"]["containers"][0]["ports"][0]["containerPort"]
    picker = pool["spec"]["endpointPickerRef"]
    service = docs[("Service", picker["name"])]
    assert picker["port"]["number"] in [p["port"] for p in service["spec"]["ports"]]
    route = docs[("HTTPRoute", "dllm-kvq")]
    assert route["spec"]["rules"][0]["backendRefs"][0] == {"group": "inference.networking.k8s.io",
                                                           "kind": "InferencePool", "name": pool["metadata"]["name"]}

    (epp,) = docs[("Deployment", "dllm-kvq-epp")]["spec"]["template"]["spec"]["containers"]
    args = dict(a.removeprefix("--").split("=", 1) for a in epp["args"])
    assert args["pool-name"] == pool["metadata"]["name"] and args["pool-namespace"] == pool["metadata"]["namespace"]
    exported = {m.name for m in Telemetry().registry.collect()}
    mapping = {"total-queued-requests-metric": "dllm_requests_waiting",
               "total-running-requests-metric": "dllm_requests_running",
               "kv-cache-usage-percentage-metric": "dllm_kv_cache_usage_perc"}
    for flag, series in mapping.items():
        assert args[flag] == series and series in exported, flag
    config = yaml.safe_load(docs[("ConfigMap", "dllm-kvq-epp-config")]["data"]["plugins.yaml"])
    plugins = {p["type"] for p in config["plugins"]}
    assert {"queue-scorer", "kv-cache-utilization-scorer"} <= plugins
    assert not any("prefix" in p for p in plugins)  # a bidirectional cache shares no prefixes across requests
    mounted = epp["volumeMounts"][0]["mountPath"]
    assert args["config-file"] == f"{mounted}/plugins.yaml"
