"""KVQuant fit: a per-layer state from the calibration trajectories' cache traces (paper, "KIVI and KVQuant
Adaptations": "we fit a bit-width-specific calibration state from collected Fast-dLLM KV cache traces ... and,
when enabled, Fisher-style activation-gradient weights").

The traces are the pre-RoPE keys and the values of every block-initial pass (where the reused cache is written),
laid out as the reference's 2-D ``[N, C]`` view (``C = num_kv_heads * head_dim``, column ``h * D + d``). The fit of
one layer (per-channel key thresholds at the sparsity threshold's percentiles, one-dimensional k-means codebooks
for keys and values with scikit-learn, optional Fisher weights) is the quantization code's
:func:`service.quant.nuq.fit_layer`, the same rules its quantizer applies.

:func:`fit_kvquant_states` is KVQuant's calibration step (``calibrate kvquant``, `service.quant.kvquant.METHOD`):
a state per bit width of ``--kvquant-bits``, stored through the job's store:

==================  ========================================================================================
kind                id and content
==================  ========================================================================================
kvquant_fit         ``kvqfit-<h>``, h = hash of (trajectory ids, bits, Fisher, sparsity); the state ids
kvquant_state       the :class:`~service.artifacts.kvquant_state.KVQuantState`'s own content id
==================  ========================================================================================
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from calibration.block_causal import pre_rope_trace
from calibration.forward import PreRopeKV
from service.artifacts.base import Provenance, canonical_json
from service.artifacts.kvquant_state import KVQuantState, KVQuantStateMeta
from service.engine.spec import ModelSpec
from service.quant.nuq import fit_layer
from service.store.base import KIND_KVQUANT_STATE

if TYPE_CHECKING:
    from calibration.job import CalibrationJob

KIND_KVQUANT_FIT = "kvquant_fit"


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``[H_kv, T, D]`` -> ``[T, H_kv * D]`` (column ``h * D + d``, the reference's k_proj output layout)."""
    return x.permute(1, 0, 2).reshape(x.shape[1], -1)


def fit_kvquant_state(traces: Sequence[list[PreRopeKV]], bits: int, spec: ModelSpec, sparsity_threshold: float,
                      provenance: Provenance) -> KVQuantState:
    """Fit a :class:`KVQuantState` from cache traces.

    Args:
        traces: one entry per captured forward, each a list of :class:`PreRopeKV` per layer.
        bits: codebook bits (2, 4 or 8).
        spec: the model (fingerprint, layer count, channels).
        sparsity_threshold: share of each vector kept dense (paper 0.99).

    Raises:
        ValueError: no traces, or traces whose layer count does not match the model.
    """
    if not traces:
        raise ValueError("KVQuant fit needs at least one cache trace")
    if any(len(trace) != spec.num_layers for trace in traces):
        raise ValueError(f"every trace must hold {spec.num_layers} layers")
    fisher = traces[0][0].k_fisher is not None
    fitted = []
    for layer in range(spec.num_layers):
        keys = torch.cat([as_rows(trace[layer].k) for trace in traces])
        values = torch.cat([as_rows(trace[layer].v) for trace in traces])
        key_fisher = torch.cat([as_rows(trace[layer].k_fisher) for trace in traces]) if fisher else None
        value_fisher = torch.cat([as_rows(trace[layer].v_fisher) for trace in traces]) if fisher else None
        fitted.append(fit_layer(keys, values, bits, sparsity_threshold, key_fisher, value_fisher))
    meta = KVQuantStateMeta(
        model_id=spec.model_id, weights_fingerprint=spec.fingerprint, bits=bits, num_layers=spec.num_layers,
        channels=spec.num_kv_heads * spec.head_dim, sparsity_threshold=sparsity_threshold,
        provenance=provenance.model_copy(update={"details": {**provenance.details, "fisher": fisher,
                                                             "tokens": int(sum(t[0].k.shape[1] for t in traces))}}),
    )
    k_upper, k_lower, k_lut, v_lut = (torch.stack(parts) for parts in zip(*fitted))
    return KVQuantState(meta, k_upper=k_upper, k_lower=k_lower, k_lut=k_lut, v_lut=v_lut)


def fit_kvquant_states(job: CalibrationJob, args: Any = None) -> dict[str, KVQuantState]:
    """KVQuant's calibration step (``calibrate kvquant``): fit and store a state per bit width of
    ``--kvquant-bits`` from the pre-RoPE cache traces of this shard's trajectories (a block-causal model: of its
    samples' committed blocks, `calibration.block_causal.pre_rope_trace`); returns the states by bits
    (``"4"``). A state whose ``kvquant_fit`` record is stored is read back, not fitted again."""
    trajectory_ids = job.trace()
    started = time.perf_counter()
    s = job.settings
    states = {}
    traces = None
    if job.block_causal:  # the samples' keys stand for the trajectories
        trajectory_ids = [job.trajectory_key(sample) for sample in job.shard(job.samples())]
        if s.fisher:
            job.note("kvquant --fisher: not on a block-causal model yet; the codebooks are fitted unweighted")
    for bits in s.kvquant_bits:
        key = job.input_key("kvqfit", {"trajectories": trajectory_ids, "bits": bits,
                                       "fisher": s.fisher and not job.block_causal,
                                       "sparsity": s.sparsity_threshold})
        if job.store.exists(KIND_KVQUANT_FIT, key):
            state_id = job.store.get_json(KIND_KVQUANT_FIT, key)["state"]
            states[bits] = KVQuantState.from_bytes(job.store.get(KIND_KVQUANT_STATE, state_id))
            job.summary.skipped[KIND_KVQUANT_FIT] = job.summary.skipped.get(KIND_KVQUANT_FIT, 0) + 1
        else:
            if traces is None:
                traces = (job.cache_traces(trajectory_ids) if not job.block_causal else
                          [pre_rope_trace(job.engine.model, sample.prompt_ids, sample.answer_ids, s.block_length)
                           for sample in job.shard(job.samples())])
            source = "block-causal samples" if job.block_causal else "TRACE trajectories"
            state = fit_kvquant_state(
                traces, bits, job.spec, s.sparsity_threshold,
                job.provenance(f"pre-RoPE cache traces of {len(trajectory_ids)} {source}"))
            state.validate_for(job.spec)
            job.store.put(KIND_KVQUANT_STATE, state.to_bytes(), state.id)
            job.cached(KIND_KVQUANT_FIT, key, lambda state=state: canonical_json({"state": state.id}))
            states[bits] = state
    job.timed("kvquant", started)
    return {str(bits): state for bits, state in states.items()}
