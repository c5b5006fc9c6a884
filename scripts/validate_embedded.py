"""Measure the embedded default model with the project's engine: what its model card reports.

For each cache mode (none = full recompute, prefix, dual) the held-out test split is decoded one question at a
time with ``Engine.generate`` (threshold 0.9, ``GEN_LENGTH`` positions in blocks of ``BLOCK_LENGTH``, greedy,
unquantized cache) and scored with ``evaluation.embedded_task.score``. Reported per mode: exact match (overall and
per operation, and whether each question was answered right, in split order), mean NFE, per-question latency (mean and p50/p90 wall seconds of ``generate``), token agreement
with full recompute; and once: the load time of ``Engine.load`` (first call in the process, which includes lazy imports, and a
second call) and, in full recompute, the share of revealed
tokens whose top-1 probability was at least the threshold (read from the logits of each forward call through a
forward hook on the model, so it is exactly what the decoder saw); and the exact match per mode on the fixed slice
of the first ``SLICE`` (32) test questions, the figure the end-to-end test (``tests/e2e``) checks the
served model against.

Usage: ``python scripts/validate_embedded.py [--model DIR] [--split test] [--limit N] [--out FILE.json]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from evaluation.embedded_task import BLOCK_LENGTH, GEN_LENGTH, OPS, load_split, score
from service.engine import Engine
from service.engine.agreement import token_agreement
from service.engine.params import DecodeParams

THRESHOLD = 0.9
MODES = ("none", "prefix", "dual")
#: The fixed held-out slice the end-to-end test scores through the server (the first questions of the test split,
#: lm-eval's ``--limit`` order): its exact match per mode is recorded under ``slice``.
SLICE = 32


class RevealConfidence:
    """Forward hook that records, per call of a full-recompute decode of one row, the window's logits and input.

    After the decode, ``confidences(final_ids)`` gives the top-1 probability of every revealed token at the call
    that revealed it (a position revealed at call k is masked in call k's input and not in call k+1's, or in the
    final output for the last call).
    """

    def __init__(self, mask_id: int):
        self.mask_id = mask_id
        self.calls: list[tuple[torch.Tensor, torch.Tensor, int]] = []

    def __call__(self, module, args, kwargs, output) -> None:
        ids = args[0] if args else kwargs["input_ids"]
        # The columns whose logits the call computed: per row (``logits_at``, continuous batching), a range, or all.
        if kwargs.get("logits_at") is not None:
            cols = kwargs["logits_at"][0]
        else:
            cols = torch.arange(*(kwargs.get("logits_range") or (0, ids.shape[1])))
        self.calls.append((ids[0].clone(), output[0].float(), cols))

    def confidences(self, final_ids: torch.Tensor) -> list[float]:
        out = []
        for k, (ids, logits, cols) in enumerate(self.calls):
            after = self.calls[k + 1][0] if k + 1 < len(self.calls) else final_ids
            revealed = ((ids == self.mask_id) & (after != self.mask_id)).nonzero()[:, 0]
            rows = (cols[None, :] == revealed[:, None]).int().argmax(-1)
            probs = logits.softmax(-1)
            out += probs[rows].max(-1).values.tolist()
        self.calls.clear()
        return out


def measure(model: str | None, split: str, limit: int | None, modes: tuple[str, ...] = MODES) -> dict:
    """Run the measurements (see the module docstring) and return them as a JSON-ready dict."""
    # The first load in a process also pays for the lazy imports (transformers' tokenizer machinery); the second
    # is the checkpoint itself (config, safetensors, fingerprint, tokenizer files).
    t0 = time.perf_counter()
    Engine.load(model, threads=1)
    t1 = time.perf_counter()
    eng = Engine.load(model, threads=1)
    load_first_s, load_s = t1 - t0, time.perf_counter() - t1
    questions = load_split(split)[:limit]
    prompts = [eng.encode_prompt(q.prompt, chat=True) for q in questions]
    results: dict = {"model": model or "embedded", "split": split, "questions": len(questions), "load_s": load_s,
                     "load_first_in_process_s": load_first_s,
                     "threshold": THRESHOLD, "gen_length": GEN_LENGTH, "block_length": BLOCK_LENGTH, "modes": {}}
    reference: list[list[int]] = []
    for mode in modes:
        params = DecodeParams(gen_length=GEN_LENGTH, block_length=BLOCK_LENGTH, cache_mode=mode,
                              threshold=THRESHOLD)
        hook = RevealConfidence(eng.spec.mask_id) if mode == "none" else None
        handle = eng.model.register_forward_hook(hook, with_kwargs=True) if hook else None
        hits, by_op, latencies, nfes, outputs, confs = 0, {op: [0, 0] for op in OPS}, [], [], [], []
        correct: list[bool] = []
        for q, ids in zip(questions, prompts):
            t = time.perf_counter()
            report = eng.generate([ids], params)
            latencies.append(time.perf_counter() - t)
            row = report.rows[0]
            outputs.append(row.generated_ids)
            nfes.append(row.nfe)
            if hook:
                final = torch.tensor(ids + row.generated_ids + [eng.spec.mask_id] * (GEN_LENGTH - len(row.generated_ids)))
                confs += hook.confidences(final)
            ok = score(eng.decode_text(row.generated_ids), q.answer)
            correct.append(bool(ok))
            hits += ok
            by_op[q.op][0] += ok
            by_op[q.op][1] += 1
        if handle:
            handle.remove()
        if mode == "none":
            reference = outputs
        lat = sorted(latencies)
        results["modes"][mode] = {
            "exact_match": hits / len(questions),
            "correct": correct,
            "exact_match_per_op": {op: h / max(n, 1) for op, (h, n) in by_op.items()},
            "mean_nfe": statistics.mean(nfes),
            "generated_tokens": sum(len(o) for o in outputs),
            "latency_mean_s": statistics.mean(lat),
            "latency_p50_s": lat[len(lat) // 2],
            "latency_p90_s": lat[int(0.9 * (len(lat) - 1))],
        }
        if reference:
            results["modes"][mode]["token_agreement_with_none"] = statistics.mean(
                token_agreement(o, r) for o, r in zip(outputs, reference))
        if confs:
            results["modes"][mode]["revealed_confident_share"] = sum(c >= THRESHOLD for c in confs) / len(confs)
            results["modes"][mode]["revealed_tokens"] = len(confs)
        print(json.dumps({mode: results["modes"][mode]}), flush=True)
    if len(questions) >= SLICE:
        results["slice"] = {"split": split, "questions": SLICE, "ids": [q.id for q in questions[:SLICE]],
                            "exact_match": {mode: sum(m["correct"][:SLICE]) / SLICE
                                            for mode, m in results["modes"].items()}}
    return results


def main() -> None:
    """CLI entry."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the embedded default)")
    ap.add_argument("--split", default="test", choices=["test", "validation"])
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="none first: the others are compared with it")
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = measure(args.model, args.split, args.limit, tuple(args.modes))
    text = json.dumps(results, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
