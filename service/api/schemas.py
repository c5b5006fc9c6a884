"""Request and response models of the HTTP API (OpenAI-compatible, native, tokenizer, admin).

Protocol models only; the serving logic is in `service.api.serving`. Every request model forbids unknown fields
(a field that is neither OpenAI's nor ours is a 400 naming it). OpenAI fields this server cannot honour are
accepted by the schema and refused by :func:`unhonoured` with a 400 that names them, so that a client learns
why instead of getting a silent ignore (vLLM's servers are the reference for shapes).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, StrictBool, StrictInt, create_model

from service.engine.params import (
    TOKENS_CEILING,
    CacheMode,
    DecodeParams,
    DecodeSettings,
    Seed,
    Stop,
    Temperature,
    optional_fields,
    resolve,
)
from service.engine.report import DecodeReport
from service.quant.config import KVQuantConfig

MAX_TOKENS_HELP = "most response tokens returned (decoding runs whole blocks, the response is cut back)"


class StrictModel(BaseModel):
    """Unknown fields are refused, and every field is strictly typed (``1`` is not a boolean, ``"7"`` and ``7.0``
    are not integers; a float field takes a JSON integer)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(StrictModel):
    """OpenAI's ``stream_options``: with ``include_usage`` true the stream ends with one chunk holding the usage and
    ``choices: []`` (every earlier chunk has ``usage: null``); otherwise no usage is streamed."""

    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None


class DiffusionKnobs(create_model("DecodingFields", __base__=StrictModel, **optional_fields())):
    """Our extra fields: every decoding setting (`service.engine.params.DecodeSettings`, generated from its
    fields: same types, bounds and help; empty: the server's default) and the KV quantization (empty: the active
    configuration of the cache mode)."""

    kv_quant: KVQuantConfig | None = None

    def decode_params(self, defaults: DecodeSettings, gen_length: int) -> DecodeParams:
        """The request's `DecodeParams`: its values, else ``defaults`` (the server's), else the built-in ones."""
        return resolve(dict(self), defaults, gen_length)


class OpenAISampling(DiffusionKnobs):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: StrictInt | None = Field(None, ge=1, le=TOKENS_CEILING, description=MAX_TOKENS_HELP)
    temperature: Temperature | None = None
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int | None = Field(None, ge=1)
    stop: Stop | None = None
    seed: Seed | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class CompletionRequest(OpenAISampling):
    """``POST /v1/completions``: OpenAI's legacy completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: int | None = Field(None, ge=1)
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0)
    suffix: str | None = None


class TextPart(StrictModel):
    """A text part of a message's content (other part types are refused)."""

    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    """One chat message; ``developer`` is treated as ``system``."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        """The content as one string (parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(OpenAISampling):
    """``POST /v1/chat/completions``: OpenAI's chat completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1, le=TOKENS_CEILING)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    service_tier: str | None = None
    web_search_options: dict[str, Any] | None = None
    verbosity: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


# OpenAI fields we accept only at their neutral value: field -> (is it neutral?, what is legal).
_NEUTRAL: dict[str, tuple[Any, str]] = {
    "n": (lambda v: v in (None, 1), "only n = 1 is supported"),
    "best_of": (lambda v: v in (None, 1), "only best_of = 1 is supported"),
    "echo": (lambda v: not v, "echo is not supported"),
    "suffix": (lambda v: v is None, "suffix (insertion) is not supported"),
    "top_p": (lambda v: v in (None, 1.0), "only top_p = 1 is supported (diffusion decoding samples the full distribution)"),
    "frequency_penalty": (lambda v: v in (None, 0.0), "only frequency_penalty = 0 is supported"),
    "presence_penalty": (lambda v: v in (None, 0.0), "only presence_penalty = 0 is supported"),
    "logit_bias": (lambda v: not v, "logit_bias is not supported"),
    "logprobs": (lambda v: v is None or v is False, "logprobs are not supported"),
    "top_logprobs": (lambda v: v in (None, 0), "logprobs are not supported"),
    "response_format": (lambda v: v is None or v.get("type") == "text", "only response_format type 'text'"),
    "tools": (lambda v: not v, "tools are not supported"),
    "tool_choice": (lambda v: v in (None, "none"), "tools are not supported"),
    "functions": (lambda v: not v, "functions are not supported"),
    "function_call": (lambda v: v in (None, "none"), "functions are not supported"),
    "store": (lambda v: not v, "store = true is not supported (nothing is stored)"),
    "modalities": (lambda v: v in (None, ["text"]), "only the text modality"),
    "audio": (lambda v: v is None, "audio output is not supported"),
    "prediction": (lambda v: v is None, "predicted outputs are not supported"),
    "reasoning_effort": (lambda v: v is None, "reasoning_effort is not supported"),
    "web_search_options": (lambda v: v is None, "web search is not supported"),
    "verbosity": (lambda v: v is None, "verbosity is not supported"),
}


def unhonoured(request: BaseModel) -> tuple[str, str] | None:
    """The first field of ``request`` set to a value this server cannot honour, with what is legal, or None."""
    for name, (neutral, legal) in _NEUTRAL.items():
        if name in type(request).model_fields and not neutral(getattr(request, name)):
            return name, f"{name}={getattr(request, name)!r} cannot be honoured: {legal}"
    if getattr(request, "stream_options", None) is not None and not getattr(request, "stream", False):
        return "stream_options", "stream_options is only allowed with stream = true"
    return None


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


class CompletionChoice(BaseModel):
    """One choice of a completion (or of a streamed completion chunk)."""

    index: int
    text: str
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None


class CompletionResponse(BaseModel):
    """OpenAI's completion object; ``kv_config`` is our addition."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kv_config: dict[str, Any] | None = Field(None, description="the configuration snapshot the request ran with")


class ChatMessageOut(BaseModel):
    """The assistant's message."""

    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    """One choice of a chat completion."""

    index: int
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: Literal["stop", "length"]


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
    """The text delta of a streamed chat chunk."""

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    """One choice of a streamed chat chunk."""

    index: int
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None = None


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

    model: str | None = Field(None, description="checked against the served model, as on the OpenAI routes")
    prompt: str | list[int]
    chat: bool = Field(False, description="wrap a text prompt in the chat template as one user turn")
    max_tokens: StrictInt | None = Field(None, ge=1, le=TOKENS_CEILING, description=MAX_TOKENS_HELP)
    temperature: Temperature = 0.0
    seed: Seed | None = None
    stop: Stop | None = None


class GenerateResponse(DecodeReport):
    """The engine's report, plus the request id, the model, the prompt length and the configuration snapshot."""

    id: str
    model: str
    prompt_tokens: int
    kv_config: dict[str, Any]
    queue_s: float
    batch_size: int


# ---- tokenizer (lm-eval's RemoteTokenizer and vLLM's shapes) ---------------------------------------------------------
class TokenizeRequest(StrictModel):
    """``/tokenize``: a prompt, or chat messages rendered through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class TokenizeResponse(BaseModel):
    """Token ids, their count and the model's context length."""

    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(StrictModel):
    """``/detokenize``: token ids."""

    model: str | None = None
    tokens: list[Annotated[StrictInt, Field(ge=0, lt=1 << 63)]]


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
    """The change made: old and new configuration, when, by which key id."""

    fingerprint: str
    cache_mode: CacheMode
    at: float
    key_id: str | None
    old: KVQuantConfig | None
    new: KVQuantConfig


class EvalScoreReport(StrictModel):
    """What the evaluation job reports for one task under one configuration."""

    task: str = Field(min_length=1, max_length=200)
    scores: dict[str, FiniteFloat] = Field(min_length=1, description="metric name -> value (finite)")
    kv_quant: KVQuantConfig = Field(default_factory=KVQuantConfig)
    cache_mode: CacheMode
    model_fingerprint: str | None = Field(None, description="must be the loaded model's when given")
    limit: int | None = Field(None, ge=1, description="samples scored, if the task was cut")
    details: dict[str, Any] = Field(default_factory=dict)


class EvalScoreAck(BaseModel):
    """Where the evaluation report was stored, and when."""

    id: str = Field(description="store id of the stored report (kind eval_scores)")
    at: float
