"""Dream (Dream-org/Dream-v0-Base-7B layout): Qwen2-style names with q/k/v biases, GQA, shifted logits.

Reference: DreamLM/Dream and NVlabs/Fast-dLLM `dream/model/modeling_dream.py`; golden SPEC sections 2.1-2.3.
RoPE cos/sin are cast to the activation dtype before rotating (bf16 rotation in a bf16 model).
"""

from __future__ import annotations

from typing import ClassVar

from service.engine.models.transformer import DiffusionLM, ModelConfig
from service.engine.reveal import DreamRule


class DreamModel(DiffusionLM):
    """Dream: GQA with q/k/v biases, SiLU-gated MLP; column p is predicted from the hidden state at p-1."""

    arch = "dream"
    logits_shift = 1
    reveal_rule = DreamRule()
    CHECKPOINT_NAMES: ClassVar[dict[str, str]] = {
        "model.embed_tokens.weight": "embed.weight",
        "model.norm.weight": "norm.weight",
        "lm_head.weight": "lm_head.weight",
        "model.layers.{i}.input_layernorm.weight": "layers.{i}.attn_norm.weight",
        "model.layers.{i}.self_attn.q_proj.weight": "layers.{i}.attn.q_proj.weight",
        "model.layers.{i}.self_attn.q_proj.bias": "layers.{i}.attn.q_proj.bias",
        "model.layers.{i}.self_attn.k_proj.weight": "layers.{i}.attn.k_proj.weight",
        "model.layers.{i}.self_attn.k_proj.bias": "layers.{i}.attn.k_proj.bias",
        "model.layers.{i}.self_attn.v_proj.weight": "layers.{i}.attn.v_proj.weight",
        "model.layers.{i}.self_attn.v_proj.bias": "layers.{i}.attn.v_proj.bias",
        "model.layers.{i}.self_attn.o_proj.weight": "layers.{i}.attn.o_proj.weight",
        "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.mlp_norm.weight",
        "model.layers.{i}.mlp.gate_proj.weight": "layers.{i}.mlp.gate_proj.weight",
        "model.layers.{i}.mlp.up_proj.weight": "layers.{i}.mlp.up_proj.weight",
        "model.layers.{i}.mlp.down_proj.weight": "layers.{i}.mlp.down_proj.weight",
    }

    @classmethod
    def config_from_hf(cls, hf: dict) -> ModelConfig:
        """Parse a Dream (Qwen2-style) ``config.json`` (SPEC 2.1).

        Raises:
            ValueError: tied embeddings, sliding-window attention or RoPE scaling (not implemented).
        """
        if hf.get("tie_word_embeddings") or hf.get("use_sliding_window") or hf.get("rope_scaling"):
            raise ValueError(
                "unsupported Dream config: tie_word_embeddings, use_sliding_window and rope_scaling must be off"
            )
        width, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        return ModelConfig(
            arch="dream",
            vocab_size=int(hf["vocab_size"]),
            width=width,
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=width // heads,
            mlp_hidden=int(hf["intermediate_size"]),
            eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(hf.get("rope_theta", 10000.0)),
            rope_full_precision=False,
            qkv_bias=True,
            mask_id=int(hf.get("mask_token_id", 151666)),
            eos_id=int(hf.get("eos_token_id", 151643)),
            pad_id=int(hf.get("pad_token_id", 151643)),
            max_length=int(hf.get("max_position_embeddings", 131072)),
        )
