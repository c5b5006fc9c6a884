"""The calibration job on the tiny LLaDA checkpoint with a directory store: diagnostics through the online
quantizer, reruns that skip finished work, shards that merge into the one-run policy, failures that leave
nothing half-written, the KVQuant state."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from threadpoolctl import threadpool_limits

from calibration import job as job_module
from calibration.corpus import write_bucket
from calibration.dllm_kvq_fit import KIND_FIT, fit_tables
from calibration.fit import DiagnosticSums
from calibration.job import CalibrationJob, JobSettings
from calibration.kvquant_fit import fit_kvquant_states
from calibration.quantize import reused_key_variants
from service.artifacts.policy import PolicyTable
from service.engine import Engine
from service.engine.kv_store import Segments
from service.quant.uniform import dequantize_k_groups, quantize_k_groups
from service.store.base import KIND_CALIBRATION_SUMS, KIND_POLICY, KIND_TRAJECTORY, open_store
from tests.support.paths import CKPT as _CKPT

CKPT = _CKPT / "llada-tiny"


def token_id_bucket(path: Path, count: int = 8, seed: int = 0) -> Path:
    """A prompt-answer bucket of token ids for a checkpoint without a tokenizer (ids below the mask id)."""
    rng = random.Random(seed)
    write_bucket(path, [{"prompt_ids": [rng.randrange(1, 80) for _ in range(rng.randrange(20, 40))],
                         "answer_ids": [rng.randrange(1, 80) for _ in range(32)]} for _ in range(count)])
    return path


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    return Engine.load(CKPT)


def _settings(tmp_path: Path, **overrides) -> JobSettings:
    values = {"model": str(CKPT), "buckets": {"qa": str(token_id_bucket(tmp_path / "qa.jsonl"))}, "samples": 2,
              "rounds": 1, "block_length": 16, "max_answer_length": 32, "steps_per_block": 4, "k_group_size": 16,
              "min_records": 4, "kvquant_bits": (4,)}
    return JobSettings(**{**values, **overrides})


def test_baseline_variant_is_kivi_and_candidates_keep_their_top_tokens_exact(engine):
    generator = torch.Generator().manual_seed(0)
    k = torch.randn(1, 4, 30, 16, generator=generator)
    v = torch.randn(1, 4, 30, 16, generator=generator)
    segments = Segments((0,), 20, 26, 30, "dual")  # reused: prefix of 20 and suffix of 4
    attention = torch.rand(1, 30, generator=generator)
    variants = reused_key_variants(engine.spec, 0, k, v, segments, 4, 8, attention, [("attention", 2)])
    reused = segments.reused_columns
    prefix = k[:, :, :20]
    kivi = dequantize_k_groups(*quantize_k_groups(prefix, 8, 4), 8, torch.float32)
    torch.testing.assert_close(variants[0][:, :20], kivi[0])
    # The 2 most attended tokens of each prefix group of 8 stay exact, the others do not.
    for start in (0, 8, 16):
        top = attention[0, start:min(start + 8, 20)].topk(2).indices + start
        assert torch.equal(variants[1][:, top], k[0][:, top])
    assert variants.shape == (2, 4, reused.numel(), 16)


def test_job_stores_everything_and_a_rerun_skips_it(engine, tmp_path):
    store = open_store(str(tmp_path / "store"))
    job = CalibrationJob(_settings(tmp_path), store, engine, progress=False)
    job.diagnose()
    tables = fit_tables(job)
    states = fit_kvquant_states(job)
    assert sorted(tables) == ["dual/2", "dual/4", "prefix/2", "prefix/4"]
    for table in tables.values():
        table.validate_for(engine.spec)
        assert store.get_model(KIND_POLICY, table.id, PolicyTable) == table
    states["4"].validate_for(engine.spec)
    assert len(store.list(KIND_TRAJECTORY)) == 2 and len(store.list(KIND_CALIBRATION_SUMS)) == 2
    sums = DiagnosticSums.model_validate_json(store.get(KIND_CALIBRATION_SUMS, store.list(KIND_CALIBRATION_SUMS)[0]))
    # 2 blocks x 3 later steps per block = 6 records per (mode, bits, layer, candidate).
    assert {cell.records for cell in sums.cells.values()} == {6}
    assert len(sums.cells) == 2 * 2 * 3 * (1 + 3 * 3)
    again = CalibrationJob(_settings(tmp_path), store, engine, progress=False)
    again.diagnose()
    fit_kvquant_states(again)
    assert again.summary.computed == {} and again.summary.skipped[KIND_CALIBRATION_SUMS] == 2
    assert {k: t.id for k, t in fit_tables(again).items()} == {k: t.id for k, t in tables.items()}


def test_shards_merge_into_the_one_run_policy(engine, tmp_path):
    whole_store = open_store(str(tmp_path / "whole"))
    shard_store = open_store(str(tmp_path / "shards"))
    whole = CalibrationJob(_settings(tmp_path, samples=3), whole_store, engine, progress=False)
    whole.diagnose()
    for index in range(2):
        CalibrationJob(_settings(tmp_path, samples=3, shard_index=index, shard_count=2), shard_store, engine,
                       progress=False).diagnose()
    merged = CalibrationJob(_settings(tmp_path, samples=3), shard_store, engine, progress=False)
    assert merged.summary.computed == {}
    assert {k: t.id for k, t in fit_tables(merged).items()} == {k: t.id for k, t in fit_tables(whole).items()}


def test_artifacts_do_not_depend_on_the_thread_count(engine, tmp_path):
    # Two machines with different thread counts (torch, OpenMP, BLAS) make byte-identical policies and states:
    # before the k-means fit was pinned to one thread, the KVQuant codebooks differed at 2 threads.
    def run(count: int, folder: str):
        torch.set_num_threads(count)
        try:
            with threadpool_limits(limits=count):
                store = open_store(str(tmp_path / folder))
                job = CalibrationJob(_settings(tmp_path, samples=1), store, engine, progress=False)
                job.diagnose()
                return fit_tables(job), fit_kvquant_states(job)["4"], store
        finally:
            torch.set_num_threads(1)

    tables_1, state_1, store_1 = run(1, "one")
    tables_n, state_n, store_n = run(2, "two")
    assert {k: t.id for k, t in tables_1.items()} == {k: t.id for k, t in tables_n.items()}
    for table in tables_1.values():
        assert store_1.get(KIND_POLICY, table.id) == store_n.get(KIND_POLICY, table.id)
    assert state_1.to_bytes() == state_n.to_bytes()


def test_a_failed_run_leaves_finished_items_and_no_policy(engine, tmp_path, monkeypatch):
    store = open_store(str(tmp_path / "store"))
    real = job_module.diagnose_trajectory
    calls = []

    def failing_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(job_module, "diagnose_trajectory", failing_second)
    job = CalibrationJob(_settings(tmp_path), store, engine, progress=False)
    with pytest.raises(RuntimeError, match="injected"):
        job.diagnose()
    assert len(store.list(KIND_CALIBRATION_SUMS)) == 1 and store.list(KIND_POLICY) == []
    with pytest.raises(FileNotFoundError, match="1 of 2 samples have no diagnostic sums"):
        fit_tables(job)
    monkeypatch.setattr(job_module, "diagnose_trajectory", real)
    rerun = CalibrationJob(_settings(tmp_path), store, engine, progress=False)
    rerun.diagnose()
    assert rerun.summary.computed[KIND_CALIBRATION_SUMS] == 1 and rerun.summary.skipped[KIND_CALIBRATION_SUMS] == 1
    fit_tables(rerun)
    assert len(store.list(KIND_POLICY)) == 4 and len(store.list(KIND_FIT)) == 1


def test_kvquant_state_from_traces_with_and_without_fisher_weights(engine):
    from calibration.forward import capture_pre_rope
    from calibration.kvquant_fit import as_rows, fit_kvquant_state
    from service.artifacts.base import Provenance

    state = torch.randint(1, 80, (40,), generator=torch.Generator().manual_seed(1))
    targets = torch.full((40,), -100)
    targets[24:] = state[24:]
    state[24:] = engine.spec.mask_id
    provenance = Provenance(data="test", code="tests")
    plain = fit_kvquant_state([capture_pre_rope(engine.model, state)], 2, engine.spec, 0.99, provenance)
    weighted = fit_kvquant_state([capture_pre_rope(engine.model, state, targets)], 2, engine.spec, 0.99, provenance)
    for fitted in (plain, weighted):
        fitted.validate_for(engine.spec)
        assert fitted.k_lut.shape == (engine.spec.num_layers, 4)
    assert weighted.meta.provenance.details["fisher"] and not plain.meta.provenance.details["fisher"]
    torch.testing.assert_close(plain.k_upper, weighted.k_upper)  # thresholds are percentiles, not weighted
    assert not torch.equal(plain.k_lut, weighted.k_lut)  # the k-means codebooks are
    # Per-channel thresholds are the 99.5th percentiles of the pre-RoPE keys of that channel.
    keys = as_rows(capture_pre_rope(engine.model, state)[0].k)
    torch.testing.assert_close(plain.k_upper[0].float(), keys.quantile(0.995, dim=0), atol=2e-3, rtol=2e-3)
    with pytest.raises(ValueError, match="at least one cache trace"):
        fit_kvquant_state([], 2, engine.spec, 0.99, provenance)


def test_diagnostic_records_assembled_by_hand(engine):
    from calibration.diagnose import DiagnoseSettings, diagnose_trajectory
    from calibration.fit import FIXED_POINT, cell_key
    from calibration.forward import cached_step, capture_qkv
    from calibration.metrics import METRICS, attention_scores, behaviour_metrics, improvements
    from calibration.trace import Trajectory, rollout
    from service.engine.scores import attention_scores as block_attention

    prompt = list(range(10, 30))
    trajectory = Trajectory(prompt_ids=tuple(prompt), answer_ids=tuple(range(40, 56)),
                            assignment=(0, 1, 1, 0, 0, 1, 0, 1, 3, 2, 2, 3, 3, 3, 2, 2), block_length=8,
                            steps_per_block=2, budgets=(4, 4, 4, 4), model_fingerprint=engine.spec.fingerprint,
                            rounds=1, objectives=(0.0,))
    settings = DiagnoseSettings(bits=(2,), k_group_size=4, score_types=("attention",), budgets=(1,))
    sums = diagnose_trajectory(engine.model, engine.spec, trajectory, "s", settings)
    states = rollout(prompt, trajectory.answer_ids, trajectory.assignment, trajectory.schedule, engine.spec.mask_id)
    for mode, tokens in (("prefix", 20 + 28), ("dual", 28 + 28)):  # dual: block 0 also reuses its 8-token suffix
        expected = {(layer, name): 0.0 for layer in range(engine.spec.num_layers) for name in METRICS}
        for block in range(2):  # one record per block: its second step
            start, end = 20 + 8 * block, 28 + 8 * block
            _, initial = capture_qkv(engine.model, states[2 * block][None])
            _, reference = capture_qkv(engine.model, states[2 * block + 1][None])
            _, fresh = cached_step(engine.model, states[2 * block + 1], mode, start, end, initial)
            segments = Segments((0,), start, end, 36, mode)
            reused = torch.zeros(36, dtype=torch.bool)
            reused[segments.reused_columns] = True
            for layer in range(engine.spec.num_layers):
                attention = block_attention(initial[layer].q[:, :, start:end], initial[layer].k, None)
                variants = reused_key_variants(engine.spec, layer, initial[layer].k, initial[layer].v, segments, 2,
                                               4, attention, [("attention", 1)])
                q = fresh[layer].q_block
                s_ref = attention_scores(q, reference[layer].k[0])
                metrics = []
                for variant in variants:  # baseline, then the candidate
                    keys = reference[layer].k[0].clone()
                    keys[:, ~reused] = fresh[layer].k_fresh
                    keys[:, reused] = variant
                    metrics.append(behaviour_metrics(s_ref, attention_scores(q, keys), reused))
                for name, value in improvements(metrics[1], metrics[0]).items():
                    expected[(layer, name)] += float(value)
        for layer in range(engine.spec.num_layers):
            cell = sums.cells[cell_key(mode, 2, layer, "attention", 1)]
            assert cell.records == 2 and cell.tokens == tokens
            for name in METRICS:
                assert cell.delta[name] / FIXED_POINT == pytest.approx(expected[(layer, name)], abs=1e-9)


def test_work_items_are_keyed_by_the_engine_dtype(engine, tmp_path):
    """A bf16 run must not reuse fp32 trajectories (their score matrices differ), so dtype is part of the key."""
    store = open_store(str(tmp_path / "store"))
    fp32 = CalibrationJob(_settings(tmp_path), store, engine, progress=False)
    bf16 = CalibrationJob(_settings(tmp_path), store, Engine.load(CKPT, dtype="bfloat16"), progress=False)
    sample = fp32.samples()[0]
    assert fp32.trajectory_key(sample) != bf16.trajectory_key(sample)
    assert fp32.trajectory_key(sample) == CalibrationJob(_settings(tmp_path), store, engine).trajectory_key(sample)


def test_cli_passes_dtype_and_device_to_the_engine():
    from calibration.cli import build_parser

    args = build_parser().parse_args(["trace", "--dtype", "bfloat16", "--device", "cuda:1"])
    assert (args.dtype, args.device) == ("bfloat16", "cuda:1")
    assert build_parser().parse_args(["fit"]).dtype == "float32"
