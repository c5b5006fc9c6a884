"""Decoding parameters: what a batch shares (`DecodeParams`) and what may differ per row (`RowOptions`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from service.engine.kv_store import CacheMode


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
