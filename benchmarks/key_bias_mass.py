"""Does rounding inflate the quantized keys' softmax mass? The embedded model's attention mass on its reused keys,
exact against quantized, with and without the key-bias correction (issue 33; `service.quant.key_bias`).

For each of ``--questions`` held-out questions of the embedded task (the shipped ``test`` split, chat template):
the block-initial pass of the first block (prompt, then ``--gen-length`` masks; the active block is the first
``--block-length`` of them, dual cache: the prompt is the reused prefix, the masks after the block the reused
suffix). Per layer, the reused keys are written into a real quantized store (``--method``, ``--bits``) and read
back; for every active-block query and head:

* ``L`` = log of the summed ``exp(q.k / sqrt(d))`` over the reused keys, exact (``L_exact``), over the dequantized
  keys (``L_quant``), and with the correction's bias added (``L_corr``; and with the bias's sign flipped,
  ``L_flip``, the inflation the issue names taken as a deflation instead);
* the share of the softmax that the reused keys take beside the exact active block, exact and as each variant.

Printed: the mean of ``L_variant - L_exact`` (positive: the variant gives the reused keys more mass than the exact
keys), the mean absolute error of the reused share, and the mean correction ``-bias`` in nats; all over layers,
heads, queries and questions. Machine-independent (no timing).

Usage: ``python benchmarks/key_bias_mass.py [--questions 16] [--method kivi] [--bits 2] [--gen-length 64]
[--block-length 32]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: benchmarks/ is not a package
from evaluation.embedded_task import load_split
from service.engine import Engine
from service.engine.kv_store import Segments
from service.quant.config import KVQuantConfig
from service.quant.key_bias import key_score_bias, log_sinhc
from service.quant.store import make_kv_store


def capture(engine: Engine, ids: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the post-RoPE queries and keys ``[1, H, T, D]`` of one full forward over ``ids``."""
    got = {}

    def hook(layer, q, k_pre, k, v):
        got[layer] = (q, k, v)

    with torch.inference_mode():
        engine.model(torch.tensor([ids]), None, kv_hook=hook)
    return got


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--method", default="kivi", help="kivi (dllm_kvq and kvquant need a fitted artifact)")
    parser.add_argument("--bits", type=int, default=2)
    parser.add_argument("--gen-length", type=int, default=64)
    parser.add_argument("--block-length", type=int, default=32)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    engine = Engine.load(None, threads=1)
    spec = engine.spec
    mask = spec.mask_id
    sums = {"quant": 0.0, "corr": 0.0, "flip": 0.0, "share_quant": 0.0, "share_corr": 0.0, "share_flip": 0.0,
            "bias": 0.0, "exact_share": 0.0, "sinh": 0.0, "share_sinh": 0.0, "sinh_bias": 0.0}
    count = 0
    for question in load_split("test")[: args.questions]:
        prompt = engine.encode_prompt(question.prompt, chat=True)
        ids = prompt + [mask] * args.gen_length
        s, e, t = len(prompt), len(prompt) + args.block_length, len(ids)
        segments = Segments((0,), block_start=s, block_end=e, seq_len=t, cache_mode="dual")
        store = make_kv_store(KVQuantConfig(method=args.method, bits=args.bits), spec, attention="torch")
        reused = segments.reused_columns
        for layer, (q, k, v) in capture(engine, ids).items():
            store.write(layer, k, v, segments)
            k_hat = store.read(layer)[0].float()  # [1, H_kv, T_reused, D]
            steps = store.quantizer.key_steps(layer, store._packed[layer], store._layout)
            steps = store._layout.scatter(steps)  # [1, H_kv, T_reused, D]
            groups = q.shape[1] // k.shape[1]
            qa = q[:, :, s:e].float()  # [1, H, Tq, D] the active block's queries
            k_exact = k[:, :, reused].float().repeat_interleave(groups, 1)
            k_q = k_hat.repeat_interleave(groups, 1)
            k_block = k[:, :, s:e].float().repeat_interleave(groups, 1)
            scale = q.shape[-1] ** -0.5
            bias = key_score_bias(qa, steps)  # [1, H, Tq, T_reused]
            # The exact log of the sinh ratio, per (query, key, channel): [1, H, Tq, T_reused, D]
            x = qa[:, :, :, None, :] * steps.repeat_interleave(groups, 1)[:, :, None] * (scale / 2)
            exact_bias = -log_sinhc(x).sum(-1)
            exact = qa @ k_exact.transpose(-1, -2) * scale
            quant = qa @ k_q.transpose(-1, -2) * scale
            block = torch.logsumexp(qa @ k_block.transpose(-1, -2) * scale, -1)
            lse = {name: torch.logsumexp(x, -1) for name, x in
                   (("exact", exact), ("quant", quant), ("corr", quant + bias), ("flip", quant - bias),
                    ("sinh", quant + exact_bias))}
            share = {name: torch.sigmoid(x - block) for name, x in lse.items()}  # reused mass / all mass
            n = lse["exact"].numel()
            for name in ("quant", "corr", "flip", "sinh"):
                sums[name] += float((lse[name] - lse["exact"]).sum())
                sums[f"share_{name}"] += float((share[name] - share["exact"]).abs().sum())
            sums["bias"] += float(-bias.mean(-1).sum())
            sums["sinh_bias"] += float(-exact_bias.mean(-1).sum())
            sums["exact_share"] += float(share["exact"].sum())
            count += n
        store.clear()
    means = {key: value / count for key, value in sums.items()}
    print(f"embedded model, {args.questions} test questions, first block (dual cache), {args.method} {args.bits}-bit "
          f"keys; means over layers x heads x active-block queries ({count} in all)")
    print(f"reused share of the softmax, exact keys: {means['exact_share']:.4f}")
    print(f"{'variant':<30}{'L - L_exact (nats)':>20}{'|share - exact share|':>24}")
    for name, label in (("quant", "quantized"), ("corr", "quantized + correction"),
                        ("flip", "quantized - correction"), ("sinh", "quantized + exact log sinh")):
        print(f"{label:<30}{means[name]:>20.4f}{means[f'share_{name}']:>24.4f}")
    print(f"mean correction per reused key (nats): second-order {means['bias']:.4f}, exact log sinh "
          f"{means['sinh_bias']:.4f}")
    return means


if __name__ == "__main__":
    main()
