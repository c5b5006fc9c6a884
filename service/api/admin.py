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

from service import strict_json
from service.api import schemas as s
from service.api.errors import ArtifactRejected, InvalidRequest
from service.artifacts.base import ArtifactMismatch
from service.engine.params import CacheMode
from service.quant.config import KVQuantConfig
from service.quant.registry import artifact_types, method
from service.store.active import ActiveConfigs
from service.store.base import KIND_EVAL_SCORES, ArtifactNotFound, Store, StoreUnavailable
from service.telemetry import Telemetry, check_label_value

#: Metrics one evaluation report may carry (each becomes a ``dllm_eval_score`` series).


def _without_id(body: bytes, label: str) -> tuple[str | None, bytes]:
    """Split the ``id`` that :meth:`Admin.read` adds to a JSON artifact off an uploaded body, so that a downloaded
    artifact uploads as it is (the id is then checked against the content). Bodies that are not JSON (a KVQuant
    state's safetensors bytes, garbage) pass through untouched for the artifact type to judge; JSON nested too
    deep or holding NaN/Infinity is rejected here (`service.strict_json`), naming where.

    Raises:
        ArtifactRejected: JSON that `service.strict_json.loads` refuses.
    """
    if body.lstrip()[:1] not in (b"{", b"["):
        return None, body
    try:
        parsed = strict_json.loads(body)
    except strict_json.NotJSON:
        return None, body
    except strict_json.JSONRefused as exc:
        raise ArtifactRejected(f"not a valid {label}: {exc}", param=exc.field) from None
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
    def artifact_type(segment: str) -> type:
        """The artifact type of a URL segment: every registered method's artifact (`service.quant.registry`), e.g.
        ``policies``, ``kvquant_states``; 400 naming ``kind`` otherwise."""
        types = artifact_types()
        if segment not in types:
            raise InvalidRequest(f"unknown artifact kind {segment!r}; legal: {', '.join(types)}", param="kind")
        return types[segment]

    # ---- artifacts ---------------------------------------------------------------------------------------------
    def list(self, segment: str) -> s.ArtifactList:
        """Every stored artifact of a kind with its size and creation time."""
        kind = self.artifact_type(segment).KIND
        ids = self._tracked(self.store.list, kind)
        return s.ArtifactList(kind=kind, data=[self._tracked(self.store.info, kind, i).model_dump() for i in ids])

    def read(self, segment: str, artifact_id: str) -> dict[str, Any]:
        """An artifact's ``summary()`` (a policy table as JSON, a KVQuant state's metadata) with its full id; an
        unambiguous prefix of the id names it too."""
        cls = self.artifact_type(segment)
        artifact_id = self._tracked(self.store.resolve_id, cls.KIND, artifact_id)
        return cls.from_bytes(self._tracked(self.store.get, cls.KIND, artifact_id)).summary() | {"id": artifact_id}

    def read_bytes(self, segment: str, artifact_id: str) -> bytes:
        """An artifact's stored bytes (its id or an unambiguous prefix of it)."""
        kind = self.artifact_type(segment).KIND
        return self._tracked(self.store.get, kind, self._tracked(self.store.resolve_id, kind, artifact_id))

    def upload(self, segment: str, body: bytes) -> dict[str, Any]:
        """Parse, validate against the loaded model, then store (nothing is stored when anything fails: 422)."""
        cls = self.artifact_type(segment)
        claimed_id, body = _without_id(body, cls.LABEL)
        try:
            artifact = cls.from_bytes(body)
            artifact.validate_for(self.spec)
        except ValidationError as exc:
            raise ArtifactRejected(f"not a valid {cls.KIND}: {exc.errors()[0]['msg']}",
                                   param=_first_error_field(exc)) from exc
        except ArtifactMismatch as exc:
            raise ArtifactRejected(str(exc), param=exc.field) from exc
        except ValueError as exc:
            raise ArtifactRejected(f"not a valid {cls.KIND}: {exc}") from exc
        if claimed_id is not None and claimed_id != artifact.id:
            raise ArtifactRejected(f"id {claimed_id!r} is not the {cls.LABEL}'s content id {artifact.id!r}", param="id")
        artifact_id = self._tracked(self.store.put, cls.KIND, artifact.to_bytes(), artifact.id)
        return {"kind": cls.KIND, "id": artifact_id}

    def delete(self, segment: str, artifact_id: str) -> None:
        """Delete an artifact (ArtifactInUse if an active configuration names it); this replica stops serving it at
        once (its cache and metric series), the others when they see the store's new version."""
        kind = self.artifact_type(segment).KIND
        artifact_id = self._tracked(self.store.resolve_id, kind, artifact_id)
        self._tracked(self.store.delete, kind, artifact_id)
        self.active.resolver.forget(kind, artifact_id)
        self.telemetry.forget_artifact(artifact_id)

    # ---- active configuration ----------------------------------------------------------------------------------
    def view_active(self) -> s.ActiveView:
        """Serving snapshots per cache mode, the store's entries, and the entries the store lost (StoreUnavailable,
        a 503 like every admin route, when the store cannot be reached)."""
        serving = {mode: snap.describe() for mode, snap in self.active.all().items()}
        entries = self._tracked(self.store.list_active)
        stored = {e.cache_mode: e.model_dump(mode="json") for e in entries if e.fingerprint == self.spec.fingerprint}
        lost = {mode: loss.describe() for mode, loss in self.active.losses.items()}
        return s.ActiveView(model=self.active.model_name, fingerprint=self.spec.fingerprint, serving=serving,
                            store=stored, store_lost=lost, not_ready=dict(self.active.not_ready))

    def activate(self, cache_mode: CacheMode, config: KVQuantConfig, key_id: str) -> s.ActivateResponse:
        """Validate, then one atomic write + event. Refusals answer as on a serving route (`service.api.errors`):
        a configuration that is bad input (a file path, a bound, quantization with cache mode none) is a 400
        (``ConfigInvalid``), one whose stored artifact does not fit it or the model a 422 (``ArtifactUnfit``).

        ``old`` and ``new`` are the audit entry's (``GET /admin/audit`` shows the same): ``old`` is the store's
        previous active entry, null when the store had none (each replica then served its ``kv_quant`` setting,
        which may differ between replicas, so no one replica's default is the store's history).
        ``served_before`` is what this replica served for the mode until now (None while it was not ready).
        """
        served = self.active.all().get(cache_mode)
        kind = method(config.method).store_kind
        if kind is not None and config.artifact_id is not None:  # an abbreviated id is stored in full
            try:
                full_id = self._tracked(self.store.resolve_id, kind, config.artifact_id)
            except ArtifactNotFound:
                full_id = config.artifact_id  # refused below as any id the store lacks, naming its field
            config = config.model_copy(update={"artifact_id": full_id})
        audit = self._tracked(self.active.activate, cache_mode, config, key_id)
        now = self.active.all().get(cache_mode)
        return s.ActivateResponse(fingerprint=audit.fingerprint, cache_mode=audit.cache_mode, at=audit.at,
                                  key_id=audit.key_id, old=audit.old, new=audit.new,
                                  served_before=served.config if served else None,
                                  configured_bits=now.describe().get("configured_bits") if now else None)

    def audit(self, limit: int) -> list[dict[str, Any]]:
        """The newest ``limit`` audit entries."""
        return [e.model_dump(mode="json") for e in self._tracked(self.store.audit, limit)]

    # ---- evaluation scores -------------------------------------------------------------------------------------
    def report_scores(self, report: s.EvalScoreReport, key_id: str) -> s.EvalScoreAck:
        """Store the evaluation job's report (kind ``eval_scores``) and show it in ``dllm_eval_score``."""
        if report.model_fingerprint is not None and report.model_fingerprint != self.spec.fingerprint:
            raise InvalidRequest(f"model_fingerprint {report.model_fingerprint[:16]}... is not the loaded model's "
                                 f"{self.spec.fingerprint[:16]}...", param="model_fingerprint")
        if len(report.scores) > s.MAX_SCORES:
            raise InvalidRequest(f"scores: at most {s.MAX_SCORES} metrics per report (each is a metric series)",
                                 param="scores")
        for value, field in ((report.task, "task"), *((m, f"scores.{m[:40]}") for m in report.scores)):
            try:
                check_label_value(value, field)
            except ValueError as exc:  # a metric label: no NUL or newline, bounded (issue 22)
                raise InvalidRequest(str(exc), param=field) from None
        at = time.time()
        record = report.model_dump(mode="json") | {"at": at, "key_id": key_id,
                                                   "model_fingerprint": self.spec.fingerprint}
        artifact_id = self._tracked(self.store.put_json, KIND_EVAL_SCORES, record)
        self.telemetry.observe_eval(report.task, report.scores, report.kv_quant, report.cache_mode, at)
        return s.EvalScoreAck(id=artifact_id, at=at)
