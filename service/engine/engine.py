"""`Engine`: a loaded model with its tokenizer and spec, and the block-diffusion `generate` entry point."""

from __future__ import annotations

from pathlib import Path

import torch

from service.engine.errors import EngineInputError
from service.engine.loading import load_checkpoint


class Engine:
    """A LLaDA or Dream model ready to decode.

    Attributes:
        spec: the model's :class:`~service.engine.spec.ModelSpec`.
        tokenizer: a transformers tokenizer, or None for a checkpoint without tokenizer files (token ids only).
        model: the torch module (:class:`~service.engine.models.DiffusionLM`), eval mode.
        dtype, device: what the weights were loaded as.
    """

    def __init__(self, model, spec, tokenizer, dtype: torch.dtype, device: torch.device) -> None:
        self.model, self.spec, self.tokenizer, self.dtype, self.device = model, spec, tokenizer, dtype, device

    @classmethod
    def load(
        cls,
        model: str | Path | None = None,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        threads: int | None = None,
    ) -> Engine:
        """Load a checkpoint (local dir, HF repo id from the offline cache, or None for the embedded default).

        Args:
            threads: if set, ``torch.set_num_threads(threads)`` (process-wide; one thread is often fastest on a
                shared small machine).

        Raises:
            EngineInputError: bad dtype/device/threads or no loadable checkpoint (see `service.engine.loading`).
        """
        if threads is not None:
            if threads < 1:
                raise EngineInputError(f"threads must be >= 1, got {threads}")
            torch.set_num_threads(threads)
        loaded = load_checkpoint(model, dtype, device)
        weight = loaded.model.embed.weight
        return cls(loaded.model, loaded.spec, loaded.tokenizer, weight.dtype, weight.device)

    def encode_prompt(self, text: str, chat: bool) -> list[int]:
        """Token ids of ``text``; with ``chat`` the tokenizer's chat template wraps it as one user turn and adds the
        assistant generation prompt.

        Raises:
            EngineInputError: the checkpoint has no tokenizer, or no chat template when ``chat`` is asked for.
        """
        if self.tokenizer is None:
            raise EngineInputError(f"{self.spec.model_id} has no tokenizer files; pass token ids instead of text")
        if chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise EngineInputError(f"{self.spec.model_id} has no chat template; send plain text (chat=False)")
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            return list(ids)
        return list(self.tokenizer(text)["input_ids"])

    def decode_text(self, ids: list[int]) -> str | None:
        """Text of ``ids`` without special tokens, or None without a tokenizer."""
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(ids, skip_special_tokens=True)
