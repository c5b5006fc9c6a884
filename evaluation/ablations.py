"""The paper's ablations as tables from the matrix's cell files: Table 3 (K-policy controls) and K-only / V-only rows.

``python -m evaluation matrix --table 3`` plans `evaluation.matrix.plan_controls` and writes ``table3.md``,
``.csv`` and ``.json``: per model, bit width and cache mode the rows of the paper's Table 3 (paper "Task-level
K-policy controls"): cache only (the reference), KIVI K/V (no K high-precision rule), the fixed K rules
(`evaluation.controls`), and dLLM-KVQ's fitted per-layer policy, each with its task scores, nominal effective K
bits and token agreement with the cache-only row.

``python -m evaluation matrix --table kv`` plans `evaluation.matrix.plan_sides` and writes ``kv_ablation.*``: per
model and bit width, for each cache mode and method, the row quantizing K and V, K only and V only (the other
side held as it is, `KVQuantConfig.sides`), so the K-side focus of the method can be checked. With
``--from-calibration`` the dLLM-KVQ rows whose policy is that calibration run's carry its Table 4 win rates (the
paper's diagnostics compare K policies on attention behaviour; a V-only row leaves K exact, and KIVI's K is the
diagnostics' baseline, so neither has a win rate).

Rows are `evaluation.matrix.table_row` dicts, so both tables share the main matrix's numbers and cell files: the
KIVI and dLLM-KVQ rows of Table 3 are the main matrix's cells, found on disk when it ran first.
"""

from __future__ import annotations

import csv
import io
from typing import Any

from evaluation.controls import rule_label
from evaluation.matrix import (
    BITS_NOTE,
    CACHE_MODES,
    CONFIGURED_DIGITS,
    MODE_LABELS,
    Cell,
    _csv,
    _fmt,
    _pair,
    documents_line,
    documents_per_task,
    index_results,
    method_label,
    quant_methods,
    table_row,
)

SIDE_LABELS = {"kv": "K+V", "k": "K only", "v": "V only"}
#: Table 4's columns (`evaluation.calibration_table.COLUMNS`) shown on the K/V table's dLLM-KVQ rows.
DIAGNOSTICS = ("L2", "KL", "Top-1", "Top-K")


def _blocks(results: list[dict[str, Any]]) -> list[tuple[str, int, list[str]]]:
    """(model, bits, cache modes) in the paper's order: models as found, bits descending."""
    out = []
    for model in dict.fromkeys(r["model"] for r in results):
        cells = [Cell(**r["cell"]) for r in results if r["model"] == model]
        modes = [m for m in CACHE_MODES if any(c.cache_mode == m for c in cells)]
        for bits in sorted({c.bits for c in cells if c.bits is not None}, reverse=True):
            out.append((model, bits, modes))
    return out


def build_controls(results: list[dict[str, Any]], tasks: list[str], rules: list[str]) -> dict[str, Any]:
    """Table 3 as data: per (model, bits) block, per cache mode, the rows in the paper's order; each row adds
    ``k_rule`` (the paper's "K high-precision rule" column)."""
    by_cell = index_results(results)
    blocks = []
    for model, bits, modes in _blocks(results):
        rows = []
        for mode in modes:
            cache_only = Cell(model, mode, "none")
            planned = [(cache_only, "No quantization"), (Cell(model, mode, "kivi", bits), "None; all low-bit"),
                       *((Cell(model, mode, "dllm_kvq", bits, rule=r), rule_label(r)) for r in rules),
                       (Cell(model, mode, "dllm_kvq", bits), "Selected per layer")]
            for cell, k_rule in planned:
                if (model, cell.key) in by_cell:
                    row = table_row(by_cell, tasks, model, cell, None if cell is cache_only else cache_only)
                    label = "KIVI K/V" if cell.method == "kivi" else row["label"]
                    rows.append({**row, "label": label, "k_rule": k_rule})
        blocks.append({"model": model, "bits": bits, "rows": rows})
    return {"tasks": tasks, "blocks": blocks, "documents": documents_per_task(results)}


def build_sides(results: list[dict[str, Any]], tasks: list[str],
                table4: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The K/V ablation as data: per (model, bits) block, per mode, cache only then per method K+V, K only, V only;
    dLLM-KVQ rows with K quantized carry ``diagnostics`` (Table 4 columns) when ``table4`` (rows of
    `evaluation.calibration_table.table4_rows`) holds their policy."""
    by_cell = index_results(results)
    diagnostics = {r["policy_id"]: {c: r[c] for c in DIAGNOSTICS} for r in table4 or [] if r.get("policy_id")}
    blocks = []
    for model, bits, modes in _blocks(results):
        rows = []
        for mode in modes:
            cache_only = Cell(model, mode, "none")
            if (model, cache_only.key) in by_cell:
                rows.append(table_row(by_cell, tasks, model, cache_only, None))
            for method in quant_methods():
                for sides in SIDE_LABELS:
                    cell = Cell(model, mode, method, bits, sides=sides)
                    if (model, cell.key) in by_cell:
                        row = table_row(by_cell, tasks, model, cell, cache_only)
                        found = diagnostics.get(row["artifact_id"]) if sides != "v" else None
                        rows.append({**row, "diagnostics": found})
        blocks.append({"model": model, "bits": bits, "rows": rows})
    return {"tasks": tasks, "blocks": blocks, "documents": documents_per_task(results)}


def _head_lines(head: list[str]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + "|"]


def render_controls_markdown(tables: dict[str, Any], skipped: list[dict] | None = None) -> str:
    """Table 3 in the paper's layout (Method | K high-precision rule | scores), one table per model and bits."""
    tasks = tables["tasks"]
    head = ["Method", "K high-precision rule", *tasks, "Avg.", "K bits configured", "K bits measured (nominal)",
            "Token agr. %"]
    lines = []
    for block in tables["blocks"]:
        lines += [f"### {block['model']} — K-policy controls (Table 3), {block['bits']}-bit K/V", "",
                  *_head_lines(head)]
        mode = None
        for r in block["rows"]:
            if r["cache_mode"] != mode:
                mode = r["cache_mode"]
                lines.append(f"| *{MODE_LABELS[mode]}* |" + " |" * (len(head) - 1))
            agr, conf = r["agreement"], r.get("configured_bits") or {}
            lines.append("| " + " | ".join([
                r["label"], r["k_rule"], *(_fmt(r["scores"][t]) for t in tasks), _fmt(r["average"]),
                _fmt(conf.get("k"), CONFIGURED_DIGITS) if r["kv"] else "16 (unquantized)",
                _fmt(r["kv"]["k_nominal_bits"]) if r["kv"] else "16 (unquantized)",
                _fmt(agr["token_agreement"], 1) if agr else "—"]) + " |")
        lines += ["", "K/V quantization is active in every row but the cache-only one; V is quantized the same way "
                  "in all of them. Fixed rules keep the same p K tokens per group of 32 at 16 bits on every layer; "
                  "token agreement is with the cache-only row of the same mode. " + BITS_NOTE + " "
                  + documents_line(tables.get("documents", {})), ""]
    if skipped:
        lines += ["Skipped cells:", ""] + [f"- {s['model']} {s['cell']}: {s['reason']}" for s in skipped] + [""]
    return "\n".join(lines)


def render_sides_markdown(tables: dict[str, Any], skipped: list[dict] | None = None) -> str:
    """The K/V ablation: one table per model and bits; rows per mode and method, K+V / K only / V only."""
    tasks = tables["tasks"]
    head = ["Method", "Quantized", *tasks, "Avg.", "K/V bits configured", "K/V bits measured (nominal)",
            "Exact match %", "Token agr. %", *DIAGNOSTICS]
    lines = []
    for block in tables["blocks"]:
        lines += [f"### {block['model']} — K-only and V-only quantization, {block['bits']}-bit", "",
                  *_head_lines(head)]
        mode = None
        for r in block["rows"]:
            if r["cache_mode"] != mode:
                mode = r["cache_mode"]
                lines.append(f"| *{MODE_LABELS[mode]}* |" + " |" * (len(head) - 1))
            kv, agr, diag, conf = r["kv"] or {}, r["agreement"], r.get("diagnostics"), r.get("configured_bits") or {}
            lines.append("| " + " | ".join([
                method_label(r["method"]), "—" if r["method"] == "none" else SIDE_LABELS[r["sides"]],
                *(_fmt(r["scores"][t]) for t in tasks), _fmt(r["average"]),
                _pair(conf.get("k"), conf.get("v"), CONFIGURED_DIGITS),
                _pair(kv.get("k_nominal_bits"), kv.get("v_nominal_bits")),
                _fmt(agr["exact_match"], 1) if agr else "—", _fmt(agr["token_agreement"], 1) if agr else "—",
                *((_fmt(diag[c], 1) if diag else "—") for c in DIAGNOSTICS)]) + " |")
        lines += ["", "The side not quantized is held as it is (16 nominal bits). Exact match and token agreement: "
                  "against the cache-only row of the same mode. L2 / KL / Top-1 / Top-K: Table 4 win rates (%) of "
                  "the row's dLLM-KVQ policy over quantizing every K token, from the calibration run "
                  "(`--from-calibration`); they judge K only, so V-only and KIVI rows have none. " + BITS_NOTE + " "
                  + documents_line(tables.get("documents", {})), ""]
    if skipped:
        lines += ["Skipped cells:", ""] + [f"- {s['model']} {s['cell']}: {s['reason']}" for s in skipped] + [""]
    return "\n".join(lines)


def render_rows_csv(tables: dict[str, Any]) -> str:
    """CSV of either table, one line per (model, bits block, row)."""
    tasks = tables["tasks"]
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["model", "block_bits", "cache_mode", "method", "bits", "sides", "k_rule", "artifact_id", *tasks,
                     "average", "k_configured_bits", "v_configured_bits", "k_nominal_bits", "v_nominal_bits",
                     "exact_match", "token_agreement", *DIAGNOSTICS])
    for block in tables["blocks"]:
        for r in block["rows"]:
            kv, agr, diag = r["kv"] or {}, r["agreement"] or {}, r.get("diagnostics") or {}
            conf = r.get("configured_bits") or {}
            writer.writerow([block["model"], block["bits"], r["cache_mode"], r["method"], r["bits"] or "",
                             r["sides"], r.get("k_rule", ""), r["artifact_id"] or "",
                             *(_csv(r["scores"][t]) for t in tasks), _csv(r["average"]),
                             _csv(conf.get("k")), _csv(conf.get("v")), _csv(kv.get("k_nominal_bits")), _csv(kv.get("v_nominal_bits")),
                             _csv(agr.get("exact_match")), _csv(agr.get("token_agreement")),
                             *(_csv(diag.get(c)) for c in DIAGNOSTICS)])
    return buf.getvalue()
