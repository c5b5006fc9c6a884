"""The published API is the served API (issue 13): the OpenAPI document states what the server answers.

FastAPI's generated document says 422 for validation errors (we answer 400 with OpenAI's error body, see
`service.api.errors`), JSON for every response, and nothing of the statuses raised inside; :func:`install` fixes
the document once, when it is first asked for, and makes a 405 list every method of the path in ``Allow``
(Starlette lists only the first matching route's).

What the running server decides is filled in at that point (:func:`fill`): the values the request models mark
with `service.api.schemas.from_server` (context length, vocabulary, model names, ... :func:`server_values`), the
cross-field rules restated with the server's defaults (`service.api.rules`), and the configuration a request or
an activation may name (`service.store.config_check.schema_constraints`).
"""

from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.deps import require_admin, require_api_key
from service.api.rules import RULED
from service.api.schemas import FROM_SERVER
from service.engine.engine import cache_modes
from service.engine.families import settings_rules
from service.engine.models import reveal_rule
from service.quant.registry import artifact_types
from service.store.config_check import schema_constraints

# Statuses any route can answer, with why (the body is always OpenAI's error object).
_ERRORS = {
    "400": "invalid request (validation, bounds, a value this server cannot honour)",
    "401": "missing or wrong bearer key",
    "403": "admin routes with no admin key configured",
    "404": "unknown model, route or artifact",
    "408": "the request body stopped arriving for DLLM_BODY_TIMEOUT_S (then the connection is closed)",
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
# One server-sent event (before OpenAPI 3.2 a text/event-stream schema describes each event): unnamed ("message"),
# its data a JSON object (a chunk, or an {"error": ...} object after the stream started) or the closing [DONE].
_SSE_EVENT = {
    "type": "object", "required": ["data"], "additionalProperties": False,
    "properties": {
        "event": {"const": "message"},
        "data": {"type": "string", "anyOf": [{"const": "[DONE]"}, {"pattern": "^\\{"}],
                 "description": "a chunk (the completion or chat.completion.chunk object, JSON), an error object, or "
                                "[DONE] last"},
    },
}
#: Request bodies whose ``kv_quant`` the server resolves (the served configuration), and the activation route.
_RESOLVED = ("CompletionRequest", "ChatCompletionRequest", "GenerateRequest")
_ACTIVATE = ("/admin/active/{cache_mode}", "put")
_REF = "#/components/schemas/"
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def _exact_bounds(node: Any) -> None:
    """Integral bounds back to integers: FastAPI's document model types them as floats, whose JSON text is not
    the number (-2**63 is written -9.223372036854776e+18, which reads as -9223372036854776000). Every bound we
    declare is a float exactly (small, or a power of two), so ``int`` restores it."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in _BOUNDS and isinstance(value, float) and value.is_integer():
                node[key] = int(value)
            else:
                _exact_bounds(value)
    elif isinstance(node, list):
        for child in node:
            _exact_bounds(child)


def _patch(doc: dict[str, Any]) -> dict[str, Any]:
    _exact_bounds(doc)
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
                responses["200"].setdefault("content", {})["text/event-stream"] = {"schema": _SSE_EVENT}
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


def server_values(state: Any) -> dict[str, Any]:
    """The values `service.api.schemas.from_server` names, from the app's state (the lifespan's objects).

    ``context`` (tokens, the model's ``max_length``); ``longest_prompt`` / ``longest_response`` (tokens: the
    context less one position for the other part); ``last_token_id`` (a prompt id: below the logits' width) and
    ``mask_id`` (``{"const": id}``, never in a prompt); ``last_decodable_id`` (``/detokenize``: the tokenizer's
    size); ``model_names`` (the served name); ``fingerprint`` (the weights'); ``remasking``,
    ``dream_schedules`` and ``token_editing`` (what the family's reveal rule takes); ``renoising`` (whether its
    decoder takes the renoising fields); ``cache_modes`` (what
    the family decodes with, `service.engine.engine.cache_modes`); ``artifact_kinds`` (admin URL segments of the registered methods); ``max_prompts``
    (prompts in one completion request: the most the queue holds, ``max_queue``); ``max_n`` (choices per prompt,
    ``DLLM_MAX_N``).
    """
    serving = state.serving
    spec = serving.spec
    return {
        "context": spec.max_length,
        "longest_prompt": spec.max_length - 1,
        "longest_response": spec.max_length - 1,
        "last_token_id": spec.vocab_size - 1,
        "mask_id": {"const": spec.mask_id},
        "last_decodable_id": spec.decodable_size - 1,
        "model_names": [serving.model_name],  # the public name only: model_id may be a path of the host
        "fingerprint": [spec.fingerprint],
        "remasking": list(reveal_rule(spec.arch).remasking),
        "dream_schedules": list(reveal_rule(spec.arch).dream_schedules),
        # JSON Schema's "not" of token editing's values: nothing ({}: every value refused) on a family that does
        # not edit, anything ({"not": {}}) on one that does.
        "token_editing": {"not": {}} if reveal_rule(spec.arch).edits_tokens else {},
        # The same for the renoising fields: anything where the family's decoder takes them (DiffusionGemma).
        "renoising": {"not": {}} if settings_rules(spec.arch)["max_denoising_steps"].serves is None else {},
        "cache_modes": list(cache_modes(spec)),
        "artifact_kinds": list(artifact_types()),
        "max_prompts": serving.settings.max_queue,
        "max_n": serving.settings.max_n,
    }


def _marked(node: Any, values: dict[str, Any] | None) -> None:
    """Replace every `FROM_SERVER` mark under ``node`` by its values (drop the marks when there are none)."""
    if isinstance(node, dict):
        marks = node.pop(FROM_SERVER, None)
        if marks and values is not None:
            node.update({keyword: copy.deepcopy(values[name]) for keyword, name in marks.items()})
        for child in node.values():
            _marked(child, values)
    elif isinstance(node, list):
        for child in node:
            _marked(child, values)


def fill(doc: dict[str, Any], state: Any) -> dict[str, Any]:
    """What the running server decides (see the module docstring); without a loaded model (``state`` lacks the
    lifespan's objects) only the marks are dropped, leaving the static bounds."""
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    if getattr(state, "serving", None) is None:
        _marked(doc, None)
        return doc
    _marked(doc, server_values(state))
    defaults = state.settings.decode_settings()
    for name, cls in RULED.items():
        if name in schemas and cls.all_rules():
            schemas[name]["allOf"] = cls.rule_schemas(defaults)
    if "KVQuantConfig" in schemas:
        schemas["ServedKVQuantConfig"] = {
            "description": "a KVQuantConfig as the server resolves it: fitted artifacts by store id only, group "
                           "sizes that fit the loaded model",
            "allOf": [{"$ref": _REF + "KVQuantConfig"}, schema_constraints(state.serving.spec)]}
        for name in _RESOLVED:
            if name in schemas:
                _retarget(schemas[name]["properties"]["kv_quant"])
        activate = doc["paths"].get(_ACTIVATE[0], {}).get(_ACTIVATE[1])
        if activate is not None:
            _retarget(activate["requestBody"])
    return doc


def _retarget(node: Any) -> None:
    """Point every reference to KVQuantConfig under ``node`` at ServedKVQuantConfig."""
    if isinstance(node, dict):
        if node.get("$ref") == _REF + "KVQuantConfig":
            node["$ref"] = _REF + "ServedKVQuantConfig"
        for child in node.values():
            _retarget(child)
    elif isinstance(node, list):
        for child in node:
            _retarget(child)


def secure(doc: dict[str, Any], app: FastAPI) -> dict[str, Any]:
    """State the bearer keys: ``/admin`` routes take the admin key (every one of them, configured or not: 403
    without one), the serving routes an API key when ``api_keys`` are configured (open otherwise)."""
    api_keys = bool(getattr(getattr(app.state, "settings", None), "api_keys", None))
    schemes = {"adminKey": {"type": "http", "scheme": "bearer", "description": "the admin key (DLLM_ADMIN_KEY)"}}
    if api_keys:
        schemes["apiKey"] = {"type": "http", "scheme": "bearer", "description": "one of DLLM_API_KEYS"}
    doc.setdefault("components", {})["securitySchemes"] = schemes
    for route in _leaves(app.routes):
        if not isinstance(route, APIRoute) or not route.include_in_schema:
            continue
        calls = {d.call for d in route.dependant.dependencies}
        scheme = "adminKey" if require_admin in calls else "apiKey" if require_api_key in calls and api_keys else None
        if scheme is None:
            continue
        for method in route.methods:
            op = doc["paths"].get(route.path_format, {}).get(method.lower())
            if op is not None:
                op["security"] = [{scheme: []}]
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
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            app.openapi_schema = secure(fill(_patch(doc), app.state), app)
        return app.openapi_schema

    app.openapi = openapi
    app.add_middleware(AllowHeader, fastapi=app)
