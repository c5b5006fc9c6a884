"""Policy fit: bit accounting, the gates, the choice, Table 4, and shard merges equal to one run."""

from __future__ import annotations

import random

import pytest

from calibration.fit import (
    DiagnosticSums,
    FitError,
    FitSettings,
    default_k_bit_cap,
    fit_layer,
    fit_policy,
    nominal_k_bit_total,
    table4,
)
from calibration.metrics import METRICS
from service.artifacts.base import Provenance
from service.artifacts.policy import PolicyTable

PROVENANCE = Provenance(data="test records", code="tests")


def _sums(**overrides) -> DiagnosticSums:
    settings = {"model_id": "tiny", "model_fingerprint": "f" * 64, "num_layers": 2, "k_group_size": 32, "top_k": 8}
    settings.update(overrides)
    return DiagnosticSums(**settings)


def _delta(l2: float, other: float = 0.0) -> dict[str, float]:
    return {name: (l2 if name == "centered_l2" else other) for name in METRICS}


def test_nominal_bits_count_short_groups_and_protected_tokens():
    # 40 reused tokens, G = 32: a full group (2 kept at 16, 30 at 4) and a short one of 8 (2 kept, 6 at 4).
    assert nominal_k_bit_total([40], 32, 4, 2) == (2 * 16 + 30 * 4) + (2 * 16 + 6 * 4)
    assert nominal_k_bit_total([3, 32], 32, 2, 4) == 3 * 16 + (4 * 16 + 28 * 2)  # a 3-token group keeps all 3
    assert nominal_k_bit_total([64], 32, 4, 0) == 64 * 4
    assert default_k_bit_cap(4) == 4.9 and default_k_bit_cap(2) == 2.9


def test_gates_refuse_low_win_rate_over_cap_and_too_few_records():
    sums = _sums()
    for r in range(8):
        sums.add_record("dual", 4, 0, {
            ("attention", 1): _delta(0.10),                          # steady small gain: accepted
            ("qerror", 1): _delta(1.0 if r < 3 else -0.1),           # mean +0.3125 but wins 3/8 < 0.5
            ("hybrid", 4): _delta(2.0),                              # big gain, 5.5 nominal bits > 4.9
            ("hybrid", 2): _delta(-0.05, other=0.01),                # weighted score negative
        }, segment_lengths=[64])
    fit = fit_layer(sums, "dual", 4, 0, FitSettings())
    assert (fit.choice.score_type, fit.choice.p) == ("attention", 1)
    assert "win rate 0.375 < 0.5" in fit.refused["qerror/p1"]
    assert "nominal K bits 5.500 > cap 4.9" in fit.refused["hybrid/p4"]
    assert "<= 0" in fit.refused["hybrid/p2"]
    # Objective: -(1.0 * 0.10) + 0.01 * (4.375 - 4)
    assert fit.objective["attention/p1"] == pytest.approx(-0.1 + 0.01 * 0.375)
    strict = fit_layer(sums, "dual", 4, 0, FitSettings(min_records=9))
    assert strict.choice.p == 0 and "8 records < 9" in strict.refused["attention/p1"]
    # A bit penalty larger than the gain keeps the baseline.
    assert fit_layer(sums, "dual", 4, 0, FitSettings(bit_penalty=1.0)).choice.p == 0
    with pytest.raises(FitError, match="layer 1"):
        fit_layer(sums, "dual", 4, 1, FitSettings())


def test_the_smallest_objective_wins_and_the_table_validates():
    sums = _sums(num_layers=1)
    for _ in range(8):
        sums.add_record("prefix", 2, 0, {("attention", 1): _delta(0.10), ("qerror", 2): _delta(0.30)},
                        segment_lengths=[32, 32])
    table, _fits = fit_policy(sums, "prefix", 2, FitSettings(), PROVENANCE, v_group_size=16)
    assert [(layer.score_type, layer.p) for layer in table.layers] == [("qerror", 2)]
    assert table.k_bit_cap == 2.9 and table.provenance.details["win_rate"] == 0.5
    assert PolicyTable.from_json(table.to_json()).id == table.id
    row = table4(sums, table)
    assert row["centered_l2"] == 100.0 and row["top1"] == 0.0 and row["protected_layers"] == 1
    # Measured on the calibration's reused tokens and configured (full groups of 32): here the same, as the
    # segments are whole groups.
    assert row["effective_k_bits"] == pytest.approx((2 * 16 + 30 * 2) / 32) == row["configured_k_bits"]
    # The same gains on 16-token segments: each group keeps 2 of 16, 3.75 bits on average > 2.9.
    short = _sums(num_layers=1)
    for _ in range(8):
        short.add_record("prefix", 2, 0, {("qerror", 2): _delta(0.30)}, segment_lengths=[16])
    assert "nominal K bits 3.750 > cap 2.9" in fit_layer(short, "prefix", 2, 0, FitSettings()).refused["qerror/p2"]


def _random_records(seed: int, count: int):
    rng = random.Random(seed)
    records = []
    for r in range(count):
        deltas = {(s, p): {name: rng.gauss(0.02, 0.1) for name in METRICS}
                  for s in ("attention", "qerror", "hybrid") for p in (1, 2, 4)}
        records.append((f"sample-{r // 6}", rng.choice(["prefix", "dual"]), rng.choice([2, 4]),
                        rng.randrange(2), deltas, [rng.randrange(1, 80)]))
    return records


def test_disjoint_shards_merge_into_exactly_the_one_run_policy():
    records = _random_records(0, 240)
    whole, first, second = _sums(), _sums(), _sums()
    for sample, mode, bits, layer, deltas, lengths in records:
        whole.add_record(mode, bits, layer, deltas, lengths)
        shard = first if int(sample.split("-")[1]) % 2 else second
        shard.add_record(mode, bits, layer, deltas, lengths)
    whole.samples = sorted({r[0] for r in records})
    first.samples = sorted({r[0] for r in records if int(r[0].split("-")[1]) % 2})
    second.samples = sorted(set(whole.samples) - set(first.samples))
    merged = second.merge(first)
    assert merged.cells == whole.cells and merged.samples == whole.samples
    settings = FitSettings(min_records=4)
    for mode, bits in whole.modes_and_bits():
        one, _ = fit_policy(whole, mode, bits, settings, PROVENANCE, 32)
        two, _ = fit_policy(DiagnosticSums.model_validate_json(merged.model_dump_json()), mode, bits, settings,
                            PROVENANCE, 32)
        assert one.id == two.id
    with pytest.raises(FitError, match="disjoint"):
        merged.merge(first)
    with pytest.raises(FitError, match="different model_fingerprint"):
        first.merge(_sums(model_fingerprint="0" * 64))
