"""`KVQuantConfig`: one request's (or the server's active) KV quantization configuration."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Method = Literal["none", "kivi", "kvquant", "dllm_kvq"]


class KVQuantConfig(BaseModel):
    """Method, bits, group sizes, and the policy table (dllm_kvq) or fitted state (kvquant) it needs.

    ``k_group_size`` is in tokens (K is quantized per channel over groups of tokens); ``v_group_size`` in channels
    (V per token over groups of channels), ``None`` meaning min(32, head_dim).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: Method = "none"
    bits: Literal[2, 4, 8] = 4
    k_group_size: int = Field(32, gt=0)
    v_group_size: int | None = Field(None, gt=0)
    policy_id: str | None = None
    kvquant_state_id: str | None = None
    # Keep each layer's dequantized reused K/V for the whole block (faster, saves no memory within a block).
    keep_dequantized: bool = False
