"""A family is one object (issue 31 item 9): what it declares is what the engine, admission and the API read.

* Admission's cost figures (`ModelConfig.mlp_cost`): a dense gated MLP's ``3 M`` for LLaDA/Dream; for LLaDA2 its
  MoE layer's routed experts x top-k plus the shared expert, not the dense ``intermediate_size`` (checked against
  the arithmetic of the checkpoint's ``config.json``).
* Cache modes (`DiffusionLM.cache_modes`): which a family decodes with and the configured mode each runs with.
* A fifth family declared and registered in this file alone is detected, loaded, decoded and served.
"""

from __future__ import annotations

import json

import torch

from service.engine import Engine
from service.engine.forward_cost import ForwardCost
from service.engine.loading import load_checkpoint
from service.engine.models.llada import LLaDAModel
from service.runtime.memory import MemoryModel
from tests.support.llada2 import LLADA2_CKPT


def test_llada2_forward_reserve_counts_its_experts_not_the_dense_width():
    hf = json.loads((LLADA2_CKPT["llada2"] / "config.json").read_text())
    c, k, s, i, e = (hf["hidden_size"], hf["num_experts_per_tok"], hf["num_shared_experts"],
                     hf["moe_intermediate_size"], hf["num_experts"])
    loaded = load_checkpoint(LLADA2_CKPT["llada2"])
    engine = Engine(loaded.model, loaded.spec, None, torch.float32, torch.device("cpu"))
    memory = MemoryModel.for_engine(engine)
    # A MoE layer per column: K experts' gate, up and product, the shared expert's, the K gathered inputs and K
    # outputs; the dense first layer (intermediate_size 96: 288 elements) is smaller here, so the MoE's counts.
    moe_elements = 3 * (k + s) * i + 2 * k * c
    assert moe_elements > 3 * hf["intermediate_size"]
    assert memory.forward == ForwardCost.of(loaded.model)
    assert (memory.forward.mlp_activations, memory.forward.mlp_macs) == (moe_elements, 3 * c * (k + s) * i + c * e)
    seq, cols, h, d, v = 96, 32, hf["num_attention_heads"], hf["head_dim"], hf["vocab_size"]
    expected = seq * (6 * c + moe_elements) * 4 + 3 * 2 * h * seq * d * 4 + cols * v * 4
    assert memory.transient(seq, cols) == expected
    # The old figure (the dense intermediate_size) under-reserved every MoE forward.
    dense = ForwardCost.dense(c, hf["intermediate_size"], h, d, v, 4)
    assert dense.bytes(1, seq, seq, cols) < expected


def test_a_dense_family_keeps_its_gated_mlp_figures():
    config = LLaDAModel.config_from_hf({
        "d_model": 64, "n_layers": 2, "n_heads": 4, "mlp_hidden_size": 160, "vocab_size": 128, "embedding_size": 128,
        "mask_token_id": 126, "eos_token_id": 127, "pad_token_id": 127, "model_type": "llada",
    })
    assert config.mlp_cost == (3 * 160, 3 * 64 * 160)
    model = LLaDAModel(config)
    assert ForwardCost.of(model) == ForwardCost.dense(64, 160, 4, 16, 128, 4)
