"""An lm-eval multiple-choice task over HTTP: likelihood work one batch per forward against its context splits
packed as rows of a few forwards (issue 34 item 4), measured in one run against two server processes.

Both servers run the embedded default model with the same Monte-Carlo settings (``DLLM_LIKELIHOOD_MC_NUM`` and
``_MC_BATCH_SIZE`` ``--mc``). The baseline's token budget per forward (``--max-batched-tokens``) is smaller than
one likelihood batch, so each forward runs one batch (a split's draws, or a batch of alternatives), as the server
did before issue 34 (`service.runtime.loop.Worker._step_tasks` always runs one batch); the other server runs at
the default budget, where a forward packs as many batches as the budget and the memory reserved for one forward
allow. lm-eval's ``local-completions`` scores the embedded task's multiple-choice variant (``--limit``
documents, four choices each) against each; the script prints both wall times, the ratio, and whether the scores
agree (within 1e-6).

Usage: ``OMP_NUM_THREADS=1 python benchmarks/likelihood_http.py [--limit 3] [--mc 4] [--threads 1]``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.serve_load import free_port, wait_ready


def start(port: int, store: str, mc: int, max_batched_tokens: int | None, threads: int, log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "service", "serve", "--port", str(port), "--store-url", store,
           "--threads", str(threads), "--log-level", "warning"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "DLLM_LIKELIHOOD_MC_NUM": str(mc),
           "DLLM_LIKELIHOOD_MC_BATCH_SIZE": str(mc)}
    if max_batched_tokens is not None:
        env["DLLM_MAX_BATCHED_TOKENS"] = str(max_batched_tokens)
    return wait_ready(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), port)


def evaluate(url: str, limit: int, tasks_dir: Path) -> tuple[float, list[float]]:
    import lm_eval

    from evaluation.embedded_choice import TASK
    from evaluation.matrix import task_manager_for

    manager = task_manager_for([TASK], str(tasks_dir))
    tokenizer = ROOT / "service" / "assets" / "embedded"
    t0 = time.perf_counter()
    out = lm_eval.simple_evaluate(
        model="local-completions", model_args=f"model=embedded,base_url={url}/v1/completions,"
        f"tokenizer_backend=huggingface,tokenizer={tokenizer},max_retries=1",
        tasks=[TASK], task_manager=manager, limit=limit, bootstrap_iters=0, apply_chat_template=True,
        log_samples=True)
    seconds = time.perf_counter() - t0
    return seconds, [r[0][0] for s in out["samples"][TASK] for r in s["resps"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=3, help="documents of the task (four requests each)")
    parser.add_argument("--mc", type=int, default=4, help="Monte-Carlo samples (= samples per forward)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--baseline-tokens", type=int, default=64,
                        help="the baseline's DLLM_MAX_BATCHED_TOKENS: under one batch's rows x tokens")
    args = parser.parse_args()

    from evaluation.embedded_task import embedded_task_configs
    from evaluation.tasks import write_task_dir

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tasks_dir = write_task_dir(Path(tmp) / "tasks", extra=embedded_task_configs())
        for name, tokens in (("one batch per forward", args.baseline_tokens), ("splits packed as rows", None)):
            port = free_port()
            with open(Path(tmp) / f"{port}.log", "w") as log:
                proc = start(port, str(Path(tmp) / f"store-{port}"), args.mc, tokens, args.threads, log)
                try:
                    results[name] = evaluate(f"http://127.0.0.1:{port}", args.limit, Path(tasks_dir))
                finally:
                    proc.terminate()
                    proc.wait(timeout=60)
    (base_s, base), (packed_s, packed) = results.values()
    same = len(base) == len(packed) and all(abs(a - b) <= 1e-6 for a, b in zip(base, packed))
    print(f"lm-eval multiple choice over HTTP, {args.limit} documents ({len(packed)} requests), mc_num {args.mc}")
    for name, (seconds, _) in results.items():
        print(f"  {name:24s} {seconds:8.1f} s")
    print(f"  speed-up {base_s / packed_s:.2f}x; scores the same within 1e-6: {same}")


if __name__ == "__main__":
    main()
