"""Issue 36, item 2: hostile grammars cannot jam structured output or grow the server, measured in one run against
one ``python -m service serve`` (the embedded model, a temporary directory store).

It sends a trivial constrained chat completion alone (best of 3: the baseline); then a control burst of 16
requests refused for a plain reason (``max_tokens`` -1) with one trivial request sent among them; then 16 hostile
regexes at once (``(b{1000}){1000}`` and the like: a million characters each once multiplied out, which took
seconds and hundreds of MB each to compile before the size limit) with one trivial request among them; then the
trivial request again after them. It prints the hostile requests' statuses, each trivial latency as a ratio to
the baseline, the trivial latency under the hostile burst against the one under the control burst (what the
grammars themselves add: the HTTP work of 16 concurrent requests is in both), and the server's resident memory
after the hostile burst as a ratio to before it. Targets: every hostile request a 400 naming its field, hostile /
control ~1x and the trivial one after the burst ~1x (it compiles at once: no compile queued in front of it), RSS
within 10% (1.10x).

Then grammars that pass the size checks but compile slowly: 8 JSON schemas of 2,500 optional integer properties
each, in an object under an optional property (a root object of that many is refused before it compiles, as the
grammar engine cannot decode it: issue 45 N3) (~12,000 positions, ~3 s to compile on one loaded core; each distinct, so none is cached) sent at once with one
trivial regex among them. It prints their statuses and the trivial request's latency as a ratio to the baseline.
Target: no more than the control burst's ratio (a small grammar compiles in a lane of its own,
`service.engine.grammar.SMALL_POSITIONS`, never behind a slow one: what is left is the HTTP and CPU work of the
concurrent requests); before that lane, one compile thread served all, and the trivial one waited for the slow ones
(or hit the 5 s compile limit).

Usage: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/hostile_grammars.py`` (under a minute on one core).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: benchmarks/ is not a package
from benchmarks.serve_load import ROOT, free_port

HOSTILE = [f"({c}{{1000}}){{1000}}" for c in "bcdefgh"] + [f"{c}{{1000}}{{1000}}" for c in "ijklmnopq"]
TRIVIAL = "( [0-9]){%d}"
#: Under the size limits (~12,000 positions, ~66 KB) yet slow to compile: optional properties, nested (a root
#: object of them is refused before compiling: `service.engine.grammar_size.first_row_items`).
SLOW_SCHEMAS = [{"type": "object", "properties": {"o": {"type": "object", "properties": {
    f"{c}{i}": {"type": "integer"} for i in range(2500)}}}} for c in "abcdefgh"]


def rss_mib(pid: int) -> float:
    """The process's resident memory (``/proc/<pid>/statm``) in MiB."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def chat(url: str, regex: str | None, max_tokens: int = 32, schema: dict | None = None,
         ) -> tuple[int, str | None, float]:
    """One chat completion (constrained by ``regex`` or ``schema`` unless None): (status, error param, seconds)."""
    body = {"model": "embedded", "messages": [{"role": "user", "content": "copy: 1 2 3"}], "max_tokens": max_tokens,
            **({"guided_regex": regex} if regex else {}), **({"guided_json": schema} if schema else {})}
    start = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    param = (r.json().get("error") or {}).get("param") if r.status_code != 200 else None
    if r.status_code != 200 and schema is not None:
        print("  a slow schema's answer:", r.status_code, r.json()["error"]["message"][:160], flush=True)
    return r.status_code, param, time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as store, tempfile.TemporaryFile() as log:
        cmd = [sys.executable, "-m", "service", "serve", "--port", str(port), "--store-url", store,
               "--threads", str(args.threads), "--log-level", "warning"]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            for _ in range(1500):
                try:
                    if httpx.get(url + "/health/ready", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            chat(url, TRIVIAL % 2)  # builds the tokenizer's trie (once per server)
            solo = min(chat(url, TRIVIAL % n)[2] for n in (3, 4, 5))
            with concurrent.futures.ThreadPoolExecutor(len(HOSTILE)) as pool:
                control = [pool.submit(chat, url, None, -1) for _ in HOSTILE]
                during_control = chat(url, TRIVIAL % 8)
                assert {f.result()[0] for f in control} == {400}
            before = rss_mib(proc.pid)
            with concurrent.futures.ThreadPoolExecutor(len(HOSTILE)) as pool:
                hostile = [pool.submit(chat, url, r) for r in HOSTILE]
                during = chat(url, TRIVIAL % 6)
                results = [f.result() for f in hostile]
            after_burst = chat(url, TRIVIAL % 7)
            after = rss_mib(proc.pid)
            with concurrent.futures.ThreadPoolExecutor(len(SLOW_SCHEMAS)) as pool:
                slow = [pool.submit(chat, url, None, 32, schema) for schema in SLOW_SCHEMAS]
                time.sleep(0.5)  # the slow compiles have started
                during_slow = chat(url, TRIVIAL % 9)
                slow_results = [f.result() for f in slow]
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    statuses = sorted({(s, p) for s, p, _ in results})
    print(f"{len(HOSTILE)} hostile regexes: {statuses} (slowest answer {max(t for *_, t in results) / solo:.2f}x "
          "the baseline)")
    print(f"trivial alone (baseline, best of 3): {solo:.3f} s")
    print(f"trivial during the control burst: status {during_control[0]}, {during_control[2] / solo:.2f}x the "
          "baseline")
    print(f"trivial during the hostile burst: status {during[0]}, {during[2] / solo:.2f}x the baseline, "
          f"{during[2] / during_control[2]:.2f}x the control burst's")
    print(f"trivial after the burst:  status {after_burst[0]}, {after_burst[2] / solo:.2f}x the baseline")
    print(f"server RSS after / before the burst: {after / before:.3f}x ({before:.0f} -> {after:.0f} MiB)")
    print(f"{len(SLOW_SCHEMAS)} slow schemas under the size limits: {sorted({(s, p) for s, p, _ in slow_results})}, "
          f"{min(t for *_, t in slow_results):.2f}-{max(t for *_, t in slow_results):.2f} s each")
    print(f"trivial during the slow schemas: status {during_slow[0]}, {during_slow[2]:.3f} s = "
          f"{during_slow[2] / solo:.2f}x the baseline")


if __name__ == "__main__":
    main()
