"""Write the tiny random DiffusionGemma checkpoints the tests and docs use (seeded: the same files every run).

The layout is the public one (``google/diffusiongemma-26B-A4B-it``: ``DiffusionGemmaForBlockDiffusion``, model type
``diffusion_gemma``), written by the installed transformers' own ``save_pretrained`` from a model it builds, so the
tensor names, the tied encoder/decoder weights and the per-pass ``layer_scalar`` buffers are the reference's. Shrunk:
vocabulary 512 (a byte-level tokenizer: ids 0-255 the bytes, ``w<id>`` for most others, the special tokens below),
width 32, 4 query heads of 16 on the sliding layers (2 KV heads), global layers with head dim 32 and 1 KV head (V
from K), proportional RoPE 0.25 on the global layers, final soft-cap 30, a dense MLP of 64 beside 8 experts (top 2,
hidden 16) on every layer, a tiny vision tower (that the engine skips). Two variants:

- ``dgemma-tiny`` (with tokenizer and a Gemma-style chat template): 5 layers ``S S F S F``, sliding window 12,
  canvas 16;
- ``dgemma-tiny-w8``: 4 layers ``S F S F``, sliding window 8, canvas 8, other seeds: the sliding layers' cache
  is trimmed to 7 positions after the first canvas (token ids only, no tokenizer);
- ``dgemma-tiny-settling``: ``dgemma-tiny-w8``'s layout, another seed, and a near rank-1 embedding (every token's
  row ``a_v u`` plus 1% noise, ``a_v`` in [0, 3)): the tied head then prefers a few ids whatever the canvas, so
  canvases settle and the stopping rule's *stability* half fires (on the other two, random weights keep every
  argmax moving and only ``stability_threshold 0`` stops early).

Each layer's ``layer_scalar`` (encoder and decoder apart), the routers' ``scale`` and ``per_expert_scale`` and the
norms' weights are drawn too (not left at one), so a wrong tie or a missing scalar changes the logits.

Usage: ``.venv/bin/python scripts/make_diffusion_gemma_tiny.py [--out DIR]`` (default ``tests/data/diffusion_gemma``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.make_llada2_tiny_chat import add_byte_tokenizer

VOCAB_SIZE = 512
#: Special tokens by id (add_byte_tokenizer names id 497 the EOS).
SPECIAL = {496: "<pad>", 497: "<eos>", 498: "<bos>", 499: "<start_of_turn>", 500: "<end_of_turn>"}
TEMPLATE = (
    "{{ '<bos>' }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

VARIANTS = {
    "dgemma-tiny": {"seed": 43, "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                                                "sliding_attention", "full_attention"],
                    "sliding_window": 12, "canvas_length": 16, "tokenizer": True},
    "dgemma-tiny-w8": {"seed": 4343, "layer_types": ["sliding_attention", "full_attention", "sliding_attention",
                                                     "full_attention"],
                       "sliding_window": 8, "canvas_length": 8, "tokenizer": False},
    "dgemma-tiny-settling": {"seed": 99, "layer_types": ["sliding_attention", "full_attention", "sliding_attention",
                                                         "full_attention"],
                             "sliding_window": 8, "canvas_length": 8, "tokenizer": False, "rank1_embedding": 1},
}


def build(variant: dict):
    """The seeded reference model ``DiffusionGemmaForBlockDiffusion`` of one variant (float32, eval)."""
    import torch
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    torch.manual_seed(variant["seed"])
    text = {
        "vocab_size": VOCAB_SIZE, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers":
        len(variant["layer_types"]), "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "global_head_dim": 32, "num_global_key_value_heads": 1, "layer_types": variant["layer_types"],
        "sliding_window": variant["sliding_window"], "num_experts": 8, "top_k_experts": 2,
        "moe_intermediate_size": 16, "max_position_embeddings": 4096, "pad_token_id": 496, "eos_token_id": 497,
        "bos_token_id": 498, "use_bidirectional_attention": "vision", "final_logit_softcapping": 30.0,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                               "rope_theta": 1000000.0}},
    }
    vision = {"model_type": "gemma4_vision", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8, "patch_size": 4,
              "position_embedding_size": 16, "pooling_kernel_size": 2}
    config = DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=variant["canvas_length"],
                                  image_token_id=VOCAB_SIZE - 1, boi_token_id=VOCAB_SIZE - 2,
                                  eoi_token_id=VOCAB_SIZE - 3, pad_token_id=496, eos_token_id=497, bos_token_id=498)
    model = DiffusionGemmaForBlockDiffusion(config).eval()
    with torch.no_grad():
        for name, value in model.named_parameters():
            if name.endswith(("norm.weight", ".scale", "per_expert_scale")):
                value.copy_(1.0 + 0.25 * torch.randn_like(value))
            elif value.dim() >= 2:
                value.normal_(0.0, 0.08)
        for name, value in model.named_buffers():
            if name.endswith("layer_scalar"):
                value.copy_(0.75 + 0.5 * torch.rand_like(value))
        if variant.get("rank1_embedding"):
            embed = model.model.decoder.embed_tokens.weight  # the encoder's and the head's too (tied)
            g = torch.Generator().manual_seed(variant["rank1_embedding"])
            scale, direction = 3 * torch.rand(embed.shape[0], generator=g), torch.randn(embed.shape[1], generator=g)
            embed.copy_(torch.outer(scale, direction) + 0.01 * torch.randn(embed.shape, generator=g))
    return model


def write(out: Path) -> list[Path]:
    """Write every variant under ``out`` (each replaced if it exists); returns the directories."""
    written = []
    for name, variant in VARIANTS.items():
        directory = out / name
        if directory.exists():
            shutil.rmtree(directory)
        model = build(variant)
        model.save_pretrained(directory)
        # The checkpoint's own generation defaults: none, so the reference's global defaults apply (as on a
        # checkpoint without generation_config.json); the EOS and pad ids are the config's.
        (directory / "generation_config.json").write_text(json.dumps(
            {"eos_token_id": 497, "pad_token_id": 496, "bos_token_id": 498}, indent=2) + "\n")
        if variant["tokenizer"]:
            add_byte_tokenizer(directory, SPECIAL, VOCAB_SIZE)
            (directory / "chat_template.jinja").write_text(TEMPLATE)
        written.append(directory)
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "diffusion_gemma")
    for path in write(parser.parse_args().out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
