"""`DecodeReport`: what one decode returns, what `generate --json` prints and what `POST /generate` answers."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from service.engine.params import DecodeParams


class Timings(BaseModel):
    """Wall-clock seconds of one decode (shared by the rows of a batch)."""

    total_s: float = 0.0
    first_block_s: float = 0.0


class LayerBits(BaseModel):
    """Effective bits of one layer's reused K and V, averaged over the reused tokens."""

    layer: int
    k_nominal_bits: float
    v_nominal_bits: float
    k_storage_bits: float
    v_storage_bits: float


class KVReport(BaseModel):
    """What the KV quantization cost (filled by `service.quant`; paper "Effective bits").

    *Nominal* bits count codes at b bits and protected tokens at 16 (scales not counted); *storage* bits are the
    bytes actually held (scales, zero points, indices, outliers included) x 8 / elements.

    The applied artifact's id is carried under the method's spelling of ``artifact_id``
    (`service.quant.plugin.QuantMethod.spellings`: ``policy_id`` for dllm_kvq, ``kvquant_state_id`` for kvquant,
    ``artifact_id`` for a method registered without one); the quantized store writes every registered method's
    spelling, null but its own (`service.quant.registry.report_fields`), so a report names no method here and a
    method registered later is reported like the built-in ones.
    """

    model_config = ConfigDict(extra="allow", json_schema_extra={
        "additionalProperties": {"anyOf": [{"type": "string"}, {"type": "null"}],
                                 "description": "the applied artifact's id under a method's spelling of "
                                                "artifact_id (policy_id, kvquant_state_id ...)"}})

    config: dict[str, Any]
    artifact_id: str | None = None
    k_nominal_bits: float
    v_nominal_bits: float
    k_storage_bits: float
    v_storage_bits: float
    bytes_held: int = Field(description="bytes of the reused K/V as held, summed over layers, peak over blocks")
    bf16_bytes: int = Field(description="bytes the same K/V would take in bf16")
    per_layer: list[LayerBits] = []


class TokenLogprob(BaseModel):
    """One token's log-probability and its most likely alternatives, in nats.

    For a decoded token: the model's log-softmax at the step that revealed it (the distribution that chose it at
    temperature 0; before any temperature), ``top`` its largest entries. For a scored prompt token
    (`service.engine.likelihood`): its ELBO increment, and ``top`` the first reveal step's alternatives.
    """

    token: int
    logprob: float
    top: list[tuple[int, float]] = Field(default_factory=list, description="(token id, log-probability), "
                                         "most likely first")


class RowReport(BaseModel):
    """One row of a batch. ``generated_ids`` are the response tokens returned and ``text`` their text, cut by
    `service.engine.response.cut_response` (at the row's ``max_tokens``, after the first EOS unless
    ``ignore_eos``, and at the first stop string)."""

    generated_ids: list[int]
    text: str | None = None
    # "cancelled": the caller's ``cancelled`` callback dropped the row before it finished.
    finish_reason: Literal["stop", "length", "cancelled"]
    nfe: int
    steps_per_block: list[int]
    reveals_per_step: list[int]
    tokens_per_second: float
    logprobs: list[TokenLogprob] | None = Field(
        None, description="per returned token, when the row asked for them (`RowOptions.logprobs`)")


class DecodeReport(BaseModel):
    """The result of one `generate` call over a batch."""

    rows: list[RowReport]
    params: DecodeParams
    timings: Timings
    kv: KVReport | None = None
