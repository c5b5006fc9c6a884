"""TRACE refinement depth: at which round does each calibration sample's assignment settle?

Runs TRACE (`calibration.trace.trace`) on the default calibration samples of a model (the embedded model's
training split unless ``--model``), with a large round limit, and prints per sample the objective after each round
(nats), the round at which the assignment stopped changing (or "not settled"), and the largest objective change
after round ``--baseline-rounds`` (the default of ``python -m calibration --rounds``), so a default can be chosen
from a measurement (issue 16). Roughly ``--max-rounds`` x 5 s per sample on one CPU thread for the embedded model.

Usage: ``python benchmarks/trace_convergence.py [--samples 8] [--max-rounds 12] [--baseline-rounds 3]
[--model DIR] [--threads 1]``.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from calibration.forward import logits_forward
from calibration.job import CalibrationJob, JobSettings
from calibration.trace import trace
from service.engine import Engine
from service.store.base import open_store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=JobSettings().samples)
    parser.add_argument("--max-rounds", type=int, default=12)
    parser.add_argument("--baseline-rounds", type=int, default=JobSettings().rounds)
    parser.add_argument("--model", default=None)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine.load(args.model, threads=args.threads)
    with tempfile.TemporaryDirectory() as store_dir:
        job = CalibrationJob(JobSettings(model=args.model, samples=args.samples), open_store(store_dir), engine,
                             progress=False)
        samples = job.samples()
    forward = logits_forward(engine.model)
    settled_at = []
    late_change = []
    for i, sample in enumerate(samples):
        started = time.perf_counter()
        result = trace(sample.prompt_ids, sample.answer_ids, forward, engine.spec.mask_id, engine.spec.fingerprint,
                       max_rounds=args.max_rounds)
        o = result.objectives
        late = max((abs(o[r] - o[r - 1]) for r in range(args.baseline_rounds, len(o))), default=0.0)
        settled_at.append(result.rounds if result.settled else None)
        late_change.append(late)
        print(f"sample {i}: {'settled at round ' + str(result.rounds) if result.settled else 'not settled'}; "
              f"objective per round " + " ".join(f"{x:.3f}" for x in o)
              + f"; largest change after round {args.baseline_rounds}: {late:.3f} nats "
              f"({time.perf_counter() - started:.0f} s)", flush=True)
    settled = [r for r in settled_at if r is not None]
    print(f"\n{len(settled)} of {len(samples)} samples settled within {args.max_rounds} rounds"
          + (f" (latest at round {max(settled)})" if settled else "")
          + f"; largest objective change after round {args.baseline_rounds}: {max(late_change):.3f} nats")


if __name__ == "__main__":
    main()
