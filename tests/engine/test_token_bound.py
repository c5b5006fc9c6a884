"""`service.engine.token_bound`: the lower bound never exceeds the real token count, and there is no bound for a
tokenizer that may drop or shrink text."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from service.engine.token_bound import max_bytes_per_token, min_tokens


@pytest.fixture(scope="module")
def embedded_tokenizer():
    from service.engine import Engine

    return Engine.load(None).tokenizer


def _texts() -> list[str]:
    rng = random.Random(0)
    return ["copy: " + "7 " * 3000, "hello world, " * 500, " " * 5000, "\n\t" * 1000, "\U0001f600" * 700,
            "<|endoftext|>" * 200, "<|start_header_id|>user<|end_header_id|>" * 100,
            "".join(chr(rng.randint(32, 0x2FFF)) for _ in range(4000)),
            "".join(chr(rng.choice([rng.randint(0x20, 0x7E), rng.randint(0x10000, 0x10FFFF)])) for _ in range(3000))]


def test_the_bound_holds_for_the_embedded_tokenizer(embedded_tokenizer):
    per_token = max_bytes_per_token(embedded_tokenizer)
    assert per_token is not None and per_token >= len("<|start_header_id|>")
    for text in _texts():
        assert min_tokens(text, per_token) <= len(embedded_tokenizer(text, verbose=False)["input_ids"]), text[:40]


def _byte_level_bpe(**kwargs) -> PreTrainedTokenizerFast:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    for name, value in kwargs.items():
        setattr(tok, name, value)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_no_bound_when_text_can_shrink_or_vanish():
    assert max_bytes_per_token(_byte_level_bpe()) == 1  # one byte per token: the bound is the byte count
    assert max_bytes_per_token(_byte_level_bpe(normalizer=normalizers.NFC())) is None
    assert max_bytes_per_token(_byte_level_bpe(pre_tokenizer=pre_tokenizers.Whitespace())) is None
    removing = pre_tokenizers.Sequence([pre_tokenizers.Split(" ", behavior="removed"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    assert max_bytes_per_token(_byte_level_bpe(pre_tokenizer=removing)) is None
    stripping = _byte_level_bpe()
    stripping.add_tokens([AddedToken("<x>", rstrip=True)])  # it absorbs the whitespace after it
    assert max_bytes_per_token(stripping) is None
    assert max_bytes_per_token(None) is None and min_tokens("anything", None) == 0
