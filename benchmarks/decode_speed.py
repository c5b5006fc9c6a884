"""Decode speed of the three cache modes on one random-weight LLaDA-shaped model, measured in one run.

Prints, for a fixed schedule (8 steps per block) and for threshold 0.9, the tokens/s and NFE of each method and its
ratio to no cache. Random weights (no download) at a shape where compute, not Python overhead, dominates: d_model
512, 8 layers, 8 heads, MLP 1536, vocabulary 4096, prompt 200 tokens, 256 generated, block 32. The LM head's
weights are scaled up (``--lm-head-scale``, default 10) so that random weights give confident predictions; even so,
all masks of a block look alike to a random model, so threshold decoding reveals either the whole block or one
token per call: the threshold figures are indicative, the fixed schedule is the controlled comparison. Compute bound with 8 steps per block (linear layers only): dual 8T / (T + 7 x 32)
= 5.4x, prefix 8T / (T + 7 x 144) = 2.5x with T = 456.

Methods are rows of ``METHODS``: a name, a cache mode and a KV-store factory (None = the engine's default
full-precision store); add quantized stores there.

Usage: ``python benchmarks/decode_speed.py [--threads 1] [--repeats 2] [--preset small|8b|tiny] [--device cpu]
[--dtype float32]``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from service.engine import Engine
from service.engine.kv_store import KVStore
from service.engine.models import LLaDAModel, ModelConfig
from service.engine.params import DecodeParams
from service.engine.spec import ModelSpec


@dataclass(frozen=True)
class Method:
    """One benchmark row: how the reused K/V are held in a cache mode."""

    name: str
    cache_mode: str
    make_store: Callable[[Engine], KVStore | None] = lambda engine: None


METHODS: list[Method] = [
    Method("no cache", "none"),
    Method("prefix cache", "prefix"),
    Method("dual cache", "dual"),
]
BASELINE = "no cache"

PRESETS = {
    # width, layers, heads, MLP hidden, vocabulary
    "small": dict(width=512, num_layers=8, num_heads=8, mlp_hidden=1536, vocab_size=4096),
    # A quick check that the script runs (not a measurement).
    "tiny": dict(width=64, num_layers=2, num_heads=4, mlp_hidden=128, vocab_size=256),
    # LLaDA-8B-Instruct's geometry (golden SPEC 1.1), for a GPU.
    "8b": dict(width=4096, num_layers=32, num_heads=32, mlp_hidden=12288, vocab_size=126464),
}


def random_engine(preset: str, dtype: torch.dtype, device: str, lm_head_scale: float, seed: int = 0) -> Engine:
    """A LLaDA-shaped model with seeded random weights, wrapped as an Engine (no tokenizer)."""
    shape = PRESETS[preset]
    config = ModelConfig(
        arch="llada", head_dim=shape["width"] // shape["num_heads"], num_kv_heads=shape["num_heads"], eps=1e-5,
        rope_theta=500000.0, rope_full_precision=True, qkv_bias=False, mask_id=shape["vocab_size"] - 1, eos_id=1,
        pad_id=2, max_length=4096, **shape,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = LLaDAModel(config).to(dtype)
    with torch.no_grad():
        model.lm_head.weight.mul_(lm_head_scale)
    model.eval().requires_grad_(False)
    spec = ModelSpec(
        arch="llada", model_id=f"random-{preset}", fingerprint="random", num_layers=config.num_layers,
        num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        vocab_size=config.vocab_size, mask_id=config.mask_id, eos_ids=(config.eos_id,), pad_id=config.pad_id,
        max_length=config.max_length,
    )
    return Engine(model, spec, None, dtype, torch.device(device))


def measure(engine: Engine, prompts: list[list[int]], params: DecodeParams, method: Method) -> tuple[float, float]:
    """(generated tokens per second over the batch, mean NFE per row) of one decode."""
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    report = engine.generate(prompts, params, kv_store=method.make_store(engine))
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    return params.gen_length * len(prompts) / seconds, sum(r.nfe for r in report.rows) / len(report.rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--prompt-length", type=int, default=200)
    parser.add_argument("--gen-length", type=int, default=256)
    parser.add_argument("--block-length", type=int, default=32)
    parser.add_argument("--steps-per-block", type=int, default=8)
    parser.add_argument("--threshold", type=float, default=0.9)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--repeats", type=int, default=1, help="decodes per method, interleaved across methods; the fastest counts"
    )
    parser.add_argument("--lm-head-scale", type=float, default=10.0, help="raises random-weight confidence")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    from service.engine.loading import resolve_dtype

    engine = random_engine(args.preset, resolve_dtype(args.dtype), args.device, args.lm_head_scale)
    generator = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(3, engine.spec.vocab_size - 1, (args.prompt_length,), generator=generator).tolist()
        for _ in range(args.batch)
    ]
    blocks = args.gen_length // args.block_length
    schedules = {
        f"fixed {args.steps_per_block} steps/block": dict(threshold=None, steps=args.steps_per_block * blocks),
        f"threshold {args.threshold}": dict(threshold=args.threshold, steps=None),
    }
    c = engine.model.config
    print(
        f"random LLaDA-shaped model: d_model {c.width}, {c.num_layers} layers, {c.num_heads} heads, MLP {c.mlp_hidden}, "
        f"vocab {c.vocab_size}; prompt {args.prompt_length}, generated {args.gen_length}, block {args.block_length}, "
        f"batch {args.batch}; {args.dtype} on {args.device}, torch threads {torch.get_num_threads()}, "
        f"best of {args.repeats}"
    )
    # Warm-up (allocator, kernels) outside the measurement.
    warm = DecodeParams(gen_length=args.block_length, block_length=args.block_length, cache_mode="dual", threshold=None,
                        steps=2, ignore_eos=True)
    engine.generate(prompts[:1], warm)
    for label, schedule in schedules.items():
        print(f"\n{label}")
        print(f"  {'method':<24}{'tokens/s':>10}{'NFE':>8}{'vs ' + BASELINE:>14}")
        results: dict[str, tuple[float, float]] = {}
        # Interleaved repeats: on a shared machine the load drifts; the fastest decode of each method counts.
        for _ in range(args.repeats):
            for method in METHODS:
                params = DecodeParams(
                    gen_length=args.gen_length, block_length=args.block_length, cache_mode=method.cache_mode,
                    ignore_eos=True, **schedule,
                )
                results[method.name] = max(results.get(method.name, (0.0, 0.0)), measure(engine, prompts, params, method))
        base = results[BASELINE][0]
        for name, (tps, nfe) in results.items():
            print(f"  {name:<24}{tps:>10.1f}{nfe:>8.1f}{tps / base:>13.2f}x")


if __name__ == "__main__":
    main()
