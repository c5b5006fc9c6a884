"""LLaDA2's quantized committed blocks carry the telemetry the other families' quantized caches do (issue 31, item
6), on one real server serving the tiny LLaDA2 (`tests/data/llada2/llada2-tiny-chat`) with the shadow re-decode
on every quantized request:

- **hot swap**: ``PUT /admin/active/prefix`` (what cache mode ``block`` serves) to KIVI 4-bit and then 2-bit while
  ``block`` requests are being served; each report's ``kv_config`` names the configuration it ran with and its KV
  report's effective bits follow it;
- **effective bits and bytes**: the ``dllm_kv_effective_bits`` / ``dllm_kv_bytes_held`` / ``dllm_kv_bf16_bytes``
  series of each configuration equal what its requests reported, and the KV-usage gauge moves while rows run;
- **accuracy**: the shadow re-decode of a quantized ``block`` request runs with the unquantized committed blocks,
  labelled with the served configuration, its token agreement the one of the served ids against the unquantized
  decode."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from service.engine.agreement import token_agreement
from tests.support.apps import ADMIN_KEY
from tests.support.llada2 import LLADA2_CHAT, start_llada2_server
from tests.support.metrics import metric_sum, metrics
from tests.support.waiting import until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
PROMPT = list(range(5, 45))  # 40 token ids: a whole prompt block commits at the first forward
REQUEST = {"prompt": PROMPT, "max_tokens": 64, "cache_mode": "block", "threshold": 0.9}
KIVI = {4: {"method": "kivi", "bits": 4}, 2: {"method": "kivi", "bits": 2}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_llada2_server(LLADA2_CHAT, tmp_path_factory.mktemp("llada2-telemetry"), DLLM_ADMIN_KEY=ADMIN_KEY,
                              DLLM_SHADOW_RATE="1.0", DLLM_MAX_BATCH_SIZE="4")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def served(server):
    """``block`` requests from 3 clients while the active ``prefix`` configuration goes from the unquantized
    cache to KIVI 4-bit and then 2-bit: ``(sent, report)`` pairs, the swaps' times and answers, and the most KV
    usage seen on /metrics while they ran."""
    results, stop, usage = [], threading.Event(), []

    def load():
        with httpx.Client(base_url=server.url, timeout=120) as c:
            while not stop.is_set():
                sent = time.monotonic()
                r = c.post("/generate", json=REQUEST)
                assert r.status_code == 200, r.text
                results.append((sent, r.json()))

    def answered_after(t):
        return [report for sent, report in results if sent > t]

    threads = [threading.Thread(target=load) for _ in range(3)]
    for t in threads:
        t.start()
    swaps = []
    try:
        until(lambda: results, "a request answered before the swaps", timeout_s=120)
        for bits in (4, 2):
            usage.append(metric_sum(metrics(server.url), "dllm_kv_cache_usage_perc"))
            begun = time.monotonic()
            r = httpx.put(server.url + "/admin/active/prefix", json=KIVI[bits], headers=ADMIN)
            swaps.append((time.monotonic(), r, begun))
            until(lambda: answered_after(swaps[-1][0]), f"a request sent after the {bits}-bit swap answered",
                  timeout_s=120)
            usage.append(metric_sum(metrics(server.url), "dllm_kv_cache_usage_perc"))
    finally:
        stop.set()
        for t in threads:
            t.join()
    return results, swaps, usage


def config_of(report: dict) -> tuple[str, int | None]:
    quant = report["kv_config"]["kv_quant"]
    return quant["method"], quant.get("bits")


def test_hot_swap_between_block_requests(served):
    results, swaps, _ = served
    for (_, r, _), before, new in zip(swaps, ({"method": "none"}, KIVI[4]), (KIVI[4], KIVI[2])):
        assert r.status_code == 200, r.text
        assert r.json()["served_before"]["method"] == before["method"] and r.json()["new"] == {
            **r.json()["new"], **new}
    seen = {config_of(report) for _, report in results}
    assert seen >= {("none", None), ("kivi", 4), ("kivi", 2)}, seen
    for sent, report in results:  # a request sent after a swap answered runs with that swap's configuration
        after = [bits for t, bits in zip((t for t, _, _ in swaps), (4, 2)) if sent > t]
        # ... unless the next swap's PUT was already under way when it was sent (a swap's time is taken when its
        # PUT answered, so a request sent during the next PUT may already see the next configuration).
        during_next = len(after) < len(swaps) and sent > swaps[len(after)][2]
        if after and not during_next:
            assert config_of(report) == ("kivi", after[-1])
        assert report["kv_config"]["cache_mode"] == "prefix"  # block serves prefix's configuration
    bits = {}
    for _, report in results:
        method, b = config_of(report)
        kv = report["kv"]
        if method == "none":
            assert kv is None or kv["k_nominal_bits"] == 16, kv
            continue
        assert kv["config"]["bits"] == b and kv["bytes_held"] < kv["bf16_bytes"], kv
        # nominal bits are the codes' bits on the committed blocks; storage adds scales and zero points
        assert kv["k_nominal_bits"] == pytest.approx(b) and kv["v_nominal_bits"] == pytest.approx(b)
        assert b < kv["k_storage_bits"] < 16 and b < kv["v_storage_bits"] < 16
        bits.setdefault(b, set()).add((kv["k_storage_bits"], kv["v_storage_bits"], kv["bytes_held"]))
    # the same prompt decoded with one configuration holds the same bytes; 2-bit holds fewer than 4-bit
    assert len(bits[4]) == 1 and len(bits[2]) == 1, bits
    (k4, v4, held4), (k2, v2, held2) = bits[4].pop(), bits[2].pop()
    assert k2 < k4 and v2 < v4 and held2 < held4


def test_effective_bits_and_bytes_series_of_block_requests(served, server):
    results, _, usage = served
    m = metrics(server.url)
    for bits in (4, 2):
        kv = next(report["kv"] for _, report in results if config_of(report) == ("kivi", bits))
        labels = {"method": "kivi", "bits": str(bits), "cache_mode": "prefix"}
        for tensor in ("k", "v"):
            for accounting in ("nominal", "storage"):
                value = metric_sum(m, "dllm_kv_effective_bits", **labels, tensor=tensor, accounting=accounting)
                assert value == pytest.approx(kv[f"{tensor}_{accounting}_bits"]), (bits, tensor, accounting)
        assert metric_sum(m, "dllm_kv_bytes_held", **labels) == kv["bytes_held"]
        assert metric_sum(m, "dllm_kv_bf16_bytes", **labels) == kv["bf16_bytes"]
    # The NFE is the request's series: its own cache mode, not its configuration's (which the KV series carry).
    assert metric_sum(m, "dllm_nfe_per_request_count", cache_mode="block") == len(results)
    assert metric_sum(m, "dllm_nfe_per_request_count", cache_mode="prefix") == 0
    assert metric_sum(m, "dllm_active_config_info", cache_mode="prefix", method="kivi", bits="2") == 1
    assert metric_sum(m, "dllm_config_changes_total", cache_mode="prefix") == 2
    # The KV-usage gauge: reserved over budget while rows run (read with 3 clients in flight).
    assert 0 < max(usage) <= 1, usage


def test_shadow_re_decode_of_quantized_block_requests(served, server):
    results, _, _ = served
    unquantized = next(report for _, report in results if config_of(report) == ("none", None))["rows"][0]
    # Every finished quantized request is re-decoded (rate 1) or dropped and counted (queue full): wait for all.
    quantized = sum(1 for _, report in results if config_of(report)[0] == "kivi")

    def settled():
        m = metrics(server.url)
        return (metric_sum(m, "dllm_shadow_requests_total", method="kivi")
                + metric_sum(m, "dllm_shadow_dropped_total")) == quantized
    until(settled, f"{quantized} quantized requests shadowed or dropped", timeout_s=300)
    for bits in (4, 2):
        labels = {"method": "kivi", "bits": str(bits), "cache_mode": "prefix"}
        m = metrics(server.url)
        assert metric_sum(m, "dllm_shadow_requests_total", **labels) >= 1, bits
        served_row = next(report for _, report in results if config_of(report) == ("kivi", bits))["rows"][0]
        # Every request decodes the same prompt, so every shadow of this configuration agrees the same: the
        # served ids against the unquantized block decode (exact committed blocks: as the unquantized request).
        count = metric_sum(m, "dllm_shadow_token_agreement_count", **labels)
        expected = token_agreement(served_row["generated_ids"], unquantized["generated_ids"])
        assert count == metric_sum(m, "dllm_shadow_requests_total", **labels)
        # 2-bit changes this decode, so a shadow that kept the quantized store would agree fully and fail here.
        assert bits == 4 or expected < 1
        assert metric_sum(m, "dllm_shadow_token_agreement_sum", **labels) == pytest.approx(expected * count)
        exact = served_row["text"] == unquantized["text"]
        assert metric_sum(m, "dllm_shadow_exact_match_total", **labels) == (count if exact else 0)
    assert metric_sum(metrics(server.url), "dllm_shadow_requests_total", method="none") == 0
