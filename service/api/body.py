"""Request bodies: a size limit on every route, and JSON read strictly on the routes that take JSON.

* :class:`BodyLimit` (ASGI middleware): a body over ``max_body_bytes`` is a 413 with OpenAI's error body, refused
  from ``Content-Length`` before a byte of it is read, or, without one (chunked), as soon as the bytes received
  pass the limit. The body is read here (FastAPI reads every body whole anyway) and handed on to the app.
* :class:`JSONBodyRoute` (route class): before FastAPI validates a JSON body, the body must be non-empty, sent
  as ``application/json`` (415 otherwise), uncompressed, UTF-8, valid JSON without NaN/Infinity and nested at
  most `service.strict_json.MAX_DEPTH` deep, and an object: each a 400 that says which (FastAPI's own answers
  were "Field required", "Input should be a valid dictionary" and "There was an error parsing the body").
  Large bodies are parsed in the thread pool, so the event loop (and /health/ready) never waits on them.
"""

from __future__ import annotations

import email.message
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service import strict_json
from service.api.errors import BodyTooLarge, InvalidJSON, UnsupportedMediaType, error_response
from service.api.streaming import OUTCOME_KEY
from service.connections import BODY_TIMED_OUT

#: The statuses a request whose body never came whole is counted with: the body timeout's answer, and nginx's
#: "client closed request" when the client itself left.
REQUEST_TIMEOUT, CLIENT_CLOSED = 408, 499

#: The default limit is this many bytes per token of the model's context...
BODY_BYTES_PER_TOKEN = 256
#: ...and at least this many.
MIN_BODY_BYTES = 1 << 20
#: Bodies up to this size are parsed on the event loop (microseconds); larger ones in the thread pool.
INLINE_PARSE_BYTES = 64 << 10


def default_body_limit(context_tokens: int) -> int:
    """The body limit when ``DLLM_MAX_BODY_BYTES`` is empty: 256 bytes per token of the model's context, at least
    1 MiB. A prompt that fills the context fits in any spelling (JSON's ``\\uXXXX`` escapes take 6 bytes per
    character; a token id at most 8 with its separator), as do several full-context prompts of ids; a body that
    does not fit could not be served anyway, and refusing it before parsing keeps its tokenization (hundreds of MB
    for a few MB of text) out of the server."""
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * context_tokens)


class BodyLimit:
    """413 for a request body over the app's ``state.max_body_bytes`` (None: no limit); see the module docstring."""

    def __init__(self, app: ASGIApp, fastapi: FastAPI) -> None:
        self.app, self.fastapi = app, fastapi

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = getattr(self.fastapi.state, "max_body_bytes", None)
        if scope["type"] != "http" or limit is None:
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await self._refuse(scope, receive, send, f"{declared:,}", limit)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                # Nobody to answer: a client-side outcome for the metrics (`service.main.MetricsMiddleware`), the
                # 408 the body timeout sent (`service.connections`), else 499: the client left mid-body.
                outcome = scope.get(OUTCOME_KEY)
                if outcome is not None:
                    outcome["status"] = REQUEST_TIMEOUT if scope.get(BODY_TIMED_OUT) else CLIENT_CLOSED
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._refuse(scope, receive, send, f"over {limit:,}", limit)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        whole: Message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return whole
            return await receive()  # after the body: disconnects, as before

        await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send, size: str, limit: int) -> None:
        response = error_response(BodyTooLarge(
            f"the request body ({size} bytes) is over this server's limit of {limit:,} bytes (DLLM_MAX_BODY_BYTES); "
            "nothing that large can be served"))
        response.headers["connection"] = "close"  # the unread rest of the body cannot be skipped cheaply
        await response(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP server refuses a malformed length before the app sees it
    return None


def _is_json(content_type: str) -> bool:
    """FastAPI's test of a JSON media type (``application/json`` or ``application/*+json``, parameters ignored)."""
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def parse_json_body(body: bytes, content_type: str | None, content_encoding: str | None) -> dict[str, Any]:
    """The JSON object a request body holds.

    Raises:
        InvalidJSON (400): empty, not UTF-8, not JSON, NaN/Infinity (``param``: the value's path), nested too
            deep (``param``: the top-level field it is in), or not an object.
        UnsupportedMediaType (415): not sent as ``application/json``, or with a ``Content-Encoding``.
    """
    if not body:
        raise InvalidJSON("the request body is empty: send a JSON object (Content-Type: application/json)")
    if not content_type or not _is_json(content_type):
        got = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
        raise UnsupportedMediaType(f"the body must be a JSON object sent with Content-Type: application/json "
                                   f"(got {got})")
    if content_encoding and content_encoding.strip().lower() != "identity":
        raise UnsupportedMediaType(f"Content-Encoding {content_encoding!r} is not supported: send the body "
                                   "uncompressed")
    try:
        value = strict_json.loads(body)
    except strict_json.JSONError as exc:
        raise InvalidJSON(f"the body is not valid JSON: {exc}", param=exc.field) from None
    if not isinstance(value, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), "a number")
        raise InvalidJSON(f"the body must be a JSON object, got {kind}")
    return value


class JSONBodyRoute(APIRoute):
    """A route whose JSON body is read by :func:`parse_json_body` before FastAPI validates it (routes without a
    body are untouched)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if self.body_field is None:
            return handler

        async def route(request: Request) -> Response:
            body = await request.body()
            args = (body, request.headers.get("content-type"), request.headers.get("content-encoding"))
            if len(body) <= INLINE_PARSE_BYTES:
                parsed = parse_json_body(*args)
            else:
                parsed = await run_in_threadpool(parse_json_body, *args)
            # FastAPI reads the body through request.json(), which returns this cached value.
            request._json = parsed
            return await handler(request)

        return route
