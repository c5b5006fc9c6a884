"""Effective-bit and memory accounting of a quantized KV store, summarized as `service.engine.report.KVReport`.

Per layer and overall, for K and V: *nominal* bits (the paper's count: codes at b bits, protected tokens and
outliers at 16, scales not counted) and *storage* bits (bytes actually held, with scales, minima, indices and
outliers, x 8 / elements), averaged over the reused tokens of every block of the request (weighted by elements).
Elements are real reused tokens x kv heads x head_dim; padding is not counted. ``bytes_held`` is the largest
amount held after any block-initial pass (every layer's packed K/V plus the block's shared index tensors);
``bf16_bytes`` is what the same K/V would take in bf16.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from service.engine.report import KVReport, LayerBits
from service.quant.base import PackedLayer


class KVAccounting:
    """Accumulates per-layer costs over the blocks of one request."""

    def __init__(self) -> None:
        # layer -> [k_elements, v_elements, k_nominal_bitsum, v_nominal_bitsum, k_bytes, v_bytes]
        self._totals: dict[int, list[float]] = defaultdict(lambda: [0.0] * 6)
        self._block_bytes = 0
        self._block_bf16 = 0
        self._peak: tuple[int, int] = (0, 0)

    def start_block(self, shared_bytes: int) -> None:
        """A new block-initial pass begins; ``shared_bytes`` are the block's index tensors held for all layers."""
        self._block_bytes = shared_bytes
        self._block_bf16 = 0

    def add(self, layer: int, packed: PackedLayer) -> None:
        """Count one layer's packed K/V of the current block."""
        t = self._totals[layer]
        for i, x in enumerate(
            (packed.k.elements, packed.v.elements, packed.k.nominal_bitsum, packed.v.nominal_bitsum,
             packed.k.nbytes, packed.v.nbytes)
        ):
            t[i] += x
        self._block_bytes += packed.nbytes
        self._block_bf16 += 2 * (packed.k.elements + packed.v.elements)
        if self._block_bytes > self._peak[0]:
            self._peak = (self._block_bytes, self._block_bf16)

    def report(self, config: dict[str, Any], artifact_ref: dict[str, str | None] | None = None) -> KVReport:
        """The request's :class:`KVReport` (zeros when nothing was quantized); ``artifact_ref`` gives the applied
        artifact's id under its report field (``{"policy_id": ...}``)."""
        per_layer = []
        sums = [0.0] * 6
        for layer in sorted(self._totals):
            t = self._totals[layer]
            sums = [a + b for a, b in zip(sums, t)]
            per_layer.append(LayerBits(layer=layer, **_bits(t)))
        return KVReport(
            config=config,
            **(artifact_ref or {}),
            bytes_held=self._peak[0],
            bf16_bytes=self._peak[1],
            per_layer=per_layer,
            **_bits(sums),
        )


def _bits(t: list[float]) -> dict[str, float]:
    k_el, v_el, k_nom, v_nom, k_bytes, v_bytes = t

    def ratio(a: float, b: float) -> float:
        return a / b if b else 0.0

    return {
        "k_nominal_bits": ratio(k_nom, k_el),
        "v_nominal_bits": ratio(v_nom, v_el),
        "k_storage_bits": ratio(8 * k_bytes, k_el),
        "v_storage_bits": ratio(8 * v_bytes, v_el),
    }
