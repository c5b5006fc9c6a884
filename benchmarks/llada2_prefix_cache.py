"""The prefix cache across requests on the tiny LLaDA2 (issue 44): counts first, cache on vs off in one run.

Serves ``tests/data/llada2/llada2-tiny-chat`` (context 1,024; one torch thread; a temporary store) once per
configuration, in this order, and sends each the same requests in the same order:

* **shared system prompt**: ``--requests`` (64) completions on token ids, one ``--system`` (768, 3/4 of the
  context) -token prefix and a different 32-token question each, streamed (``max_tokens`` 64, block 32, greedy,
  cache mode ``block``) from ``--clients`` (8) threads; per configuration: prompt tokens computed per request (the
  prompt's tokens less those served from the cache: ``dllm_prefix_cache_queries_total`` minus
  ``dllm_prefix_cache_hits_total``), forwards per request (``dllm_nfe_per_request``), generated tokens per server
  CPU second (``/proc/PID/stat``: other jobs on a shared machine do not distort it) and the mean time to the first
  streamed block;
* the same with KIVI 2-bit committed blocks (``DLLM_KV_QUANT``), cache on: bytes per cached token
  (``dllm_prefix_cache_bytes`` over ``dllm_prefix_cache_blocks`` x 32) against bf16's ``2 x layers x kv_heads x
  head_dim x 2`` and the unquantized (float32) cache's;
* **multi-turn**: ``--conversations`` (8) chats of ``--turns`` (6) turns on token ids (``POST /generate``: each
  turn the history, the model's last answer and a new 32-token user message), one client per chat.

Usage: ``python benchmarks/llada2_prefix_cache.py [--requests 64] [--clients 8] [--system 768]
[--conversations 8] [--turns 6] [--parts shared,quantized,chat]`` (``--parts``: the tables to run; the bytes
table needs ``shared`` and ``quantized``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: benchmarks/ is not a package
from benchmarks.serve_load import ROOT, cpu_s, free_port, wait_ready
from tests.support.metrics import metric_sum, metrics

CHAT = ROOT / "tests" / "data" / "llada2" / "llada2-tiny-chat"
CACHE_BYTES = 1 << 28


def serve(port: int, tmp: str, log, cache: bool, kv_quant: str | None) -> subprocess.Popen:
    """A server on ``port`` with the prefix cache on or off and ``DLLM_KV_QUANT`` (None: unquantized)."""
    cmd = [sys.executable, "-m", "service", "serve", "--port", str(port), "--store-url", str(Path(tmp) / "store"),
           "--create-store", "--model", str(CHAT), "--threads", "1", "--max-batch-size", "16", "--max-queue", "256",
           "--log-level", "warning", "--kv-budget-bytes", str(1 << 30),
           "--prefix-cache-bytes", str(CACHE_BYTES if cache else 0)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if kv_quant is not None:
        env["DLLM_KV_QUANT"] = kv_quant
    return wait_ready(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), port)


def streamed(client: httpx.Client, path: str, body: dict) -> tuple[float, int, str]:
    """One streamed request: (seconds to the first chunk with text, completion tokens, the text)."""
    t0, first, text, tokens = time.perf_counter(), None, [], 0
    with client.stream("POST", path, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{path}: {r.status_code} {r.read().decode()}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                if piece and first is None:
                    first = time.perf_counter() - t0
                text.append(piece)
    return (first if first is not None else time.perf_counter() - t0), tokens, "".join(text)


def shared_prompts(requests: int, system: int, seed: int = 44) -> list[list[int]]:
    rng = random.Random(seed)
    head = [rng.randrange(5, 490) for _ in range(system)]
    return [head + [rng.randrange(5, 490) for _ in range(32)] for _ in range(requests)]


def shared_phase(url: str, prompts: list[list[int]], clients: int) -> dict:
    body = {"max_tokens": 64, "temperature": 0, "cache_mode": "block"}
    with httpx.Client(base_url=url, timeout=600) as client, concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda p: streamed(client, "/v1/completions", {**body, "prompt": p}), prompts))
    return {"first_s": sum(r[0] for r in results) / len(results), "tokens": sum(r[1] for r in results),
            "texts": [r[2] for r in results]}


def chat_phase(url: str, conversations: int, turns: int, seed: int = 45) -> dict:
    """``conversations`` chats of ``turns`` turns, one client each, the turns of a chat in order, on token ids
    (``POST /generate``, which answers with the ids: a chat's history is then exactly what the model saw and
    wrote, as a chat template's rendering of earlier turns is): a 32-token system prompt, then per turn a new
    32-token user message after the history and the model's last answer. First block: the server's
    ``timings.first_block_s`` (admission to the first committed block)."""
    def chat(c: int) -> tuple[float, int, list[list[int]]]:
        rng = random.Random(seed + c)
        history = [rng.randrange(5, 490) for _ in range(32)]
        first, tokens, answers = 0.0, 0, []
        with httpx.Client(base_url=url, timeout=600) as client:
            for _ in range(turns):
                history += [rng.randrange(5, 490) for _ in range(32)]
                r = client.post("/generate", json={"prompt": history, "max_tokens": 64, "temperature": 0,
                                                   "cache_mode": "block"})
                if r.status_code != 200:
                    raise RuntimeError(f"/generate: {r.status_code} {r.text}")
                report = r.json()
                answer = report["rows"][0]["generated_ids"]
                history += answer
                first, tokens = first + report["timings"]["first_block_s"], tokens + len(answer)
                answers.append(answer)
        return first, tokens, answers

    with concurrent.futures.ThreadPoolExecutor(conversations) as pool:
        results = list(pool.map(chat, range(conversations)))
    return {"first_s": sum(r[0] for r in results) / (conversations * turns), "tokens": sum(r[1] for r in results),
            "texts": [t for r in results for t in r[2]]}


def run(label: str, cache: bool, kv_quant: str | None, phase, *args) -> dict:
    """Serve one configuration, run ``phase`` once (after a warm-up request on other ids), read the counts."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "server.log", "wb") as log:
        proc = serve(port, tmp, log, cache, kv_quant)
        try:
            with httpx.Client(base_url=url, timeout=600) as client:  # warm-up: first-call costs, other tokens
                streamed(client, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 32, "temperature": 0})
            before, cpu0 = metrics(url), cpu_s(proc.pid)
            row = phase(url, *args)
            row["cpu_s"] = cpu_s(proc.pid) - cpu0
            after = metrics(url)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    delta = {name: metric_sum(after, name) - metric_sum(before, name) for name in (
        "dllm_prefix_cache_queries_total", "dllm_prefix_cache_hits_total", "dllm_nfe_per_request_sum",
        "dllm_nfe_per_request_count", "dllm_prompt_tokens_total")}
    requests = delta["dllm_nfe_per_request_count"]
    row.update(label=label, requests=int(requests), nfe=delta["dllm_nfe_per_request_sum"] / requests,
               prompt=delta["dllm_prompt_tokens_total"] / requests,
               computed=(delta["dllm_prompt_tokens_total"] - delta["dllm_prefix_cache_hits_total"]) / requests,
               held=metric_sum(after, "dllm_prefix_cache_bytes"), blocks=metric_sum(after, "dllm_prefix_cache_blocks"))
    row["tok_per_cpu_s"] = row["tokens"] / row["cpu_s"]
    return row


def table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print("| run | requests | prompt tokens / req | computed / req | forwards / req | tokens | server CPU s | "
          "tokens / CPU s | x off | first block s (mean) | same text as off |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    base = rows[0]
    for r in rows:
        same = "yes" if r["texts"] == base["texts"] else "NO"
        print(f"| {r['label']} | {r['requests']} | {r['prompt']:.0f} | {r['computed']:.1f} | {r['nfe']:.2f} | "
              f"{r['tokens']} | {r['cpu_s']:.2f} | {r['tok_per_cpu_s']:.1f} | "
              f"{r['tok_per_cpu_s'] / base['tok_per_cpu_s']:.2f} | {r['first_s']:.3f} | {same} |")
    sys.stdout.flush()  # a long run shows each table as it comes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--system", type=int, default=768, help="shared prefix tokens (default 768: 3/4 of 1,024)")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--parts", default="shared,quantized,chat", help="tables to run (comma-separated)")
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
    prompts = shared_prompts(args.requests, args.system)
    kivi2 = '{"method": "kivi", "bits": 2}'
    print(f"llada2_prefix_cache: {CHAT.name}, 1 torch thread, cpu; max_tokens 64, block 32, greedy, cache mode block")
    if "shared" in parts:
        shared = [run("off", False, None, shared_phase, prompts, args.clients),
                  run("on", True, None, shared_phase, prompts, args.clients)]
        table(f"Shared system prompt: {args.requests} requests, {args.system}-token prefix + 32-token question, "
              f"{args.clients} clients", shared)
    if "quantized" in parts:
        quantized = [run("KIVI 2-bit, off", False, kivi2, shared_phase, prompts, args.clients),
                     run("KIVI 2-bit, on", True, kivi2, shared_phase, prompts, args.clients)]
        table("Same, KIVI 2-bit committed blocks", quantized)
    if "chat" in parts:
        chats = [run("off", False, None, chat_phase, args.conversations, args.turns),
                 run("on", True, None, chat_phase, args.conversations, args.turns)]
        table(f"Multi-turn: {args.conversations} chats x {args.turns} turns (32-token system prompt and user "
              "messages, 64-token answers, on token ids)", chats)
    if not {"shared", "quantized"} <= parts:
        return 0
    layers, kv_heads, head_dim = 3, 2, 16  # the tiny checkpoint's config.json
    bf16 = 2 * layers * kv_heads * head_dim * 2
    print("\nBytes per cached token (block 32)")
    print("| cache | blocks | bytes held | bytes / token | vs bf16 |")
    print("|---|---:|---:|---:|---:|")
    for r in (shared[1], quantized[1]):
        per = r["held"] / (r["blocks"] * 32)
        print(f"| {'float32' if r is shared[1] else 'KIVI 2-bit'} | {r['blocks']:.0f} | {r['held']:,.0f} | {per:.1f} | "
              f"{per / bf16:.3f} |")
    print(f"| bf16 (arithmetic) | | | {bf16} | 1.000 |")
    return 0


if __name__ == "__main__":
    from benchmarks.machine import Run

    with Run():
        raise SystemExit(main())
