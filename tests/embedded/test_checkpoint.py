"""The shipped embedded default checkpoint: LLaDA layout, bf16 size, spec against config and tokenizer, answers."""

import json

import pytest
import torch
from safetensors import safe_open

from evaluation.embedded_task import BLOCK_LENGTH, GEN_LENGTH, load_split, score
from service.engine import Engine
from service.engine.params import DecodeParams
from tests.support.paths import EMBEDDED


@pytest.fixture(scope="module")
def engine():
    return Engine.load(None, threads=1)


def test_files_and_tensors_in_llada_layout():
    for name in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "README.md"]:
        assert (EMBEDDED / name).is_file(), name
    assert (EMBEDDED / "model.safetensors").stat().st_size < 20e6
    config = json.loads((EMBEDDED / "config.json").read_text())
    expected = {"model.transformer.wte.weight", "model.transformer.ln_f.weight", "model.transformer.ff_out.weight"}
    for i in range(config["n_layers"]):
        expected |= {f"model.transformer.blocks.{i}.{n}.weight" for n in
                     ["attn_norm", "q_proj", "k_proj", "v_proj", "attn_out", "ff_norm", "ff_proj", "up_proj", "ff_out"]}
    with safe_open(EMBEDDED / "model.safetensors", framework="pt") as f:
        assert set(f.keys()) == expected
        assert {f.get_tensor(k).dtype for k in expected} == {torch.bfloat16}
        assert tuple(f.get_tensor("model.transformer.wte.weight").shape) == (config["vocab_size"], config["d_model"])


def test_spec_matches_config_and_tokenizer(engine):
    config = json.loads((EMBEDDED / "config.json").read_text())
    spec, tok = engine.spec, engine.tokenizer
    assert spec.arch == "llada" and spec.model_id == "embedded"
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads) == (config["n_layers"], config["n_heads"],
                                                                   config["n_kv_heads"])
    assert spec.head_dim == config["d_model"] // config["n_heads"]
    assert spec.vocab_size == config["vocab_size"] == len(tok)
    assert spec.mask_id == config["mask_token_id"] == tok.mask_token_id
    assert spec.pad_id == tok.pad_token_id != spec.mask_id
    assert {tok.eos_token_id, tok.convert_tokens_to_ids("<|eot_id|>")} <= set(spec.eos_ids)
    generation = json.loads((EMBEDDED / "generation_config.json").read_text())
    assert generation["mask_token_id"] == spec.mask_id and generation["bos_token_id"] == tok.bos_token_id


@pytest.mark.parametrize("op", ["copy", "next", "sum"])
def test_answers_a_held_out_question_in_dual_mode(engine, op):
    q = next(q for q in load_split("validation") if q.op == op)
    params = DecodeParams(gen_length=GEN_LENGTH, block_length=BLOCK_LENGTH, cache_mode="dual", threshold=0.9)
    row = engine.generate([engine.encode_prompt(q.prompt, chat=True)], params).rows[0]
    assert score(row.text if row.text is not None else engine.decode_text(row.generated_ids), q.answer)
    assert row.finish_reason == "stop"
