"""Tiny checkpoints with a real tokenizer, shared by the engine, evaluation and API tests."""

from __future__ import annotations

import shutil
from pathlib import Path

#: The tiny Fast-dLLM LLaDA checkpoint (seeded random weights, reference layout) copied into the repo.
LLADA_TINY = Path(__file__).resolve().parent.parent / "data" / "fastdllm" / "ckpt" / "llada-tiny"


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


def llada_tiny_with_tokenizer(parent: Path) -> Path:
    """Copy llada-tiny into ``parent/llada-tiny`` with a word-level tokenizer (EOS 81, end-of-turn 348, mask 336,
    header tokens 346/347; every other id ``i`` is the word ``w<i>``) and return the folder."""
    directory = Path(parent) / "llada-tiny"
    shutil.copytree(LLADA_TINY, directory)
    special = {
        81: "<|endoftext|>", 336: "<|mdm_mask|>", 346: "<|start_header_id|>", 347: "<|end_header_id|>",
        348: "<|eot_id|>",
    }
    add_word_tokenizer(directory, special, 384)
    return directory
