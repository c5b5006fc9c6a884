"""The matrix on a tiny LLaDA: every planned cell runs once, resumes, and the tables match direct decoding."""

from __future__ import annotations

import json

import pytest

from evaluation.matrix import MatrixSettings, find_artifacts, plan_cells, run_matrix, write_outputs
from service.artifacts.base import Provenance
from service.artifacts.policy import LayerPolicy, PolicyTable
from service.engine.agreement import token_agreement
from service.engine.params import DecodeParams, RowOptions
from service.quant.config import KVQuantConfig
from service.quant.store import make_kv_store
from service.store.base import KIND_POLICY, open_store
from tests.evaluation.conftest import MAX_GEN_TOKS, PROMPTS, STOP, direct_answers, write_echo_task


@pytest.fixture(scope="module")
def store_url(tmp_path_factory, engine):
    url = str(tmp_path_factory.mktemp("store"))
    table = PolicyTable(model_id="tiny", weights_fingerprint=engine.spec.fingerprint, cache_mode="dual", bits=4,
                        k_group_size=32, v_group_size=16, k_bit_cap=4.9,
                        layers=[LayerPolicy(score_type="attention", p=1)] * engine.spec.num_layers,
                        provenance=Provenance(data="test", code="test"))
    store = open_store(url)
    store.put_model(KIND_POLICY, table)
    store.close()
    return url, table.id


def _direct(engine, config: KVQuantConfig, policy=None):
    params = DecodeParams(gen_length=64, block_length=32, cache_mode="dual", threshold=0.9)
    rows = []
    for prompt in PROMPTS:
        store = make_kv_store(config, engine.spec, policy) if config.method != "none" else None
        rows.append(engine.generate([engine.encode_prompt(prompt, chat=False)], params, [RowOptions(stop=(STOP,), max_tokens=MAX_GEN_TOKS)],
                                    kv_store=store).rows[0])
    return rows


def test_matrix_runs_resumes_and_compares_rows(tmp_path, engine, store_url):
    url, policy_id = store_url
    answers = direct_answers(engine)
    task_dir = write_echo_task(tmp_path / "tasks", answers)
    assert find_artifacts(open_store(url), engine.spec.fingerprint) == {("dllm_kvq", "dual", 4): policy_id}
    cells = plan_cells(["tiny"], ["dual"], [4], ["none", "kivi", "kvquant", "dllm_kvq"])
    settings = MatrixSettings(tasks=["tiny_echo"], batch_size=4, store_url=url, include_path=str(task_dir))
    reported = []
    out = tmp_path / "matrix"
    first = run_matrix(cells, settings, out, lambda name: engine, reported.append)
    assert [r["cell"] for r in first["ran"]] == ["none", "dual-none", "dual-kivi-4", "dual-dllm_kvq-4"]
    assert first["skipped"] == [{"model": "tiny", "cell": "dual-kvquant-4",
                                 "reason": "no KVQuant state for (dual, 4-bit) in the store"}]
    assert [r["artifact_id"] for r in reported] == [None, None, None, policy_id]

    assert len(list(out.glob(f"cells/tiny/{engine.spec.fingerprint[:16]}/*/tiny_echo.json"))) == 4
    # Resume: finished cells are not run again; the skipped one is looked up again (a state may exist by now).
    again = run_matrix(cells, settings, out, lambda name: engine)
    assert again["ran"] == [] and again["already_done"] == 4 and again["skipped"] == first["skipped"]

    paths = write_outputs(out, ["tiny_echo"], first["skipped"])
    blocks = json.loads(paths["json"].read_text())["blocks"]
    rows = {(r["cache_mode"], r["method"]): r for r in blocks[0]["rows"]}
    assert rows[("dual", "none")]["scores"]["tiny_echo"] == 100.0  # the references are the cache-only answers
    # Agreement columns against decoding the same prompts directly with the same KV stores.
    cache_only = _direct(engine, KVQuantConfig())
    kivi = _direct(engine, KVQuantConfig(method="kivi", bits=4))
    em = 100 * sum(a.text == b.text for a, b in zip(kivi, cache_only)) / len(PROMPTS)
    agree = 100 * sum(token_agreement(a.generated_ids, b.generated_ids) for a, b in zip(kivi, cache_only)) / len(PROMPTS)
    assert rows[("dual", "kivi")]["agreement"]["exact_match"] == pytest.approx(em)
    assert rows[("dual", "kivi")]["agreement"]["token_agreement"] == pytest.approx(agree)
    assert rows[("dual", "kivi")]["scores"]["tiny_echo"] == pytest.approx(em)  # same texts, same exact match
    assert rows[("dual", "kivi")]["kv"]["k_nominal_bits"] == 4.0
    # By hand: each block reuses 36 K tokens (4 prompt + 32 response) in a group of 4 and one of 32, each keeping
    # p=1 token at 16 bits: (3*4 + 16) + (31*4 + 16) = 168 bits over 36 tokens.
    assert rows[("dual", "dllm_kvq")]["kv"]["k_nominal_bits"] == pytest.approx(168 / 36)
    md = paths["md"].read_text()
    assert "| dLLM-KVQ (4-bit) |" in md and "- tiny dual-kvquant-4: no KVQuant state" in md
