"""`benchmarks/step_bytes.py` counts what a later step reads from the packed layers the stores really hold (issue 41,
item 5's CPU half)."""

from __future__ import annotations

import json

from benchmarks import step_bytes
from service.artifacts.base import default_v_group_size


def test_a_kivi_layer_holds_codes_statistics_and_the_kernel_maps():
    reused, suffix, heads, d, bits = 100, 36, 2, 16, 4
    n = reused * heads * d
    codes = 4 * -(-(n * bits // 8) // 4)  # one planar stream per side, whole int32 words
    groups = -(-(reused - suffix) // 32) + -(-suffix // 32)  # K groups are cut inside each reused segment
    k_stats = 2 * groups * heads * d * 2  # bf16 scale and minimum per group and channel
    v_stats = 2 * reused * heads * (d // default_v_group_size(d)) * 2
    maps = 4 * reused + 4 * reused  # int32 slot_of [1, reused] and group_of_slot [N]
    assert step_bytes.layer_bytes("kivi", bits, reused, suffix, heads, d) == 2 * codes + k_stats + v_stats + maps
    assert step_bytes.layer_bytes("none", 16, reused, suffix, heads, d) == 2 * n * 2


def test_the_json_output_names_each_cache_and_its_ratio(capsys):
    step_bytes.main(["--rows", "2", "--reused", "64", "--suffix", "32", "--json"])
    result = json.loads(capsys.readouterr().out)
    ratios = {(c["cache"], c["bits"]): c["ratio"] for c in result["caches"]}
    assert ratios[("dual", 16)] == 1.0
    assert ratios[("dual+kivi", 2)] < ratios[("dual+kivi", 4)] < 1.0
    # dLLM-KVQ holds KIVI's format plus its protected tokens (and their code rows)
    assert ratios[("dual+kivi", 4)] < ratios[("dual+dllm_kvq", 4)] < 1.0
    dual = result["caches"][0]
    assert dual["step_bytes"] == result["weights_bytes"] + dual["kv_bytes"] == result["weights_bytes"] + 2 * (
        32 * 2 * 64 * 4096 * 2)
