"""An lm-eval multiple-choice task over HTTP: likelihood work one batch per forward against its context splits
packed as rows of a few forwards (issue 34 item 4), measured in one run against two server processes.

Both servers run the embedded default model with the same Monte-Carlo settings (``DLLM_LIKELIHOOD_MC_NUM`` and
``_MC_BATCH_SIZE`` ``--mc``). The baseline's token budget per forward (``--max-batched-tokens``) is smaller than
one likelihood batch, so each forward runs one batch (a split's draws, or a batch of alternatives), as the server
did before issue 34 (`service.runtime.loop.Worker._step_tasks` always runs one batch); the other server runs at
the default budget, where a forward packs as many batches as the budget and the memory reserved for one forward
allow. lm-eval's ``local-completions`` scores the embedded task's multiple-choice variant (``--limit``
documents, four choices each) against each; the script prints both wall times, the ratio, and whether the scores
agree (within 1e-6), with the server's CPU seconds per request in each run.

Where the time goes, in counts (issue 34): for one 109-token request at ``--mc`` it runs the server's likelihood
work in process both ways (`service.engine.likelihood.PromptLikelihood.step` with the budget and the memory
reserve of `service.runtime.loop.Worker._step_tasks`) and prints the forwards, the arithmetic (every layer's
projections, MLP and attention, `service.engine.forward_cost.ForwardCost.flops`, plus the LM head), and the CPU
seconds inside the model against those outside it (draws, losses, the loop). The arithmetic is the same both
ways (the same rows of the same tokens); packing cuts the forwards, not the arithmetic, so where a forward's time
follows its arithmetic (a CPU) the speed-up is bounded by the share of the time spent outside it; where a forward
costs about the same whatever its rows (a GPU launch-bound at these sizes) the time follows the forwards.

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

from benchmarks.serve_load import cpu_s, free_port, wait_ready


def start(port: int, store: str, mc: int, max_batched_tokens: int | None, threads: int, log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "service", "serve", "--port", str(port), "--store-url", store, "--create-store",
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


def breakdown(mc: int, baseline_tokens: int, length: int = 109) -> list[tuple[str, int, int, float, float]]:
    """(name, forwards, flops, CPU s in the model, CPU s outside it) of one ``length``-token request's likelihood
    work, the baseline's way (one batch per forward) and the packed way (module docstring)."""
    import torch

    from service.engine import Engine
    from service.runtime.memory import MemoryModel
    from service.runtime.scheduler import DEFAULT_MAX_BATCHED_TOKENS

    torch.set_num_threads(1)
    engine = Engine.load(None, threads=1)
    ids = (engine.tokenizer("copy: 3 1 4 1 5 9 2 6 5 3 5 8 9 7 9 3 2 3 8 4 6 2 6 4")["input_ids"] * length)[:length]
    memory = MemoryModel.for_engine(engine)
    c = engine.model.config
    out = []
    for name, tokens in (("one batch per forward", baseline_tokens), ("splits packed as rows", None)):
        budget = DEFAULT_MAX_BATCHED_TOKENS if tokens is None else tokens
        reserve = memory.measure_forward(engine, budget)
        work = engine.likelihood(ids, mc, mc, 1234, top_k=1)
        model, inside = work.model, [0.0]
        flops = [0]

        def timed(x, head=True, model=model, inside=inside, flops=flops):
            t0 = time.process_time()
            y = model(x, head=head)
            inside[0] += time.process_time() - t0
            rows, t = x.shape
            flops[0] += c.num_layers * memory.forward.flops(rows, t, t)
            return y

        def head_logits(hidden, model=model, inside=inside, flops=flops):
            t0 = time.process_time()
            y = model.head_logits(hidden)
            inside[0] += time.process_time() - t0
            flops[0] += 2 * hidden.shape[0] * hidden.shape[1] * c.width * c.vocab_size
            return y

        timed.head_logits = head_logits
        work.model = timed
        t0 = time.process_time()
        while work.step(max(1, budget // length), reserve):
            pass
        total = time.process_time() - t0
        out.append((name, work.forwards, flops[0], inside[0], total - inside[0]))
    return out


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

    results, server_cpu = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        tasks_dir = write_task_dir(Path(tmp) / "tasks", extra=embedded_task_configs())
        for name, tokens in (("one batch per forward", args.baseline_tokens), ("splits packed as rows", None)):
            port = free_port()
            with open(Path(tmp) / f"{port}.log", "w") as log:
                proc = start(port, str(Path(tmp) / f"store-{port}"), args.mc, tokens, args.threads, log)
                try:
                    before = cpu_s(proc.pid)
                    results[name] = evaluate(f"http://127.0.0.1:{port}", args.limit, Path(tasks_dir))
                    server_cpu[name] = cpu_s(proc.pid) - before
                finally:
                    proc.terminate()
                    proc.wait(timeout=60)
    (base_s, base), (packed_s, packed) = results.values()
    same = len(base) == len(packed) and all(abs(a - b) <= 1e-6 for a, b in zip(base, packed))
    print(f"lm-eval multiple choice over HTTP, {args.limit} documents ({len(packed)} requests), mc_num {args.mc}")
    for name, (seconds, scores) in results.items():
        print(f"  {name:24s} {seconds:8.1f} s; server CPU {server_cpu[name] / max(1, len(scores)):.2f} s per request")
    print(f"  speed-up {base_s / packed_s:.2f}x; scores the same within 1e-6: {same}")
    rows = breakdown(args.mc, args.baseline_tokens)
    print(f"one 109-token request's likelihood work in process, mc_num {args.mc}:")
    print(f"  {'':24s} {'forwards':>8} {'GFLOP':>8} {'CPU s model':>11} {'CPU s other':>11}")
    for name, forwards, flops, inside, other in rows:
        print(f"  {name:24s} {forwards:8d} {flops / 1e9:8.2f} {inside:11.2f} {other:11.2f}")
    (_, f0, w0, m0, o0), (_, f1, w1, m1, o1) = rows
    print(f"  forwards {f0 / f1:.1f}x fewer, arithmetic {w0 / w1:.2f}x, CPU seconds {(m0 + o0) / (m1 + o1):.2f}x. "
          f"A CPU's forward time follows its arithmetic, so packing can win at most the time outside the model "
          f"and the per-forward overhead; a launch-bound GPU's time follows the forwards: {f0 / f1:.0f}x.")


if __name__ == "__main__":
    main()
