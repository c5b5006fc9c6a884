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
import shutil
import weakref
from typing import ClassVar, get_args

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from service.engine import Engine, EngineInputError
from service.engine.engine import cache_modes
from service.engine.forward_cost import ForwardCost
from service.engine.loading import detect_arch, load_checkpoint
from service.engine.models import MODEL_CLASSES, ModelConfig
from service.engine.models.llada import LLaDAModel
from service.engine.params import CacheMode, ConfiguredCacheMode, DecodeParams, configured_cache_mode
from service.runtime.memory import MemoryModel
from tests.support.fastdllm import CKPT, golden
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
class TinyFamModel(LLaDAModel):
    """A family the tree does not know: LLaDA's layers and checkpoint names under its own ``model_type``, and a
    cache-mode declaration of its own (no ``dual``), to show that detection, loading, the engine's checks and the
    API's schema follow what the class declares."""

    arch = "tinyfam"
    cache_modes: ClassVar[dict[str, str]] = {"none": "none", "prefix": "prefix"}

    @classmethod
    def config_from_hf(cls, hf: dict) -> ModelConfig:
        return dataclasses.replace(super().config_from_hf(hf), arch=cls.arch)


@pytest.fixture
def tinyfam(tmp_path, monkeypatch):
    """The tiny LLaDA checkpoint relabelled ``model_type: tinyfam``, with the family registered for this test."""
    monkeypatch.setitem(MODEL_CLASSES, TinyFamModel.arch, TinyFamModel)
    directory = tmp_path / "tinyfam"
    shutil.copytree(CKPT["llada"], directory)
    config = json.loads((directory / "config.json").read_text())
    config.update(model_type="tinyfam", architectures=["TinyFamModelLM"])
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _golden_prefix_run() -> dict:
    return next(r for r in golden("llada_generate.json")["runs"] if r["mode"] == "prefix" and not r["fragile"])


def test_a_family_registered_from_the_tests_is_detected_loaded_and_decodes(tinyfam):
    hf = json.loads((tinyfam / "config.json").read_text())
    assert detect_arch(hf) == "tinyfam"
    with pytest.raises(EngineInputError, match="llada, dream, llada2, diffusion_gemma, tinyfam"):  # the refusal lists the registry
        detect_arch({"model_type": "gpt2"})
    engine = Engine.load(tinyfam)
    assert type(engine.model) is TinyFamModel and engine.spec.arch == "tinyfam"
    # Its layers are LLaDA's and so are its weights: it decodes the LLaDA golden token for token.
    run = _golden_prefix_run()
    p = run["params"]
    params = DecodeParams(gen_length=p["gen_length"], block_length=p["block_length"], cache_mode="prefix",
                          threshold=p["threshold"], steps=p["steps"] if p["threshold"] is None else None,
                          ignore_eos=True)
    assert engine.generate([run["prompt_ids"]], params).rows[0].generated_ids == run["generated_ids"]
    # Its declared cache modes are the engine's: dual, which it does not declare, is refused naming what it takes.
    assert cache_modes(engine.spec) == ("none", "prefix")
    assert configured_cache_mode("prefix", "tinyfam") == "prefix"
    with pytest.raises(EngineInputError, match="this tinyfam model takes none or prefix") as refused:
        engine.generate([run["prompt_ids"]], DecodeParams(**{**params.model_dump(), "cache_mode": "dual"}))
    assert refused.value.field == "cache_mode"
    # Its admission figures are the dense default's (`ModelConfig.mlp_cost`), read by the memory model.
    assert MemoryModel.for_engine(engine).forward == ForwardCost.of(engine.model)


def test_the_api_serves_a_family_registered_from_the_tests(tinyfam, tmp_path):
    from fastapi.testclient import TestClient

    from service.config import Settings
    from service.main import create_app

    engine = Engine.load(tinyfam)
    settings = Settings(store_url=str(tmp_path / "store"), cache_mode="prefix")
    with TestClient(create_app(settings, engine=engine)) as client:
        schemas = client.get("/openapi.json").json()["components"]["schemas"]
        mode = schemas["GenerateRequest"]["properties"]["cache_mode"]
        enum = mode.get("enum") or next(b["enum"] for b in mode.get("anyOf", ()) if "enum" in b)
        assert enum == ["none", "prefix"]
        run = _golden_prefix_run()
        body = {"prompt": run["prompt_ids"], "max_tokens": run["params"]["gen_length"], "cache_mode": "prefix",
                "block_length": run["params"]["block_length"], "threshold": run["params"]["threshold"],
                "ignore_eos": True}
        served = client.post("/generate", json=body)
        assert served.status_code == 200, served.text
        assert served.json()["rows"][0]["generated_ids"] == run["generated_ids"]
        refused = client.post("/generate", json={**body, "cache_mode": "dual"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "cache_mode", refused.text
        assert "this tinyfam model takes none or prefix" in refused.json()["error"]["message"]
