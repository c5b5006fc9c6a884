"""Train the embedded default model's tokenizer: byte-level BPE, small vocabulary, LLaDA's special tokens.

Output (``--out``, default ``service/assets/embedded``): ``tokenizer.json``, ``tokenizer_config.json`` (with
LLaDA-8B-Instruct's chat template) and ``special_tokens_map.json``, loadable by
``transformers.AutoTokenizer.from_pretrained``.

The corpus is the task family (``evaluation.embedded_task``: instructions and answers, so every digit with and
without its leading space, and the instruction words, become single tokens) plus the project's own Python
sources and README (so code and prose get a few useful merges). Byte-level BPE with no normalizer
round-trips any text exactly; the vocabulary size only decides how many tokens a text takes.

Special tokens and their roles, the strings LLaDA-8B-Instruct uses (SPEC section 1.1; the mask string is
LLaDA's ``<|mdm_mask|>``): ``<|endoftext|>`` EOS and padding, ``<|startoftext|>`` bos, ``<|start_header_id|>``
and ``<|end_header_id|>`` around a role name, ``<|eot_id|>`` end of turn, ``<|mdm_mask|>`` the mask.

Usage: ``python scripts/build_embedded_tokenizer.py [--vocab-size 1024] [--out DIR]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from evaluation.embedded_task import generate

SPECIALS = {
    "eos": "<|endoftext|>",
    "bos": "<|startoftext|>",
    "start_header": "<|start_header_id|>",
    "end_header": "<|end_header_id|>",
    "eot": "<|eot_id|>",
    "mask": "<|mdm_mask|>",
}
# LLaDA-8B-Instruct's chat template (SPEC 1.1): bos before the first message only; content stripped.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def corpus() -> list[str]:
    """Training texts: 4000 task questions (prompt and answer, each several times) and the repo's sources."""
    texts = []
    for q in generate("train", 4000, seed=7):
        texts += [q.prompt, q.answer, f"user\n\n{q.prompt}", "assistant\n\n" + q.answer, "system"]
    for path in sorted(ROOT.glob("**/*.py")) + [ROOT / "README.md"]:
        if ".venv" not in path.parts and path.is_file():
            texts.append(path.read_text(errors="replace"))
    return texts


def build(vocab_size: int) -> PreTrainedTokenizerFast:
    """Train the BPE model on ``corpus()`` and wrap it with the special tokens and chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIALS["bos"],
        eos_token=SPECIALS["eos"],
        pad_token=SPECIALS["eos"],
        mask_token=SPECIALS["mask"],
        additional_special_tokens=[SPECIALS["start_header"], SPECIALS["end_header"], SPECIALS["eot"]],
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )


def main() -> None:
    """CLI entry: train and save."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab-size", type=int, default=1024)
    ap.add_argument("--out", type=Path, default=ROOT / "service/assets/embedded")
    args = ap.parse_args()
    tok = build(args.vocab_size)
    # chat template inside tokenizer_config.json (older transformers do not read chat_template.jinja)
    tok.save_pretrained(args.out, save_jinja_files=False)
    print(f"saved {len(tok)} tokens to {args.out}")


if __name__ == "__main__":
    main()
