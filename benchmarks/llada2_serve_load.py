"""Served throughput of the tiny LLaDA2 (issue 31): generated tokens per server CPU second at 8 concurrent
clients against 1, in one run against one server process.

Starts ``python -m service serve`` on ``tests/data/llada2/llada2-tiny-chat`` (``--model``; one torch thread, a
temporary store, `benchmarks.serve_load.levels`), warms it up, then sends the same ``--requests``
completions (prompts of 4-11 ``w<id>`` words, different per request; ``max_tokens`` 64 = two blocks of 32, greedy,
the server's default threshold) from 1 and then 8 client threads. For each level it prints the generated tokens,
the server's CPU seconds over the level (``/proc/PID/stat``: a throughput other jobs on a shared machine do not
distort), tokens per server CPU second, the rows per forward (``dllm_row_forwards_total`` over the forwards), and
the ratio of 8 clients' tokens per CPU second to 1 client's: what batching the rows into one forward per
iteration saves on the host and in the kernels' fixed costs (one run; no verdict, the load moves it).

``--extra JSON`` adds fields to every request body: the same run on the tiny DiffusionGemma (docs/diffusion_gemma.md)
is ``--model tests/data/diffusion_gemma/dgemma-tiny --extra '{"max_denoising_steps": 8}'`` (64 tokens: four canvases
of 16, 8 steps each at most; each request its own seed, so every row draws from its own generator).

Usage: ``python benchmarks/llada2_serve_load.py [--requests 32] [--model DIR] [--levels 1,8] [--extra JSON]``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: benchmarks/ is not a package
from benchmarks.serve_load import batch_stats, levels

CHAT = Path(__file__).resolve().parents[1] / "tests" / "data" / "llada2" / "llada2-tiny-chat"


def prompts(n: int) -> list[str]:
    """``n`` different prompts of 4-11 ``w<id>`` words."""
    return [" ".join(f"w{(7 * i + k) % 400}" for k in range(4 + i % 8)) for i in range(n)]


#: Fields every request adds (``--extra``).
EXTRA: dict = {}


def completion(client: httpx.Client, prompt: str, seed: int = 0) -> int:
    """One ``/v1/completions`` (seeded: a family that samples draws the same every run); its completion tokens."""
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 64, "temperature": 0, "seed": seed,
                                             **EXTRA})
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"]


def level(url: str, texts: list[str], clients: int) -> dict:
    """Send every prompt from ``clients`` threads; generated tokens and rows per forward."""
    before = batch_stats(url)
    with httpx.Client(base_url=url, timeout=600) as client, concurrent.futures.ThreadPoolExecutor(clients) as pool:
        tokens = sum(pool.map(lambda ip: completion(client, ip[1], ip[0]), enumerate(texts)))
    after = batch_stats(url)
    return {"clients": clients, "tokens": tokens,
            "rows_per_forward": (after[3] - before[3]) / max(1.0, after[2] - before[2])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32, help="requests per level (default 32)")
    parser.add_argument("--model", default=str(CHAT), help="checkpoint (default the tiny LLaDA2 with a tokenizer)")
    parser.add_argument("--levels", default="1,8", help="concurrent clients per level (default 1,8)")
    parser.add_argument("--extra", default="{}", help="JSON object of fields added to every request (default {})")
    args = parser.parse_args(argv)
    EXTRA.update(json.loads(args.extra))
    args.threads, args.device, args.kv_budget_bytes = 1, "cpu", 1 << 30  # what start_server reads
    rows = levels(args, level, prompts(args.requests))
    print(f"llada2_serve_load: {args.requests} completions per level, max_tokens 64, {Path(args.model).name}, "
          f"extra {args.extra}, 1 torch thread, cpu")
    print("| clients | tokens | server CPU s | tokens / CPU s | rows/fwd | x 1st level | load |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    base = rows[0]["tok_per_cpu_s"]
    for r in rows:
        print(f"| {r['clients']} | {r['tokens']} | {r['cpu_s']:.2f} | {r['tok_per_cpu_s']:.1f} | "
              f"{r['rows_per_forward']:.2f} | {r['tok_per_cpu_s'] / base:.2f} | {r['load']:.1f} |")
    return 0


if __name__ == "__main__":
    from benchmarks.machine import Run

    with Run():
        raise SystemExit(main())
