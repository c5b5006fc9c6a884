"""Per-layer policy tables (paper appendix: "the selected per-layer policies for each reported model, cache mode
and bit-width"): one row per layer with the score type, p, nominal K bits and the win rates of its choice.

The fit (`calibration.dllm_kvq_fit.fit_tables`) stores, per policy and layer, what `layer_record` returns; the
calibration report and the evaluation matrix print it with `per_layer_markdown`, so a run's exact configuration can
be read (and, with the table's id or JSON, served again).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from calibration.fit import CandidateSums
from calibration.metrics import METRICS
from service.artifacts.policy import PolicyTable, nominal_k_bits
from service.quant.accounting import policy_k_bits


def layer_record(cell: CandidateSums, p: int) -> dict[str, Any]:
    """What the fit record keeps of a layer's chosen candidate: its nominal K bits averaged over the calibration
    records' reused tokens, and its win rate (%) per metric over quantizing every K token (None for ``p = 0``: the
    baseline itself)."""
    return {"effective_k_bits": cell.mean_bits,
            "win_rates": {m: 100.0 * cell.win_rate(m) for m in METRICS} if p else None,
            "records": cell.records}


def per_layer_markdown(title: str, table: PolicyTable, layers: Sequence[Mapping[str, Any]] | None = None
                       ) -> list[str]:
    """Markdown lines: a heading, the policy's configured K bits (`service.quant.accounting.policy_k_bits`) and one
    row per layer (score type, p, the layer's configured K bits ``(b (G - p) + 16 p) / G``, and with the fit
    record's ``layers`` the nominal K bits measured over the calibration's reused tokens and the win rates)."""
    fitted = {int(entry["layer"]): entry for entry in layers or []}
    lines = [f"#### {title}", "",
             (f"Policy `{table.id}` ({table.cache_mode} cache, {table.bits}-bit, K groups of {table.k_group_size}, "
             f"configured K bits {policy_k_bits(table):.3f}, cap {table.k_bit_cap:g}); "
             f"{table.provenance.data.split(' (')[0]}"), "",
             "| Layer | Score type | p | Configured K bits | Measured K bits (calibration) | "
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


#: The paper's Table 4 columns -> metric keys of a fit record's ``table4`` rows (`calibration.fit.table4`).
TABLE4_COLUMNS = {"L2": "centered_l2", "KL": "attention_kl", "Top-1": "top1", "Top-K": "topk", "Cosine": "cosine"}
#: What a Table 4 win rate is, and is not (printed under every rendering of the table).
TABLE4_CAVEAT = ("Win rate: share of the calibration records (%) of the layers a policy protects where it is "
                 "strictly closer to full recompute than quantizing every K token. A tie is not a win: when both "
                 "pick the same top-1 key (most records, on a small model) the record is not a win for the policy, so "
                 "a low Top-1 means \"mostly ties\", not \"mostly worse\". Configured K bits: the policy's nominal "
                 "K bits on full groups (docs/glossary.md, \"Effective bits\").")


def table4_markdown(rows: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The paper's Table 4 as markdown lines: one row per ``"<mode>/<bits>"`` key of a fit record's ``table4``
    (win rates % per metric, configured K bits, protected layers), then `TABLE4_CAVEAT`. A record written before
    ``configured_k_bits`` existed shows "—" there."""
    lines = ["| Mode | Bits | " + " | ".join(TABLE4_COLUMNS) + " | Configured K bits | Protected layers |",
             "|---|---:|" + "---:|" * (len(TABLE4_COLUMNS) + 2)]
    for key in sorted(rows):
        row, (mode, bits) = rows[key], key.split("/")
        configured, protected = row.get("configured_k_bits"), row.get("protected_layers")
        lines.append(f"| {mode.capitalize()} | {bits} | "
                     + " | ".join("—" if row.get(m) is None else f"{row[m]:.1f}" for m in TABLE4_COLUMNS.values())
                     + f" | {'—' if configured is None else f'{configured:.3f}'}"
                     + f" | {'—' if protected is None else int(protected)} |")
    return [*lines, "", TABLE4_CAVEAT, ""]
