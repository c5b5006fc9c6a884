"""How many CUDA graphs the later steps capture while requests join and leave (issue 41, item 4), counted on the CPU.

A captured graph costs more than an eager forward (a capture records the forward and runs it once), so a server
that captures whenever its set of requests changes pays for graphs it never replays. This benchmark runs
``--requests`` requests of mixed prompt lengths, response lengths and cache modes (dual and prefix, full-precision
K/V, one row each) through a running batch of at most ``--running`` requests at once, a new one joining as soon as
one leaves (as the server admits), planned as the server plans (`service.runtime.scheduler.forward_plan`), with the
later steps run by `service.engine.graphs.EagerGraphs`: the pool, the keys, the warm-ups and the replays of CUDA,
each graph a stand-in that runs eagerly. Its counts are machine-independent:

* **graphed forwards**: later-step forwards whose rows all live in the pool, which a GPU runs from a graph (each
  shape's first forward is its eager warm-up, the rest captured or replayed);
* **buckets**, **shapes** (bucket and LM-head columns) and **keys** (shape and pool generation) among them, and
  **keys by stores**: the (shape, stores read) pairs, which keyed a graph before the pool;
* **captures**: graphs captured (a key's first forward after its shape's warm-up), **replays**, **warm-ups**;
* **pool growths** (each makes new buffers and drops the graphs over the old ones) and **moves** (runs moved down
  to close gaps, graphs kept);
* **tokens**: whether every request decoded the tokens it decodes with plain eager forwards (the same schedule,
  ``--check``).

Before the pool (commit 26d2866, graphs keyed by bucket and the stores they read, the same run): see
docs/benchmarks.md.

``--methods`` gives each request a store of one of the methods, in turn (``none``: full precision; ``kivi4``,
``kivi2``, ``dllm_kvq``: quantized, 4/2/4 bits, on the fused kernel's path, forced on the CPU under Triton's
interpreter). Their later steps are graphed over the packed pool (`service.engine.packed_pool`); with
``--no-packed-pool`` they are not (what main did before it: a forward of quantized stores ran eagerly, uncaptured),
counted as **eager (not graphable)**.

``--model llada2`` (or a LLaDA2 checkpoint's folder; ``llada2`` is tests/data/llada2/llada2-tiny) runs LLaDA2's
block-causal batch instead (`service.engine.block_causal_graphs`), full-precision K/V: prompts of 8 to 300 tokens,
responses of 32, 64 or 128 in blocks of 32, cache mode ``block``, 8 steps per block, EOS kept (the checkpoint's own
lengths); the counts are the same, less the keys by stores, plus the **host syncs** of one later-step iteration
graphed (3 rows, LLaDA2.0-mini's expert layout in 2 layers, `benchmarks/llada2_iteration_cost.py`): the
iteration's and those of its replayed forward (`benchmarks.iteration_cost.Counter`).

Usage: ``python benchmarks/graph_keys.py [--requests 64] [--running 16] [--preset tiny] [--seed 0] [--check]
[--methods none] [--no-packed-pool] [--model llada2]``.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: benchmarks/ is not a package
# The quantized stores' fused kernel on CPU tensors: Triton's interpreter, set before Triton is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
from benchmarks.decode_speed import random_engine
from benchmarks.iteration_cost import Counter
from service.engine import Engine
from service.engine.graphs import EagerGraphs, LaterSteps, bucket_of, graphable
from service.engine.params import DecodeParams
from service.runtime.scheduler import forward_plan


def requests(count: int, vocab: int, seed: int, longest: int = 600) -> list[tuple[list[int], DecodeParams]]:
    """``count`` requests (prompt ids, settings), seeded: prompts of 8 to ``longest`` tokens, responses of 32, 64 or 128
    in blocks of 32, dual or prefix cache, 8 fixed steps per block (every request's later steps take part in every
    iteration of its blocks), ``ignore_eos`` (the lengths are the requests', not the random weights')."""
    rng = random.Random(seed)
    made = []
    for _ in range(count):
        prompt = [rng.randrange(3, vocab - 1) for _ in range(rng.randrange(8, longest + 1))]
        gen = rng.choice((32, 64, 128))
        params = DecodeParams(gen_length=gen, block_length=32, cache_mode=rng.choice(("dual", "prefix")),
                              threshold=None, steps=gen // 4, ignore_eos=True)
        made.append((prompt, params))
    return made


def llada2_requests(count: int, seed: int) -> list[tuple[list[int], DecodeParams]]:
    """``count`` LLaDA2 requests (module doc, ``--model``), seeded; ids below the tiny checkpoint's specials."""
    rng = random.Random(seed)
    made = []
    for _ in range(count):
        prompt = [rng.randrange(3, 490) for _ in range(rng.randrange(8, 301))]
        gen = rng.choice((32, 64, 128))
        made.append((prompt, DecodeParams(gen_length=gen, block_length=32, cache_mode="block", threshold=None,
                                          steps=gen // 4)))
    return made


class Recording(EagerGraphs):
    """:class:`EagerGraphs` that records, for every forward it runs from a graph (captured or replayed, or its
    shape's warm-up), its shape (bucket, LM-head columns), the pool's generation, and the runs it read (what keyed a
    graph before the pool, with the bucket: one run per store's buffers)."""

    def __init__(self, packed: bool = True, **kwargs) -> None:
        super().__init__(**kwargs)
        self.graphed: list[tuple] = []
        self.ungraphable = 0  # window forwards over every layer that could not be graphed
        if not packed:  # quantized stores keep their own tensors: their forwards run eagerly (before the pool)
            self.pool.packed = None

    def __call__(self, model, group, pad_id, columns=None):
        before = self.captures + self.replays + self.eager
        pooled = graphable(group, self.pool)
        out = super().__call__(model, group, pad_id, columns)
        if pooled and self.captures + self.replays + self.eager > before:
            # the runs themselves (ids stay unique): a full-precision store's, a quantized store's packed runs
            runs = tuple(getattr(p.cohort.store, "packed_runs", None) or p.cohort.store.run for p in group)
            self.graphed.append(((bucket_of(group, self.key_step, self.width_step), out[0].shape[1]),
                                 self.generation, runs))
        elif not pooled and group[0].kind == "window" and group[0].layers is None:
            self.ungraphable += 1
        return out

    def keyed(self, model, shape, inputs, logits_at, rows):
        self.graphed.append((shape, self.pool.generation, None))  # LLaDA2's later steps: every one pooled
        return super().keyed(model, shape, inputs, logits_at, rows)


class SyncCounting(EagerGraphs):
    """:class:`EagerGraphs` counting the host syncs of the forwards it runs from a graph (``syncs``)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.syncs = 0

    def keyed(self, model, shape, inputs, logits_at, rows):
        with Counter() as counter:
            out = super().keyed(model, shape, inputs, logits_at, rows)
        self.syncs += counter.syncs
        return out


def llada2_syncs(rows: int = 3, layers: int = 2) -> dict:
    """Host syncs of one LLaDA2 later-step iteration replayed by :class:`SyncCounting` (module doc): a batch of
    ``rows`` requests of different prompts stepped past the block-initial forward, the warm-up and the capture."""
    from benchmarks.llada2_iteration_cost import mini_layout
    from service.engine.block_causal import BlockCausalParams
    from service.engine.block_causal_batch import BlockCausalBatch, BlockCausalCohort

    model = mini_layout(layers, 512)
    runner = SyncCounting()
    batch = BlockCausalBatch(model, later_steps=runner)
    settings = BlockCausalParams(gen_length=64, block_length=32, steps=8, threshold=float("inf"))
    gen = torch.Generator().manual_seed(rows)
    for i in range(rows):
        prompt = torch.randint(0, 500, (40 + 32 * i,), generator=gen).tolist()  # rows in step: one forward
        batch.join(BlockCausalCohort(model, [prompt], [settings], model.config.mask_id, (model.config.eos_id,)))
    with torch.inference_mode():
        for _ in range(3):  # block-initial, the later step's warm-up, its capture
            batch.step()
        replays, runner.syncs = runner.replays, 0
        with Counter() as counter:
            batch.step()
    return {"iteration syncs": counter.syncs, "forward syncs": runner.syncs, "replayed": runner.replays - replays}



def store_of(engine: Engine, method: str):
    """A request's store for ``method`` (module doc; None: the engine's full-precision store)."""
    if method == "none":
        return None
    from service.quant.config import KVQuantConfig
    from service.quant.store import make_kv_store

    if method == "dllm_kvq":
        from tests.engine.test_decode_quantized import policy_for

        table = policy_for(engine.spec, 4, p=2)
        config = KVQuantConfig(method="dllm_kvq", bits=4, k_group_size=8, policy_id=table.id)
        return make_kv_store(config, engine.spec, artifact=table, attention="triton")
    return make_kv_store(KVQuantConfig(method="kivi", bits=int(method[-1]), k_group_size=8), engine.spec,
                         attention="triton")


def serve(engine: Engine, made: list[tuple[list[int], DecodeParams]], running: int,
          runner: LaterSteps | None, methods: tuple[str, ...] = ("none",), held: list | None = None
          ) -> list[list[int]]:
    """Decode ``made`` with at most ``running`` requests at once, each joining as soon as one left, the later steps
    run by ``runner`` (None: plain eager forwards), request ``i``'s store of ``methods[i % len(methods)]``; each
    request's generated ids, in order. ``held``: the batch is appended to it (its counts read after)."""
    engine.use_graphs(runner)
    batch = engine.batch(forward_plan())
    if held is not None:
        held.append(batch)
    pending, cohorts = list(range(len(made))), {}
    with torch.inference_mode():
        while pending or batch.cohorts:
            while pending and len(batch.cohorts) < running:
                index = pending.pop(0)
                store = store_of(engine, methods[index % len(methods)])
                cohorts[index] = engine.cohort([made[index][0]], made[index][1], None, store)
                batch.join(cohorts[index])
            batch.step()
            if batch.failed:
                raise batch.failed[0][1]
    return [engine.report(cohorts[i]).rows[0].generated_ids for i in range(len(made))]


def count(engine: Engine, made: list[tuple[list[int], DecodeParams]], running: int, check: bool,
          methods: tuple[str, ...] = ("none",), packed: bool = True) -> dict:
    """The counts of the module doc for one run."""
    runner = Recording(packed=packed)
    tokens = serve(engine, made, running, runner, methods)
    graphed = runner.graphed
    found = {"requests": len(made), "running": running, "graphed forwards": len(graphed),
             "buckets": len({shape[0] for shape, _, _ in graphed}), "shapes": len({s for s, _, _ in graphed}),
             "keys (shape, pool generation)": len({(s, g) for s, g, _ in graphed}),
             "keys by stores (before the pool)": len({(s, tuple(map(id, r))) for s, _, r in graphed if r}),
             "captures": runner.captures, "replays": runner.replays, "warm-ups": len({s for s, _, _ in graphed}),
             "eager (not graphable)": runner.ungraphable,
             "pool growths": runner.pool.generation, "pool moves": runner.pool.moves,
             "packed pool generations": runner.pool.packed.generation if packed else 0}
    if check:
        held: list = []
        found["tokens as eager"] = tokens == serve(engine, made, running, None, methods, held)
        if hasattr(held[0], "peak_bytes"):  # LLaDA2: the pool's buffers against the eager caches' peak
            found["K/V pool bytes"] = runner.pool.bytes_held
            found["eager caches' peak bytes"] = held[0].peak_bytes
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--running", type=int, default=16)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true", help="decode again eagerly and compare the tokens")
    parser.add_argument("--methods", default="none", help="stores, in turn: none, kivi4, kivi2, dllm_kvq")
    parser.add_argument("--longest", type=int, default=600, help="longest prompt")
    parser.add_argument("--no-packed-pool", action="store_true", help="quantized stores not pooled (before it)")
    parser.add_argument("--model", default=None, help="llada2 (tests/data/llada2/llada2-tiny) or a LLaDA2 "
                        "checkpoint's folder: its block-causal batch instead of --preset")
    args = parser.parse_args()
    methods = tuple(args.methods.split(","))
    if args.model is not None:
        from service.engine.loading import load_checkpoint

        path = Path(__file__).resolve().parents[1] / "tests/data/llada2/llada2-tiny" if args.model == "llada2" else args.model
        loaded = load_checkpoint(path)
        engine = Engine(loaded.model, loaded.spec, None, torch.float32, torch.device("cpu"))
        found = count(engine, llada2_requests(args.requests, args.seed), args.running, args.check)
        del found["keys by stores (before the pool)"]
        syncs = llada2_syncs()
        found["host syncs per later step"] = syncs["iteration syncs"]
        found["of them in its forward"] = syncs["forward syncs"]
    else:
        engine = random_engine(args.preset, torch.float32, "cpu", 1.0)
        found = count(engine, requests(args.requests, engine.spec.vocab_size, args.seed, args.longest),
                      args.running, args.check, methods, not args.no_packed_pool)
    for name, value in found.items():
        print(f"{name:>26}: {value}")


if __name__ == "__main__":
    main()
