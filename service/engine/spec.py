"""`ModelSpec`: what the rest of the system needs to know about a loaded model, without touching its weights."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    """Facts about a loaded checkpoint, used to validate policy tables and KVQuant states against it.

    Attributes:
        arch: the model family, a key of `service.engine.models.MODEL_CLASSES` (which also gives its reveal rule).
        model_id: the path or repo id it was loaded from (for display; never used for matching).
        fingerprint: hex SHA-256 over the checkpoint's tensors (names, shapes, dtypes, bytes), so a retrained
            model with the same shapes does not match (see `service.engine.loading.weights_fingerprint`).
        num_layers, num_heads, num_kv_heads, head_dim: attention geometry (GQA when num_kv_heads < num_heads).
        vocab_size: logits columns.
        mask_id: the ``<mask>`` token id.
        eos_ids: ids that end a response (EOS and, for chat models, end-of-turn).
        pad_id: id used for left padding (never equal to mask_id).
        max_length: longest prompt + response the engine accepts, in tokens.
        tokenizer_size: ids the loaded tokenizer can decode (``len(tokenizer)``), or None without a tokenizer;
            the logit rows may be wider (``vocab_size``), and ids at or beyond it are never sampled.
        canvas_length: tokens per canvas of a family whose block is fixed by the checkpoint (DiffusionGemma's
            ``canvas_length``): its decode window is ``max_tokens`` rounded up to whole canvases, whatever
            ``block_length`` says (`service.api.planning`); None: the block is the ``block_length`` setting.
    """

    arch: str
    model_id: str
    fingerprint: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    mask_id: int
    eos_ids: tuple[int, ...]
    pad_id: int
    max_length: int
    tokenizer_size: int | None = None
    canvas_length: int | None = None

    @property
    def decodable_size(self) -> int:
        """Ids below this can be decoded: the tokenizer's size, at most the logit width (the logit width without a
        tokenizer)."""
        return self.vocab_size if self.tokenizer_size is None else min(self.tokenizer_size, self.vocab_size)

    @property
    def has_mask_token(self) -> bool:
        """Whether ``mask_id`` is a token a prompt could hold: a family with no mask token (DiffusionGemma, which
        renoises) gives ``vocab_size``, an id outside the vocabulary, which the vocabulary check refuses as such."""
        return 0 <= self.mask_id < self.vocab_size

    @property
    def banned_ids(self) -> list[int]:
        """Ids decoding never chooses: the mask id, and every logit row the tokenizer cannot decode
        (`service.engine.sampling`)."""
        return sorted({self.mask_id, *range(self.decodable_size, self.vocab_size)})
