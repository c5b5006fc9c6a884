"""Checkpoint loading: formats, sources, dtypes, fingerprints and refusals."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from service.engine import Engine, EngineInputError
from service.engine.loading import EMBEDDED_DIR, weights_fingerprint
from tests.support.fastdllm import CKPT, REPO_ROOT, golden


def _shard(src, dst):
    """Write ``src``'s single-file checkpoint as two shards plus an index, the way LLaDA-8B is published."""
    dst.mkdir()
    for name in src.iterdir():
        if name.name != "model.safetensors":
            shutil.copy(name, dst / name.name)
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, shard_names in halves.items():
        save_file({n: tensors[n] for n in shard_names}, dst / shard, metadata={"format": "pt"})
    weight_map = {n: shard for shard, shard_names in halves.items() for n in shard_names}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _logits(engine):
    ids = torch.tensor([golden(f"{engine.spec.arch}_forward.json")["all_masks_after_prompt"]["input_ids"]])
    with torch.no_grad():
        return engine.model(ids)


@pytest.mark.parametrize("arch", ["llada", "dream"])
def test_sharded_checkpoint_loads_the_same_model(engines, tmp_path, arch):
    _shard(CKPT[arch], tmp_path / "sharded")
    sharded = Engine.load(tmp_path / "sharded")
    assert sharded.spec == dataclasses.replace(engines[arch].spec, model_id=str(tmp_path / "sharded"))
    torch.testing.assert_close(_logits(sharded), _logits(engines[arch]), atol=0, rtol=0)


def test_fingerprint_follows_values_not_layout(engines, tmp_path):
    tensors = load_file(CKPT["llada"] / "model.safetensors")
    assert weights_fingerprint(tensors) == engines["llada"].spec.fingerprint
    tensors["model.transformer.ln_f.weight"] = tensors["model.transformer.ln_f.weight"] + 1e-3
    assert weights_fingerprint(tensors) != engines["llada"].spec.fingerprint


def test_spec_facts(engines):
    llada, dream = engines["llada"].spec, engines["dream"].spec
    assert (llada.arch, llada.num_layers, llada.num_heads, llada.num_kv_heads, llada.head_dim) == ("llada", 3, 4, 4, 16)
    assert (llada.vocab_size, llada.mask_id, llada.eos_ids, llada.pad_id) == (384, 336, (81,), 81)
    assert (dream.arch, dream.num_kv_heads, dream.vocab_size, dream.mask_id, dream.eos_ids) == ("dream", 2, 320, 266, (243,))
    assert engines["llada"].tokenizer is None


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_load(dtype):
    engine = Engine.load(CKPT["dream"], dtype=dtype)
    assert engine.dtype == getattr(torch, dtype)
    assert all(p.dtype == engine.dtype for p in engine.model.parameters())
    logits = _logits(engine)
    assert logits.dtype == engine.dtype and torch.isfinite(logits.float()).all()


def test_bad_load_arguments_say_what_is_legal(tmp_path):
    with pytest.raises(EngineInputError, match="legal: float32"):
        Engine.load(CKPT["llada"], dtype="int8")
    with pytest.raises(EngineInputError, match="legal: cpu"):
        Engine.load(CKPT["llada"], device="tpu")
    with pytest.raises(EngineInputError, match="config.json"):
        Engine.load(tmp_path)
    with pytest.raises(EngineInputError, match="local Hugging Face cache"):
        Engine.load("no-such-org/no-such-model")


def test_missing_embedded_default_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr("service.engine.loading.EMBEDDED_DIR", tmp_path)
    with pytest.raises(EngineInputError, match="embedded default model"):
        Engine.load(None)


@pytest.mark.skipif(not (EMBEDDED_DIR / "config.json").is_file(), reason="no embedded default model in this tree")
def test_embedded_default_loads_with_its_tokenizer():
    engine = Engine.load(None)
    assert engine.spec.model_id == "embedded" and engine.tokenizer is not None
    assert engine.encode_prompt("2 + 3", chat=True)


@pytest.mark.integration  # a fresh interpreter with an offline HF cache
def test_repo_id_from_offline_hf_cache(tmp_path):
    snapshot = tmp_path / "hub" / "models--tiny-org--dream-tiny" / "snapshots" / ("a" * 40)
    shutil.copytree(CKPT["dream"], snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("a" * 40)
    env = {**os.environ, "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    code = "from service.engine import Engine; e = Engine.load('tiny-org/dream-tiny'); print(e.spec.fingerprint)"
    out = subprocess.run([sys.executable, "-c", code], check=False, env=env, cwd=REPO_ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == Engine.load(CKPT["dream"]).spec.fingerprint
