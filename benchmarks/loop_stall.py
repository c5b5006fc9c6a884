"""The event loop's longest stall while the worker measures new KV configurations under 16 open streams (issue 34
item 1: nothing slow under a lock the event loop takes).

In one process, as the server runs it: an asyncio event loop (the HTTP side) and the worker thread
(`service.runtime.loop.Worker`) over the embedded default model. The event loop opens ``--streams`` streaming
requests (their committed blocks handed to it with ``call_soon_threadsafe``, as `service.api.serving` does), then,
while they decode, submits ``--probes`` requests that each name a KV configuration not measured yet (2-, 4- and 8-bit
KIVI with distinct K group sizes), so the worker probes each one (`MemoryModel._probe` writes every layer of its
store), and keeps calling `Worker.submit` and `Worker.cancel` every 2 ms, as new HTTP requests would. A ticker
coroutine sleeps 1 ms at a time and records the longest gap between its wake-ups: the longest time the event loop
(and every open stream with it) could not run.

It prints the longest stall and the longest single `submit` call, with the probe's own time measured in the same
run (one probe of the same kind, on this thread) as the yardstick: before issue 34 the worker held the lock the
event loop takes through each probe, cohort build and report, so a `submit` during one waited for it; the ratio
stall / probe says how much of a probe the event loop still feels.

Before/after in one command: run it once at this tree and once with ``PYTHONPATH`` pointing at a checkout of the
commit before (the script uses only `Worker`'s public calls, which did not change).

Usage: ``OMP_NUM_THREADS=1 python benchmarks/loop_stall.py [--streams 16] [--probes 6] [--gen 128]``.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch

from service.engine import Engine
from service.engine.loading import EMBEDDED_DIR
from service.engine.params import DecodeParams, RowOptions
from service.quant.config import KVQuantConfig
from service.quant.store import make_kv_store
from service.runtime.loop import Job, Worker
from service.runtime.memory import MemoryModel
from service.store.active import ConfigSnapshot
from service.telemetry import Telemetry


def _configs(count: int) -> list[KVQuantConfig]:
    """``count`` KIVI configurations, each a distinct measuring key (bits x K group size)."""
    out = []
    for group in (8, 16, 32, 64, 128):
        for bits in (2, 4, 8):
            out.append(KVQuantConfig(method="kivi", bits=bits, k_group_size=group))
    return out[:count]


async def _run(args: argparse.Namespace) -> dict[str, float]:
    torch.set_num_threads(1)
    engine = Engine.load(EMBEDDED_DIR)
    memory = MemoryModel.for_engine(engine)
    worker = Worker(engine, lambda snap: make_kv_store(snap.config, engine.spec), Telemetry(), memory, 1 << 32,
                    max_rows=args.streams + args.probes + 64, max_queue=1024)
    prompt = engine.tokenizer.encode("Q: what is 17 + 25? A:") if hasattr(engine, "tokenizer") else [5, 6, 7, 8]
    params = DecodeParams(gen_length=args.gen, block_length=32, threshold=0.9, ignore_eos=True, cache_mode="dual")
    loop = asyncio.get_running_loop()
    blocks = asyncio.Queue()
    worker.start()

    def snapshot(config: KVQuantConfig) -> ConfigSnapshot:
        return ConfigSnapshot(config, "dual", "request")

    # The yardstick: one probe of the same kind, measured here.
    t0 = time.perf_counter()
    memory._probe(make_kv_store(KVQuantConfig(method="kivi", bits=2, k_group_size=256), engine.spec))
    probe_s = time.perf_counter() - t0

    streams = [worker.submit(Job(prompt, params, RowOptions(), snapshot(KVQuantConfig()),
                                 on_block=lambda b, ids: loop.call_soon_threadsafe(blocks.put_nowait, b)))
               for _ in range(args.streams)]
    await blocks.get()  # the streams are decoding

    stall = [0.0]
    submit_s = [0.0]
    done = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            stall[0] = max(stall[0], now - last)
            last = now

    async def poker() -> None:
        short = DecodeParams(gen_length=32, block_length=32, threshold=0.9, cache_mode="dual")
        while not done.is_set():
            t = time.perf_counter()
            job = worker.submit(Job(prompt, short, RowOptions(), snapshot(KVQuantConfig())))
            worker.cancel(job)
            submit_s[0] = max(submit_s[0], time.perf_counter() - t)
            await asyncio.sleep(0.002)

    tasks = [asyncio.create_task(ticker()), asyncio.create_task(poker())]
    t_window = time.perf_counter()
    probes = [worker.submit(Job(prompt, DecodeParams(gen_length=32, block_length=32, cache_mode="dual"),
                                RowOptions(), snapshot(config))) for config in _configs(args.probes)]
    await asyncio.gather(*(asyncio.wrap_future(job.future) for job in probes))
    window_s = time.perf_counter() - t_window
    done.set()
    await asyncio.gather(*tasks)
    for job in streams:
        job.cancel()
    await asyncio.to_thread(worker.stop)
    return {"probe_s": probe_s, "stall_s": stall[0], "submit_s": submit_s[0], "window_s": window_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--probes", type=int, default=6)
    parser.add_argument("--gen", type=int, default=128, help="tokens each open stream decodes (blocks of 32)")
    args = parser.parse_args()
    r = asyncio.run(_run(args))
    print(f"{args.streams} open streams, {args.probes} new KV configurations measured in a {r['window_s']:.2f} s "
          f"window")
    print(f"one probe (same kind, alone on this thread):  {r['probe_s'] * 1e3:8.1f} ms")
    print(f"event loop's longest stall:                   {r['stall_s'] * 1e3:8.1f} ms "
          f"({r['stall_s'] / r['probe_s']:.2f} x one probe)")
    print(f"longest Worker.submit + cancel call:          {r['submit_s'] * 1e3:8.1f} ms "
          f"({r['submit_s'] / r['probe_s']:.2f} x one probe)")


if __name__ == "__main__":
    main()
