"""scripts/validate_embedded.py on the shipped model: the report's fields and the reveal-confidence hook."""

import importlib.util

from tests.support.paths import REPO

SCRIPT = REPO / "scripts/validate_embedded.py"


def test_measure_reports_every_mode_and_counts_each_reveal_once():
    spec = importlib.util.spec_from_file_location("validate_embedded", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    res = module.measure(None, "validation", limit=2, modes=("none", "dual"))
    assert res["questions"] == 2 and set(res["modes"]) == {"none", "dual"}
    none = res["modes"]["none"]
    assert none["token_agreement_with_none"] == 1.0
    assert 0.0 <= none["revealed_confident_share"] <= 1.0
    # the hook sees every reveal once: all positions up to the end of turn, and at most the whole response
    assert 0 < none["generated_tokens"] <= none["revealed_tokens"] <= 2 * 64
    assert none["mean_nfe"] >= 2
    assert 0.0 <= res["modes"]["dual"]["exact_match"] <= 1.0
