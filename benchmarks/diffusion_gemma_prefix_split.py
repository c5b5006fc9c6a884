"""Whether DiffusionGemma's committed K/V of a prompt's leading tokens depend only on those tokens: the question a
prefix cache across requests rests on (docs/prefix-cache.md). Counts, no times.

The encoder pass is causal, so mathematically the K/V of positions ``[0, P)`` depend on ``ids[:P]`` only. A prefix
cache would serve them as computed by an earlier request whose prompt ran its encoder pass over *its* whole prompt
(or in chunks), and the reader would encode only ``ids[P:]`` after them. Measured here, per case, a prompt of ``L``
tokens encoded:

- **one pass** (what a request does with no cache: the reference's pass), against
- **two passes** ``[0, P)`` then ``[P, L)`` (what a request reading ``P`` cached tokens computes, the cached part
  being the first pass's).

Printed: the cases whose held K/V (every layer, sliding and global) are equal bit for bit; the first operation of
the first layer whose output at the prefix positions differs between the one-pass and the prefix-only pass (module
hooks: attention, dense MLP, experts); and, over seeded decodes of ``dgemma-tiny`` and of the 26B-A4B layout (in
float32 and bfloat16), how many give other tokens when the prompt is encoded in those two passes (the rest of the
decode as usual: `RenoisingRow.replay`).

Checkpoints: the three tiny ones of tests/data/diffusion_gemma and a random model with 26B-A4B's layout
(`benchmarks.diffusion_gemma_iteration_cost.a4b_layout`: 30 layers, 128 experts top 8, canvas 256), prompts split
at whole canvases.

Usage: ``python benchmarks/diffusion_gemma_prefix_split.py [--decodes 48]``.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: benchmarks/ is not a package
from benchmarks.diffusion_gemma_iteration_cost import a4b_layout
from service.engine.loading import load_checkpoint
from service.engine.models.diffusion_gemma import CanvasCache, DiffusionGemmaModel
from service.engine.renoise import RenoiseParams, RenoisingRow, eos_tensor, iterate

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "diffusion_gemma"


def _ids(length: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, min(vocab, 496)) for _ in range(length)]


def encoded_cache(model: DiffusionGemmaModel, runs: list[list[int]]) -> CanvasCache:
    """A one-row cache after one encoder pass per run of ``runs`` (ids), in order."""
    cache = CanvasCache(model.config, 1)
    for run in runs:
        model.encode(torch.tensor([run]), [len(run)], cache)
    return cache


def split_cases(model: DiffusionGemmaModel, cases: list[tuple[int, int]]) -> tuple[int, int]:
    """(cases whose K/V are equal bit for bit, cases) of one pass vs ``[0, P)`` then ``[P, L)``."""
    equal = 0
    for length, prefix in cases:
        ids = _ids(length, length * 7 + prefix, model.config.vocab_size)
        one, two = encoded_cache(model, [ids]), encoded_cache(model, [ids[:prefix], ids[prefix:]])
        equal += all(torch.equal(a[0], b[0]) for layer in range(model.config.num_layers)
                     for a, b in ((one.k[layer], two.k[layer]), (one.v[layer], two.v[layer])))
    return equal, len(cases)


def first_difference(model: DiffusionGemmaModel, length: int, prefix: int) -> str:
    """The first module output (layer order; attention, dense MLP, experts) that differs at positions ``[0,
    prefix)`` between the one-pass encoding of ``length`` tokens and the encoding of the first ``prefix`` alone."""
    outputs: dict[str, list[torch.Tensor]] = {}
    hooks = []
    for index, layer in enumerate(model.layers):
        for name, module in (("attention", layer.self_attn), ("dense MLP", layer.mlp), ("experts", layer.experts)):
            def keep(_, __, out, key=f"layer {index} {name}"):
                if out is not None:
                    outputs.setdefault(key, []).append(out.reshape(-1, out.shape[-1]))
            hooks.append(module.register_forward_hook(keep))
    ids = _ids(length, 3, model.config.vocab_size)
    try:
        encoded_cache(model, [ids])
        encoded_cache(model, [ids[:prefix]])
    finally:
        for hook in hooks:
            hook.remove()
    for key, (one, alone) in outputs.items():
        if not torch.equal(one[:prefix], alone[:prefix]):
            return f"{key} (max |diff| {float((one[:prefix] - alone[:prefix]).abs().max()):.2e})"
    return "none"


def decode(model: DiffusionGemmaModel, prompt: list[int], prefix: int, seed: int, params: RenoiseParams,
           eos: torch.Tensor, pad_id: int | None) -> list[int]:
    """One seeded decode (the running batch's loop, one row); ``prefix`` > 0: its prompt's first ``prefix`` tokens
    encoded in a pass of their own before the rest (a prefix-cache hit's K/V)."""
    row = RenoisingRow(model, prompt, params, torch.Generator().manual_seed(seed))
    if prefix:
        row.replay, row.pending = [row.pending[:prefix]], row.pending[prefix:]
    while not row.done:
        iterate(model, [row], eos, pad_id, 64)
    return row.result.generated_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decodes", type=int, default=48)
    parser.add_argument("--a4b-decodes", type=int, default=8, help="seeded decodes on the 26B-A4B layout per dtype")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| model | canvas | window | cases (L, P) | K/V equal bit for bit | first difference |")
    print("|---|---:|---:|---|---:|---|")
    with torch.inference_mode():
        models = [(name, load_checkpoint(DATA / name).model.float().eval())
                  for name in ("dgemma-tiny", "dgemma-tiny-w8", "dgemma-tiny-settling")]
        models.append(("26B-A4B layout, widths shrunk", a4b_layout()))
        for name, model in models:
            c = model.config.canvas_length
            cases = [(length, k * c) for length in (2 * c + 5, 3 * c, 4 * c + 9) for k in (1, 2) if k * c < length]
            equal, total = split_cases(model, cases)
            shown = ", ".join(f"({length}, {p})" for length, p in cases[:3]) + (" ..." if len(cases) > 3 else "")
            print(f"| {name} | {c} | {model.config.sliding_window} | {shown} | {equal} / {total} | "
                  f"{first_difference(model, 2 * c + 5, c)} |")
        tiny = models[0][1]
        loaded = load_checkpoint(DATA / "dgemma-tiny")
        eos = eos_tensor(loaded.spec.eos_ids, torch.device("cpu"))
        params = RenoiseParams(max_new_tokens=64, max_denoising_steps=4, entropy_bound=0.5, t_max=0.9, t_min=0.3,
                               stability_threshold=1, confidence_threshold=0.01)
        differ = 0
        for seed in range(args.decodes):
            prompt = [498] + _ids(16 * (1 + seed % 3) + seed % 7, seed, 496)
            whole = decode(tiny, prompt, 0, seed, params, eos, loaded.spec.pad_id)
            split = decode(tiny, prompt, 16 * (1 + seed % 2) if len(prompt) > 32 else 16, seed, params, eos,
                           loaded.spec.pad_id)
            differ += whole != split
        print(f"\ndgemma-tiny, {args.decodes} seeded decodes (64 tokens, prompts 17 to 55 tokens, the first 16 or 32 "
              f"encoded apart): {differ} give other tokens than the one-pass encoding")
        big = models[-1][1]
        c = big.config.canvas_length
        params = RenoiseParams(max_new_tokens=c, max_denoising_steps=4, entropy_bound=20.0, t_max=0.9, t_min=0.3,
                               stability_threshold=1, confidence_threshold=0.01)
        eos = eos_tensor((1,), torch.device("cpu"))
        for dtype in (torch.float32, torch.bfloat16):
            big.to(dtype)
            equal, total = split_cases(big, [(2 * c + 5, c), (3 * c, 2 * c)])
            differ = 0
            for seed in range(args.a4b_decodes):
                prompt = [2] + _ids(2 * c + 7 * seed, seed, big.config.vocab_size)
                differ += decode(big, prompt, 0, seed, params, eos, 0) != decode(big, prompt, c, seed, params, eos, 0)
            print(f"26B-A4B layout, {str(dtype).removeprefix('torch.')}: K/V equal bit for bit in {equal} / {total} "
                  f"splits; {differ} of {args.a4b_decodes} seeded decodes (one canvas of {c}, prompts {2 * c + 1} "
                  f"to {2 * c + 1 + 7 * (args.a4b_decodes - 1)} tokens, the first {c} encoded apart) give other "
                  "tokens")


if __name__ == "__main__":
    main()
