"""Batches: left padding, per-row results equal to each row alone, streaming and cancellation."""

from __future__ import annotations

import pytest

from service.engine.params import DecodeParams, RowOptions
from tests.support.fastdllm import four_prompts

# (arch, cache mode, Dream no-cache schedule): Dream's no-cache has two schedules, LLaDA's one.
CASES = [
    (arch, mode, schedule)
    for arch in ("llada", "dream")
    for mode, schedule in [("none", "origin"), ("none", "block"), ("prefix", "origin"), ("dual", "origin")]
    if not (arch == "llada" and schedule == "block")
]


@pytest.mark.parametrize("arch,mode,schedule", CASES)
@pytest.mark.parametrize("threshold,steps", [(0.9, None), (None, 16)])
def test_batch_rows_equal_rows_alone(engines, arch, mode, schedule, threshold, steps):
    """4 prompts of lengths 5, 17, 40, 9 (greedy and seeded sampling rows) in one batch vs each alone."""
    engine = engines[arch]
    params = DecodeParams(
        gen_length=64, block_length=32, cache_mode=mode, threshold=threshold, steps=steps, ignore_eos=True,
        dream_schedule=schedule,
    )
    prompts = four_prompts(arch)
    rows = [RowOptions(temperature=0.0), RowOptions(temperature=0.7, seed=11), RowOptions(), RowOptions(temperature=1.0, seed=5)]
    batch = engine.generate(prompts, params, rows).rows
    for prompt, options, got in zip(prompts, rows, batch):
        alone = engine.generate([prompt], params, [options]).rows[0]
        assert got.generated_ids == alone.generated_ids
        assert (got.nfe, got.reveals_per_step, got.steps_per_block) == (alone.nfe, alone.reveals_per_step, alone.steps_per_block)


def test_seeded_sampling_is_reproducible_and_seed_dependent(engines):
    params = DecodeParams(gen_length=64, block_length=32, cache_mode="dual", threshold=0.9, ignore_eos=True)
    prompt = four_prompts("llada")[1]
    first = engines["llada"].generate([prompt], params, [RowOptions(temperature=1.0, seed=3)]).rows[0]
    again = engines["llada"].generate([prompt], params, [RowOptions(temperature=1.0, seed=3)]).rows[0]
    other = engines["llada"].generate([prompt], params, [RowOptions(temperature=1.0, seed=4)]).rows[0]
    greedy = engines["llada"].generate([prompt], params).rows[0]
    assert first.generated_ids == again.generated_ids
    assert first.generated_ids != other.generated_ids
    assert first.generated_ids != greedy.generated_ids


@pytest.mark.parametrize("mode", ["none", "dual"])
def test_on_block_streams_committed_blocks_in_order(engines, mode):
    params = DecodeParams(gen_length=96, block_length=32, cache_mode=mode, threshold=0.9, ignore_eos=True)
    prompts = four_prompts("dream")[:2]
    seen = []
    report = engines["dream"].generate(prompts, params, on_block=lambda b, ids: seen.append((b, ids)))
    assert [b for b, _ in seen] == [0, 1, 2]
    for b, ids in seen:
        for row, row_ids in zip(report.rows, ids):
            # Dream's no-cache canvas commits everything at its last call; the block loop one block at a time.
            assert len(row_ids) >= 32 * (b + 1) and row_ids == row.generated_ids[: len(row_ids)]
    if mode == "dual":
        assert [len(ids[0]) for _, ids in seen] == [32, 64, 96]
    assert report.timings.first_block_s > 0


def test_cancelled_row_stops_and_others_are_unaffected(engines):
    params = DecodeParams(gen_length=64, block_length=32, cache_mode="prefix", threshold=0.9, ignore_eos=True)
    prompts = four_prompts("llada")[:2]
    calls = []

    def cancelled():
        calls.append(1)
        return [False, len(calls) >= 3]

    rows = engines["llada"].generate(prompts, params, cancelled=cancelled).rows
    alone = engines["llada"].generate(prompts[:1], params).rows[0]
    assert rows[1].finish_reason == "cancelled" and rows[1].nfe == 3
    assert rows[0].generated_ids == alone.generated_ids and rows[0].nfe == alone.nfe
