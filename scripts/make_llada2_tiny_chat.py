"""Write the tiny LLaDA2 checkpoint with a tokenizer and a chat template, the one the docs and tests serve as text.

Output (``--out``, default ``tests/data/llada2/llada2-tiny-chat``): ``config.json`` (llada2-tiny's), a link
``model.safetensors -> ../llada2-tiny/model.safetensors`` (the same weights: the link is how llada21-tiny shares
them), and a byte-level transformers tokenizer (:func:`add_byte_tokenizer`: ids 0-255 the 256 bytes, so any text
encodes and the grammar engine can read it, as structured output and tool calls need; ids 256-495 ``w<id>``,
decodable, never produced by encoding; EOS 497 ``<|endoftext|>``, mask 500 ``<|mask|>``, end of turn 496
``<|eot_id|>``, header tokens 498/499; 501-511 ``w<id>``) with a LLaDA-style chat template. Nothing random:
running it again writes the same files (tests/engine/test_llada2_tiny_chat.py checks the shipped copy against a
fresh one).

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

WEIGHTS = ROOT / "tests" / "data" / "llada2" / "llada2-tiny"
#: The tokenizer's special tokens by id (the checkpoint's config says EOS 497 and mask 500).
SPECIAL = {496: "<|eot_id|>", 497: "<|endoftext|>", 498: "<|start_header_id|>", 499: "<|end_header_id|>",
           500: "<|mask|>"}
VOCAB_SIZE = 512


#: The chat template (LLaDA's turn markers; the text between them is spelled in bytes).
TEMPLATE = (
    "{% for m in messages %}<|start_header_id|> {{ m['role'] }} <|end_header_id|> {{ m['content'] }} <|eot_id|> "
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|> assistant <|end_header_id|>{% endif %}"
)


def add_byte_tokenizer(directory: Path, special: dict[int, str], vocab_size: int) -> None:
    """Write a byte-level tokenizer of ``vocab_size`` ids into ``directory`` (module doc): a BPE model without
    merges over the 256 byte symbols at ids 0-255, ``special`` at their ids, ``w<id>`` at the others."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbols = pre_tokenizers.ByteLevel.alphabet()
    by_byte = sorted(symbols, key=lambda c: _byte_of(c))
    vocab = {special.get(i, by_byte[i] if i < 256 else f"w{i}"): i for i in range(vocab_size)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=TEMPLATE, eos_token=special[497])
    fast.add_special_tokens({"additional_special_tokens": sorted(special.values())})
    fast.save_pretrained(directory)


def _byte_of(symbol: str) -> int:
    """The byte that a byte-level symbol stands for (GPT-2's map: printable bytes are themselves, the others
    shifted to 256 and up, in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    code = ord(symbol)
    return code if code in printable else others[code - 256]


def write(out: Path) -> Path:
    """Write the checkpoint directory ``out`` (replaced if it exists); returns it."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    shutil.copyfile(WEIGHTS / "config.json", out / "config.json")
    os.symlink(os.path.relpath(WEIGHTS / "model.safetensors", out), out / "model.safetensors")
    add_byte_tokenizer(out, SPECIAL, VOCAB_SIZE)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=WEIGHTS.parent / "llada2-tiny-chat")
    print(write(parser.parse_args().out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
