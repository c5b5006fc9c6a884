"""Effective bits, computed here and only here (terms: docs/glossary.md, "Effective bits").

Two counts (the same for K and for V):

* *nominal* bits: the paper's count, codes at b bits and every element held in high precision (protected K
  tokens, KVQuant outliers, the side a K-only or V-only row leaves alone) at 16, scales not counted;
* *storage* bits: bytes actually held (codes, scales, minima, indices, outliers) x 8 / elements.

And two figures that carry them:

* **configured** bits (`configured_bits`): the nominal bits a configuration sets on full groups, known before
  any data, as the method's plug-in declares them (`service.quant.plugin.QuantMethod.configured_bits`): b for
  KIVI, the policy's ``(b (G - p) + 16 p) / G`` averaged over layers for dLLM-KVQ, none for the unquantized cache
  and for KVQuant (its outliers are counted as the data has them). Every report of a policy or
  configuration shows this figure: calibration summary and report, matrix tables and model card, ``kv_config``
  and ``/admin`` answers, ``dllm_kv_configured_bits``.
* **measured** bits (`KVAccounting`, summarized as `service.engine.report.KVReport`): nominal and storage bits
  over the reused tokens of every block of one request (weighted by elements), per layer and overall; a run's
  figure is the mean of its requests'. A reused segment shorter than a group still keeps p tokens at 16 bits, so
  a dLLM-KVQ request measures more nominal K bits than its configured figure.

Elements are real reused tokens x kv heads x head_dim; padding is not counted. ``bytes_held`` is the largest
amount held after any block-initial pass (every layer's packed K/V plus the block's shared index tensors);
``bf16_bytes`` is what the same K/V would take in bf16.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

from service.engine.report import KVReport, LayerBits
from service.quant.base import PackedLayer, read_bits
from service.quant.config import KVQuantConfig
from service.quant.registry import method

if TYPE_CHECKING:
    from service.artifacts.policy import PolicyTable

#: Nominal bits of an element held in high precision (the paper counts protected tokens at 16).
HIGH_PRECISION_BITS = 16.0


def policy_k_bits(table: PolicyTable) -> float:
    """A dLLM-KVQ policy's configured K bits: the full-group nominal K bits ``(b (G - p) + 16 p) / G`` of each
    layer's budget p, averaged over layers (bits per K element; what every report of the policy shows)."""
    return table.mean_k_bits()


def configured_bits(config: KVQuantConfig, artifact: Any = None) -> dict[str, float] | None:
    """The configured nominal bits ``{"k": ..., "v": ...}`` (bits per element) of ``config`` on full groups (module
    docstring), as the method's plug-in declares them (`QuantMethod.configured_bits`), or None where no figure
    follows from the configuration: the unquantized cache (method ``none``), methods that declare none (KVQuant:
    its outliers depend on the data), and a method whose figure needs its artifact when none is given.

    Args:
        config: the configuration; ``sides`` ``k`` / ``v`` count the side left alone at 16 bits.
        artifact: the loaded artifact ``config`` names (a `PolicyTable` for ``dllm_kvq``), or None.

    Raises:
        KVQuantError: ``config.method`` is not registered.
    """
    declared = method(config.method).configured_bits
    bits = declared(config, artifact) if declared is not None else None
    if bits is None:
        return None
    return {"k": HIGH_PRECISION_BITS if config.sides == "v" else float(bits["k"]),
            "v": HIGH_PRECISION_BITS if config.sides == "k" else float(bits["v"])}


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

    def drop(self, packed: PackedLayer) -> None:
        """Packed K/V no longer held (a renoising family's sliding window dropped them, `service.quant.canvas`):
        off the bytes held now; the peak and the bits counted stay."""
        self._block_bytes -= packed.nbytes
        self._block_bf16 -= 2 * (packed.k.elements + packed.v.elements)

    def report(self, config: dict[str, Any], artifact_ref: dict[str, str | None] | None = None) -> KVReport:
        """The request's :class:`KVReport` (zeros when nothing was quantized); ``artifact_ref`` gives the applied
        artifact's id under its report field (``{"policy_id": ...}``)."""
        per_layer = []
        sums = [0.0] * 6
        read_bits([x for t in self._totals.values() for x in t])  # KVQuant's outliers, counted on the device
        for layer in sorted(self._totals):
            t = [float(x) for x in self._totals[layer]]
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
        return float(a) / b if b else 0.0

    return {
        "k_nominal_bits": ratio(k_nom, k_el),
        "v_nominal_bits": ratio(v_nom, v_el),
        "k_storage_bits": ratio(8 * k_bytes, k_el),
        "v_storage_bits": ratio(8 * v_bytes, v_el),
    }
