"""``python -m evaluation matrix --table 3`` and ``--table kv`` on the embedded model (4-question slice), and the
one-line errors of the evaluation CLI."""

from __future__ import annotations

import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from evaluation.cli import main
from service.artifacts.base import Provenance
from service.artifacts.policy import LayerPolicy, PolicyTable
from service.commands import prog
from service.engine import Engine
from service.store.base import KIND_POLICY, open_store

pytestmark = pytest.mark.slow


def _args(out, store, *extra):
    return ["matrix", "--models", "embedded", "--tasks", "digit_ledger", "--limit", "4", "--cache-modes", "dual",
            "--bits", "2", "--batch-size", "4", "--threads", "1", "--out", str(out), "--store", str(store), *extra]


@pytest.mark.integration  # lm-eval's evaluate reports its environment: torch's collect_env runs pip as a process
def test_table3_and_kv_ablation_commands(tmp_path, capsys):
    spec = Engine.load(None, threads=1).spec
    fitted = PolicyTable(model_id="embedded", weights_fingerprint=spec.fingerprint, cache_mode="dual", bits=2,
                         k_bit_cap=2.9, layers=[LayerPolicy(score_type="qerror", p=1)] * spec.num_layers,
                         provenance=Provenance(data="test", code="test"))
    store = tmp_path / "store"
    open_store(str(store)).put_model(KIND_POLICY, fitted)
    out = tmp_path / "matrix"
    assert main(_args(out, store, "--table", "3", "--rules", "attention:2")) == 0
    md = (out / "table3.md").read_text()
    assert "| KIVI K/V | None; all low-bit |" in md and "| Fixed K rule | Attention, p = 2 |" in md
    assert "| dLLM-KVQ | Selected per layer |" in md and "the same 4 documents of digit_ledger" in md
    data = json.loads((out / "table3.json").read_text())
    assert data["policies"][fitted.id]["layers"][0] == {"score_type": "qerror", "p": 1}
    assert "### Per-layer dLLM-KVQ policies" in md and f"Policy `{fitted.id}`" in md
    capsys.readouterr()
    assert main(_args(out, store, "--table", "kv", "--methods", "kivi")) == 0
    printed = capsys.readouterr().out
    assert "ran 2 (cell, task) runs" in printed  # K only and V only; the rest is Table 3's cells, reused
    rows = {(r["method"], r["sides"]): r for r in json.loads((out / "kv_ablation.json").read_text())["blocks"][0]["rows"]}
    assert rows[("kivi", "k")]["kv"]["v_nominal_bits"] == 16.0 and rows[("kivi", "v")]["kv"]["k_nominal_bits"] == 16.0
    assert "| KIVI | K only |" in (out / "kv_ablation.md").read_text()


def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_matrix_inputs_are_checked_before_any_work(tmp_path, capsys):
    store = tmp_path / "empty-store"
    store.mkdir()
    err = _one_line_error(capsys, _args(tmp_path / "m", store, "--from-calibration", "latest"))
    assert "--from-calibration latest" in err and str(store) in err and f"{prog('calibration', 'all')} --store {store}" in err
    err = _one_line_error(capsys, _args(tmp_path / "m", store, "--from-calibration", "fit-nope"))
    assert "fit-nope" in err and str(store) in err
    assert "--bits 3" in _one_line_error(capsys, _args(tmp_path / "m", store)[:-2] + ["--bits", "3"])
    assert "--rules" in _one_line_error(capsys, _args(tmp_path / "m", store, "--table", "3", "--rules", "x:1"))
    assert "--card" in _one_line_error(capsys, _args(tmp_path / "m", store, "--card", str(tmp_path / "no")))
    assert not (tmp_path / "m" / "cells").exists()


@pytest.mark.integration  # lm-eval's evaluate reports its environment: torch's collect_env runs pip as a process
def test_a_card_is_written_only_with_every_row_and_the_same_results_write_the_same_card(tmp_path, capsys,
                                                                                       monkeypatch):
    """--card refuses a table with a row it cannot run (no fitted policy in the store): one line, exit 2, no cell
    run, the card untouched. A card written twice from the same results (fresh cell files, other timings) is the
    same bytes: nothing in it depends on how long the run took."""
    card = tmp_path / "card"
    card.mkdir()
    (card / "README.md").write_text("# card\n")
    empty = tmp_path / "empty-store"
    empty.mkdir()
    err = _one_line_error(capsys, _args(tmp_path / "m", empty, "--table", "3", "--rules", "attention:1",
                                        "--card", str(card)))
    assert err.startswith(f"{prog('evaluation', 'matrix')}: error: --card {card}: the table would lack rows (embedded: "
                          "dual-dllm_kvq-2: no policy table for (dual, 2-bit) in the store)")
    assert err.endswith("no cell ran and the card was not written")
    assert sorted(p.name for p in card.iterdir()) == ["README.md"] and (card / "README.md").read_text() == "# card\n"
    assert not (tmp_path / "m" / "cells").exists()
    written = []
    for _ in range(2):  # the main table's KIVI rows need no artifact; each run computes its cells afresh
        shutil.rmtree(tmp_path / "m", ignore_errors=True)
        assert main(_args(tmp_path / "m", empty, "--methods", "kivi", "--card", str(card))) == 0
        written.append({p.name: p.read_bytes() for p in card.iterdir()})
    assert written[0] == written[1] and b"KIVI (2-bit)" in written[0]["README.md"]
    assert b"wall" not in written[0]["README.md"] + written[0]["quantization.json"]


def test_an_unreachable_server_is_named_before_any_work(tmp_path, capsys, monkeypatch):
    from tests.support.processes import free_port

    monkeypatch.setenv("DLLM_ADMIN_KEY", "x" * 20)
    url = f"http://127.0.0.1:{free_port()}"
    store = tmp_path / "store"
    store.mkdir()
    err = _one_line_error(capsys, _args(tmp_path / "m", store, "--server", url))
    assert err.startswith(f"{prog('evaluation', 'matrix')}: error: --server {url}: cannot reach it (")
    assert not (tmp_path / "m" / "cells").exists()


class _Refuse(BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.dumps({"error": {"message": "invalid admin key", "type": "permission_error", "param": None,
                                     "code": "forbidden"}}).encode()
        self.send_response(403)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_push_scores_errors_are_one_line_and_name_the_flag(tmp_path, capsys, monkeypatch):
    http_run = tmp_path / "results.json"  # what lm-eval writes for a run over HTTP: no configuration recorded
    http_run.write_text(json.dumps({"config": {"model": "local-completions"},
                                    "results": {"digit_ledger": {"exact_match,none": 0.5}}}))
    monkeypatch.delenv("DLLM_ADMIN_KEY", raising=False)
    err = _one_line_error(capsys, ["push-scores", str(http_run), "--server", "http://127.0.0.1:9"])
    assert "DLLM_ADMIN_KEY" in err and "--admin-key-env" in err
    monkeypatch.setenv("DLLM_ADMIN_KEY", "wrong")
    err = _one_line_error(capsys, ["push-scores", str(http_run), "--server", "http://127.0.0.1:9"])
    assert "--cache-mode" in err and "--kv-quant" in err
    server = HTTPServer(("127.0.0.1", 0), _Refuse)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        err = _one_line_error(capsys, ["push-scores", str(http_run), "--server", f"http://127.0.0.1:{server.server_port}",
                                       "--cache-mode", "dual", "--kv-quant", '{"method": "none"}'])
    finally:
        server.shutdown()
    assert "403" in err and "invalid admin key" in err and "--admin-key-env" in err
