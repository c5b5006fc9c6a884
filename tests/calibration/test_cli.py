"""The calibration CLI's activation bodies: one `KVQuantConfig` file per fitted policy and state, ready for
``PUT /admin/active/{cache_mode}``."""

from __future__ import annotations

import json

from calibration.cli import print_summary, write_activation_configs
from calibration.job import RunSummary
from service.commands import prog
from service.quant.config import KVQuantConfig


def test_activation_bodies_name_each_artifact_with_its_group_sizes(tmp_path, capsys):
    summary = RunSummary(fitted={"dllm_kvq": {"dual/2": "policy-aa", "prefix/4": "policy-bb"},
                                 "kvquant": {"2": "kvqstate-cc"}})
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


def test_reports_default_under_runs_and_help_says_so(capsys):
    import pytest

    from calibration.cli import DEFAULT_OUT, build_parser

    assert DEFAULT_OUT.as_posix() == "runs/calibration"  # git ignores runs/
    assert build_parser().parse_args(["all"]).out == DEFAULT_OUT
    with pytest.raises(SystemExit):
        build_parser().parse_args(["all", "--help"])
    assert "(default runs/calibration," in " ".join(capsys.readouterr().out.split())


def test_an_unreachable_store_is_one_line_before_the_model_loads(capsys):
    """Redis not running: one line naming --store and the URL, exit 2 (it was a StoreUnavailable traceback)."""
    from calibration.cli import main
    from tests.support.processes import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"
    assert main(["all", "--store", url, "--model", "/nonexistent", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{prog('calibration', 'all')}: error: --store {url} (key prefix ")
    assert "cannot read it (" in err[0] and "Connection refused" in err[0]
    assert err[0].endswith("start the store (redis-server) or give another --store")


def test_one_round_reports_no_change_rather_than_zero(capsys):
    summary = RunSummary(convergence=[{"trajectory": "trace-a", "rounds": 1, "objectives": [-3.0], "settled": False,
                                       "last_change": None}])
    print_summary(summary, 1.0)
    out = capsys.readouterr().out
    assert "no change between rounds to report" in out and "+0.0000" not in out


def test_a_missing_merge_file_is_one_line_before_the_model_loads(tmp_path, capsys):
    """``fit --merge`` (dLLM-KVQ's own flag, `calibration.dllm_kvq_fit.fit_flags`) with a path that is no file: one
    line naming it, exit 2, before the store or the model is touched (the CLI itself names no method)."""
    import pytest

    from calibration.cli import main

    missing = tmp_path / "sums-0.json"
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--model", "/nonexistent", "--store", str(tmp_path / "store"), "--merge", str(missing)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [(f"{prog('calibration', 'fit')}: error: --merge {missing}: no such file; give the files "
                    "`diagnose --sums-out` wrote")]
    assert not (tmp_path / "store").exists()


def test_every_setting_is_one_flag_and_parses_back(tmp_path):
    """The flags made from `JobSettings`' fields give back the settings they were given (tuples, a switch, an
    optional int), so no field is lost by the CLI naming none."""
    from calibration.cli import build_parser, settings_from
    from calibration.job import JobSettings

    args = build_parser().parse_args([
        "fit", "--bits", "2", "--kvquant-bits", "8", "2", "--fisher", "--cache-modes", "dual", "--v-group-size", "8",
        "--samples", "3", "--bit-penalty", "0.5", "--shard", "1/2", "--bucket", f"qa={tmp_path / 'qa.jsonl'}"])
    settings = settings_from(args)
    assert settings == JobSettings(bits=(2,), kvquant_bits=(8, 2), fisher=True, cache_modes=("dual",),
                                   v_group_size=8, samples=3, bit_penalty=0.5, shard_index=1, shard_count=2,
                                   buckets={"qa": str(tmp_path / "qa.jsonl")})
    assert settings_from(build_parser().parse_args(["fit"])) == JobSettings()
