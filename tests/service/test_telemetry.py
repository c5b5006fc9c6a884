"""Telemetry: metric names and labels as documented, parsed back with prometheus_client.parser."""

from prometheus_client.parser import text_string_to_metric_families

from service.engine.params import DecodeParams
from service.engine.report import DecodeReport, KVReport, RowReport, Timings
from service.quant.config import KVQuantConfig
from service.telemetry import Telemetry


def _samples(tel: Telemetry) -> dict:
    out = {}
    for family in text_string_to_metric_families(tel.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_report_kv_and_active_config_metrics():
    tel = Telemetry()
    cfg = KVQuantConfig(method="dllm_kvq", bits=4, policy_id="pol-1")
    kv = KVReport(config=cfg.model_dump(), policy_id="pol-1", k_nominal_bits=4.4, v_nominal_bits=4.0,
                  k_storage_bits=4.9, v_storage_bits=5.0, bytes_held=1000, bf16_bytes=4000)
    row = RowReport(generated_ids=[5, 6, 7], finish_reason="stop", nfe=12, steps_per_block=[6, 6],
                    reveals_per_step=[1] * 12, tokens_per_second=1.0)
    tel.observe_report(DecodeReport(rows=[row, row], params=DecodeParams(), timings=Timings(), kv=kv), "dual", cfg)
    tel.set_active("m", "dual", KVQuantConfig(method="kivi", bits=2), "store")
    tel.set_active("m", "dual", cfg, "admin", k_bits_cap=4.9)
    s = _samples(tel)
    base = (("bits", "4"), ("cache_mode", "dual"), ("method", "dllm_kvq"), ("policy", "pol-1"))
    assert s[("dllm_kv_effective_bits", tuple(sorted(base + (("tensor", "k"), ("accounting", "nominal")))))] == 4.4
    assert s[("dllm_kv_effective_bits", tuple(sorted(base + (("tensor", "v"), ("accounting", "storage")))))] == 5.0
    assert s[("dllm_kv_bytes_held", base)] == 1000
    assert s[("dllm_generation_tokens_total", ())] == 6
    assert s[("dllm_nfe_per_request_count", (("cache_mode", "dual"),))] == 2
    active = [k for k in s if k[0] == "dllm_active_config_info"]
    assert len(active) == 1 and ("method", "dllm_kvq") in active[0][1]  # the kivi series was replaced
    assert s[("dllm_policy_k_bits_cap", (("cache_mode", "dual"), ("policy", "pol-1")))] == 4.9


def test_shadow_and_eval_metrics():
    tel = Telemetry()
    cfg = KVQuantConfig(method="kivi", bits=2)
    tel.observe_shadow(cfg, "prefix", 0.5, exact=False)
    tel.observe_shadow(cfg, "prefix", 1.0, exact=True)
    tel.observe_eval("gsm8k", {"exact_match": 0.25}, cfg, "prefix", at=123.0)
    s = _samples(tel)
    labels = (("bits", "2"), ("cache_mode", "prefix"), ("method", "kivi"), ("policy", ""))
    assert s[("dllm_shadow_requests_total", labels)] == 2
    assert s[("dllm_shadow_exact_match_total", labels)] == 1
    assert s[("dllm_shadow_token_agreement_sum", labels)] == 1.5
    assert s[("dllm_eval_score", tuple(sorted(labels + (("metric", "exact_match"), ("task", "gsm8k")))))] == 0.25


def test_the_active_configuration_names_the_key_bias_correction():
    tel = Telemetry()
    tel.set_active("m", "dual", KVQuantConfig(method="kivi", bits=2, key_bias_correction=True), "admin")
    tel.set_active("m", "prefix", KVQuantConfig(method="kivi", bits=2), "store")
    tel.set_active("m", "prefix", KVQuantConfig(), "store")
    active = {dict(k[1])["cache_mode"]: dict(k[1]) for k in _samples(tel) if k[0] == "dllm_active_config_info"}
    assert active["dual"]["key_bias_correction"] == "on"
    assert active["prefix"]["key_bias_correction"] == ""  # method none (the kivi series was replaced)
