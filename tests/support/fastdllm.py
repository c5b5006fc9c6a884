"""Tiny Fast-dLLM checkpoints and goldens (tests/data/fastdllm), and a tokenizer to give them text."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "data" / "fastdllm"
CKPT = {"llada": DATA / "ckpt" / "llada-tiny", "dream": DATA / "ckpt" / "dream-tiny"}
REPO_ROOT = DATA.parents[2]


def golden(name: str) -> dict:
    """A trimmed golden file of tests/data/fastdllm, parsed."""
    return json.loads((DATA / name).read_text())


def four_prompts(arch: str) -> list[list[int]]:
    """Four golden prompts of different lengths (5, 17, 40, 9 tokens) for batch tests."""
    base = golden(f"{arch}_generate.json")["runs"]
    lengths = sorted({len(run["prompt_ids"]) for run in base})  # 5, 17, 40
    by_length = {len(run["prompt_ids"]): run["prompt_ids"] for run in base}
    prompts = [by_length[n] for n in lengths]
    prompts.append(by_length[17][3:12])  # a fourth length: 9
    return prompts


def add_word_tokenizer(directory: Path, special: dict[int, str], vocab_size: int) -> None:
    """Give a copied tiny checkpoint a real transformers tokenizer: word-level, ``w<id>`` for each id, the given
    special tokens, and a LLaDA-style chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {special.get(i, f"w{i}"): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    template = (
        "{% for m in messages %}<|start_header_id|> {{ m['role'] }} <|end_header_id|> {{ m['content'] }} <|eot_id|> "
        "{% endfor %}{% if add_generation_prompt %}<|start_header_id|> assistant <|end_header_id|>{% endif %}"
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template)
    fast.add_special_tokens({"additional_special_tokens": sorted(special.values())})
    fast.save_pretrained(directory)


def llada_with_tokenizer(parent: Path) -> Path:
    """Copy llada-tiny under ``parent`` and add a word-level tokenizer (EOS 81, end-of-turn 348, mask 336,
    header tokens 346/347)."""
    directory = parent / "llada-tiny"
    shutil.copytree(CKPT["llada"], directory)
    special = {
        81: "<|endoftext|>", 336: "<|mdm_mask|>", 346: "<|start_header_id|>", 347: "<|end_header_id|>",
        348: "<|eot_id|>",
    }
    add_word_tokenizer(directory, special, 384)
    return directory
