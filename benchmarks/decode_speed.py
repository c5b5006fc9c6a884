"""Decode speed of the three cache modes on one random-weight LLaDA-shaped model, measured in one run.

Prints, for a fixed schedule (8 steps per block) and for threshold 0.9, the tokens/s and NFE of each method and its
ratio to no cache, by wall clock and by this process's CPU time: on a shared machine other jobs slow the wall clock
unevenly across methods, while with one thread the CPU-time figures are close to what an idle machine shows. Random
weights (no download) at a shape where compute, not Python overhead, dominates: d_model 512, 8 layers, 8 heads, MLP
1536, vocabulary 4096, prompt 200 tokens, 256 generated, block 32. The LM head's weights are scaled up
(``--lm-head-scale``, default 10) so that random weights give confident predictions; even so, all masks of a block look
alike to a random model, so threshold decoding reveals either the whole block or one token per call: the threshold
figures are indicative, the fixed schedule is the controlled comparison. Compute bound with 8 steps per block
(linear layers only): dual 8T / (T + 7 x 32) = 5.4x, prefix 8T / (T + 7 x 144) = 2.5x with T = 456.

Methods are rows of ``METHODS``: a name, a cache mode and a KV-store factory (None = the engine's default
full-precision store). The quantized rows hold the dual cache's reused K/V with `service.quant` at 4 bits (KIVI,
dLLM-KVQ with p = 1 on every layer, KVQuant), per layer (each later step dequantizes a layer while it runs; the
issue's target: <= 1.15x the time of the dual cache alone) and with the dequantized copies kept for the block
("keep": faster, saves no memory within a block); the last two columns are each row's time relative to dual cache
(wall clock, CPU time).

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


KV_BITS = 4
_STATES: dict[str, object] = {}


def quantized_store(method: str, keep: bool) -> Callable[[Engine], KVStore]:
    """A factory of `service.quant` stores at ``KV_BITS`` bits: KIVI (G = 32), dLLM-KVQ (attention score, p = 1 on
    every layer), KVQuant (a state fitted once per model on random tensors of its K/V shape); ``keep`` keeps the
    dequantized copies for the block instead of dequantizing each layer at every step."""
    from service.artifacts.base import Provenance, default_v_group_size
    from service.artifacts.policy import LayerPolicy, PolicyTable
    from service.quant.config import KVQuantConfig
    from service.quant.kvquant import fit_state
    from service.quant.store import make_kv_store

    prov = Provenance(data="random tensors", code="benchmarks/decode_speed.py")

    def make(engine: Engine) -> KVStore:
        spec = engine.spec
        config = {"method": method, "bits": KV_BITS, "keep_dequantized": keep}
        if method == "dllm_kvq":
            table = PolicyTable(
                model_id=spec.model_id, weights_fingerprint=spec.fingerprint, cache_mode="dual", bits=KV_BITS,
                k_group_size=32, v_group_size=default_v_group_size(spec.head_dim), k_bit_cap=16.0, provenance=prov,
                layers=[LayerPolicy(score_type="attention", p=1)] * spec.num_layers,
            )
            return make_kv_store(KVQuantConfig(**config, policy_id=table.id), spec, artifact=table)
        if method == "kvquant":
            key = f"{spec.model_id}/{KV_BITS}"
            if key not in _STATES:
                gen = torch.Generator().manual_seed(0)
                sample = [torch.randn(1, spec.num_kv_heads, 256, spec.head_dim, generator=gen)
                          for _ in range(spec.num_layers)]
                _STATES[key] = fit_state(sample, sample, KV_BITS, spec, prov)
            state = _STATES[key]
            return make_kv_store(KVQuantConfig(**config, kvquant_state_id=state.id), spec, artifact=state)
        return make_kv_store(KVQuantConfig(**config), spec)

    return make


METHODS: list[Method] = [
    Method("no cache", "none"),
    Method("prefix cache", "prefix"),
    Method("dual cache", "dual"),
    *(
        Method(f"dual+{name} {KV_BITS}b{' keep' if keep else ''}", "dual", quantized_store(name, keep))
        for keep in (False, True)
        for name in ("kivi", "dllm_kvq", "kvquant")
    ),
]
BASELINE = "no cache"
CACHE_BASELINE = "dual cache"  # the quantized rows' reference: the same cache mode unquantized

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


@dataclass(frozen=True)
class Measurement:
    """One decode: generated tokens per wall-clock second and per CPU second of this process, mean NFE per row."""

    tokens_per_s: float
    tokens_per_cpu_s: float
    nfe: float

    def best(self, other: Measurement | None) -> Measurement:
        """The faster of two decodes of the same method, per clock."""
        if other is None:
            return self
        return Measurement(
            max(self.tokens_per_s, other.tokens_per_s), max(self.tokens_per_cpu_s, other.tokens_per_cpu_s), self.nfe
        )


def measure(engine: Engine, prompts: list[list[int]], params: DecodeParams, method: Method) -> Measurement:
    """Decode once with ``method``'s store and time it (wall clock and process CPU time)."""
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter(), time.process_time()
    report = engine.generate(prompts, params, kv_store=method.make_store(engine))
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    tokens = params.gen_length * len(prompts)
    return Measurement(tokens / wall, tokens / cpu, sum(r.nfe for r in report.rows) / len(report.rows))


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
        "--methods", default=None,
        help=f"comma-separated method names to run (default: all; always includes {BASELINE!r} and {CACHE_BASELINE!r})",
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="decodes per method, interleaved across methods; the fastest counts"
    )
    parser.add_argument("--lm-head-scale", type=float, default=10.0, help="raises random-weight confidence")
    args = parser.parse_args(argv)
    methods = METHODS
    if args.methods is not None:
        wanted = {name.strip() for name in args.methods.split(",")} | {BASELINE, CACHE_BASELINE}
        unknown = wanted - {m.name for m in METHODS}
        if unknown:
            parser.error(f"unknown methods {sorted(unknown)}; legal: {', '.join(m.name for m in METHODS)}")
        methods = [m for m in METHODS if m.name in wanted]

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
        print(
            f"  {'method':<24}{'tokens/s':>10}{'tokens/CPU-s':>14}{'NFE':>8}{'vs no cache':>13}{'(CPU)':>8}"
            f"{'time vs dual':>14}{'(CPU)':>8}"
        )
        results: dict[str, Measurement] = {}
        # Interleaved repeats: on a shared machine the load drifts; the fastest decode of each method counts.
        for _ in range(args.repeats):
            for method in methods:
                params = DecodeParams(
                    gen_length=args.gen_length, block_length=args.block_length, cache_mode=method.cache_mode,
                    ignore_eos=True, **schedule,
                )
                results[method.name] = measure(engine, prompts, params, method).best(results.get(method.name))
        base, dual = results[BASELINE], results[CACHE_BASELINE]
        for name, m in results.items():
            print(
                f"  {name:<24}{m.tokens_per_s:>10.1f}{m.tokens_per_cpu_s:>14.1f}{m.nfe:>8.1f}"
                f"{m.tokens_per_s / base.tokens_per_s:>12.2f}x{m.tokens_per_cpu_s / base.tokens_per_cpu_s:>7.2f}x"
                f"{dual.tokens_per_s / m.tokens_per_s:>13.3f}x{dual.tokens_per_cpu_s / m.tokens_per_cpu_s:>7.3f}x"
            )


if __name__ == "__main__":
    main()
