"""A small fake engine with the `service.engine.Engine` interface, for HTTP-shape tests of the server (STYLE.md
habit 3: the API depends on an engine interface). It decodes nothing: the response of a row is its prompt's
characters in reverse order followed by EOS, revealed block by block with a configurable delay per block.

Special prompt characters make it misbehave on purpose: ``!`` raises an ordinary error in the batch (the worker
must answer 500 and live on), ``#`` raises a `DeviceFault` (readiness must fail).
"""

from __future__ import annotations

import time

from service.engine.params import DecodeParams, RowOptions
from service.engine.report import DecodeReport, RowReport, Timings
from service.engine.spec import ModelSpec
from service.worker import DeviceFault

ALPHABET = " abcdefghijklmnopqrstuvwxyz.,!?#ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
PAD, BOS, EOS, MASK = 0, 1, 2, 127
OFFSET = 3  # token id of ALPHABET[0]


class CharTokenizer:
    """One token per character of ALPHABET; BOS first; a two-line chat template."""

    eos_token, bos_token, pad_token, unk_token = "<eos>", "<bos>", "<pad>", None
    chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant: "

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = [OFFSET + ALPHABET.index(c) for c in text if c in ALPHABET]
        return {"input_ids": ([BOS] if add_special_tokens else []) + ids}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(ALPHABET[i - OFFSET] for i in ids if OFFSET <= i < OFFSET + len(ALPHABET))

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + ("assistant: " if add_generation_prompt
                                                                              else "")
        return self(text)["input_ids"] if tokenize else text


class FakeEngine:
    """See the module docstring. ``block_delay_s`` is slept per committed block (per batch, not per row)."""

    def __init__(self, block_delay_s: float = 0.0, max_length: int = 512) -> None:
        self.block_delay_s = block_delay_s
        self.tokenizer = CharTokenizer()
        self.spec = ModelSpec(arch="llada", model_id="fake-llada", fingerprint="fa" * 32, num_layers=2,
                              num_heads=2, num_kv_heads=2, head_dim=8, vocab_size=128, mask_id=MASK,
                              eos_ids=(EOS,), pad_id=PAD, max_length=max_length)
        self.calls: list[int] = []  # batch sizes, in order

    def decode_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def generate(self, prompts, params: DecodeParams, rows: list[RowOptions] | None = None, kv_store=None,
                 on_block=None, cancelled=None) -> DecodeReport:
        t0 = time.monotonic()
        self.calls.append(len(prompts))
        fault = OFFSET + ALPHABET.index("!")
        device_fault = OFFSET + ALPHABET.index("#")
        if any(device_fault in p for p in prompts):
            raise DeviceFault("CUDA error: an illegal memory access was encountered (injected)")
        if any(fault in p for p in prompts):
            raise RuntimeError("injected fault in this batch")
        answers = []
        for p in prompts:
            body = [t for t in reversed(p) if t >= OFFSET]
            answers.append((body + [EOS] + [EOS] * params.gen_length)[: params.gen_length])
        num_blocks = params.gen_length // params.block_length
        for b in range(num_blocks):
            if cancelled is not None and all(cancelled()):
                break
            time.sleep(self.block_delay_s)
            if on_block is not None:
                on_block(b, [a[: (b + 1) * params.block_length] for a in answers])
        reports = []
        for a in answers:
            cut = a[: a.index(EOS) + 1] if EOS in a and not params.ignore_eos else a
            reports.append(RowReport(generated_ids=cut, text=self.decode_text(cut),
                                     finish_reason="stop" if cut[-1:] == [EOS] else "length", nfe=num_blocks,
                                     steps_per_block=[1] * num_blocks, reveals_per_step=[params.block_length] *
                                     num_blocks, tokens_per_second=0.0))
        return DecodeReport(rows=reports, params=params, timings=Timings(total_s=time.monotonic() - t0))
