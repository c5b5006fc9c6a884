"""Decoding parameters: what a batch shares (`DecodeParams`) and what may differ per row (`RowOptions`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

#: How much of the K/V a step reuses (DESIGN.md "Words"): none (full recompute), prefix, dual.
CacheMode = Literal["none", "prefix", "dual"]


class DecodeParams(BaseModel):
    """Batch-level block-diffusion settings (Fast-dLLM semantics; see `service.engine.decode`).

    Exactly one of ``threshold`` (confidence-threshold parallel decoding) and ``steps`` (fixed schedule, total
    over all blocks) is set. ``gen_length`` is in tokens and a multiple of ``block_length``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    gen_length: int = Field(256, gt=0)
    block_length: int = Field(32, gt=0)
    cache_mode: CacheMode = "dual"
    threshold: float | None = 0.9
    steps: int | None = None
    remasking: Literal["low_confidence", "random"] = "low_confidence"
    ignore_eos: bool = False
    # Dream only, cache_mode "none": "origin" is Dream's whole-sequence algorithm (the paper's full-attention
    # row); "block" is the block-wise no-cache schedule consistent with the cached modes (full recompute).
    dream_schedule: Literal["origin", "block"] = "origin"


class RowOptions(BaseModel):
    """Per-row settings inside a batch: sampling temperature, seed, stop strings."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(0.0, ge=0.0)
    seed: int | None = None
    stop: tuple[str, ...] = ()


def response_length(max_new_tokens: int, block_length: int) -> int:
    """The number of response positions decoded for a request asking for ``max_new_tokens`` tokens.

    One rule for every path that turns a client's length into a decode window: the server (OpenAI
    ``max_tokens``) and the in-process lm-eval model (a task's ``max_gen_toks``) both call this, so the same
    request decodes the same window either way. Block diffusion can only decode whole blocks (Fast-dLLM
    asserts ``gen_length % block_length == 0``), so the length is rounded **up** to the next multiple of
    ``block_length``. The response is not cut back to ``max_new_tokens``: every decoded position may hold text,
    which the caller cuts only at EOS and stop strings (the server documents ``max_tokens`` this way).

    Args:
        max_new_tokens: requested response tokens, >= 1.
        block_length: tokens per block, >= 1.

    Returns:
        ``ceil(max_new_tokens / block_length) * block_length`` (tokens), usable as ``DecodeParams.gen_length``.

    Raises:
        ValueError: if either argument is not a positive integer.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if isinstance(block_length, bool) or not isinstance(block_length, int) or block_length < 1:
        raise ValueError(f"block_length must be a positive integer, got {block_length!r}")
    return -(-max_new_tokens // block_length) * block_length
