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

Usage: ``python benchmarks/graph_keys.py [--requests 64] [--running 16] [--preset tiny] [--seed 0] [--check]
[--methods none] [--no-packed-pool]``.
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
          runner: LaterSteps | None, methods: tuple[str, ...] = ("none",)) -> list[list[int]]:
    """Decode ``made`` with at most ``running`` requests at once, each joining as soon as one left, the later steps
    run by ``runner`` (None: plain eager forwards), request ``i``'s store of ``methods[i % len(methods)]``; each
    request's generated ids, in order."""
    engine.use_graphs(runner)
    batch = engine.batch(forward_plan())
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
             "keys by stores (before the pool)": len({(s, tuple(map(id, r))) for s, _, r in graphed}),
             "captures": runner.captures, "replays": runner.replays, "warm-ups": len({s for s, _, _ in graphed}),
             "eager (not graphable)": runner.ungraphable,
             "pool growths": runner.pool.generation, "pool moves": runner.pool.moves,
             "packed pool generations": runner.pool.packed.generation if packed else 0}
    if check:
        found["tokens as eager"] = tokens == serve(engine, made, running, None, methods)
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
    args = parser.parse_args()
    methods = tuple(args.methods.split(","))
    engine = random_engine(args.preset, torch.float32, "cpu", 1.0)
    found = count(engine, requests(args.requests, engine.spec.vocab_size, args.seed, args.longest), args.running,
                  args.check, methods, not args.no_packed_pool)
    for name, value in found.items():
        print(f"{name:>26}: {value}")


if __name__ == "__main__":
    main()
