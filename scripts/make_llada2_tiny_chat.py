"""Write the tiny LLaDA2 checkpoint with a tokenizer and a chat template, the one the docs and tests serve as text.

Output (``--out``, default ``tests/data/llada2/llada2-tiny-chat``): ``config.json`` (llada2-tiny's), a link
``model.safetensors -> ../llada2-tiny/model.safetensors`` (the same weights: the link is how llada21-tiny shares
them), and a word-level transformers tokenizer (``w<id>`` for each of the 512 ids; EOS 497 ``<|endoftext|>``,
mask 500 ``<|mask|>``, end of turn 496 ``<|eot_id|>``, header tokens 498/499) with a LLaDA-style chat template
(`tests.support.fastdllm.add_word_tokenizer`). Nothing random: running it again writes the same files
(tests/engine/test_llada2_tiny_chat.py checks the shipped copy against a fresh one).

Usage: ``.venv/bin/python scripts/make_llada2_tiny_chat.py [--out DIR]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.fastdllm import add_word_tokenizer

WEIGHTS = ROOT / "tests" / "data" / "llada2" / "llada2-tiny"
#: The tokenizer's special tokens by id (the checkpoint's config says EOS 497 and mask 500).
SPECIAL = {496: "<|eot_id|>", 497: "<|endoftext|>", 498: "<|start_header_id|>", 499: "<|end_header_id|>",
           500: "<|mask|>"}
VOCAB_SIZE = 512


def write(out: Path) -> Path:
    """Write the checkpoint directory ``out`` (replaced if it exists); returns it."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    shutil.copyfile(WEIGHTS / "config.json", out / "config.json")
    os.symlink(os.path.relpath(WEIGHTS / "model.safetensors", out), out / "model.safetensors")
    add_word_tokenizer(out, SPECIAL, VOCAB_SIZE)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=WEIGHTS.parent / "llada2-tiny-chat")
    print(write(parser.parse_args().out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
