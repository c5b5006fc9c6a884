"""Per-layer policy tables (paper appendix: "the selected per-layer policies for each reported model, cache mode
and bit-width"): one row per layer with the score type, p, nominal K bits and the win rates of its choice.

The fit (`calibration.job.CalibrationJob.fit`) stores, per policy and layer, what `layer_record` returns; the
calibration report and the evaluation matrix print it with `per_layer_markdown`, so a run's exact configuration can
be read (and, with the table's id or JSON, served again).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from calibration.fit import CandidateSums
from calibration.metrics import METRICS
from service.artifacts.policy import PolicyTable, nominal_k_bits


def layer_record(cell: CandidateSums, p: int) -> dict[str, Any]:
    """What the fit record keeps of a layer's chosen candidate: its nominal K bits averaged over the calibration
    records' reused tokens, and its win rate (%) per metric over quantizing every K token (None for ``p = 0``: the
    baseline itself)."""
    return {"effective_k_bits": cell.mean_bits,
            "win_rates": {m: 100.0 * cell.win_rate(m) for m in METRICS} if p else None,
            "records": cell.records}


def per_layer_markdown(title: str, table: PolicyTable, layers: Sequence[Mapping[str, Any]] | None = None
                       ) -> list[str]:
    """Markdown lines: a heading and one row per layer (score type, p, full-group nominal K bits ``(b (G - p) +
    16 p) / G``, and with the fit record's ``layers`` the calibration's effective K bits and win rates)."""
    fitted = {int(entry["layer"]): entry for entry in layers or []}
    lines = [f"#### {title}", "",
             (f"Policy `{table.id}` ({table.cache_mode} cache, {table.bits}-bit, K groups of {table.k_group_size}, "
             f"cap {table.k_bit_cap:g} K bits); {table.provenance.data.split(' (')[0]}"), "",
             "| Layer | Score type | p | Nominal K bits | Eff. K bits (calibration) | "
             + " | ".join(f"Win {m} %" for m in METRICS) + " |",
             "|---:|---|---:|---:|---:|" + "---:|" * len(METRICS)]
    for i, choice in enumerate(table.layers):
        entry = fitted.get(i, {})
        rates = entry.get("win_rates")
        eff = entry.get("effective_k_bits")
        lines.append(f"| {i} | {choice.score_type if choice.p else '— (all low-bit)'} | {choice.p} | "
                     f"{nominal_k_bits(table.bits, table.k_group_size, choice.p):.3f} | "
                     f"{'—' if eff is None else f'{eff:.3f}'} | "
                     + " | ".join("—" if not rates else f"{rates[m]:.1f}" for m in METRICS) + " |")
    return lines + [""]
