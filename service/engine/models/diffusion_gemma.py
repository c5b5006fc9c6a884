"""DiffusionGemma (``google/diffusiongemma-26B-A4B-it``): one Gemma-4 MoE stack run as two passes over a cache.

Reference: the installed transformers' ``models/diffusion_gemma/modeling_diffusion_gemma.py`` (5.25). What the family
is, read from it (text only):

* **Two passes, one set of weights.** A *causal encoder pass* runs the prompt, and later each committed canvas, and
  writes its K/V into the cache (nothing else of it is used: its hidden states end there). A *bidirectional decoder
  pass* runs the canvas (``canvas_length`` tokens, 256 in the public config) at the positions after the encoded
  length, reads the cached K/V beside the canvas's own, writes nothing, and gives the logits. The encoder's and the
  decoder's weights are tied (one copy on disk); each pass has its own per-layer ``layer_scalar`` that scales the
  layer's output, and only the decoder has the self-conditioning block.
* **Layers** (``DiffusionGemma{Encoder,Decoder}TextLayer``): ``x + post_attn_norm(attn(input_norm(x)))``, then a dense
  gated MLP (tanh-GELU) and a mixture of experts side by side, each with its own pre/post norm, summed, normed and
  added, the result times ``layer_scalar``. Norms (``DiffusionGemmaRMSNorm``) normalise in float32 by
  ``pow(mean(x^2) + eps, -0.5)`` and multiply by the weight itself (not ``1 + weight``).
* **Attention**: per-head RMS norm of q and k (and a weightless one of v), attention scale 1 (the norms fix the
  scale). Two kinds of layers: ``sliding_attention`` (head dim ``head_dim``, own V projection, default RoPE, the
  encoder sees the last ``sliding_window`` positions, the cache keeps the last ``sliding_window - 1``) and
  ``full_attention`` (head dim ``global_head_dim``, ``num_global_key_value_heads``, **V from K**: no V projection,
  V is the weightless norm of the raw K projection; *proportional* RoPE: the first ``partial_rotary_factor * D / 2``
  frequency pairs rotate, the others are frequency 0, i.e. pass unchanged). The decoder is bidirectional over every
  cached key it is given and over the canvas (on sliding layers: the cache's last ``W - 1`` positions).
* **MoE** (``DiffusionGemmaTextRouter`` / ``Experts``): the router reads the layer's residual stream (normed without
  weight, times ``scale`` and ``C^-1/2``), softmax in float32, top K, renormalised, times ``per_expert_scale``;
  the experts (gate-up ``[E, 2I, C]``, down ``[E, C, I]``) read ``pre_feedforward_layernorm_2`` of it; no shared
  expert *inside* the MoE block: the dense MLP beside it plays that part (what the issue calls the shared expert).
* **Head**: final norm, the tied embedding as LM head, float32 logits soft-capped ``cap * tanh(logits / cap)``.
* **Self-conditioning** (``DiffusionGemmaSelfConditioning``): the previous step's processed logits, softmaxed in
  float32, times the embedding matrix and its scale ``sqrt(C)``, through a normed gated MLP, added to the canvas's
  embeddings and normed (weightless); zero at a canvas's first step, never on encoder passes.

Every operation runs in the reference's order and dtype, with the same SDPA call (mask or ``is_causal``, GQA in the
kernel or repeated heads) at batch 1, so float32 logits on CPU are the reference's bit for bit (token-exact
decoding, `service.engine.renoise`). With several rows each row's attention and experts run on its own tensors
(the cache holds rows apart, unpadded), so they round as alone; the projections, norms and MLPs run batched and
round as alone from 4 input rows up (`service.engine.renoise.STACKABLE_TOKENS`).

Shapes use STYLE.md letters: B rows, T tokens, C width, H heads, D head dim, E experts, K experts per token, V vocab.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from service.engine.errors import EngineInputError
from service.engine.models import layers
from service.engine.models.transformer import DiffusionLM, ModelConfig
from service.engine.params import RENOISING_FIELDS
from service.engine.renoise_settings import RenoiseParams, checkpoint_directory, settings_for
from service.engine.reveal import RevealRule

log = logging.getLogger(__name__)

SLIDING, GLOBAL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class DiffusionGemmaConfig(ModelConfig):
    """:class:`ModelConfig` plus DiffusionGemma's numbers (``text_config`` of ``config.json``, and ``canvas_length``).

    ``num_kv_heads``/``head_dim`` are the sliding layers'; the global layers' are ``global_kv_heads`` /
    ``global_head_dim``. ``mask_id`` is ``vocab_size``: the family has no mask token (an id no token has).

    Attributes:
        layer_types: per layer ``"sliding_attention"`` or ``"full_attention"``.
        sliding_window: W; the sliding layers' cache keeps the last ``W - 1`` positions.
        global_rotary_pairs: frequency pairs that rotate on a global layer (``int(factor * D_g // 2)``).
        global_theta: RoPE base of the global layers (``rope_theta`` is the sliding layers').
        softcap: the final logits' soft-cap (None: none).
        num_experts, experts_per_token, moe_hidden: E, K, each expert's hidden size I.
        canvas_length: tokens per canvas. bos_id: beginning-of-sequence id (prompts carry their own).
    """

    layer_types: tuple[str, ...] = ()
    sliding_window: int = 512
    global_head_dim: int = 512
    global_kv_heads: int = 1
    global_rotary_pairs: int = 0
    global_theta: float = 1e6
    softcap: float | None = 30.0
    num_experts: int = 0
    experts_per_token: int = 1
    moe_hidden: int = 0
    canvas_length: int = 256
    bos_id: int = 2

    @property
    def mlp_cost(self) -> tuple[int, int]:
        """Admission's per-column MLP figures (`ModelConfig.mlp_cost`): the dense MLP (``3 I_d``, ``3 C I_d``) and
        the experts beside it (their gate-up and product ``4 K I`` and the per-choice copies ``3 K C``)."""
        k, c, hidden = self.experts_per_token, self.width, self.moe_hidden
        return (3 * self.mlp_hidden + 4 * k * hidden + 3 * k * c,
                3 * c * self.mlp_hidden + 3 * c * k * hidden + c * self.num_experts)

    def layer_kv(self, layer: int) -> tuple[int, int, bool]:
        """(KV heads, head dim, V stored apart from K) of one layer. A global layer's V is a norm of its raw K,
        but attention reads it as a tensor of its own, so the cache holds both."""
        if self.layer_types[layer] == GLOBAL:
            return self.global_kv_heads, self.global_head_dim, True
        return self.num_kv_heads, self.head_dim, True

    def kv_geometry(self) -> list[tuple[int, int, int | None]]:
        """Per layer: (KV heads, head dim, positions a sliding layer keeps (``W - 1``) or None on a global layer):
        what a quantized cache needs to hold each layer (`service.quant.canvas`)."""
        return [(*self.layer_kv(i)[:2], self.sliding_window - 1 if kind == SLIDING else None)
                for i, kind in enumerate(self.layer_types)]

    def kv_bytes_per_token(self, element_size: int) -> dict[str, int]:
        """Bytes of K and V that one committed token adds, per layer kind, all layers of that kind together.

        A sliding layer holds at most ``sliding_window - 1`` positions, so past that its figure is a fixed cost per
        row (``(W - 1) x`` this), not a cost per token; a global layer's grows with the text.
        """
        out = {SLIDING: 0, GLOBAL: 0}
        for layer, kind in enumerate(self.layer_types):
            heads, dim, _ = self.layer_kv(layer)
            out[kind] += 2 * heads * dim * element_size
        return out


    def kv_bytes(self, tokens: int, element_size: int) -> int:
        """Bytes of K and V one row holds with ``tokens`` committed tokens (prompt and canvases), every layer: a
        sliding layer at most ``sliding_window - 1`` positions, a global layer all of them (admission's KV cost,
        `service.runtime.memory.MemoryModel.cost`)."""
        per = self.kv_bytes_per_token(element_size)
        return per[SLIDING] * min(tokens, self.sliding_window - 1) + per[GLOBAL] * tokens

    def sampler_bytes(self, chunk: int = 64) -> int:
        """Transient bytes of one row's denoising step beside its forward: its float32 logits ``[C, V]`` (kept
        as the next step's self-conditioning input) and the sampler's pieces (``~4 x chunk x V`` float32,
        `service.engine.renoise.sample_row`)."""
        return 4 * self.vocab_size * (self.canvas_length + 4 * min(chunk, self.canvas_length))


class GemmaNorm(nn.Module):
    """``DiffusionGemmaRMSNorm``: ``(x32 * pow(mean(x32^2) + eps, -0.5) [* weight32]).type_as(x)``."""

    def __init__(self, width: int, eps: float, with_scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[..., C]`` -> same shape and dtype."""
        h = x.float()
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            h = h * self.weight.float()
        return h.type_as(x)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def inv_freq(head_dim: int, theta: float, rotary_pairs: int | None) -> torch.Tensor:
    """float32 ``[D / 2]``: default RoPE (``rotary_pairs`` None) or proportional RoPE (the first ``rotary_pairs``
    frequencies ``1 / theta^(2j / D)``, zeros after; reference ``_compute_proportional_rope_parameters``)."""
    if rotary_pairs is None:
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rotated = 1.0 / (theta ** (torch.arange(0, 2 * rotary_pairs, 2, dtype=torch.int64).float() / head_dim))
    return torch.cat([rotated, torch.zeros(head_dim // 2 - rotary_pairs)]) if rotary_pairs < head_dim // 2 else rotated


@dataclass
class KeyLayout:
    """One row's SDPA call on one layer kind, as the reference makes it at batch 1 (transformers ``masking_utils``):
    ``mask`` None with ``causal`` (SDPA's ``is_causal``) where it skips the mask, else its boolean mask
    ``[1, 1, T, L]``; the decoder: no mask, not causal. ``keep``: positions the cache keeps after an encoder pass
    (``None``: all; a sliding layer keeps the last ``W - 1``)."""

    mask: torch.Tensor | None
    causal: bool
    keep: int | None = None


@dataclass
class PassInputs:
    """What every layer of one pass shares.

    Attributes:
        rope: per layer kind, (cos, sin) ``[B, T, D]`` in the activation dtype.
        new: per row, its real tokens in this pass (the first ``new[r]`` columns; 0: the row sits this pass out).
        layouts: per row, per layer kind, its :class:`KeyLayout`.
        decoder: the decoder pass (reads the cache) or the encoder pass (writes it).
        cache: the rows' :class:`CanvasCache`.
        last_layer_kv_only: the encoder's last layer computes its K/V only (its output is never read).
    """

    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]
    new: list[int]
    layouts: list[dict[str, KeyLayout] | None]
    decoder: bool
    cache: CanvasCache
    last_layer_kv_only: bool = True

    def whole(self, width: int) -> bool:
        """One row whose tokens fill the pass (batch 1: tensors pass as they are, no per-row slicing)."""
        return len(self.new) == 1 and self.new[0] == width


class CanvasCache:
    """The committed K/V of a batch's rows: written once by encoder passes, read by decoder passes.

    Per layer and row, K and V ``[1, H_kv, S, D]``: a global layer holds every committed position, a sliding layer
    the last ``sliding_window - 1`` only (the reference's ``DynamicSlidingWindowLayer``: its memory does not grow
    with the text). ``length[r]``: row r's committed tokens (prompt + committed canvases), where its next positions
    start. Rows are held apart (not padded into one tensor): each row's attention reads exactly the tensors it
    would read alone, so it rounds as alone.

    With ``packed`` (per row, ``(holder, its row in the holder)`` of a quantized store, `service.quant.canvas.
    PackedCanvas`, or None; made by :func:`make_canvas_cache`) a row's committed K/V are held there, quantized, and
    :meth:`read` gives them dequantized; its ``k``/``v`` entries stay empty. A row without one (the unquantized
    cache) is held as the reference's cache holds it.

    Args:
        config: the model's; batch: B; packed: per row, its quantized holder and row in it, or None; or None.
    """

    def __init__(self, config: DiffusionGemmaConfig, batch: int, packed: list | None = None) -> None:
        self.config = config
        self.k: list[list[torch.Tensor | None]] = [[None] * batch for _ in range(config.num_layers)]
        self.v: list[list[torch.Tensor | None]] = [[None] * batch for _ in range(config.num_layers)]
        self.length = [0] * batch
        self.packed = packed if packed is not None and any(packed) else None

    def _holder(self, row: int):
        return self.packed[row] if self.packed is not None else None

    @classmethod
    def of_rows(cls, rows: list[CanvasCache]) -> CanvasCache:
        """One cache over the first row of each of ``rows`` (a running batch keeps a cache per request row and
        runs a forward over some of them): the same tensors (or packed holders), nothing copied. An encoder
        pass's writes go back with :meth:`write_back` (a packed row's go to its holder: only its length)."""
        packed = [c.packed[0] if c.packed is not None else None for c in rows]
        out = cls(rows[0].config, len(rows), packed)
        for layer in range(len(out.k)):
            out.k[layer] = [c.k[layer][0] for c in rows]
            out.v[layer] = [c.v[layer][0] for c in rows]
        out.length = [c.length[0] for c in rows]
        return out

    def write_back(self, rows: list[CanvasCache]) -> None:
        """Hand the K/V and lengths an encoder pass wrote into this :meth:`of_rows` cache back to ``rows``."""
        for r, cache in enumerate(rows):
            for layer in range(len(self.k)):
                cache.k[layer][0], cache.v[layer][0] = self.k[layer][r], self.v[layer][r]
            cache.length[0] = self.length[r]

    def held(self, row: int, kind: str) -> int:
        """Positions row ``row`` holds on a layer of ``kind``."""
        if not self.length[row]:
            return 0
        return min(self.length[row], self.config.sliding_window - 1) if kind == SLIDING else self.length[row]

    def read(self, layer: int, row: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Row ``row``'s committed K (post-RoPE) and V at ``layer``, ``[1, H_kv, held, D]`` in the model dtype
        (dequantized when packed), or None before its first encoder pass."""
        entry = self._holder(row)
        if entry is not None:
            return entry[0].read(layer, entry[1], self.length[row]) if self.length[row] else None
        k = self.k[layer][row]
        return None if k is None else (k, self.v[layer][row])

    def write(self, layer: int, row: int, k: torch.Tensor, v: torch.Tensor, keep: int | None, new: int,
              k_pre: torch.Tensor | None = None) -> None:
        """After an encoder pass's layer: ``k``/``v`` ``[1, H_kv, held + new, D]`` are the held K/V and the
        ``new`` positions after them (post-RoPE keys); the cache keeps the last ``keep`` (None: all). A packed
        row quantizes only the new positions (``k_pre``: their pre-RoPE keys, ``[1, H_kv, new, D]``, for a
        quantizer that stores those) and drops what falls out of the window."""
        entry = self._holder(row)
        if entry is not None:
            entry[0].write(layer, entry[1], self.length[row], k[:, :, -new:], v[:, :, -new:],
                           None if k_pre is None else k_pre[:, :, -new:])
            return
        self.k[layer][row] = k if keep is None else k[:, :, -keep:]
        self.v[layer][row] = v if keep is None else v[:, :, -keep:]

    @property
    def wants_pre_rope(self) -> bool:
        """Whether some row's :meth:`write` needs the new positions' pre-RoPE keys (KVQuant's format)."""
        return self.packed is not None and any(e is not None and e[0].pre_rope_keys for e in self.packed)

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's held K and V (packed rows: their holders', `PackedCanvas.nbytes`)."""
        holders = {id(e[0]): e[0] for e in self.packed or () if e is not None}
        full = sum(t.numel() * t.element_size() for layer in (*self.k, *self.v) for t in layer if t is not None)
        return full + sum(holder.nbytes for holder in holders.values())

    def row_bytes(self, row: int) -> dict[str, int]:
        """Bytes row ``row`` holds, per layer kind."""
        out = {SLIDING: 0, GLOBAL: 0}
        entry = self._holder(row)
        for index, kind in enumerate(self.config.layer_types):
            if entry is not None:
                out[kind] += entry[0].layer_bytes(index, entry[1])
                continue
            for t in (self.k[index][row], self.v[index][row]):
                out[kind] += t.numel() * t.element_size() if t is not None else 0
        return out


def make_canvas_cache(model: DiffusionGemmaModel, batch: int, kv_store=None) -> CanvasCache:
    """The rows' :class:`CanvasCache` for their KV stores: the one place a renoising decode (CLI, running batch)
    builds it.

    ``kv_store``: one store for every row, or a list with one per row (a running batch's rows of several
    requests). A quantized store (one with ``canvas``, `service.quant.store.QuantizedKVStore.canvas`) holds its
    rows' committed K/V packed (its quantizer; its accounting: the request's report); None or any other store
    (`service.engine.kv_store.FullPrecisionKVStore`): those rows are held unquantized, as the reference's cache.

    Raises:
        ValueError: a list of stores whose length is not ``batch``.
        KVQuantError: what the store raises for a configuration this family cannot run
            (`service.quant.canvas.check_geometry`: dLLM-KVQ scores by attention, a V group size that does not
            divide a layer kind's head dim, a KVQuant state of another width).
    """
    stores = list(kv_store) if isinstance(kv_store, list | tuple) else [kv_store] * batch
    if len(stores) != batch:
        raise ValueError(f"{len(stores)} KV stores for {batch} rows; give one, or one per row")
    rows_of: dict[int, tuple[object, list[int]]] = {}
    for row, store in enumerate(stores):
        if callable(getattr(store, "canvas", None)):
            rows_of.setdefault(id(store), (store, []))[1].append(row)
    packed: list = [None] * batch
    for store, rows in rows_of.values():
        holder = store.canvas(len(rows), model.config.kv_geometry(), model.rotate_keys)
        for index, row in enumerate(rows):
            packed[row] = (holder, index)
    return CanvasCache(model.config, batch, packed)


class Attention(nn.Module):
    """One layer's attention (reference ``DiffusionGemma{Encoder,Decoder}TextAttention``; one module serves both
    passes: the weights are tied)."""

    def __init__(self, config: DiffusionGemmaConfig, layer: int) -> None:
        super().__init__()
        self.kind = config.layer_types[layer]
        heads, self.head_dim, _ = config.layer_kv(layer)
        self.num_heads, self.num_kv_heads = config.num_heads, heads
        self.groups = config.num_heads // heads
        self.q_proj = nn.Linear(config.width, config.num_heads * self.head_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.width, heads * self.head_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.width, heads * self.head_dim, bias=config.qkv_bias) \
            if self.kind == SLIDING else None
        self.o_proj = nn.Linear(config.num_heads * self.head_dim, config.width, bias=config.qkv_bias)
        self.q_norm = GemmaNorm(self.head_dim, config.eps)
        self.k_norm = GemmaNorm(self.head_dim, config.eps)
        self.v_norm = GemmaNorm(self.head_dim, config.eps, with_scale=False)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pre: list | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``[B, T, C]`` -> post-RoPE K and V ``[B, H_kv, T, D]`` (V from the raw K on a global layer);
        ``pre``: a list the pre-RoPE K ``[B, H_kv, T, D]`` is appended to (a quantized cache that stores those)."""
        shape = (*x.shape[:-1], -1, self.head_dim)
        raw_k = self.k_proj(x).view(shape)
        v = self.v_proj(x).view(shape) if self.v_proj is not None else raw_k
        k = self.k_norm(raw_k)
        if pre is not None:
            pre.append(k.transpose(1, 2))
        k = (k * cos[:, :, None]) + (rotate_half(k) * sin[:, :, None])
        return k.transpose(1, 2), self.v_norm(v).transpose(1, 2)

    def forward(self, x: torch.Tensor, inputs: PassInputs, layer: int) -> torch.Tensor | None:
        """x ``[B, T, C]`` -> ``[B, T, C]``; an encoder pass writes the cache (and returns None on the last layer
        when only its K/V are wanted). Each row attends alone over its own cached K/V and its new columns."""
        cos, sin = inputs.rope[self.kind]
        cache = inputs.cache
        pre = [] if not inputs.decoder and cache.wants_pre_rope else None
        k, v = self.kv(x, cos, sin, pre)
        last = not inputs.decoder and inputs.last_layer_kv_only and layer == len(cache.k) - 1
        q = None
        if not last:
            shape = (*x.shape[:-1], -1, self.head_dim)
            q = self.q_norm(self.q_proj(x).view(shape))
            q = ((q * cos[:, :, None]) + (rotate_half(q) * sin[:, :, None])).transpose(1, 2)  # [B, H, T, D]
        whole = inputs.whole(x.shape[1])
        outs = None if whole or last else q.new_zeros(q.shape)
        for r, t in enumerate(inputs.new):
            if not t:
                continue
            k_r, v_r = (k, v) if whole else (k[r:r + 1, :, :t], v[r:r + 1, :, :t])
            held = cache.read(layer, r)
            if held is not None:  # the reference's torch.cat (a fresh contiguous tensor, as its cache returns)
                k_r, v_r = torch.cat([held[0], k_r], dim=-2), torch.cat([held[1], v_r], dim=-2)
            else:
                k_r, v_r = k_r.contiguous(), v_r.contiguous()
            layout = inputs.layouts[r][self.kind]
            if not inputs.decoder:  # the pass attends over its own new K/V as computed; the cache keeps them
                cache.write(layer, r, k_r, v_r, layout.keep, t, None if pre is None else pre[0][r:r + 1, :, :t])
            if last:
                continue
            out = sdpa(q if whole else q[r:r + 1, :, :t], k_r, v_r, layout.mask, layout.causal, self.groups)
            if whole:
                outs = out
            else:
                outs[r:r + 1, :, :t] = out
        if last:
            return None
        return self.o_proj(outs.transpose(1, 2).reshape(*x.shape[:-1], -1))


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
         groups: int) -> torch.Tensor:
    """The reference's SDPA call (transformers ``sdpa_attention_forward``): scale 1; GQA in the kernel when there is
    no mask and ``D <= 256``, one query over packed heads when ``T = 1`` otherwise, else repeated K/V heads.

    q ``[B, H, T, D]``, k/v ``[B, H_kv, L, D]``, mask bool ``[B, 1, T, L]`` or None -> ``[B, H, T, D]``.
    """
    kwargs = {}
    t = q.shape[2]
    packed = False
    if groups > 1:
        if mask is None and k.shape[-1] == v.shape[-1] <= 256:
            kwargs["enable_gqa"] = True
        elif t == 1:
            b, h, _, d = q.shape
            q, packed = q.reshape(b, h // groups, groups, d), True
        else:
            k = k[:, :, None].expand(-1, -1, groups, -1, -1).reshape(k.shape[0], -1, *k.shape[2:])
            v = v[:, :, None].expand(-1, -1, groups, -1, -1).reshape(v.shape[0], -1, *v.shape[2:])
    is_causal = t > 1 and mask is None and causal
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0, is_causal=is_causal, **kwargs)
    return out.reshape(out.shape[0], -1, t, v.shape[-1]) if packed else out


class Experts(nn.Module):
    """Router and routed experts of one layer (reference ``DiffusionGemmaTextRouter`` and the ``grouped_mm`` experts
    of transformers' ``integrations/moe.py``, the reference's default implementation): the (token, choice) pairs
    sorted by expert, one ``grouped_mm`` for gate-up and one for down over the stacked weights, back to pair order,
    summed over the K choices. Where ``grouped_mm`` is missing or refuses the operands, one matmul pair per active
    expert after one host read of the counts."""

    def __init__(self, config: DiffusionGemmaConfig) -> None:
        super().__init__()
        c, e, hidden = config.width, config.num_experts, config.moe_hidden
        self.num_experts, self.top_k, self.root = e, config.experts_per_token, c ** -0.5
        self.router_norm = GemmaNorm(c, config.eps, with_scale=False)
        self.router_proj = nn.Linear(c, e, bias=False)
        self.router_scale = nn.Parameter(torch.ones(c))
        self.per_expert_scale = nn.Parameter(torch.ones(e))
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * hidden, c))
        self.down_proj = nn.Parameter(torch.empty(e, c, hidden))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``[N, C]`` -> (weights float32 ``[N, K]``, expert ids int64 ``[N, K]``)."""
        h = self.router_norm(x) * self.router_scale * self.root
        probs = F.softmax(self.router_proj(h), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, k=self.top_k, dim=-1)
        weights /= weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids

    def forward(self, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """``x`` ``[N, C]`` the experts' input, ``routed`` ``[N, C]`` what the router reads -> ``[N, C]``."""
        weights, ids = self.route(routed)
        n = x.shape[0]
        flat_ids, order = torch.sort(ids.reshape(-1))
        rows = x[order // self.top_k]
        pair_weights = weights.reshape(-1)[order]
        counts = torch.histc(flat_ids.float() if x.device.type in ("cpu", "mps") else flat_ids.int(),
                             bins=self.num_experts, min=0, max=self.num_experts - 1)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        if self._grouped(rows):
            out = F.grouped_mm(rows.to(self.gate_up_proj.dtype), self.gate_up_proj.transpose(-2, -1), offs=offsets)
            gate, up = out.chunk(2, dim=-1)
            out = F.grouped_mm(F.gelu(gate, approximate="tanh") * up, self.down_proj.transpose(-2, -1), offs=offsets)
        else:
            out = self._per_expert(rows, offsets)
        out = out * pair_weights.unsqueeze(-1)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.shape[0], device=x.device)
        return out[inverse].view(n, self.top_k, -1).sum(dim=1).to(x.dtype)

    def _grouped(self, rows: torch.Tensor) -> bool:
        """``grouped_mm`` exists and takes these operands (strides multiples of 16 bytes)."""
        if not hasattr(F, "grouped_mm"):
            return False
        size = rows.element_size()
        return all(n * size % 16 == 0 for n in (rows.shape[-1], self.gate_up_proj.shape[1], self.down_proj.shape[2]))

    def _per_expert(self, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        out = rows.new_zeros(rows.shape[0], self.down_proj.shape[1])
        start = 0
        for expert, end in enumerate(offsets.tolist()):
            if end > start:
                gate, up = F.linear(rows[start:end], self.gate_up_proj[expert]).chunk(2, dim=-1)
                out[start:end] = F.linear(F.gelu(gate, approximate="tanh") * up, self.down_proj[expert])
            start = end
        return out


class GatedMLP(layers.GatedMLP):
    """``down(gelu_tanh(gate(x)) * up(x))`` (reference ``DiffusionGemmaText4MLP``; the self-conditioning block's
    MLP too): the shared gated MLP with Gemma's activation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Layer(nn.Module):
    """One layer, both passes (module doc); ``encoder_scalar`` / ``decoder_scalar`` are the passes' own
    ``layer_scalar``."""

    def __init__(self, config: DiffusionGemmaConfig, index: int) -> None:
        super().__init__()
        c, eps = config.width, config.eps
        self.input_layernorm = GemmaNorm(c, eps)
        self.self_attn = Attention(config, index)
        self.post_attention_layernorm = GemmaNorm(c, eps)
        self.pre_feedforward_layernorm = GemmaNorm(c, eps)
        self.mlp = GatedMLP(c, config.mlp_hidden)
        self.post_feedforward_layernorm_1 = GemmaNorm(c, eps)
        self.pre_feedforward_layernorm_2 = GemmaNorm(c, eps)
        self.experts = Experts(config)
        self.post_feedforward_layernorm_2 = GemmaNorm(c, eps)
        self.post_feedforward_layernorm = GemmaNorm(c, eps)
        self.encoder_scalar = nn.Parameter(torch.ones(1))
        self.decoder_scalar = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor, inputs: PassInputs, index: int) -> torch.Tensor | None:
        attn = self.self_attn(self.input_layernorm(x), inputs, index)
        if attn is None:
            return None
        x = x + self.post_attention_layernorm(attn)
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(x)))
        expert_in = self.pre_feedforward_layernorm_2(x)
        if inputs.whole(x.shape[1]):
            routed = self.experts(expert_in.reshape(-1, x.shape[-1]), x.reshape(-1, x.shape[-1])).reshape(x.shape)
        else:
            # Each row's tokens are grouped by expert alone: grouped_mm rounds a group by its size, so a row's
            # experts computed beside other rows' tokens would not be the ones it computes alone.
            routed = torch.zeros_like(x)
            for r, t in enumerate(inputs.new):
                if t:
                    routed[r, :t] = self.experts(expert_in[r, :t], x[r, :t])
        x = x + self.post_feedforward_layernorm(dense + self.post_feedforward_layernorm_2(routed))
        return x * (self.decoder_scalar if inputs.decoder else self.encoder_scalar)


class SelfConditioning(nn.Module):
    """``post_norm(embeds + mlp(pre_norm(soft)))`` (reference ``DiffusionGemmaSelfConditioning``)."""

    def __init__(self, config: DiffusionGemmaConfig) -> None:
        super().__init__()
        self.pre_norm = GemmaNorm(config.width, config.eps)
        self.post_norm = GemmaNorm(config.width, config.eps, with_scale=False)
        self.mlp = GatedMLP(config.width, config.mlp_hidden)

    def forward(self, embeds: torch.Tensor, soft: torch.Tensor | None) -> torch.Tensor:
        """embeds ``[B, T, C]``; soft ``[B, T, C]`` or None (a canvas's first step: the reference's zero signal, whose
        MLP output is exactly zero, so it is skipped) -> ``[B, T, C]``."""
        if soft is None:
            return self.post_norm(embeds)
        return self.post_norm(embeds + self.mlp(self.pre_norm(soft)))


class RenoisingRule(RevealRule):
    """DiffusionGemma decodes by renoising (`service.engine.renoise`), not by revealing masks: the settings are
    checked by its decoder's rules (`service.engine.renoise.SETTINGS`); the per-row options its sampling does not
    define are refused here, before any work (a 400 naming the field)."""

    remasking = ("low_confidence",)

    def check_request(self, spec, params, rows) -> None:
        """Refuse renoising settings the reference refuses once the checkpoint's ``generation_config.json`` fills
        the ones not given (``t_max`` not above ``t_min`` ...: `service.engine.renoise_settings.settings_for`, here so that
        it is a 400 before any work), ``temperature`` above 0 (its temperature is the t_max .. t_min schedule),
        ``logprobs`` (a committed token is the argmax of a canvas whose other positions were drawn and redrawn: no
        one distribution gave it) and a grammar (structured output, tool calls: each step redraws every position
        it does not accept, so a constrained position would be redrawn unconstrained).

        Raises:
            EngineInputError: naming the renoising field, ``temperature``, ``logprobs`` or ``response_format``.
        """
        settings_for(params, checkpoint_directory(spec))
        for row in rows:
            if row.temperature:
                raise EngineInputError(f"temperature {row.temperature} is not a setting of DiffusionGemma: its "
                                       "temperature follows the t_max .. t_min schedule over each canvas's steps; "
                                       "send t_max and t_min, or leave temperature unset (or 0)", "temperature")
            if row.logprobs is not None:
                raise EngineInputError("logprobs are not defined for DiffusionGemma: a committed token is the "
                                       "argmax of a canvas whose positions were drawn and redrawn over the steps, "
                                       "not a draw from one distribution (nor is a prompt's likelihood, echo with "
                                       "logprobs: the family has no ELBO); leave logprobs unset", "logprobs")
            if row.grammar is not None:
                raise EngineInputError("structured output and tool calls are not served for DiffusionGemma: each "
                                       "denoising step redraws every position it does not accept, so a constrained "
                                       "position would be redrawn unconstrained; leave response_format and "
                                       "tool_choice unset", "response_format")


    def check_defaults(self, directory, config, values, given) -> None:
        """Refuse, at ``serve`` start, a server whose defaults every request would be refused for: renoising
        settings the reference refuses once the checkpoint's ``generation_config.json`` fills the ones not set
        (``--t-max 0.3`` under its t_min 0.4), and a ``block_length`` the operator set to another value than the
        checkpoint's ``canvas_length`` (the built-in 32 is not used: the canvas is the block).

        Raises:
            EngineInputError: naming the field (``block_length``, a renoising field).
        """
        canvas = config.canvas_length
        if "block_length" in given and values["block_length"] != canvas:
            raise EngineInputError(f"block_length {values['block_length']} is not served by this model: its block "
                                   f"is the checkpoint's canvas of {canvas} tokens (canvas_length); leave it "
                                   f"unset or set {canvas}", "block_length")
        where = directory if (directory / "config.json").is_file() else None
        RenoiseParams.for_checkpoint(where, max_new_tokens=canvas,
                                     **{name: values.get(name) for name in RENOISING_FIELDS})


#: Checkpoint names of one layer's text tensors under ``model.decoder.layers.{i}.`` (or the encoder's
#: ``model.encoder.language_model.layers.{i}.``, tied) -> this module's names under ``layers.{i}.``.
_LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "pre_feedforward_layernorm.weight": "pre_feedforward_layernorm.weight",
    "post_feedforward_layernorm.weight": "post_feedforward_layernorm.weight",
    "post_feedforward_layernorm_1.weight": "post_feedforward_layernorm_1.weight",
    "pre_feedforward_layernorm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_feedforward_layernorm_2.weight": "post_feedforward_layernorm_2.weight",
    "self_attn.q_proj.weight": "self_attn.q_proj.weight",
    "self_attn.k_proj.weight": "self_attn.k_proj.weight",
    "self_attn.v_proj.weight": "self_attn.v_proj.weight",
    "self_attn.o_proj.weight": "self_attn.o_proj.weight",
    "self_attn.q_proj.bias": "self_attn.q_proj.bias",
    "self_attn.k_proj.bias": "self_attn.k_proj.bias",
    "self_attn.v_proj.bias": "self_attn.v_proj.bias",
    "self_attn.o_proj.bias": "self_attn.o_proj.bias",
    "self_attn.q_norm.weight": "self_attn.q_norm.weight",
    "self_attn.k_norm.weight": "self_attn.k_norm.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
    "router.proj.weight": "experts.router_proj.weight",
    "router.scale": "experts.router_scale",
    "router.per_expert_scale": "experts.per_expert_scale",
    "experts.gate_up_proj": "experts.gate_up_proj",
    "experts.down_proj": "experts.down_proj",
}
_DECODER, _ENCODER = "model.decoder.", "model.encoder.language_model."
#: Prefixes of the multimodal tensors a text-only engine does not load.
_VISION = ("model.encoder.vision_tower.", "model.encoder.embed_vision.", "model.vision_tower.",
           "model.embed_vision.")


class DiffusionGemmaModel(DiffusionLM):
    """``DiffusionGemmaForBlockDiffusion``, text only: :meth:`encode` (causal, writes the cache) and :meth:`decode`
    (bidirectional over cache + canvas, soft-capped float32 logits)."""

    arch = "diffusion_gemma"
    logits_shift = 0
    #: Its cache is the committed canvases' (``block``, run with ``prefix``'s configuration, as LLaDA2's); the
    #: masked families' ``prefix``/``dual`` mean the same cache here.
    cache_modes: ClassVar[dict[str, str]] = {"prefix": "prefix", "dual": "dual", "block": "prefix"}
    mask_kind: ClassVar[str] = "renoising"
    #: Its decoder (`service.engine.families.DECODERS`): `service.engine.renoise.RenoisingDecoder`.
    decoder: ClassVar[str] = "renoising"
    reveal_rule = RenoisingRule()
    CHECKPOINT_NAMES: ClassVar[dict[str, str]] = {}  # loading maps names itself (tied passes, vision skipped)

    def __init__(self, config: DiffusionGemmaConfig) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.width)
        self.layers = nn.ModuleList(Layer(config, i) for i in range(config.num_layers))
        self.norm = GemmaNorm(config.width, config.eps)
        self.self_conditioning = SelfConditioning(config)
        self._freqs: dict[tuple[str, torch.device], torch.Tensor] = {}

    # ---- config and weights -------------------------------------------------------------------------------------
    @classmethod
    def config_from_hf(cls, hf: dict) -> DiffusionGemmaConfig:
        """Parse a DiffusionGemma ``config.json`` (``DiffusionGemmaConfig``: ``text_config`` and ``canvas_length``).

        Raises:
            ValueError: one line naming a key whose value this implementation does not have
                (``use_bidirectional_attention: all``, a RoPE type other than default/proportional, no experts).
        """
        text = hf.get("text_config") or hf
        if text.get("use_bidirectional_attention") == "all":
            raise ValueError("unsupported DiffusionGemma config: use_bidirectional_attention='all' (a bidirectional "
                             "encoder) is not implemented")
        layers = int(text.get("num_hidden_layers", 30))
        pattern = text.get("layer_types") or [
            SLIDING if (i + 1) % 6 else GLOBAL for i in range(layers)]
        pattern = list(pattern)
        pattern[-1] = GLOBAL  # the reference forces it (with a warning)
        rope = text.get("rope_parameters") or {}
        sliding_rope = rope.get(SLIDING) or {"rope_type": "default", "rope_theta": 10000.0}
        global_rope = rope.get(GLOBAL) or {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                           "rope_theta": 1e6}
        for kind, params in ((SLIDING, sliding_rope), (GLOBAL, global_rope)):
            if params.get("rope_type") not in ("default", "proportional") or params.get("factor", 1.0) != 1.0:
                raise ValueError(f"unsupported DiffusionGemma config: rope_parameters[{kind}]={params!r} is not "
                                 "implemented (default or proportional, factor 1)")
        if sliding_rope.get("rope_type") != "default" or sliding_rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"unsupported DiffusionGemma config: sliding layers' RoPE {sliding_rope!r}")
        if text.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(f"unsupported DiffusionGemma config: hidden_activation={text['hidden_activation']!r}")
        if not text.get("num_experts"):
            raise ValueError("unsupported DiffusionGemma config: num_experts is missing (the family is MoE)")
        heads, kv = int(text.get("num_attention_heads", 8)), int(text.get("num_key_value_heads", 4))
        head_dim = int(text.get("head_dim", 256))
        per_layer = text.get("per_layer_config") or {}
        global_layers = [i for i, kind in enumerate(pattern) if kind == GLOBAL]
        first_global = per_layer.get(str(global_layers[0])) or per_layer.get(global_layers[0]) or {}
        global_dim = int(first_global.get("head_dim", text.get("global_head_dim", 512)))
        global_kv = int(first_global.get("num_key_value_heads", text.get("num_global_key_value_heads") or kv))
        for i in global_layers:  # one shape for every global layer (the reference's per_layer_config does that)
            entry = per_layer.get(str(i)) or per_layer.get(i) or first_global
            if (int(entry.get("head_dim", global_dim)), int(entry.get("num_key_value_heads", global_kv))) != \
                    (global_dim, global_kv):
                raise ValueError(f"unsupported DiffusionGemma config: per_layer_config[{i}]={entry!r} differs from "
                                 "the other global layers")
        factor = float(global_rope.get("partial_rotary_factor", 1.0))
        proportional = global_rope.get("rope_type") == "proportional"
        window = int(text.get("sliding_window", 512))
        eos = text.get("eos_token_id", hf.get("eos_token_id", 1))
        return DiffusionGemmaConfig(
            arch=cls.arch,
            vocab_size=int(text.get("vocab_size", 262144)),
            width=int(text.get("hidden_size", 2304)),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=head_dim,
            mlp_hidden=int(text.get("intermediate_size", 9216)),
            eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=float(sliding_rope.get("rope_theta", 10000.0)),
            rope_full_precision=True,
            qkv_bias=bool(text.get("attention_bias", False)),
            mask_id=int(text.get("vocab_size", 262144)),
            eos_id=int(eos[0] if isinstance(eos, list) else eos),
            pad_id=int(text.get("pad_token_id", hf.get("pad_token_id", 0)) or 0),
            max_length=int(text.get("max_position_embeddings", 131072)),
            layer_types=tuple(pattern),
            sliding_window=window,
            global_head_dim=global_dim,
            global_kv_heads=global_kv,
            global_rotary_pairs=int(factor * global_dim // 2) if proportional else global_dim // 2,
            global_theta=float(global_rope.get("rope_theta", 1e6)),
            softcap=text.get("final_logit_softcapping", 30.0),
            num_experts=int(text["num_experts"]),
            experts_per_token=int(text.get("top_k_experts") or 1),
            moe_hidden=int(text.get("moe_intermediate_size") or 0),
            canvas_length=int(hf.get("canvas_length") or 256),
            bos_id=int(text.get("bos_token_id", hf.get("bos_token_id", 2)) or 2),
        )

    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load the text tensors of a ``DiffusionGemmaForBlockDiffusion`` checkpoint (decoder or encoder names: they
        are tied; each pass's ``layer_scalar`` apart). A vision tower present is skipped (one log line).

        Raises:
            ValueError: a tensor missing, unexpected or misshapen (the message names it).
        """
        vision = [name for name in tensors if name.startswith(_VISION)]
        if vision:
            log.info("DiffusionGemma: text only, skipping the vision tower (%d tensors)", len(vision))
        mine: dict[str, torch.Tensor] = {}
        unexpected = []
        for name, value in tensors.items():
            if name.startswith(_VISION) or name == "lm_head.weight":  # the head is the tied embedding
                continue
            target = self._own_name(name)
            if target is None:
                unexpected.append(name)
            elif target not in mine or name.startswith(_DECODER):  # the decoder's copy wins a (tied) duplicate
                mine[target] = value
        expected = dict(self.state_dict())
        for i in range(self.config.num_layers):  # a pass's scalar left out: the reference's initial value, 1
            for scalar in ("encoder_scalar", "decoder_scalar"):
                mine.setdefault(f"layers.{i}.{scalar}", torch.ones(1, dtype=expected["embed.weight"].dtype,
                                                                   device=next(iter(tensors.values())).device))
        missing = sorted(set(expected) - set(mine))
        unexpected += sorted(set(mine) - set(expected))
        if missing or unexpected:
            raise ValueError(f"{self.arch} checkpoint does not match the architecture: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
        for name, value in mine.items():
            if tuple(value.shape) != tuple(expected[name].shape):
                raise ValueError(f"tensor {name}: shape {tuple(value.shape)}, expected {tuple(expected[name].shape)}")
        self.load_state_dict(mine, strict=True, assign=True)

    @staticmethod
    def _own_name(name: str) -> str | None:
        for prefix in (_DECODER, _ENCODER):
            if not name.startswith(prefix):
                continue
            rest = name[len(prefix):]
            if rest in ("embed_tokens.weight", "norm.weight"):
                return "embed.weight" if rest == "embed_tokens.weight" else "norm.weight"
            if rest.startswith("self_conditioning.") and prefix == _DECODER:
                part = rest[len("self_conditioning."):]
                return f"self_conditioning.mlp.{part}" if part.endswith("_proj.weight") else f"self_conditioning.{part}"
            if rest.startswith("layers."):
                index, _, tail = rest[len("layers."):].partition(".")
                if tail == "layer_scalar":
                    return f"layers.{index}.{'decoder' if prefix == _DECODER else 'encoder'}_scalar"
                if tail in _LAYER_NAMES:
                    return f"layers.{index}.{_LAYER_NAMES[tail]}"
        return None

    # ---- passes ----------------------------------------------------------------------------------------------------
    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per layer kind, cos and sin ``[B, T, D]`` of int64 ``positions`` ``[B, T]`` in ``dtype`` (reference
        ``DiffusionGemmaTextRotaryEmbedding``: float32 angles, ``cat(freqs, freqs)``, cast)."""
        out = {}
        c = self.config
        for kind, dim, theta, pairs in ((SLIDING, c.head_dim, c.rope_theta, None),
                                        (GLOBAL, c.global_head_dim, c.global_theta, c.global_rotary_pairs)):
            key = (kind, positions.device)
            if key not in self._freqs:
                self._freqs[key] = inv_freq(dim, theta, None if pairs is None or pairs >= dim // 2 else pairs).to(positions.device)
            freqs = positions[..., None].float() * self._freqs[key]
            emb = torch.cat((freqs, freqs), dim=-1)
            out[kind] = (emb.cos().to(dtype), emb.sin().to(dtype))
        return out

    def kv_bytes_per_token(self, kind: str, kv_store=None) -> float:
        """Bytes one committed token adds to a row's cache on the layers of ``kind`` (``"sliding_attention"`` or
        ``"full_attention"``; every layer of that kind, K and V), for admission.

        ``kv_store``: the request's store (`service.quant.store.make_kv_store` of its KV configuration); a
        quantized one answers with its quantizer's bytes on a probe at each layer's geometry
        (`service.quant.store.QuantizedKVStore.canvas_bytes_per_token`); None or the full-precision store:
        ``2 x H_kv x D x`` the weights' element size per layer. On a sliding layer the figure applies to at most
        :meth:`kv_positions_held` positions (a fixed cost per row past that), on a global layer to every token.

        Raises:
            ValueError: an unknown ``kind``. KVQuantError: a store configuration the family cannot run.
        """
        c = self.config
        if kind not in (SLIDING, GLOBAL):
            raise ValueError(f"kind must be {SLIDING!r} or {GLOBAL!r}, got {kind!r}")
        probe = getattr(kv_store, "canvas_bytes_per_token", None)
        weight = self.embed.weight
        if not callable(probe):
            return float(c.kv_bytes_per_token(weight.element_size())[kind])
        layers = [i for i, k in enumerate(c.layer_types) if k == kind]
        return float(probe(c.kv_geometry(), layers, weight.dtype, weight.device))

    def kv_positions_held(self, kind: str, kv_store=None) -> int | None:
        """Most positions a row holds on a layer of ``kind``: None on a global layer (all of them); on a sliding
        layer ``W - 1``, or with a quantized store ``W - 1 + k_group_size - 1`` (a K group is dropped whole,
        `service.quant.canvas`)."""
        if kind != SLIDING:
            return None
        quantizer = getattr(kv_store, "quantizer", None)
        extra = quantizer.k_group_size - 1 if callable(getattr(kv_store, "canvas", None)) else 0
        return self.config.sliding_window - 1 + extra

    def rotate_keys(self, layer: int, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s RoPE of pre-RoPE keys ``k`` ``[1, H_kv, T, D]`` at int64 ``positions`` ``[1, T]``
        (what :meth:`Attention.kv` applies; its layer kind's frequencies): a quantized cache holding pre-RoPE keys
        (KVQuant) rotates what it reads with it."""
        cos, sin = self._rope(positions, k.dtype)[self.config.layer_types[layer]]
        return (k * cos[:, None]) + (rotate_half(k) * sin[:, None])

    def _layouts(self, cache: CanvasCache, new: list[int], decoder: bool,
                 device: torch.device) -> list[dict[str, KeyLayout] | None]:
        """Each row's :class:`KeyLayout` per layer kind for a pass adding ``new[r]`` tokens (None: not in it)."""
        return [{kind: self._layout(kind, cache.length[r], cache.held(r, kind), n, decoder, device)
                 for kind in (SLIDING, GLOBAL)} if n else None for r, n in enumerate(new)]

    def _layout(self, kind: str, length: int, held: int, new: int, decoder: bool, device: torch.device) -> KeyLayout:
        """The reference's SDPA call for one row (transformers ``masking_utils``: ``_ignore_causal_mask_sdpa`` and
        the causal / sliding-window mask functions; the decoder: ``create_diffusion_decoder_attention_mask``'s
        None without padding)."""
        window = self.config.sliding_window if kind == SLIDING else None
        keys = held + new
        keep = window - 1 if window is not None and keys > window - 1 else None
        if decoder:
            return KeyLayout(mask=None, causal=False)
        if not (window is not None and keys >= window) and (new == 1 or keys == new or length == 0):
            return KeyLayout(mask=None, causal=True, keep=keep)
        key_pos = torch.arange(length - held, length + new, device=device)
        q_pos = torch.arange(length, length + new, device=device)
        allowed = key_pos[None, :] <= q_pos[:, None]
        if window is not None:
            allowed = allowed & (key_pos[None, :] > q_pos[:, None] - window)
        return KeyLayout(mask=allowed[None, None], causal=False, keep=keep)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """``embed(ids) * sqrt(C)`` with the scale a float32 tensor cast to the weight's dtype (reference
        ``DiffusionGemmaTextScaledWordEmbedding``)."""
        scale = torch.tensor(self.config.width ** 0.5).to(self.embed.weight.dtype)
        return self.embed(ids) * scale

    def encode(self, ids: torch.Tensor, lengths: list[int], cache: CanvasCache) -> None:
        """Encoder pass: run ``ids`` int64 ``[B, T]`` (row r's first ``lengths[r]`` tokens, right-padded; 0: the row
        sits out) causally after each row's committed text and write their K/V into ``cache`` (sliding layers keep
        the last ``W - 1`` positions).

        Positions continue each row's committed length. Nothing is returned: the encoder's hidden states are never
        read (the last layer computes its K/V only).
        """
        t = ids.shape[1]
        positions = torch.tensor(cache.length, device=ids.device)[:, None] + torch.arange(t, device=ids.device)
        x = self._embed(ids)
        inputs = PassInputs(rope=self._rope(positions, x.dtype), new=list(lengths),
                            layouts=self._layouts(cache, lengths, False, ids.device), decoder=False, cache=cache)
        for index, layer in enumerate(self.layers):
            x = layer(x, inputs, index)
        cache.length = [length + n for length, n in zip(cache.length, lengths, strict=True)]

    def decode(self, canvas: torch.Tensor, cache: CanvasCache, soft: torch.Tensor | None = None,
               rows: list[bool] | None = None) -> torch.Tensor:
        """Decoder pass: logits of the canvas ``[B, T]`` int64 at the positions after each row's committed text,
        bidirectional over the cache and the canvas; the cache is read, never written.

        Args:
            soft: the self-conditioning embeddings ``[B, T, C]`` (:meth:`soft_embeddings` of the previous step's
                processed logits) or None (a canvas's first step).
            rows: which rows take part (default: all); the others' logits are not meaningful.

        Returns:
            float32 ``[B, T, V]`` soft-capped logits.
        """
        t = canvas.shape[1]
        positions = torch.tensor(cache.length, device=canvas.device)[:, None] + torch.arange(t, device=canvas.device)
        x = self.self_conditioning(self._embed(canvas), soft)
        new = [t if length else 0 for length in cache.length] if rows is None else [t * bool(r) for r in rows]
        inputs = PassInputs(rope=self._rope(positions, x.dtype), new=new,
                            layouts=self._layouts(cache, new, True, canvas.device), decoder=True, cache=cache)
        for index, layer in enumerate(self.layers):
            x = layer(x, inputs, index)
        logits = F.linear(self.norm(x), self.embed.weight).float()  # [B, T, V]
        if self.config.softcap:  # in place: the reference's three ops without two more [B, T, V] float32 copies
            logits.div_(self.config.softcap).tanh_().mul_(self.config.softcap)
        return logits

    def soft_embeddings(self, logits: torch.Tensor) -> torch.Tensor:
        """The self-conditioning input of processed logits ``[B, T, V]`` (already in the embedding dtype, as the
        reference casts them): ``softmax32(logits).to(E.dtype) @ E * sqrt(C)`` -> ``[B, T, C]``."""
        weight = self.embed.weight
        scale = torch.tensor(self.config.width ** 0.5).to(weight.dtype)
        return torch.matmul(logits.softmax(dim=-1, dtype=torch.float32).to(weight.dtype), weight) * scale

    def forward(self, *args, **kwargs):
        """Not used: the masked families' one-pass forward has no meaning for a two-pass model."""
        raise NotImplementedError("DiffusionGemmaModel runs encode() and decode(), see service.engine.renoise")
