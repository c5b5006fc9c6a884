"""LLaDA2.x (inclusionAI/LLaDA2.0-mini, -flash; LLaDA2.1): a MoE diffusion LM decoded block-causally.

Reference: the HF remote code ``modeling_llada2_moe.py`` / ``modeling_llada21_moe.py`` (copied, with their
README, in ZHZisZZ/dllm ``dllm/pipelines/llada2*/models/``); tests/data/llada2/README.md says what the goldens in
this repository are. What differs from LLaDA/Dream (`service.engine.models.layers`):

* attention: one fused ``query_key_value`` projection (q, k, v rows in that order), a per-head RMS norm of q and k
  (``query_layernorm``/``key_layernorm``) *before* RoPE, and **partial** RoPE: only the first
  ``head_dim * partial_rotary_factor`` channels rotate (rotate-half over those channels, cos/sin in the activation
  dtype as the reference casts them); the output projection is ``dense``;
* the mask is **block-causal**: bidirectional inside a block of ``block_length`` positions, causal across blocks
  (reference ``generate``: ``log(tril(ones(blocks, blocks)))`` repeated per block), so a committed block's K/V never
  change (`service.engine.block_causal` keeps them once);
* MLP: layers below ``first_k_dense_replace`` are dense; the others are a mixture of experts (:class:`SparseMoE`).

Shapes use STYLE.md letters: B batch, T tokens, C width, H heads, D head dim, E experts, K experts per token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from service.engine.models.layers import GatedMLP, RMSNorm, RotaryEmbedding
from service.engine.models.transformer import DiffusionLM, ModelConfig
from service.engine.reveal import RevealRule

#: config.json values this implementation does not have: key -> the value (or predicate) it supports.
_SUPPORTED = {
    "rope_scaling": lambda v: v is None,
    "use_sliding_window": lambda v: not v,
    "norm_head": lambda v: not v,
    "tie_word_embeddings": lambda v: not v,
    "score_function": lambda v: v in (None, "sigmoid"),
    "router_dtype": lambda v: v in (None, "fp32", "float32"),
    "hidden_act": lambda v: v in (None, "silu"),
    "expert_capacity": lambda v: not v,
    "moe_router_topk_scaling": lambda v: v in (None, "none"),
}


@dataclass(frozen=True)
class LLaDA2Config(ModelConfig):
    """:class:`ModelConfig` plus what LLaDA2 adds.

    Attributes:
        rotary_dim: channels of each head that RoPE rotates (``head_dim * partial_rotary_factor``).
        qk_norm: q and k are RMS-normalised per head before RoPE (``use_qk_norm``).
        dense_bias: the attention output projection has a bias (``use_bias``).
        first_dense: layers ``0 .. first_dense - 1`` are dense (``first_k_dense_replace``).
        num_experts: E (0: every layer dense); experts_per_token: K; expert_groups: ``n_group``;
            groups_per_token: ``topk_group``; moe_hidden: each expert's hidden size; shared_experts: how many
            experts' width the shared expert has (0: none); routed_scale: ``routed_scaling_factor``.
        editing: the checkpoint is LLaDA2.1 (token editing is its default decoding; ``model_type llada21_moe``).
    """

    rotary_dim: int = 0
    qk_norm: bool = True
    dense_bias: bool = False
    first_dense: int = 0
    num_experts: int = 0
    experts_per_token: int = 1
    expert_groups: int = 1
    groups_per_token: int = 1
    moe_hidden: int = 0
    shared_experts: int = 0
    routed_scale: float = 1.0
    editing: bool = False

    @property
    def mlp_cost(self) -> tuple[int, int]:
        """Admission's MLP figures per input column (`ModelConfig.mlp_cost`) of the costliest layer kind.

        A MoE layer (`SparseMoE.forward`) holds, per column, for its K chosen experts of hidden size I: the input
        gathered per choice, the experts' output, its copy back in (token, choice) order and the weighted sum's
        float32 copy and product (``7 K C`` at bf16, where the float32 ones count twice; ``4 K C`` at float32);
        the experts' gate/up, activation and product (``4 K I``); the shared expert's gate, up and product
        (``3 S I``). Counted together, ``7 K C + 4 K I + 3 S I`` bounds the live peak measured per column in
        float32 and bfloat16 (tests/engine/test_family.py); it is not the dense ``intermediate_size``, which a MoE
        layer never holds. Multiply-adds: ``3 C (K + S) I`` plus the router's ``C E``. The dense layers before
        ``first_dense`` count when they are larger."""
        dense = super().mlp_cost if self.first_dense or not self.num_experts else (0, 0)
        if not self.num_experts:
            return dense
        k, c, hidden, shared = self.experts_per_token, self.width, self.moe_hidden, self.shared_experts * self.moe_hidden
        moe = 7 * k * c + 4 * k * hidden + 3 * shared, 3 * c * (k * hidden + shared) + c * self.num_experts
        return max(dense[0], moe[0]), max(dense[1], moe[1])


def block_causal_mask(query_positions: torch.Tensor, key_positions: torch.Tensor,
                      block_length: int | torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The reference's block-diffusion mask as booleans: query at position p sees key at s iff
    ``s // block_length <= p // block_length`` (and the key is not padding).

    Args:
        query_positions: int64 ``[B, Tq]``; key_positions: int64 ``[B, Tk]`` (absolute, as RoPE's).
        block_length: tokens per block, >= 1: one for every row, or int64 ``[B]`` (rows of different requests).
        key_mask: optional bool ``[B, Tk]`` (False = padding).

    Returns:
        bool ``[B, 1, Tq, Tk]`` (True = attend), for SDPA.
    """
    if isinstance(block_length, torch.Tensor):
        block_length = block_length[:, None]
    allowed = (key_positions // block_length)[:, None, :] <= (query_positions // block_length)[:, :, None]
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, :]
    return allowed[:, None]


class CommittedKV:
    """Per-layer K/V of a batch's rows, one slot per row, indexed by sequence position.

    A forward writes its window's K/V at the columns of their positions in each row's slot (one scatter per layer)
    and attends over the first ``columns`` columns under the block-causal mask. A row's columns below its
    committed length hold its committed blocks, written once (when their block committed) and read after that;
    its active block's columns are rewritten by every forward; columns past its window hold nothing it can see
    (they lie in later blocks, which the mask hides), so padded query columns may write there.

    The last ``packed`` slots belong to rows whose committed blocks a quantized store holds packed
    (`service.quant.committed`): they have no per-layer buffers, only one scratch layer ``[B, H_kv, capacity,
    D]`` shared by every layer of a forward, into which the ``on_write`` hook dequantizes their committed blocks
    at each layer (the full-precision slots' K/V are copied into it beside them, so attention reads one tensor).
    With no packed slot there is no scratch and attention reads the per-layer buffers as they are.

    Args:
        num_layers: L; batch: B (rows); kv_heads: H_kv; capacity: columns per row (at least the widest window's
            last position + 1); head_dim: D; dtype, device: of the K/V (the model's); packed: slots (the last
            ones) held packed outside.
    """

    def __init__(self, num_layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, packed: int = 0) -> None:
        shape = (batch - packed, kv_heads, capacity, head_dim)
        self.device = torch.device(device)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        #: One layer's K and V of every slot ``[B, H_kv, capacity, D]`` when some slots are packed, else None.
        self.scratch: tuple[torch.Tensor, torch.Tensor] | None = None
        if packed:
            full = (batch, kv_heads, capacity, head_dim)
            self.scratch = (torch.zeros(full, dtype=dtype, device=device),
                            torch.zeros(full, dtype=dtype, device=device))
        #: Columns the next forward attends over (set by the caller: its rows' last window position + 1).
        self.columns = 0
        #: Called with the layer index, the window's post-RoPE queries ``[B, H, T, D]``, its pre-RoPE keys
        #: ``[B, H_kv, T, D]``, the layer's K and V of every slot ``[B, H_kv, capacity, D]`` (after the window's
        #: K/V are written and before attention reads them) and ``columns`` (set by the caller for one forward;
        #: `service.quant.committed` reads and quantizes the packed slots' committed blocks with it). It returns
        #: None, or a float32 ``[B, H, T, columns]`` bias that attention adds to its scaled scores (the key-bias
        #: correction of quantized committed keys, `service.quant.committed.CommitWriter`).
        self.on_write: Callable[..., torch.Tensor | None] | None = None

    @property
    def bytes_per_column(self) -> int:
        """Bytes of one row's K and V at one position, every layer."""
        one = self.k[0]
        return 2 * len(self.k) * one.shape[1] * one.shape[3] * one.element_size()

    @property
    def nbytes(self) -> int:
        """Bytes of the per-layer buffers and the scratch."""
        tensors = [*self.k, *self.v, *(self.scratch or ())]
        return sum(t.numel() * t.element_size() for t in tensors)

    def layer_kv(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pre: torch.Tensor,
                 index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Write the window's K/V ``[B, H_kv, T, D]`` (post-RoPE keys) at the columns of ``index`` (the scatter
        index ``[B, H_kv, T, D]``), run ``on_write``, and return the layer's K/V of every slot over the first
        ``columns`` columns ``[B, H_kv, columns, D]`` and the score bias ``on_write`` returned (float32 ``[B, H,
        T, columns]``, or None) (q, k_pre: for ``on_write``)."""
        if self.scratch is None:
            k_buf, v_buf = self.k[layer], self.v[layer]
            k_buf.scatter_(2, index, k)
            v_buf.scatter_(2, index, v)
        else:
            k_buf, v_buf = self.scratch
            n, cols = self.k[layer].shape[0], self.columns
            if n:
                self.k[layer].scatter_(2, index[:n], k[:n])
                self.v[layer].scatter_(2, index[:n], v[:n])
                k_buf[:n, :, :cols] = self.k[layer][:, :, :cols]
                v_buf[:n, :, :cols] = self.v[layer][:, :, :cols]
            k_buf[n:].scatter_(2, index[n:], k[n:])
            v_buf[n:].scatter_(2, index[n:], v[n:])
        bias = None
        if self.on_write is not None:
            bias = self.on_write(layer, q, k_pre, k_buf, v_buf, columns=self.columns)
        return k_buf[:, :, : self.columns], v_buf[:, :, : self.columns], bias


@dataclass
class _Step:
    """What every layer of one forward shares: RoPE cos/sin of the window, the mask, the cache, and the scatter
    index ``[B, H_kv, T, D]`` of the columns (positions) where the window's K/V go in it."""

    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor | None
    cache: CommittedKV | None
    index: torch.Tensor | None


class LLaDA2Attention(nn.Module):
    """Fused-QKV GQA attention with per-head q/k RMS norm and partial RoPE (reference ``LLaDA2MoeAttention``)."""

    def __init__(self, config: LLaDA2Config, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.rotary_dim = config.rotary_dim
        self.rope = rope
        self.query_key_value = nn.Linear(
            config.width, (config.num_heads + 2 * config.num_kv_heads) * config.head_dim, bias=config.qkv_bias
        )
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.query_layernorm = RMSNorm(config.head_dim, config.eps)
            self.key_layernorm = RMSNorm(config.head_dim, config.eps)
        self.dense = nn.Linear(config.num_heads * config.head_dim, config.width, bias=config.dense_bias)

    def _rotate(self, x: torch.Tensor, step: _Step) -> torch.Tensor:
        """Partial RoPE: the first ``rotary_dim`` channels of x ``[B, H, T, D]`` rotate, the rest pass."""
        if self.rotary_dim == self.head_dim:
            return self.rope.rotate_with(x, step.cos, step.sin)
        rotated = self.rope.rotate_with(x[..., : self.rotary_dim], step.cos, step.sin)
        return torch.cat([rotated, x[..., self.rotary_dim:]], dim=-1)

    def forward(self, x: torch.Tensor, step: _Step, layer: int) -> torch.Tensor:
        """x: ``[B, T, C]`` -> ``[B, T, C]``; with a cache, the window's K/V go to its columns first."""
        b, t, _ = x.shape
        qkv = self.query_key_value(x).view(b, t, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = (part.transpose(1, 2) for part in qkv.split([self.num_heads, self.num_kv_heads,
                                                                self.num_kv_heads], dim=2))  # [B, H(_kv), T, D]
        if self.qk_norm:
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        k_pre = k
        q, k = self._rotate(q, step), self._rotate(k, step)
        mask = step.mask
        if step.cache is not None:
            k, v, bias = step.cache.layer_kv(layer, q, k, v, k_pre, step.index)
            if bias is not None:  # the key-bias correction: an additive mask, -inf where the block-causal hides
                mask = bias.masked_fill_(~step.mask, float("-inf")).to(q.dtype)
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, H, T, D]
        return self.dense(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class SparseMoE(nn.Module):
    """Routed experts plus a shared expert (reference ``LLaDA2MoeSparseMoeBlock`` and ``LLaDA2MoeGate``).

    Router, in float32 as the reference: ``scores = sigmoid(x W_g^T)``; the choice uses ``scores + expert_bias``:
    the experts are cut into ``expert_groups`` groups, a group scores the sum of its top-2, the best
    ``groups_per_token`` groups stay, and the top K experts among them are chosen; the weights are the chosen
    experts' *unbiased* scores, normalised over the K (when K > 1) and scaled by ``routed_scale``.

    Experts run grouped by expert id: the (token, choice) pairs are sorted by expert on the device, their group
    offsets found there too (the sorted ids searched for each expert's end), and one grouped matmul over every
    expert's stacked weights (``torch.nn.functional.grouped_mm``) does gate-up, one more does down; the outputs go
    back to (token, choice) order and are summed with the routing weights. No host read and no loop over tokens,
    rows or experts: the op count is the same whatever the rows and the active experts. Where ``grouped_mm`` is
    missing (torch before 2.9) or refuses the operands (bfloat16 rows whose bytes are not a multiple of 16), each
    active expert runs its matmul pair instead, after one host read of the counts. The weights are held stacked
    (replacing the checkpoint's per-expert tensors, not beside them): ``gate_up`` ``[E, 2 * I, C]`` (gate rows
    then up rows) and ``down`` ``[E, C, I]``.
    """

    def __init__(self, config: LLaDA2Config) -> None:
        super().__init__()
        e, hidden, width = config.num_experts, config.moe_hidden, config.width
        self.num_experts, self.top_k = e, config.experts_per_token
        self.groups, self.groups_per_token = config.expert_groups, config.groups_per_token
        self.routed_scale = config.routed_scale
        self.gate_weight = nn.Parameter(torch.empty(e, width))
        self.register_buffer("expert_bias", torch.zeros(e))
        self.gate_up = nn.Parameter(torch.empty(e, 2 * hidden, width))
        self.down = nn.Parameter(torch.empty(e, width, hidden))
        self.shared = GatedMLP(width, hidden * config.shared_experts) if config.shared_experts else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: ``[N, C]`` -> (int64 expert ids ``[N, K]``, float32 weights ``[N, K]``)."""
        scores = torch.sigmoid(F.linear(x.float(), self.gate_weight.float()))  # [N, E]
        choice = scores + self.expert_bias.float()
        n = choice.shape[0]
        group_scores = choice.view(n, self.groups, -1).topk(2, dim=-1)[0].sum(dim=-1)  # [N, groups]
        kept = torch.topk(group_scores, k=self.groups_per_token, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, kept, 1.0).bool()
        expert_mask = group_mask[:, :, None].expand(n, self.groups, self.num_experts // self.groups).reshape(n, -1)
        ids = torch.topk(choice.masked_fill(~expert_mask, float("-inf")), k=self.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if self.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.routed_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: ``[B, T, C]`` -> ``[B, T, C]``, same dtype (no host read with ``grouped_mm``: class doc)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [N, C]
        ids, weights = self.route(flat)
        experts = ids.reshape(-1)  # [N*K]
        order = experts.argsort()  # (token, choice) pairs grouped by expert
        rows = flat[order // self.top_k]  # [N*K, C]
        if self._grouped(rows):
            # Each expert's group ends where the sorted ids pass it: int32 cumulative counts [E], on the device.
            ends = torch.arange(self.num_experts, device=x.device, dtype=experts.dtype)
            offs = torch.searchsorted(experts[order], ends, right=True).to(torch.int32)
            gate, up = F.grouped_mm(rows, self.gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)
            grouped = F.grouped_mm(F.silu(gate) * up, self.down.transpose(1, 2), offs=offs)  # [N*K, C]
        else:
            grouped = self._per_expert(rows, experts)
        out = torch.empty_like(grouped)
        out[order] = grouped  # back to (token, choice) order
        y = (out.view(*ids.shape, -1).to(weights.dtype) * weights[..., None]).sum(dim=1).to(x.dtype)
        y = y.view(shape)
        return y + self.shared(x) if self.shared is not None else y

    def _grouped(self, rows: torch.Tensor) -> bool:
        """``grouped_mm`` exists and takes these operands (its strides must be multiples of 16 bytes)."""
        if not hasattr(F, "grouped_mm"):
            return False
        size = rows.element_size()
        return all(n * size % 16 == 0 for n in (rows.shape[-1], self.gate_up.shape[1], self.down.shape[2],
                                                  self.down.shape[1]))

    def _per_expert(self, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The fallback: one matmul pair per active expert over its sorted rows ``[N*K, C]`` (one host read)."""
        counts = torch.bincount(experts, minlength=self.num_experts).tolist()
        outs, start = [], 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            chunk = rows[start:start + count]
            gate, up = F.linear(chunk, self.gate_up[expert]).chunk(2, dim=-1)
            outs.append(F.linear(F.silu(gate) * up, self.down[expert]))
            start += count
        return torch.cat(outs)


class LLaDA2Layer(nn.Module):
    """Pre-norm block: ``x + attention(norm(x))`` then ``x + mlp(norm(x))`` (MLP dense or :class:`SparseMoE`)."""

    def __init__(self, config: LLaDA2Config, rope: RotaryEmbedding, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.width, config.eps)
        self.attention = LLaDA2Attention(config, rope)
        self.post_attention_layernorm = RMSNorm(config.width, config.eps)
        moe = config.num_experts > 0 and index >= config.first_dense
        self.mlp = SparseMoE(config) if moe else GatedMLP(config.width, config.mlp_hidden)

    def forward(self, x: torch.Tensor, step: _Step, layer: int) -> torch.Tensor:
        x = x + self.attention(self.input_layernorm(x), step, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class BlockCausalRule(RevealRule):
    """LLaDA2's reveal rules live in `service.engine.block_causal` (the reference loop); this says what of the
    other families' settings it refuses."""

    remasking = ("low_confidence",)
    edits_tokens = True  # LLaDA2.1's algorithm (`service.engine.block_causal`), on any LLaDA2 checkpoint

    def check(self, params) -> None:
        """Refuse random remasking (the reference reveals by confidence only), and what every family but Dream
        refuses (`RevealRule.check`)."""
        from service.engine.errors import EngineInputError

        super().check(params)
        if params.remasking != "low_confidence":
            raise EngineInputError(f"remasking {params.remasking!r} is not a LLaDA2 rule; legal: low_confidence",
                                   "remasking")


class LLaDA2Model(DiffusionLM):
    """LLaDA2.0/2.1 MoE (``LLaDA2MoeModelLM``): embedding -> L layers -> RMSNorm -> LM head, no logit shift."""

    arch = "llada2"
    logits_shift = 0
    #: Attention kind of the family: bidirectional inside a block, causal across blocks (its own decode loop,
    #: `service.engine.block_causal`, and its cache modes there).
    mask_kind: ClassVar[str] = "block_causal"
    decoder: ClassVar[str] = "block_causal"
    #: ``block``, the exact append-only cache of committed blocks, runs with ``prefix``'s configuration (committed
    #: blocks are its reused prefix; it has no suffix); ``prefix`` and ``dual`` decode as ``block`` with their own
    #: (a dual request whose policy was fitted for prefix is served with it, `service.store.active`).
    cache_modes: ClassVar[dict[str, str]] = {"none": "none", "prefix": "prefix", "dual": "dual", "block": "prefix"}
    reveal_rule = BlockCausalRule()
    #: Public names -> module names. The experts' per-expert tensors are stacked on load (``gate_up``, ``down``).
    CHECKPOINT_NAMES: ClassVar[dict[str, str]] = {
        "model.word_embeddings.weight": "embed.weight",
        "model.norm.weight": "norm.weight",
        "lm_head.weight": "lm_head.weight",
        "model.layers.{i}.input_layernorm.weight": "layers.{i}.input_layernorm.weight",
        "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.post_attention_layernorm.weight",
        "model.layers.{i}.attention.query_key_value.weight": "layers.{i}.attention.query_key_value.weight",
        "model.layers.{i}.attention.query_key_value.bias": "layers.{i}.attention.query_key_value.bias",
        "model.layers.{i}.attention.query_layernorm.weight": "layers.{i}.attention.query_layernorm.weight",
        "model.layers.{i}.attention.key_layernorm.weight": "layers.{i}.attention.key_layernorm.weight",
        "model.layers.{i}.attention.dense.weight": "layers.{i}.attention.dense.weight",
        "model.layers.{i}.attention.dense.bias": "layers.{i}.attention.dense.bias",
        "model.layers.{i}.mlp.gate_proj.weight": "layers.{i}.mlp.gate_proj.weight",
        "model.layers.{i}.mlp.up_proj.weight": "layers.{i}.mlp.up_proj.weight",
        "model.layers.{i}.mlp.down_proj.weight": "layers.{i}.mlp.down_proj.weight",
        "model.layers.{i}.mlp.gate.weight": "layers.{i}.mlp.gate_weight",
        "model.layers.{i}.mlp.gate.expert_bias": "layers.{i}.mlp.expert_bias",
        "model.layers.{i}.mlp.shared_experts.gate_proj.weight": "layers.{i}.mlp.shared.gate_proj.weight",
        "model.layers.{i}.mlp.shared_experts.up_proj.weight": "layers.{i}.mlp.shared.up_proj.weight",
        "model.layers.{i}.mlp.shared_experts.down_proj.weight": "layers.{i}.mlp.shared.down_proj.weight",
        # Not public names: the stacked experts (see `_stack_experts`).
        "model.layers.{i}.mlp.experts.gate_up": "layers.{i}.mlp.gate_up",
        "model.layers.{i}.mlp.experts.down": "layers.{i}.mlp.down",
    }

    def __init__(self, config: LLaDA2Config) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.rope = RotaryEmbedding(config.rotary_dim, config.rope_theta, full_precision=False)
        self.embed = nn.Embedding(config.vocab_size, config.width)
        self.layers = nn.ModuleList(LLaDA2Layer(config, self.rope, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.width, config.eps)
        self.lm_head = nn.Linear(config.width, config.vocab_size, bias=False)

    @classmethod
    def config_from_hf(cls, hf: dict) -> LLaDA2Config:
        """Parse a LLaDA2 ``config.json`` (``LLaDA2MoeConfig`` keys).

        Raises:
            ValueError: one line naming the first key whose value this implementation does not have.
        """
        for key, supported in _SUPPORTED.items():
            if key in hf and not supported(hf[key]):
                raise ValueError(f"unsupported LLaDA2 config: {key}={hf[key]!r} is not implemented")
        width, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        head_dim = int(hf.get("head_dim") or width // heads)
        experts = int(hf.get("num_experts") or 0)
        groups = int(hf.get("n_group") or 1)
        if experts and experts % groups:
            raise ValueError(f"unsupported LLaDA2 config: num_experts={experts} is not a multiple of n_group={groups}")
        rotary = int(head_dim * float(hf.get("partial_rotary_factor", 1.0)))
        kind = " ".join([str(hf.get("model_type", ""))] + [str(a) for a in hf.get("architectures") or []]).lower()
        return LLaDA2Config(
            arch="llada2",
            vocab_size=int(hf["vocab_size"]),
            width=width,
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            mlp_hidden=int(hf.get("intermediate_size") or 0),
            eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(hf.get("rope_theta", 600000.0)),
            rope_full_precision=False,
            qkv_bias=bool(hf.get("use_qkv_bias", False)),
            mask_id=int(hf.get("mask_token_id", 156895)),
            eos_id=int(hf.get("eos_token_id", 156892)),
            pad_id=int(hf.get("pad_token_id", 156892)),
            max_length=int(hf.get("max_position_embeddings", 32768)),
            rotary_dim=rotary - rotary % 2,
            qk_norm=bool(hf.get("use_qk_norm", True)),
            dense_bias=bool(hf.get("use_bias", False)),
            first_dense=int(hf.get("first_k_dense_replace", 0)),
            num_experts=experts,
            experts_per_token=int(hf.get("num_experts_per_tok") or 1),
            expert_groups=groups,
            groups_per_token=int(hf.get("topk_group") or groups),
            moe_hidden=int(hf.get("moe_intermediate_size") or 0),
            shared_experts=int(hf.get("num_shared_experts") or 0),
            routed_scale=float(hf.get("routed_scaling_factor", 1.0)),
            editing="llada21" in kind or "llada2.1" in kind,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        positions: torch.Tensor | None = None,
        block_length: int | torch.Tensor | None = None,
        cache: CommittedKV | None = None,
        logits_range: tuple[int, int] | None = None,
        logits_at: torch.Tensor | None = None,
        layers: tuple[int, int] | None = None,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits of a window of columns, block-causal when ``block_length`` is given.

        Args:
            input_ids: int64 ``[B, T]``: the whole sequence, or (with ``cache``) each row's window, right-padded.
            attention_mask: optional bool ``[B, T]`` (False = padding; plain calls without a cache only).
            positions: int64 ``[B, T]`` absolute positions (default ``0 .. T-1``); with a cache, each row's
                window positions (padded columns continue past the row's window).
            block_length: block-causal mask of that block size, one int or int64 ``[B]`` per row (None:
                bidirectional over every key; not with a cache).
            cache: :class:`CommittedKV`; the window's K/V are written at the columns of ``positions`` and
                attention reads each row's first ``cache.columns`` columns.
            logits_range: ``(a, b)`` columns of the window whose logits are wanted (default all);
            logits_at: instead, int64 ``[B, N]`` window columns per row.
            layers: ``(a, b)``: run decoder layers ``a .. b-1`` only (default all), from ``hidden`` (the ``[B, T,
                C]`` hidden states a call with ``layers=(.., a)`` returned) when ``a > 0``; ``b`` below the layer
                count returns the hidden states after layer ``b - 1`` (a block-initial pass split by layers,
                `service.runtime.scheduler.split_by_layers`: each layer runs the same operations as in a whole
                forward, so the pieces give its logits bit for bit).

        Returns:
            float32 ``[B, N, V]`` logits (the reference casts them to float32), or ``[B, T, C]`` hidden states
            (``layers`` ending before the last layer).
        """
        b, t = input_ids.shape
        device = input_ids.device
        if positions is None:
            positions = torch.arange(t, device=device).expand(b, t)
        key_positions, key_mask, index = positions, None, None
        if cache is not None:
            if block_length is None:
                raise ValueError("a cached forward needs block_length (the cache holds block-causal K/V)")
            key_positions = torch.arange(cache.columns, device=device).expand(b, cache.columns)
            index = positions[:, None, :, None].expand(b, self.config.num_kv_heads, t, self.config.head_dim)
        elif attention_mask is not None and not bool(attention_mask.all()):
            key_mask = attention_mask.to(torch.bool)
        if block_length is not None:
            mask = block_causal_mask(positions, key_positions, block_length, key_mask)
        else:
            mask = None if key_mask is None else key_mask[:, None, None, :]
        cos, sin = self.rope.cos_sin(positions)
        step = _Step(cos=cos, sin=sin, mask=mask, cache=cache, index=index)
        start, stop = layers if layers is not None else (0, len(self.layers))
        if start and hidden is None:
            raise ValueError(f"layers {start}..{stop - 1} need the hidden states after layer {start - 1}")
        x = self.embed(input_ids) if start == 0 else hidden  # [B, T, C]
        for layer_index in range(start, stop):
            x = self.layers[layer_index](x, step, layer_index)
        if stop < len(self.layers):
            return x
        if logits_at is not None:
            x = x.gather(1, logits_at[..., None].expand(-1, -1, x.shape[-1]))  # [B, N, C]
        else:
            lo, hi = logits_range if logits_range is not None else (0, t)
            x = x[:, lo:hi]
        return self.lm_head(self.norm(x)).float()

    def key_rotation(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos, sin ``[B, 1, T, rotary_dim]`` of the RoPE at int64 ``positions`` ``[B, T]`` (rotate-half
        over the first ``rotary_dim`` channels): what the key-bias correction of pre-RoPE keys rotates the
        queries back by (`service.quant.committed.CommitWriter`)."""
        return self.rope.cos_sin(positions)

    def rotate_keys(self, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Partial RoPE of pre-RoPE keys ``[B, H_kv, T, D]`` at int64 ``positions`` ``[B, T]``, as a forward
        rotates them: the first ``rotary_dim`` channels rotate, the rest pass; same dtype."""
        r = self.config.rotary_dim
        rotated = self.rope.rotate(k[..., :r], positions)
        return rotated if r == k.shape[-1] else torch.cat([rotated, k[..., r:]], dim=-1)

    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """As :meth:`DiffusionLM.load_checkpoint_tensors`, after stacking each MoE layer's per-expert tensors.

        Raises:
            ValueError: a tensor is missing, unexpected or misshapen, or an expert of a MoE layer is missing.
        """
        super().load_checkpoint_tensors(_stack_experts(tensors, self.config.num_experts))

    def checkpoint_state_dict(self) -> dict[str, torch.Tensor]:
        """This module's tensors under the public checkpoint's names, experts one tensor each again."""
        out = {}
        for name, value in super().checkpoint_state_dict().items():
            head, _, kind = name.rpartition(".experts.")
            if kind == "gate_up":
                for e, stacked in enumerate(value):
                    gate, up = stacked.chunk(2, dim=0)
                    out[f"{head}.experts.{e}.gate_proj.weight"] = gate.contiguous()
                    out[f"{head}.experts.{e}.up_proj.weight"] = up.contiguous()
            elif kind == "down":
                for e, stacked in enumerate(value):
                    out[f"{head}.experts.{e}.down_proj.weight"] = stacked.contiguous()
            else:
                out[name] = value
        return out


def _stack_experts(tensors: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """``...mlp.experts.{e}.{gate,up,down}_proj.weight`` -> ``...mlp.experts.gate_up`` ``[E, 2I, C]`` and
    ``...mlp.experts.down`` ``[E, C, I]``; other tensors unchanged.

    Raises:
        ValueError: a MoE layer lacks one of its ``num_experts`` experts' tensors (the message names it).
    """
    out, layers = {}, set()
    for name, value in tensors.items():
        if ".mlp.experts." in name:
            layers.add(name.split(".mlp.experts.")[0])
        else:
            out[name] = value
    for head in sorted(layers):
        gate_up, down = [], []
        for e in range(num_experts):
            names = [f"{head}.mlp.experts.{e}.{p}_proj.weight" for p in ("gate", "up", "down")]
            missing = [n for n in names if n not in tensors]
            if missing:
                raise ValueError(f"LLaDA2 checkpoint lacks {missing[0]}")
            gate_up.append(torch.cat([tensors[names[0]], tensors[names[1]]], dim=0))
            down.append(tensors[names[2]])
        out[f"{head}.mlp.experts.gate_up"] = torch.stack(gate_up)
        out[f"{head}.mlp.experts.down"] = torch.stack(down)
    return out
