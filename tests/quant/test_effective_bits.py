"""One effective-bits figure per meaning (docs/glossary.md, "Effective bits"): a policy's configured K bits are
the same number on every path that reports it (activation answer, /admin/active, kv_config of the native and the
OpenAI routes, dllm_kv_configured_bits, the calibration tables and Table 4, the matrix rows), and the unquantized
cache reports no bits anywhere. In-process server with a fake engine and a directory store."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from calibration.policy_tables import per_layer_markdown, table4_markdown
from evaluation.matrix import Cell, MatrixSettings, cell_configured_bits
from service.artifacts.base import Provenance
from service.artifacts.policy import LayerPolicy, PolicyTable
from service.quant.accounting import configured_bits, policy_k_bits
from service.quant.config import KVQuantConfig
from tests.support.apps import ADMIN_KEY, fake_admin_client
from tests.support.fake_engine import FakeEngine

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
SPEC = FakeEngine().spec


def _policy() -> PolicyTable:
    """2-bit K groups of 32 with a different budget p on each layer (0, 1, 2, 4, ...)."""
    budgets = [(0, 1, 2, 4)[i % 4] for i in range(SPEC.num_layers)]
    return PolicyTable(model_id=SPEC.model_id, weights_fingerprint=SPEC.fingerprint, cache_mode="dual", bits=2,
                       k_group_size=32, v_group_size=min(32, SPEC.head_dim), k_bit_cap=16.0,
                       layers=[LayerPolicy(score_type="attention", p=p) for p in budgets],
                       provenance=Provenance(data="tests", code="tests/quant/test_effective_bits.py"))


POLICY = _policy()
#: By hand: each layer's full-group nominal K bits (b (G - p) + 16 p) / G, averaged over layers.
EXPECTED = sum((2 * (32 - layer.p) + 16 * layer.p) / 32 for layer in POLICY.layers) / len(POLICY.layers)


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("store")


@pytest.fixture(scope="module")
def client(store_dir):
    with fake_admin_client(store_dir) as c:
        yield c


def _configured_metric(client) -> dict[tuple[str, str], float]:
    """(cache mode, tensor) -> dllm_kv_configured_bits, read with prometheus-client's parser."""
    found = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "dllm_kv_configured_bits":
                found[sample.labels["cache_mode"], sample.labels["tensor"]] = sample.value
    return found


def test_the_function_by_hand():
    assert policy_k_bits(POLICY) == pytest.approx(EXPECTED)
    config = KVQuantConfig(method="dllm_kvq", bits=2, policy_id=POLICY.id)
    assert configured_bits(config, POLICY) == {"k": pytest.approx(EXPECTED), "v": 2.0}
    assert configured_bits(KVQuantConfig(method="kivi", bits=2, sides="k")) == {"k": 2.0, "v": 16.0}
    assert configured_bits(KVQuantConfig()) is None  # the unquantized cache has no bits


def test_a_policy_reports_the_same_configured_bits_on_every_path(client, store_dir):
    assert client.post("/admin/policies", content=POLICY.to_json(), headers=ADMIN).status_code == 201
    config = {"method": "dllm_kvq", "bits": 2, "policy_id": POLICY.id}
    activated = client.put("/admin/active/dual", json=config, headers=ADMIN)
    assert activated.status_code == 200, activated.text
    want = {"k": pytest.approx(EXPECTED), "v": 2.0}
    assert activated.json()["configured_bits"] == want
    assert client.get("/admin/active", headers=ADMIN).json()["serving"]["dual"]["configured_bits"] == want
    native = client.post("/generate", json={"prompt": "ab", "max_tokens": 4, "cache_mode": "dual"}).json()
    assert native["kv_config"]["configured_bits"] == want
    openai = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 4, "cache_mode": "dual"}).json()
    assert openai["kv_config"]["configured_bits"] == want
    metric = _configured_metric(client)
    assert metric["dual", "k"] == pytest.approx(EXPECTED) and metric["dual", "v"] == 2.0

    # The calibration's tables and Table 4 print the same figure (3 decimals).
    shown = f"{EXPECTED:.3f}"
    assert f"configured K bits {shown}" in "\n".join(per_layer_markdown("dual, 2-bit", POLICY))
    assert f"| {shown} |" in "\n".join(table4_markdown({"dual/2": {"configured_k_bits": policy_k_bits(POLICY)}}))
    # A matrix row of this policy carries it too.
    cell = Cell("embedded", "dual", "dllm_kvq", 2)
    assert cell_configured_bits(cell, MatrixSettings(tasks=["t"], store_url=str(store_dir)), POLICY.id,
                                SPEC) == want


def test_the_unquantized_cache_reports_no_bits(client):
    # The active entry of prefix is the unquantized default, and cache mode none is always unquantized.
    for mode in ("prefix", "none"):
        r = client.post("/generate", json={"prompt": "ab", "max_tokens": 4, "cache_mode": mode}).json()
        assert r["kv_config"]["kv_quant"] == {"method": "none"} and "configured_bits" not in r["kv_config"]
    assert client.get("/admin/active", headers=ADMIN).json()["serving"]["prefix"]["kv_quant"] == {"method": "none"}
    assert not any(mode == "prefix" for mode, _ in _configured_metric(client))
    changed = client.put("/admin/active/prefix", json={"method": "kivi", "bits": 4}, headers=ADMIN).json()
    assert changed["served_before"] == {"method": "none"} and changed["configured_bits"] == {"k": 4.0, "v": 4.0}
    back = client.put("/admin/active/prefix", json={"method": "none", "bits": 2}, headers=ADMIN).json()
    assert back["new"] == {"method": "none"} and back["configured_bits"] is None
    assert not any(mode == "prefix" for mode, _ in _configured_metric(client))
