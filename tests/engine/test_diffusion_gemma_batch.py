"""DiffusionGemma's running batch (`service.engine.renoise.RenoisingBatch`): requests join and leave between
iterations, each row decodes as its solo run (per-row generators seeded by the request's seed), canvases stream as
they commit, the engine cuts and refuses as the API needs, and admission counts the K/V by layer kind.

The solo run is `service.engine.renoise.generate` in ``per_row`` mode at batch 1, which
tests/engine/test_diffusion_gemma.py holds token-exact against the live transformers reference.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from service.engine import Engine
from service.engine.errors import EngineInputError
from service.engine.loading import load_checkpoint
from service.engine.models.diffusion_gemma import GLOBAL, SLIDING
from service.engine.params import DecodeParams, RowOptions
from service.engine.renoise import generate, settings_for
from service.engine.response import cut_response
from service.runtime.memory import MemoryModel

TINY = Path(__file__).resolve().parents[1] / "data" / "diffusion_gemma" / "dgemma-tiny"


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    loaded = load_checkpoint(TINY)
    return Engine(loaded.model, loaded.spec, loaded.tokenizer, torch.float32, torch.device("cpu"))


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(length * 31 + seed)
    return [498] + [rng.randrange(0, 496) for _ in range(length - 1)]


def _params(gen: int, **renoising) -> DecodeParams:
    return DecodeParams(**{"gen_length": gen, "block_length": 16, "cache_mode": "prefix", **renoising})


def _solo(engine, prompt: list[int], params: DecodeParams, seed: int):
    """The row's solo run: `generate` at batch 1 on a generator seeded by its seed."""
    settings = settings_for(params, TINY)
    return generate(engine.model, [prompt], settings, engine.spec.eos_ids, engine.spec.pad_id,
                    [torch.Generator().manual_seed(seed)])[0]


#: Requests of different prompt lengths (both sides of the 12-token window), lengths, steps, stopping rules.
REQUESTS = [
    (_prompt(5, 0), _params(32, max_denoising_steps=4), [11, 12]),  # n = 2
    (_prompt(14, 1), _params(48, max_denoising_steps=3, entropy_bound=1.0), [13]),
    (_prompt(3, 2), _params(16, max_denoising_steps=10, t_max=0.1, t_min=0.01, stability_threshold=1,
                            confidence_threshold=3.0), [14]),
    (_prompt(30, 3), _params(32, max_denoising_steps=2, t_max=2.0, t_min=0.5), [15, 16, 17]),  # n = 3
]


def test_rows_joining_mid_run_decode_as_alone(engine):
    """Cohorts join a running batch at different iterations (one at the start, one after 3 iterations, two more
    after 7) and leave when done: every row's ids, decoder and encoder passes equal its solo run's, and the
    batch ran rows of several cohorts in one forward."""
    batch = engine.batch()
    cohorts = [engine.cohort([prompt] * len(seeds), params, [RowOptions(seed=s) for s in seeds])
               for prompt, params, seeds in REQUESTS]
    joins = {0: [0], 3: [1], 7: [2, 3]}
    finished, widest, iteration = [], 0, 0
    with torch.inference_mode():
        while iteration <= max(joins) or batch.cohorts:
            for index in joins.get(iteration, []):
                batch.join(cohorts[index])
            finished += batch.step()
            assert not batch.failed
            widest = max(widest, batch.rows)
            iteration += 1
    assert set(map(id, finished)) == set(map(id, cohorts))
    assert widest > max(len(seeds) for *_, seeds in REQUESTS)  # rows of several cohorts stacked in a forward
    for cohort, (prompt, params, seeds) in zip(cohorts, REQUESTS, strict=True):
        for row, seed in zip(cohort.rows, seeds, strict=True):
            alone = _solo(engine, prompt, params, seed)
            assert row.result.generated_ids == alone.generated_ids
            assert (row.result.nfe, row.result.encoder_passes) == (alone.nfe, alone.encoder_passes)
            assert row.result.steps_per_canvas == alone.steps_per_canvas
    assert len({tuple(c.rows[0].result.steps_per_canvas) for c in cohorts}) > 1


def test_engine_report_is_the_solo_run_cut_at_max_tokens_and_stop(engine):
    """``Engine.generate`` (the worker's cohort and report): the solo run's committed ids cut at ``max_tokens``
    (not a multiple of the canvas), the first EOS and a stop string; ``steps_per_block`` are its canvases' steps."""
    prompt, params = _prompt(6, 4), _params(48, max_denoising_steps=3)
    alone = _solo(engine, prompt, params, 21)
    report = engine.generate([prompt], params, [RowOptions(seed=21, max_tokens=37)])
    row = report.rows[0]
    expected = cut_response(alone.generated_ids, engine.spec.eos_ids, False, 37)
    assert row.generated_ids == expected.ids and row.finish_reason == expected.finish_reason
    assert len(row.generated_ids) <= 37 and row.nfe == alone.nfe and row.steps_per_block == alone.steps_per_canvas
    text = engine.decode_text(alone.ids_to_eos(engine.spec.eos_ids)[:37])
    stop = text[len(text) // 2: len(text) // 2 + 2]
    stopped = engine.generate([prompt], params, [RowOptions(seed=21, max_tokens=37, stop=(stop,))]).rows[0]
    assert stop and stopped.text == text[: text.index(stop)] and stopped.finish_reason == "stop"


def test_the_same_seed_gives_the_same_text_and_seeds_differ(engine):
    prompt, params = _prompt(8, 5), _params(32, max_denoising_steps=3)
    first, again, other = (engine.generate([prompt], params, [RowOptions(seed=s)]).rows[0].generated_ids
                           for s in (3, 3, 4))
    assert first == again and first != other


def test_each_committed_canvas_is_streamed(engine):
    """``on_block`` once per canvas every row committed, with each row's committed ids so far (n = 2 rows whose
    canvases stop at different steps)."""
    prompt, params = _prompt(9, 6), _params(48, max_denoising_steps=6, t_max=0.1, t_min=0.01,
                                            stability_threshold=1, confidence_threshold=3.0)
    seen: list[tuple[int, list[list[int]]]] = []
    report = engine.generate([prompt, prompt], params, [RowOptions(seed=1), RowOptions(seed=2)],
                             on_block=lambda block, ids: seen.append((block, [list(r) for r in ids])))
    width = engine.model.config.canvas_length
    canvases = max(len(row.steps_per_block) for row in report.rows)
    assert [block for block, _ in seen] == list(range(canvases))
    for block, ids in seen:
        for row_ids, solo in zip(ids, (_solo(engine, prompt, params, s) for s in (1, 2)), strict=True):
            assert row_ids == solo.generated_ids[: (block + 1) * width]


@pytest.mark.parametrize(("options", "field"), [
    ({"temperature": 0.7}, "temperature"), ({"logprobs": 0}, "logprobs"), ({"grammar": object()}, "response_format"),
])
def test_row_options_the_family_does_not_define_are_refused_by_name(engine, options, field):
    with pytest.raises(EngineInputError, match="DiffusionGemma") as refused:
        engine.generate([[498, 5]], _params(16), [RowOptions(**options)])
    assert refused.value.field == field


@pytest.mark.parametrize(("update", "field"), [
    ({"steps": 16, "threshold": None}, "steps"), ({"threshold": 0.5}, "threshold"),
    ({"cache_mode": "none"}, "cache_mode"), ({"t_max": 0.3, "t_min": 0.4}, "t_max"),
])
def test_settings_the_family_does_not_serve_are_refused_by_name(engine, update, field):
    with pytest.raises(EngineInputError) as refused:
        engine.generate([[498, 5]], _params(16, **update))
    assert refused.value.field == field


def test_a_failing_callback_fails_its_request_alone(engine):
    """A request whose ``on_block`` raises leaves the batch in ``failed``; the other one finishes as alone."""
    batch = engine.batch()
    prompt, params = _prompt(4, 7), _params(32, max_denoising_steps=2)

    def broken(block, ids):
        raise RuntimeError("client went away")

    bad = engine.cohort([prompt], params, [RowOptions(seed=1)], on_block=broken)
    good = engine.cohort([prompt], params, [RowOptions(seed=2)])
    batch.join(bad)
    batch.join(good)
    failed = []
    with torch.inference_mode():
        while batch.cohorts:
            batch.step()
            failed += batch.failed
    assert [c for c, _ in failed] == [bad]
    assert good.rows[0].result.generated_ids == _solo(engine, prompt, params, 2).generated_ids


def test_admission_counts_kv_by_layer_kind(engine):
    """The memory model's KV bytes of a request: sliding layers at most W - 1 positions (the same for a long
    prompt as for one at the window), global layers growing with the text; at least what the row held at the
    end of its decode (the last canvas is never encoded: one canvas less)."""
    memory = MemoryModel.for_engine(engine)
    config = engine.model.config
    per = config.kv_bytes_per_token(4)
    assert per[SLIDING] and per[GLOBAL]
    params = _params(32, max_denoising_steps=1)
    window = config.sliding_window - 1
    short, long = (memory.cost(n, params, 0.0).kv for n in (window, window + 100))
    assert long - short == 100 * per[GLOBAL]  # the sliding layers' share did not grow
    prompt = _prompt(20, 8)
    caches: list = []
    settings = settings_for(params, TINY)
    generate(engine.model, [prompt], settings, engine.spec.eos_ids, None, [torch.Generator().manual_seed(0)],
             caches=caches)
    held = sum(caches[0].row_bytes(0).values())
    cost = memory.cost(len(prompt), params, 0.0)
    assert held <= cost.kv and cost.kv - held == config.canvas_length * per[GLOBAL]
    assert cost.transient >= config.sampler_bytes()


def test_the_cache_mode_refusal_lists_diffusion_gemma_truly(engine):
    """The masked families' 400 for ``block`` names the families that take it; DiffusionGemma is among them and
    does take it (its committed canvases' cache, as prefix and dual name it: the same tokens)."""
    from service.engine.engine import check_cache_mode
    from tests.support.fastdllm import CKPT

    with pytest.raises(EngineInputError, match=r"diffusion_gemma \(renoising\)") as refused:
        check_cache_mode(load_checkpoint(CKPT["llada"]).spec, "block")
    assert refused.value.field == "cache_mode"
    prompt = _prompt(6, 9)
    ids = {mode: engine.generate([prompt], _params(16, cache_mode=mode, max_denoising_steps=2),
                                 [RowOptions(seed=1)]).rows[0].generated_ids for mode in ("block", "prefix", "dual")}
    assert ids["block"] == ids["prefix"] == ids["dual"]


def test_the_work_bound_counts_max_denoising_steps():
    """A request's work (`work_tokens`, held against the server's ceiling) grows with a given
    max_denoising_steps, and bounds the decoder passes it can make: canvases (at most the blocks) x steps."""
    from service.runtime.scheduler import FORWARD_FLOOR_TOKENS, work_tokens

    small, large = (work_tokens(10, _params(64, max_denoising_steps=n)) for n in (8, 8_000))
    # Each pass is charged at least the floor (its fixed cost), here over the 74 tokens it holds.
    assert large == 4 * 8_000 * FORWARD_FLOOR_TOKENS > small == work_tokens(10, _params(64))  # 64 calls bound 4 x 8
    assert work_tokens(1000, _params(64, max_denoising_steps=8)) == 4 * 16 * (1000 + 64)  # long: its tokens


def test_a_cancelled_request_leaves_and_the_other_goes_on(engine):
    """A request whose flag is set (its client went away) leaves after the iteration, reported ``cancelled``; the
    request beside it decodes as alone."""
    batch = engine.batch()
    prompt, params = _prompt(7, 10), _params(48, max_denoising_steps=3)
    flag = {"set": False}
    gone = engine.cohort([prompt], params, [RowOptions(seed=1)], cancelled=lambda: [flag["set"]])
    kept = engine.cohort([prompt], params, [RowOptions(seed=2)])
    batch.join(gone)
    batch.join(kept)
    finished = []
    with torch.inference_mode():
        finished += batch.step()
        flag["set"] = True
        while batch.cohorts:
            finished += batch.step()
    assert gone in finished and engine.report(gone).rows[0].finish_reason == "cancelled"
    assert gone.rows[0].result.nfe == 2  # flags are polled after each iteration: it ran the one after it was set
    assert kept.rows[0].result.generated_ids == _solo(engine, prompt, params, 2).generated_ids
