"""One default store for every command: the server, calibration, evaluation and policies all use
``DLLM_STORE_URL`` when set, else ``.dllm-kvq/store``, and each ``--help`` names it."""

from __future__ import annotations

import json

import pytest

from service.config import DEFAULT_STORE_URL, Settings, default_store
from service.store.base import KIND_EVAL_SCORES, open_store
from tests.evaluation.test_scores import _lm_eval_results


def test_the_server_and_the_offline_commands_share_the_default(monkeypatch):
    monkeypatch.delenv("DLLM_STORE_URL", raising=False)
    monkeypatch.delenv("DLLM_STORE_PREFIX", raising=False)
    assert Settings().store_url == DEFAULT_STORE_URL == default_store()[0] == ".dllm-kvq/store"
    monkeypatch.setenv("DLLM_STORE_URL", "redis://127.0.0.1:6379/3")
    monkeypatch.setenv("DLLM_STORE_PREFIX", "other")
    assert default_store() == ("redis://127.0.0.1:6379/3", "other") == (Settings().store_url, Settings().store_prefix)
    assert default_store("dir", "p") == ("dir", "p")


def test_every_command_help_names_the_default(capsys):
    from calibration.cli import build_parser as calibration_parser
    from evaluation.cli import matrix_parser
    from service.__main__ import build_parser as service_parser

    helps = [calibration_parser()._subparsers._group_actions[0].choices["all"].format_help(),
             matrix_parser().format_help()]
    for argv in (["policies", "export", "--help"], ["serve", "--help"]):
        with pytest.raises(SystemExit):
            service_parser().parse_args(argv)
        helps.append(capsys.readouterr().out)
    for text in helps:
        assert DEFAULT_STORE_URL in " ".join(text.split()), text


def test_push_scores_without_store_writes_to_the_default(tmp_path, monkeypatch):
    from evaluation.cli import main

    monkeypatch.delenv("DLLM_STORE_URL", raising=False)
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "results.json"
    path.write_text(json.dumps(_lm_eval_results("dllm-kvq", {"cache_mode": "dual"}, {})))
    assert main(["push-scores", str(path)]) == 0
    assert len(open_store(str(tmp_path / DEFAULT_STORE_URL)).list(KIND_EVAL_SCORES)) == 1


def test_calibration_summary_says_where_it_stored(tmp_path, capsys):
    from calibration.cli import print_summary
    from calibration.job import RunSummary

    print_summary(RunSummary(fitted={"dllm_kvq": {"dual/2": "policy-aa"}}), 1.0, store=open_store(str(tmp_path)).location)
    assert f"stored in {tmp_path.resolve()}" in capsys.readouterr().out
