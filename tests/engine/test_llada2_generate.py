"""LLaDA2.0 and 2.1 block-causal decoding token for token against the reference's runs, in every cache mode."""

from __future__ import annotations

import pytest
import torch

from service.engine.block_causal import BLOCK_CAUSAL_CACHE_MODES, BlockCausalParams, transfer_schedule
from service.engine.block_causal_batch import generate, generate_batch
from service.engine.loading import load_checkpoint
from tests.support.llada2 import LLADA2_CKPT, llada2_golden

RUNS = {family: llada2_golden(f"{family}_generate.json")["runs"] for family in ("llada2", "llada21")}


@pytest.fixture(scope="module")
def llada2():
    return {family: load_checkpoint(path) for family, path in LLADA2_CKPT.items()}


def params_of(run: dict, cache_mode: str, editing: bool) -> BlockCausalParams:
    """The reference's ``generate`` arguments of a golden run as :class:`BlockCausalParams`."""
    p = run["params"]
    extra = {}
    if editing:
        extra = {"editing_threshold": p["editing_threshold"], "max_post_steps": p["max_post_steps"],
                 "min_transfer": p.get("num_to_transfer", 1)}
    return BlockCausalParams(gen_length=p["gen_length"], block_length=p["block_length"], steps=p["steps"],
                             threshold=p["threshold"], cache_mode=cache_mode,
                             eos_early_stop=p.get("eos_early_stop", False), editing=editing, **extra)


def check_run(result, run: dict) -> None:
    """Token-exact, same forward count and reveals per call; a fragile run (a near-tie) is a soft check.

    The golden harness saw the last call's writes only inside the returned ids (tests/data/llada2/README.md):
    that call counts the columns it wrote there.
    """
    start = len(run["prompt_ids"])
    end = start + len(result.generated_ids)
    reveals = list(result.reveals_per_call)
    if reveals:
        reveals[-1] = sum(start <= c < end for c in result.last_call_columns)
    got = (result.generated_ids, result.nfe, reveals)
    want = (run["generated_ids"], run["nfe"], run["reveals_per_call"])
    if got != want and run["fragile"]:
        pytest.xfail(f"{run['id']}: a near-tie (top-2 gap or threshold margin under 1e-4) decided otherwise")
    assert got == want


def test_schedule_puts_the_remainder_first():
    assert transfer_schedule(16, 5) == [4, 3, 3, 3, 3]
    assert transfer_schedule(4, 6) == [1, 1, 1, 1, 0, 0]


#: (family, run) of both golden files: 2.0 runs decode with 2.0's rule, 2.1 runs with editing.
CASES = [(family, run) for family, runs in RUNS.items() for run in runs]


@pytest.mark.parametrize("cache_mode", BLOCK_CAUSAL_CACHE_MODES)
@pytest.mark.parametrize("family, run", CASES, ids=[run["id"] for _, run in CASES])
def test_generate_matches_reference(llada2, family, run, cache_mode):
    loaded = llada2[family]
    result = generate(loaded.model, run["prompt_ids"], params_of(run, cache_mode, editing=family == "llada21"),
                      loaded.spec.mask_id, loaded.spec.eos_ids)
    check_run(result, run)


@pytest.mark.parametrize("modes", [("block",), ("none", "block")], ids=["block", "mixed"])
def test_rows_decode_as_alone_in_one_batch(llada2, modes):
    # All 52 runs in one batch: prompts of 5-40 tokens, responses of 40-96, blocks of 16 and 32, 2.0 and 2.1
    # settings (the two checkpoints share their weights), rows leaving at different iterations; with "mixed"
    # every other row recomputes in full.
    loaded = llada2["llada2"]
    settings = [params_of(run, modes[i % len(modes)], editing=family == "llada21")
                for i, (family, run) in enumerate(CASES)]
    results = generate_batch(loaded.model, [run["prompt_ids"] for _, run in CASES], settings,
                             loaded.spec.mask_id, loaded.spec.eos_ids)
    soft = []
    for (_, run), result in zip(CASES, results):
        try:
            check_run(result, run)
        except pytest.xfail.Exception:
            soft.append(run["id"])
    assert not soft or all(run["fragile"] for _, run in CASES if run["id"] in soft)


def test_the_engine_serves_llada2_requests_and_refuses_what_it_lacks(llada2):
    from service.engine import Engine, EngineInputError
    from service.engine.params import DecodeParams, RowOptions

    loaded = llada2["llada2"]
    engine = Engine(loaded.model, loaded.spec, None, torch.float32, torch.device("cpu"))
    run = next(r for _, r in CASES if r["id"] == "llada2_p5_g64_thr05_s32")
    for mode in ("none", "block", "dual"):
        report = engine.generate([run["prompt_ids"]], DecodeParams(gen_length=64, threshold=0.5, cache_mode=mode))
        assert (report.rows[0].generated_ids, report.rows[0].nfe) == (run["generated_ids"], run["nfe"])
    fixed = next(r for _, r in CASES if r["id"] == "llada2_p5_g64_fixed_s8")
    report = engine.generate([fixed["prompt_ids"]], DecodeParams(gen_length=64, steps=16, cache_mode="block"))
    assert (report.rows[0].generated_ids, report.rows[0].nfe) == (fixed["generated_ids"], fixed["nfe"])
    with pytest.raises(EngineInputError, match="remasking"):
        engine.generate([[1, 2]], DecodeParams(gen_length=32, remasking="random"), [RowOptions(temperature=0.5)])
    with pytest.raises(EngineInputError, match="dream_schedule 'block' is a Dream setting") as refused:
        engine.generate([[1, 2]], DecodeParams(gen_length=32, cache_mode="none", dream_schedule="block"))
    assert refused.value.field == "dream_schedule"
    with pytest.raises(EngineInputError, match="ELBO"):
        engine.likelihood([1, 2, 3], 4, 4, 0)
