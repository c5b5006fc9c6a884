"""Request and response models of the HTTP API (OpenAI-compatible, native, tokenizer, admin).

Protocol models only; the serving logic is in `service.api.serving`. Every request model forbids unknown fields
(a field that is neither OpenAI's nor ours is a 400 naming it) and declares what the server accepts once, for its
validation and its published schema alike (issue 13, `service.api.rules`): strict types, bounds, cross-field rules
(``rules``), and the OpenAI fields this server honours only at their neutral value (`service.api.rules.only`:
``top_p`` = 1, ``best_of`` = 1 ...; any other value is a 400 that names the field and says what is legal, so a client
learns why instead of getting a silent ignore). Bounds that the running server decides (the loaded model's context
length, vocabulary and name, the registered artifact kinds) are marked with :func:`from_server` and filled into the
document by `service.api.openapi`; the engine checks them. vLLM's servers are the reference for shapes.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictStr,
    ValidationError,
    WithJsonSchema,
    WrapValidator,
    create_model,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from service.api.rules import (
    AtMostOne,
    ExactlyOne,
    Given,
    Implies,
    Is,
    IsText,
    Not,
    NullOrHas,
    RuledModel,
    only,
)
from service.api.structured import StructuredOutputFields
from service.api.tools import OfferedTools, ToolCallIn, ToolFields
from service.engine.params import (
    EDITING_FIELDS,
    MAX_TOP_LOGPROBS,
    N_CEILING,
    RENOISING_FIELDS,
    TOKENS_CEILING,
    CacheMode,
    DecodeParams,
    DecodeSettings,
    Seed,
    Stop,
    Temperature,
    json_int,
    optional_fields,
    resolve,
)
from service.engine.report import DecodeReport
from service.quant.config import KVQuantConfig
from service.telemetry import LABEL_VALUE

MAX_TOKENS_HELP = ("most response tokens returned (decoding runs whole blocks, the response is cut back); the "
                   "prompt's tokens + max_tokens rounded up to whole blocks must fit the model's context")
#: What a generation request must also satisfy: the rules JSON Schema cannot state (arithmetic across fields, token
#: counts, the server's limits), for the operations' descriptions (a request that breaks one is a 400 naming the
#: field; `service.engine.engine.validate_request`, `service.runtime.loop`).
GENERATION_RULES = """Rules the schema cannot state (each refused with a 400 naming the field):

* the prompt's tokens (a text counts in the tokenizer's tokens, not characters, and must encode to at least one)
  plus the response positions (`max_tokens`, else the server's default, rounded up to whole blocks of
  `block_length`) fit the model's context (`max_model_len` of `/v1/models`);
* `steps` (the request's, or the server's default schedule) is a multiple of the number of blocks and at most the
  response positions; a Dream model needs at least 2 steps per block, except with cache mode `none` and
  `dream_schedule` `origin`;
* forward calls (`steps`, else the response positions) x (prompt + response positions) are within the server's
  `max_request_work`, and the request's KV memory fits the server's budget alone (code `over_memory_budget`);
* text is valid Unicode (no lone surrogate), and a text prompt does not hold the mask token's text (chat content is
  tokenized as text and may);
* a structured-output schema or regex (`response_format`, `structured_outputs`, `guided_*`) compiles within the
  grammar engine's limits (llguidance: its JSON Schema coverage, Rust regex syntax, bounded work, 5 s);
* chat: top_logprobs needs logprobs = true;
* chat: tool_choice other than none needs tools; tool names are unique, a named tool_choice is one of them, each
  function's parameters an object schema that compiles, and tool_choice other than none is not combined with a
  structured-output field (docs/api.md, "Tool calls")."""
#: The chat rules GENERATION_RULES states in words (`ChatCompletionRequest`).
TOP_LOGPROBS_RULE = "top_logprobs needs logprobs = true"
TOOL_CHOICE_RULE = "tool_choice other than none needs tools"

#: The JSON Schema extension key that :func:`from_server` writes and `service.api.openapi` replaces.
FROM_SERVER = "x-from-server"


def from_server(**keywords: str) -> dict[str, Any]:
    """``json_schema_extra`` marking JSON Schema keywords whose value the running server decides, e.g.
    ``from_server(maximum="longest_response")``; the names are those of `service.api.openapi.server_values`."""
    return {FROM_SERVER: keywords}


def exactly(value: bool | int | str) -> Any:
    """The one JSON value ``value``, its type included (pydantic's ``Literal`` also takes ``0`` for ``false`` and
    ``1.0`` for ``1``)."""
    kind, name = {bool: (StrictBool, "boolean"), int: (json_int(), "integer"), str: (StrictStr, "string")}[type(value)]

    def same(v: Any) -> Any:
        if v != value:
            raise PydanticCustomError("const", "Input should be {expected}", {"expected": repr(value)})
        return v

    return Annotated[kind, AfterValidator(same), WithJsonSchema({"type": name, "const": value})]


#: A prompt token id: below the model's vocabulary size and not its mask id (the engine checks both).
PromptTokenId = json_int(ge=0, json_schema_extra=from_server(maximum="last_token_id", **{"not": "mask_id"}))
#: Token ids of one prompt: at least one, and room for at least one response position in the context.
PromptIds = Annotated[list[PromptTokenId], Field(min_length=1, json_schema_extra=from_server(maxItems="longest_prompt"))]
#: A text prompt: not empty (its tokens, not its characters, count against the context).
PromptText = Annotated[str, Field(min_length=1)]
#: The rule a refused ``prompt`` is told (the union's own error named only its first branch: "Input should be a
#: valid string", also for token ids out of range or an empty list).
PROMPT_RULE = ("prompt is a non-empty string, a list of them, a non-empty list of token ids (integers from 0 up "
               "to the model's vocabulary size) or a list of such lists")


def _is_token_id(item: Any) -> bool:
    return (isinstance(item, int) and not isinstance(item, bool)) or (isinstance(item, float) and item.is_integer())


def _one_prompt_problem(value: Any, where: str) -> str | None:
    """What is wrong with one prompt (text or token ids) at ``where`` (``"item 2"``, or ``""`` for the whole
    prompt), in a few words; None when this check finds nothing (another rule refused it)."""
    at = f" at {where}" if where else ""
    if isinstance(value, str):
        return f"an empty prompt{at} (an empty string)" if not value else None
    if not isinstance(value, list):
        return f"a {type(value).__name__}{at}"
    if not value:
        return f"an empty prompt{at} (an empty list)"
    for i, item in enumerate(value):
        if not _is_token_id(item):
            return f"item {i}{' of ' + where if where else ''} is a {type(item).__name__}, not a token id"
        if item < 0:
            return f"token id {int(item)} (item {i}{' of ' + where if where else ''}) is out of range: ids are >= 0"
    return None


def prompt_problem(value: Any) -> str | None:
    """What is wrong with a refused ``prompt`` value (one prompt or a list of them), in a few words; None when
    nothing here explains the refusal."""
    if isinstance(value, list) and value and not all(_is_token_id(item) for item in value):
        if all(isinstance(item, str) for item in value) or all(isinstance(item, list) for item in value):
            for i, item in enumerate(value):
                problem = _one_prompt_problem(item, f"item {i}")
                if problem is not None:
                    return problem
            return None
        kinds = sorted({type(item).__name__ for item in value})
        return f"a list mixing {', '.join(kinds)}"
    return _one_prompt_problem(value, "")


def _prompt_rule(value: Any, handler: Any) -> Any:
    try:
        return handler(value)
    except ValidationError:
        problem = prompt_problem(value)
        if problem is None:
            raise
        raise PydanticCustomError("prompt_rule", "{got}; {rule}", {"got": problem, "rule": PROMPT_RULE}) from None
#: ``model``: the served model's name (or its checkpoint id); another name is a 404.
ModelName = Annotated[str, Field(json_schema_extra=from_server(enum="model_names"))]
#: A response length in tokens (``max_tokens``): room for at least one prompt token in the context.
ResponseTokens = json_int(ge=1, le=TOKENS_CEILING, json_schema_extra=from_server(maximum="longest_response"))
StrictTemperature = Annotated[Temperature, Field(strict=True)]
StrictSeed = json_int(*Seed.__metadata__)


class StrictModel(BaseModel):
    """Unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(StrictModel):
    """OpenAI's ``stream_options``: with ``include_usage`` true the stream ends with one chunk holding the usage and
    ``choices: []`` (every earlier chunk has ``usage: null``); otherwise no usage is streamed."""

    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None


#: Schedule fields and response lengths are bounded by the model's context (a block, the steps and the response
#: all fit in it beside a prompt of at least one token); ``remasking`` and ``dream_schedule`` by the model family's
#: reveal rule (``block`` schedule: Dream only), ``cache_mode`` by the family (``block``: block-causal ones only),
#: token editing's fields by whether the family edits (null only where it does not), the renoising fields by
#: whether the family renoises (DiffusionGemma; null only elsewhere).
_KNOB_BOUNDS = {"block_length": from_server(maximum="longest_response"),
                "steps": from_server(maximum="longest_response"),
                "remasking": from_server(enum="remasking"), "cache_mode": from_server(enum="cache_modes"),
                "dream_schedule": from_server(enum="dream_schedules"),
                **{name: from_server(**{"not": "token_editing"}) for name in EDITING_FIELDS},
                **{name: from_server(**{"not": "renoising"}) for name in RENOISING_FIELDS}}


class DiffusionKnobs(create_model("DecodingFields", __base__=RuledModel, **optional_fields(_KNOB_BOUNDS))):
    """Our extra fields: every decoding setting (`service.engine.params.DecodeSettings`, generated from its
    fields: same types, bounds and help; empty: the server's default) and the KV quantization (empty: the active
    configuration of the cache mode; fitted artifacts by store id only)."""

    kv_quant: KVQuantConfig | None = None

    rules = (
        AtMostOne("threshold", "steps"),
        Implies(Is("cache_mode", "none", server_default=True), NullOrHas("kv_quant", "method", "none", "none"),
                "a quantizing kv_quant method needs a cache mode that reuses the cache (prefix or dual; block on "
                "a block-causal model): cache mode 'none' reuses nothing", "cache_mode"),
    )

    def decode_params(self, defaults: DecodeSettings, gen_length: int) -> DecodeParams:
        """The request's `DecodeParams`: its values, else ``defaults`` (the server's), else the built-in ones."""
        return resolve(dict(self), defaults, gen_length)


class OpenAISampling(DiffusionKnobs, StructuredOutputFields):
    """Fields shared by completions and chat completions (the structured-output fields: `service.api.structured`)."""

    model: ModelName | None = None
    max_tokens: ResponseTokens | None = Field(None, description=MAX_TOKENS_HELP)
    temperature: StrictTemperature | None = None
    top_p: only(Annotated[float, Field(strict=True, ge=1.0, le=1.0)] | None,
                "only top_p = 1 is supported (diffusion decoding samples the full distribution)") = None
    n: json_int(ge=1, le=N_CEILING, json_schema_extra=from_server(maximum="max_n")) | None = Field(
        None, description="choices per prompt, decoded as rows of one cohort, each with its own seed (seed + index "
        "when a seed is given); at most the server's DLLM_MAX_N")
    stop: Stop | None = None
    seed: StrictSeed | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    frequency_penalty: only(Annotated[float, Field(strict=True, ge=0.0, le=0.0)] | None,
                            "only frequency_penalty = 0 is supported") = None
    presence_penalty: only(Annotated[float, Field(strict=True, ge=0.0, le=0.0)] | None,
                           "only presence_penalty = 0 is supported") = None
    logit_bias: only(Annotated[dict[str, float], Field(max_length=0)] | None, "logit_bias is not supported") = None
    user: str | None = None

    rules = (Implies(Given("stream_options"), Is("stream", True), "stream_options is only allowed with stream = true",
                     "stream_options"),)


_MAX_PROMPTS = from_server(maxItems="max_prompts")

# ---- log-probabilities and likelihoods (issue 25) ---------------------------------------------------------------------
#: Most Monte-Carlo samples one request may ask for per prompt ELBO (each split of the prompt costs that many rows).
MAX_MC_NUM = 4096
TopLogprobs = json_int(ge=0, le=MAX_TOP_LOGPROBS)
LOGPROBS_HELP = ("log-probability of each returned token as the model gave it at the step that revealed it, and "
                 "this many alternatives (0-20); with echo = true, the prompt's tokens get their Monte-Carlo ELBO "
                 "increments (docs/api.md, \"Log-probabilities\")")
ECHO_HELP = "the prompt before the completion; with logprobs, the prompt's tokens scored (max_tokens 0: only them)"
MC_NUM_HELP = ("our field: Monte-Carlo samples of each prompt ELBO of echo = true with logprobs (default: the "
               "server's DLLM_LIKELIHOOD_MC_NUM); a multiple of the server's DLLM_LIKELIHOOD_MC_BATCH_SIZE when above it")
RETURN_TOKEN_IDS_HELP = ("vLLM's field: each choice also carries its prompt's ids (prompt_token_ids) and the ids "
                         "it returned (token_ids), as cut for its text; always on for a checkpoint without a "
                         "tokenizer, whose text is empty; not streamed")
#: A completion's ``max_tokens``: 0 (only with echo: nothing generated, the prompt scored) or a response length.
CompletionTokens = json_int(ge=0, le=TOKENS_CEILING, json_schema_extra=from_server(maximum="longest_response"))


class CompletionRequest(OpenAISampling):
    """``POST /v1/completions``: OpenAI's legacy completions."""

    # More prompts than the queue can ever hold is a 400 naming prompt (a 429 would invite a vain retry).
    prompt: Annotated[PromptText | Annotated[list[PromptText], Field(min_length=1, json_schema_extra=_MAX_PROMPTS)]
                      | PromptIds | Annotated[list[PromptIds], Field(min_length=1, json_schema_extra=_MAX_PROMPTS)],
                      WrapValidator(_prompt_rule)]
    max_tokens: CompletionTokens | None = Field(None, description=MAX_TOKENS_HELP + "; 0 only with echo = true")
    best_of: only(exactly(1) | None, "only best_of = 1 is supported") = None
    echo: StrictBool | None = Field(None, description=ECHO_HELP)
    logprobs: TopLogprobs | None = Field(None, description=LOGPROBS_HELP)
    mc_num: json_int(ge=1, le=MAX_MC_NUM) | None = Field(None, description=MC_NUM_HELP)
    suffix: only(None, "suffix (insertion) is not supported") = None
    return_token_ids: StrictBool | None = Field(None, description=RETURN_TOKEN_IDS_HELP)

    rules = (
        Implies(Is("max_tokens", 0), Is("echo", True), "max_tokens 0 generates nothing: only with echo = true (the "
                "prompt and, with logprobs, its scores)", "max_tokens"),
        Implies(Given("mc_num"), Is("echo", True), "mc_num sets the samples of the prompt's ELBO: only with echo = "
                "true", "mc_num"),
        Implies(Is("echo", True), Not(Is("stream", True)), "echo is not streamed: send it with stream = false",
                "echo"),
        Implies(Is("return_token_ids", True), Not(Is("stream", True)), "return_token_ids is not streamed: send it "
                "with stream = false", "return_token_ids"),
    )


class TextPart(StrictModel):
    """A text part of a message's content (other part types are refused)."""

    type: Literal["text"]
    text: str


def _text_parts_only(value: Any, handler) -> Any:
    """Content refused for a part that is not text (an image, audio, a file) says so at the part's index
    (``messages.0.content.1``); pydantic's own error named the union's first branch ("Input should be a valid
    string")."""
    try:
        return handler(value)
    except ValidationError:
        if isinstance(value, list):
            for j, part in enumerate(value):
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise PydanticCustomError(
                        "unsupported_part", "content part {index} is of type {kind}: this model reads text only, so "
                        "image, audio and file parts are not supported; send text parts or a string",
                        {"index": j, "kind": repr(kind), "param": str(j)}) from None
        raise


#: A message's content: a string or a list of text parts; another part type is refused at its index.
MessageContent = Annotated[str | list[TextPart] | None, WrapValidator(_text_parts_only)]


class ChatMessage(RuledModel):
    """One chat message; ``developer`` is treated as ``system``. Only an assistant message may leave ``content``
    out or null (OpenAI's: its content is optional, every other role's is required). An assistant message may carry
    the ``tool_calls`` it made, a ``tool`` message the result of one (``tool_call_id``; `service.api.tools`)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: MessageContent = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: StrictStr | None = None

    rules = (Implies(Not(Is("role", "assistant")), Given("content"),
                     "content is required (a string or a list of text parts) in a system, developer, user or tool "
                     "message; only an assistant message may leave it out or null", "content"),
             Implies(Is("role", "tool"), Given("tool_call_id"), "a tool message needs the tool_call_id of the call "
                     "it answers", "tool_call_id"),
             Implies(Given("tool_calls"), Is("role", "assistant"), "only an assistant message carries tool_calls",
                     "tool_calls"))

    @property
    def text(self) -> str:
        """The content as one string (parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(OpenAISampling, ToolFields):
    """``POST /v1/chat/completions``: OpenAI's chat completions (tool calling: `service.api.tools`)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: ResponseTokens | None = Field(None, description="the same as max_tokens (OpenAI's newer "
                                                         "name)")
    logprobs: StrictBool | None = Field(None, description="each returned token's log-probability as the model gave "
                                        "it at the step that revealed it (docs/api.md, \"Log-probabilities\")")
    top_logprobs: TopLogprobs | None = Field(None, description="alternatives per token (0-20); needs logprobs = true")
    functions: only(Annotated[list[dict[str, Any]], Field(max_length=0)] | None, "functions are not supported") = None
    function_call: only(exactly("none") | None, "functions are not supported") = None
    store: only(exactly(False) | None, "store = true is not supported (nothing is stored)") = None
    metadata: dict[str, str] | None = None
    modalities: only(Annotated[list[exactly("text")], Field(min_length=1, max_length=1)] | None,
                     "only the text modality") = None
    audio: only(None, "audio output is not supported") = None
    prediction: only(None, "predicted outputs are not supported") = None
    reasoning_effort: only(None, "reasoning_effort is not supported") = None
    service_tier: str | None = None
    web_search_options: only(None, "web search is not supported") = None
    verbosity: only(None, "verbosity is not supported") = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    rules = (AtMostOne("max_tokens", "max_completion_tokens", param="max_completion_tokens"),)

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        # Not one of ``rules``: stated in the schema (allOf), this rule makes schemathesis' generator give up on the
        # whole operation ("Schema Error"), so GENERATION_RULES states it in words instead.
        if self.top_logprobs is not None and not self.logprobs:
            raise PydanticCustomError("request_rule", TOP_LOGPROBS_RULE, {"param": "top_logprobs"})
        return self

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self):
        # Stated in words for the same reason as top_logprobs' rule (as an allOf, schemathesis gives up).
        if self.tool_choice not in (None, "none") and not self.tools:
            raise PydanticCustomError("request_rule", TOOL_CHOICE_RULE, {"param": "tool_choice"})
        return self


# ---- OpenAI responses ------------------------------------------------------------------------------------------------
def _now() -> int:
    return int(time.time())


def new_id(prefix: str) -> str:
    """A request id such as ``cmpl-<32 hex>``."""
    return f"{prefix}-{uuid.uuid4().hex}"


class Usage(BaseModel):
    """Token counts: prompt, completion (the tokens returned, an ending EOS included), total."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy ``logprobs`` of a completion choice: per token its text, log-probability (None for the first
    prompt token of an echo: nothing precedes it), alternatives by text, and character offset in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    """One choice of a completion (or of a streamed completion chunk)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None
    # vLLM's names (``return_token_ids``): only when asked for, or when the checkpoint has no tokenizer.
    prompt_token_ids: list[int] | None = Field(None, description="the prompt's token ids (return_token_ids)")
    token_ids: list[int] | None = Field(None, description="the returned token ids, cut as the text is "
                                        "(return_token_ids)")

    @model_serializer(mode="wrap")
    def _token_ids_when_given(self, handler: Any) -> dict[str, Any]:
        """Left out, not null, when not asked for: the choice is then OpenAI's object exactly."""
        data = handler(self)
        return {k: v for k, v in data.items() if v is not None or k not in ("prompt_token_ids", "token_ids")}


class CompletionResponse(BaseModel):
    """OpenAI's completion object; ``kv_config`` is our addition."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kv_config: dict[str, Any] | None = Field(None, description="the configuration snapshot the request ran with")


class FunctionCallOut(BaseModel):
    """A call's function: its name and arguments (the JSON text of an object)."""

    name: str
    arguments: str


class ToolCallOut(BaseModel):
    """One call of a response (OpenAI's ``message.tool_calls[]``)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


def _without_absent_calls(self: BaseModel, handler: Any) -> dict[str, Any]:
    """The model's fields, ``tool_calls`` left out when there are none (OpenAI's messages carry it only then)."""
    data = handler(self)
    if data.get("tool_calls") is None:
        data.pop("tool_calls", None)
    return data


class ChatMessageOut(BaseModel):
    """The assistant's message: its text (null when it is calls) and its ``tool_calls`` (only when it made some)."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None

    _serialize = model_serializer(mode="wrap")(_without_absent_calls)


class TopLogprob(BaseModel):
    """One alternative of a chat token."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    """One returned token of a chat choice with its alternatives."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """OpenAI's chat ``logprobs``: the returned tokens in order."""

    content: list[ChatTokenLogprob] | None = None
    refusal: None = None


class ChatChoice(BaseModel):
    """One choice of a chat completion."""

    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletionResponse(BaseModel):
    """OpenAI's chat completion object; ``kv_config`` is our addition."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    kv_config: dict[str, Any] | None = None


class DeltaMessage(BaseModel):
    """The delta of a streamed chat chunk: text, or pieces of calls (OpenAI's: ``index``, ``id``, ``type`` and
    ``function.name`` in a call's first piece, ``function.arguments`` in later ones; only the keys a piece has)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    _serialize = model_serializer(mode="wrap")(_without_absent_calls)


class ChatChunkChoice(BaseModel):
    """One choice of a streamed chat chunk."""

    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletionChunk(BaseModel):
    """OpenAI's chat completion chunk."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    """One model of ``/v1/models`` (vLLM's fields)."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "dllm-kvq"
    max_model_len: int
    root: str


class ModelList(BaseModel):
    """``/v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---- native ----------------------------------------------------------------------------------------------------------
class GenerateRequest(DiffusionKnobs):
    """``POST /generate``: one prompt (text, or token ids) in, the engine's full `DecodeReport` out."""

    model: ModelName | None = Field(None, description="checked against the served model, as on the OpenAI routes")
    prompt: PromptText | PromptIds
    chat: StrictBool = Field(False, description="wrap a text prompt in the chat template as one user turn")
    max_tokens: ResponseTokens | None = Field(None, description=MAX_TOKENS_HELP)
    temperature: StrictTemperature = 0.0
    seed: StrictSeed | None = None
    stop: Stop | None = None

    rules = (Implies(Is("chat", True), IsText("prompt"), "chat applies to a text prompt, not token ids", "chat"),)


class GenerateResponse(DecodeReport):
    """The engine's report, plus the request id, the model, the prompt length and the configuration snapshot."""

    id: str
    model: str
    prompt_tokens: int
    kv_config: dict[str, Any]
    queue_s: float
    batch_size: int


# ---- tokenizer (lm-eval's RemoteTokenizer and vLLM's shapes) ---------------------------------------------------------
class TokenizeRequest(RuledModel, OfferedTools):
    """``/tokenize``: a prompt, or chat messages rendered through the chat template.

    ``prompt`` may itself be a list of chat messages: lm-eval's remote tokenizer (``local-completions`` with
    ``tokenizer_backend=remote`` and ``--apply_chat_template``) posts each request's chat history as ``prompt``;
    it is rendered through the chat template as ``messages`` is (``add_special_tokens`` does not apply then).
    ``tools`` (vLLM's ``TokenizeChatRequest`` field) go with chat messages and are rendered as
    ``/v1/chat/completions`` renders them: the ids are that route's prompt (``tool_choice`` does not change the
    prompt, and is not taken)."""

    model: ModelName | None = None
    prompt: str | Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True

    rules = (ExactlyOne("prompt", "messages"),
             Implies(Given("tools"), Not(IsText("prompt")), "tools go with chat messages (messages, or a prompt "
                     "that is a list of messages), not a text prompt", "tools"))


class TokenizeResponse(BaseModel):
    """Token ids, their count and the model's context length."""

    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(StrictModel):
    """``/detokenize``: token ids."""

    model: ModelName | None = None
    tokens: list[json_int(ge=0, json_schema_extra=from_server(maximum="last_decodable_id"))]


class DetokenizeResponse(BaseModel):
    """The text of the token ids."""

    prompt: str


# ---- admin -----------------------------------------------------------------------------------------------------------
class ArtifactList(BaseModel):
    """Stored artifacts of one kind with their size and creation time."""

    kind: str
    data: list[dict[str, Any]]


class ActiveView(BaseModel):
    """What this replica serves per cache mode, and the store's entries for this model."""

    model: str
    fingerprint: str
    serving: dict[str, dict[str, Any]]
    store: dict[str, dict[str, Any]]
    store_lost: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="per cache mode, the last time the store came back without the active configuration this "
        "replica serves: kv_quant, detected_at, restored_at (when this replica wrote it back), note",
    )
    not_ready: dict[str, str] = Field(
        default_factory=dict,
        description="per cache mode that cannot serve its configuration (the store's active entry, or the "
        "kv_quant setting without one, does not resolve or validate against the loaded model): why; its "
        "requests get 503 config_unavailable until a valid configuration is activated",
    )


class ActivateResponse(BaseModel):
    """The change made, as its audit entry records it (``GET /admin/audit``): old and new configuration, when, by
    which key id; and what this replica served before."""

    fingerprint: str
    cache_mode: CacheMode
    at: float
    key_id: str | None
    old: KVQuantConfig | None = Field(description="the store's previous active entry (null: the store had none, and "
                                      "replicas served their kv_quant setting); the audit entry's old")
    new: KVQuantConfig
    served_before: KVQuantConfig | None = Field(None, description="what this replica served for the cache mode "
                                                "before the change (its kv_quant setting when old is null)")
    configured_bits: dict[str, float] | None = Field(None, description="the new configuration's nominal K and V "
                                                     "bits on full groups (null: unquantized, or KVQuant)")


#: `service.telemetry.LABEL_VALUE` as a JSON Schema pattern (anchored: JSON Schema patterns search).
LABEL_PATTERN = f"^{LABEL_VALUE.pattern}$"
#: Metrics in one evaluation report (each is a metric series).
MAX_SCORES = 64


class EvalScoreReport(StrictModel):
    """What the evaluation job reports for one task under one configuration."""

    # The label rule (`service.telemetry.check_label_value`, checked by the admin route) published in the schema.
    task: str = Field(min_length=1, max_length=200, json_schema_extra={"pattern": LABEL_PATTERN, "maxLength": 128},
                      description="a metric label: 1-128 characters of letters, digits and _ . , : / + = @ - or space")
    scores: dict[str, Annotated[StrictFloat, Field(allow_inf_nan=False)]] = Field(
        min_length=1, description="metric name (a label, as task) -> value (finite); at most 64 metrics",
        json_schema_extra={"propertyNames": {"pattern": LABEL_PATTERN}, "maxProperties": MAX_SCORES})
    kv_quant: KVQuantConfig = Field(default_factory=KVQuantConfig)
    cache_mode: CacheMode
    model_fingerprint: Annotated[str, Field(json_schema_extra=from_server(enum="fingerprint"))] | None = Field(
        None, description="must be the loaded model's when given")
    limit: json_int(ge=1) | None = Field(None, description="samples scored, if the task was cut")
    details: dict[str, Any] = Field(default_factory=dict)


class EvalScoreAck(BaseModel):
    """Where the evaluation report was stored, and when."""

    id: str = Field(description="store id of the stored report (kind eval_scores)")
    at: float
