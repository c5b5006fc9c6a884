"""`PolicyTable`: dLLM-KVQ's per-layer K policy for one (model, cache mode, bits).

Paper sections "K-Cache Policy Selection" and "Policy Diagnostics and Selection": for a model, a cache mode and a
target bit width, each layer gets a candidate ``(score type, p)``: the token score used to rank the K tokens of a
group and the high-precision budget p (K tokens per group kept unquantized). Offline fitting
(`calibration`) makes a table; the online quantizer (`service.quant.dllm_kvq`) applies it. A table is immutable,
has an id derived from its content, round-trips through JSON and is checked against the loaded model before use.
"""

from __future__ import annotations

import hashlib
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from service.artifacts.base import (
    Artifact,
    ArtifactMismatch,
    Provenance,
    canonical_json,
    check_fingerprint,
    legal_v_group_sizes,
)
from service.engine.spec import ModelSpec

ScoreType = Literal["attention", "qerror", "hybrid"]
#: Legal score types (paper "Online dLLM-KVQ Quantization").
SCORE_TYPES: tuple[str, ...] = ("attention", "qerror", "hybrid")
#: Cache modes a policy can be fitted for (no reuse, no cache to quantize, under "none").
POLICY_CACHE_MODES: tuple[str, ...] = ("prefix", "dual")


class LayerPolicy(BaseModel):
    """One layer's candidate ``a = (s, p)``: score type ``s`` and high-precision budget ``p`` (K tokens per group).

    ``p = 0`` is ordinary KIVI-style K quantization of that layer (the score is then unused).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    score_type: ScoreType
    p: int = Field(ge=0)


class PolicyTable(BaseModel, Artifact):
    """A fitted dLLM-KVQ policy for one (model, cache mode, bits): one :class:`LayerPolicy` per layer.

    Attributes:
        model_id: the checkpoint it was fitted on (path or repo id; for display).
        weights_fingerprint: ``ModelSpec.fingerprint`` of that checkpoint (hash of its tensors), so a retrained
            model with the same shapes does not match.
        cache_mode: ``"prefix"`` or ``"dual"``.
        bits: code bits b of the low-bit K and V tokens, one of 2, 4, 8.
        k_group_size: K tokens per group (statistics per channel over these tokens); must exceed every p.
        v_group_size: V channels per group (statistics per token over these channels).
        k_bit_cap: the nominal effective K-bit cap the table was fitted under (paper: 4.9); a record of the fit,
            checked against each layer's full-group nominal K bits ``(b (G - p) + 16 p) / G``.
        layers: one entry per transformer layer, in order.
        provenance: the data and code that made the table.

    Raises (at construction): ``pydantic.ValidationError`` (a ``ValueError``) naming the field, e.g.
    ``layers.3.p`` for a negative budget or one that is not below ``k_group_size``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    #: The store kind policy tables are kept under.
    KIND: ClassVar[str] = "policy"
    LABEL: ClassVar[str] = "policy table"
    #: The admin API's URL segment (``/admin/policies``).
    PLURAL: ClassVar[str] = "policies"

    schema_version: Literal[1] = 1
    model_id: str
    weights_fingerprint: str = Field(min_length=1)
    cache_mode: Literal["prefix", "dual"]
    bits: Literal[2, 4, 8]
    k_group_size: int = Field(32, gt=0)
    v_group_size: int = Field(32, gt=0)
    k_bit_cap: float = Field(gt=0)
    layers: list[LayerPolicy] = Field(min_length=1)
    provenance: Provenance

    @model_validator(mode="after")
    def _check_budgets(self) -> PolicyTable:
        for i, layer in enumerate(self.layers):
            if layer.p >= self.k_group_size:
                raise ValueError(
                    f"layers.{i}.p: budget {layer.p} must be in [0, k_group_size={self.k_group_size}) so that a "
                    "full group keeps at least one quantized token"
                )
            if nominal_k_bits(self.bits, self.k_group_size, layer.p) > self.k_bit_cap + 1e-9:
                raise ValueError(
                    f"layers.{i}.p: budget {layer.p} gives {nominal_k_bits(self.bits, self.k_group_size, layer.p)}"
                    f" nominal K bits, above the table's k_bit_cap {self.k_bit_cap}"
                )
        return self

    @property
    def id(self) -> str:
        """Content-derived id: ``policy-`` + the first 32 hex digits of SHA-256 over the canonical JSON."""
        return "policy-" + hashlib.sha256(canonical_json(self.model_dump(mode="json"))).hexdigest()[:32]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def to_json(self) -> str:
        """Canonical JSON (sorted keys, no spaces); :meth:`from_json` gives back an equal table with the same id."""
        return canonical_json(self.model_dump(mode="json")).decode()

    def to_bytes(self) -> bytes:
        """The bytes a store holds (:meth:`to_json`, UTF-8): the artifact protocol's writer."""
        return self.to_json().encode()

    def summary(self) -> dict:
        """What ``GET /admin/policies/{id}`` shows: the whole table as JSON."""
        return self.model_dump(mode="json")

    @classmethod
    def from_json(cls, text: str | bytes) -> PolicyTable:
        """Parse and validate a table (``pydantic.ValidationError`` naming the field if it is not one)."""
        return cls.model_validate_json(text)

    @classmethod
    def from_bytes(cls, data: bytes) -> PolicyTable:
        """:meth:`from_json` of UTF-8 bytes (a stored or uploaded table)."""
        return cls.model_validate_json(data)

    @classmethod
    def configured_k_bits(cls, summary: dict) -> float | None:
        """The table's configured K bits (`service.quant.accounting.policy_k_bits`: ``(b (G - p) + 16 p) / G``
        averaged over layers) from its summary; None for a summary that is not a whole table."""
        from pydantic import ValidationError

        try:
            return cls.model_validate(summary).mean_k_bits()
        except ValidationError:
            return None

    def mean_k_bits(self) -> float:
        """The full-group nominal K bits ``(b (G - p) + 16 p) / G`` of each layer's budget p, averaged over layers
        (bits per K element)."""
        per_layer = [nominal_k_bits(self.bits, self.k_group_size, layer.p) for layer in self.layers]
        return sum(per_layer) / len(per_layer)

    @classmethod
    def activation_fields(cls) -> tuple[str, ...]:
        return ("bits", "k_group_size", "v_group_size")

    def validate_for(self, spec: ModelSpec) -> None:
        """Check the table against a loaded model.

        Raises:
            ArtifactMismatch: ``weights_fingerprint`` differs from ``spec.fingerprint``; ``layers`` has a length
                other than ``spec.num_layers``; ``v_group_size`` does not divide ``spec.head_dim``.
        """
        check_fingerprint(self.weights_fingerprint, spec)
        if self.num_layers != spec.num_layers:
            raise ArtifactMismatch(
                "layers", f"the policy has {self.num_layers} layer entries, the model has {spec.num_layers} layers"
            )
        if spec.head_dim % self.v_group_size:
            raise ArtifactMismatch(
                "v_group_size", f"{self.v_group_size} does not divide the model's head_dim {spec.head_dim}; legal: "
                f"{legal_v_group_sizes(spec.head_dim)}"
            )


def nominal_k_bits(bits: int, k_group_size: int, p: int) -> float:
    """Nominal K bits of a full group as the paper counts them: ``(b (G - p) + 16 p) / G`` (scales not counted)."""
    return (bits * (k_group_size - p) + 16 * p) / k_group_size
