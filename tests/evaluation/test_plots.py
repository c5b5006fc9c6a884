"""The trade-off plot from the matrix (points, file, link in matrix.md) and the serve_load plot."""

from __future__ import annotations

import json

import pytest

from evaluation.matrix import Cell, build_tables, write_outputs
from evaluation.plots import TRADEOFF_PNG, plot_serve_load, plot_tradeoff, tradeoff_points


def _result(cell: Cell, score: float, kv: dict | None) -> dict:
    return {"model": cell.model, "fingerprint": "f", "cell": {"model": cell.model, "cache_mode": cell.cache_mode,
                                                              "method": cell.method, "bits": cell.bits},
            "task": "t", "metric": "exact_match,none", "score": score, "metrics": {}, "config": {},
            "artifact_id": None, "settings": {}, "kv": kv, "seconds": 1.0,
            "records": [{"doc_id": 0, "ids": [1], "text": "x", "nfe": 1}]}


def _kv(bits: float, held: int) -> dict:
    return {"k_nominal_bits": bits, "v_nominal_bits": bits, "k_storage_bits": bits + 2, "v_storage_bits": bits + 2,
            "bytes_held": held, "bf16_bytes": 4096}


@pytest.fixture
def results():
    return [
        _result(Cell("m", "none", "none"), 100.0, None),
        _result(Cell("m", "dual", "none"), 100.0, None),
        _result(Cell("m", "dual", "kivi", 4), 90.0, _kv(4.0, 1536)),
        _result(Cell("m", "dual", "kivi", 2), 50.0, _kv(2.0, 1024)),
        _result(Cell("m", "dual", "kvquant", 2), 75.0, _kv(2.25, 900)),
    ]


def test_points_one_per_method_and_width_with_the_cache_only_reference(results):
    points = tradeoff_points(build_tables(results, ["t"]))
    by = {(p["method"], p["bits"]): p for p in points}
    assert set(by) == {("kivi", 4), ("kivi", 2), ("kvquant", 2), ("none", 16)}
    assert by["kivi", 2] == {"mode": "dual", "method": "kivi", "bits": 2, "accuracy": 50.0, "kib": 1.0,
                             "bits_nominal": 2.0, "bits_storage": 4.0}
    # The cache-only row: its K/V in bf16 (the quantized rows' bf16 size), 16 bits, its score.
    assert by["none", 16]["kib"] == 4.0 and by["none", 16]["accuracy"] == 100.0


def test_matrix_writes_and_links_the_plot(tmp_path, results):
    for r in results:
        path = tmp_path / "cells" / "m" / "f" / Cell(**r["cell"]).key / "t.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(r))
    paths = write_outputs(tmp_path, ["t"])
    png = tmp_path / TRADEOFF_PNG
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert f"![Accuracy against KV memory]({TRADEOFF_PNG})" in paths["md"].read_text()


def test_no_quantized_row_no_plot(tmp_path, results):
    assert plot_tradeoff(build_tables(results[:2], ["t"]), tmp_path / "x.png") is None
    assert not (tmp_path / "x.png").exists()


def test_serve_load_plot(tmp_path):
    rows = [{"clients": c, "req_per_s": 1.0 + c / 8, "tok_per_s": 50.0 + c, "p50_s": 0.1 * (c + 1),
             "p90_s": 0.2 * (c + 1), "p99_s": 0.3 * (c + 1), "mean_batch": max(1, c)} for c in (0, 1, 4, 8, 16)]
    path = plot_serve_load(rows, tmp_path / "new" / "load.png", "title")  # its folder is made
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 20_000


def test_method_colours_and_labels_come_from_the_registry():
    """No method is named in the plot module: the built-in ones keep their colours by registration order, and a
    method registered later gets its own colour and its plug-in's label."""
    from evaluation.plots import method_styles
    from service.quant.base import KVQuantizer
    from service.quant.registry import QuantMethod, register, unregister

    assert method_styles() == {"kivi": ("tab:blue", "KIVI"), "kvquant": ("tab:orange", "KVQuant"),
                               "dllm_kvq": ("tab:green", "dLLM-KVQ")}
    register(QuantMethod("mine", quantizer=KVQuantizer, label="Mine"))
    try:
        assert method_styles()["mine"] == ("tab:red", "Mine")
    finally:
        unregister("mine")
