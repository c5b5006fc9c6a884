"""Every Fast-dLLM golden run, token-exact with NFE and reveals per call, in fp32 (golden SPEC section 3).

One named departure (see `service.engine.decode`): after a block-initial pass that fills the whole block, the
reference's LLaDA cached loops still make one call that reveals nothing; the engine skips it, so those runs have
the golden's reveals without the zero entries and a lower NFE.
"""

from __future__ import annotations

import pytest

from service.engine.params import DecodeParams
from tests.support.fastdllm import golden

RUNS = [run for family in ("llada", "dream") for run in golden(f"{family}_generate.json")["runs"]]


def params_of(run: dict, ignore_eos: bool = True) -> DecodeParams:
    p = run["params"]
    fixed = p["threshold"] is None
    return DecodeParams(
        gen_length=p["gen_length"], block_length=p["block_length"],
        cache_mode="none" if run["mode"] == "nocache" else run["mode"],
        threshold=p["threshold"], steps=p["steps"] if fixed else None, ignore_eos=ignore_eos,
    )


def expected_reveals(run: dict) -> list[int]:
    """The golden's reveals per call, less the reference's empty call after a block its first pass filled."""
    if run["id"].startswith("llada") and run["mode"] != "nocache":
        return [count for count in run["reveals_per_call"] if count]
    return run["reveals_per_call"]


@pytest.mark.parametrize("run", RUNS, ids=[run["id"] for run in RUNS])
def test_golden_run(engines, run):
    engine = engines[run["id"].split("_")[0]]
    row = engine.generate([run["prompt_ids"]], params_of(run)).rows[0]
    if run["fragile"] and row.generated_ids != run["generated_ids"]:
        # Near-tie in the reference (SPEC 5): soft check, most tokens must still agree.
        same = sum(a == b for a, b in zip(row.generated_ids, run["generated_ids"]))
        assert same >= 0.9 * len(run["generated_ids"])
        pytest.skip(f"fragile run differs at {len(run['generated_ids']) - same} positions (near-tie)")
    assert row.generated_ids == run["generated_ids"]
    assert row.reveals_per_step == expected_reveals(run)
    assert row.nfe == len(expected_reveals(run)) <= run["nfe"]
    assert sum(row.steps_per_block) == row.nfe
    # ignore_eos decoded to the end: "length" (the response rule of issue 13; this asserted "stop" when the run
    # held an EOS before); the ids, EOS included, are the golden's (above).
    assert row.finish_reason == "length"


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_departure_skips_the_empty_call_after_a_full_block(engines, mode):
    run = next(r for r in RUNS if r["id"] == f"llada_p17_g64_thr0.0_{mode}")
    assert run["nfe"] == 4 and run["reveals_per_call"] == [32, 0, 32, 0]  # the reference's wasted calls
    row = engines["llada"].generate([run["prompt_ids"]], params_of(run)).rows[0]
    assert row.generated_ids == run["generated_ids"]
    assert (row.nfe, row.reveals_per_step, row.steps_per_block) == (2, [32, 32], [1, 1])


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_one_fixed_step_per_block_works_in_cached_modes(engines, mode):
    """The reference raises IndexError here (SPEC 3.4); the engine gives the no-cache answer (1 call per block)."""
    run = next(r for r in RUNS if r["id"] == "llada_p17_g64_thr0.0_nocache")
    params = DecodeParams(gen_length=64, block_length=32, cache_mode=mode, threshold=None, steps=2, ignore_eos=True)
    row = engines["llada"].generate([run["prompt_ids"]], params).rows[0]
    assert row.nfe == 2 and row.reveals_per_step == [32, 32]


EOS_RUNS = [run for run in RUNS if run["first_eos_offset"] is not None]


@pytest.mark.parametrize("run", EOS_RUNS, ids=[run["id"] for run in EOS_RUNS])
def test_eos_stops_early_with_the_same_tokens(engines, run):
    offset = run["first_eos_offset"]
    row = engines["dream"].generate([run["prompt_ids"]], params_of(run, ignore_eos=False)).rows[0]
    assert row.generated_ids == run["generated_ids"][: offset + 1]
    assert row.finish_reason == "stop"
    assert row.nfe <= run["nfe"]
    assert row.reveals_per_step == expected_reveals(run)[: row.nfe]
