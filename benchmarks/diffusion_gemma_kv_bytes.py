"""DiffusionGemma's committed K/V quantized (`service.quant.canvas`): bytes per token per layer kind, and how
closely the quantized cache's decoder follows the unquantized one, per method and bits.

1. **Admission at 26B-A4B's K/V shape** (no weights: the quantizers on probes, bf16): 30 layers, every sixth global
   (25 sliding with 4 KV heads of 256, window 1024; 5 global with 2 KV heads of 512, V from K), K groups of 32.
   Per layer kind, the bytes one committed token adds (`QuantizedKVStore.canvas_bytes_per_token`, what
   `DiffusionGemmaModel.kv_bytes_per_token` answers), the ratio to bf16, and one row's cache at 32k tokens
   (sliding layers capped at ``W - 1`` positions, ``W - 1 + 31`` when quantized).
2. **The tiny checkpoints** (tests/data/diffusion_gemma, float32, K groups of 8): per method and bits, the
   teacher-forced decoder agreement with the unquantized cache (`tests.support.dgemma_kv.decoder_agreement`: 4
   prompts of 20 tokens, 3 canvases each, the decoder's argmax on the same random canvases over both caches), beside
   a lossless store and a garbage cache (K/V replaced by noise of their scale); the whole-run token agreement of a
   renoising decode under the same seed (3 canvases, 4 steps: the runs part at the first changed draw, so this
   figure is low whatever the method); and the bytes per token per layer kind.

KIVI and dLLM-KVQ's bytes are counts (machine-independent); KVQuant's depend on the probe's outliers.

Usage: ``python benchmarks/diffusion_gemma_kv_bytes.py [--skip-tiny]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: benchmarks/ is not a package
from service.engine.agreement import token_agreement
from service.engine.loading import load_checkpoint
from service.engine.models.diffusion_gemma import GLOBAL, SLIDING
from service.engine.renoise import RenoiseParams, generate
from service.engine.spec import ModelSpec
from tests.support.dgemma_kv import METHODS, decoder_agreement, held_store, prompts_for, store_for

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "diffusion_gemma"
TINY = ("dgemma-tiny", "dgemma-tiny-w8", "dgemma-tiny-settling")
CONFIGS = ["none"] + [f"{m}-{b}" for m in METHODS for b in (4, 2)]


def a4b_geometry() -> tuple[ModelSpec, list[tuple[int, int, int | None]]]:
    """26B-A4B's K/V shape (module doc) as a spec (the sliding layers' geometry, as the loader reports it) and
    the per-layer geometry."""
    kinds = [SLIDING if (i + 1) % 6 else GLOBAL for i in range(30)]
    spec = ModelSpec(arch="diffusion_gemma", model_id="a4b-shape", fingerprint="0" * 64, num_layers=30,
                     num_heads=16, num_kv_heads=4, head_dim=256, vocab_size=262144, mask_id=262144, eos_ids=(1,),
                     pad_id=0, max_length=131072)
    return spec, [(4, 256, 1023) if kind == SLIDING else (2, 512, None) for kind in kinds]


def per_token_at_a4b() -> dict[str, dict[str, float]]:
    """Per config (``none``, ``method-bits``), per layer kind: bytes per committed token at 26B-A4B's K/V shape."""
    spec, geometry = a4b_geometry()
    layers = {kind: [i for i, g in enumerate(geometry) if (g[2] is None) == (kind == GLOBAL)]
              for kind in (SLIDING, GLOBAL)}
    out = {"none": {kind: float(sum(2 * geometry[i][0] * geometry[i][1] * 2 for i in layers[kind]))
                    for kind in layers}}
    for name in CONFIGS[1:]:
        method, bits = name.rsplit("-", 1)
        store = store_for(method, int(bits), spec, group=32)
        out[name] = {kind: store.canvas_bytes_per_token(geometry, layers[kind], torch.bfloat16) for kind in layers}
    return out


def admission() -> None:
    figures = per_token_at_a4b()
    bf16 = figures["none"]
    print("26B-A4B K/V shape, bf16, K groups of 32: bytes per committed token (all layers of the kind, K+V)")
    print(f"{'config':<12} {'sliding B/tok':>14} {'x bf16':>7} {'global B/tok':>13} {'x bf16':>7} "
          f"{'row @32k MiB':>13}")
    for name, per in figures.items():
        cap = 1023 if name == "none" else 1023 + 31  # the sliding layers' positions (a K group held whole)
        row = per[SLIDING] * min(cap, 32768) + per[GLOBAL] * 32768
        print(f"{name:<12} {per[SLIDING]:>14.1f} {per[SLIDING] / bf16[SLIDING]:>7.3f} {per[GLOBAL]:>13.1f} "
              f"{per[GLOBAL] / bf16[GLOBAL]:>7.3f} {row / 2**20:>13.2f}")


def tiny() -> None:
    torch.set_num_threads(1)
    loaded = {name: load_checkpoint(DATA / name) for name in TINY}
    prompts = prompts_for(4, 20, 498)
    print("\ntiny checkpoints, float32, K groups of 8: teacher-forced decoder agreement (positions), whole-run token "
          "agreement, bytes per token")
    print(f"{'config':<12} " + " ".join(f"{name[7:] or 'tiny':>12}" for name in TINY) +
          f" {'pooled':>7} {'whole runs':>11} {'slid B/tok':>11} {'glob B/tok':>11}")
    rows = [("lossless", lambda spec: held_store(spec), False), ("garbage", lambda spec: held_store(spec), True)]
    rows += [(name, lambda spec, name=name: store_for(name.rsplit("-", 1)[0], int(name.rsplit("-", 1)[1]), spec),
              False) for name in CONFIGS[1:]]
    for label, make, garbage in rows:
        same = total = 0
        cells = []
        for name in TINY:
            model, spec = loaded[name].model, loaded[name].spec
            a, n = decoder_agreement(model, lambda spec=spec, make=make: make(spec), prompts, garbage=garbage)
            same, total = same + a, total + n
            cells.append(f"{a}/{n}")
        whole = slid = glob = "-"
        if not garbage:
            whole = f"{_whole_runs(loaded, make):.3f}"
            model, spec = loaded["dgemma-tiny"].model, loaded["dgemma-tiny"].spec
            slid, glob = (f"{model.kv_bytes_per_token(kind, make(spec)):.1f}" for kind in (SLIDING, GLOBAL))
        print(f"{label:<12} " + " ".join(f"{c:>12}" for c in cells) +
              f" {same / total:>7.3f} {whole:>11} {slid:>11} {glob:>11}")
    model = loaded["dgemma-tiny"].model
    print(f"{'none':<12} {'':>38} {'':>7} {'':>11} {model.kv_bytes_per_token(SLIDING):>11.1f} "
          f"{model.kv_bytes_per_token(GLOBAL):>11.1f}")


def _whole_runs(loaded, make) -> float:
    """Mean token agreement (`service.engine.agreement.token_agreement`) of whole renoising runs (3 canvases, 4
    steps, seeds 0-3) on every tiny checkpoint with the unquantized run of the same seed."""
    scores = []
    for name in TINY:
        model, spec = loaded[name].model, loaded[name].spec
        params = RenoiseParams(max_new_tokens=3 * model.config.canvas_length, max_denoising_steps=4)
        for seed, prompt in enumerate(prompts_for(4, 20, 498, seed=1)):
            runs = [generate(model, [prompt], params, spec.eos_ids, 496, torch.Generator().manual_seed(seed),
                             mode="shared", kv_store=store)[0].generated_ids for store in (None, make(spec))]
            scores.append(token_agreement(runs[1], runs[0]))
    return sum(scores) / len(scores)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-tiny", action="store_true", help="print the admission table only")
    args = parser.parse_args(argv)
    admission()
    if not args.skip_tiny:
        tiny()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
