"""What DiffusionGemma's renoising decode costs per denoising step and per committed canvas, in machine-independent
counts (issue 43).

The model has DiffusionGemma-26B-A4B's layout: 30 layers, every sixth global (``(i + 1) % 6 == 0``, the reference's
default pattern: 25 sliding, 5 global), 128 experts top 8 beside the dense MLP on every layer (the "shared" path),
8 query heads, sliding layers 4 KV heads, global layers 2 KV heads with twice the head dim and V from K, window
1024, canvas 256; the widths are shrunk so the arithmetic is small (width 64, head dim 16 / global 32, dense hidden
128, expert hidden 16, vocabulary 4096: counts do not depend on them). Each request: a 200-token prompt (different
per row), per-row generators (each row its own seed). Rows at 1, 8, 32.

From three decodes (``generate`` with 1 step and 1 canvas, 2 steps and 1 canvas, 1 step and 2 canvases):

- **per denoising step** = (2 steps) - (1 step): one decoder pass over all rows, the sampler (one row and 64
  positions at a time), the acceptance, the renoise draw, the stopping test and the self-conditioning input;
- **per commit** = (2 canvases) - (1 canvas): the encoder pass that writes the committed canvas's K/V, the next
  canvas's first step and its random start.

Printed: tensor ops (aten operations dispatched, views included), host syncs (`benchmarks.iteration_cost.Counter`),
decoder and encoder forwards.

Usage: ``python benchmarks/diffusion_gemma_iteration_cost.py [--rows 1,8,32] [--layers 30]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: benchmarks/ is not a package
from benchmarks.iteration_cost import Counter
from service.engine.models.diffusion_gemma import GLOBAL, SLIDING, DiffusionGemmaConfig, DiffusionGemmaModel
from service.engine.renoise import RenoiseParams, generate


def a4b_layout(layers: int = 30, vocab: int = 4096, canvas: int = 256) -> DiffusionGemmaModel:
    """A random DiffusionGemma with 26B-A4B's layer, attention-kind and expert layout, widths shrunk (module doc)."""
    config = DiffusionGemmaConfig(
        arch="diffusion_gemma", vocab_size=vocab, width=64, num_layers=layers, num_heads=8, num_kv_heads=4,
        head_dim=16, mlp_hidden=128, eps=1e-6, rope_theta=10000.0, rope_full_precision=True, qkv_bias=False,
        mask_id=vocab, eos_id=1, pad_id=0, max_length=131072,
        layer_types=tuple(SLIDING if (i + 1) % 6 else GLOBAL for i in range(layers - 1)) + (GLOBAL,),
        sliding_window=1024, global_head_dim=32, global_kv_heads=2, global_rotary_pairs=4, global_theta=1e6,
        softcap=30.0, num_experts=128, experts_per_token=8, moe_hidden=16, canvas_length=canvas, bos_id=2)
    torch.manual_seed(0)
    model = DiffusionGemmaModel(config)
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=0.05)
    return model.eval().requires_grad_(False)


class PassCount:
    """Counts the model's decoder and encoder passes while active."""

    def __init__(self, model: DiffusionGemmaModel) -> None:
        self.model, self.decoder, self.encoder = model, 0, 0

    def __enter__(self) -> PassCount:  # noqa: PYI034
        decode, encode = self.model.decode, self.model.encode

        def counted_decode(*args, **kwargs):
            self.decoder += 1
            return decode(*args, **kwargs)

        def counted_encode(*args, **kwargs):
            self.encoder += 1
            return encode(*args, **kwargs)

        self.model.decode, self.model.encode = counted_decode, counted_encode
        return self

    def __exit__(self, *exc) -> None:
        del self.model.decode, self.model.encode


def run(model: DiffusionGemmaModel, rows: int, steps: int, canvases: int) -> tuple[int, int, int, int]:
    """(ops, syncs, decoder passes, encoder passes) of one decode of ``rows`` requests."""
    gen = torch.Generator().manual_seed(rows)
    vocab, width = model.config.vocab_size, model.config.canvas_length
    prompts = [torch.randint(3, vocab, (200,), generator=gen).tolist() for _ in range(rows)]
    params = RenoiseParams(max_new_tokens=canvases * width, max_denoising_steps=steps, stability_threshold=0,
                           confidence_threshold=1e-9)  # no early stop: every row takes every step
    generators = [torch.Generator().manual_seed(100 + r) for r in range(rows)]
    with Counter() as counter, PassCount(model) as passes:
        generate(model, prompts, params, (), None, generators, mode="per_row")
    return counter.ops, counter.syncs, passes.decoder, passes.encoder


def measure(model: DiffusionGemmaModel, rows: int) -> dict[str, tuple[int, int, int, int]]:
    """Per denoising step and per commit (module doc): (ops, syncs, decoder passes, encoder passes)."""
    one = run(model, rows, 1, 1)
    two_steps = run(model, rows, 2, 1)
    two_canvases = run(model, rows, 1, 2)
    return {"step": tuple(b - a for a, b in zip(one, two_steps, strict=True)),
            "commit": tuple(b - a for a, b in zip(one, two_canvases, strict=True))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,32", help="row counts, comma-separated (default 1,8,32)")
    parser.add_argument("--layers", type=int, default=30, help="layers (default 30, 26B-A4B's)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model = a4b_layout(args.layers)
    print("| rows | per | tensor ops | host syncs | decoder passes | encoder passes |")
    print("|---:|---|---:|---:|---:|---:|")
    for rows in (int(r) for r in args.rows.split(",")):
        for kind, (ops, syncs, decoder, encoder) in measure(model, rows).items():
            print(f"| {rows} | {kind} | {ops} | {syncs} | {decoder} | {encoder} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
