"""``python -m evaluation matrix`` end to end on the embedded model's own task (a 2-document slice)."""

from __future__ import annotations

import csv
import json

import pytest

from evaluation.calibration_table import KIND_CALIBRATION_FIT
from evaluation.cli import main
from service.artifacts.base import canonical_json
from service.store.base import KIND_EVAL_SCORES, open_store

pytestmark = pytest.mark.slow


@pytest.mark.integration  # lm-eval's evaluate reports its environment: torch's collect_env runs pip as a process
def test_matrix_command_writes_tables_table4_and_scores(tmp_path, capsys):
    store_dir = tmp_path / "store"
    row = {"centered_l2": 96.4, "attention_kl": 88.9, "top1": 72.9, "topk": 85.9, "cosine": 90.0,
           "configured_k_bits": 4.77, "protected_layers": 2}
    open_store(str(store_dir)).put(KIND_CALIBRATION_FIT, canonical_json({"policies": {}, "table4": {"dual/4": row}}),
                                   "fit-1")
    out = tmp_path / "matrix"
    argv = ["matrix", "--models", "embedded", "--tasks", "digit_ledger", "--limit", "2", "--cache-modes", "dual",
            "--bits", "4", "--methods", "none,kivi", "--batch-size", "2", "--threads", "1", "--out", str(out),
            "--store", str(store_dir), "--from-calibration", "latest"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "ran 3 (cell, task) runs" in printed
    md = (out / "matrix.md").read_text()
    assert "| KIVI (4-bit) |" in md and "| Dual | 4 | 96.4 | 88.9 | 72.9 | 85.9 | 90.0 | 4.770 | 2 |" in md
    assert "A tie is not a win" in md
    rows = list(csv.DictReader((out / "matrix.csv").open()))
    assert [(r["cache_mode"], r["method"]) for r in rows] == [("none", "none"), ("dual", "none"), ("dual", "kivi")]
    assert float(rows[2]["k_nominal_bits"]) == 4.0 and rows[2]["agreement_reference"] == "Cache only"
    data = json.loads((out / "matrix.json").read_text())
    assert data["table4"][0]["L2"] == 96.4 and len(data["run"]["ran"]) == 3
    # Each finished score went into the store (no server given).
    assert len(open_store(str(store_dir)).list(KIND_EVAL_SCORES)) == 3
    # A second run resumes: nothing left to do.
    assert main(argv) == 0
    assert "ran 0 (cell, task) runs" in capsys.readouterr().out
