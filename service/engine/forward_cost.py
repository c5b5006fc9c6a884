"""Transient memory and arithmetic of one forward call: the single definition used by admission
(`service.runtime.memory`) and by the plan that merges forwards (`service.runtime.scheduler`), so that what admission
reserves bounds what runs.

A forward over ``rows`` rows of ``tokens`` input columns attending over ``keys`` keys, with logits at
``logits_cols`` columns, holds at its peak about:

* the activations of one layer: residual, norm and q/k/v/o (``6 C`` elements per input column) plus what the
  family declares its MLP holds (`service.engine.models.ModelConfig.mlp_cost`: ``3 M`` for a dense gated MLP of
  hidden size M; LLaDA2's routed and shared experts declare theirs);
* the K/V of one layer over the keys, repeated for GQA (``H`` heads), plus a second copy (the reused K/V put back
  around the fresh window, or a dequantized copy of a quantized store): ``3 x 2 x H x D`` elements per key;
* float32 logits of the LM head at the reveal's columns.

Attention probabilities are not materialised (torch's SDPA runs a flash / memory-efficient kernel with a key mask
on CPU and CUDA). Activations count at the model's element size.

The arithmetic (:meth:`ForwardCost.flops`) counts the projections, the MLP (the family's declared multiply-adds)
and the attention products per input column; the batch uses it to keep padding waste of merged forwards small.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ForwardCost:
    """The numbers of a model that size its forwards.

    Attributes:
        width: C; mlp_activations: activation elements the MLP holds per input column; mlp_macs: the MLP's
        multiply-adds per input column (both declared by the family, `ModelConfig.mlp_cost`); num_heads: H;
        head_dim: D; vocab_size: V; element_size: bytes per activation.
    """

    width: int
    mlp_activations: int
    mlp_macs: int
    num_heads: int
    head_dim: int
    vocab_size: int
    element_size: int

    @classmethod
    def of(cls, model) -> ForwardCost:
        """From a `service.engine.models.DiffusionLM` (its config's declared MLP figures and its weight dtype)."""
        c = model.config
        activations, macs = c.mlp_cost
        return cls(c.width, activations, macs, c.num_heads, c.head_dim, c.vocab_size, model.embed.weight.element_size())

    @classmethod
    def dense(cls, width: int, mlp_hidden: int, num_heads: int, head_dim: int, vocab_size: int,
              element_size: int) -> ForwardCost:
        """A model whose MLP is a dense gated MLP of hidden size ``mlp_hidden`` (``3 M`` elements, ``3 C M``
        multiply-adds per column)."""
        return cls(width, 3 * mlp_hidden, 3 * width * mlp_hidden, num_heads, head_dim, vocab_size, element_size)

    def bytes(self, rows: int, tokens: int, keys: int, logits_cols: int) -> int:
        """Transient bytes of one forward (module docstring); ``rows`` x ``tokens`` input columns (padding
        included), ``keys`` keys per row, ``logits_cols`` logit columns per row."""
        e = self.element_size
        activations = rows * tokens * (6 * self.width + self.mlp_activations) * e
        kv_layer = rows * 3 * 2 * self.num_heads * keys * self.head_dim * e
        return activations + kv_layer + self.logits_bytes(rows * logits_cols)

    def logits_bytes(self, columns: int) -> int:
        """Bytes of the LM head's float32 logits at ``columns`` columns in all (a likelihood forward takes them
        at each row's masked columns only, `service.engine.likelihood.PromptLikelihood`)."""
        return columns * self.vocab_size * 4

    def flops(self, rows: int, tokens: int, keys: int) -> int:
        """Multiply-adds x 2 of one layer: q/k/v/o projections and the MLP per input column, plus
        ``q k^T`` and ``p v`` over ``keys`` keys (GQA counted as full heads)."""
        hd = self.num_heads * self.head_dim
        per_column = 2 * (4 * self.width * hd + self.mlp_macs) + 4 * hd * keys
        return rows * tokens * per_column
