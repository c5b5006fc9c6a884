"""`KVQuantConfig`: one request's (or the server's active) KV quantization configuration."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from service.artifacts.base import default_v_group_size, legal_v_group_sizes
from service.engine.params import TOKENS_CEILING, json_int
from service.quant import registry
from service.quant.errors import KVQuantError

BITS: tuple[int, ...] = (2, 4, 8)
Sides = Literal["kv", "k", "v"]
#: Legal values of ``sides``: both, K only, V only.
SIDES: tuple[str, ...] = ("kv", "k", "v")


def _rule(message: str, field: str) -> PydanticCustomError:
    """A rule across fields, naming the field to fix (``param`` of the API's 400: ``kv_quant.key_bias_correction``
    on a request, ``key_bias_correction`` on an activation) where a plain ``ValueError`` names none."""
    return PydanticCustomError("request_rule", message, {"param": field})


class KVQuantConfig(BaseModel):
    """Method, bits, group sizes, and a reference to the fitted artifact the method needs, if any.

    ``method`` is a name in the quantizer registry (`service.quant.registry`: none, kivi, kvquant, dllm_kvq, and
    any registered later). ``k_group_size`` is in tokens (K is quantized per channel over groups of tokens);
    ``v_group_size`` in channels (V per token over groups of channels), ``None`` meaning min(32, head_dim) (see
    :meth:`resolve_v_group_size`).

    The artifact is referenced generically: ``artifact_id`` (a store id) or ``artifact_file`` (a path), exactly one
    when the method's registry entry names an artifact type, neither otherwise. A method's entry may give its own
    spellings of the two fields, accepted on input and written on output in their place: ``policy_id`` /
    ``policy_file`` (dllm_kvq, a policy table in JSON) and ``kvquant_state_id`` / ``kvquant_state_file``
    (kvquant, a safetensors state), the public HTTP, CLI and lm-eval names.

    ``sides`` says which of K and V the method quantizes (``kv``, default), ``k`` or ``v``: the other one is held
    as it is, in the model dtype (counted at 16 nominal bits, the paper's high-precision accounting), so a K-only
    or V-only row shows where a method's loss comes from (issue 16; the paper's method is K-side).

    ``key_bias_correction`` (off by default, written only when on) subtracts from each quantized key's attention
    score its expected rounding inflation (`service.quant.key_bias`); only for a method that quantizes keys.

    Raises (at construction): ``pydantic.ValidationError`` (a ``ValueError``) whose message lists the legal values:
    an unknown method (the registered ones), bits (2, 4, 8), a missing or superfluous artifact reference.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: str = Field("none", json_schema_extra=lambda schema: schema.update(enum=list(registry.methods())))
    bits: Literal[2, 4, 8] = 4
    # Integers as JSON Schema types them, as every request field (`service.engine.params.json_int`): "32" is refused,
    # not read as 32 (the environment and the CLI give JSON or typed values).
    k_group_size: json_int(gt=0, le=TOKENS_CEILING, description="tokens per K group (at most the context)") = 32
    v_group_size: json_int(gt=0, le=TOKENS_CEILING, description="channels per V group (a divisor of head_dim)"
                           ) | None = None
    artifact_id: str | None = None
    artifact_file: str | None = None
    sides: Sides = "kv"
    # Keep each layer's dequantized reused K/V for the whole block (faster, saves no memory within a block).
    keep_dequantized: StrictBool = False
    # Subtract each quantized key's expected rounding inflation from its attention score (issue 33;
    # `service.quant.key_bias`). Off: the attention is exactly what it was without the field.
    key_bias_correction: StrictBool = False

    @model_validator(mode="before")
    @classmethod
    def _accept_spellings(cls, data):
        """Map a method's own spellings (``policy_id`` ...) onto ``artifact_id`` / ``artifact_file``."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        method = data.get("method", "none")
        for spelling, (owner, generic) in registry.spellings().items():
            if data.get(spelling) is None:
                data.pop(spelling, None)
                continue
            if owner != method:
                raise _rule(f"{spelling} is only used by method {owner!r}, not {method!r}", spelling)
            if data.get(generic) is not None:
                raise _rule(f"give {spelling} or {generic}, not both", spelling)
            data[generic] = data.pop(spelling)
        return data

    @field_validator("method")
    @classmethod
    def _registered(cls, name: str) -> str:
        registry.method(name)  # KVQuantError listing the registered methods
        return name

    @model_validator(mode="after")
    def _check_artifacts(self) -> KVQuantConfig:
        entry = registry.method(self.method)
        given = [f for f in ("artifact_id", "artifact_file") if getattr(self, f) is not None]
        if entry.artifact is not None and len(given) != 1:
            names = [entry.spelling(f) for f in given] or "neither"
            raise _rule(f"method {self.method!r} needs exactly one of {entry.spelling('artifact_id')} or "
                        f"{entry.spelling('artifact_file')}, got {names}", entry.spelling("artifact_id"))
        if entry.artifact is None and given:
            raise _rule(f"{given[0]} is only used by methods with a fitted artifact "
                        f"({', '.join(registry.methods(with_artifact=True))}), not {self.method!r}", given[0])
        if self.key_bias_correction and (entry.quantizer is None or "k" not in self.sides):
            raise _rule(f"key_bias_correction corrects quantized keys; method {self.method!r} with sides "
                        f"{self.sides!r} quantizes none (use a quantizing method with sides 'kv' or 'k')",
                        "key_bias_correction")
        return self

    @model_serializer(mode="wrap")
    def _write_spellings(self, handler):
        """Write the reference under the method's own spellings, so stored and reported configs keep them, and
        leave out references that are not set: a KIVI config beside a dLLM-KVQ one (an activation's old and new)
        shows no ``artifact_id: null`` next to the other's ``policy_id``, so both read with the same keys. The
        unquantized cache (method ``none``) is written as ``{"method": "none"}``: bits and group sizes mean nothing
        there, and a report reading ``"bits": 4`` beside it would claim a quantization that did not happen."""
        out = handler(self)
        if self.method == "none":
            return {"method": "none"}
        if not self.key_bias_correction:
            # Written only when on, so every config stored or reported before the option reads as it did.
            out.pop("key_bias_correction", None)
        entry = registry.method(self.method)
        for generic in ("artifact_id", "artifact_file"):
            if generic not in out:
                continue
            value = out.pop(generic)
            if value is not None:
                out[entry.spelling(generic)] = value
        return out

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema, handler):
        """The fields, every registered method's spellings, and the reference rule as ``_check_artifacts`` and
        ``_accept_spellings`` apply it: a method with an artifact takes exactly one reference (generic or its own
        spelling), any other method none; a spelling belongs to its method (issue 13: the schema says what is
        refused)."""
        schema = handler(core_schema)
        target = handler.resolve_ref_schema(schema)
        spellings = registry.spellings()
        for spelling, (owner, generic) in spellings.items():
            target["properties"][spelling] = {"anyOf": [{"type": "string"}, {"type": "null"}],
                                              "description": f"method {owner}'s name for {generic}"}
        default = cls.model_fields["method"].default
        branches = []
        for name in registry.methods():
            entry = registry.method(name)
            own = ["artifact_id", "artifact_file", *entry.spellings.values()]
            props: dict = {"method": {"const": name}}
            props |= {s: {"type": "null"} for s, (owner, _) in spellings.items() if owner != name}
            branch: dict = {"properties": props, **({} if name == default else {"required": ["method"]})}
            if entry.artifact is None:
                props |= {ref: {"type": "null"} for ref in own}
            else:
                branch["oneOf"] = [{"required": [ref], "properties": {ref: {"type": "string"}}} for ref in own]
            branches.append(branch)
        target["allOf"] = [{"description": "a method with a fitted artifact takes exactly one reference to it, "
                                           "other methods none", "anyOf": branches}]
        return schema

    @classmethod
    def accepted_keys(cls) -> tuple[str, ...]:
        """Every key a config accepts: its fields and the registered methods' spellings (CLI, model_args)."""
        return (*cls.model_fields, *registry.spellings())

    def resolve_v_group_size(self, head_dim: int) -> int:
        """The V group size for a model with ``head_dim`` channels per head (default min(32, head_dim)).

        Raises:
            KVQuantError: the group size does not divide ``head_dim`` (the message lists the legal sizes).
        """
        size = self.v_group_size if self.v_group_size is not None else default_v_group_size(head_dim)
        if head_dim % size:
            raise KVQuantError(
                f"v_group_size {size} does not divide head_dim {head_dim}; legal: {legal_v_group_sizes(head_dim)}",
                "v_group_size",
            )
        return size

    def check_bounds(self, context: int, head_dim: int, default_v: bool = True) -> None:
        """Refuse group sizes whose cost does not follow from the model (issue 13: ``k_group_size`` 1e9 sized a
        16 GB table): a K group longer than the model's ``context`` (tokens), or a V group size that does not
        divide ``head_dim`` (with ``default_v`` false, only a V group size that is given).

        Raises:
            KVQuantError: naming ``k_group_size`` or ``v_group_size``.
        """
        if self.k_group_size > context:
            raise KVQuantError(f"k_group_size {self.k_group_size} is over the model's context of {context} tokens",
                               "k_group_size")
        if default_v or self.v_group_size is not None:
            self.resolve_v_group_size(head_dim)

    def check_cache_mode(self, cache_mode: str) -> None:
        """Refuse a quantizing method with cache mode ``none``: quantization acts only on the reused regions
        (DESIGN.md, "Rules that hold everywhere"), and full recompute reuses nothing, so the request would run
        unquantized while claiming a method.

        Raises:
            KVQuantError: ``method`` is not ``none`` and ``cache_mode`` is ``none``.
        """
        if self.method != "none" and cache_mode == "none":
            raise KVQuantError(f"method {self.method!r} quantizes the reused cache, and cache mode 'none' reuses "
                               "nothing; use 'prefix' or 'dual' ('block' on a block-causal model)", "cache_mode")


# A method's spelling never takes a field's name (`registry.register` refuses it).
registry.reserve(KVQuantConfig.model_fields)
