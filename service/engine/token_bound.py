"""A provable lower bound on a text's token count, so that a prompt that cannot fit the context is refused
before it is tokenized (tokenizing 1 MB of text takes seconds and some 250 MB for a moment).

The bound is ``ceil(utf8_bytes(text) / L)``, where ``L`` is the most bytes of text one token can stand for. It
holds only when tokenizing never drops or shrinks text, which we check on the tokenizer's own definition
(``tokenizer.json``, HF ``tokenizers``), and otherwise give no bound (None) and rely on the body size limit:

* no normalizer (NFC, NFKC, lowercasing, stripping, BERT's cleaning can all shrink or drop text);
* byte-level pre-tokenization (GPT-2's ``ByteLevel``: every UTF-8 byte becomes one alphabet character), alone or
  after ``Split`` steps that keep what they split on (``Removed`` drops it);
* a BPE model whose vocabulary holds all 256 byte characters (BPE drops a character it has no token for when it
  has no ``unk_token``, and fuses runs of unknown characters into one when it has);
* added tokens that do not absorb neighbouring whitespace (``lstrip``/``rstrip``).

Then every byte of the text lies in exactly one token: a vocabulary token covers one byte per byte character it
holds (other characters, e.g. a ``##`` prefix, are counted too: an over-estimate of ``L`` keeps the bound valid),
an added token the UTF-8 bytes of its content; special tokens the post-processor adds only add tokens. Chat
prompts get no bound here: a chat template may trim or drop message content.
"""

from __future__ import annotations

import json
import math
from typing import Any

_KEEPING_SPLITS = ("Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous")


def _byte_level_pre_tokenizer(spec: dict | None) -> bool:
    if spec is None:
        return False
    if spec.get("type") == "ByteLevel":
        return True
    if spec.get("type") != "Sequence":
        return False
    steps = spec.get("pretokenizers") or []
    kinds = [s.get("type") for s in steps]
    return (kinds.count("ByteLevel") == 1 and kinds[-1] == "ByteLevel"
            and all(s.get("type") == "ByteLevel" or (s.get("type") == "Split" and s.get("behavior") in _KEEPING_SPLITS)
                    for s in steps))


def max_bytes_per_token(tokenizer: Any) -> int | None:
    """``L``: the most UTF-8 bytes of text one token of ``tokenizer`` can stand for, or None when the tokenizer
    may drop or shrink text (see the module docstring) or is not a fast (``tokenizers``) one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    from tokenizers.pre_tokenizers import ByteLevel

    definition = json.loads(backend.to_str())
    model = definition.get("model") or {}
    if (definition.get("normalizer") is not None or not _byte_level_pre_tokenizer(definition.get("pre_tokenizer"))
            or model.get("type") != "BPE"):
        return None
    vocab: dict[str, int] = model.get("vocab") or {}
    alphabet = set(ByteLevel.alphabet())
    if not alphabet <= vocab.keys():
        return None
    added = definition.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") for t in added):
        return None
    longest = max(sum(1 if c in alphabet else len(c.encode("utf-8")) for c in token) for token in vocab)
    return max([longest, *(len(t["content"].encode("utf-8")) for t in added)])


def min_tokens(text: str, bytes_per_token: int | None) -> int:
    """The fewest tokens ``text`` can tokenize to with a tokenizer whose `max_bytes_per_token` is given (0 when
    there is no bound)."""
    if bytes_per_token is None:
        return 0
    return math.ceil(len(text.encode("utf-8", "surrogatepass")) / bytes_per_token)
