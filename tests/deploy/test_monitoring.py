"""Prometheus config and alert rules (promtool), the Grafana dashboard and provisioning, and that every query
names only metrics the server exports (read from the server's own registry through prometheus_client's parser)."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.tools import REPO, find_tool, run_tool

PROM = REPO / "deploy" / "prometheus"
GRAFANA = REPO / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "dllm-kvq.json"
# Series Prometheus makes itself for every target (not exported by the server).
PROMETHEUS_OWN = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}
SAMPLE_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
}


def exported_series_names() -> set[str]:
    """Every series name the server's /metrics can carry: the families of a fresh `Telemetry` registry as
    prometheus_client's parser reads its exposition text, expanded by type to their sample names."""
    from service.telemetry import Telemetry

    names = set()
    for family in text_string_to_metric_families(Telemetry().render().decode()):
        names.update(family.name + suffix for suffix in SAMPLE_SUFFIXES[family.type])
    return names


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects: identifiers outside strings, label matchers and grouping
    clauses that are not followed by '(' (functions) and are not PromQL keywords."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    expr = re.sub(r"\{[^}]*\}", "{}", expr)  # label matchers
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    expr = re.sub(r"\[[^\]]*\]", "[]", expr)  # range and subquery durations
    keywords = {
        "and",
        "or",
        "unless",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "offset",
        "bool",
        "inf",
        "nan",
    }
    names = set()
    for m in re.finditer(r"(?<![\w.:])([a-zA-Z_:][\w:]*)(?![\w:])(?!\s*\()", expr):
        word = m.group(1)
        if word.lower() not in keywords and not re.fullmatch(r"\d+[smhdwy]", word):
            names.add(word)
    return names


def label_names(expr: str) -> set[str]:
    """Label names a PromQL expression matches on or groups by."""
    names = set()
    for matchers in re.findall(r"\{([^}]*)\}", expr):
        names.update(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", re.sub(r'"(?:[^"\\]|\\.)*"', '""', matchers)))
    for clause in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", expr):
        names.update(n.strip() for n in clause.split(",") if n.strip())
    return names


def dashboard_exprs() -> list[str]:
    """Every PromQL query in the dashboard: panel targets, template variable queries, annotations."""
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [a["expr"] for a in dash["annotations"]["list"] if "expr" in a]
    for var in dash["templating"]["list"]:
        inner = re.fullmatch(r"label_values\((\w+),\s*\w+\)", var["query"]["query"])
        assert inner, var["query"]
        exprs.append(inner.group(1))
    return exprs


def rule_exprs() -> list[str]:
    groups = yaml.safe_load((PROM / "alerts.yml").read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


def test_promtool_checks_the_config_and_its_rule_files():
    result = run_tool([find_tool("promtool"), "check", "config", str(PROM / "prometheus.yml")])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 1 rule files found" in result.stdout


def test_promtool_checks_the_rules():
    result = run_tool([find_tool("promtool"), "check", "rules", str(PROM / "alerts.yml")])
    assert result.returncode == 0, result.stdout + result.stderr


def test_alerts_fire_on_their_cases_and_stay_silent_on_near_misses():
    # promtool's rule unit tests: K bits over the cap (averaged, stale policy ignored), agreement below 0.9
    # with enough samples, 5xx share, 429s, readiness and reachability.
    result = run_tool(
        [find_tool("promtool"), "test", "rules", "alerts_test.yml"],
        cwd=REPO / "tests" / "deploy" / "prometheus",
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_issue_asks_for_these_alerts():
    names = {
        rule["alert"]
        for g in yaml.safe_load((PROM / "alerts.yml").read_text())["groups"]
        for rule in g["rules"]
    }
    assert {
        "DllmKvqKBitsAboveCap",
        "DllmKvqOnlineAgreementLow",
        "DllmKvqHigh5xxRate",
        "DllmKvqQueueSaturated",
        "DllmKvqNotReady",
    } <= names


def test_metric_name_extraction_on_known_queries():
    assert metric_names('sum by (le) (rate(a_bucket{x="b"}[5m])) / on (i) group_left b_count') == {
        "a_bucket",
        "b_count",
    }
    assert metric_names(
        "histogram_quantile(0.9, sum by (le, cache_mode) (rate(x_bucket[$__rate_interval])))"
    ) == {"x_bucket"}
    assert metric_names("up == 0 and foo offset 5m") == {"up", "foo"}
    assert label_names(
        'sum by (cache_mode) (rate(x{instance=~"$i", a="{b}"}[5m])) > on (policy) group_left y'
    ) == {"cache_mode", "instance", "a", "policy"}


def test_rule_queries_name_only_exported_metrics():
    exported = exported_series_names() | PROMETHEUS_OWN
    for expr in rule_exprs():
        assert metric_names(expr), expr
        assert metric_names(expr) <= exported, (expr, metric_names(expr) - exported)


def test_dashboard_queries_name_only_exported_metrics():
    exported = exported_series_names() | PROMETHEUS_OWN
    exprs = dashboard_exprs()
    assert len(exprs) > 20
    for expr in exprs:
        assert metric_names(expr), expr
        assert metric_names(expr) <= exported, (expr, metric_names(expr) - exported)


def test_a_misspelt_metric_is_caught():
    # The check above is not vacuous: one wrong letter in a dashboard-style query is reported.
    exported = exported_series_names()
    assert not metric_names("sum(rate(dllm_request_total[5m]))") <= exported
    assert "dllm_requests_total" in exported and "dllm_kv_effective_bits" in exported


def test_dashboard_covers_what_the_issue_asks():
    names = set().union(*(metric_names(e) for e in dashboard_exprs()))
    for needed in (
        "dllm_request_latency_seconds_bucket",
        "dllm_generation_tokens_total",
        "dllm_requests_waiting",
        "dllm_batch_size_bucket",
        "dllm_nfe_per_request_sum",
        "dllm_kv_effective_bits",
        "dllm_kv_bytes_held",
        "dllm_active_config_info",
        "dllm_config_changes_total",
        "dllm_shadow_token_agreement_sum",
        "dllm_eval_score",
    ):
        assert needed in names, needed


def test_dashboard_panels_use_the_provisioned_data_source():
    dash = json.loads(DASHBOARD.read_text())
    source = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    (ds,) = source["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": ds["uid"]}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == ds["uid"]


def test_dashboard_provider_reads_the_mounted_directory():
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "dllm-kvq.yml").read_text())
    (entry,) = provider["providers"]
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert f"./deploy/grafana/dashboards:{entry['options']['path']}:ro" in mounts


@pytest.mark.parametrize("path", sorted(GRAFANA.rglob("*.yml")) + sorted(PROM.glob("*.yml")), ids=str)
def test_yaml_files_parse(path):
    assert yaml.safe_load(path.read_text())
