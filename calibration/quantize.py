"""The reused K of one layer as the baseline and every candidate policy would hold it, through the online
quantizer's own code (``service.quant``), so the diagnostics judge exactly what serving would run.

The baseline is KIVI's K (every reused token quantized, ``p = 0``); a candidate ``(score type, p)`` is dLLM-KVQ
with that entry on the layer: token scores (``attention`` from the block-initial pass, ``qerror``, ``hybrid``),
top-p per K group kept in the model dtype and excluded from the group's min/max.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch

from service.artifacts.base import Provenance, default_v_group_size
from service.artifacts.policy import LayerPolicy, PolicyTable
from service.engine.kv_store import Segments
from service.engine.spec import ModelSpec
from service.quant.base import KVQuantizer
from service.quant.config import KVQuantConfig
from service.quant.dllm_kvq import DLLMKVQQuantizer
from service.quant.layout import SlotLayout

# Diagnostics try every budget, including those above the fit's cap (the gate refuses them later).
_NO_CAP = 16.0


@lru_cache(maxsize=256)
def _quantizer(spec: ModelSpec, bits: int, k_group_size: int, candidate: tuple[str, int] | None) -> KVQuantizer:
    if candidate is None:
        return KVQuantizer(KVQuantConfig(method="kivi", bits=bits, k_group_size=k_group_size), spec)
    score_type, p = candidate
    table = PolicyTable(
        model_id=spec.model_id, weights_fingerprint=spec.fingerprint, cache_mode="dual", bits=bits,
        k_group_size=k_group_size, v_group_size=default_v_group_size(spec.head_dim), k_bit_cap=_NO_CAP,
        layers=[LayerPolicy(score_type=score_type, p=p)] * spec.num_layers,
        provenance=Provenance(data="diagnostic candidate", code="calibration.quantize"),
    )
    config = KVQuantConfig(method="dllm_kvq", bits=bits, k_group_size=k_group_size, policy_id=table.id)
    return DLLMKVQQuantizer(config, spec, table)


def reused_key_variants(spec: ModelSpec, layer: int, k: torch.Tensor, v: torch.Tensor, segments: Segments,
                        bits: int, k_group_size: int, attention: torch.Tensor,
                        candidates: Sequence[tuple[str, int]]) -> torch.Tensor:
    """Dequantized reused K of one layer under the baseline and each candidate.

    Args:
        spec: the model.
        layer: layer index (the quantizers are per layer).
        k, v: ``[1, H_kv, T, D]`` the block-initial pass's K/V of the whole sequence (post-RoPE K).
        segments: the block's layout (cache mode, block bounds).
        bits, k_group_size: the quantization setting.
        attention: float32 ``[1, T]`` block-initial attention scores (active-block queries, mean over heads).
        candidates: ``(score type, p)`` pairs.

    Returns:
        ``[1 + C, H_kv, T_reused, D]`` in K's dtype, the baseline first, then the candidates in order; reused
        axis in ``segments.reused_columns`` order.
    """
    layout = SlotLayout.from_segments(segments, k_group_size, k.device)
    variants = []
    for candidate in [None, *candidates]:
        quantizer = _quantizer(spec, bits, k_group_size, candidate)
        scores = attention if quantizer.needs_scores else None
        packed = quantizer.quantize(layer, k, v, layout, scores)
        variants.append(quantizer.dequantize_k(layer, packed, layout)[0])
    return torch.stack(variants)
