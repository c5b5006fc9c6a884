"""The published API is the served API (issue 13): the OpenAPI document states what the server answers.

FastAPI's generated document says 422 for validation errors (we answer 400 with OpenAI's error body, see
`service.api.errors`), JSON for every response, and nothing of the statuses raised inside; :func:`install` fixes
the document once, when it is first asked for, and makes a 405 list every method of the path in ``Allow``
(Starlette lists only the first matching route's).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Statuses any route can answer, with why (the body is always OpenAI's error object).
_ERRORS = {
    "400": "invalid request (validation, bounds, a value this server cannot honour)",
    "401": "missing or wrong bearer key",
    "403": "admin routes with no admin key configured",
    "404": "unknown model, route or artifact",
    "409": "artifact conflict or in use",
    "413": "request body over the size limit (DLLM_MAX_BODY_BYTES)",
    "415": "body not sent as JSON (Content-Type: application/json), or compressed",
    "422": "artifact rejected: it (or the one a configuration names) does not fit the loaded model",
    "429": "queue full (Retry-After)",
    "499": "the client went away",
    "500": "a request that failed while decoding",
    "503": "not ready, draining, or the store is unreachable",
    "504": "request timeout",
}
_ERROR_SCHEMA = {
    "type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
_SSE_ROUTES = ("/v1/completions", "/v1/chat/completions")


def _patch(doc: dict[str, Any]) -> dict[str, Any]:
    doc.setdefault("components", {}).setdefault("schemas", {})["ErrorResponse"] = _ERROR_SCHEMA
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    for path, item in doc["paths"].items():
        for method, op in item.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            for status, why in _ERRORS.items():
                responses.setdefault(status, {"description": why, "content": error})
            if path == "/metrics":
                responses["200"]["content"] = {"text/plain": {"schema": {"type": "string"}}}
            if path in _SSE_ROUTES:
                responses["200"].setdefault("content", {})["text/event-stream"] = {"schema": {"type": "string"}}
            if path.endswith("/raw"):
                responses["200"]["content"] = {"application/octet-stream": {"schema": {"type": "string",
                                                                                       "format": "binary"}}}
            if path == "/admin/{kind}" and method == "post":
                op["requestBody"] = {"required": True, "content": {
                    "application/json": {"schema": {"type": "object"}},
                    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}
            if method == "delete":
                responses.get("204", {}).pop("content", None)
    return doc


def _leaves(routes: list) -> list:
    """Every route with methods, in routing order (included routers walked)."""
    out = []
    for route in routes:
        nested = getattr(getattr(route, "original_router", None), "routes", None)
        out += _leaves(nested) if nested is not None else [route]
    return out


def _methods(routes: list, scope: Scope) -> set[str]:
    """The methods of the first path template (in routing order) that matches ``scope``: the documented methods
    of that path (``/admin/active`` is GET only, although ``/admin/{kind}`` would also match it)."""
    leaves = [r for r in _leaves(routes) if getattr(r, "methods", None)]
    for route in leaves:
        if route.matches(scope)[0] != Match.NONE:
            return {m for r in leaves if getattr(r, "path", None) == route.path for m in r.methods}
    return set()


class AllowHeader:
    """On a 405, ``Allow`` lists every method of every route that matches the path."""

    def __init__(self, app: ASGIApp, fastapi: FastAPI) -> None:
        self.app, self.fastapi = app, fastapi

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_allow(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 405:
                methods = sorted(_methods(self.fastapi.router.routes, scope))
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"allow"]
                message = {**message, "headers": [*headers, (b"allow", ", ".join(methods).encode())]}
            await send(message)

        await self.app(scope, receive, send_allow)


def install(app: FastAPI) -> None:
    """Publish the patched document at ``/openapi.json`` and fix ``Allow`` on 405 answers."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _patch(get_openapi(title=app.title, version=app.version, routes=app.routes))
        return app.openapi_schema

    app.openapi = openapi
    app.add_middleware(AllowHeader, fastapi=app)
