"""``python -m service generate --kv-quant ...``: quantized decoding from the command line, and its bad input. The
policy-file report runs a real subprocess; the other cases call the same ``main`` in this process
(`tests.support.cli`), which saves an interpreter start and a torch import per call."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from service.artifacts.base import Provenance
from service.artifacts.policy import LayerPolicy, PolicyTable
from tests.support.cli import service_main
from tests.support.fastdllm import CKPT, REPO_ROOT, four_prompts


def _generate_args(*args: str) -> list[str]:
    prompt = ",".join(map(str, four_prompts("llada")[1]))
    return ["generate", "--threads", "1", "--model", str(CKPT["llada"]), "--prompt-ids", prompt, "--gen-length", "64",
            "--ignore-eos", *args]


def _cli(*args: str) -> subprocess.CompletedProcess:
    """A real ``python -m service generate`` subprocess."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "service", *_generate_args(*args)], check=False, cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


def _main(*args: str) -> subprocess.CompletedProcess:
    """The same command's ``main`` in this process."""
    return service_main(*_generate_args(*args))


@pytest.fixture(scope="module")
def spec():
    from service.engine import Engine

    return Engine.load(CKPT["llada"]).spec


def _policy(spec, layers: int) -> PolicyTable:
    return PolicyTable(
        model_id=spec.model_id, weights_fingerprint=spec.fingerprint, cache_mode="dual", bits=2, k_group_size=32,
        v_group_size=16, k_bit_cap=4.9, provenance=Provenance(data="none", code="tests"),
        layers=[LayerPolicy(score_type="hybrid", p=1)] * layers,
    )


@pytest.mark.integration  # the real subprocess of `generate --kv-quant`
def test_dllm_kvq_from_a_policy_file_reports_kv(tmp_path, spec):
    """The --json report carries the kv field (plain output adds a [kv=...] line)."""
    table = _policy(spec, spec.num_layers)
    path = tmp_path / "policy.json"
    path.write_text(table.to_json())
    out = _cli("--kv-quant", "dllm_kvq", "--kv-bits", "2", "--policy", str(path), "--json")
    assert out.returncode == 0, out.stderr
    kv = json.loads(out.stdout)["kv"]
    assert kv["config"]["method"] == "dllm_kvq" and kv["config"]["bits"] == 2 and kv["policy_id"] == table.id
    assert kv["k_nominal_bits"] > 2 and kv["v_nominal_bits"] == 2 and len(kv["per_layer"]) == spec.num_layers


def test_bad_kv_input_exits_2_with_what_is_legal(tmp_path, spec):
    # One line in the flags' spellings: the command line has no policy_id or kvquant_state_file to set.
    for args, line in [
        (("--kv-quant", "kvquant"), ("--kv-quant kvquant needs its fitted KVQuant state: --kvquant-state FILE (or "
         "--kv-artifact FILE)")),
        (("--kv-quant", "dllm_kvq"), ("--kv-quant dllm_kvq needs its fitted policy table: --policy FILE (or "
         "--kv-artifact FILE)")),
        (("--kv-quant", "kivi", "--policy", "p.json"), ("--policy is only used by a method with a fitted artifact "
         "(kvquant, dllm_kvq), not --kv-quant kivi")),
        (("--kv-quant", "dllm_kvq", "--kvquant-state", "s"), ("--kvquant-state is for another method than "
         "--kv-quant dllm_kvq; give --policy FILE")),
        (("--kv-quant", "dllm_kvq", "--policy", "a", "--kv-artifact", "b"), ("give --policy or --kv-artifact, not "
         "both")),
    ]:
        out = _main(*args)
        assert out.returncode == 2 and out.stderr.splitlines() == [f"error: {line}"], (args, out.stderr)
    path = tmp_path / "policy.json"
    path.write_text(_policy(spec, spec.num_layers + 1).to_json())
    out = _main("--kv-quant", "dllm_kvq", "--kv-bits", "2", "--policy", str(path))
    assert out.returncode == 2 and "layers: the policy has 4 layer entries, the model has 3" in out.stderr
    out = _main("--kv-quant", "kivi", "--kv-bits", "3")
    assert out.returncode == 2 and "invalid choice: 3 (choose from 2, 4, 8)" in out.stderr
    # Full recompute reuses nothing: the server refuses this (400), so does the CLI.
    out = _main("--kv-quant", "kivi", "--kv-bits", "2", "--cache-mode", "none")
    assert out.returncode == 2 and "cache mode 'none' reuses nothing" in out.stderr


def test_a_policy_fitted_for_another_cache_mode_is_refused_naming_the_field(tmp_path, spec):
    """The CLI passes its cache mode to the one resolver, as the server does (its 400 names kv_quant.cache_mode):
    the dual-cache policy with --cache-mode prefix is refused before any decoding, naming the field and the flag."""
    path = tmp_path / "policy.json"
    path.write_text(_policy(spec, spec.num_layers).to_json())  # fitted for the dual cache
    out = _main("--kv-quant", "dllm_kvq", "--kv-bits", "2", "--policy", str(path), "--cache-mode", "prefix")
    assert out.returncode == 2, out.stdout
    assert out.stderr.strip().splitlines() == [
        (f"error: --policy {path} does not fit: cache_mode: the artifact has 'dual', the configuration asks for "
        "'prefix' (set by --cache-mode)")]
    # The same file with the cache mode it was fitted for decodes.
    assert _main("--kv-quant", "dllm_kvq", "--kv-bits", "2", "--policy", str(path), "--cache-mode", "dual").returncode == 0


def test_a_missing_policy_file_is_named_by_its_flag(tmp_path):
    missing = tmp_path / "nope"
    out = _main("--kv-quant", "dllm_kvq", "--kv-bits", "2", "--policy", str(missing))
    assert out.returncode == 2
    assert out.stderr.startswith(f"error: --policy '{missing}' cannot be used: ")
    assert "policy_file" not in out.stderr.replace(str(missing), "")


def test_the_key_bias_flag_is_reported_and_refused_without_quantized_keys():
    out = _main("--kv-quant", "kivi", "--kv-bits", "2", "--kv-key-bias-correction", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["kv"]["config"]["key_bias_correction"] is True
    out = _main("--kv-key-bias-correction")
    assert out.returncode == 2 and out.stderr.startswith("error: --kv-key-bias-correction corrects quantized keys; "
                                                         "--kv-quant none"), out.stderr


def test_an_activation_body_names_the_correction():
    from service.commands.policies import describe_config

    body = {"method": "kivi", "bits": 2, "key_bias_correction": True}
    assert describe_config(body) == "kivi 2-bit key_bias_correction"
    assert describe_config({"method": "kivi", "bits": 2}) == "kivi 2-bit"
