"""Tiny Fast-dLLM checkpoints and goldens (tests/data/fastdllm) shared by the engine tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

DATA = Path(__file__).resolve().parent.parent / "data" / "fastdllm"
CKPT = {"llada": DATA / "ckpt" / "llada-tiny", "dream": DATA / "ckpt" / "dream-tiny"}


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    # The goldens were made with one torch thread; the shared machine is also fastest this way.
    torch.set_num_threads(1)


def golden(name: str) -> dict:
    return json.loads((DATA / name).read_text())


@pytest.fixture(scope="session")
def engines():
    from service.engine import Engine

    return {arch: Engine.load(path) for arch, path in CKPT.items()}


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


@pytest.fixture(scope="session")
def llada_with_tokenizer(tmp_path_factory) -> Path:
    """llada-tiny plus a word-level tokenizer (EOS 81, end-of-turn 348, mask 336, header tokens 346/347)."""
    import shutil

    directory = tmp_path_factory.mktemp("llada-tok") / "llada-tiny"
    shutil.copytree(CKPT["llada"], directory)
    special = {
        81: "<|endoftext|>", 336: "<|mdm_mask|>", 346: "<|start_header_id|>", 347: "<|end_header_id|>",
        348: "<|eot_id|>",
    }
    add_word_tokenizer(directory, special, 384)
    return directory
