"""The peak memory of DiffusionGemma's per-step sampler work beside the logits, ours against the reference's, by rows
(issue 43: the ``[canvas x vocab]`` float32 work must not multiply with the rows).

Each measurement runs in a fresh process (``--one MODE ROWS``): it allocates the step's logits ``[B, C, V]`` float32
(the model's output, which both keep), reads its peak resident set size, runs one step's sampling work, and reports
the peak's growth over that, in MiB (``resource.getrusage`` max RSS; large tensors are mapped and returned on free,
so the peak follows the live tensors):

- ``ours``: `service.engine.renoise.sample_row` and the self-conditioning input, one row and 64 positions at a time,
  the temperature divided in place (what `service.engine.renoise.generate` does);
- ``reference``: the reference's step (``generation_diffusion_gemma.py``): ``logits / t``, ``softmax`` and
  ``multinomial`` over ``[B*C, V]``, ``argmax``, ``Categorical(logits).entropy()`` for the acceptance and again for
  the stopping test, and the decoder's self-conditioning ``softmax`` of the whole batch.

Defaults: canvas 256, vocabulary 16,384 (a sixteenth of the real 262,144, so that the reference's 32 rows fit a
small shared machine; the real vocabulary's figures are these times 16), rows 1, 8, 32. Usage:
``python benchmarks/diffusion_gemma_sampler_memory.py [--rows 1,8,32] [--vocab 16384] [--canvas 256]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def one(mode: str, rows: int, vocab: int, canvas: int) -> float:
    """The sampler's peak over the logits, MiB, in this process (run it in a fresh one)."""
    import torch

    sys.path.insert(0, str(ROOT))
    from service.engine.renoise import entropy, sample_row

    torch.set_num_threads(1)
    logits = torch.randn(rows, canvas, vocab)
    embed = torch.randn(vocab, 64)
    base = _peak_mib()
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        if mode == "ours":
            for r in range(rows):
                logits[r].div_(0.5)
                sample_row(logits[r:r + 1], generator, 64)
            for r in range(rows):
                torch.matmul(logits[r:r + 1].softmax(dim=-1, dtype=torch.float32), embed)
        else:
            processed = logits / 0.5
            probs = torch.softmax(processed, dim=-1, dtype=torch.float32)
            torch.multinomial(probs.view(-1, vocab), num_samples=1, generator=generator)
            del probs
            torch.argmax(processed, dim=-1)
            entropy(processed)  # the acceptance's Categorical
            entropy(processed)  # the stopping test's
            torch.matmul(processed.softmax(dim=-1, dtype=torch.float32), embed)
    return _peak_mib() - base


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--canvas", type=int, default=256)
    parser.add_argument("--one", nargs=2, metavar=("MODE", "ROWS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]), args.vocab, args.canvas)))
        return 0
    print(f"canvas {args.canvas}, vocabulary {args.vocab}: peak over the logits, MiB")
    print("| rows | logits MiB | ours | reference |")
    print("|---:|---:|---:|---:|")
    for rows in (int(r) for r in args.rows.split(",")):
        out = {}
        for mode in ("ours", "reference"):
            done = subprocess.run([sys.executable, __file__, "--one", mode, str(rows), "--vocab", str(args.vocab),
                                   "--canvas", str(args.canvas)], capture_output=True, text=True, check=True,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
            out[mode] = float(done.stdout.strip().splitlines()[-1])
        logits = rows * args.canvas * args.vocab * 4 / 2**20
        print(f"| {rows} | {logits:.0f} | {out['ours']:.0f} | {out['reference']:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
