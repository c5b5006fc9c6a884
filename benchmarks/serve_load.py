"""Load on the HTTP server: throughput and latency at 1, 4, 8 and 16 concurrent clients against sequential
requests, measured in one run against one server process.

Starts ``python -m service serve`` (the embedded default model unless ``--model``; a temporary directory store;
``--max-batch-size`` 16) on a free port, warms it up, then sends the same ``--requests`` chat completions
(held-out questions of the embedded model's task, ``max_tokens`` 64 = two blocks of 32) first one after another
(the baseline), then from 1, 4, 8 and 16 client threads. For each it prints requests/s, generated tokens/s,
latency p50/p90/p99, the mean batch size the server formed (from ``/metrics``), and the throughput ratio to
sequential. Targets (issue #5): >= 1.2x at 8 clients on CPU (batching only shares per-forward overhead there),
never below 1.0x; >= 3x on a GPU.

``--mixed`` instead runs a mixed workload (prompts of 20-1,000 tokens; ``max_tokens`` 32-256; a quarter of the
requests with 2-bit KIVI) and measures:

* **capacity**: every request sent at once; generated tokens/s until the last answer;
* **open loop**: Poisson arrivals at ``--load`` (0.7) times that capacity in requests/s, measured in this run, so
  the server is not overloaded and latency is service, not an ever-growing queue: latency p50/p99;
* **head-of-line**: a 32-token request alone and sent 50 ms after a 256-token one, medians of 3 (target <= 2x;
  the rule: `service.runtime.scheduler.first_passes_first`);
* **memory**: the server's RSS after warm-up (weights, runtime and allocator: the fixed part) and its peak
  (VmHWM) through the run, against the KV budget (``--kv-budget-bytes``, default 1 GiB on CPU).

(Issue 14's ``--compare`` ran this workload on the legacy batch worker and then the continuous scheduler; it
went with the batch worker in issue 21, and its figures stay in docs/admission.md as history.)

Each level also reports the server's CPU seconds (generated tokens per server CPU second, a throughput other jobs
on a shared machine do not distort), the rows per forward call (``dllm_row_forwards_total`` over the forwards)
and the ratios to the first level; issue 21's targets: at 16 clients >= 2.5x one client's tokens per server CPU
second and >= 6 rows per forward.

Usage: ``python benchmarks/serve_load.py [--requests 48] [--threads 1] [--model PATH] [--device cpu]
[--levels 0,1,4,8,16] [--json FILE] [--plot PNG] [--mixed [--requests 16] [--load 0.7]]``; ``--plot`` draws
throughput and latency against concurrent clients (`evaluation.plots.plot_serve_load`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
TASK = ROOT / "service" / "assets" / "embedded" / "task" / "test.jsonl"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, port: int, store: str, log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "service", "serve", "--port", str(port), "--store-url", store, "--create-store",
           "--max-batch-size", "16", "--max-queue", "256", "--threads", str(args.threads), "--device", args.device,
           "--log-level", "warning", "--kv-budget-bytes", str(args.kv_budget_bytes)]
    if args.model:
        cmd += ["--model", args.model]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    return wait_ready(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), port)


def wait_ready(proc: subprocess.Popen, port: int) -> subprocess.Popen:
    """``proc`` once its server on ``port`` answers ``/health/ready`` (raises if it exits or 300 s pass)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health/ready", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("server not ready after 300 s")


def batch_stats(url: str) -> tuple[float, float, float, float]:
    """(sum, count) of the server's dllm_batch_size histogram, its forward calls (dllm_forwards_per_iteration's
    sum) and its row-forwards (dllm_row_forwards_total)."""
    total = count = forwards = rows = 0.0
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            if s.name == "dllm_batch_size_sum":
                total = s.value
            elif s.name == "dllm_batch_size_count":
                count = s.value
            elif s.name == "dllm_forwards_per_iteration_sum":
                forwards = s.value
            elif s.name == "dllm_row_forwards_total":
                rows = s.value
    return total, count, forwards, rows


def one_request(client: httpx.Client, prompt: str) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}],
                                                  "max_tokens": 64, "temperature": 0})
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()["usage"]["completion_tokens"]


def run_level(url: str, prompts: list[str], clients: int) -> dict:
    """Send every prompt from ``clients`` threads (0 = sequentially from one client); wall time and latencies."""
    before = batch_stats(url)
    with httpx.Client(base_url=url, timeout=600) as client:
        t0 = time.perf_counter()
        if clients == 0:
            results = [one_request(client, p) for p in prompts]
        else:
            with concurrent.futures.ThreadPoolExecutor(clients) as pool:
                results = list(pool.map(lambda p: one_request(client, p), prompts))
        wall = time.perf_counter() - t0
    after = batch_stats(url)
    latencies = sorted(r[0] for r in results)
    q = statistics.quantiles(latencies, n=100, method="inclusive")
    return {
        "clients": clients,
        "wall_s": wall,
        "req_per_s": len(prompts) / wall,
        "tok_per_s": sum(r[1] for r in results) / wall,
        "p50_s": q[49],
        "p90_s": q[89],
        "p99_s": q[98],
        "mean_batch": (after[0] - before[0]) / max(1.0, after[1] - before[1]),
        "tokens": sum(r[1] for r in results),
        "rows_per_forward": (after[3] - before[3]) / max(1.0, after[2] - before[2]),
    }


def rss_mb(pid: int, field: str = "VmHWM") -> float:
    """The process's peak (VmHWM) or current (VmRSS) resident set in MiB (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process has used (Linux ``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measured(pid: int, phase, *args) -> dict:
    """Run ``phase(*args)`` (a dict of figures); add the server's CPU seconds during it, the generated tokens per
    server CPU second (a throughput that other jobs on a shared machine do not distort) and the load average."""
    before = cpu_s(pid)
    row = phase(*args)
    row["cpu_s"] = cpu_s(pid) - before
    row["tok_per_cpu_s"] = row["tokens"] / row["cpu_s"]
    row["load"] = os.getloadavg()[0]
    return row


def levels(args: argparse.Namespace, phase, prompts: list) -> list[dict]:
    """Serve (:func:`start_server`), warm up with ``phase(url, prompts[:4], 4)``, then one :func:`measured` row of
    ``phase(url, prompts, clients)`` per level of ``args.levels``; the server stops after."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "server.log", "wb") as log:
        proc = start_server(args, port, str(Path(tmp) / "store"), log)
        try:
            phase(url, prompts[:4], 4)  # warm-up (first-call costs, allocator)
            return [measured(proc.pid, phase, url, prompts, c) for c in map(int, args.levels.split(","))]
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def completion(client: httpx.Client, ids: list[int], max_tokens: int, quantized: bool = False) -> tuple[float, int]:
    """One /v1/completions on token ids; (latency s, completion tokens)."""
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if quantized:
        body["kv_quant"] = {"method": "kivi", "bits": 2}
    t0 = time.perf_counter()
    r = client.post("/v1/completions", json=body)
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()["usage"]["completion_tokens"]


def mixed_workload(n: int, ids: list[int], seed: int) -> list[tuple[float, list[int], int, bool]]:
    """(arrival gap s, prompt ids, max_tokens, quantized) per request, seeded: the same every run."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(20, 1000)
        start = rng.randrange(0, len(ids) - length)
        out.append((rng.random(), ids[start:start + length], rng.randint(32, 256), rng.random() < 0.25))
    return out


def run_mixed(url: str, workload, rate: float | None) -> dict:
    """Open loop: request i is sent at its Poisson arrival time (``rate`` per second) whatever the server does;
    ``rate`` None sends every request at once (capacity)."""
    results: list[tuple[float, int]] = []
    lock = threading.Lock()

    def send(item) -> None:
        _, ids, max_tokens, quantized = item
        with httpx.Client(base_url=url, timeout=1800) as client:
            got = completion(client, ids, max_tokens, quantized)
        with lock:
            results.append(got)

    threads = []
    t0 = time.perf_counter()
    for gap, *rest in workload:
        if rate is not None:
            time.sleep(-math.log(1.0 - gap) / rate)  # exponential inter-arrival time
        thread = threading.Thread(target=send, args=((gap, *rest),))
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - t0
    latencies = sorted(r[0] for r in results)
    q = statistics.quantiles(latencies, n=100, method="inclusive")
    tokens = sum(r[1] for r in results)
    return {"tokens": tokens, "tok_per_s": tokens / wall, "req_per_s": len(results) / wall, "p50_s": q[49],
            "p99_s": q[98], "wall_s": wall}


def run_hol(url: str, ids: list[int], trials: int = 7) -> dict:
    """Latency of a 32-token request alone and sent 50 ms after a 256-token request (each the median of
    ``trials``; a new 256-token request each time)."""
    with httpx.Client(base_url=url, timeout=900) as client:
        alone = statistics.median(completion(client, ids[:100], 32)[0] for _ in range(trials))
        besides = []
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            for _ in range(trials):
                long = pool.submit(completion, client, ids[100:400], 256)
                time.sleep(0.05)
                besides.append(pool.submit(completion, client, ids[:100], 32).result()[0])
                long.result()
    return {"alone_s": alone, "beside_s": statistics.median(besides)}


def mixed(args: argparse.Namespace) -> None:
    """The mixed workload, one server (module docstring)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "server.log", "wb") as log:
        proc = start_server(args, port, str(Path(tmp) / "store"), log)
        try:
            text = " ".join(json.loads(line)["prompt"] for line in TASK.read_text().splitlines() if line)
            ids = httpx.post(url + "/tokenize", json={"prompt": text}, timeout=60).json()["tokens"]
            while len(ids) < 2000:
                ids = ids + ids
            workload = mixed_workload(args.requests, ids, seed=0)
            run_mixed(url, workload[:4], None)  # warm-up
            if args.hol_only:
                r = run_hol(url, ids, args.hol_trials)
                print(f"head-of-line: 32 tokens alone {r['alone_s']:.3f} s, 50 ms after a 256-token request "
                      f"{r['beside_s']:.3f} s: {r['beside_s'] / r['alone_s']:.2f}x (target <= 2x)")
                return
            r = {"rss_idle_mb": rss_mb(proc.pid, "VmRSS"),
                 "capacity": measured(proc.pid, run_mixed, url, workload, None)}
            rate = args.load * r["capacity"]["req_per_s"]  # below the capacity measured just now
            r["open"] = measured(proc.pid, run_mixed, url, workload, rate)
            r.update(run_hol(url, ids), rss_peak_mb=rss_mb(proc.pid))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    print(f"serve_load --mixed: {args.requests} requests (prompts 20-1000 tokens, max_tokens 32-256, 1/4 KIVI "
          f"2-bit); open loop: Poisson {rate:.3f}/s = {args.load} x the capacity; device {args.device}, "
          f"{args.threads} torch thread(s); load: 1-minute load average at the end of each phase")
    print(f"{'cap tok/s':>9} {'tok/CPU s':>9} {'load':>5} {'open tok/s':>10} {'load':>5} {'p50 s':>7} {'p99 s':>7} "
          f"{'32 alone':>9} {'beside 256':>11} {'HOL x':>6} {'idle MiB':>8} {'peak MiB':>8}")
    cap, open_ = r["capacity"], r["open"]
    hol = r["beside_s"] / r["alone_s"]
    print(f"{cap['tok_per_s']:9.1f} {cap['tok_per_cpu_s']:9.1f} {cap['load']:5.1f} {open_['tok_per_s']:10.1f} "
          f"{open_['load']:5.1f} {open_['p50_s']:7.2f} {open_['p99_s']:7.2f} {r['alone_s']:9.3f} "
          f"{r['beside_s']:11.3f} {hol:6.2f} {r['rss_idle_mb']:8.0f} {r['rss_peak_mb']:8.0f}")
    print(f"head-of-line {hol:.2f}x alone (target <= 2x); RSS peak - idle {r['rss_peak_mb'] - r['rss_idle_mb']:.0f} "
          f"MiB (budget {args.kv_budget_bytes / 2**20:.0f} MiB)")
    if args.json:
        args.json.write_text(json.dumps({"rate": rate, **r}, indent=2))


def summary(rows: list[dict]) -> list[str]:
    """The ratios against the targets, one line per target whose level was run (rows as :func:`run_level` and
    :func:`measured` give them, the first level the baseline): issue 5's at 8 clients (requests/s) with the
    slowest level, issue 21's at 16 (tokens per server CPU second, rows per forward). No verdict: on a shared
    machine the load moves them by more than the margin (docs/benchmarks.md quotes runs with their date and
    load)."""
    first = "sequential" if rows[0]["clients"] == 0 else f"the first level ({rows[0]['clients']} client(s))"
    base, base_cpu = rows[0]["req_per_s"], rows[0]["tok_per_cpu_s"]
    lines = []
    at8 = next((r for r in rows if r["clients"] == 8), None)
    if at8 is not None:
        slowest = min(r["req_per_s"] for r in rows) / base
        lines.append(f"at 8 clients: {at8['req_per_s'] / base:.2f}x {first} (target >= 1.2x on CPU, >= 3x on a "
                     f"GPU); slowest level: {slowest:.2f}x {first} (target >= 1.0x)")
    at16 = next((r for r in rows if r["clients"] == 16), None)
    if at16 is not None:
        lines.append(f"at 16 clients: {at16['tok_per_cpu_s'] / base_cpu:.2f}x the first level's tokens per server "
                     f"CPU second (issue 21's target >= 2.5x against one client), {at16['rows_per_forward']:.2f} "
                     f"rows per forward (target >= 6)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=48, help="requests per level")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the server")
    parser.add_argument("--model", default=None, help="checkpoint (default: the embedded model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument("--plot", type=Path, default=None,
                        help="also plot throughput and latency against concurrent clients into this PNG")
    parser.add_argument("--mixed", action="store_true",
                        help="mixed workload: capacity, open loop, head-of-line, memory (module docstring)")
    parser.add_argument("--hol-only", action="store_true",
                        help="--mixed: only the head-of-line part (short alone, then beside a long one)")
    parser.add_argument("--hol-trials", type=int, default=7,
                        help="--mixed: head-of-line trials, the median taken (each ~0.3 s on the embedded model)")
    parser.add_argument("--load", type=float, default=0.7,
                        help="--mixed: open-loop arrival rate as a fraction of the capacity measured first")
    parser.add_argument("--kv-budget-bytes", type=int, default=1 << 30, help="the server's KV budget")
    parser.add_argument("--levels", default="0,1,4,8,16",
                        help="concurrent clients per level, comma-separated (0 = sequential from one client)")
    args = parser.parse_args()
    if args.mixed:
        mixed(args)
        return

    questions = [json.loads(line)["prompt"] for line in TASK.read_text().splitlines() if line.strip()]
    prompts = [questions[i % len(questions)] for i in range(args.requests)]
    rows = levels(args, run_level, prompts)
    base = rows[0]["req_per_s"]
    base_cpu = rows[0]["tok_per_cpu_s"]
    first = "sequential" if rows[0]["clients"] == 0 else f"{rows[0]['clients']} client(s)"
    print(f"serve_load: {args.requests} chat completions per level, max_tokens 64, device {args.device}, "
          f"{args.threads} torch thread(s); ratios to the first level ({first}); load: 1-minute load average")
    print(f"{'clients':>10} {'req/s':>7} {'tok/s':>7} {'tok/CPU s':>9} {'p50 s':>7} {'p90 s':>7} {'p99 s':>7} "
          f"{'batch':>6} {'rows/fwd':>8} {'x first':>7} {'CPU x':>6} {'load':>5}")
    for r in rows:
        name = "sequential" if r["clients"] == 0 else str(r["clients"])
        print(f"{name:>10} {r['req_per_s']:7.2f} {r['tok_per_s']:7.1f} {r['tok_per_cpu_s']:9.1f} {r['p50_s']:7.3f} "
              f"{r['p90_s']:7.3f} {r['p99_s']:7.3f} {r['mean_batch']:6.2f} {r['rows_per_forward']:8.2f} "
              f"{r['req_per_s'] / base:7.2f} {r['tok_per_cpu_s'] / base_cpu:6.2f} {r['load']:5.1f}")
    for line in summary(rows):
        print(line)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    if args.plot:
        from evaluation.plots import plot_serve_load

        plot_serve_load(rows, args.plot, f"serve_load: {args.requests} chat completions per level, max_tokens 64, "
                                         f"{args.device}, {args.threads} torch thread(s)")
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    from machine import Run  # benchmarks/machine.py, beside this script

    with Run():
        main()
