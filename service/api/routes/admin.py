"""``/admin``: behind the bearer admin key (no key configured: 403 on every route).

``GET/POST /admin/{policies|kvquant_states|...}`` (every registered method's artifact type), ``GET/DELETE /admin/{kind}/{id}`` (``GET .../{id}/raw`` gives a
state's safetensors bytes), ``GET /admin/active``, ``PUT /admin/active/{cache_mode}`` (a `KVQuantConfig`),
``GET /admin/audit``, ``POST /admin/eval_scores``. Answers are indented for ``curl``-like clients
(`service.api.readable`).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from service.api import schemas as s
from service.api.deps import AdminDep, AdminKeyDep, require_admin
from service.api.readable import ReadableJSONRoute
from service.engine.params import CacheMode
from service.quant.config import KVQuantConfig

router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)], route_class=ReadableJSONRoute)


@router.get("/active")
def view_active(admin: AdminDep) -> s.ActiveView:
    """What this replica serves per cache mode, and the store's entries for this model."""
    return admin.view_active()


@router.put("/active/{cache_mode}")
def activate(cache_mode: CacheMode, config: KVQuantConfig, admin: AdminDep, key_id: AdminKeyDep
             ) -> s.ActivateResponse:
    """Validate a `KVQuantConfig` and make it the active configuration of the cache mode (old and new)."""
    return admin.activate(cache_mode, config, key_id)


@router.get("/audit")
def audit(admin: AdminDep, limit: int = Query(100, ge=1, le=10_000)) -> list[dict[str, Any]]:
    """The newest changes of active configurations, newest first."""
    return admin.audit(limit)


@router.post("/eval_scores", status_code=201)
def report_scores(report: s.EvalScoreReport, admin: AdminDep, key_id: AdminKeyDep) -> s.EvalScoreAck:
    """The evaluation job's task scores: stored and shown in ``dllm_eval_score``."""
    return admin.report_scores(report, key_id)


@router.get("/{kind}")
def list_artifacts(kind: str, admin: AdminDep) -> s.ArtifactList:
    """Ids, sizes and creation times of the policies or KVQuant states."""
    return admin.list(kind)


@router.post("/{kind}", status_code=201)
async def upload(kind: str, request: Request, admin: AdminDep) -> dict[str, Any]:
    """Store a policy (JSON) or KVQuant state (safetensors bytes) after validating it against the model (parsing
    runs in the thread pool, off the event loop)."""
    return await run_in_threadpool(admin.upload, kind, await request.body())


@router.get("/{kind}/{artifact_id}")
def read(kind: str, artifact_id: str, admin: AdminDep) -> dict[str, Any]:
    """A policy table, or a KVQuant state's metadata."""
    return admin.read(kind, artifact_id)


@router.get("/{kind}/{artifact_id}/raw")
def read_raw(kind: str, artifact_id: str, admin: AdminDep) -> Response:
    """The stored bytes (a KVQuant state's safetensors file)."""
    return Response(admin.read_bytes(kind, artifact_id), media_type="application/octet-stream")


@router.delete("/{kind}/{artifact_id}", status_code=204)
def delete(kind: str, artifact_id: str, admin: AdminDep) -> Response:
    """Delete an artifact that no active configuration names (409 otherwise)."""
    admin.delete(kind, artifact_id)
    return Response(status_code=204)
