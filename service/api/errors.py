"""The one mapping from typed exceptions to HTTP errors in OpenAI's shape.

Every error answer is ``{"error": {"message", "type", "param", "code"}}`` (OpenAI's body; ``code`` is a short
machine-readable reason). ``param`` is the ``field`` the error carries (engine, quantizer, artifact and store
errors name the offending input when they raise it; nothing here parses messages). :data:`MAPPING` decides the status of each exception type raised inside the server;
anything not listed is a 500 whose message does not leak internals. Whether a worker error is fatal is decided
by the worker (`service.runtime.loop.is_device_fault`), which then fails readiness.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.artifacts.base import ArtifactMismatch
from service.engine.errors import EngineInputError, GrammarLaneFull, validation_message
from service.engine.grammar import GrammarViolation
from service.runtime.loop import BatchFailed, JobCancelled, QueueFull, RequestTooLarge, WorkerUnavailable
from service.store.active import ConfigUnavailable
from service.store.base import (
    AmbiguousId,
    ArtifactConflict,
    ArtifactInUse,
    ArtifactNotFound,
    ArtifactUnfit,
    ConfigInvalid,
    EntryUnreadable,
    InvalidName,
    StoreAccessDenied,
    StoreUnavailable,
)

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An error raised by the API layer itself, with its status, OpenAI ``type``, ``code`` and ``param``."""

    status: int = 400
    type: str = "invalid_request_error"
    code: str = "invalid_request"

    def __init__(self, message: str, param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.headers = headers


class InvalidRequest(ApiError):
    """A request the server cannot serve as asked (unhonourable value, prompt too long, no tokenizer ...)."""


class InvalidJSON(ApiError):
    """A body that is empty, not UTF-8 JSON, not a JSON object, nested too deep, or holding NaN/Infinity."""

    code = "invalid_json"


class BodyTooLarge(ApiError):
    """A request body over the server's limit (``DLLM_MAX_BODY_BYTES``), refused before it is parsed (413)."""

    status, code = 413, "body_too_large"


class UnsupportedMediaType(ApiError):
    """A body sent as something other than JSON (``Content-Type``), or compressed (``Content-Encoding``) (415)."""

    status, code = 415, "unsupported_media_type"


class ArtifactRejected(ApiError):
    """An uploaded or activated policy/state that does not fit the loaded model (nothing was stored)."""

    status, code = 422, "artifact_rejected"


class Unauthorized(ApiError):
    """A missing or wrong bearer key (401)."""

    status, type, code = 401, "authentication_error", "invalid_api_key"


class AdminClosed(ApiError):
    """Admin routes with no admin key configured (403)."""

    status, type, code = 403, "permission_error", "admin_disabled"


class NotFound(ApiError):
    """An unknown model or route (404)."""

    status, type, code = 404, "not_found_error", "not_found"


class RequestTimeout(ApiError):
    """A request older than ``request_timeout_s`` (504)."""

    status, type, code = 504, "timeout_error", "request_timeout"


# exception type -> (status, OpenAI type, code). First match in order wins (subclasses before bases).
MAPPING: list[tuple[type[BaseException], int, str, str]] = [
    (QueueFull, 429, "rate_limit_error", "queue_full"),
    (GrammarLaneFull, 429, "rate_limit_error", "grammar_lane_full"),
    (RequestTooLarge, 400, "invalid_request_error", "over_memory_budget"),
    (WorkerUnavailable, 503, "service_unavailable_error", "not_ready"),
    (StoreUnavailable, 503, "service_unavailable_error", "store_unavailable"),
    (StoreAccessDenied, 503, "service_unavailable_error", "store_access_denied"),
    (EntryUnreadable, 503, "service_unavailable_error", "store_unreadable"),
    (ConfigUnavailable, 503, "service_unavailable_error", "config_unavailable"),
    (BatchFailed, 500, "server_error", "batch_failed"),
    (JobCancelled, 499, "invalid_request_error", "cancelled"),
    (ArtifactNotFound, 404, "not_found_error", "artifact_not_found"),
    (ArtifactInUse, 409, "conflict_error", "artifact_in_use"),
    (ArtifactConflict, 409, "conflict_error", "artifact_conflict"),
    (ArtifactMismatch, 422, "invalid_request_error", "artifact_rejected"),
    (ArtifactUnfit, 422, "invalid_request_error", "artifact_rejected"),
    (ConfigInvalid, 400, "invalid_request_error", "invalid_config"),
    (AmbiguousId, 400, "invalid_request_error", "ambiguous_id"),
    (InvalidName, 400, "invalid_request_error", "invalid_name"),
    (EngineInputError, 400, "invalid_request_error", "invalid_input"),
    # A grammar that compiled but failed mid-decode (the grammar engine's work limit): the schema's fault, as
    # vLLM answers a schema its backend cannot use (400); ``param`` names the field.
    (GrammarViolation, 400, "invalid_request_error", "structured_output_failed"),
]


# An engine field that a request names otherwise: the decode window is asked for as max_tokens.
REQUEST_PARAM = {"gen_length": "max_tokens"}


def error_body(message: str, type_: str, code: str | None, param: str | None) -> dict[str, Any]:
    """The OpenAI error body."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def classify(exc: BaseException) -> tuple[int, dict[str, Any], dict[str, str] | None]:
    """Status, body and headers for any exception (the one place that decides)."""
    if isinstance(exc, ApiError):
        return exc.status, error_body(str(exc), exc.type, exc.code, exc.param), exc.headers
    for cls, status, type_, code in MAPPING:
        if isinstance(exc, cls):
            field = getattr(exc, "field", None)
            param = REQUEST_PARAM.get(field, field)
            busy = isinstance(exc, QueueFull | StoreUnavailable | GrammarLaneFull)
            retry = getattr(exc, "retry_after_s", None) if busy else None
            headers = {"Retry-After": str(retry)} if retry is not None else None
            message = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
            return status, error_body(message, type_, code, param), headers
    if isinstance(exc, RecursionError):
        # A safety net (issue 36): every JSON text a request carries is depth-bounded before it is parsed
        # (`service.strict_json.loads_field`), so this names no field; it is still the request's shape, not a fault.
        return 400, error_body(f"the request is nested too deeply to process ({exc})", "invalid_request_error",
                               "too_deep", None), None
    if isinstance(exc, RequestValidationError | ValidationError):
        return _validation(exc)
    if isinstance(exc, StarletteHTTPException):
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return exc.status_code, error_body(str(exc.detail), type_, str(exc.status_code), None), exc.headers
    log.error("unhandled error", exc_info=exc)
    return 500, error_body("internal server error", "server_error", "internal_error", None), None


def _body_path(loc: list, body: dict[str, Any], names_itself: bool) -> list[str]:
    """The parts of a pydantic error location that are keys or indices of the request body, in order: a union's
    branch labels (``dict[str,any]``, ``list[int]``) and a tagged union's tag (``json_schema`` in
    ``response_format.json_schema.json_schema.schema``) are not in the body and are dropped; with
    ``names_itself`` (a missing or unknown field) the last part is kept though absent."""
    path, here = [], body
    for i, part in enumerate(loc):
        if ((isinstance(here, dict) and part in here)
                or (isinstance(here, list) and isinstance(part, int) and 0 <= part < len(here))):
            here = here[part]
        elif i < len(loc) - 1 or not names_itself:
            continue  # a label pydantic adds
        else:
            here = None
        path.append(str(part))
    return path


def _union_branch(errors: list[Any]) -> dict[str, Any]:
    """The error to name: the first, unless it is a union's string branch refusing an object (``tool_choice:
    {"type": "function"}`` against ``'none', 'auto' or 'required'``) and the union's object branch said what
    is wrong with that object (``tool_choice.function: Field required``)."""
    first = errors[0]
    if first.get("type") == "literal_error" and isinstance(first.get("input"), dict):
        field = tuple(first.get("loc", ()))[:-1]
        for other in errors[1:]:
            loc = tuple(other.get("loc", ()))
            if len(loc) > len(field) + 1 and loc[:len(field)] == field:
                return other
    return first


def _validation(exc: RequestValidationError | ValidationError) -> tuple[int, dict[str, Any], None]:
    """400 naming the first bad field (``messages.0.role``); malformed JSON says so."""
    errors = exc.errors()
    first = _union_branch(errors) if errors else {"loc": (), "msg": "invalid request", "type": ""}
    full = tuple(first.get("loc", ()))
    raw = [p for p in full if p not in ("body", "query", "path")]
    body = getattr(exc, "body", None)
    if full[:1] == ("body",) and isinstance(body, dict):  # a path or query parameter is not in the body
        loc = _body_path(raw, body, names_itself=first.get("type") in ("missing", "extra_forbidden"))
    else:
        # Unions report the branch they tried ("str", "list[int]"); drop those parts of the location.
        # Match the tags exactly: a prefix test would also drop real fields such as "stream".
        loc = [str(p) for p in raw]
        loc = [p for p in loc if not (p in ("str", "int", "float", "bool")
                                      or p.startswith(("list[", "dict[", "function-", "constrained-")))]
    # A cross-field rule fails at the model's level and names its field in the context (`service.api.rules`).
    ruled = (first.get("ctx") or {}).get("param")
    param = ".".join([*loc, ruled] if ruled else loc) or None
    if first.get("type") == "json_invalid":
        return 400, error_body(f"malformed JSON: {first.get('msg')}", "invalid_request_error", "invalid_json",
                               None), None
    if first.get("type") == "extra_forbidden":
        message = f"unknown field {param!r}: neither an OpenAI field nor one of this server's"
        return 400, error_body(message, "invalid_request_error", "unknown_field", param), None
    message = f"{param}: {validation_message(first)}" if param else validation_message(first)
    return 400, error_body(message, "invalid_request_error", "invalid_value", param), None


def error_response(exc: BaseException) -> JSONResponse:
    """The JSON error response of any exception."""
    status, body, headers = classify(exc)
    return JSONResponse(body, status_code=status, headers=headers)


class AnswerUnhandled:
    """Answers an exception no handler took (a bug: nothing the server raises on purpose) with the JSON 500 of
    :func:`classify`, and returns: Starlette's last-resort handler answers too but then re-raises, and uvicorn
    closes the client's kept-alive connection (issue 22). Pure ASGI; an exception after the answer started is
    left to uvicorn (the answer cannot change any more)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking)
        except Exception as exc:
            if started:
                raise
            await error_response(exc)(scope, receive, send)


def _cache_mode_of_this_model(exc: RequestValidationError, request: Request) -> RequestValidationError:
    """An unknown ``cache_mode`` in a request body told the modes the served model takes: the request schema's enum
    is every family's (``block`` included), which a bidirectional model then refuses."""
    from service.api.rules import describe_value
    from service.engine.engine import legal_cache_modes

    errors = list(exc.errors())
    serving = getattr(request.app.state, "serving", None)
    if not errors or serving is None:
        return exc
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    if first.get("type") != "literal_error" or loc[-1:] != ("cache_mode",):
        return exc
    if loc[:1] == ("path",):  # PUT /admin/active/{cache_mode}: only the modes that hold a configuration
        if first.get("input") != "block":
            return exc
        message = ("cache mode 'block' has no configuration of its own: a block-causal model's committed blocks are "
                   "its reused prefix, so 'block' serves prefix's (PUT /admin/active/prefix)")
        return RequestValidationError([{**first, "msg": message}, *errors[1:]], body=exc.body)
    if loc[:1] != ("body",):
        return exc
    message = f"unknown cache mode {describe_value(first.get('input'))}: {legal_cache_modes(serving.spec)}"
    return RequestValidationError([{**first, "msg": message}, *errors[1:]], body=exc.body)


def install(app: FastAPI) -> None:
    """Route every exception through :func:`classify` (an unhandled one without closing the connection: the
    innermost middleware, :class:`AnswerUnhandled`)."""
    app.add_middleware(AnswerUnhandled)

    async def handler(request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, RequestValidationError):
            exc = _cache_mode_of_this_model(exc, request)
        return error_response(exc)

    app.add_exception_handler(Exception, handler)
    app.add_exception_handler(StarletteHTTPException, handler)
    app.add_exception_handler(RequestValidationError, handler)
    for cls, *_ in MAPPING:
        app.add_exception_handler(cls, handler)
    app.add_exception_handler(ApiError, handler)
