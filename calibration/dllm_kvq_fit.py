"""dLLM-KVQ's calibration step (``calibrate fit``, `service.quant.dllm_kvq.METHOD`): one policy table per (cache
mode, bits) from every sample's diagnostic sums (`calibration.fit.fit_policy`), stored through the job's store.

Artifacts it writes:

==================  ========================================================================================
kind                id and content
==================  ========================================================================================
calibration_fit     ``fit-<h>``, h = hash of (sums samples, fit settings); the policy ids and Table 4 rows
policy              the :class:`~service.artifacts.policy.PolicyTable`'s own content id
==================  ========================================================================================

The step's own flag is ``--merge FILE ...`` (:func:`fit_flags`): fit from the sums files ``diagnose --sums-out``
wrote instead of the store's sums.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from calibration.fit import DiagnosticSums, FitSettings, LayerFit, cell_key, fit_policy, table4
from calibration.policy_tables import layer_record
from service.artifacts.base import canonical_json
from service.artifacts.policy import PolicyTable
from service.store.base import KIND_POLICY

if TYPE_CHECKING:
    from calibration.job import CalibrationJob

KIND_FIT = "calibration_fit"


def fit_policies(job: CalibrationJob, args: Any = None) -> dict[str, PolicyTable]:
    """dLLM-KVQ's calibration step (``calibrate fit``): :func:`fit_tables`, from the sums files of ``--merge``
    when given (:func:`fit_flags`); returns ``"<mode>/<bits>"`` -> table."""
    sums = None
    for path in getattr(args, "merge", None) or []:
        part = DiagnosticSums.model_validate_json(Path(path).read_text())
        sums = part if sums is None else sums.merge(part)
    return fit_tables(job, sums)


class _ExistingFiles(argparse.Action):
    """``--merge``: every path must be a file; else one line naming it and exit 2 (before the model loads)."""

    def __call__(self, parser, namespace, values, option_string=None):
        for path in values:
            if not path.is_file():
                parser.exit(2, f"{parser.prog}: error: --merge {path}: no such file; give the files "
                               "`diagnose --sums-out` wrote\n")
        setattr(namespace, self.dest, values)


def fit_flags(parser: argparse.ArgumentParser) -> None:
    """The ``fit`` verb's own flag (`service.quant.dllm_kvq.METHOD`): ``--merge`` sums files."""
    parser.add_argument("--merge", type=Path, nargs="+", action=_ExistingFiles,
                        help="fit from these sums files instead of the store (default: the store's sums)")


def fit_settings(job: CalibrationJob) -> FitSettings:
    """The fit gates of the job's settings (:class:`calibration.fit.FitSettings`)."""
    s = job.settings
    return FitSettings(bit_penalty=s.bit_penalty, min_records=s.min_records, win_rate=s.win_rate)


def fit_tables(job: CalibrationJob, sums: DiagnosticSums | None = None) -> dict[str, PolicyTable]:
    """Fit and store one policy per (cache mode, bits) from every sample's sums (or the given merged sums).

    Returns ``"<mode>/<bits>"`` -> table; Table 4 rows, per-layer records and each policy's summary note go to the
    job's summary, and a ``calibration_fit`` record keyed by the sums and fit settings to the store.

    Raises:
        FileNotFoundError: a sample has no diagnostic sums in the store (`CalibrationJob.merged_sums`).
    """
    started = time.perf_counter()
    sums = sums if sums is not None else job.merged_sums(job.all_sums_ids())
    settings = fit_settings(job)
    tables, fits, ids = {}, {}, {}
    for mode, bits in sums.modes_and_bits():
        source = "committed-block diagnostics" if job.block_causal else "TRACE trajectories"
        table, layer_fits = fit_policy(
            sums, mode, bits, settings,
            job.provenance(f"mixed_chat {source}: {len(sums.samples)} samples ({sorted(sums.samples)})"),
            job.v_group_size)
        table.validate_for(job.spec)
        key = f"{mode}/{bits}"
        tables[key], fits[key], ids[key] = table, layer_fits, table.id
        job.store.put_model(KIND_POLICY, table)
        job.summary.table4[key] = row = table4(sums, table)
        job.summary.notes[table.id] = _policy_note(row)
    job.summary.fit_layers = _layer_fit_json(fits, tables, sums)
    record = {"sums_samples": sorted(sums.samples), "policies": ids,
              "table4": job.summary.table4, "layers": job.summary.fit_layers}
    # "record" 2: layers carry effective K bits and win rates (calibration.policy_tables).
    key = job.input_key("fit", {"samples": sorted(sums.samples), "fit": settings.as_dict(),
                                "v_group_size": job.v_group_size, "record": 2})
    job.cached(KIND_FIT, key, lambda: canonical_json(record))
    job.timed("fit", started)
    return tables


def _policy_note(row: dict[str, float]) -> str:
    """A policy's line in the end-of-run summary: its Table 4 win rates and configured K bits."""
    rates = " ".join(f"{m}={row[m]:.1f}%" for m in ("centered_l2", "attention_kl", "top1", "topk") if m in row)
    bits = row.get("configured_k_bits")
    return f"{rates}; configured K bits {'—' if bits is None else f'{bits:.3f}'}"


def _layer_fit_json(fits: dict[str, list[LayerFit]], tables: dict[str, PolicyTable],
                    sums: DiagnosticSums) -> dict[str, list[dict]]:
    """Per policy key and layer: the choice, every candidate's objective and refusal, and `layer_record`."""
    out = {}
    for key, layer_fits in fits.items():
        table = tables[key]
        out[key] = [{"layer": f.layer, "score_type": f.choice.score_type, "p": f.choice.p, "objective": f.objective,
                     "refused": f.refused,
                     **layer_record(sums.cells[cell_key(table.cache_mode, table.bits, f.layer, f.choice.score_type,
                                                        f.choice.p)], f.choice.p)}
                    for f in layer_fits]
    return out
