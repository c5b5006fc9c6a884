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
full-precision store). The quantized rows hold the dual cache's reused K/V with `service.quant` at ``--bits`` (KIVI,
dLLM-KVQ with p = 1 on every layer, KVQuant), per layer (each later step dequantizes a layer into a scratch buffer
while it runs, or on CUDA attends straight from the packed codes with the fused Triton kernel,
`service.quant.kernels`) and with the dequantized layers kept for the block ("keep": dequantized once per block,
saves no memory within a block). Columns after NFE: ratio to no cache (wall, CPU), time relative to the dual cache
(wall, CPU; issue 15's targets: <= 1.05x on the ``small`` preset, <= 1.15x on the embedded model), the peak bytes of
reused K/V alive during a later step (held + the attention's input; MiB), and the KV bytes one later step reads
over all layers (held or packed bytes + the attention's full-precision input, which the fused kernel never makes;
MiB). With ``--peak-bandwidth GB/s`` two more: the bytes one forward reads (weights + KV) and the bandwidth that
implies at the decode's mean time per forward (block-initial forwards included, so a lower bound), as a share of
the peak.

``--embedded`` adds, in the same run, the embedded default model in-process: the first 8 held-out test questions
batched, threshold 0.9, the task's 64 tokens in blocks of 32, the dual cache against its quantized rows (at 4 and
2 bits).

Usage: ``python benchmarks/decode_speed.py [--threads 1] [--repeats 2] [--preset small|8b|tiny] [--device cpu]
[--dtype float32] [--bits 4,2] [--schedules both|fixed|threshold] [--kv-attention auto|torch|triton] [--embedded]
[--peak-bandwidth 4800]``.
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
#: The later steps' attention path of the quantized stores (`service.quant.store.QuantizedKVStore`).
KV_ATTENTION = {"path": "auto"}


def quantized_store(method: str, keep: bool, bits: int = KV_BITS, key_bias: bool = False
                    ) -> Callable[[Engine], KVStore]:
    """A factory of `service.quant` stores at ``bits`` bits: KIVI (G = 32), dLLM-KVQ (attention score, p = 1 on
    every layer), KVQuant (a state fitted once per model on random tensors of its K/V shape); ``keep`` keeps the
    dequantized copies for the block instead of dequantizing each layer at every step; ``key_bias`` turns on the
    key-bias correction (`service.quant.key_bias`)."""
    from service.artifacts.base import Provenance, default_v_group_size
    from service.artifacts.policy import LayerPolicy, PolicyTable
    from service.quant.config import KVQuantConfig
    from service.quant.kvquant import fit_state
    from service.quant.store import make_kv_store

    prov = Provenance(data="random tensors", code="benchmarks/decode_speed.py")

    def make(engine: Engine) -> KVStore:
        spec = engine.spec
        config = {"method": method, "bits": bits, "keep_dequantized": keep, "key_bias_correction": key_bias}
        path = KV_ATTENTION["path"]
        if method == "dllm_kvq":
            table = PolicyTable(
                model_id=spec.model_id, weights_fingerprint=spec.fingerprint, cache_mode="dual", bits=bits,
                k_group_size=32, v_group_size=default_v_group_size(spec.head_dim), k_bit_cap=16.0, provenance=prov,
                layers=[LayerPolicy(score_type="attention", p=1)] * spec.num_layers,
            )
            config = KVQuantConfig(**config, policy_id=table.id)
            return make_kv_store(config, spec, artifact=table, attention=path)
        if method == "kvquant":
            key = f"{spec.model_id}/{bits}"
            if key not in _STATES:
                gen = torch.Generator().manual_seed(0)
                sample = [torch.randn(1, spec.num_kv_heads, 256, spec.head_dim, generator=gen)
                          for _ in range(spec.num_layers)]
                _STATES[key] = fit_state(sample, sample, bits, spec, prov)
            state = _STATES[key]
            config = KVQuantConfig(**config, kvquant_state_id=state.id)
            return make_kv_store(config, spec, artifact=state, attention=path)
        return make_kv_store(KVQuantConfig(**config), spec, attention=path)

    return make


def quantized_methods(bits: tuple[int, ...]) -> list[Method]:
    """The quantized dual-cache rows: every method at every bit width, per layer, then kept."""
    return [
        Method(f"dual+{name} {b}b{' keep' if keep else ''}", "dual", quantized_store(name, keep, b))
        for keep in (False, True)
        for b in bits
        for name in ("kivi", "dllm_kvq", "kvquant")
    ]


METHODS: list[Method] = [
    Method("no cache", "none"),
    Method("prefix cache", "prefix"),
    Method("dual cache", "dual"),
    *quantized_methods((KV_BITS,)),
]
BASELINE = "no cache"
CACHE_BASELINE = "dual cache"  # the quantized rows' reference: the same cache mode unquantized

PRESETS = {
    # width, layers, heads, MLP hidden, vocabulary
    "small": {"width": 512, "num_layers": 8, "num_heads": 8, "mlp_hidden": 1536, "vocab_size": 4096},
    # A quick check that the script runs (not a measurement).
    "tiny": {"width": 64, "num_layers": 2, "num_heads": 4, "mlp_hidden": 128, "vocab_size": 256},
    # LLaDA-8B-Instruct's geometry (golden SPEC 1.1), for a GPU.
    "8b": {"width": 4096, "num_layers": 32, "num_heads": 32, "mlp_hidden": 12288, "vocab_size": 126464},
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
    """One decode: generated tokens per wall-clock second and per CPU second of this process, mean NFE per row,
    wall seconds per forward, the peak bytes of reused K/V alive in a later step and the KV bytes a later step
    reads (see the module doc; 0 in no-cache mode)."""

    tokens_per_s: float
    tokens_per_cpu_s: float
    nfe: float
    seconds_per_forward: float = 0.0
    kv_alive: int = 0
    kv_read: int = 0

    def best(self, other: Measurement | None) -> Measurement:
        """The faster of two decodes of the same method, per clock."""
        if other is None:
            return self
        return Measurement(
            max(self.tokens_per_s, other.tokens_per_s), max(self.tokens_per_cpu_s, other.tokens_per_cpu_s), self.nfe,
            min(self.seconds_per_forward, other.seconds_per_forward), self.kv_alive, self.kv_read,
        )


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class KVTraffic:
    """Wraps a store's later-step calls (``window_kv``, ``attend``) to record the bytes of reused K/V alive
    (what the store holds, plus an attention input it allocated afresh) and read (held or packed bytes, plus the
    attention input) per later step, summed over layers."""

    def __init__(self, store: KVStore) -> None:
        self.store, self.alive, self.per_layer = store, 0, {}
        window_kv, attend = store.window_kv, store.attend

        def tracked_window_kv(layer, *args):
            k_all, v_all = window_kv(layer, *args)
            self._note(layer, _nbytes((k_all, v_all)))
            return k_all, v_all

        def tracked_attend(layer, *args):
            out = attend(layer, *args)
            if out is not None:
                self._note(layer, 0)
            return out

        store.window_kv, store.attend = tracked_window_kv, tracked_attend
        if hasattr(store, "sequence_kv"):  # the full-precision store: the engine reads its sequence in order
            sequence_kv = store.sequence_kv

            def tracked_sequence_kv(layer):
                k_all, v_all = sequence_kv(layer)
                self._note(layer, _nbytes((k_all, v_all)))  # the batch's concatenation copies it
                return k_all, v_all

            store.sequence_kv = tracked_sequence_kv

    def _note(self, layer: int, attention_input: int) -> None:
        store = self.store
        if hasattr(store, "bytes_held"):  # quantized: packed + its scratch or kept copies (the attention input)
            self.alive = max(self.alive, store.bytes_held)
            self.per_layer[layer] = store._packed[layer].nbytes + attention_input
            return
        if getattr(store, "run", None) is not None:  # held in the graphs' K/V pool (`service.engine.kv_pool`)
            layers = {i: store.sequence_kv(i) for i in store.held_layers}
        else:
            layers = getattr(store, "_sequence", None) or store._layers
        held = _nbytes(t for kv in layers.values() for t in kv)
        packed = _nbytes(layers[layer])
        self.alive = max(self.alive, held + attention_input)  # the concatenation is new memory
        self.per_layer[layer] = packed + attention_input

    @property
    def read(self) -> int:
        return sum(self.per_layer.values())


def measure(engine: Engine, prompts: list[list[int]], params: DecodeParams, method: Method) -> Measurement:
    """Decode once with ``method``'s store and time it (wall clock and process CPU time)."""
    store = method.make_store(engine)
    if store is None and method.cache_mode != "none":
        from service.engine.kv_store import FullPrecisionKVStore

        store = FullPrecisionKVStore()
    traffic = KVTraffic(store) if store is not None else None
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter(), time.process_time()
    report = engine.generate(prompts, params, kv_store=store)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    tokens = params.gen_length * len(prompts)
    nfe = max(r.nfe for r in report.rows)  # batched forwards: the longest row's count
    return Measurement(
        tokens / wall, tokens / cpu, sum(r.nfe for r in report.rows) / len(report.rows), wall / nfe,
        traffic.alive if traffic else 0, traffic.read if traffic else 0,
    )


def run_table(engine, prompts, methods, schedule, args, peak_bandwidth: float | None) -> None:
    """Measure ``methods`` (interleaved repeats, fastest counts) on one schedule and print the table."""
    results: dict[str, Measurement] = {}
    for _ in range(args.repeats):
        for method in methods:
            params = DecodeParams(cache_mode=method.cache_mode, ignore_eos=True, **schedule)
            results[method.name] = measure(engine, prompts, params, method).best(results.get(method.name))
    header = (
        f"  {'method':<24}{'tokens/s':>10}{'tokens/CPU-s':>14}{'NFE':>8}{'vs no cache':>13}{'(CPU)':>8}"
        f"{'time vs dual':>14}{'(CPU)':>8}{'KV alive MiB':>14}{'KV read MiB':>13}"
    )
    weights = _nbytes(engine.model.parameters())
    if peak_bandwidth:
        header += f"{'MiB/forward':>13}{'GB/s':>8}{'of peak':>9}"
    print(header)
    base = results.get(BASELINE, results[CACHE_BASELINE])  # without a no-cache row: ratios to the dual cache
    dual = results[CACHE_BASELINE]
    mib = 2**20
    for name, m in results.items():
        line = (
            f"  {name:<24}{m.tokens_per_s:>10.1f}{m.tokens_per_cpu_s:>14.1f}{m.nfe:>8.1f}"
            f"{m.tokens_per_s / base.tokens_per_s:>12.2f}x{m.tokens_per_cpu_s / base.tokens_per_cpu_s:>7.2f}x"
            f"{dual.tokens_per_s / m.tokens_per_s:>13.3f}x{dual.tokens_per_cpu_s / m.tokens_per_cpu_s:>7.3f}x"
            f"{m.kv_alive / mib:>14.2f}{m.kv_read / mib:>13.2f}"
        )
        if peak_bandwidth:
            per_forward = weights + m.kv_read
            achieved = per_forward / m.seconds_per_forward / 1e9
            line += f"{per_forward / mib:>13.1f}{achieved:>8.0f}{achieved / peak_bandwidth:>8.0%} "
        print(line)


def embedded_table(args, bits: tuple[int, ...]) -> None:
    """The embedded default model in-process (module doc): dual cache against its quantized rows."""
    from evaluation.embedded_task import BLOCK_LENGTH, GEN_LENGTH, load_split

    engine = Engine.load(None, dtype="float32", device=args.device)
    questions = load_split("test")[: args.embedded_questions]
    prompts = [engine.encode_prompt(q.prompt, chat=True) for q in questions]
    methods = [Method("dual cache", "dual"), *quantized_methods(bits)]
    if args.methods is not None:
        methods = [m for m in methods if m.name in args.wanted]
    c = engine.model.config
    print(
        f"\nembedded model ({c.num_layers} layers, d_model {c.width}, {c.num_heads} heads): {len(prompts)} held-out "
        f"test questions batched, threshold {args.threshold}, {GEN_LENGTH} tokens in blocks of {BLOCK_LENGTH}"
    )
    schedule = {"gen_length": GEN_LENGTH, "block_length": BLOCK_LENGTH, "threshold": args.threshold, "steps": None}
    engine.generate(prompts[:1], DecodeParams(cache_mode="dual", ignore_eos=True, **schedule))  # warm-up
    run_table(engine, prompts, methods, schedule, args, None)


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
        help=f"comma-separated method names to run (default: all; {CACHE_BASELINE!r} is always included, "
        f"{BASELINE!r} only when named or by default)",
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="decodes per method, interleaved across methods; the fastest counts"
    )
    parser.add_argument("--lm-head-scale", type=float, default=10.0, help="raises random-weight confidence")
    parser.add_argument("--bits", default=str(KV_BITS), help="comma-separated bit widths of the quantized rows")
    parser.add_argument("--schedules", choices=("both", "fixed", "threshold"), default="both")
    parser.add_argument(
        "--kv-attention", choices=("auto", "torch", "triton"), default="auto",
        help="later steps of quantized rows: auto = fused Triton kernel on CUDA, PyTorch elsewhere",
    )
    parser.add_argument("--embedded", action="store_true", help="also measure the embedded model (module doc)")
    parser.add_argument("--embedded-questions", type=int, default=8)
    parser.add_argument(
        "--peak-bandwidth", type=float, default=None, help="device peak memory bandwidth, GB/s (adds columns)"
    )
    args = parser.parse_args(argv)
    try:
        bits = tuple(int(b) for b in args.bits.split(","))
    except ValueError:
        parser.error(f"--bits takes comma-separated integers, got {args.bits!r}")
    if any(b not in (2, 4, 8) for b in bits):
        parser.error(f"--bits: each of 2, 4, 8, got {args.bits!r}")
    KV_ATTENTION["path"] = args.kv_attention
    all_methods = [*METHODS[:3], *quantized_methods(bits)]
    methods = all_methods
    args.wanted = None
    if args.methods is not None:
        wanted = {name.strip() for name in args.methods.split(",")} | {CACHE_BASELINE}
        unknown = wanted - {m.name for m in all_methods}
        if unknown:
            parser.error(f"unknown methods {sorted(unknown)}; legal: {', '.join(m.name for m in all_methods)}")
        methods = [m for m in all_methods if m.name in wanted]
        args.wanted = wanted

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
        f"fixed {args.steps_per_block} steps/block": {"threshold": None, "steps": args.steps_per_block * blocks},
        f"threshold {args.threshold}": {"threshold": args.threshold, "steps": None},
    }
    if args.schedules != "both":
        schedules = {k: v for k, v in schedules.items() if k.startswith(args.schedules)}
    c = engine.model.config
    print(
        f"random LLaDA-shaped model: d_model {c.width}, {c.num_layers} layers, {c.num_heads} heads, MLP {c.mlp_hidden}, "
        f"vocab {c.vocab_size}; prompt {args.prompt_length}, generated {args.gen_length}, block {args.block_length}, "
        f"batch {args.batch}; {args.dtype} on {args.device}, torch threads {torch.get_num_threads()}, "
        f"best of {args.repeats}; quantized later steps: {args.kv_attention}"
    )
    # Warm-up (allocator, kernels) outside the measurement.
    warm = DecodeParams(gen_length=args.block_length, block_length=args.block_length, cache_mode="dual", threshold=None,
                        steps=2, ignore_eos=True)
    engine.generate(prompts[:1], warm)
    for label, schedule in schedules.items():
        print(f"\n{label}")
        run_table(
            engine, prompts, methods, dict(gen_length=args.gen_length, block_length=args.block_length, **schedule),
            args, args.peak_bandwidth,
        )
    if args.embedded:
        embedded_table(args, bits)


if __name__ == "__main__":
    from machine import Run  # benchmarks/machine.py, beside this script

    with Run():
        main()
