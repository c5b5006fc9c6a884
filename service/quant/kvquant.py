"""KVQuant adapted to Fast-dLLM cache reuse: NUQ codebooks, static key ranges, dynamic value ranges, sparse outliers.

Paper "KIVI and KVQuant Adaptations": the fitted per-layer state (`service.artifacts.kvquant_state`) is applied to
the reused cache after the block-initial pass; keys are stored **before RoPE** (the engine rotates them after
reading); sparse outlier handling is on with sparsity threshold 0.99; first_few_fp16 = 0. The math is
`service.quant.nuq`'s. It works per token over all kv heads (the reference's ``[tokens, heads x head_dim]`` view), so
grouped-query attention needs nothing special and no statistic crosses a row (no token groups at all).

Held per layer: the b-bit codes of every entry (outliers included, their code is unused, as in KVQuant's dense
matrix), the outliers as int32 flat indices + model-dtype values, and for V the float32 offset and half range of
each token. The state's thresholds and codebooks are not counted: they are fixed per model, like the weights.
"""

from __future__ import annotations

import numpy as np
import torch

from service.artifacts.base import Provenance
from service.artifacts.kvquant_state import KVQuantState, KVQuantStateMeta
from service.engine.spec import ModelSpec
from service.quant import nuq
from service.quant.base import KVQuantizer, PackedLayer, PackedTensor
from service.quant.config import KVQuantConfig
from service.quant.kernels.operands import KernelOperands, nuq_operands
from service.quant.layout import SlotLayout
from service.quant.packing import byte_table, decode_stream, pack_stream


class KVQuantQuantizer(KVQuantizer):
    """KVQuant (NUQ + dense-and-sparse) on reused pre-RoPE keys and values.

    Args:
        config: method ``kvquant``; ``bits`` must equal the state's.
        spec: the loaded model.
        state: the fitted state (already validated against ``spec`` by the factory).
    """

    name = "kvquant"
    pre_rope_keys = True

    def __init__(self, config: KVQuantConfig, spec: ModelSpec, state: KVQuantState) -> None:
        super().__init__(config, spec)
        self.state = state
        self.sparse = state.meta.sparsity_threshold < 1.0
        # Per (layer, device), made at the first read: the keys' static offset and half range, and each
        # codebook as a per-byte table (`service.quant.packing.byte_table`). Fixed per model, like the state.
        self._read_tables: dict[tuple[int, torch.device], tuple[torch.Tensor, ...]] = {}

    def quantize_k(self, layer, x, layout, scores):
        s = self.state
        x2d = x.reshape(x.shape[0], -1)  # [N, H*D], column h*D + d
        upper, lower, lut = (t[layer].to(x.device) for t in (s.k_upper, s.k_lower, s.k_lut))
        codes, outliers = nuq.quantize_keys(x2d, upper, lower, lut, self.sparse)
        return self._pack(x2d, codes, outliers, {})

    def dequantize_k(self, layer, packed, layout, out=None):
        # nuq.dequantize_keys (lut[code] * range + offset, float32), the lookup read straight from the stream.
        t = packed.k.tensors
        offset, half_range, k_table, _ = self._tables(layer, t["codes"].device)
        values = self._values(t, k_table, layout, packed)
        values[:-1].mul_(half_range).add_(offset)
        return self._finish(values, t, layout, packed, out)

    def quantize_v(self, layer, x):
        x2d = x.reshape(x.shape[0], -1)
        lut = self.state.v_lut[layer].to(x.device)
        codes, offset, half_range, outliers = nuq.quantize_values(
            x2d, lut, self.sparse, self.state.meta.sparsity_threshold
        )
        return self._pack(x2d, codes, outliers, {"offset": offset, "half_range": half_range})

    def dequantize_v(self, layer, packed, layout, out=None):
        # nuq.dequantize_values, likewise.
        t = packed.v.tensors
        v_table = self._tables(layer, t["codes"].device)[3]
        values = self._values(t, v_table, layout, packed)
        values[:-1].mul_(t["half_range"][:, None]).add_(t["offset"][:, None])
        return self._finish(values, t, layout, packed, out)

    def _tables(self, layer: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """``(k_offset [C], k_half_range [C], k_table, v_table)`` of a layer on ``device`` (made once)."""
        key = (layer, device)
        if key not in self._read_tables:
            s = self.state
            offset, half_range = nuq.key_offset_range(s.k_upper[layer].to(device), s.k_lower[layer].to(device))
            self._read_tables[key] = (
                offset, half_range,
                byte_table(s.k_lut[layer].to(device, torch.float32), self.bits),
                byte_table(s.v_lut[layer].to(device, torch.float32), self.bits),
            )
        return self._read_tables[key]

    def kernel_operands(self, layer, packed, layout) -> KernelOperands:
        s = self.state
        device = packed.k.tensors["codes"].device
        offset, half_range = nuq.key_offset_range(s.k_upper[layer].to(device), s.k_lower[layer].to(device))
        return nuq_operands(
            packed.k.tensors, packed.v.tensors, self.bits, layout.num_slots, packed.num_heads, packed.head_dim,
            offset, half_range,
            s.k_lut[layer].to(device, torch.float32), s.v_lut[layer].to(device, torch.float32),
        )

    # ---- shared by K and V -----------------------------------------------------------------------------------
    def _pack(self, x2d: torch.Tensor, codes: torch.Tensor, outliers: torch.Tensor, extra: dict) -> PackedTensor:
        index = _flat_nonzero(outliers)
        n_out = index.numel()
        tensors = {
            "codes": pack_stream(codes, self.bits),
            "outlier_index": index.to(torch.int32),
            "outlier_values": x2d.flatten()[index],
            **extra,
        }
        return PackedTensor(
            tensors=tensors,
            elements=x2d.numel(),
            nominal_bitsum=float(self.bits * (x2d.numel() - n_out) + 16 * n_out),
        )

    @staticmethod
    def _values(t: dict, table: torch.Tensor, layout: SlotLayout, packed: PackedLayer) -> torch.Tensor:
        """float32 ``[N + 1, C]``: the codebook value of every code, and a spare last row (a new tensor, free to
        modify in place; see :meth:`_finish`)."""
        n, c = layout.num_slots, packed.num_heads * packed.head_dim
        return decode_stream(t["codes"], table, n * c, extra=c).view(n + 1, c)

    @staticmethod
    def _finish(
        values: torch.Tensor, t: dict, layout: SlotLayout, packed: PackedLayer, out: torch.Tensor | None
    ) -> torch.Tensor:
        """Fill in the outliers and place the values (``[N + 1, C]``, the last row spare) into the output."""
        values.view(-1)[t["outlier_index"].long()] = t["outlier_values"].to(values.dtype)
        h, d = packed.num_heads, packed.head_dim
        if layout.batched(h * d):
            values[-1].zero_()
            out = layout.empty_output(h, d, packed.dtype, out)
            return layout.place(layout.take_active(values, spare=True).view(-1, h, d), out)
        return layout.scatter(values[:-1].view(-1, h, d), dtype=packed.dtype, out=out)


def _flat_nonzero(mask: torch.Tensor) -> torch.Tensor:
    """int64 ``[n]``: the flat indices of the True entries of ``mask``, ascending (numpy's ``flatnonzero`` on a
    CPU tensor: several times faster there than ``torch.nonzero``, the same indices)."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(mask.numpy()))
    return mask.flatten().nonzero().squeeze(1)


def fit_state(
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    bits: int,
    spec: ModelSpec,
    provenance: Provenance,
    sparsity_threshold: float = 0.99,
) -> KVQuantState:
    """Fit a whole KVQuant state from per-layer calibration activations (a small fitter, for tests and tools;
    the calibration job owns the real fit over cache traces).

    Args:
        keys, values: one ``[N, C]`` tensor per layer (pre-RoPE keys; ``C = num_kv_heads * head_dim``), or
            ``[B, H, T, D]`` tensors, which are viewed as ``[B * T, H * D]``.
        bits: 2, 4 or 8.
        spec: the model (fingerprint, layers, channels are recorded and checked).
        provenance: what data and code made it.
        sparsity_threshold: 0.99 in the paper.
    """
    fitted = [nuq.fit_layer(_as_2d(k), _as_2d(v), bits, sparsity_threshold) for k, v in zip(keys, values)]
    meta = KVQuantStateMeta(
        model_id=spec.model_id,
        weights_fingerprint=spec.fingerprint,
        bits=bits,
        num_layers=len(fitted),
        channels=spec.num_kv_heads * spec.head_dim,
        sparsity_threshold=sparsity_threshold,
        provenance=provenance,
    )
    k_upper, k_lower, k_lut, v_lut = (torch.stack(parts) for parts in zip(*fitted))
    return KVQuantState(meta, k_upper=k_upper, k_lower=k_lower, k_lut=k_lut, v_lut=v_lut)


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 4:
        return x.transpose(1, 2).reshape(x.shape[0] * x.shape[2], -1)
    return x
