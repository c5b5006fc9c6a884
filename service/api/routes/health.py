"""``/health`` (alive), ``/health/ready`` (model loaded, the start-up one-step denoise passed, the worker
accepting), ``/metrics`` (Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from service.api.deps import ActiveDep, TelemetryDep, WorkerDep
from service.runtime.loop import WorkerUnavailable

router = APIRouter()


# Each GET route also answers HEAD (load balancers and uptime checkers probe with either; RFC 9110 §9.3.2: the GET
# answer without its body). HEAD is left out of the OpenAPI document, which states it for no route.
@router.get("/health")
@router.head("/health", include_in_schema=False)
def health() -> dict[str, str]:
    """Alive."""
    return {"status": "ok"}


@router.get("/health/ready")
@router.head("/health/ready", include_in_schema=False)
def ready(request: Request, worker: WorkerDep, active: ActiveDep, telemetry: TelemetryDep) -> dict[str, str]:
    """Ready to serve: the start-up denoise passed, the worker accepts, the store accepts this server's
    credentials, and every cache mode's configuration can be served (503 otherwise, naming what cannot and why)."""
    probe_error = request.app.state.probe_error
    if probe_error is not None:
        raise WorkerUnavailable(f"the start-up denoise check failed: {probe_error}")
    if not worker.accepting:
        reason = "is draining" if worker.fault is None else f"hit a device fault ({worker.fault})"
        telemetry.ready.set(0)
        raise WorkerUnavailable(f"not ready: the worker {reason}")
    if active.store_denied is not None:
        telemetry.ready.set(0)
        raise WorkerUnavailable(f"not ready: {active.store_denied}")
    if active.not_ready:
        telemetry.ready.set(0)
        raise WorkerUnavailable("not ready: " + "; ".join(
            f"cache mode {mode} cannot serve its configuration ({reason})"
            for mode, reason in sorted(active.not_ready.items())))
    telemetry.ready.set(1)
    return {"status": "ready"}


@router.get("/metrics")
@router.head("/metrics", include_in_schema=False)
def metrics(telemetry: TelemetryDep) -> Response:
    """Prometheus exposition of `service.telemetry`."""
    return Response(telemetry.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
