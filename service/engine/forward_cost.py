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

    def layer_stages(self, keys: int, num_layers: int, sublayer: bool = True) -> LayerStages:
        """A likelihood forward's work per column of one layer, in tokens' worth (the unit of
        ``layer_split_tokens``: one token through every layer's projections and MLP, its attention left out, as a
        decoding pass's piece counts it): (the q/k/v projections of a column, the rest of a query column: its
        attention over ``keys`` keys, the output projection and the MLP). They add up to :meth:`flops` of one
        column over ``flops(1, 1, 0) x num_layers`` (`service.runtime.scheduler.likelihood_piece`); ``sublayer`` as
        :class:`LayerStages` says."""
        hd = self.num_heads * self.head_dim
        token = self.flops(1, 1, 0) * num_layers
        project = 2 * 3 * self.width * hd
        return LayerStages(project / token, (self.flops(1, 1, keys) - project) / token, sublayer)


@dataclass(frozen=True)
class LayerStages:
    """A likelihood forward's work per column of one layer, in tokens' worth (the unit of ``layer_split_tokens``,
    :meth:`ForwardCost.layer_stages`): ``project`` a column's q/k/v projections, ``rest`` a
    query column's attention over every key, output projection and MLP. ``sublayer``: the model runs a layer in
    these two parts (`service.engine.models.DiffusionLM.project_layer` / ``finish_layer``); else only whole
    layers."""

    project: float
    rest: float
    sublayer: bool = True


def likelihood_work(tokens: int, units: tuple[int, int], stages: LayerStages) -> float:
    """Tokens' worth of work of the units ``(a, b)`` of a likelihood forward of ``tokens`` columns (rows x width).

    A forward's work is a line of units, ``2 x tokens`` per layer in layer order: first each column's projections
    (``tokens`` units of ``stages.project``), then each query column's rest (``tokens`` units of ``stages.rest``);
    a piece (`service.runtime.scheduler.likelihood_piece`) is a stretch of it."""

    def done(u: int) -> float:
        layers, offset = divmod(u, 2 * tokens)
        return (layers * tokens * (stages.project + stages.rest) + min(offset, tokens) * stages.project
                + max(0, offset - tokens) * stages.rest)

    return done(units[1]) - done(units[0])
