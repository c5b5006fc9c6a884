"""Table 4 from a calibration run's ``calibration_fit`` record in a store (a local directory)."""

import os
import time

import pytest

from evaluation.calibration_table import KIND_CALIBRATION_FIT, table4_markdown, table4_rows
from service.artifacts.base import canonical_json
from service.store.base import open_store


def _record(l2):
    row = {"centered_l2": l2, "attention_kl": 88.9, "top1": 72.9, "topk": 85.9, "cosine": 90.0,
           "configured_k_bits": 4.77, "effective_k_bits": 4.8125, "protected_layers": 3}
    return {"sums_samples": [0, 1], "policies": {"prefix/4": "policy-a", "dual/4": "policy-b"},
            "table4": {"prefix/4": row, "dual/4": {**row, "centered_l2": 94.9, "configured_k_bits": 4.6}}}


def test_rows_and_markdown_from_the_named_and_the_latest_run(tmp_path):
    store = open_store(str(tmp_path))
    first = store.put(KIND_CALIBRATION_FIT, canonical_json(_record(96.4)), "fit-1")
    rows = table4_rows(str(tmp_path), first)
    assert [(r["cache_mode"], r["bits"], r["policy_id"], r["L2"], r["configured_k_bits"]) for r in rows] == [
        ("dual", 4, "policy-b", 94.9, 4.6), ("prefix", 4, "policy-a", 96.4, 4.77)]
    md = table4_markdown(rows)
    # The policy's configured K bits, not the bits measured on calibration tokens (4.8125), and the caveat.
    assert "| Prefix | 4 | 96.4 | 88.9 | 72.9 | 85.9 | 90.0 | 4.770 | 3 |" in md and "`fit-1`" in md
    assert "4.81" not in md and "A tie is not a win" in md
    store.put(KIND_CALIBRATION_FIT, canonical_json(_record(50.0)), "fit-2")
    later = time.time() + 10  # make fit-2 the newest whatever the file system's time resolution
    os.utime(tmp_path / "artifacts" / KIND_CALIBRATION_FIT / "fit-2", (later, later))
    assert table4_rows(str(tmp_path), "latest")[1]["L2"] == 50.0


def test_errors_say_what_is_missing(tmp_path):
    with pytest.raises(ValueError, match="needs --store"):
        table4_rows(None, "latest")
    with pytest.raises(ValueError, match="no calibration run"):
        table4_rows(str(tmp_path), "latest")
