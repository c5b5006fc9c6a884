"""The calibration CLI's activation bodies: one `KVQuantConfig` file per fitted policy and state, ready for
``PUT /admin/active/{cache_mode}``."""

from __future__ import annotations

import json

from calibration.cli import print_summary, write_activation_configs
from calibration.job import RunSummary
from service.quant.config import KVQuantConfig


def test_activation_bodies_name_each_artifact_with_its_group_sizes(tmp_path, capsys):
    summary = RunSummary(policies={"dual/2": "policy-aa", "prefix/4": "policy-bb"}, kvquant_states={"2": "kvqstate-cc"})
    paths = write_activation_configs(summary, k_group_size=16, v_group_size=8, out=tmp_path)
    assert [p.name for p in paths] == ["dllm_kvq-dual-2bit.json", "dllm_kvq-prefix-4bit.json", "kvquant-2bit.json"]
    bodies = {p.name: json.loads(p.read_text()) for p in paths}
    assert bodies["dllm_kvq-dual-2bit.json"] == {"method": "dllm_kvq", "bits": 2, "k_group_size": 16,
                                                 "v_group_size": 8, "policy_id": "policy-aa", "sides": "kv",
                                                 "keep_dequantized": False}
    assert bodies["kvquant-2bit.json"]["kvquant_state_id"] == "kvqstate-cc"
    for body in bodies.values():  # each is a valid configuration as the admin endpoint parses it
        KVQuantConfig.model_validate(body)
    summary.activation_configs = [str(p) for p in paths]
    print_summary(summary, 1.0)
    assert str(paths[0]) in capsys.readouterr().out
