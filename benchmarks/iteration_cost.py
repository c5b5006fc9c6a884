"""What one iteration of the running batch costs, in machine-independent counts (issue 21), with a projected H200
time against the roofline.

A GPU in eager mode pays for every dispatched tensor operation (a kernel launch, ~5 us of host time) and for every
host read of device data (a sync: the host waits for the device's queue to drain); a well-built runtime reads the
weights once per iteration for every row in flight and does host work that does not grow with the rows. This
benchmark counts, for one **later-step iteration** and one **block-initial iteration** of a running batch of
``rows`` requests (one row each):

* **tensor ops**: every aten operation dispatched (`torch.utils._python_dispatch.TorchDispatchMode`), views
  included (the issue's definition);
* **host syncs**: aten operations whose result the host must read (``_local_scalar_dense``: ``.item()``,
  ``bool()``, ``int()``; ``nonzero``, ``equal``, ``masked_select``, ``unique``, ``repeat_interleave`` without an
  output size) plus calls of ``Tensor.tolist`` and ``Tensor.numpy`` (which read without dispatching);
* **forwards**: calls of the model's ``forward``; **rows/fwd**: the most rows in one of them;
* **bytes read** at LLaDA-8B's real size (bf16 weights ``W``, 16.0 GB): ``W x forwards`` plus the reused K/V of
  every row at every layer (full precision: ``2 x 32 x 32 x 128 x 2`` bytes per token; 4-bit stores at an assumed
  4.6 effective bits: KIVI's K statistics per 32 tokens and V per 128 channels);
* **CPU ms/row** (CPU runs): this process's CPU time of one more later-step iteration, uncounted, per request;
  with ``X`` and ``X+kbc`` both in ``--methods`` a last line gives the corrected over uncorrected ratios of ops and
  of this time, from the one run;
* **projected H200 time** = ``max(ops x LAUNCH_US, bytes / PEAK) + syncs x SYNC_US`` (launch-bound host or
  bandwidth-bound device, whichever is slower, plus a drained queue per sync), against the **roofline**
  ``(W + K/V) / PEAK``: one weight read and each row's K/V read once.

The model has LLaDA-8B's layer count and head layout (32 layers, 32 heads, MHA) with the width shrunk to 128 (head
dim 4, MLP 384, vocabulary 4096) so that the arithmetic is small; counts do not depend on the width. Each request:
a 200-token prompt (``--mixed-lengths``: prompts of 100 to 200 tokens, different per row, as in real serving),
256 generated, block 32, 8 fixed steps per block (``steps=64``, so every row takes part in
every step), ``ignore_eos``. The KV stores: the engine's full precision (``none``) and `service.quant` at 4 bits
(KIVI, dLLM-KVQ with p = 1 on every layer, KVQuant), made as in `benchmarks/decode_speed.py`; a method written
``kivi+kbc`` (any quantizing method) has the key-bias correction on (`service.quant.key_bias`).

Usage: ``python benchmarks/iteration_cost.py [--rows 1,8,32,64] [--caches dual,prefix]
[--methods none,kivi,dllm_kvq,kvquant] [--paths torch,triton] [--layers 32] [--prompt-length 200] [--mixed-lengths] [--gen-length 256] [--block-length 32]
[--slack inf] [--no-time] [--width 128] [--vocab 4096] [--device cpu] [--dtype float32] [--cpu-chunks]``. On CUDA
(``--device cuda``, e.g. ``--width 4096 --vocab 126464 --dtype bfloat16``: LLaDA-8B itself) a column adds the
measured time of a later-step iteration (a third iteration, not counted, between two syncs). ``--slack`` is the
plan's ``padding_slack`` (`service.runtime.scheduler.plan_forwards`; ``inf`` merges whenever the token budget
allows, as a launch-bound GPU would). ``--paths``: each quantized method's later steps on the PyTorch path
(``torch``, the CPU's default) and on the fused kernel's (``triton``, CUDA's default; on a CPU forced, the kernel
replaced by a stand-in that counts as one op per launch, :class:`StandInKernel`), a row each (column ``path``).
KVQuant's nearest-code search runs in chunks whose size depends on the device (`service.quant.nuq.NEAREST_CHUNK`:
small on a CPU, for its cache; one chunk elsewhere); on a CPU the counts are of the accelerator's chunks unless
``--cpu-chunks`` (the codes are the same either way).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: benchmarks/ is not a package
from benchmarks.decode_speed import KV_ATTENTION, PRESETS, quantized_store, random_engine
from service.engine import Engine
from service.engine.params import DecodeParams
from service.quant import nuq
from service.runtime.scheduler import forward_plan

#: Host cost of one eager kernel launch on a GPU (seconds), and the extra stall of one host read (a drained queue).
LAUNCH_S = 5e-6
SYNC_S = 20e-6
#: H200 HBM bandwidth (bytes/s).
PEAK_BYTES_PER_S = 4.8e12
#: LLaDA-8B at bf16: parameters (golden SPEC 1.1 geometry) and full-precision K/V bytes per token (all layers).
LLADA_8B = PRESETS["8b"]
ASSUMED_BITS = {"none": 16.0, "kivi": 4.6, "dllm_kvq": 4.6, "kvquant": 4.6}

#: aten operations whose result the host reads (a sync on a GPU).
SYNC_OPS = {"_local_scalar_dense", "nonzero", "equal", "masked_select", "unique", "_unique", "_unique2",
            "unique_consecutive", "unique_dim", "is_nonzero"}


def llada_8b_bytes() -> tuple[int, int]:
    """(weight bytes, full-precision K/V bytes per token over all layers) of LLaDA-8B in bf16."""
    p = LLADA_8B
    c, m, v, layers = p["width"], p["mlp_hidden"], p["vocab_size"], p["num_layers"]
    params = layers * (4 * c * c + 3 * c * m + 2 * c) + 2 * v * c + c
    return 2 * params, 2 * layers * c * 2  # K and V: heads x head_dim = width


class Counter(TorchDispatchMode):
    """Counts dispatched aten operations and host syncs (module doc) while active; ``Tensor.tolist`` and
    ``Tensor.numpy`` are wrapped for the duration, since they read without dispatching."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.syncs = 0
        self._saved: dict[str, object] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        name = func.__name__.split(".")[0]
        if name in SYNC_OPS or (name == "repeat_interleave" and "output_size" not in (kwargs or {})
                                and isinstance(args[0], torch.Tensor) and len(args) == 1):
            self.syncs += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        for name in ("tolist", "numpy"):
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def wrapped(tensor, *a, _original=original, **kw):
                self.syncs += 1
                return _original(tensor, *a, **kw)

            setattr(torch.Tensor, name, wrapped)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)


class StandInKernel:
    """The fused attention kernel's stand-in on CPU tensors (``--paths triton``): each launch zeroes its output
    (one dispatched op, where a GPU launches one kernel) and runs nothing, so the counts are the host's work around
    the kernel, as `benchmarks/fused_rows_cost.py` counts them (its values are tested in
    tests/quant/test_fused_attention.py and test_fused_rows.py). Triton's interpreter (``TRITON_INTERPRET=1``,
    set here) lets CPU tensors through the kernel's checks."""

    def __enter__(self):
        os.environ.setdefault("TRITON_INTERPRET", "1")
        import triton

        from service.quant.kernels import attention

        triton.knobs.runtime.interpret = True
        self._module, self._kernel = attention, attention._fused_reuse_attention
        attention._fused_reuse_attention = self
        return self

    def __getitem__(self, grid):
        return lambda out, *args, **kwargs: out.zero_()

    def __exit__(self, *exc):
        self._module._fused_reuse_attention = self._kernel


class ForwardCount:
    """Counts the model's forward calls and the most rows one of them held (wraps ``model.forward``)."""

    def __init__(self, model) -> None:
        self.model, self.calls, self.most_rows = model, 0, 0
        self._forward = model.forward

    def __enter__(self):
        def counted(input_ids, *args, **kwargs):
            self.calls += 1
            self.most_rows = max(self.most_rows, int(input_ids.shape[0]))
            return self._forward(input_ids, *args, **kwargs)

        self.model.forward = counted
        return self

    def __exit__(self, *exc):
        del self.model.forward


@dataclass(frozen=True)
class IterationCost:
    """Counts of one iteration (module doc)."""

    ops: int
    syncs: int
    forwards: int
    most_rows: int


def _batch(engine: Engine):
    """The engine's running batch, planned as the server plans (`service.runtime.scheduler.plan_forwards`) with
    ``--slack`` as its ``padding_slack``."""
    return engine.batch(forward_plan(padding_slack=ARGS["slack"]))


ARGS = {"slack": float("inf")}


def prompt_lengths(rows: int, prompt_length: int, mixed: bool) -> list[int]:
    """Each request's prompt length: all ``prompt_length``, or with ``mixed`` spread over
    ``[prompt_length / 2, prompt_length]`` (row ``i``: ``prompt_length - (13 i mod (prompt_length / 2 + 1))``),
    as requests of a real running batch differ."""
    if not mixed:
        return [prompt_length] * rows
    return [prompt_length - (13 * i) % (prompt_length // 2 + 1) for i in range(rows)]


def measure(engine: Engine, rows: int, params: DecodeParams, method: str, prompt_length: int, mixed: bool = False
            ) -> tuple[IterationCost, IterationCost, float]:
    """(block-initial iteration, later-step iteration, measured seconds of a later step) of ``rows`` requests
    that joined together (prompts of :func:`prompt_lengths`); the seconds of a third iteration, uncounted: on
    CUDA wall time between two syncs, on CPU this process's CPU time."""
    gen = torch.Generator().manual_seed(rows)
    vocab = engine.spec.vocab_size
    batch = _batch(engine)
    for length in prompt_lengths(rows, prompt_length, mixed):
        prompt = torch.randint(3, vocab - 1, (length,), generator=gen).tolist()
        base, _, corrected = method.partition("+")
        store = None if method == "none" else quantized_store(base, keep=False, key_bias=corrected == "kbc")(engine)
        batch.join(engine.cohort([prompt], params, None, store))
    costs = []
    with torch.inference_mode():
        for _ in range(2):
            with ForwardCount(engine.model) as forwards, Counter() as counter:
                batch.step()
            costs.append(IterationCost(counter.ops, counter.syncs, forwards.calls, forwards.most_rows))
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
            start = time.perf_counter()
            batch.step()
            torch.cuda.synchronize(engine.device)
            seconds = time.perf_counter() - start
        else:  # this process's CPU time (one thread: what an idle machine would show, whatever the load)
            start = time.process_time()
            batch.step()
            seconds = time.process_time() - start
        for cohort in list(batch.cohorts):
            batch.leave(cohort)
    return costs[0], costs[1], seconds


def projected(cost: IterationCost, rows: int, method: str, reused: int) -> tuple[float, float, float]:
    """(bytes read, projected seconds, roofline seconds) of an iteration at LLaDA-8B's size (module doc)."""
    weights, kv_per_token = llada_8b_bytes()
    kv = rows * reused * kv_per_token * ASSUMED_BITS[method.partition("+")[0]] / 16.0
    read = weights * cost.forwards + kv
    seconds = max(cost.ops * LAUNCH_S, read / PEAK_BYTES_PER_S) + cost.syncs * SYNC_S
    return read, seconds, (weights + kv) / PEAK_BYTES_PER_S


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,32,64")
    parser.add_argument("--caches", default="dual,prefix")
    parser.add_argument("--methods", default="none,kivi,dllm_kvq,kvquant")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--prompt-length", type=int, default=200)
    parser.add_argument("--mixed-lengths", action="store_true", help="prompts of different lengths per row, "
                        "spread over [prompt length / 2, prompt length] (see prompt_lengths)")
    parser.add_argument("--gen-length", type=int, default=256)
    parser.add_argument("--block-length", type=int, default=32)
    parser.add_argument("--steps-per-block", type=int, default=8)
    parser.add_argument("--slack", type=float, default=float("inf"))
    parser.add_argument("--no-time", action="store_true", help="counts only (no projected times)")
    parser.add_argument("--width", type=int, default=128, help="model width (LLaDA-8B: 4096; counts do not depend "
                        "on it)")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--device", default="cpu", help="on cuda a measured later-step time is added")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--paths", default="torch,triton", help="later steps of the quantized stores: torch (the "
                        "PyTorch path, CPU's default) and/or triton (the fused kernel's path, CUDA's default; on a "
                        "CPU forced, with the kernel's stand-in, StandInKernel)")
    parser.add_argument("--cpu-chunks", action="store_true", help="on a CPU, count KVQuant's nearest-code search "
                        "in the CPU's cache-sized chunks (service.quant.nuq.NEAREST_CHUNK) instead of the "
                        "accelerator's one chunk, which is what the projection is of")
    args = parser.parse_args(argv)
    if args.device == "cpu" and not args.cpu_chunks:  # count the launches the projected device makes
        nuq.NEAREST_CHUNK["cpu"] = nuq._NEAREST_CHUNK_ELSEWHERE
    ARGS["slack"] = args.slack
    torch.set_num_threads(1)
    PRESETS["8b-narrow"] = {"width": args.width, "num_layers": args.layers, "num_heads": 32,
                            "mlp_hidden": 3 * args.width, "vocab_size": args.vocab}
    engine = random_engine("8b-narrow", getattr(torch, args.dtype), args.device, 10.0)
    blocks = args.gen_length // args.block_length
    reused = args.prompt_length + args.gen_length - args.block_length
    print(f"iteration cost: LLaDA-8B layout ({args.layers} layers, 32 heads x head dim {args.width // 32}, width "
          f"{args.width}, MLP {3 * args.width}, vocabulary {args.vocab}; {args.dtype} on {args.device}), prompt "
          f"{args.prompt_length}{' (mixed: half to whole, per row)' if args.mixed_lengths else ''}, "
          f"{args.gen_length} generated, block "
          f"{args.block_length}, {args.steps_per_block} steps per block; projected at LLaDA-8B bf16 on an H200: "
          f"{LAUNCH_S * 1e6:.0f} us per op, {SYNC_S * 1e6:.0f} us per sync, {PEAK_BYTES_PER_S / 1e12:.1f} TB/s")
    header = (f"{'cache':<7}{'KV':<13}{'path':<7}{'rows':>5} | {'later: ops':>11}{'ops/row':>8}{'syncs':>6}{'fwd':>4}"
              f"{'rows/fwd':>9} | {'initial: ops':>13}{'syncs':>6}{'fwd':>4}")
    if not args.no_time:
        header += f" | {'later GB':>9}{'proj ms':>8}{'roofline':>9}{'x':>7}"
    header += f" | {'measured ms':>11}" if engine.device.type == "cuda" else f" | {'CPU ms/row':>10}"
    print(header)
    results = []
    for cache in args.caches.split(","):
        params = DecodeParams(cache_mode=cache, gen_length=args.gen_length, block_length=args.block_length,
                              threshold=None, steps=args.steps_per_block * blocks, ignore_eos=True)
        for method, path in ((m, p) for m in args.methods.split(",")
                             for p in (["-"] if m == "none" else args.paths.split(","))):
            for rows in (int(r) for r in args.rows.split(",")):
                KV_ATTENTION["path"] = "auto" if path == "-" else path
                with StandInKernel() if path == "triton" and engine.device.type != "cuda" else contextlib.nullcontext():
                    initial, later, measured_s = measure(engine, rows, params, method, args.prompt_length,
                                                         args.mixed_lengths)
                line = (f"{cache:<7}{method:<13}{path:<7}{rows:>5} | {later.ops:>11,}{later.ops // rows:>8,}"
                        f"{later.syncs:>6}{later.forwards:>4}{later.most_rows:>9} | {initial.ops:>13,}"
                        f"{initial.syncs:>6}{initial.forwards:>4}")
                row = {"cache": cache, "method": method, "path": path, "rows": rows, "later": later,
                       "initial": initial}
                if not args.no_time:
                    read, seconds, roof = projected(later, rows, method, reused)
                    line += f" | {read / 1e9:>9.1f}{seconds * 1e3:>8.1f}{roof * 1e3:>9.1f}{seconds / roof:>6.1f}x"
                    row.update(read=read, projected=seconds, roofline=roof)
                if engine.device.type == "cuda":
                    line += f" | {measured_s * 1e3:>11.1f}"
                    row["measured"] = measured_s
                else:
                    line += f" | {measured_s * 1e3 / rows:>10.2f}"
                    row["cpu"] = measured_s
                print(line, flush=True)
                results.append(row)
    _corrected_ratios(results)
    return results


def _corrected_ratios(results: list[dict]) -> None:
    """For each ``X+kbc`` row measured beside its ``X`` row (same cache and rows): the later step's ops and its
    CPU time (or CUDA time) per request, corrected over uncorrected, from this one run."""
    plain = {(r["cache"], r["method"], r["path"], r["rows"]): r for r in results}
    for r in results:
        base = plain.get((r["cache"], r["method"].removesuffix("+kbc"), r["path"], r["rows"]))
        if not r["method"].endswith("+kbc") or base is None:
            continue
        seconds = "measured" if "measured" in r else "cpu"
        print(f"key-bias correction, {r['cache']} {r['method']} ({r['path']}) at {r['rows']} rows: later-step ops "
              f"{base['later'].ops:,} -> {r['later'].ops:,} ({r['later'].ops / base['later'].ops:.3f}x), "
              f"{'CUDA' if seconds == 'measured' else 'CPU'} time per request {r[seconds] / base[seconds]:.2f}x")


if __name__ == "__main__":
    from machine import Run  # benchmarks/machine.py, beside this script

    with Run():
        main()
