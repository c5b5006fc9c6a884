"""Diagnostics: behaviour of every candidate K policy on the reconstructed states of a TRACE trajectory.

Paper, "K-Cache Policy Selection" and "Policy Diagnostics and Selection"; issue 6 item 3. A record is
(sample, cache mode, block, step, layer), for every step of a block after its block-initial step (that step runs a
full forward and reuses nothing). For each record:

* the state ``x_t`` of that step (TRACE rollout);
* the reused cache as the cache mode builds it: K/V of the reused columns from the full forward of the block's
  initial state ``x_tau_b`` (prefix; prefix and suffix in dual mode);
* ``Q``: the active block's queries at that layer from the step's forward in that cache mode, with the
  *unquantized* reused cache (:func:`calibration.forward.cached_step`);
* ``K_ref``: the keys of a full-recompute forward of the same state;
* the keys to judge: the reused keys quantized by the baseline (``p = 0``: all K quantized, KIVI's K) or by a
  candidate ``(score type, p)``, next to the fresh keys of the recomputed window (the active block, and in prefix
  mode the suffix) from the same cached forward;
* the metrics of :mod:`calibration.metrics` against ``K_ref`` with the same ``Q``, and each candidate's signed
  improvements over the baseline, added to :class:`calibration.fit.DiagnosticSums`.

The reused cache is constant within a block, so its quantized variants (and the token scores they rank by) are
computed once per (block, cache mode, layer, bits). Token scores and QDQ come from ``service.quant`` (the same code
the online quantizer runs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from calibration.fit import BUDGETS, DiagnosticSums
from calibration.forward import cached_step, capture_qkv, reused_columns
from calibration.metrics import TOP_K, attention_scores, behaviour_metrics, improvements
from calibration.quantize import reused_key_variants
from calibration.trace import Trajectory, rollout
from service.artifacts.policy import SCORE_TYPES
from service.engine.kv_store import Segments
from service.engine.models import DiffusionLM
from service.engine.scores import attention_scores as block_attention
from service.engine.spec import ModelSpec


@dataclass(frozen=True)
class DiagnoseSettings:
    """What to diagnose: cache modes, bit widths, K group size, candidates, and the top-K of the recall metric."""

    cache_modes: tuple[str, ...] = ("prefix", "dual")
    bits: tuple[int, ...] = (4, 2)
    k_group_size: int = 32
    score_types: tuple[str, ...] = SCORE_TYPES
    budgets: tuple[int, ...] = BUDGETS[1:]
    top_k: int = TOP_K

    def as_dict(self) -> dict:
        return {"cache_modes": list(self.cache_modes), "bits": list(self.bits), "k_group_size": self.k_group_size,
                "score_types": list(self.score_types), "budgets": list(self.budgets), "top_k": self.top_k}


def diagnose_trajectory(model: DiffusionLM, spec: ModelSpec, trajectory: Trajectory, sample_id: str,
                        settings: DiagnoseSettings) -> DiagnosticSums:
    """The diagnostic sums of one trajectory (every block, later step, cache mode, layer and bits).

    Raises:
        ValueError: the trajectory's blocks have a single step (no step reuses a cache).
    """
    schedule = trajectory.schedule
    if schedule.steps_per_block < 2:
        raise ValueError("diagnostics need at least 2 steps per block: only later steps reuse the cache")
    num_layers = spec.num_layers
    sums = DiagnosticSums(model_id=spec.model_id, model_fingerprint=trajectory.model_fingerprint, num_layers=num_layers,
                          k_group_size=settings.k_group_size, top_k=settings.top_k, samples=[sample_id])
    device = model.embed.weight.device
    states = rollout(trajectory.prompt_ids, trajectory.answer_ids, trajectory.assignment, schedule,
                     spec.mask_id).to(device)
    prompt_length, seq_len = len(trajectory.prompt_ids), states.shape[1]
    candidates = [(s, p) for p in settings.budgets for s in settings.score_types]
    for block in range(schedule.num_blocks):
        start = prompt_length + block * schedule.block_length
        end = start + schedule.block_length
        first = block * schedule.steps_per_block
        _, initial = capture_qkv(model, states[first][None])
        # dLLM-KVQ's attention score: block-initial attention from the active block's queries, per key column.
        attention = [block_attention(layer.q[:, :, start:end], layer.k, None) for layer in initial]  # [1, T] each
        per_mode = {}
        for mode in settings.cache_modes:
            columns = reused_columns(mode, start, end, seq_len).to(device)
            if columns.numel() == 0:
                continue  # nothing reused (empty prompt): no record
            segments = Segments((0,), start, end, seq_len, mode)
            lengths = [b - a for a, b in segments.row_segments(0)]
            variants = {
                (layer, bits): reused_key_variants(spec, layer, initial[layer].k, initial[layer].v, segments, bits,
                                                   settings.k_group_size, attention[layer], candidates)
                for layer in range(num_layers) for bits in settings.bits
            }
            per_mode[mode] = (columns, lengths, variants)
        for step in range(first + 1, first + schedule.steps_per_block):
            _, reference = capture_qkv(model, states[step][None])
            for mode, (columns, lengths, variants) in per_mode.items():
                _, fresh = cached_step(model, states[step], mode, start, end, initial)
                reused = torch.zeros(seq_len, dtype=torch.bool, device=device)
                reused[columns] = True
                for layer in range(num_layers):
                    q = fresh[layer].q_block
                    s_ref = attention_scores(q, reference[layer].k[0])
                    keys = reference[layer].k[0].clone()
                    keys[:, ~reused] = fresh[layer].k_fresh.to(keys.dtype)
                    for bits in settings.bits:
                        quantized = variants[(layer, bits)]  # [1 + C, H_kv, T_reused, D], baseline first
                        stacked = keys.expand(quantized.shape[0], -1, -1, -1).clone()
                        stacked[:, :, reused] = quantized.to(stacked.dtype)
                        metrics = behaviour_metrics(s_ref, attention_scores(q, stacked), reused, settings.top_k)
                        baseline = {name: value[0] for name, value in metrics.items()}
                        deltas = {
                            candidate: {name: float(v) for name, v in improvements(
                                {name: value[i + 1] for name, value in metrics.items()}, baseline).items()}
                            for i, candidate in enumerate(candidates)
                        }
                        sums.add_record(mode, bits, layer, deltas, lengths)
    return sums
