"""Transient memory and arithmetic of one forward call: the single definition used by admission
(`service.runtime.memory`) and by the plan that merges forwards (`service.runtime.scheduler`), so that what admission
reserves bounds what runs.

A forward over ``rows`` rows of ``tokens`` input columns attending over ``keys`` keys, with logits at
``logits_cols`` columns, holds at its peak about:

* the activations of one layer: residual, norm, q/k/v/o and the MLP's gate/up/activation, ``6 C + 3 M`` elements
  per input column;
* the K/V of one layer over the keys, repeated for GQA (``H`` heads), plus a second copy (the reused K/V put back
  around the fresh window, or a dequantized copy of a quantized store): ``3 x 2 x H x D`` elements per key;
* float32 logits of the LM head at the reveal's columns.

Attention probabilities are not materialised (torch's SDPA runs a flash / memory-efficient kernel with a key mask
on CPU and CUDA). Activations count at the model's element size.

The arithmetic (:meth:`ForwardCost.flops`) counts the projections, the MLP and the attention products per input
column; the batch uses it to keep padding waste of merged forwards small.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ForwardCost:
    """The numbers of a model that size its forwards.

    Attributes:
        width: C; mlp_hidden: M; num_heads: H; head_dim: D; vocab_size: V; element_size: bytes per activation.
    """

    width: int
    mlp_hidden: int
    num_heads: int
    head_dim: int
    vocab_size: int
    element_size: int

    @classmethod
    def of(cls, model) -> ForwardCost:
        """From a `service.engine.models.DiffusionLM` (its config and weight dtype)."""
        c = model.config
        return cls(c.width, c.mlp_hidden, c.num_heads, c.head_dim, c.vocab_size, model.embed.weight.element_size())

    def bytes(self, rows: int, tokens: int, keys: int, logits_cols: int) -> int:
        """Transient bytes of one forward (module docstring); ``rows`` x ``tokens`` input columns (padding
        included), ``keys`` keys per row, ``logits_cols`` logit columns per row."""
        e = self.element_size
        activations = rows * tokens * (6 * self.width + 3 * self.mlp_hidden) * e
        kv_layer = rows * 3 * 2 * self.num_heads * keys * self.head_dim * e
        return activations + kv_layer + self.logits_bytes(rows * logits_cols)

    def logits_bytes(self, columns: int) -> int:
        """Bytes of the LM head's float32 logits at ``columns`` columns in all (a likelihood forward takes them
        at each row's masked columns only, `service.engine.likelihood.PromptLikelihood`)."""
        return columns * self.vocab_size * 4

    def flops(self, rows: int, tokens: int, keys: int) -> int:
        """Multiply-adds x 2 of one layer: q/k/v/o projections and the gated MLP per input column, plus
        ``q k^T`` and ``p v`` over ``keys`` keys (GQA counted as full heads)."""
        hd = self.num_heads * self.head_dim
        per_column = 2 * (4 * self.width * hd + 3 * self.width * self.mlp_hidden) + 4 * hd * keys
        return rows * tokens * per_column
