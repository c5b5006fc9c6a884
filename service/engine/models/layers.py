"""Shared transformer layers of LLaDA and Dream: RMSNorm, rotary embedding, attention, gated MLP, decoder layer.

Both architectures are a Llama-style pre-norm decoder with **bidirectional** attention (no causal mask). The
numerics follow the reference modelling code (NVlabs/Fast-dLLM `llada/model/modeling_llada.py`,
`dream/model/modeling_dream.py`; golden SPEC sections 1.3 and 2.3) so that fp32 logits match the goldens and a bf16
model does the same casts as the reference:

* RMSNorm normalises in float32, casts back to the activation dtype, *then* multiplies by the weight.
* RoPE is NeoX "rotate-half"; LLaDA rotates q/k in float32 (``rope_full_precision``), Dream casts cos/sin to the
  activation dtype and rotates in it.
* Attention is ``F.scaled_dot_product_attention`` with a key-padding mask; GQA repeats each kv head for
  ``num_heads // num_kv_heads`` consecutive query heads (``repeat_interleave``, as both references do).

Shapes use STYLE.md letters: B batch, T tokens, C model width, H heads, D head dim.

The K/V seam: every attention layer hands its freshly computed q, pre-RoPE k, post-RoPE k and v to an optional
``kv_hook`` (see :class:`KVHook`). Decoding uses it to write the reuse cache in the block-initial pass and to put
reused K/V next to the fresh window in later steps; calibration uses it to capture post-RoPE Q/K/V.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm with a weight and no bias (LLaDA ``layer_norm_type: rms``; Qwen2RMSNorm for Dream).

    ``y = weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``: the normalisation runs in float32 and is cast back
    to the input dtype before the weight multiply (reference op order; matters in bf16).
    """

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: ``[..., C]`` any float dtype -> same shape and dtype (the weight's dtype wins under promotion)."""
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """NeoX/Llama rotate-half RoPE at absolute per-row positions.

    ``inv_freq[j] = 1 / theta^(2j/D)`` in float32; angle = position x inv_freq; the D dims use
    ``cat(angles, angles)``; ``rot(t) = cat(-t[D/2:], t[:D/2])``; ``t' = t cos + rot(t) sin``.

    Args:
        head_dim: D (even).
        theta: RoPE base (LLaDA ``rope_theta`` 5e5, Dream 1e6).
        full_precision: True rotates in float32 and casts back (LLaDA ``rope_full_precision``); False casts cos/sin
            to the activation dtype and rotates in it (Dream).
    """

    def __init__(self, head_dim: int, theta: float, full_precision: bool) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for rotate-half RoPE, got {head_dim}")
        self.head_dim = head_dim
        self.theta = float(theta)
        self.full_precision = full_precision
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def inv_freq(self, device: torch.device | str) -> torch.Tensor:
        """float32 ``[D / 2]``: ``1 / theta^(2j/D)`` (also read by the fused attention kernel, which rotates
        pre-RoPE reused keys itself)."""
        # Computed per call (64 values): no buffer, so a meta-device model needs nothing re-initialised.
        exponent = torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32) / self.head_dim
        return 1.0 / (self.theta**exponent)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: int64 ``[B, T]`` -> float32 cos, sin ``[B, 1, T, D]``."""
        angles = positions.to(torch.float32)[..., None] * self.inv_freq(positions.device)  # [B, T, D/2]
        angles = torch.cat([angles, angles], dim=-1)[:, None]  # [B, 1, T, D]
        return angles.cos(), angles.sin()

    def table(self, length: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos, sin ``[L, D]`` of positions ``0 .. L-1`` with ``L >= length``, built once per device and
        grown (to the next power of two, at least 1024) only when a longer sequence comes: a forward looks its
        positions up (:meth:`cos_sin_at`) instead of computing them at every layer. Each entry is the value
        :meth:`cos_sin` computes for that position (the same float32 product and cos/sin, elementwise)."""
        device = torch.device(device)
        held = self._tables.get(device)
        if held is None or held[0].shape[0] < length:
            size = max(1024, 1 << max(0, length - 1).bit_length())
            cos, sin = self.cos_sin(torch.arange(size, device=device)[None])
            held = (cos[0, 0], sin[0, 0])
            self._tables[device] = held
        return held

    def cos_sin_at(self, positions: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`cos_sin` of ``positions`` int64 ``[B, T]`` (every value below ``length``), looked up in the
        table: float32 cos, sin ``[B, 1, T, D]``."""
        cos, sin = self.table(length, positions.device)
        return cos[positions][:, None], sin[positions][:, None]

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: ``[B, H, T, D]``; positions: int64 ``[B, T]`` -> rotated x, same dtype."""
        return self.rotate_with(x, *self.cos_sin(positions))

    def rotate_with(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """:meth:`rotate` with ``cos, sin = cos_sin(positions)`` computed once by the caller (a store that rotates
        the same reused positions at every layer keeps them)."""
        if self.full_precision:
            t = x.to(torch.float32)
        else:
            t, cos, sin = x, cos.to(x.dtype), sin.to(x.dtype)
        half = self.head_dim // 2
        rotated = torch.cat([-t[..., half:], t[..., :half]], dim=-1)
        return (t * cos + rotated * sin).to(x.dtype)

    def rotate_in_place(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate ``x`` ``[B, H, T, D]`` (any view, e.g. some columns of a larger buffer) in place, bit for bit
        :meth:`rotate_with`: where the rotation runs in x's own dtype (float32, or ``full_precision`` off) the
        halves are updated with four products and two sums per element pair, ``x1 cos - x2 sin`` and ``x2 cos +
        x1 sin``, the same roundings as ``t cos + rotate_half(t) sin`` without its negated copy and
        concatenation; otherwise (bf16 with ``full_precision``) through :meth:`rotate_with`."""
        if self.full_precision and x.dtype != torch.float32:
            x.copy_(self.rotate_with(x, cos, sin))
            return
        if not self.full_precision:
            cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        half = self.head_dim // 2
        x1, x2 = x[..., :half], x[..., half:]
        x2_sin = x2 * sin[..., :half]
        x1_sin = x1 * sin[..., half:]
        x1.mul_(cos[..., :half]).sub_(x2_sin)
        x2.mul_(cos[..., half:]).add_(x1_sin)


class KVHook(Protocol):
    """Called by every attention layer once its q/k/v exist (before attending).

    Args:
        layer: 0-based layer index.
        q: ``[B, H, T, D]`` queries after RoPE.
        k_pre: ``[B, H_kv, T, D]`` keys before RoPE; k: the same after RoPE; v: ``[B, H_kv, T, D]``.

    Returns:
        ``None`` to attend over the fresh k/v, ``(k_all, v_all)`` ``[B, H_kv, T_k, D]`` (post-RoPE keys) to
        attend over instead, e.g. reused cache columns put next to the fresh window, or the attention output
        itself, one tensor ``[B, H, T, D]`` (a store that attends straight from its packed cache, see
        `service.engine.kv_store.KVStore.attend`).
    """

    def __call__(
        self, layer: int, q: torch.Tensor, k_pre: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor | None: ...


@dataclass
class ForwardContext:
    """What every layer of one forward call shares.

    Attributes:
        positions: int64 ``[B, T]`` absolute RoPE positions of the input columns.
        key_mask: bool ``[B, T_k]`` (True = attend) over the keys attended to, or None for no padding.
        rope: the model's rotary embedding.
        kv_hook: optional :class:`KVHook`.
        cos, sin: float32 ``[B, 1, T, D]`` RoPE tables of ``positions`` (made once per forward).
    """

    positions: torch.Tensor
    key_mask: torch.Tensor | None
    rope: RotaryEmbedding
    kv_hook: KVHook | None = None
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None

    def __post_init__(self) -> None:
        # RoPE's cos/sin are the same at every layer: made once per forward (looked up in the model's table when
        # the caller states the longest position, else computed from the positions).
        if self.cos is None:
            self.cos, self.sin = self.rope.cos_sin(self.positions)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
    """Bidirectional SDPA with GQA and key padding.

    Args:
        q: ``[B, H, Tq, D]``; k, v: ``[B, H_kv, Tk, D]`` with H a multiple of H_kv (query head h uses kv head
            ``h // (H / H_kv)``); key_mask: bool ``[B, Tk]`` or None.

    Returns:
        ``[B, H, Tq, D]`` in q's dtype. Scale is 1/sqrt(D) (SDPA default, as in both references).
    """
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    mask = None if key_mask is None else key_mask[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False)


class Attention(nn.Module):
    """Multi-head (grouped-query) self-attention with separate q/k/v projections and an output projection.

    Args:
        width: C; num_heads: H; num_kv_heads: H_kv; head_dim: D; qkv_bias: q/k/v projections have biases (Dream).
    """

    def __init__(self, width: int, num_heads: int, num_kv_heads: int, head_dim: int, qkv_bias: bool) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(width, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(width, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(width, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, width, bias=False)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, layer: int) -> torch.Tensor:
        """x: ``[B, T, C]`` -> ``[B, T, C]``."""
        q, k_pre, k, v = self.project(x, ctx.rope, ctx.cos, ctx.sin)
        replaced = None if ctx.kv_hook is None else ctx.kv_hook(layer, q, k_pre, k, v)
        if isinstance(replaced, torch.Tensor):  # the hook attended itself (fused kernel over a packed cache)
            out = replaced
        else:
            if replaced is not None:
                k, v = replaced
            out = attend(q, k, v, ctx.key_mask)  # [B, H, T, D]
        return self.output(out)

    def project(self, x: torch.Tensor, rope: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The queries and keys of ``x`` ``[B, T, C]`` (already normed): q ``[B, H, T, D]`` after RoPE, k before
        and after RoPE and v ``[B, H_kv, T, D]``, with ``cos, sin`` float32 ``[B or 1, 1, T, D]`` of its columns.
        Per column: a run over some columns gives those columns' values of a run over all of them (a likelihood
        forward in pieces smaller than a layer, `service.engine.likelihood.PromptLikelihood.step`)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k_pre = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, H_kv, T, D]
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return rope.rotate_with(q, cos, sin), k_pre, rope.rotate_with(k_pre, cos, sin), v

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """The output projection of the attention's result ``[B, H, T, D]``: ``[B, T, C]``."""
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` (LLaDA ``ff_proj``/``up_proj``/``ff_out``; Dream ``gate/up/down_proj``)."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(width, hidden, bias=False)
        self.up_proj = nn.Linear(width, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(
        self, width: int, num_heads: int, num_kv_heads: int, head_dim: int, mlp_hidden: int, eps: float,
        qkv_bias: bool,
    ) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(width, eps)
        self.attn = Attention(width, num_heads, num_kv_heads, head_dim, qkv_bias)
        self.mlp_norm = RMSNorm(width, eps)
        self.mlp = GatedMLP(width, mlp_hidden)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, layer: int) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), ctx, layer)
        return x + self.mlp(self.mlp_norm(x))

    # The layer in two parts, for a forward run in pieces smaller than a layer (a likelihood forward,
    # `service.engine.likelihood.PromptLikelihood.step`): in a bidirectional layer every query needs the K/V of
    # every column, so the projections of all columns come first (:meth:`project`, per column), then the rest per
    # query column (:meth:`finish`: attention of those queries over all keys, output projection, MLP). Each part
    # runs the operations of :meth:`forward` on the same values.
    def project(self, x: torch.Tensor, rope: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[B, H, T, D]``, k, v ``[B, H_kv, T, D]`` (after RoPE) of the layer's input ``x`` ``[B, T, C]``, with
        ``cos, sin`` float32 ``[B or 1, 1, T, D]`` of its columns (:meth:`Attention.project`)."""
        q, _, k, v = self.attn.project(self.attn_norm(x), rope, cos, sin)
        return q, k, v

    def finish(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output ``[B, t, C]`` at ``t`` query columns: ``x`` ``[B, t, C]`` their input, ``q``
        ``[B, H, t, D]`` their queries, ``k, v`` ``[B, H_kv, T, D]`` every column's (:meth:`project`)."""
        x = x + self.attn.output(attend(q, k, v, key_mask))
        return x + self.mlp(self.mlp_norm(x))
