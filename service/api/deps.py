"""`Annotated` dependency aliases: the long-lived objects built in the lifespan (on ``app.state``), and the key
checks (bearer API keys for serving routes; the admin key for ``/admin``)."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request

from service.api.admin import Admin
from service.api.errors import AdminClosed, Unauthorized
from service.api.serving import Serving
from service.config import Settings, key_id
from service.runtime.loop import Worker
from service.store.active import ActiveConfigs
from service.store.base import Store
from service.telemetry import Telemetry


def get_settings(request: Request) -> Settings:
    """The settings the app was built with."""
    return request.app.state.settings


def get_worker(request: Request) -> Worker:
    """The worker that owns the engine."""
    return request.app.state.worker


def get_store(request: Request) -> Store:
    """The policy/state store."""
    return request.app.state.store


def get_active(request: Request) -> ActiveConfigs:
    """The active configurations."""
    return request.app.state.active


def get_telemetry(request: Request) -> Telemetry:
    """The metrics."""
    return request.app.state.telemetry


def get_serving(request: Request) -> Serving:
    """The serving logic."""
    return request.app.state.serving


def get_admin(request: Request) -> Admin:
    """The admin logic."""
    return request.app.state.admin


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _matches(token: str, secret: str) -> bool:
    """Constant-time comparison of a bearer token with a key. As bytes: ``hmac.compare_digest`` raises TypeError
    on ``str`` with non-ASCII characters, and a header is any latin-1 text (``Bearer \xe9\xe9``)."""
    return hmac.compare_digest(token.encode("utf-8"), secret.encode("utf-8"))


def require_api_key(request: Request) -> None:
    """Serving routes: open when no API keys are configured; else a matching bearer key (401 otherwise)."""
    keys = request.app.state.settings.api_keys
    if not keys:
        return
    token = _bearer(request)
    if token is None or not any(_matches(token, k.get_secret_value()) for k in keys):
        raise Unauthorized("missing or invalid API key: send 'Authorization: Bearer <key>'")


def require_admin(request: Request) -> str:
    """Admin routes: 403 when no admin key is configured, 401 on a missing or wrong key; returns its key id."""
    admin_key = request.app.state.settings.admin_key
    if admin_key is None:
        raise AdminClosed("admin is disabled: no admin key is configured (set DLLM_ADMIN_KEY)")
    token = _bearer(request)
    if token is None or not _matches(token, admin_key.get_secret_value()):
        raise Unauthorized("missing or invalid admin key: send 'Authorization: Bearer <admin key>'")
    return key_id(token)


SettingsDep = Annotated[Settings, Depends(get_settings)]
WorkerDep = Annotated[Worker, Depends(get_worker)]
StoreDep = Annotated[Store, Depends(get_store)]
ActiveDep = Annotated[ActiveConfigs, Depends(get_active)]
TelemetryDep = Annotated[Telemetry, Depends(get_telemetry)]
ServingDep = Annotated[Serving, Depends(get_serving)]
AdminDep = Annotated[Admin, Depends(get_admin)]
ApiKeyDep = Annotated[None, Depends(require_api_key)]
AdminKeyDep = Annotated[str, Depends(require_admin)]
