"""Write the embedded default model's card (``README.md``) from measured files only.

Inputs, all in the model directory: ``config.json``, ``training.json`` (``scripts/export_embedded.py``) and
``measurements.json`` (``scripts/validate_embedded.py --out``). Every figure in the card comes from them; the
only free text is ``--note`` (the assessment: whether the target was reached and what would reach it).

Usage: ``python scripts/embedded_card.py [--dir service/assets/embedded] [--note "..."]``
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from evaluation.embedded_task import BLOCK_LENGTH, GEN_LENGTH, LIST_LENGTH, OPS, SPLIT_SIZES, load_split

TARGET_EM = 0.80
SITTING_KEYS = ("lr", "batch", "ramp_tokens", "final_sum_weight", "zero_start", "zero_ramp_from", "zero_ramp_tokens")
# Sittings logged before an argument existed ran with the behaviour these values give (uniform digits, sum weight 3).
SITTING_ARGS_BEFORE_THEY_EXISTED = {"final_sum_weight": "3.0", "zero_start": "0.1", "zero_ramp_from": "0",
                                    "zero_ramp_tokens": "16000000"}


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def quantization_section(directory: Path) -> str:
    """The KV-quantization table as the evaluation matrix wrote it (``quantization.json``, `evaluation.card`), while
    it was measured on these weights; otherwise how to make it."""
    from evaluation.card import CARD_FILE, SECTION, card_section
    from service.engine.loading import read_checkpoint_tensors, weights_fingerprint

    path = directory / CARD_FILE
    if path.is_file():
        data = json.loads(path.read_text())
        if data["fingerprint"] == weights_fingerprint(read_checkpoint_tensors(directory)):
            return card_section(data)
        how = f"`{data['command']}`"
    else:
        how = "`.venv/bin/dllm-kvq evaluate matrix --models embedded --tasks digit_ledger --card service/assets/embedded ...`"
    return (f"{SECTION}\n\nThe KV-quantization table (methods x bits x cache modes, accuracy and agreement) comes from "
            f"the evaluation matrix and has not been measured on these weights yet: run {how}.\n")


def card(directory: Path, note: str) -> str:
    """The card's markdown text."""
    config = json.loads((directory / "config.json").read_text())
    train = json.loads((directory / "training.json").read_text())
    meas = json.loads((directory / "measurements.json").read_text())
    size_mb = (directory / "model.safetensors").stat().st_size / 1e6
    example = load_split("test")[0]
    modes = meas["modes"]
    rows = []
    for mode, m in modes.items():
        per_op = " / ".join(pct(m["exact_match_per_op"][op]) for op in OPS)
        rows.append(
            f"| {mode} | {pct(m['exact_match'])} | {per_op} | {m['mean_nfe']:.1f} | {m['latency_mean_s']:.3f} | "
            f"{m['latency_p90_s']:.3f} | {pct(m['token_agreement_with_none'])} |"
        )
    fixed = meas.get("slice")
    slice_line = (
        f"- Fixed slice (the first {fixed['questions']} {fixed['split']} questions, `slice` in `measurements.json`, "
        "what `tests/e2e` checks the served model against): exact match "
        + ", ".join(f"{mode} {pct(em)}" for mode, em in fixed["exact_match"].items()) + "."
        if fixed else "- Fixed slice: not measured (fewer questions than the slice)."
    )
    none_em = modes["none"]["exact_match"]
    gaps = {mode: none_em - modes[mode]["exact_match"] for mode in ("prefix", "dual")}
    target_line = (
        f"- Exact match with full recompute >= {pct(TARGET_EM)}: **{'met' if none_em >= TARGET_EM else 'not met'}** "
        f"({pct(none_em)}); prefix and dual within 5 points of it: "
        + ", ".join(f"{mode} {'yes' if gap <= 0.05 else 'no'} ({-100 * gap:+.1f} points)" for mode, gap in gaps.items())
    )
    confident = modes["none"].get("revealed_confident_share")
    sits = [{**SITTING_ARGS_BEFORE_THEY_EXISTED, **s} for s in train.get("sittings", [])]
    sitting_rows = "\n".join(
        f"| {s['from_tokens']:,} | " + " | ".join(str(s[k]) for k in SITTING_KEYS) + " |" for s in sits
    )
    commands = []
    for i, s in enumerate(sits):
        until = sits[i + 1]["from_tokens"] if i + 1 < len(sits) else train["tokens_seen"]
        flags = " ".join(f"--{k.replace('_', '-')} {s[k]}" for k in SITTING_KEYS)
        first = (f"--d-model {config['d_model']} --n-layers {config['n_layers']} --n-heads {config['n_heads']} "
                 f"--seed {train['seed']}" if i == 0 else "--resume")
        commands.append(f"python scripts/train_embedded.py --run-dir runs/embedded {first} {flags} --max-tokens {until}")
    train_commands = "\n".join(commands)
    hours = train["train_seconds"] / 3600
    return f"""# dllm-kvq embedded default model (digit ledger, LLaDA format)

A {train['parameters'] / 1e6:.2f}M-parameter masked diffusion language model in the LLaDA-8B-Instruct checkpoint
layout (`config.json` with LLaDA's keys, `model.safetensors` with `model.transformer.*` names, bf16,
{size_mb:.1f} MB), trained by this project (`scripts/train_embedded.py`) so that the server, the calibration job and
the evaluation matrix have a real, trained model with structured attention that runs on a CPU with no download.
It is loaded by the same code as LLaDA-8B: `Engine.load(None)`.

Architecture: d_model {config['d_model']}, {config['n_layers']} layers, {config['n_heads']} heads
(head_dim {config['d_model'] // config['n_heads']}), SiLU-gated MLP {config['mlp_hidden_size']}, RoPE theta
{config['rope_theta']:g}, vocabulary {config['vocab_size']} (byte-level BPE; any text round-trips). Special tokens in
LLaDA's roles: `<|mdm_mask|>` mask ({config['mask_token_id']}), `<|endoftext|>` EOS/pad ({config['eos_token_id']}),
`<|eot_id|>` end of turn, `<|startoftext|>` bos, `<|start_header_id|>`/`<|end_header_id|>`; LLaDA's chat template.

## Task

Digit ledger (`evaluation/embedded_task.py`): a list of {LIST_LENGTH} digits and an operation, answered with
{LIST_LENGTH} digits: `copy` (the list), `next` (each digit plus one, mod 10), `sum` (running total mod 10, which
needs the previous answer digit, so it is decoded left to right and later steps of a block reuse the cache).
The answer spans two blocks of {BLOCK_LENGTH} (decode with `gen_length={GEN_LENGTH}`, `block_length={BLOCK_LENGTH}`,
chat template on). Example (`{example.id}`, op `{example.op}`):

    prompt: {example.prompt}
    answer: {example.answer}

Scoring: exact match after removing all whitespace (lm-eval: `exact_match` with `regexes_to_ignore: ["\\\\s+"]`).
Held-out test split: {SPLIT_SIZES['test']} questions (`service/assets/embedded/task/test.jsonl`), validation
{SPLIT_SIZES['validation']}, training stream regenerated from its seed (`train_sample.jsonl`: the first
{SPLIT_SIZES['train_sample']}, the calibration corpus).

## Training run

LLaDA's SFT objective (response masked with probability t ~ U(0, 1), loss on masked positions weighted by 1/t,
prompt never masked, answer + `<|eot_id|>` + EOS padding to {GEN_LENGTH}), AdamW, bf16 autocast, one CPU thread.

| tokens seen | steps | training time | seed | hardware | torch |
|---|---|---|---|---|---|
| {train['tokens_seen']:,} | {train['steps']:,} | {hours:.2f} h | {train['seed']} | {train['hardware']} | {train['torch']} |

Sittings (from the run's log; each resumed the previous checkpoint with these arguments of `train_embedded.py`,
see "Reproduce"; the curriculum was changed between sittings as the run showed what the model needed):

| from tokens | lr | batch | ramp_tokens | final_sum_weight | zero_start | zero_ramp_from | zero_ramp_tokens |
|---|---|---|---|---|---|---|---|
{sitting_rows}

## Measured with the project's engine

`scripts/validate_embedded.py`: the {meas['questions']} held-out test questions, one at a time, threshold
{meas['threshold']}, greedy, unquantized cache, fp32 weights, one thread. Exact match per operation is
{' / '.join(OPS)}; latency is the wall time of one `Engine.generate` call; token agreement is with the
full-recompute output of the same question.

| cache mode | exact match | per op | mean NFE | latency mean (s) | latency p90 (s) | token agreement |
|---|---|---|---|---|---|---|
{chr(10).join(rows)}

- Load time of `Engine.load`: {meas['load_s']:.2f} s (checkpoint and tokenizer); the first call in a fresh process
  took {meas['load_first_in_process_s']:.2f} s, the difference is one-time lazy imports.
- Revealed tokens with top-1 probability >= {meas['threshold']} (full recompute):
  {pct(confident) if confident is not None else 'not measured'} of {modes['none'].get('revealed_tokens', 0):,}.
{slice_line}
{target_line}

{note}

{quantization_section(directory)}
## Reproduce

```bash
python scripts/build_embedded_tokenizer.py              # tokenizer (already shipped)
{train_commands}
python scripts/export_embedded.py --ckpt runs/embedded/ckpt-{train['tokens_seen']:012d}.pt
python scripts/validate_embedded.py --out service/assets/embedded/measurements.json
python scripts/embedded_card.py --note "..."
```
"""


def main() -> None:
    """CLI entry."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=ROOT / "service/assets/embedded")
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    (args.dir / "README.md").write_text(card(args.dir, args.note))


if __name__ == "__main__":
    main()
