"""A family is one object (issue 31 item 9): what it declares is what the engine, admission and the API read.

* Admission's cost figures (`ModelConfig.mlp_cost`): a dense gated MLP's ``3 M`` for LLaDA/Dream; for LLaDA2 its
  MoE layer's routed experts x top-k plus the shared expert, not the dense ``intermediate_size`` (checked against
  the arithmetic of the checkpoint's ``config.json``).
* Cache modes (`DiffusionLM.cache_modes`): which a family decodes with and the configured mode each runs with.
* A fifth family declared and registered in this file alone is detected, loaded, decoded and served.
"""

from __future__ import annotations

import dataclasses
import json
import weakref
from typing import ClassVar, get_args

import pytest
import torch
from safetensors.torch import save_file
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from service.engine import Engine, EngineInputError
from service.engine.engine import cache_modes
from service.engine.forward_cost import ForwardCost
from service.engine.loading import detect_arch, load_checkpoint
from service.engine.models import MODEL_CLASSES, DiffusionLM, ModelConfig, configured_cache_mode
from service.engine.models.llada import LLaDAModel
from service.engine.params import CacheMode, ConfiguredCacheMode, DecodeParams, RowOptions
from service.engine.reveal import LLaDARule
from service.runtime.memory import MemoryModel
from tests.support.llada2 import LLADA2_CKPT


class LivePeak(TorchDispatchMode):
    """The most bytes held at once by the tensors the ops run under it create (each new storage counted until
    its tensor is freed): a CPU stand-in for CUDA's peak allocation statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.held: dict[int, int] = {}

    def _free(self, key: int) -> None:
        self.live -= self.held.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t._base is None:
                storage = t.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
                if size and key not in self.held:
                    self.held[key] = size
                    self.live += size
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(t, self._free, key)
        return out


def test_llada2_forward_reserve_counts_its_experts_not_the_dense_width():
    hf = json.loads((LLADA2_CKPT["llada2"] / "config.json").read_text())
    c, k, s, i, e = (hf["hidden_size"], hf["num_experts_per_tok"], hf["num_shared_experts"],
                     hf["moe_intermediate_size"], hf["num_experts"])
    loaded = load_checkpoint(LLADA2_CKPT["llada2"])
    engine = Engine(loaded.model, loaded.spec, None, torch.float32, torch.device("cpu"))
    memory = MemoryModel.for_engine(engine)
    # A MoE layer per column (`LLaDA2Config.mlp_cost`): the K choices' gathered input, outputs and the weighted
    # sum's copies, the experts' gate/up/activation/product, the shared expert's; the dense first layer
    # (intermediate_size 96: 288 elements) is smaller here, so the MoE's counts.
    moe_elements = 7 * k * c + 4 * k * i + 3 * s * i
    assert moe_elements > 3 * hf["intermediate_size"]
    assert memory.forward == ForwardCost.of(loaded.model)
    assert (memory.forward.mlp_activations, memory.forward.mlp_macs) == (moe_elements, 3 * c * (k + s) * i + c * e)
    seq, cols, h, d, v = 96, 32, hf["num_attention_heads"], hf["head_dim"], hf["vocab_size"]
    expected = seq * (6 * c + moe_elements) * 4 + 3 * 2 * h * seq * d * 4 + cols * v * 4
    assert memory.transient(seq, cols) == expected
    # The old figure (the dense intermediate_size) under-reserved every MoE forward.
    dense = ForwardCost.dense(c, hf["intermediate_size"], h, d, v, 4)
    assert dense.bytes(1, seq, seq, cols) < expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llada2_moe_figure_bounds_the_measured_peak_of_its_moe_layer(dtype):
    """The declared figure holds what a MoE layer's forward holds at its peak (measured over 512 columns, where
    the per-call constants are small), and is not far above it."""
    model = load_checkpoint(LLADA2_CKPT["llada2"], dtype=dtype).model
    config = model.config
    moe = model.layers[config.first_dense].mlp
    columns = 512
    x = torch.randn(1, columns, config.width, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.inference_mode(), LivePeak() as peak:
        moe(x)
    measured = peak.peak / (columns * x.element_size())  # elements per column
    declared = config.mlp_cost[0]
    assert measured <= declared <= 2 * measured, (measured, declared)
    assert measured > 3 * config.mlp_hidden  # the dense intermediate_size's figure would not hold it


def test_a_dense_family_keeps_its_gated_mlp_figures():
    config = LLaDAModel.config_from_hf({
        "d_model": 64, "n_layers": 2, "n_heads": 4, "mlp_hidden_size": 160, "vocab_size": 128, "embedding_size": 128,
        "mask_token_id": 126, "eos_token_id": 127, "pad_token_id": 127, "model_type": "llada",
    })
    assert config.mlp_cost == (3 * 160, 3 * 64 * 160)
    model = LLaDAModel(config)
    assert ForwardCost.of(model) == ForwardCost.dense(64, 160, 4, 16, 128, 4)


def test_each_family_declares_its_cache_modes_and_what_they_run_with():
    declared = {arch: cls.cache_modes for arch, cls in MODEL_CLASSES.items()}
    assert declared["llada"] == declared["dream"] == {"none": "none", "prefix": "prefix", "dual": "dual"}
    assert declared["llada2"]["block"] == "prefix" and configured_cache_mode("block", "llada2") == "prefix"
    assert configured_cache_mode("dual", "llada") == "dual"
    for modes in declared.values():  # within the engine's vocabulary of modes and of configured modes
        assert set(modes) <= set(get_args(CacheMode)) and set(modes.values()) <= set(get_args(ConfiguredCacheMode))


# ---- a fifth family, declared and registered here alone (docs/extending.md "Adding a model family") --------------
@dataclasses.dataclass(frozen=True)
class TinyFamConfig(ModelConfig):
    """Its MLP's figures for admission (`ModelConfig.mlp_cost`): a plain GELU MLP holds ``fc1``'s output and its
    activation (``2 M``) and multiplies ``2 C M``."""

    @property
    def mlp_cost(self) -> tuple[int, int]:
        return 2 * self.mlp_hidden, 2 * self.width * self.mlp_hidden


class PlainMLP(torch.nn.Module):
    """``fc2(gelu(fc1(x)))``: a layer no family of the tree has."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(width, hidden, bias=True)
        self.fc2 = torch.nn.Linear(hidden, width, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class TinyFamModel(DiffusionLM):
    """A family the tree does not know: its own MLP layer (:class:`PlainMLP`, biased, ungated), its own
    checkpoint names and ``config.json`` keys, LLaDA's reveal rule, and a cache-mode declaration of its own (no
    ``dual``), to show that detection, loading, decoding, the runtime and the API follow what the class declares."""

    arch = "tinyfam"
    logits_shift = 0
    reveal_rule = LLaDARule()
    cache_modes: ClassVar[dict[str, str]] = {"none": "none", "prefix": "prefix"}
    CHECKPOINT_NAMES: ClassVar[dict[str, str]] = {
        "tok.weight": "embed.weight", "final_norm.weight": "norm.weight", "out.weight": "lm_head.weight",
        **{f"h.{{i}}.{a}": f"layers.{{i}}.{b}" for a, b in (
            ("ln1.weight", "attn_norm.weight"), ("ln2.weight", "mlp_norm.weight"),
            ("q.weight", "attn.q_proj.weight"), ("k.weight", "attn.k_proj.weight"),
            ("v.weight", "attn.v_proj.weight"), ("o.weight", "attn.o_proj.weight"),
            ("fc1.weight", "mlp.fc1.weight"), ("fc1.bias", "mlp.fc1.bias"),
            ("fc2.weight", "mlp.fc2.weight"), ("fc2.bias", "mlp.fc2.bias"))},
    }

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        for layer in self.layers:
            layer.mlp = PlainMLP(config.width, config.mlp_hidden)

    @classmethod
    def config_from_hf(cls, hf: dict) -> ModelConfig:
        width, heads = hf["hidden"], hf["heads"]
        return TinyFamConfig(arch=cls.arch, vocab_size=hf["vocab"], width=width, num_layers=hf["layers"],
                             num_heads=heads, num_kv_heads=heads, head_dim=width // heads, mlp_hidden=hf["ffn"],
                             eps=1e-5, rope_theta=10000.0, rope_full_precision=True, qkv_bias=False,
                             mask_id=hf["mask"], eos_id=hf["eos"], pad_id=hf["pad"], max_length=256)


@pytest.fixture
def tinyfam(tmp_path, monkeypatch):
    """A seeded random checkpoint of the family, written in its own format, with the family registered for this
    test."""
    monkeypatch.setitem(MODEL_CLASSES, TinyFamModel.arch, TinyFamModel)
    hf = {"model_type": "tinyfam", "architectures": ["TinyFamModelLM"], "hidden": 32, "heads": 4, "layers": 2,
          "ffn": 64, "vocab": 64, "mask": 63, "eos": 1, "pad": 0}
    torch.manual_seed(0)
    model = TinyFamModel(TinyFamModel.config_from_hf(hf))
    directory = tmp_path / "tinyfam"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(hf))
    save_file({k: v.contiguous() for k, v in model.checkpoint_state_dict().items()},
              str(directory / "model.safetensors"))
    return directory


PROMPTS = [[5, 9, 2, 33, 17], [12, 4, 8], [7] * 11]


def test_a_family_registered_from_the_tests_is_detected_loaded_and_decodes(tinyfam):
    hf = json.loads((tinyfam / "config.json").read_text())
    assert detect_arch(hf) == "tinyfam"
    with pytest.raises(EngineInputError, match="llada, dream, llada2, diffusion_gemma, tinyfam"):  # the refusal lists the registry
        detect_arch({"model_type": "gpt2"})
    engine = Engine.load(tinyfam)
    assert type(engine.model) is TinyFamModel and engine.spec.arch == "tinyfam"
    assert all(isinstance(layer.mlp, PlainMLP) for layer in engine.model.layers)
    # It decodes with the bidirectional decoder, under the runtime's one protocol: each prompt alone, then all of
    # them in one continuous batch under a plan that merges their passes, token for token the same.
    params = DecodeParams(gen_length=32, block_length=16, cache_mode="prefix", threshold=0.5, ignore_eos=True)
    rows = [[RowOptions(temperature=0.8, seed=i)] for i in range(len(PROMPTS))]  # sampled: rows differ
    alone = [engine.generate([p], params, r).rows[0].generated_ids for p, r in zip(PROMPTS, rows)]
    batch = engine.batch(lambda passes: [passes] if passes else [])
    cohorts = [engine.cohort([p], params, r) for p, r in zip(PROMPTS, rows)]
    for cohort in cohorts:
        batch.join(cohort)
    with torch.inference_mode():
        while batch.cohorts:
            assert batch.step() is not None and batch.failed == []
    assert [engine.report(c).rows[0].generated_ids for c in cohorts] == alone
    assert len({tuple(ids) for ids in alone}) > 1
    # Its declared cache modes are the engine's: dual, which it does not declare, is refused naming what it takes.
    assert cache_modes(engine.spec) == ("none", "prefix")
    assert configured_cache_mode("prefix", "tinyfam") == "prefix"
    with pytest.raises(EngineInputError, match="this tinyfam model takes none or prefix") as refused:
        engine.generate([PROMPTS[0]], DecodeParams(**{**params.model_dump(), "cache_mode": "dual"}))
    assert refused.value.field == "cache_mode"
    # Its admission figures are its own (`TinyFamConfig.mlp_cost`), read by the memory model.
    forward = MemoryModel.for_engine(engine).forward
    assert forward == ForwardCost.of(engine.model) and (forward.mlp_activations, forward.mlp_macs) == (2 * 64, 2 * 32 * 64)


def test_the_api_serves_a_family_registered_from_the_tests(tinyfam, tmp_path):
    from fastapi.testclient import TestClient

    from service.config import Settings
    from service.main import create_app

    engine = Engine.load(tinyfam)
    params = DecodeParams(gen_length=32, block_length=16, cache_mode="prefix", threshold=0.5, ignore_eos=True)
    expected = engine.generate([PROMPTS[0]], params).rows[0].generated_ids
    settings = Settings(store_url=str(tmp_path / "store"), cache_mode="prefix")
    with TestClient(create_app(settings, engine=engine)) as client:
        schemas = client.get("/openapi.json").json()["components"]["schemas"]
        mode = schemas["GenerateRequest"]["properties"]["cache_mode"]
        enum = mode.get("enum") or next(b["enum"] for b in mode.get("anyOf", ()) if "enum" in b)
        assert enum == ["none", "prefix"]
        body = {"prompt": PROMPTS[0], "max_tokens": 32, "cache_mode": "prefix", "block_length": 16,
                "threshold": 0.5, "ignore_eos": True}
        served = client.post("/generate", json=body)
        assert served.status_code == 200, served.text
        assert served.json()["rows"][0]["generated_ids"] == expected
        refused = client.post("/generate", json={**body, "cache_mode": "dual"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "cache_mode", refused.text
        assert "this tinyfam model takes none or prefix" in refused.json()["error"]["message"]
