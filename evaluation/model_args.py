"""`EvalModelArgs`: the ``--model_args`` of the in-process lm-eval model ``dllm-kvq`` (validated, typed).

lm-eval parses ``--model_args key=value,...`` (or a JSON object) into keyword arguments; this model turns them into
the engine's load arguments, the decoding settings (`DecodeSettings`, inherited: the same fields, bounds and
defaults as the server's) and a `KVQuantConfig`. Unknown keys are refused with the list
of legal ones (a typo must not silently fall back to a default).
"""

from __future__ import annotations

import typing
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, model_validator

from service.commands import describe_validation_error
from service.engine.params import DecodeSettings
from service.quant.config import KVQuantConfig


def kv_fields() -> tuple[str, ...]:
    """Keys of `KVQuantConfig` accepted directly as model_args (``method=dllm_kvq,bits=4,policy_id=...``): its
    fields and the registered methods' spellings of the artifact reference, as registered now
    (`KVQuantConfig.accepted_keys`: a method registered after import is taken too)."""
    return KVQuantConfig.accepted_keys()

#: ``model=embedded``: the embedded default model (the name it serves under, and lm-eval's folder for its results).
EMBEDDED = "embedded"


def _takes_text(annotation: Any) -> bool:
    """Whether a field's type takes a string (``str``, or a ``Literal`` of strings), anywhere in a union."""
    if annotation is str:
        return True
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is Literal:
        return any(isinstance(a, str) for a in args)
    return any(_takes_text(a) for a in args if not isinstance(a, (str, int, float)))


def _from_text(name: str, value: Any) -> Any:
    """A `KVQuantConfig` value as ``key=value`` text gives it (``bits=2``, ``keep_dequantized=true``), read as its
    field's type where that takes no text (as lm-eval's own parsing reads numbers and booleans); any other value,
    and every value of a field that takes text (``method``, ids, ``sides``), as it is."""
    field = KVQuantConfig.model_fields.get(name)
    if not isinstance(value, str) or field is None or _takes_text(field.annotation):
        return value
    text = value.strip().lower()
    if text in ("true", "false", "none"):
        return {"true": True, "false": False, "none": None}[text]
    try:
        return int(text)
    except ValueError:
        return value


class ModelArgsError(ValueError):
    """Bad ``--model_args`` of ``dllm-kvq``: the message (one line) names the key and what is legal."""


class EvalModelArgs(DecodeSettings):
    """Every model_arg of ``dllm-kvq`` (README "Evaluate with lm-eval" has the table).

    Attributes:
        model: checkpoint dir or HF repo id (offline cache); None or ``embedded`` = the embedded default model
            (`checkpoint` gives what `Engine.load` takes).
        dtype, device, threads: `Engine.load` arguments (``threads`` sets torch's intra-op threads).
        cache_mode, block_length, threshold, steps, remasking, ignore_eos, dream_schedule: the decoding settings
            (`service.engine.params.DecodeSettings`; paper: dual, 32, 0.9). ``steps`` alone replaces the threshold.
        batch_size: prompts decoded together (rows of one engine batch); results do not depend on it.
        max_gen_toks: response tokens when the task gives no ``max_gen_toks`` (lm-eval's API models use the
            same name and default, 256); the decoded window is ``response_length(max_gen_toks, block_length)``.
        store: store URL (``redis://...`` or a directory) for an artifact id; None: the default store
            (``DLLM_STORE_URL``, else ``.dllm-kvq/store``, as every command).
        method, bits, k_group_size, v_group_size, artifact_id, artifact_file (or a registered method's spelling
            of them: policy_id, policy_file, kvquant_state_id, kvquant_state_file ...), sides, keep_dequantized,
            key_bias_correction: the `KVQuantConfig` (paper Appendix "KIVI and KVQuant Adaptations"), gathered
            into ``kv`` (`kv_fields`) and read as attributes.
        mc_num, mc_batch_size: Monte-Carlo samples per likelihood and samples per forward pass
            (`evaluation.likelihood`; the LLaDA authors use 128 and 32).
        check_greedy: compute lm-eval's ``is_greedy`` (costs one forward per continuation token; default off).
        seed: base seed of sampling (temperature > 0) and of the Monte-Carlo masks.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"
    threads: int | None = Field(None, ge=1)
    batch_size: int = Field(1, ge=1)
    max_gen_toks: int = Field(256, gt=0)
    store: str | None = None
    #: The `KVQuantConfig` keys given (`kv_fields`), as given; validated by :attr:`kv_config`.
    kv: dict[str, Any] = Field(default_factory=dict)
    mc_num: int = Field(128, gt=0)
    mc_batch_size: int = Field(32, gt=0)
    check_greedy: bool = False
    seed: int = 1234

    @model_validator(mode="before")
    @classmethod
    def _gather_kv(cls, data: Any) -> Any:
        """Move the `KVQuantConfig` keys (`kv_fields`) into ``kv``: the configuration declares them, not this
        class."""
        if not isinstance(data, dict):
            return data
        keys = set(kv_fields())
        kv = {k: _from_text(k, v) for k, v in data.items() if k in keys}
        rest = {k: v for k, v in data.items() if k not in keys}
        return rest | {"kv": {**rest.get("kv", {}), **kv}}

    def __getattr__(self, name: str) -> Any:
        """A `KVQuantConfig` key reads as the configuration's value (``args.bits``, ``args.k_group_size``)."""
        if name in kv_fields() and name != "kv":
            return getattr(self.kv_config, name, None)
        return super().__getattr__(name)

    @model_validator(mode="after")
    def _check(self) -> EvalModelArgs:
        if (self.threshold is None) == (self.steps is None):
            raise ValueError("give exactly one of threshold (e.g. 0.9) and steps (then threshold=none)")
        if self.mc_num % self.mc_batch_size:
            raise ValueError(f"mc_num ({self.mc_num}) must be a multiple of mc_batch_size ({self.mc_batch_size})")
        self.kv_config  # noqa: B018 - validates the KV fields now, with KVQuantConfig's messages
        return self

    @property
    def checkpoint(self) -> str | None:
        """What `Engine.load` takes: the checkpoint, or None for the embedded default model."""
        return None if self.model in (None, EMBEDDED) else self.model

    @property
    def kv_config(self) -> KVQuantConfig:
        """The `KVQuantConfig` these arguments name."""
        return KVQuantConfig(**self.kv)

    @classmethod
    def parse(cls, raw: dict) -> EvalModelArgs:
        """Validate lm-eval's keyword arguments; `ModelArgsError` (one line) lists the legal keys or values on a bad
        one."""
        legal = [*(f for f in cls.model_fields if f != "kv"), *kv_fields()]
        unknown = sorted(set(raw) - set(legal))
        if unknown:
            raise ModelArgsError(f"unknown model_args {unknown}; legal: {', '.join(legal)}")
        try:
            return cls(**raw)
        except ValidationError as exc:
            raise ModelArgsError(f"bad model_args for dllm-kvq: {describe_validation_error(exc)}") from exc
