"""DiffusionGemma's preemption at a canvas boundary (`service.engine.renoise.RenoisingBatch.preempt` / ``resume``):
a preempted cohort's committed K/V go, and when it resumes its encoder passes are re-run one per run (the prompt,
then each committed canvas) before the pass it was about to make, so its K/V are bit for bit those it would have
held, and every row decodes token for token, pass for pass, as not preempted (its generator, committed ids and
counts never left it).

The run it is compared with is the same cohort in a batch of its own, stepped in lock step; the solo run
(`service.engine.renoise.generate`) is held to the transformers reference by tests/engine/test_diffusion_gemma.py.
"""

from __future__ import annotations

import pytest
import torch

from service.engine.params import RowOptions
from service.engine.renoise import CAPABILITIES, generate, replay_rows, settings_for
from service.quant.config import KVQuantConfig
from service.quant.store import make_kv_store
from tests.engine.test_diffusion_gemma_batch import TINY, _params, _prompt
from tests.engine.test_diffusion_gemma_batch import engine as tiny_engine


@pytest.fixture(scope="module")
def engine():
    return tiny_engine.__wrapped__()  # the batch tests' engine (dgemma-tiny, float32, CPU, one thread)


def _held(cohort) -> list[list[tuple[torch.Tensor, torch.Tensor] | None]]:
    """Each row's committed K/V per layer as its cache reads them."""
    return [[row.cache.read(layer, 0) for layer in range(row.cache.config.num_layers)] for row in cohort.rows]


def _same_kv(a, b) -> bool:
    return all((x is None) == (y is None) and (x is None or (torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])))
               for rows_a, rows_b in zip(a, b, strict=True) for x, y in zip(rows_a, rows_b, strict=True))


#: A long prompt (past the 12-token window) over several canvases, and one of 3 tokens (its passes run alone:
#: `STACKABLE_TOKENS`) with two rows that stop every iteration (one step per canvas).
CASES = [
    (_prompt(30, 1), _params(64, max_denoising_steps=3, entropy_bound=1.0), [7]),
    (_prompt(3, 2), _params(48, max_denoising_steps=1), [8, 9]),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_a_cohort_preempted_at_every_canvas_boundary_decodes_as_not_preempted(engine, case):
    """The cohort is preempted at each canvas boundary after its first (its prompt and canvases encoded), waits
    two iterations while another request runs in its batch, and resumes: after every iteration its K/V equal
    the not-preempted copy's bit for bit, and at the end its ids, decoder and encoder passes and steps per
    canvas (and the solo run's ids)."""
    prompt, params, seeds = CASES[case]
    rows = [RowOptions(seed=s) for s in seeds]
    batch, reference = engine.batch(), engine.batch()
    cohort, twin = (engine.cohort([prompt] * len(seeds), params, rows) for _ in range(2))
    other = engine.cohort([_prompt(9, 3)], _params(48, max_denoising_steps=2), [RowOptions(seed=5)])
    batch.join(cohort)
    batch.join(other)
    reference.join(twin)
    preempted, waiting, canvases_seen = 0, None, set()
    with torch.inference_mode():
        while not twin.done:
            if waiting is None and cohort in batch.cohorts and batch.preemptible(cohort):
                committed = len(cohort.rows[0].result.steps_per_canvas)
                if committed and committed not in canvases_seen:  # once per boundary
                    canvases_seen.add(committed)
                    waiting = (batch.preempt(cohort), 2)
                    preempted += 1
                    assert cohort not in batch.cohorts
                    assert all(row.cache.length[0] == 0 for row in cohort.rows)  # its K/V went
            elif waiting is not None:
                call, left = waiting
                if left == 0:
                    batch.resume(cohort, call)
                    batch.join(cohort)
                    waiting = None
                else:
                    waiting = (call, left - 1)
            if waiting is None:
                reference.step()
            batch.step()
            assert not batch.failed and not reference.failed
            if waiting is None and not cohort.done:
                assert _same_kv(_held(cohort), _held(twin))
    assert preempted >= 2, preempted
    for row, alone in zip(cohort.rows, twin.rows, strict=True):
        assert row.result.generated_ids == alone.result.generated_ids
        assert (row.result.nfe, row.result.encoder_passes) == (alone.result.nfe, alone.result.encoder_passes)
        assert row.result.steps_per_canvas == alone.result.steps_per_canvas
    settings = settings_for(params, TINY)
    solo = generate(engine.model, [prompt], settings, engine.spec.eos_ids, engine.spec.pad_id,
                    [torch.Generator().manual_seed(seeds[0])])[0]
    assert cohort.rows[0].result.generated_ids == solo.generated_ids


def test_replaying_the_text_in_one_pass_would_not_be_exact(engine):
    """Why the runs are re-encoded one pass per run: one encoder pass over the prompt and a committed canvas
    writes other K/V (bit for bit) than the prompt's pass and the canvas's pass, so a replay in one pass would
    not be the cache the cohort had (this is what the test above would catch)."""
    prompt, params = CASES[0][0], CASES[0][1]
    batch = engine.batch()
    cohort = engine.cohort([prompt], params, [RowOptions(seed=7)])
    batch.join(cohort)
    with torch.inference_mode():
        while not (batch.preemptible(cohort) and cohort.rows[0].result.steps_per_canvas):
            batch.step()
        held = _held(cohort)
        call = batch.preempt(cohort)
        runs = call[0]
        assert [len(r) for r in runs] == [len(prompt)]  # the prompt; the committed canvas is pending
        batch.step()  # another canvas in, so that two runs are replayed
        batch.resume(cohort, {0: runs})
        batch.join(cohort)
        batch.step()  # replays the prompt, encodes the canvas, one step
        while not batch.preemptible(cohort):
            batch.step()
        two = _held(cohort)
        call = batch.preempt(cohort)
        assert [len(r) for r in call[0]] == [len(prompt), engine.model.config.canvas_length]
        batch.resume(cohort, {0: [torch.cat(call[0])]})  # the whole text in one pass
        batch.join(cohort)
        replay_rows(engine.model, cohort.rows)
        assert not _same_kv(_held(cohort), two)
        cohort.rows[0].cache = type(cohort.rows[0].cache)(engine.model.config, 1)
        cohort.rows[0].encoded = []
        batch.resume(cohort, {0: list(call[0])})  # one pass per run
        assert replay_rows(engine.model, cohort.rows) == (2, 2)  # (forwards, row-forwards): the replay's cost
        assert _same_kv(_held(cohort), two)
    assert held  # the first boundary's K/V were held


def test_not_preemptible_mid_canvas_nor_with_packed_kv(engine):
    """Mid-canvas (a canvas, its self-conditioning input and stopping history in flight) a cohort is not
    preemptible and ``preempt`` refuses; a cohort whose K/V a quantized store holds packed is not either (its
    accounting counts each write)."""
    assert CAPABILITIES.preemption
    batch = engine.batch()
    cohort = engine.cohort([_prompt(10, 4)], _params(32, max_denoising_steps=4, entropy_bound=0.01),
                           [RowOptions(seed=1)])
    batch.join(cohort)
    assert batch.preemptible(cohort)  # nothing encoded yet: its prompt is its next pass
    with torch.inference_mode():
        batch.step()
    assert cohort.rows[0].canvas is not None and not batch.preemptible(cohort)
    with pytest.raises(ValueError, match="canvas boundary"):
        batch.preempt(cohort)
    store = make_kv_store(KVQuantConfig(method="kivi", bits=4, k_group_size=8, v_group_size=8), engine.spec)
    packed = engine.cohort([_prompt(10, 4)], _params(32, max_denoising_steps=1), [RowOptions(seed=1)], store)
    batch.join(packed)
    assert packed.rows[0].cache.packed is not None and not batch.preemptible(packed)
