"""`QuantizedKVStore`: the engine's KV store holding reused K/V packed, and the `make_kv_store` factory.

Where it acts (paper "KIVI and KVQuant Adaptations", DESIGN.md): right after the block-initial pass, the reused
regions of every layer (prefix; in dual mode prefix and suffix) are quantized layer by layer as the engine calls
``write``, and held packed. Later steps call ``read(layer)`` and get that layer dequantized for the time the layer
runs, so the peak is the packed bytes plus one layer's dequantized copy. With ``keep_dequantized`` the
dequantized copies are kept for the rest of the block (they do not change within a block): faster, but it saves
no memory within a block. The active block is never handed to the store, so it is never quantized.
"""

from __future__ import annotations

from typing import Any

import torch

from service.engine.kv_store import FullPrecisionKVStore, KVStore, Segments
from service.engine.report import KVReport
from service.engine.spec import ModelSpec
from service.quant.accounting import KVAccounting
from service.quant.base import KVQuantizer, PackedLayer
from service.quant.config import KVQuantConfig
from service.quant.errors import KVQuantError
from service.quant.layout import SlotLayout
from service.quant.registry import make_quantizer, method, resolve_artifact


class QuantizedKVStore(KVStore):
    """A :class:`KVStore` that holds each layer's reused K/V packed by a quantizer.

    Args:
        quantizer: the method (see `service.quant.registry`).
        keep_dequantized: keep each layer's dequantized copy until the next block.
        artifact_id: the applied artifact's id, recorded in the report under ``report_field`` (the method's
            spelling of ``artifact_id``: ``policy_id``, ``kvquant_state_id`` ...).

    ``needs_scores`` and ``pre_rope_keys`` are the quantizer's. A new block starts when ``write`` sees other
    segments, or a layer already written. ``read`` of a layer not written in this block raises
    :class:`KVQuantError`.
    """

    def __init__(
        self,
        quantizer: KVQuantizer,
        keep_dequantized: bool = False,
        artifact_id: str | None = None,
        report_field: str = "artifact_id",
    ) -> None:
        self.quantizer = quantizer
        self.needs_scores = quantizer.needs_scores
        self.pre_rope_keys = quantizer.pre_rope_keys
        self.keep_dequantized = keep_dequantized
        self.artifact_id = artifact_id
        self.report_field = report_field
        self.accounting = KVAccounting()
        self._segments: Segments | None = None
        self._layout: SlotLayout | None = None
        self._packed: dict[int, PackedLayer] = {}
        self._dequantized: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def write(self, layer, k, v, segments, scores=None) -> None:
        if segments != self._segments or layer in self._packed:
            self._start_block(segments, k.device)
        packed = self.quantizer.quantize(layer, k, v, self._layout, scores if self.needs_scores else None)
        self._packed[layer] = packed
        self.accounting.add(layer, packed)

    def read(self, layer):
        if layer in self._dequantized:
            return self._dequantized[layer]
        if layer not in self._packed:
            raise KVQuantError(f"layer {layer} was not written in this block's initial pass")
        kv = self.quantizer.dequantize(layer, self._packed[layer], self._layout)
        if self.keep_dequantized:
            self._dequantized[layer] = kv
        return kv

    def clear(self) -> None:
        """Drop the held tensors; the accounting stays for :meth:`report`."""
        self._segments = None
        self._layout = None
        self._packed.clear()
        self._dequantized.clear()

    @property
    def bytes_held(self) -> int:
        """Bytes held now: packed layers, the block's index tensors, and kept dequantized copies."""
        held = sum(p.nbytes for p in self._packed.values())
        held += sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self._dequantized.values())
        return held + (self._layout.nbytes if self._layout is not None else 0)

    def report(self) -> KVReport:
        """Effective bits and bytes of everything written so far (see `service.quant.accounting`)."""
        return self.accounting.report(
            self.quantizer.config.model_dump(mode="json"), {self.report_field: self.artifact_id}
        )

    def _start_block(self, segments: Segments, device: torch.device) -> None:
        self.clear()
        self._segments = segments
        self._layout = SlotLayout.from_segments(segments, self.quantizer.k_group_size, device)
        self.accounting.start_block(self._layout.nbytes)


def make_kv_store(config: KVQuantConfig, spec: ModelSpec, artifact: Any = None) -> KVStore:
    """The KV store for one request's configuration.

    ``method="none"`` gives the engine's :class:`FullPrecisionKVStore`. An artifact named by file in the config
    is loaded here (`service.quant.registry.resolve_artifact`); one named by id must be passed in (the caller
    resolves ids through its store, `service.store.base`).

    Raises:
        KVQuantError: the artifact is missing, or named by id but not passed, or its file cannot be read or
            parsed; an unknown method; a bad v_group_size.
        ArtifactMismatch: the artifact does not fit the model or the config (message names the field).
    """
    entry = method(config.method)
    if entry.quantizer is None:
        return FullPrecisionKVStore()
    if entry.artifact is not None and artifact is None:
        if config.artifact_file is None:
            raise KVQuantError(f"{entry.spelling('artifact_id')} {config.artifact_id!r} must be resolved by the "
                               "caller and passed as artifact")
        artifact = resolve_artifact(config, spec)
    quantizer = make_quantizer(config, spec, artifact)
    return QuantizedKVStore(
        quantizer,
        keep_dequantized=config.keep_dequantized,
        artifact_id=artifact.id if artifact is not None else None,
        report_field=entry.spelling("artifact_id"),
    )
