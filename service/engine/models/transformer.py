"""`DiffusionLM`: the bidirectional decoder both architectures share, and its config.

One forward serves training, decoding and calibration:

* plain: ``model(input_ids [B, T], attention_mask [B, T] bool | None) -> logits [B, T, V]``, differentiable;
* decoding: a window of columns with explicit ``positions``, a ``key_mask`` over all keys, a ``kv_hook`` that
  writes/reads the reuse cache, and ``logits_range`` so the LM head runs only on the positions that are decoded;
* calibration: ``kv_hook`` captures every layer's post-RoPE Q/K/V (see :func:`capture_qkv`).

Logits are **position-aligned**: ``logits[:, p]`` is the distribution of the token at column p. For LLaDA that is
the raw LM-head output; Dream predicts column p from the hidden state at p-1, so its logits are shifted by one
column inside the computed window, and the window's first column uses its own hidden state (reference
`generation_utils*.py`: ``cat([logits[:, :1], logits[:, :-1]])``; golden SPEC 2.3).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from service.engine.models.layers import DecoderLayer, ForwardContext, KVHook, RMSNorm, RotaryEmbedding
from service.engine.reveal import RevealRule


@dataclass(frozen=True)
class ModelConfig:
    """Architecture numbers of a checkpoint, read from its ``config.json`` by the model class.

    Attributes:
        arch: the family's name, a key of `service.engine.models.MODEL_CLASSES`.
        vocab_size: rows of the embedding and LM head (logit columns V).
        width: model width C; num_layers: L; num_heads: H; num_kv_heads: H_kv; head_dim: D.
        mlp_hidden: gated-MLP hidden size; eps: RMSNorm epsilon.
        rope_theta: RoPE base; rope_full_precision: rotate in float32 (LLaDA) or in the activation dtype (Dream).
        qkv_bias: q/k/v projections carry biases (Dream).
        mask_id, eos_id, pad_id: special token ids from the config.
        max_length: longest sequence (prompt + response) the model is meant for, in tokens.
    """

    arch: str
    vocab_size: int
    width: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_hidden: int
    eps: float
    rope_theta: float
    rope_full_precision: bool
    qkv_bias: bool
    mask_id: int
    eos_id: int
    pad_id: int
    max_length: int

    @property
    def mlp_cost(self) -> tuple[int, int]:
        """The family's declared MLP figures for admission (`service.engine.forward_cost.ForwardCost`), per input
        column of one layer: (activation elements held at the MLP's peak, multiply-adds). A dense gated MLP of
        hidden size M holds gate, up and their product (``3 M``) and multiplies ``3 C M``; a family with another
        MLP (LLaDA2's experts) overrides this."""
        return 3 * self.mlp_hidden, 3 * self.width * self.mlp_hidden


class DiffusionLM(nn.Module):
    """Embedding -> L pre-norm bidirectional decoder layers -> RMSNorm -> LM head.

    Subclasses (`LLaDAModel`, `DreamModel`) set ``arch``, ``logits_shift``, ``CHECKPOINT_NAMES`` (the public
    checkpoint's tensor names as templates with ``{i}`` for the layer index, mapped to this module's names) and
    ``reveal_rule`` (the family's :class:`~service.engine.reveal.RevealRule`, which the decode loop calls), and
    parse their ``config.json`` in ``config_from_hf``. A subclass missing one of them is refused when it is
    defined (TypeError), so a new family cannot fall back on another's rule.
    """

    arch: ClassVar[str]
    #: The cache modes this family decodes with (the request's ``cache_mode``, `service.engine.params.CacheMode`),
    #: each mapped to the configured cache mode whose KV configuration it runs with (`ConfiguredCacheMode`: the
    #: store's active entry, a request's ``kv_quant`` checked as for it). The engine's checks, the refusal
    #: messages and the API's published schema read this (`service.engine.engine.cache_modes`).
    cache_modes: ClassVar[dict[str, str]] = {"none": "none", "prefix": "prefix", "dual": "dual"}
    #: Attention kind of the family (``bidirectional``; LLaDA2's ``block_causal``), as messages name it.
    mask_kind: ClassVar[str] = "bidirectional"
    #: The decoder that decodes the family (a key of `service.engine.families.DECODERS`): its batch, cohorts,
    #: settings rules and capabilities (`service.engine.protocol.FamilyDecoder`).
    decoder: ClassVar[str] = "bidirectional"
    logits_shift: ClassVar[int]
    CHECKPOINT_NAMES: ClassVar[dict[str, str]]
    reveal_rule: ClassVar[RevealRule]

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        missing = [name for name in ("arch", "logits_shift", "CHECKPOINT_NAMES", "reveal_rule") if not hasattr(cls, name)]
        if missing:
            raise TypeError(f"model family {cls.__name__} must set {', '.join(missing)}")
        if not isinstance(cls.reveal_rule, RevealRule):
            raise TypeError(f"{cls.__name__}.reveal_rule must be a RevealRule, got {type(cls.reveal_rule).__name__}")

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.width)
        self.layers = nn.ModuleList(
            DecoderLayer(
                config.width, config.num_heads, config.num_kv_heads, config.head_dim, config.mlp_hidden,
                config.eps, config.qkv_bias,
            )
            for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.width, config.eps)
        self.lm_head = nn.Linear(config.width, config.vocab_size, bias=False)
        self.rope = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_full_precision)

    @classmethod
    def config_from_hf(cls, hf: dict) -> ModelConfig:
        """Build a :class:`ModelConfig` from the checkpoint's ``config.json`` dict."""
        raise NotImplementedError

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        positions: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
        kv_hook: KVHook | None = None,
        logits_range: tuple[int, int] | None = None,
        logits_at: torch.Tensor | None = None,
        max_position: int | None = None,
        head: bool = True,
        layers: tuple[int, int] | None = None,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Position-aligned logits.

        Args:
            input_ids: int64 ``[B, T]`` (the whole sequence, or the window of columns computed in a cached step).
            attention_mask: bool/int ``[B, T]`` (1 = real token, 0 = left padding) for a plain call; gives
                ``positions`` (count of real tokens before the column) and the key mask when those are not passed.
            positions: int64 ``[B, T]`` absolute RoPE positions of the input columns.
            key_mask: bool ``[B, T_k]`` over the keys attended to when they differ from the input columns
                (cached steps); None with no attention_mask means no padding.
            kv_hook: see :class:`~service.engine.models.layers.KVHook`.
            logits_range: ``(a, b)`` column range of the input whose logits are wanted (default: all). The LM head
                runs only there (the vocabulary projection dominates small windows).
            logits_at: int64 ``[B, N]`` input columns whose logits are wanted, per row (instead of
                ``logits_range``; rows of a continuous batch decode different blocks).
            max_position: an upper bound (exclusive) on ``positions``, when the caller knows it: RoPE's cos/sin
                are then looked up in the model's table (built once per length) instead of computed per forward.
            head: False: no LM head, the last layer's hidden states ``[B, T, C]`` come back instead (a likelihood
                forward runs the head one batch of rows at a time, :meth:`head_logits`).
            layers: ``(a, b)``, run decoder layers ``a .. b-1`` only (default: all). ``a > 0`` starts from
                ``hidden`` (the ``[B, T, C]`` hidden states a call with ``layers=(.., a)`` returned) instead of the
                embedding; ``b`` below the layer count returns the hidden states after layer ``b - 1`` (no LM
                head). Each layer runs the same operations in the same order as in a whole forward, so the ranges
                of one forward called in turn give its logits bit for bit (a block-initial pass split by layers,
                `service.runtime.scheduler.split_by_layers`).

        Returns:
            ``[B, b - a, V]`` (or ``[B, N, V]``) logits in the model dtype, position-aligned (Dream shifted, see module doc).
        """
        b, t = input_ids.shape
        if attention_mask is not None:
            attention_mask = attention_mask.to(torch.bool)
            if positions is None:
                positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
            if key_mask is None and not bool(attention_mask.all()):
                key_mask = attention_mask
        if positions is None:
            positions = torch.arange(t, device=input_ids.device).expand(b, t)
        cos = sin = None
        if max_position is not None:
            cos, sin = self.rope.cos_sin_at(positions, max_position)
        ctx = ForwardContext(positions=positions, key_mask=key_mask, rope=self.rope, kv_hook=kv_hook, cos=cos, sin=sin)
        start, stop = layers if layers is not None else (0, len(self.layers))
        if start and hidden is None:
            raise ValueError(f"layers {start}..{stop - 1} need the hidden states after layer {start - 1}")
        x = self.embed(input_ids) if start == 0 else hidden  # [B, T, C]
        for index in range(start, stop):
            x = self.layers[index](x, ctx, index)
        if not head or stop < len(self.layers):
            return x
        # Dream: column p reads the hidden state at p-1, except the window's first column (reference shift rule).
        if logits_at is not None:
            rows = (logits_at - self.logits_shift).clamp(min=0)  # [B, N]
            return self.lm_head(self.norm(x.gather(1, rows[..., None].expand(-1, -1, x.shape[-1]))))
        return self.head_logits(x, logits_range)

    # ---- a layer in two parts (a likelihood forward in pieces smaller than a layer) ---------------------------
    def rope_columns(self, seq_len: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos, sin ``[1, 1, T, D]`` of columns ``0 .. T-1`` (a plain call's positions, no padding), as
        :meth:`forward` computes them for each row."""
        return self.rope.cos_sin(torch.arange(seq_len, device=device)[None])

    def project_layer(self, index: int, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer ``index``'s q ``[B, H, t, D]``, k, v ``[B, H_kv, t, D]`` (after RoPE) at ``t`` columns: ``hidden``
        ``[B, t, C]`` their input (the hidden states after layer ``index - 1``, or the embedding), ``cos, sin``
        their :meth:`rope_columns` (`service.engine.models.layers.DecoderLayer.project`)."""
        return self.layers[index].project(hidden, self.rope, cos, sin)

    def finish_layer(self, index: int, hidden: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                     ) -> torch.Tensor:
        """Layer ``index``'s output ``[B, t, C]`` at ``t`` query columns, from their input ``hidden`` ``[B, t, C]``
        and queries ``q`` ``[B, H, t, D]`` and every column's ``k, v`` ``[B, H_kv, T, D]`` (no padding). With
        :meth:`project_layer` over every column first, the layer's output of :meth:`forward` bit for bit
        (`tests/engine/test_likelihood_rows.py`)."""
        return self.layers[index].finish(hidden, q, k, v)

    def head_logits(self, hidden: torch.Tensor, logits_range: tuple[int, int] | None = None) -> torch.Tensor:
        """The LM head over hidden states ``[B, T, C]`` (:meth:`forward` with ``head=False``): position-aligned
        logits ``[B, b - a, V]`` at ``logits_range`` (default: every column), as :meth:`forward` returns them."""
        start, end = logits_range if logits_range is not None else (0, hidden.shape[1])
        rows = (torch.arange(start, end, device=hidden.device) - self.logits_shift).clamp(min=0)
        return self.lm_head(self.norm(hidden[:, rows]))

    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy a public checkpoint's tensors (its own names) into this module; every name must match.

        Raises:
            ValueError: a tensor is missing, unexpected, or has the wrong shape (message names them).
        """
        renamed = {self._internal_name(name): value for name, value in tensors.items()}
        expected = dict(self.state_dict())
        missing = sorted(set(expected) - set(renamed))
        unexpected = sorted(set(renamed) - set(expected))
        if missing or unexpected:
            raise ValueError(
                f"{self.arch} checkpoint does not match the architecture: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}"
            )
        for name, value in renamed.items():
            if tuple(value.shape) != tuple(expected[name].shape):
                raise ValueError(f"tensor {name}: shape {tuple(value.shape)}, expected {tuple(expected[name].shape)}")
        self.load_state_dict(renamed, strict=True, assign=True)

    def checkpoint_state_dict(self) -> dict[str, torch.Tensor]:
        """This module's tensors under the public checkpoint's names (for writing a checkpoint)."""
        return {self._public_name(name): value for name, value in self.state_dict().items()}

    @classmethod
    def _internal_name(cls, name: str) -> str:
        return _translate(name, cls.CHECKPOINT_NAMES, "checkpoint")

    @classmethod
    def _public_name(cls, name: str) -> str:
        return _translate(name, {v: k for k, v in cls.CHECKPOINT_NAMES.items()}, "module")


def _translate(name: str, table: dict[str, str], side: str) -> str:
    """Map one tensor name through a template table (``{i}`` = layer index)."""
    for source, target in table.items():
        match = re.fullmatch(re.escape(source).replace(r"\{i\}", r"(\d+)"), name)
        if match:
            return target.replace("{i}", match.group(1)) if match.groups() else target
    raise ValueError(f"unknown {side} tensor name {name!r}")


@dataclass
class LayerQKV:
    """One layer's post-RoPE attention inputs: q ``[B, H, T, D]``, k and v ``[B, H_kv, T, D]``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


def capture_qkv(
    model: DiffusionLM, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, list[LayerQKV]]:
    """Full-recompute forward that also returns every layer's post-RoPE Q, K and V (for calibration).

    Args:
        input_ids: int64 ``[B, T]``; attention_mask: optional ``[B, T]`` (1 = real token).

    Returns:
        (position-aligned logits ``[B, T, V]``, one :class:`LayerQKV` per layer in order). Tensors are detached
        and in the model dtype.
    """
    captured: list[LayerQKV] = []

    def hook(layer, q, k_pre, k, v):
        captured.append(LayerQKV(q.detach(), k.detach(), v.detach()))

    logits = model(input_ids, attention_mask, kv_hook=hook)
    return logits, captured
