"""LLaDA (GSAI-ML/LLaDA-8B-Instruct layout): ``config.json`` keys and ``model.transformer.*`` tensor names.

Reference: ML-GSAI/LLaDA and NVlabs/Fast-dLLM `llada/model/modeling_llada.py` (``LLaDALlamaBlock``); golden SPEC
sections 1.1-1.3. No logit shift; RoPE in float32 (``rope_full_precision``).
"""

from __future__ import annotations

from typing import ClassVar

from service.engine.models.transformer import DiffusionLM, ModelConfig
from service.engine.reveal import LLaDARule

# Features of the LLaDA/OLMo config that this implementation does not have; a checkpoint using one is refused.
_UNSUPPORTED = {
    "alibi": True, "attention_layer_norm": True, "input_emb_norm": True, "scale_logits": True,
    "weight_tying": True, "include_bias": True, "include_qkv_bias": True,
}


class LLaDAModel(DiffusionLM):
    """LLaDA: MHA/GQA, no biases, SiLU-gated MLP (``ff_proj`` = gate, ``up_proj`` = up, ``ff_out`` = down)."""

    arch = "llada"
    logits_shift = 0
    reveal_rule = LLaDARule()
    CHECKPOINT_NAMES: ClassVar[dict[str, str]] = {
        "model.transformer.wte.weight": "embed.weight",
        "model.transformer.ln_f.weight": "norm.weight",
        "model.transformer.ff_out.weight": "lm_head.weight",
        "model.transformer.blocks.{i}.attn_norm.weight": "layers.{i}.attn_norm.weight",
        "model.transformer.blocks.{i}.q_proj.weight": "layers.{i}.attn.q_proj.weight",
        "model.transformer.blocks.{i}.k_proj.weight": "layers.{i}.attn.k_proj.weight",
        "model.transformer.blocks.{i}.v_proj.weight": "layers.{i}.attn.v_proj.weight",
        "model.transformer.blocks.{i}.attn_out.weight": "layers.{i}.attn.o_proj.weight",
        "model.transformer.blocks.{i}.ff_norm.weight": "layers.{i}.mlp_norm.weight",
        "model.transformer.blocks.{i}.ff_proj.weight": "layers.{i}.mlp.gate_proj.weight",
        "model.transformer.blocks.{i}.up_proj.weight": "layers.{i}.mlp.up_proj.weight",
        "model.transformer.blocks.{i}.ff_out.weight": "layers.{i}.mlp.down_proj.weight",
    }

    @classmethod
    def config_from_hf(cls, hf: dict) -> ModelConfig:
        """Parse a LLaDA ``config.json`` (keys of SPEC 1.1).

        Raises:
            ValueError: the config uses a feature this model does not implement (listed in the message).
        """
        used = sorted(key for key, bad in _UNSUPPORTED.items() if hf.get(key) == bad)
        if hf.get("block_type", "llama") != "llama" or hf.get("layer_norm_type", "rms") != "rms" or used:
            raise ValueError(
                f"unsupported LLaDA config: block_type={hf.get('block_type')!r}, "
                f"layer_norm_type={hf.get('layer_norm_type')!r}, features {used}; supported: block_type 'llama', "
                "layer_norm_type 'rms', none of " + ", ".join(sorted(_UNSUPPORTED))
            )
        width, heads = int(hf["d_model"]), int(hf["n_heads"])
        kv_heads = hf.get("n_kv_heads") or (1 if hf.get("multi_query_attention") else heads)
        return ModelConfig(
            arch="llada",
            vocab_size=int(hf.get("embedding_size") or hf["vocab_size"]),
            width=width,
            num_layers=int(hf["n_layers"]),
            num_heads=heads,
            num_kv_heads=int(kv_heads),
            head_dim=width // heads,
            mlp_hidden=int(hf.get("mlp_hidden_size") or hf.get("mlp_ratio", 4) * width),
            eps=float(hf.get("rms_norm_eps", 1e-5)),
            rope_theta=float(hf.get("rope_theta", 10000.0)),
            rope_full_precision=bool(hf.get("rope_full_precision", True)),
            qkv_bias=False,
            mask_id=int(hf.get("mask_token_id", 126336)),
            eos_id=int(hf.get("eos_token_id", 126081)),
            pad_id=int(hf.get("pad_token_id", 126081)),
            max_length=int(hf.get("max_sequence_length", 4096)),
        )
