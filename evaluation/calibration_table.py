"""The paper's Table 4 (trajectory-level diagnostics) from a calibration run stored by the calibration job.

The calibration job (``python -m calibration ... fit``) stores one ``calibration_fit`` record per fit: the
policies it stored per ``"<mode>/<bits>"`` and, for each, the win rates (%) of the selected policy against
quantizing every K token (records of the layers it protects), per metric (``centered_l2``, ``attention_kl``,
``top1``, ``topk``, ``cosine``), with the nominal effective K bits. `table4_rows` reads that record;
``RUN_ID`` ``latest`` takes the newest one.
"""

from __future__ import annotations

from typing import Any

from service.commands import prog
from service.store.base import open_store, redact_url

#: Artifact kind of the calibration job's fit records (``calibration.dllm_kvq_fit.KIND_FIT``).
KIND_CALIBRATION_FIT = "calibration_fit"
#: Paper column -> metric key in the record.
COLUMNS = {"L2": "centered_l2", "KL": "attention_kl", "Top-1": "top1", "Top-K": "topk"}


def calibration_record(store_url: str | None, run_id: str) -> tuple[str, dict[str, Any]]:
    """(run id, record) of the calibration run ``run_id`` (or ``latest``) in the store at ``store_url``.

    Raises:
        ValueError: no store URL, or no such run; the message names the flag, the run and the store it looked in.
    """
    if not store_url:
        raise ValueError("--from-calibration needs --store (the store the calibration job wrote to)")
    store = open_store(store_url)
    try:
        ids = store.list(KIND_CALIBRATION_FIT)
        if run_id == "latest":
            if not ids:
                raise ValueError(f"--from-calibration latest: no calibration run ({KIND_CALIBRATION_FIT}) in the "
                                 f"store {store.location}; run `{prog('calibration', 'all')} --store "
                                 f"{redact_url(store_url)}` first")
            run_id = max(ids, key=lambda i: store.info(KIND_CALIBRATION_FIT, i).created_at)
        elif run_id not in ids:
            raise ValueError(f"--from-calibration {run_id}: no such calibration run in the store {store.location} "
                             f"(it holds {len(ids)}: {', '.join(sorted(ids)[:3]) or 'none'})")
        return run_id, store.get_json(KIND_CALIBRATION_FIT, run_id)
    finally:
        store.close()


def table4_rows(store_url: str | None, run_id: str) -> list[dict[str, Any]]:
    """One row per (cache mode, bits) of the calibration run ``run_id`` (or ``latest``).

    Raises:
        ValueError: as `calibration_record`.
    """
    run_id, record = calibration_record(store_url, run_id)
    rows = []
    for key, values in sorted(record["table4"].items()):
        mode, bits = key.split("/")
        rows.append({"run_id": run_id, "cache_mode": mode, "bits": int(bits),
                     "policy_id": record.get("policies", {}).get(key),
                     **{col: values[metric] for col, metric in COLUMNS.items()},
                     "configured_k_bits": values.get("configured_k_bits"),
                     "protected_layers": values.get("protected_layers"), "record": values})
    return rows


def table4_markdown(rows: list[dict[str, Any]]) -> str:
    """Table 4 as markdown (`calibration.policy_tables.table4_markdown`, with its "a tie is not a win" caveat):
    mode, bits, win rates (%), configured K bits, protected layers."""
    from calibration.policy_tables import table4_markdown as lines_of

    head = ["### Trajectory-level diagnostics (Table 4)", ""]
    if not rows:
        return "\n".join([*head, "No rows.", ""])
    head += [(f"Calibration run `{rows[0]['run_id']}`: share of paired records (%) where the selected policy "
              "beats quantizing every K token."), ""]
    return "\n".join([*head, *lines_of({f"{r['cache_mode']}/{r['bits']}": r["record"] for r in rows})])
