"""Which grammar engine constrains the reveal (issue 26): llguidance, xgrammar and outlines-core, measured on the
same grammars, tokens and machine in one run.

For each engine and each vocabulary (the embedded model's 1,024-token tokenizer, and a synthetic byte-level
vocabulary of 128k tokens with LLaDA's size, since no real LLaDA/Dream tokenizer is on this machine) it prints:

* compile time of three grammars (the digit-ledger answer regex, a nested record schema, a 200-property schema),
  and whether the engine refused one;
* the time of one token mask along a valid token sequence (mask, then consume the next token), in microseconds;
* every figure also as a ratio to llguidance's in the same run (the machine's speed cancels out).

What a constrained reveal needs from the engine besides speed (the token-mask API, stated in the table's notes):
a mask for the next position given the tokens before it, consuming tokens one at a time, a copy of a compiled
grammar per request, the tokens the grammar forces next (several positions revealed in one step), and bounds on
the work a hostile grammar can cause.

Usage: ``.venv/bin/pip install -e ".[grammar-bench]"``, then
``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/grammar_engines.py [--repeat 3] [--big-vocab 128000]``
(about a minute on one CPU core).
"""

from __future__ import annotations

import argparse
import json
import random
import string
import time
from pathlib import Path

import llguidance
import llguidance.hf
import llguidance.torch
import outlines_core
import torch
import xgrammar
from outlines_core.json_schema import build_regex_from_schema
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

EMBEDDED = Path(__file__).resolve().parents[1] / "service" / "assets" / "embedded"
DIGIT_LEDGER_REGEX = r"( [0-9]){48}"
RECORD_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["op", "digits", "meta"],
    "properties": {
        "op": {"enum": ["copy", "next", "sum"]},
        "digits": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1,
                   "maxItems": 8},
        "meta": {"type": "object", "additionalProperties": False, "required": ["ok", "note"],
                 "properties": {"ok": {"type": "boolean"}, "note": {"type": "string", "maxLength": 12}}},
    },
}
WIDE_SCHEMA = {"type": "object", "additionalProperties": False, "required": [f"field_{i}" for i in range(200)],
               "properties": {f"field_{i}": {"type": "integer", "minimum": 0, "maximum": 9} for i in range(200)}}
TEXTS = {
    "digit-ledger regex": " " + " ".join(str(i % 10) for i in range(48)),
    "record schema": '{"op":"sum","digits":[1,2,3],"meta":{"ok":true,"note":"fine"}}',
    "200-property schema": json.dumps({f"field_{i}": i % 10 for i in range(200)}, separators=(",", ":")),
}


def synthetic_tokenizer(size: int, seed: int = 0) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with ``size`` tokens: the 256 byte symbols, digit and punctuation pairs, JSON
    fragments, then random lower-case words with and without the leading-space marker (the shape of a real 126k
    vocabulary: most tokens are words; no merges, the engines read only the vocabulary)."""
    rng = random.Random(seed)
    byte_symbols = list(pre_tokenizers.ByteLevel.alphabet())
    vocab: dict[str, int] = {"<|endoftext|>": 0}
    for s in sorted(byte_symbols):
        vocab.setdefault(s, len(vocab))
    pieces = string.digits + string.punctuation
    for a in pieces:
        for b in pieces:
            vocab.setdefault(a + b, len(vocab))
    for frag in ('":', '",', '{"', '"}', '":"', '","', "true", "false", "null", "field", "_"):
        vocab.setdefault(frag, len(vocab))
        vocab.setdefault("Ġ" + frag, len(vocab))
    while len(vocab) < size:
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 9)))
        vocab.setdefault(("Ġ" if rng.random() < 0.5 else "") + word, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def _timed(repeat: int, fn, *args):
    """(result of the last ``fn(*args)``, best seconds of ``repeat`` calls)."""
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn(*args)
        best = min(best, time.perf_counter() - t0)
    return out, best


class Llguidance:
    name = "llguidance"

    def __init__(self, hf, vocab):
        self.tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
        self.vocab = vocab

    def compile(self, kind, source):
        grammar = (llguidance.LLMatcher.grammar_from_regex(source) if kind == "regex" else
                   llguidance.LLMatcher.grammar_from_json_schema(source, defaults={"whitespace_flexible": False}))
        matcher = llguidance.LLMatcher(self.tok, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def walk(self, compiled, tokens):
        m, mask = compiled.deep_copy(), llguidance.torch.allocate_token_bitmask(1, self.vocab)
        for t in tokens:
            llguidance.torch.fill_next_token_bitmask(m, mask)
            assert m.consume_token(t), "token refused"


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf, vocab):
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.vocab = vocab

    def compile(self, kind, source):
        if kind == "regex":
            return self.compiler.compile_regex(source)
        return self.compiler.compile_json_schema(json.dumps(source), any_whitespace=False, separators=(",", ":"))

    def walk(self, compiled, tokens):
        m, mask = xgrammar.GrammarMatcher(compiled), xgrammar.allocate_token_bitmask(1, self.vocab)
        for t in tokens:
            m.fill_next_token_bitmask(mask)
            assert m.accept_token(t), "token refused"


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, hf, vocab):
        by_text: dict[str, list[int]] = {}
        eos = hf.eos_token_id
        for token, i in hf.get_vocab().items():
            if i != eos:
                by_text.setdefault(hf.convert_tokens_to_string([token]), []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos, by_text)
        self.vocab = vocab

    def compile(self, kind, source):
        regex = source if kind == "regex" else build_regex_from_schema(json.dumps(source), r"")
        return outlines_core.Index(regex, self.vocabulary)

    def walk(self, compiled, tokens):
        guide = outlines_core.Guide(compiled)
        mask = torch.zeros((self.vocab + 31) // 32, dtype=torch.int32)
        for t in tokens:
            guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
            guide.advance(t)


GRAMMARS = {"digit-ledger regex": ("regex", DIGIT_LEDGER_REGEX), "record schema": ("json", RECORD_SCHEMA),
            "200-property schema": ("json", WIDE_SCHEMA)}


def measure(label: str, hf, vocab: int, repeat: int) -> list[dict]:
    rows = []
    reference = Llguidance(hf, vocab)
    for engine_cls in (Llguidance, XGrammar, OutlinesCore):
        try:
            engine, setup_s = _timed(1, engine_cls, hf, vocab)
        except Exception as exc:  # noqa: BLE001 -- an engine that cannot load this tokenizer is a result
            rows.append({"vocab": label, "engine": engine_cls.name, "grammar": "(tokenizer)", "error": str(exc)[:80]})
            continue
        for name, (kind, source) in GRAMMARS.items():
            tokens = reference.tok.tokenize_str(TEXTS[name])
            row = {"vocab": label, "engine": engine.name, "grammar": name, "setup_s": setup_s, "tokens": len(tokens)}
            try:
                compiled, row["compile_s"] = _timed(repeat, engine.compile, kind, source)
                _, walk_s = _timed(repeat, engine.walk, compiled, tokens)
                row["mask_us"] = walk_s / len(tokens) * 1e6
            except Exception as exc:  # noqa: BLE001 -- a refusal is a result
                row["error"] = str(exc).splitlines()[0][:80]
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="best of this many timings")
    parser.add_argument("--big-vocab", type=int, default=128_000, help="size of the synthetic vocabulary")
    args = parser.parse_args()
    torch.set_num_threads(1)
    embedded = AutoTokenizer.from_pretrained(EMBEDDED, trust_remote_code=False)
    rows = measure("embedded (1,024)", embedded, 1024, args.repeat)
    big = synthetic_tokenizer(args.big_vocab)
    rows += measure(f"synthetic ({args.big_vocab:,})", big, args.big_vocab, args.repeat)
    base = {(r["vocab"], r["grammar"]): r for r in rows if r["engine"] == "llguidance" and "compile_s" in r}
    print("| vocabulary | engine | grammar | tokens | compile ms | x llguidance | mask us/token | x llguidance |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['vocab']} | {r['engine']} | {r['grammar']} | | refused: {r['error']} | | | |")
            continue
        b = base.get((r["vocab"], r["grammar"]))
        cr = f"{r['compile_s'] / b['compile_s']:.1f}" if b else "-"
        mr = f"{r['mask_us'] / b['mask_us']:.1f}" if b else "-"
        print(f"| {r['vocab']} | {r['engine']} | {r['grammar']} | {r['tokens']} | {r['compile_s'] * 1e3:.1f} | {cr} "
              f"| {r['mask_us']:.1f} | {mr} |")
    setups = {(r["vocab"], r["engine"]): r["setup_s"] for r in rows if "setup_s" in r}
    print("\ntokenizer preparation (once per server): " + "; ".join(
        f"{e} on {v}: {s * 1e3:.0f} ms" for (v, e), s in setups.items()))


if __name__ == "__main__":
    main()
