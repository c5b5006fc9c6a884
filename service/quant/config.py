"""`KVQuantConfig`: one request's (or the server's active) KV quantization configuration."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from service.artifacts.base import legal_v_group_sizes
from service.quant.errors import KVQuantError

Method = Literal["none", "kivi", "kvquant", "dllm_kvq"]
#: Legal values, for error messages and CLI choices.
METHODS: tuple[str, ...] = ("none", "kivi", "kvquant", "dllm_kvq")
BITS: tuple[int, ...] = (2, 4, 8)
Sides = Literal["kv", "k", "v"]
#: Legal values of ``sides``: both, K only, V only.
SIDES: tuple[str, ...] = ("kv", "k", "v")


class KVQuantConfig(BaseModel):
    """Method, bits, group sizes, and the policy table (dllm_kvq) or fitted state (kvquant) it needs.

    ``k_group_size`` is in tokens (K is quantized per channel over groups of tokens); ``v_group_size`` in channels
    (V per token over groups of channels), ``None`` meaning min(32, head_dim) (see :meth:`resolve_v_group_size`).
    ``dllm_kvq`` needs a policy table, by store id (``policy_id``) or file (``policy_file``, JSON); ``kvquant`` a
    fitted state, by id (``kvquant_state_id``) or file (``kvquant_state_file``, safetensors). Exactly one of id and
    file, and only for the method that uses it.

    ``sides`` says which of K and V the method quantizes (``kv``, default), ``k`` or ``v``: the other one is held
    as it is, in the model dtype (counted at 16 nominal bits, the paper's high-precision accounting), so a K-only
    or V-only row shows where a method's loss comes from (issue 16; the paper's method is K-side).

    Raises (at construction): ``pydantic.ValidationError`` (a ``ValueError``) whose message lists the legal values:
    method (none, kivi, kvquant, dllm_kvq), bits (2, 4, 8), a missing or superfluous policy/state.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: Method = "none"
    bits: Literal[2, 4, 8] = 4
    k_group_size: int = Field(32, gt=0)
    v_group_size: int | None = Field(None, gt=0)
    policy_id: str | None = None
    kvquant_state_id: str | None = None
    policy_file: str | None = None
    kvquant_state_file: str | None = None
    sides: Sides = "kv"
    # Keep each layer's dequantized reused K/V for the whole block (faster, saves no memory within a block).
    keep_dequantized: bool = False

    @model_validator(mode="after")
    def _check_artifacts(self) -> KVQuantConfig:
        needs = {"dllm_kvq": ("policy_id", "policy_file"), "kvquant": ("kvquant_state_id", "kvquant_state_file")}
        for method, (id_field, file_field) in needs.items():
            given = [f for f in (id_field, file_field) if getattr(self, f) is not None]
            if self.method == method and len(given) != 1:
                raise ValueError(
                    f"method {method!r} needs exactly one of {id_field} or {file_field}, got "
                    f"{given or 'neither'}"
                )
            if self.method != method and given:
                raise ValueError(f"{given[0]} is only used by method {method!r}, not {self.method!r}")
        return self

    def resolve_v_group_size(self, head_dim: int) -> int:
        """The V group size for a model with ``head_dim`` channels per head (default min(32, head_dim)).

        Raises:
            KVQuantError: the group size does not divide ``head_dim`` (the message lists the legal sizes).
        """
        size = self.v_group_size if self.v_group_size is not None else min(32, head_dim)
        if head_dim % size:
            raise KVQuantError(
                f"v_group_size {size} does not divide head_dim {head_dim}; legal: {legal_v_group_sizes(head_dim)}"
            )
        return size

    def check_cache_mode(self, cache_mode: str) -> None:
        """Refuse a quantizing method with cache mode ``none``: quantization acts only on the reused regions
        (DESIGN.md, "Rules that hold everywhere"), and full recompute reuses nothing, so the request would run
        unquantized while claiming a method.

        Raises:
            KVQuantError: ``method`` is not ``none`` and ``cache_mode`` is ``none``.
        """
        if self.method != "none" and cache_mode == "none":
            raise KVQuantError(f"method {self.method!r} quantizes the reused cache, and cache mode 'none' reuses "
                               "nothing; use 'prefix' or 'dual'")

