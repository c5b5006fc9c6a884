"""Admin logic behind ``/admin``: policies and KVQuant states (list, read, upload validated against the loaded
model, delete when not active), the active configuration per cache mode, the audit log, evaluation scores.

Built in the lifespan (``app.state.admin``). A store that cannot be reached raises ``StoreUnavailable`` (503)
from every method; serving is not affected (it uses the snapshots already loaded).
"""

from __future__ import annotations

import json
import time
from typing import Any

from pydantic import ValidationError

from service.api import schemas as s
from service.api.errors import ArtifactRejected, InvalidRequest
from service.artifacts.base import ArtifactMismatch
from service.artifacts.kvquant_state import KVQuantState
from service.artifacts.policy import PolicyTable
from service.engine.params import CacheMode
from service.quant.config import KVQuantConfig
from service.store.active import ActiveConfigs, ConfigInvalid
from service.store.base import KIND_EVAL_SCORES, KIND_KVQUANT_STATE, KIND_POLICY, Store, StoreUnavailable
from service.telemetry import Telemetry

#: URL segment -> store kind of the artifacts the admin API manages.
ARTIFACT_KINDS = {"policies": KIND_POLICY, "kvquant_states": KIND_KVQUANT_STATE}


def _without_id(body: bytes) -> tuple[str | None, bytes]:
    """Split the ``id`` that :meth:`AdminService.read` adds to a policy off an uploaded body, so that a downloaded
    policy uploads as it is (the id is then checked against the content). Bodies that are not a JSON object pass
    through untouched for the schema to reject."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return None, body
    if not isinstance(parsed, dict) or "id" not in parsed:
        return None, body
    claimed = parsed.pop("id")
    return (claimed if isinstance(claimed, str) else repr(claimed)), json.dumps(parsed).encode()


def _first_error_field(exc: ValidationError) -> str | None:
    errors = exc.errors()
    return ".".join(str(p) for p in errors[0]["loc"]) if errors and errors[0]["loc"] else None


class Admin:
    """See the module docstring."""

    def __init__(self, store: Store, active: ActiveConfigs, telemetry: Telemetry) -> None:
        self.store = store
        self.active = active
        self.telemetry = telemetry
        self.spec = active.resolver.spec

    def _tracked(self, fn, *args, **kwargs):
        """Call a store method, keeping ``dllm_store_up`` current."""
        try:
            out = fn(*args, **kwargs)
        except StoreUnavailable:
            self.telemetry.store_up.set(0)
            raise
        self.telemetry.store_up.set(1)
        return out

    @staticmethod
    def kind(segment: str) -> str:
        """The store kind of a URL segment (``policies``, ``kvquant_states``; 400 otherwise)."""
        if segment not in ARTIFACT_KINDS:
            raise InvalidRequest(f"unknown artifact kind {segment!r}; legal: {', '.join(ARTIFACT_KINDS)}",
                                 param="kind")
        return ARTIFACT_KINDS[segment]

    # ---- artifacts ---------------------------------------------------------------------------------------------
    def list(self, segment: str) -> s.ArtifactList:
        """Every stored artifact of a kind with its size and creation time."""
        kind = self.kind(segment)
        ids = self._tracked(self.store.list, kind)
        return s.ArtifactList(kind=kind, data=[self._tracked(self.store.info, kind, i).model_dump() for i in ids])

    def read(self, segment: str, artifact_id: str) -> dict[str, Any]:
        """A policy table as JSON, or a KVQuant state's metadata (its tensors are binary: see :meth:`read_bytes`)."""
        kind = self.kind(segment)
        data = self._tracked(self.store.get, kind, artifact_id)
        if kind == KIND_POLICY:
            return PolicyTable.from_json(data).model_dump(mode="json") | {"id": artifact_id}
        return KVQuantState.from_bytes(data).meta.model_dump(mode="json") | {"id": artifact_id}

    def read_bytes(self, segment: str, artifact_id: str) -> bytes:
        """An artifact's stored bytes."""
        return self._tracked(self.store.get, self.kind(segment), artifact_id)

    def upload(self, segment: str, body: bytes) -> dict[str, Any]:
        """Parse, validate against the loaded model, then store (nothing is stored when anything fails: 422)."""
        kind = self.kind(segment)
        try:
            if kind == KIND_POLICY:
                claimed_id, body = _without_id(body)
                artifact = PolicyTable.from_json(body)
                data = artifact.to_json().encode()
            else:
                artifact = KVQuantState.from_bytes(body)
                data = artifact.to_bytes()
            artifact.validate_for(self.spec)
        except ValidationError as exc:
            raise ArtifactRejected(f"not a valid {kind}: {exc.errors()[0]['msg']}",
                                   param=_first_error_field(exc)) from exc
        except ArtifactMismatch as exc:
            raise ArtifactRejected(str(exc), param=exc.field) from exc
        except ValueError as exc:
            raise ArtifactRejected(f"not a valid {kind}: {exc}") from exc
        if kind == KIND_POLICY and claimed_id is not None and claimed_id != artifact.id:
            raise ArtifactRejected(f"id {claimed_id!r} is not the table's content id {artifact.id!r}", param="id")
        artifact_id = self._tracked(self.store.put, kind, data, artifact.id)
        return {"kind": kind, "id": artifact_id}

    def delete(self, segment: str, artifact_id: str) -> None:
        """Delete an artifact (ArtifactInUse if an active configuration names it)."""
        self._tracked(self.store.delete, self.kind(segment), artifact_id)

    # ---- active configuration ----------------------------------------------------------------------------------
    def view_active(self) -> s.ActiveView:
        """Serving snapshots per cache mode, the store's entries, and the entries the store lost (StoreUnavailable,
        a 503 like every admin route, when the store cannot be reached)."""
        serving = {mode: snap.describe() for mode, snap in self.active.all().items()}
        entries = self._tracked(self.store.list_active)
        stored = {e.cache_mode: e.model_dump(mode="json") for e in entries if e.fingerprint == self.spec.fingerprint}
        lost = {mode: loss.describe() for mode, loss in self.active.losses.items()}
        return s.ActiveView(model=self.active.model_name, fingerprint=self.spec.fingerprint, serving=serving,
                            store=stored, store_lost=lost)

    def activate(self, cache_mode: CacheMode, config: KVQuantConfig, key_id: str) -> s.ActivateResponse:
        """Validate, then one atomic write + event; 422 if the configuration does not fit the model.

        ``old`` is the store's previous entry, or, when the store had none, the default this replica served.
        """
        served = self.active.snapshot(cache_mode).config
        try:
            audit = self._tracked(self.active.activate, cache_mode, config, key_id)
        except ConfigInvalid as exc:
            raise ArtifactRejected(str(exc), param=exc.field) from exc
        return s.ActivateResponse(fingerprint=audit.fingerprint, cache_mode=audit.cache_mode, at=audit.at,
                                  key_id=audit.key_id, old=audit.old or served, new=audit.new)

    def audit(self, limit: int) -> list[dict[str, Any]]:
        """The newest ``limit`` audit entries."""
        return [e.model_dump(mode="json") for e in self._tracked(self.store.audit, limit)]

    # ---- evaluation scores -------------------------------------------------------------------------------------
    def report_scores(self, report: s.EvalScoreReport, key_id: str) -> s.EvalScoreAck:
        """Store the evaluation job's report (kind ``eval_scores``) and show it in ``dllm_eval_score``."""
        if report.model_fingerprint is not None and report.model_fingerprint != self.spec.fingerprint:
            raise InvalidRequest(f"model_fingerprint {report.model_fingerprint[:16]}... is not the loaded model's "
                                 f"{self.spec.fingerprint[:16]}...", param="model_fingerprint")
        at = time.time()
        record = report.model_dump(mode="json") | {"at": at, "key_id": key_id,
                                                   "model_fingerprint": self.spec.fingerprint}
        artifact_id = self._tracked(self.store.put_json, KIND_EVAL_SCORES, record)
        self.telemetry.observe_eval(report.task, report.scores, report.kv_quant, report.cache_mode, at)
        return s.EvalScoreAck(id=artifact_id, at=at)
