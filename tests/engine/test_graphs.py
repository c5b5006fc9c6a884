"""Later steps bucketed, padded and (on CUDA) replayed from graphs (`service.engine.graphs`, issue 41 item 4).

On the CPU the padding and bucketing run eagerly: every Fast-dLLM golden run and a batch of requests of mixed
lengths, cache modes and stores (quantized and not) give the tokens of the unpadded forwards. Small key and width
steps make every later step padded (keys, window columns and, in the batch, rows). The CUDA tests (capture,
replay equal to eager, token-identical decodes) skip without a GPU; `benchmarks/gpu_check.sh` runs them.
"""

from __future__ import annotations

import pytest
import torch

from service.engine.batch import run_forward
from service.engine.graphs import ROW_BUCKETS, Bucket, LaterSteps, bucket_of
from service.engine.params import DecodeParams
from service.runtime.scheduler import forward_plan
from tests.engine.test_continuous_batch import MIXED, _store, run_mixed
from tests.engine.test_decode_golden import RUNS, params_of
from tests.engine.test_decode_quantized import states  # noqa: F401 (a fixture of _store's stores)
from tests.support.fastdllm import four_prompts

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


class Counting(LaterSteps):
    """A padded eager runner that records each window forward's bucket and real shapes."""

    def __init__(self) -> None:
        super().__init__(capture=False, key_step=16, width_step=8)
        self.padded: list[tuple[Bucket, int, int, int]] = []

    def __call__(self, model, group, pad_id, columns=None):
        if group[0].kind == "window" and group[0].layers is None:
            rows = sum(len(p.rows) for p in group)
            self.padded.append((bucket_of(group, 16, 8), rows, max(p.width for p in group),
                                max(p.seq_len for p in group) + 1))
        return super().__call__(model, group, pad_id, columns)


@pytest.fixture
def padded(engines):
    """Each engine's later steps run through a :class:`Counting` runner for the test, then as before."""
    runners = {arch: Counting() for arch in engines}
    saved = {arch: engine.later_steps for arch, engine in engines.items()}
    for arch, engine in engines.items():
        engine.use_graphs(runners[arch])
    yield runners
    for arch, engine in engines.items():
        engine.use_graphs(saved[arch])


def test_buckets_round_rows_keys_and_widths_up():
    assert ROW_BUCKETS[0] == 1 and list(ROW_BUCKETS) == sorted(ROW_BUCKETS)
    with pytest.raises(ValueError, match="rows, width and key_len"):
        Bucket(0, 8, 16)
    with pytest.raises(ValueError, match="max_bytes"):
        LaterSteps(capture=False, key_step=0)


CACHED = [run for run in RUNS if run["mode"] != "nocache" and not run["fragile"]]


@pytest.mark.parametrize("run", CACHED, ids=[run["id"] for run in CACHED])
def test_golden_runs_padded_give_the_golden_tokens(engines, padded, run):
    arch = run["id"].split("_")[0]
    row = engines[arch].generate([run["prompt_ids"]], params_of(run)).rows[0]
    assert row.generated_ids == run["generated_ids"]
    steps = padded[arch].padded
    if steps:  # a block its first pass fills has no later step
        assert any(b.width > w or b.key_len > k for b, _, w, k in steps)  # padding happened


@pytest.mark.parametrize("arch", ["llada", "dream"])
def test_a_mixed_batch_padded_decodes_as_unpadded(engines, padded, arch):
    """Requests of every cache mode, quantized and not, prompts of different lengths, joining mid-flight: with
    their later steps padded to buckets (rows too) each decodes token for token as it does unpadded, alone."""
    engine = engines[arch]
    prompts = four_prompts(arch)
    cohorts, _ = run_mixed(engine, engine.batch(forward_plan()), prompts)
    assert any(b.rows > rows for b, rows, _, _ in padded[arch].padded)  # padded rows took part
    engine.use_graphs(None)
    for index, (prompt, params, row, kind, _) in enumerate(MIXED):
        alone = engine.generate([prompts[prompt]], params, [row], kv_store=_store(engine, kind)).rows[0]
        assert engine.report(cohorts[index]).rows[0].generated_ids == alone.generated_ids, index


def test_padded_logits_equal_unpadded_at_the_real_rows(engines):
    """One later-step forward of three requests, padded to four rows and to the key and width steps: the real
    rows' logits are the unpadded forward's (within float rounding), its tokens the same."""
    engine = engines["llada"]
    prompts = four_prompts("llada")[:3]
    params = DecodeParams(gen_length=64, block_length=32, cache_mode="dual", threshold=None, steps=8,
                          ignore_eos=True)
    batch = engine.batch(forward_plan())
    with torch.inference_mode():
        for prompt in prompts:
            batch.join(engine.cohort([prompt], params))
        batch.step()  # the block-initial pass
        group = forward_plan()(batch.passes(batch.cohorts))[0]
        assert group[0].kind == "window" and len(group) == 3
        plain = run_forward(engine.model, group, engine.spec.pad_id)
        bucket = bucket_of(group, 16, 8)
        assert bucket.rows == 4
        padded_out = run_forward(engine.model, group, engine.spec.pad_id, None, bucket)
    torch.testing.assert_close(padded_out[0], plain[0], rtol=1e-4, atol=1e-4)
    assert torch.equal(padded_out[1], plain[1])
    assert torch.equal(padded_out[0].argmax(-1), plain[0].argmax(-1))


def decoded(engine, prompts: list[list[int]], params: DecodeParams, runner: LaterSteps | None) -> list[list[int]]:
    """Each prompt's generated ids, the prompts decoded together (one request each) with ``runner``'s later steps
    (None: plain eager forwards)."""
    engine.use_graphs(runner)
    batch = engine.batch(forward_plan())
    cohorts = [engine.cohort([p], params) for p in prompts]
    with torch.inference_mode():
        for cohort in cohorts:
            batch.join(cohort)
        while batch.cohorts:
            batch.step()
    return [engine.report(c).rows[0].generated_ids for c in cohorts]


class _Rerun:
    """A stand-in for a captured graph on the CPU: its replay runs the captured call again over the same input
    tensors (what a CUDA graph's replay reads) and writes the same output tensor; the hook's cached flat index is
    recomputed from its destination buffer, as the captured graph recomputes it."""

    def __init__(self, model, inputs, logits_at):
        self.model, self.inputs, self.logits_at = model, inputs, logits_at
        self.logits = model(**inputs, logits_at=logits_at)

    def replay(self):
        self.inputs["kv_hook"]._flat = None
        self.logits.copy_(self.model(**self.inputs, logits_at=self.logits_at))


class Rerun(LaterSteps):
    """:class:`LaterSteps` with capture on, its graphs :class:`_Rerun` stand-ins: the keys, the warm-up, the
    persistent inputs refreshed before each replay and the graphs dropped with their stores, on the CPU."""

    def __init__(self) -> None:
        super().__init__(capture=True, key_step=16, width_step=8)

    @staticmethod
    def _can_capture(device):
        return True

    @staticmethod
    def _record(model, inputs, logits_at):
        graph = _Rerun(model, inputs, logits_at)
        return graph, graph.logits, 0


@pytest.mark.parametrize("cache_mode", ["dual", "prefix"])
def test_replays_over_persistent_inputs_decode_as_eager(engines, cache_mode):
    """A batch of mixed prompt lengths replays its later steps from persistent inputs refreshed each step, block
    after block (the store written in place), and decodes as the plain eager forwards; full-precision stores only
    are captured, and a graph goes when its stores leave."""
    engine = engines["llada"]
    prompts = four_prompts("llada")
    params = DecodeParams(gen_length=64, block_length=32, cache_mode=cache_mode, threshold=None, steps=16,
                          ignore_eos=True)

    saved = engine.later_steps
    try:
        runner = Rerun()
        eager = decoded(engine, prompts, params, None)
        assert decoded(engine, prompts, params, runner) == eager
    finally:
        engine.use_graphs(saved)
    # keys: the bucket (dual: one for the whole decode, the window and stores stay; prefix: one per block, its
    # width shrinks) and the LM head's columns rounded up to a power of two (32, 16, 8, 4 as the masks go)
    blocks = 1 if cache_mode == "dual" else 2
    assert blocks <= runner.captures <= 6 * blocks
    assert runner.replays > (runner.captures if cache_mode == "dual" else 0)
    runner._drop_stale()  # the cohorts left: their stores were cleared
    assert runner.bytes_held == 0 and not runner._graphs


@CUDA
@pytest.mark.parametrize("cache_mode", ["dual", "prefix"])
def test_cuda_graphs_replay_token_identical_to_eager(cache_mode):
    """On CUDA: a batch of mixed prompt lengths decodes with its later steps captured and replayed exactly as
    eagerly, and the graphs were captured and replayed (not merely run eagerly)."""
    from service.engine import Engine
    from tests.support.fastdllm import CKPT

    engine = Engine.load(CKPT["llada"], device="cuda")
    prompts = four_prompts("llada")
    params = DecodeParams(gen_length=64, block_length=32, cache_mode=cache_mode, threshold=None, steps=16,
                          ignore_eos=True)

    graphs = LaterSteps(capture=True)
    eager = decoded(engine, prompts, params, None)
    assert decoded(engine, prompts, params, graphs) == eager
    assert graphs.captures >= 1 and graphs.replays > graphs.captures
    assert graphs.bytes_held > 0
    for run in (r for r in CACHED if r["id"].startswith("llada") and r["mode"] == cache_mode):
        engine.use_graphs(LaterSteps(capture=True))
        assert engine.generate([run["prompt_ids"]], params_of(run)).rows[0].generated_ids == run["generated_ids"]
