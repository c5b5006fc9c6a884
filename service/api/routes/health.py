"""``/health`` (alive), ``/health/ready`` (model loaded, the start-up one-step denoise passed, the worker
accepting), ``/metrics`` (Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from service.api.deps import TelemetryDep, WorkerDep
from service.worker import WorkerUnavailable

router = APIRouter()


@router.get("/health")
def health() -> dict[str, str]:
    """Alive."""
    return {"status": "ok"}


@router.get("/health/ready")
def ready(request: Request, worker: WorkerDep, telemetry: TelemetryDep) -> dict[str, str]:
    """Ready to serve: the start-up denoise passed and the worker accepts (503 otherwise)."""
    probe_error = request.app.state.probe_error
    if probe_error is not None:
        raise WorkerUnavailable(f"the start-up denoise check failed: {probe_error}")
    if not worker.accepting:
        reason = "is draining" if worker.fault is None else f"hit a device fault ({worker.fault})"
        telemetry.ready.set(0)
        raise WorkerUnavailable(f"not ready: the worker {reason}")
    telemetry.ready.set(1)
    return {"status": "ready"}


@router.get("/metrics")
def metrics(telemetry: TelemetryDep) -> Response:
    """Prometheus exposition of `service.telemetry`."""
    return Response(telemetry.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
