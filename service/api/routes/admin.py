"""``/admin``: behind the bearer admin key (no key configured: 403 on every route).

``GET/POST /admin/{policies|kvquant_states|...}`` (every registered method's artifact type), ``GET/DELETE /admin/{kind}/{id}`` (``GET .../{id}/raw`` gives a
state's safetensors bytes), ``GET /admin/active``, ``PUT /admin/active/{cache_mode}`` (a `KVQuantConfig`),
``GET /admin/audit``, ``POST /admin/eval_scores``. Answers are indented for ``curl``-like clients
(`service.api.readable`).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query, Request, Response
from starlette.concurrency import run_in_threadpool
from starlette.convertors import Convertor, register_url_convertor

from service.api import schemas as s
from service.api.deps import AdminDep, AdminKeyDep, require_admin
from service.api.readable import ReadableJSONRoute
from service.engine.params import ConfiguredCacheMode
from service.quant.config import KVQuantConfig
from service.store.base import ID_PATTERN

router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)], route_class=ReadableJSONRoute)

#: The fixed first segments of this router's own paths.
FIXED = ("active", "audit", "eval_scores")


class KindConvertor(Convertor):
    """The ``{kind}`` segment of the artifact routes matches anything but a fixed segment, so that a method a fixed
    path does not take (``GET /admin/active/none``, ``POST /admin/audit``) is a 405 naming the methods it takes, as
    the document says, not a lookup of an artifact kind called ``active``."""

    regex = f"(?!(?:{'|'.join(FIXED)})(?:/|$))[^/]+"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("artifact_kind", KindConvertor())

#: An artifact kind's URL segment: one of the registered methods' (the document lists them; another is a 400).
Kind = Annotated[str, Path(json_schema_extra=s.from_server(enum="artifact_kinds"))]
#: A store id (the store refuses other names with a 400).
ArtifactId = Annotated[str, Path(pattern=ID_PATTERN)]


@router.get("/active")
def view_active(admin: AdminDep) -> s.ActiveView:
    """What this replica serves per cache mode, and the store's entries for this model."""
    return admin.view_active()


@router.put("/active/{cache_mode}", description="Validate a configuration and make it the active one of the cache "
            "mode (answers old and new). Beyond the schema: cache mode `none` takes only method `none` (it reuses "
            "nothing to quantize), and a fitted artifact must exist (404) and fit the model, cache mode and bits "
            "(422).")
def activate(cache_mode: ConfiguredCacheMode, config: KVQuantConfig, admin: AdminDep, key_id: AdminKeyDep
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


@router.get("/{kind:artifact_kind}")
def list_artifacts(kind: Kind, admin: AdminDep) -> s.ArtifactList:
    """Ids, sizes and creation times of the policies or KVQuant states."""
    return admin.list(kind)


@router.post("/{kind:artifact_kind}", status_code=201,
             description="Store a policy table (JSON) or a KVQuant state (safetensors bytes). The schema cannot "
             "state what is checked before anything is stored: the content parses as the kind's artifact and fits "
             "the loaded model (weights fingerprint, layer and head counts; 422 otherwise).")
async def upload(kind: Kind, request: Request, admin: AdminDep) -> dict[str, Any]:
    """Store a policy (JSON) or KVQuant state (safetensors bytes) after validating it against the model (parsing
    runs in the thread pool, off the event loop)."""
    return await run_in_threadpool(admin.upload, kind, await request.body())


@router.get("/{kind:artifact_kind}/{artifact_id}")
def read(kind: Kind, artifact_id: ArtifactId, admin: AdminDep) -> dict[str, Any]:
    """A policy table, or a KVQuant state's metadata."""
    return admin.read(kind, artifact_id)


@router.get("/{kind:artifact_kind}/{artifact_id}/raw")
def read_raw(kind: Kind, artifact_id: ArtifactId, admin: AdminDep) -> Response:
    """The stored bytes (a KVQuant state's safetensors file)."""
    return Response(admin.read_bytes(kind, artifact_id), media_type="application/octet-stream")


@router.delete("/{kind:artifact_kind}/{artifact_id}", status_code=204)
def delete(kind: Kind, artifact_id: ArtifactId, admin: AdminDep) -> Response:
    """Delete an artifact that no active configuration names (409 otherwise)."""
    admin.delete(kind, artifact_id)
    return Response(status_code=204)
