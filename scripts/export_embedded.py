"""Export a training checkpoint of the embedded model to the LLaDA on-disk layout the engine loads.

Writes into ``--out`` (default ``service/assets/embedded``, the embedded default): ``config.json`` (LLaDA-8B's
keys, SPEC 1.1, plus ``torch_dtype``), ``model.safetensors`` (``model.transformer.*`` names, SPEC 1.2, in
bfloat16, metadata ``format: pt``) and ``generation_config.json`` (bos/eos/pad/mask ids and the decoding
settings the model was trained for). The tokenizer files (``scripts/build_embedded_tokenizer.py``) are
those in ``service/assets/embedded`` (copied when ``--out`` is elsewhere); the model card is ``scripts/embedded_card.py``'s
job. Also writes ``training.json`` beside them: the run's facts (tokens seen, seconds, seed, parameters, the
checkpoint's last validation result), which the model card quotes.

Usage: ``python scripts/export_embedded.py [--ckpt runs/embedded/best.pt] [--out service/assets/embedded]``
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from evaluation.embedded_task import BLOCK_LENGTH, GEN_LENGTH

THRESHOLD = 0.9
TOKENIZER_DIR = ROOT / "service/assets/embedded"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def cpu_name() -> str:
    """The CPU model string from /proc/cpuinfo (or the platform's processor name)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


CURRICULUM_ARGS = ("lr", "batch", "ramp_tokens", "final_sum_weight", "zero_start", "zero_ramp_from",
                   "zero_ramp_tokens")


def sittings(log: Path, until_tokens: int) -> list[dict]:
    """The run's sittings from its ``log.jsonl`` ``start`` events: tokens seen at the start and the curriculum
    arguments, up to the exported checkpoint (a sitting that resumed an earlier checkpoint replaces the tail)."""
    out: list[dict] = []
    if not log.is_file():
        return out
    for line in log.read_text().splitlines():
        event = json.loads(line)
        if event.get("event") != "start" or event["tokens"] > until_tokens:
            continue
        while out and out[-1]["from_tokens"] >= event["tokens"]:
            out.pop()
        out.append({"from_tokens": event["tokens"],
                    **{k: event["args"][k] for k in CURRICULUM_ARGS if k in event["args"]}})
    return out


def export(ckpt: Path, out: Path) -> dict:
    """Write the checkpoint ``ckpt`` (a ``train_embedded.py`` state) as a LLaDA directory ``out``.

    Returns the run facts written to ``training.json``.

    Raises:
        KeyError: the state has a tensor outside the ``model.transformer.*`` names.
    """
    state = torch.load(ckpt, weights_only=False, map_location="cpu")
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in state["model"].items()}
    bad = [k for k in tensors if not k.startswith("model.transformer.")]
    if bad:
        raise KeyError(f"unexpected tensor names {bad[:3]}; expected model.transformer.*")
    out.mkdir(parents=True, exist_ok=True)
    if out.resolve() != TOKENIZER_DIR.resolve():
        for name in TOKENIZER_FILES:
            shutil.copyfile(TOKENIZER_DIR / name, out / name)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # package data must be readable by every user of an install
    config = dict(state["config"], torch_dtype="bfloat16")
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tok = AutoTokenizer.from_pretrained(out, trust_remote_code=False)
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    generation = {
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": [tok.eos_token_id, eot],
        "pad_token_id": tok.pad_token_id,
        "mask_token_id": tok.mask_token_id,
        "max_new_tokens": GEN_LENGTH,
        "block_length": BLOCK_LENGTH,
        "threshold": THRESHOLD,
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    facts = {
        "sittings": sittings(ckpt.parent / "log.jsonl", state["tokens"]),
        "checkpoint": ckpt.name,
        "tokens_seen": state["tokens"],
        "steps": state["step"],
        "train_seconds": round(state["elapsed_s"]),
        "seed": state["seed"],
        "parameters": state["params"],
        "last_validation": state.get("val"),
        "hardware": f"{cpu_name()}, 1 torch thread, bf16 autocast",
        "torch": torch.__version__,
    }
    (out / "training.json").write_text(json.dumps(facts, indent=2) + "\n")
    return facts


def main() -> None:
    """CLI entry."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", type=Path, default=ROOT / "runs/embedded/best.pt")
    ap.add_argument("--out", type=Path, default=ROOT / "service/assets/embedded")
    args = ap.parse_args()
    print(json.dumps(export(args.ckpt, args.out), indent=2))


if __name__ == "__main__":
    main()
