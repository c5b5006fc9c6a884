"""Matrix planning, agreement columns and the paper-layout tables from cell results (values by hand)."""

import csv
import io
import json

import pytest

from evaluation.matrix import (
    Cell,
    build_tables,
    plan_cells,
    primary_metric,
    render_csv,
    render_markdown,
    write_outputs,
)


def test_plan_has_reference_cache_only_and_quantized_rows_in_order():
    cells = plan_cells(["m"], ["prefix", "dual"], [4, 2], ["none", "kivi", "dllm_kvq"])
    assert [c.key for c in cells] == [
        "none", "prefix-none", "prefix-kivi-4", "prefix-dllm_kvq-4", "prefix-kivi-2", "prefix-dllm_kvq-2",
        "dual-none", "dual-kivi-4", "dual-dllm_kvq-4", "dual-kivi-2", "dual-dllm_kvq-2"]
    # The cache-only row is planned even when "none" is not asked for: it is the agreement reference.
    assert [c.key for c in plan_cells(["m"], ["dual"], [4], ["kivi"])] == ["none", "dual-none", "dual-kivi-4"]


@pytest.mark.parametrize(("bad", "match"), [({"cache_modes": ["none"]}, "legal: prefix, dual"),
                                            ({"methods": ["gptq"]}, "legal: none, kivi, kvquant, dllm_kvq")])
def test_plan_rejects_unknown_names(bad, match):
    args = {"models": ["m"], "cache_modes": ["dual"], "bits": [4], "methods": ["kivi"]} | bad
    with pytest.raises(ValueError, match=match):
        plan_cells(**args)


def test_primary_metric():
    assert primary_metric("gsm8k_local", {"exact_match,strict-match": 0.1, "exact_match,flexible-extract": 0.2}) \
        == "exact_match,flexible-extract"
    assert primary_metric("digit_ledger", {"sample_len": 4, "exact_match,none": 0.5,
                                           "exact_match_stderr,none": 0.1}) == "exact_match,none"
    with pytest.raises(KeyError, match="no score"):
        primary_metric("t", {"x_stderr,none": 0.1})


def _result(cell, task, score, records, kv=None, configured=None):
    return {"model": cell.model, "fingerprint": "f", "cell": {"model": cell.model, "cache_mode": cell.cache_mode,
                                                              "method": cell.method, "bits": cell.bits},
            "task": task, "metric": "exact_match,none", "score": score, "metrics": {}, "config": {},
            "artifact_id": None, "settings": {}, "kv": kv, "configured_bits": configured, "seconds": 1.0,
            "records": [{"doc_id": i, "ids": ids, "text": text, "nfe": 3} for i, (ids, text) in enumerate(records)]}


@pytest.fixture
def results():
    ref, only, kivi = Cell("m", "none", "none"), Cell("m", "prefix", "none"), Cell("m", "prefix", "kivi", 4)
    kv = {"k_nominal_bits": 4.0, "v_nominal_bits": 4.0, "k_storage_bits": 5.0, "v_storage_bits": 5.5,
          "bytes_held": 100}
    return [
        _result(ref, "a", 50.0, [([1, 2, 3], "x"), ([4, 5], "y")]),
        _result(ref, "b", 100.0, [([7], "z")]),
        _result(only, "a", 50.0, [([1, 2, 3], "x"), ([4, 6], "w")]),
        _result(only, "b", 100.0, [([7], "z")]),
        _result(kivi, "a", 0.0, [([1, 2, 9, 9], "q"), ([4, 6], "w")], kv, {"k": 4.0, "v": 4.0}),
        _result(kivi, "b", 100.0, [([7], "z")], kv, {"k": 4.0, "v": 4.0}),
    ]


def test_tables_scores_average_and_agreement_by_hand(results):
    tables = build_tables(results, ["a", "b"])
    (block,) = tables["blocks"]
    assert block["bits"] == 4
    ref, only, kivi = block["rows"]
    assert (ref["label"], only["label"], kivi["label"]) == ("No cache (full recompute)", "Cache only", "KIVI")
    assert ref["average"] == 75.0 and kivi["scores"] == {"a": 0.0, "b": 100.0} and kivi["average"] == 50.0
    assert ref["agreement"] is None
    # cache-only vs no-cache: texts x=x, w!=y, z=z -> 2/3; tokens 3/3, 1/2, 1/1 -> (1 + .5 + 1) / 3
    assert only["agreement"]["exact_match"] == pytest.approx(200 / 3)
    assert only["agreement"]["token_agreement"] == pytest.approx(100 * 2.5 / 3)
    # KIVI vs cache-only of the same mode: q!=x, w=w, z=z -> 2/3; tokens 2/4, 2/2, 1/1
    assert kivi["agreement"]["reference"] == "Cache only"
    assert kivi["agreement"]["exact_match"] == pytest.approx(200 / 3)
    assert kivi["agreement"]["token_agreement"] == pytest.approx(100 * 2.5 / 3)
    assert kivi["kv"]["k_storage_bits"] == 5.0


def test_markdown_and_csv_layout(results):
    tables = build_tables(results, ["a", "b"])
    md = render_markdown(tables, [{"model": "m", "cell": "prefix-dllm_kvq-4", "reason": "no policy table"}])
    lines = [line for line in md.splitlines() if line.startswith("| ")]
    assert lines[0].startswith("| Method | a | b | Avg. |")
    assert lines[1].startswith("| No cache (full recompute) | 50.00 | 100.00 | 75.00 | — | — | — | — | — |")
    assert lines[2].startswith("| *Prefix cache* |")
    # Configured, then measured nominal and storage K / V bits.
    assert lines[4] == ("| KIVI (4-bit) | 0.00 | 100.00 | 50.00 | 4.000 / 4.000 | 4.00 / 4.00 | 5.00 / 5.50 | 66.7 "
                        "| 83.3 |")
    assert "- m prefix-dllm_kvq-4: no policy table" in md
    rows = list(csv.DictReader(io.StringIO(render_csv(tables))))
    assert [(r["cache_mode"], r["method"]) for r in rows] == [("none", "none"), ("prefix", "none"), ("prefix", "kivi")]
    assert rows[2]["average"] == "50.0000" and rows[2]["exact_match"] == "66.6667"


def test_write_outputs_reads_cell_files(tmp_path, results):
    for r in results:
        path = tmp_path / "cells" / r["model"] / "f" / Cell(**r["cell"]).key / f"{r['task']}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(r))
    paths = write_outputs(tmp_path, ["a", "b"])
    data = json.loads(paths["json"].read_text())
    assert data["blocks"][0]["rows"][2]["average"] == 50.0
    assert "KIVI (4-bit)" in paths["md"].read_text()
    # Cells of other weights (a retrained model of the same name) are left out when fingerprints are given.
    assert write_outputs(tmp_path, ["a", "b"], fingerprints=["other"]) and \
        json.loads(paths["json"].read_text())["blocks"] == []


def test_key_bias_rows_are_planned_keyed_labelled_and_tabled_after_their_twin(results):
    from dataclasses import asdict

    from evaluation.matrix import with_key_bias

    cells = plan_cells(["m"], ["dual"], [2], ["none", "kivi"])
    assert [c.key for c in with_key_bias(cells, "off")] == ["none", "dual-none", "dual-kivi-2"]
    assert [c.key for c in with_key_bias(cells, "both")] == ["none", "dual-none", "dual-kivi-2", "dual-kivi-2-kbc"]
    assert [c.key for c in with_key_bias(cells, "on")] == ["none", "dual-none", "dual-kivi-2-kbc"]
    v_only = Cell("m", "dual", "kivi", 2, sides="v")
    assert with_key_bias([v_only], "on") == [v_only]  # nothing to correct: its keys are held as they are
    with pytest.raises(ValueError, match="legal: off, on, both"):
        with_key_bias(cells, "yes")
    corrected = Cell("m", "prefix", "kivi", 4, key_bias_correction=True)
    assert corrected.label == "KIVI + key-bias corr."
    twin = _result(corrected, "a", 50.0, [([1, 2, 3], "x"), ([4, 6], "w")])
    twin["cell"] = asdict(corrected)
    block = build_tables([*results, twin], ["a"])["blocks"][0]
    assert [r["label"] for r in block["rows"]] == ["No cache (full recompute)", "Cache only", "KIVI",
                                                   "KIVI + key-bias corr."]
    assert block["rows"][-1]["key_bias_correction"] is True and block["rows"][-1]["agreement"]["exact_match"] == 100.0
