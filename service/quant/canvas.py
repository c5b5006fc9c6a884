"""Quantized committed K/V of a renoising family (DiffusionGemma's `CanvasCache`), held packed.

DiffusionGemma writes K/V in its causal encoder pass only (the prompt, then each committed canvas) and reads them
at every decoder step of the next canvases, never writing them again: LLaDA2's committed blocks
(`service.quant.committed`) in another shape. So the same holder keeps them: per row, per layer, the
`service.quant.base.PackedLayer` the request's quantizer made of each committed run (`CommittedBlocks`), and a
read dequantizes them (`CommittedBlocks.read_into`) into a fresh ``[1, H_kv, held, D]`` pair that attention
concatenates with the pass's own K/V, as it does the unquantized cache's tensors.

What is quantized, and when:

* **On write.** The encoder pass computes its new K/V in full precision and attends over them as they are (as the
  masked families' block-initial pass does); what the cache keeps of them is quantized then, once. Every later pass
  reads the dequantized values.
* **Both layer kinds, each its own geometry.** A layer's packed K/V carry their own heads and head dim, so a global
  layer (``global_head_dim``, ``num_global_key_value_heads``) and a sliding one quantize with the same method and
  bits; the V group size must divide both head dims (refused otherwise, naming the legal sizes).
* **V on a global layer is quantized as a V of its own.** The model derives it from the raw K (a weightless norm),
  but attention reads it as a separate tensor, so it is held as one, in V's per-token format; it is not rebuilt
  from the dequantized K (that would carry K's per-channel rounding, divided by the K norm's weights, into V).
* **Sliding layers keep their bound.** A run committed on a sliding layer is cut into pieces of ``k_group_size``
  tokens (each its own K groups, so the codes are the run's, `KVQuantizer.block_separable`), and a piece is dropped
  once all its positions lie before the window: a read takes exactly the last ``W - 1`` positions, the layer holds at
  most ``W - 1 + k_group_size - 1`` (a K group is held whole, with its statistics, until all of it has expired).
  Global layers keep each run whole.
* **KVQuant**: pre-RoPE keys in, each layer kind's RoPE after the read (`DiffusionGemmaModel.rotate_keys`). Its
  state holds one channel count for every layer, so it runs only where both kinds' ``heads x head_dim`` equal it
  (refused otherwise).
* **dLLM-KVQ**: its protected K tokens per group need a score. ``qerror`` (the token's own rounding error) is
  computed from the K/V written, so a policy whose layers rank by it runs as everywhere. ``attention`` and ``hybrid``
  rank by the attention that the *active block's* queries put on each token; here the K/V are written by the
  encoder pass, before the canvas whose queries would read them exists, so a policy that uses those score types
  (with ``p > 0``) is refused with a message saying so.

Bytes per token per layer kind (admission): :func:`bytes_per_token` writes a probe of whole K groups through the
request's own quantizer at each layer's geometry and divides the bytes it holds by the tokens, as
`service.runtime.memory.MemoryModel` probes the other families' stores.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from service.quant.accounting import KVAccounting
from service.quant.base import KVQuantizer
from service.quant.committed import CommittedBlocks
from service.quant.errors import KVQuantError

#: Per layer: (KV heads, head dim, positions a sliding layer reads, None on a global layer).
Geometry = list[tuple[int, int, int | None]]
#: ``rotate_keys(layer, k, positions)``: the layer's RoPE of pre-RoPE keys ``[1, H_kv, T, D]`` at ``[1, T]``.
LayerRotation = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]
#: Whole K groups of the probe of :func:`bytes_per_token` (at least 256 tokens, as the other families' probe).
PROBE_TOKENS = 256


def check_geometry(quantizer: KVQuantizer, geometry: Geometry) -> None:
    """Refuse a configuration a renoising family's committed K/V cannot run (module doc).

    Raises:
        KVQuantError: ``key_bias_correction`` on; dLLM-KVQ policy layers that rank by attention scores; a V group
            size that does not divide a layer's head dim; a KVQuant state whose channel count is not ``heads x
            head_dim`` of every layer.
    """
    method = quantizer.config.method
    check_scores(quantizer)
    for layer, (heads, dim, _) in enumerate(geometry):
        if dim % quantizer.v_group_size:
            legal = [g for g in range(1, dim + 1) if dim % g == 0 and all(d % g == 0 for _, d, _ in geometry)]
            raise KVQuantError(f"v_group_size {quantizer.v_group_size} does not divide layer {layer}'s head dim "
                               f"{dim}; legal for every layer: {legal}", "v_group_size")
        state = getattr(quantizer, "state", None)  # KVQuant's: one [layers, channels] table
        channels = getattr(getattr(state, "meta", None), "channels", None)
        if channels is not None and channels != heads * dim:
            raise KVQuantError(f"--kv-quant {method}: the state has {channels} channels per layer, layer {layer} "
                               f"has {heads} x {dim} = {heads * dim} (its state holds one width for every layer)",
                               "kvquant_state_file")


def check_scores(quantizer: KVQuantizer) -> None:
    """Refuse what the committed K/V's attention here does not apply: the key-bias correction (``field``
    ``key_bias_correction``), and a quantizer that ranks K tokens by attention scores (a dLLM-KVQ policy with ``p >
    0`` layers of score type ``attention`` or ``hybrid``): the geometry-free part of :func:`check_geometry`, which
    the server's one configuration check (`service.store.config_check.check_config`) runs at a swap and on a
    request naming its own.

    Raises:
        KVQuantError: ``field`` ``key_bias_correction``, or ``policy_file`` (the server names its ``policy_id``).
    """
    if quantizer.config.key_bias_correction:
        # The decoder's attention reads the dequantized committed K/V as plain tensors (`PackedCanvas.read`), with
        # no per-key steps and no additive bias: accepting the flag would echo a correction never applied.
        raise KVQuantError(f"--kv-quant {quantizer.config.method}: key_bias_correction is not applied to "
                           "DiffusionGemma's committed K/V (its attention adds no per-key bias yet); leave it off",
                           "key_bias_correction")
    if quantizer.needs_scores:
        raise KVQuantError(f"--kv-quant {quantizer.config.method}: the policy ranks K tokens by attention scores "
                           "(score type attention or hybrid with p > 0), which the active canvas's queries give; "
                           "DiffusionGemma writes its committed K/V in the encoder pass, before that canvas exists: "
                           "use a policy whose layers with p > 0 score by qerror", "policy_file")


class PackedCanvas:
    """The packed committed K/V of a renoising decode's rows (`CanvasCache.packed`; module doc).

    Args:
        quantizer: the request's (its store's); accounting: its store's (the request's KV report).
        rows: per row, its :class:`CommittedBlocks` (held by the store, so its ``bytes_held`` counts them).
        geometry: per layer, (KV heads, head dim, positions read or None).
        rotate_keys: the model's per-layer RoPE (for a quantizer storing pre-RoPE keys).
        keep_dequantized: keep each (layer, row)'s dequantized read until the row's next write (faster decoder
            steps; no memory saved between writes).

    Raises:
        KVQuantError: see :func:`check_geometry`.
    """

    def __init__(self, quantizer: KVQuantizer, accounting: KVAccounting, rows: list[CommittedBlocks],
                 geometry: Geometry, rotate_keys: LayerRotation, keep_dequantized: bool = False) -> None:
        check_geometry(quantizer, geometry)
        self.quantizer, self.accounting, self.rows, self.geometry = quantizer, accounting, rows, geometry
        self.rotate_keys, self.keep_dequantized = rotate_keys, keep_dequantized
        self.pre_rope_keys = quantizer.pre_rope_keys
        self._kept: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def write(self, layer: int, row: int, start: int, k: torch.Tensor, v: torch.Tensor,
              k_pre: torch.Tensor | None) -> None:
        """Quantize row ``row``'s new positions ``[start, start + T)`` at ``layer`` (``k`` post-RoPE, ``v``,
        ``k_pre`` pre-RoPE or None, each ``[1, H_kv, T, D]``, model dtype) and keep them; on a sliding layer drop
        the pieces now wholly before the window.

        Raises:
            NonFiniteKVError: a NaN or inf K or V (`KVQuantizer.quantize`).
        """
        _, _, window = self.geometry[layer]
        held, n = self.rows[row], k.shape[2]
        keys = k_pre if self.pre_rope_keys else k
        piece = self.quantizer.k_group_size if window is not None else n
        for a in range(0, n, piece):
            b = min(a + piece, n)
            packed = self.quantizer.quantize(layer, keys[:, :, a:b], v[:, :, a:b], held._layout(b - a, k.device))
            self.accounting.add(layer, packed)
            held.add(layer, start + a, start + b, packed)
        if window is not None:
            first = start + n - window
            blocks = held.layers[layer]
            for _, _, packed in (x for x in blocks if x[1] <= first):
                self.accounting.drop(packed)
            held.layers[layer] = [x for x in blocks if x[1] > first]
        self._kept.pop((layer, row), None)

    def read(self, layer: int, row: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ``row``'s committed K (post-RoPE) and V at ``layer`` after ``length`` committed tokens, dequantized:
        ``[1, H_kv, held, D]`` each (a sliding layer: its last ``W - 1`` positions)."""
        if (layer, row) in self._kept:
            return self._kept[(layer, row)]
        heads, dim, window = self.geometry[layer]
        held = self.rows[row]
        blocks = held.layers[layer]
        offset, first = blocks[0][0], 0 if window is None else max(0, length - window)
        packed = blocks[0][2]
        shape = (1, heads, length - offset, dim)
        k_buf = torch.empty(shape, dtype=packed.dtype, device=packed_device(packed))
        v_buf = torch.empty_like(k_buf)
        held.read_into(layer, 0, k_buf, v_buf, lambda x, positions: self.rotate_keys(layer, x, positions),
                       offset=offset)
        out = (k_buf[:, :, first - offset:], v_buf[:, :, first - offset:])
        if self.keep_dequantized:
            self._kept[(layer, row)] = out
        return out

    def layer_bytes(self, layer: int, row: int) -> int:
        """Bytes of row ``row``'s packed K/V at ``layer`` (codes, scales, minima, protected tokens, outliers, and
        the index tensors derived from them)."""
        return sum(p.nbytes + p.derived_nbytes for _, _, p in self.rows[row].layers.get(layer, ()))

    @property
    def nbytes(self) -> int:
        """Bytes held: every row's packed layers and read layouts, and the dequantized reads kept."""
        kept = sum(t.numel() * t.element_size() for pair in self._kept.values() for t in pair)
        return sum(held.nbytes for held in self.rows) + kept


def packed_device(packed) -> torch.device:
    """The device of a packed layer's tensors."""
    return next(iter(packed.k.tensors.values())).device


def bytes_per_token(quantizer: KVQuantizer, geometry: Geometry, layers: list[int], dtype: torch.dtype,
                    device: torch.device | str = "cpu") -> float:
    """Bytes the quantizer holds per committed token over ``layers`` (K and V, summed over those layers): a
    :class:`PackedCanvas` of one row is written a probe of whole K groups (at least :data:`PROBE_TOKENS` tokens) of
    seeded normal K/V at each layer's geometry, cut as the cache cuts it (pieces on a sliding layer, none dropped),
    read once (the index tensors a read derives are held too), and its bytes divided by the tokens.

    Exact for KIVI and dLLM-KVQ on runs of the probe's cut (their bytes depend on counts only); KVQuant's outliers
    are the probe's (about ``1 - sparsity_threshold`` of the entries), as the other families' admission probe
    counts them.

    Raises:
        KVQuantError: see :func:`check_geometry`.
    """
    g = quantizer.k_group_size
    tokens = g * -(-PROBE_TOKENS // g)
    # Sliding layers keep every piece of the probe (a window past its end), so all its tokens are held.
    probe = [(h, d, None if w is None else tokens + 1) for h, d, w in geometry]
    canvas = PackedCanvas(quantizer, KVAccounting(), [CommittedBlocks(quantizer)], probe, lambda _, k, __: k)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.inference_mode():
        for layer in layers:
            heads, dim, _ = geometry[layer]
            k, v = (torch.randn(1, heads, tokens, dim, generator=gen, device=device).to(dtype) for _ in range(2))
            canvas.write(layer, 0, 0, k, v, k)
            canvas.read(layer, 0, tokens)
    return sum(canvas.layer_bytes(layer, 0) for layer in layers) / tokens
