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
from service.engine.graphs import ROW_BUCKETS, Bucket, EagerGraphs, LaterSteps, bucket_of
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
        runner = EagerGraphs(key_step=16, width_step=8)
        eager = decoded(engine, prompts, params, None)
        assert decoded(engine, prompts, params, runner) == eager
    finally:
        engine.use_graphs(saved)
    # keys: the bucket (dual: one for the whole decode, the window and stores stay; prefix: one per block, its
    # width shrinks) and the LM head's columns rounded up to a power of two (32, 16, 8, 4 as the masks go)
    blocks = 1 if cache_mode == "dual" else 2
    assert blocks <= runner.captures <= 6 * blocks
    assert runner.replays > (runner.captures if cache_mode == "dual" else 0)
    assert runner.pool.live_bytes == 0 < runner.pool.bytes_held  # the cohorts left: their runs were freed


@pytest.mark.parametrize("run", CACHED, ids=[run["id"] for run in CACHED])
def test_golden_runs_pooled_and_replayed_give_the_golden_tokens(engines, run):
    """Every cached Fast-dLLM golden run with its K/V in the pool and its later steps run as graphs would run
    them (warm-up, capture, replays over refreshed inputs; padded to small buckets): the golden tokens."""
    arch = run["id"].split("_")[0]
    engine = engines[arch]
    saved = engine.later_steps
    runner = EagerGraphs(key_step=16, width_step=8)
    try:
        engine.use_graphs(runner)
        assert engine.generate([run["prompt_ids"]], params_of(run)).rows[0].generated_ids == run["generated_ids"]
    finally:
        engine.use_graphs(saved)
    assert runner.pool.bytes_held > 0 and runner.pool.live_bytes == 0  # held in the pool, freed at the end
    assert runner.eager == len(runner._seen)  # every later step graphed: the eager ones were its shapes' warm-ups


@pytest.mark.parametrize("arch", ["llada", "dream"])
def test_a_mixed_batch_pooled_decodes_as_alone(engines, arch):
    """Requests of every cache mode, quantized and not, joining mid-flight, the full-precision ones' K/V in the
    pool (moved and grown as requests come and go) and their later steps graphed when no quantized store shares
    the forward: each decodes token for token as it does alone, eagerly."""
    engine = engines[arch]
    prompts = four_prompts(arch)
    saved = engine.later_steps
    runner = EagerGraphs(key_step=16, width_step=8)
    try:
        engine.use_graphs(runner)
        cohorts, _ = run_mixed(engine, engine.batch(forward_plan()), prompts)
        engine.use_graphs(None)
        for index, (prompt, params, row, kind, _) in enumerate(MIXED):
            alone = engine.generate([prompts[prompt]], params, [row], kv_store=_store(engine, kind)).rows[0]
            assert engine.report(cohorts[index]).rows[0].generated_ids == alone.generated_ids, index
    finally:
        engine.use_graphs(saved)
    # full-precision K/V were held in the pool and forwards of them alone gathered from it (a shape's first forward,
    # its warm-up, runs the pooled gather as a replay does)
    assert runner.pool.bytes_held > 0 == runner.pool.live_bytes and runner._seen


def test_a_new_set_of_requests_replays_the_graphs_it_has(engines):
    """The same prompts decoded twice by new requests (new stores): the second batch captures nothing, every one
    of its later steps replays a graph the first captured (keyed by bucket, not by the stores it reads)."""
    engine = engines["llada"]
    prompts = four_prompts("llada")
    params = DecodeParams(gen_length=64, block_length=32, cache_mode="dual", threshold=None, steps=16,
                          ignore_eos=True)
    saved = engine.later_steps
    try:
        runner = EagerGraphs(key_step=16, width_step=8)
        first = decoded(engine, prompts, params, runner)
        captures, replays, grown = runner.captures, runner.replays, runner.pool.generation
        assert decoded(engine, prompts[::-1], params, runner) == first[::-1]  # other stores, rows in another order
    finally:
        engine.use_graphs(saved)
    assert runner.pool.generation == grown and runner.captures == captures and runner.replays > 2 * replays


def test_requests_joining_and_leaving_capture_one_graph_per_key():
    """Requests of mixed lengths and cache modes joining as others leave (`benchmarks/graph_keys.py`): at most one
    capture per key (bucket, LM-head columns, pool generation), the pool's generations few (it doubles), fewer
    captures than keys by the stores read (the key before the pool), and the tokens of plain eager forwards."""
    from benchmarks.decode_speed import random_engine
    from benchmarks.graph_keys import count, requests

    engine = random_engine("tiny", torch.float32, "cpu", 1.0)
    found = count(engine, requests(16, engine.spec.vocab_size, 0), 4, check=True)
    assert found["tokens as eager"]
    assert found["graphed forwards"] > found["shapes"] >= found["buckets"] > 1
    assert found["captures"] <= found["keys (shape, pool generation)"]
    assert found["pool growths"] <= 8  # doubling from the first request's run to the peak: 16 x 700 tokens at most
    assert found["captures"] < found["keys by stores (before the pool)"]


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
    assert graphs.bytes_held > 0 and graphs.pool.bytes_held > 0
    captures = graphs.captures  # new requests, the same shapes: replayed, not captured (keyed by bucket alone)
    assert decoded(engine, prompts[::-1], params, graphs) == eager[::-1]
    assert graphs.captures == captures
    for run in (r for r in CACHED if r["id"].startswith("llada") and r["mode"] == cache_mode):
        engine.use_graphs(LaterSteps(capture=True))
        assert engine.generate([run["prompt_ids"]], params_of(run)).rows[0].generated_ids == run["generated_ids"]
