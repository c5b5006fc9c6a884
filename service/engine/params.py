"""Decoding parameters, declared once.

`DecodeSettings` is the one declaration of every decoding setting a user may choose (field, type, bounds, default,
help). Everything else is derived from its fields: the server's defaults (`service.config.Settings` inherits them:
``DLLM_<NAME>`` and ``serve --<name>``), the request fields of every route (:func:`optional_fields`, each ``None``
= not given), the ``generate`` CLI flags (`service.commands.add_model_flags`) and the lm-eval model_args
(`evaluation.model_args.EvalModelArgs` inherits them). A request resolves its value, else the server's default,
else the built-in default (:func:`resolve`, the way vLLM's protocol models build ``SamplingParams``).

`DecodeParams` adds the decode window (``gen_length``) and is what a batch shares; `RowOptions` may differ per row.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictFloat,
    ValidationError,
    WrapValidator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from service.engine.errors import EngineInputError

#: How much of the K/V a step reuses (DESIGN.md "Words"): none (full recompute), prefix, dual; block: the exact
#: append-only cache of block-causal families (LLaDA2, `service.engine.block_causal`), refused by the others.
CacheMode = Literal["none", "prefix", "dual", "block"]
#: The cache modes that hold an active KV configuration in the store: what ``PUT /admin/active/{cache_mode}`` takes.
#: ``block`` (LLaDA2's) has none of its own: it serves ``prefix``'s (`service.engine.models.configured_cache_mode`).
ConfiguredCacheMode = Literal["none", "prefix", "dual"]


#: The two fields that together choose the schedule: confidence threshold, or a fixed number of steps.
SCHEDULE_FIELDS = ("threshold", "steps")
#: LLaDA2.1's token editing (`service.engine.block_causal`): any of them given decodes with 2.1's algorithm on a
#: block-causal model; a family whose reveal rule does not edit refuses each by name (`service.engine.reveal`).
EDITING_FIELDS = ("editing_threshold", "max_post_steps", "min_transfer")
#: DiffusionGemma's renoising (`service.engine.renoise`): unset is the checkpoint's ``generation_config.json`` value,
#: else the reference's default; a family that does not renoise refuses each by name (its decoder's settings rules).
RENOISING_FIELDS = ("max_denoising_steps", "entropy_bound", "t_min", "t_max", "stability_threshold",
                    "confidence_threshold")

# ---- bounds (issue 13: the cost of a request is bounded before it is admitted) -------------------------------------
#: A static ceiling on every token count (block length, steps, max_tokens, group sizes), so the published schema
#: states a bound; the real bound is the loaded model's context, checked at admission (:meth:`DecodeParams.check_bounds`,
#: `service.quant.config.KVQuantConfig.check_bounds`).
TOKENS_CEILING = 1 << 20
#: Most stop strings of one request. OpenAI's API allows 4; lm-eval sends a task's ``until`` strings plus EOS as
#: ``stop`` (humaneval: 5 + 1, the ``*-cot-llama`` tasks: 5 + 1), and vLLM takes any number: 16 fits every lm-eval
#: 0.4.13 task with room. Each costs a scan of the response text per committed block.
MAX_STOP_STRINGS = 16
#: Characters per stop string (streaming holds back a tail as long as the longest stop string).
MAX_STOP_CHARS = 256
#: The rule a refused ``stop`` is told (the union's own error named only its first branch: "Input should be a
#: valid string").
STOP_RULE = (f"stop is one string or a list of at most {MAX_STOP_STRINGS} strings, each of 1-{MAX_STOP_CHARS} "
             "characters")
#: A static ceiling on the choices (``n``) of one request; the server's ``max_n`` setting is the real bound.
N_CEILING = 128
#: Most alternatives per token a request may ask for (OpenAI chat's ``top_logprobs`` bound).
MAX_TOP_LOGPROBS = 20
#: Sampling temperature range (OpenAI's 0..2).
Temperature = Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)]
#: Temperatures below this decode exactly as greedy (temperature 0; :class:`RowOptions`). Sampling divides the
#: logits by the temperature (Dream) or raises the noise to its power (LLaDA): at 1e-38 Dream's float32 logits / T
#: overflowed to inf and its softmax to NaN (64 copies of id 0), and well before that the tempered distribution is
#: one-hot in float32, so sampling there only adds noise draws and ties to what greedy decides. Dream's confidence is
#: the tempered probability (its reference ``sample_tokens``): from this temperature up it is ~1 for a sharp model,
#: so a Dream threshold reveals a block in very few steps, as the reference does (`service.engine.sampling`).
GREEDY_BELOW = 1e-2
#: A seed ``torch.Generator.manual_seed`` accepts: [-2^63, 2^64).
Seed = Annotated[int, Field(ge=-(1 << 63), lt=1 << 64)]
#: One stop string: non-empty, at most MAX_STOP_CHARS characters.
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


def _stop_problem(value: Any) -> str:
    """What is wrong with a refused ``stop`` value, in a few words."""
    if isinstance(value, str):
        return f"a string of {len(value)} characters"
    if not isinstance(value, list):
        return f"a {type(value).__name__}"
    if len(value) > MAX_STOP_STRINGS:
        return f"{len(value)} strings"
    for i, item in enumerate(value):
        if not isinstance(item, str):
            return f"item {i} is a {type(item).__name__}"
        if not 1 <= len(item) <= MAX_STOP_CHARS:
            return f"item {i} has {len(item)} characters"
    return "an empty list" if not value else repr(value)[:80]


def _stop_rule(value: Any, handler: Any) -> Any:
    try:
        return handler(value)
    except ValidationError:
        raise PydanticCustomError("stop_rule", "{rule}; got {got}",
                                  {"rule": STOP_RULE, "got": _stop_problem(value)}) from None


#: The stop field of the HTTP routes: one string or up to MAX_STOP_STRINGS of them; a refusal states the rule.
Stop = Annotated[StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)],
                 WrapValidator(_stop_rule)]


def _integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


def json_int(*constraints: Any, **field: Any) -> Any:
    """JSON Schema's ``integer`` as a request field: ``8`` or ``8.0`` (JSON Schema calls both integers, and
    pydantic's strict int refuses the second), never ``"8"`` or ``true`` (which its lax int takes).
    ``constraints`` (annotated-types metadata) and ``field`` (``Field`` arguments: bounds, schema extras) bound it;
    they come before the conversion so that the schema states them as ``minimum`` / ``maximum``."""
    return Annotated[int, *constraints, Field(**field), BeforeValidator(_integral), Strict()]


class DecodeSettings(BaseModel):
    """Block-diffusion decoding settings (Fast-dLLM semantics; see `service.engine.decode`).

    Exactly one of ``threshold`` (confidence-threshold parallel decoding, Fast-dLLM Sec. 3.3) and ``steps``
    (fixed schedule, total over all blocks) is set; giving ``steps`` alone clears the default threshold.
    Add a setting here (and use it in the decode loop): the server, every route, the CLI and evaluation get it.
    """

    model_config = ConfigDict(extra="forbid")

    cache_mode: CacheMode = Field("dual", description="none (full recompute), prefix or dual; block for block-causal models (LLaDA2)")
    block_length: int = Field(32, gt=0, le=TOKENS_CEILING,
                              description="tokens per block (at most the model's context)")
    threshold: float | None = Field(
        0.9, ge=0.0, le=1.0, description="confidence threshold of parallel decoding (0 reveals a block at once)"
    )
    steps: int | None = Field(
        None, gt=0, le=TOKENS_CEILING,
        description="total denoising steps over all blocks (fixed schedule instead of threshold), at most the "
        "response length (one token per step)"
    )
    remasking: Literal["low_confidence", "random"] = Field(
        "low_confidence", description="which masked positions a fixed schedule reveals (random: LLaDA only)"
    )
    ignore_eos: bool = Field(False, description="decode every block even after an EOS")
    # "origin" is Dream's whole-sequence algorithm (the paper's full-attention row); "block" is the block-wise
    # no-cache schedule consistent with the cached modes (full recompute).
    dream_schedule: Literal["origin", "block"] = Field(
        "origin", description="Dream with cache_mode none: whole-sequence (origin) or block-wise full recompute"
    )
    # LLaDA2.1's token editing (docs/llada2.md): unset is the family's default (on with 0.9 / 16 / 1 on a 2.1
    # checkpoint, off on 2.0); any of them given turns it on. Another family refuses them by name.
    editing_threshold: float | None = Field(
        None, ge=0.0, le=1.0, allow_inf_nan=False, description="LLaDA2 token editing: replace a revealed token the "
        "model predicts as another above this probability (a probability, 0 to 1; 1: never, no probability is "
        "above it); giving any editing setting turns editing on "
        "(unset: 0.9 on a LLaDA2.1 checkpoint, no editing on 2.0; LLaDA2 only)"
    )
    max_post_steps: int | None = Field(
        None, ge=0, le=TOKENS_CEILING, description="LLaDA2 token editing: forwards after a block's last mask that "
        "may still edit (unset: 16; LLaDA2 only)"
    )
    min_transfer: int | None = Field(
        None, ge=1, le=TOKENS_CEILING, description="LLaDA2 token editing: reveals per forward at least (the "
        "reference's num_to_transfer; unset: 1; LLaDA2 only)"
    )

    # DiffusionGemma's renoising (docs/diffusion_gemma.md): unset is the checkpoint's generation_config.json value,
    # else the reference's default; the other families refuse them by name. The reference's own checks (t_max >
    # t_min) are `service.engine.renoise.RenoiseParams`'s.
    max_denoising_steps: int | None = Field(
        None, gt=0, le=TOKENS_CEILING, description="DiffusionGemma: decoder passes per canvas at most (unset: the "
        "checkpoint's, else 48; DiffusionGemma only)")
    entropy_bound: float | None = Field(
        None, gt=0.0, allow_inf_nan=False, description="DiffusionGemma: a step keeps the positions of lowest "
        "entropy while their summed entropy less the largest is at most this, in nats (unset: the checkpoint's, "
        "else 0.1; DiffusionGemma only)")
    t_min: float | None = Field(
        None, ge=0.0, allow_inf_nan=False, description="DiffusionGemma: the temperature the linear schedule ends "
        "at, below t_max (unset: the checkpoint's, else 0.4; DiffusionGemma only)")
    t_max: float | None = Field(
        None, gt=0.0, allow_inf_nan=False, description="DiffusionGemma: the temperature at a canvas's first step "
        "(unset: the checkpoint's, else 0.8; DiffusionGemma only)")
    stability_threshold: int | None = Field(
        None, ge=0, le=TOKENS_CEILING, description="DiffusionGemma: steps the argmax canvas must not change before "
        "it may stop (0: no stability condition; unset: the checkpoint's, else 1; DiffusionGemma only)")
    confidence_threshold: float | None = Field(
        None, gt=0.0, allow_inf_nan=False, description="DiffusionGemma: mean entropy (nats) under which a stable "
        "canvas stops (unset: the checkpoint's, else 0.005; DiffusionGemma only)")

    @model_validator(mode="before")
    @classmethod
    def _schedule(cls, data: Any) -> Any:
        """``steps`` given without ``threshold``: the fixed schedule replaces the default threshold. From text
        (CLI flags, lm-eval model_args, the environment) ``none`` means None for either."""
        if not isinstance(data, dict):
            return data
        data = {**data, **{k: None for k in SCHEDULE_FIELDS
                           if isinstance(data.get(k), str) and data[k].strip().lower() in ("none", "null")}}
        if data.get("steps") is not None and "threshold" not in data:
            data["threshold"] = None
        return data

    def decode_settings(self) -> dict[str, Any]:
        """The values of the decoding settings only (a subclass such as `Settings` holds more fields)."""
        return {name: getattr(self, name) for name in DecodeSettings.model_fields}


class DecodeParams(DecodeSettings):
    """Batch-level settings: the decoding settings and the decode window ``gen_length`` (tokens, a multiple of
    ``block_length``; see :func:`response_length`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gen_length: int = Field(256, gt=0, description="response positions decoded (whole blocks)")

    def check_bounds(self, context: int) -> None:
        """Refuse settings whose cost does not follow from the model and the request (issue 13): a block longer
        than the model's ``context`` (tokens), more steps than response positions (a step that can reveal
        nothing is work without output).

        Raises:
            EngineInputError: naming the field (``block_length``, ``steps``).
        """
        if self.block_length > context:
            raise EngineInputError(f"block_length {self.block_length} is over the model's context of {context} "
                                   "tokens", "block_length")
        if self.steps is not None and self.steps > self.gen_length:
            raise EngineInputError(f"steps {self.steps} is over the response length of {self.gen_length} positions "
                                   "(max_tokens rounded up to whole blocks): each step reveals at least one token",
                                   "steps")


def optional_fields(schema_extra: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The decoding settings as optional request fields: same type, bounds and help, default ``None`` (not
    given), for ``pydantic.create_model``. Request fields are strict (JSON ``0`` is not a boolean, ``"4"`` and
    ``4.0`` are not integers, ``"0.5"`` is not a number); the server's settings keep pydantic's coercion for the
    environment's text (integers: :func:`json_int`). ``schema_extra`` adds JSON Schema keys to a field's non-null schema (the HTTP layer marks
    bounds that the loaded model decides, `service.api.openapi`)."""
    fields = {}
    for name, field in DecodeSettings.model_fields.items():
        base = field.annotation
        if base in (int | None, float | None):
            base = int if base == int | None else float
        extra = (schema_extra or {}).get(name) or {}
        if base is int:
            annotation = json_int(*field.metadata, json_schema_extra=extra or None)
        else:
            strict = {bool: StrictBool, float: StrictFloat}.get(base, base)
            metadata = [*field.metadata, *([Field(json_schema_extra=extra)] if extra else [])]
            annotation = Annotated[strict, *metadata] if metadata else strict
        fields[name] = (annotation | None, Field(None, description=f"{field.description} (default: the server's)"))
    return fields


def resolve(given: dict[str, Any], defaults: DecodeSettings | None, gen_length: int) -> DecodeParams:
    """`DecodeParams` from a request's values (``None`` = not given), then ``defaults`` (the server's), then the
    built-in defaults.

    The schedule is one choice: if the request names ``threshold`` or ``steps``, both come from the request (the
    other is then None); otherwise both come from the defaults.

    Raises:
        pydantic.ValidationError: a value outside the declared bounds.
    """
    base = (defaults or DecodeSettings()).decode_settings()
    chosen = {k: v for k, v in given.items() if k in DecodeSettings.model_fields and v is not None}
    if any(k in chosen for k in SCHEDULE_FIELDS):
        chosen = {**{k: None for k in SCHEDULE_FIELDS}, **chosen}
    return DecodeParams(**{**base, **chosen, "gen_length": gen_length})


class RowOptions(BaseModel):
    """Per-row settings inside a batch: sampling temperature (below :data:`GREEDY_BELOW` it is 0: greedy), seed,
    stop strings, ``max_tokens`` (the most response tokens returned, EOS included; None: the whole decode window;
    see `service.engine.response`), the grammar the response must follow (None: unconstrained;
    `service.engine.grammar`) and how many log-probability alternatives to capture."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    temperature: Annotated[Temperature, AfterValidator(lambda t: 0.0 if t < GREEDY_BELOW else t)] = 0.0
    seed: Seed | None = None
    stop: tuple[str, ...] = ()
    max_tokens: int | None = Field(None, gt=0)
    # A `service.engine.grammar.CompiledGrammar`; typed Any at run time so that importing the settings (every
    # command's --help) does not import the grammar engine, which imports torch and transformers.
    grammar: Any = Field(None, exclude=True)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="capture each revealed token's "
                                 "log-probability and this many alternatives (None: capture nothing)")


def decode_window(max_new_tokens: int, block_length: int | None, canvas_length: int | None,
                  default_block_length: int) -> tuple[int, int]:
    """The decode window and block of a request for ``max_new_tokens`` tokens: ``(gen_length, block_length)``, both
    in tokens. One rule for the server (`service.api.planning`) and the in-process lm-eval model (`evaluation.lm`).

    Args:
        max_new_tokens: requested response tokens, >= 1.
        block_length: the block length the caller gave, or None (not given).
        canvas_length: the model's canvas (`ModelSpec.canvas_length`, DiffusionGemma), or None: the block is then
            ``block_length``, else ``default_block_length`` (the server's default).
        default_block_length: the block length used when none is given (and the model has no canvas), >= 1.

    Returns:
        With a canvas: ``(ceil(max_new_tokens / canvas_length) * canvas_length, canvas_length)``, the reference's
        rule for ``max_new_tokens`` (the default block length does not size it: 32 once rounded max_tokens 1 up to
        two canvases of 16). Without: ``(response_length(max_new_tokens, block), block)``.

    Raises:
        EngineInputError: a given ``block_length`` other than the canvas (naming ``block_length``).
        ValueError: as :func:`response_length`.
    """
    if canvas_length is None:
        block = block_length or default_block_length
        return response_length(max_new_tokens, block), block
    if block_length is not None and block_length != canvas_length:
        raise EngineInputError(f"block_length {block_length} is not served by this model: its block is the "
                               f"checkpoint's canvas of {canvas_length} tokens (canvas_length), and max_tokens is "
                               f"decoded in whole canvases; send {canvas_length} or leave block_length unset",
                               "block_length")
    return response_length(max_new_tokens, canvas_length), canvas_length


def response_length(max_new_tokens: int, block_length: int) -> int:
    """The number of response positions decoded for a request asking for ``max_new_tokens`` tokens.

    One rule for every path that turns a client's length into a decode window: the server (OpenAI
    ``max_tokens``) and the in-process lm-eval model (a task's ``max_gen_toks``) both call this, so the same
    request decodes the same window either way. Block diffusion can only decode whole blocks (Fast-dLLM
    asserts ``gen_length % block_length == 0``), so the length is rounded **up** to the next multiple of
    ``block_length``; the response is then cut back to ``max_new_tokens`` tokens
    (`service.engine.response.cut_response`), so ``max_tokens`` is a hard upper bound as in OpenAI's API.

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
