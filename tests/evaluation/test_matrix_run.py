"""The matrix on a tiny LLaDA: every planned cell runs once, resumes, and the tables match direct decoding."""

from __future__ import annotations

import json

import pytest

from evaluation.controls import fixed_rule_table
from evaluation.matrix import (
    MatrixSettings,
    find_artifacts,
    plan_cells,
    plan_controls,
    plan_sides,
    run_matrix,
    write_outputs,
)
from service.artifacts.base import Provenance
from service.artifacts.policy import LayerPolicy, PolicyTable
from service.engine.agreement import token_agreement
from service.engine.params import DecodeParams, RowOptions
from service.quant.accounting import policy_k_bits
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


@pytest.mark.integration  # lm-eval's evaluate reports its environment: torch's collect_env runs pip as a process
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

    assert len(list(out.glob(f"cells/tiny/{engine.spec.fingerprint[:16]}/*/tiny_echo-*.json"))) == 4
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
    # Configured bits: what the configuration sets on full groups of 32, the policy's own figure (p = 1 on every
    # layer); no figure for the cache-only rows.
    policy = open_store(store_url[0]).get_model(KIND_POLICY, policy_id, PolicyTable)
    assert rows[("dual", "dllm_kvq")]["configured_bits"] == {"k": policy_k_bits(policy), "v": 4.0}
    assert policy_k_bits(policy) == (31 * 4 + 16) / 32
    assert rows[("dual", "kivi")]["configured_bits"] == {"k": 4.0, "v": 4.0}
    assert rows[("dual", "none")]["configured_bits"] is None
    md = paths["md"].read_text()
    assert "| dLLM-KVQ (4-bit) |" in md and "- tiny dual-kvquant-4: no KVQuant state" in md


@pytest.mark.integration  # lm-eval's evaluate reports its environment: torch's collect_env runs pip as a process
def test_a_cell_is_recomputed_when_the_limit_changes_and_tables_use_one_slice(tmp_path, engine):
    task_dir = write_echo_task(tmp_path / "tasks", direct_answers(engine))
    cells = plan_cells(["tiny"], ["dual"], [4], ["kivi"])
    out = tmp_path / "matrix"

    def run(limit):
        settings = MatrixSettings(tasks=["tiny_echo"], batch_size=4, limit=limit, include_path=str(task_dir))
        return run_matrix(cells, settings, out, lambda name: engine)

    assert len(run(2)["ran"]) == 3
    wider = run(4)
    assert len(wider["ran"]) == 3 and wider["already_done"] == 0  # nothing of the 2-document run is reused
    tables = json.loads(write_outputs(out, ["tiny_echo"], files=wider["files"])["json"].read_text())
    assert tables["documents"] == {"tiny_echo": 4}
    assert {r["agreement"]["documents"] for r in tables["blocks"][0]["rows"][1:]} == {4}
    again = run(2)  # the first run's files are still there and match again
    assert again["ran"] == [] and again["already_done"] == 3
    assert "Every row: the same 2 documents of tiny_echo." in write_outputs(
        out, ["tiny_echo"], files=again["files"])["md"].read_text()


@pytest.mark.integration  # lm-eval's evaluate reports its environment: torch's collect_env runs pip as a process
def test_table3_controls_and_kv_ablation_rows(tmp_path, engine, store_url):
    url, policy_id = store_url
    task_dir = write_echo_task(tmp_path / "tasks", direct_answers(engine))
    settings = MatrixSettings(tasks=["tiny_echo"], batch_size=4, limit=4, store_url=url, include_path=str(task_dir))
    out = tmp_path / "matrix"
    controls = run_matrix(plan_controls(["tiny"], ["dual"], [4], ["attention:2", "qerror:1"]), settings, out,
                          lambda name: engine)
    assert [r["cell"] for r in controls["ran"]] == [
        "none", "dual-none", "dual-kivi-4", "dual-dllm_kvq-4-fixed-attention-p2", "dual-dllm_kvq-4-fixed-qerror-p1",
        "dual-dllm_kvq-4"]
    # The fixed rules are ordinary policy tables in the store, one (score type, p) on every layer.
    rule = fixed_rule_table(engine.spec, "dual", 4, "attention:2")
    assert open_store(url).get_model(KIND_POLICY, rule.id, PolicyTable).layers == [
        LayerPolicy(score_type="attention", p=2)] * engine.spec.num_layers
    # Stored after the fitted policy, they are still not taken for it.
    assert find_artifacts(open_store(url), engine.spec.fingerprint) == {("dllm_kvq", "dual", 4): policy_id}
    table3 = json.loads(write_outputs(out, ["tiny_echo"], files=controls["files"], table="3",
                                      rules=["attention:2", "qerror:1"])["json"].read_text())
    rows = table3["blocks"][0]["rows"]
    assert [(r["label"], r["k_rule"]) for r in rows] == [
        ("Cache only", "No quantization"), ("KIVI K/V", "None; all low-bit"),
        ("Fixed K rule", "Attention, p = 2"), ("Fixed K rule", "Q-error, p = 1"),
        ("dLLM-KVQ", "Selected per layer")]
    assert rows[2]["artifact_id"] == rule.id and rows[4]["artifact_id"] == policy_id
    # Nominal K bits by hand: 36 reused K tokens per block in groups of 4 and 32, p tokens of each at 16 bits.
    assert rows[1]["kv"]["k_nominal_bits"] == 4.0
    assert rows[2]["kv"]["k_nominal_bits"] == pytest.approx(((2 * 4 + 2 * 16) + (30 * 4 + 2 * 16)) / 36)
    assert rows[2]["configured_bits"]["k"] == (30 * 4 + 2 * 16) / 32  # full groups: (b (G - p) + 16 p) / G
    assert all(r["agreement"]["reference"] == "Cache only" for r in rows[1:])

    sides = run_matrix(plan_sides(["tiny"], ["dual"], [4], ["kivi"]), settings, out, lambda name: engine)
    assert [r["cell"] for r in sides["ran"]] == ["dual-kivi-4-konly", "dual-kivi-4-vonly"]  # the rest is reused
    kv = json.loads(write_outputs(out, ["tiny_echo"], files=sides["files"], table="kv")["json"].read_text())
    bits = {r["sides"]: (r["kv"]["k_nominal_bits"], r["kv"]["v_nominal_bits"])
            for r in kv["blocks"][0]["rows"] if r["method"] == "kivi"}
    assert bits == {"kv": (4.0, 4.0), "k": (4.0, 16.0), "v": (16.0, 4.0)}
