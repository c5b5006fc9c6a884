"""The fixed 32-question slice the end-to-end test checks is measured, machine-readable, and on the card."""

from __future__ import annotations

import json
import sys

from evaluation.embedded_task import load_split
from tests.support.paths import REPO

ROOT = REPO
EMBEDDED = ROOT / "service" / "assets" / "embedded"


def test_slice_figures_follow_from_the_per_question_outcomes_and_reach_the_card():
    sys.path.insert(0, str(ROOT / "scripts"))
    from embedded_card import card, pct
    from validate_embedded import SLICE

    meas = json.loads((EMBEDDED / "measurements.json").read_text())
    fixed = meas["slice"]
    assert fixed["questions"] == SLICE == 32 and fixed["split"] == "test"
    assert fixed["ids"] == [q.id for q in load_split("test")[:SLICE]]
    for mode, m in meas["modes"].items():
        assert len(m["correct"]) == meas["questions"]
        assert sum(m["correct"]) / len(m["correct"]) == m["exact_match"]
        assert fixed["exact_match"][mode] == sum(m["correct"][:SLICE]) / SLICE
    text = card(EMBEDDED, "note")
    assert all(f"{mode} {pct(em)}" in text for mode, em in fixed["exact_match"].items())
