"""Health: /health (everything), /v2/health/live, /v2/health/ready, and /metrics; the documents
are plain functions of the service, the routes below them thin.

/health answers 200 while the service is ready and 503 otherwise (starting,
failed, draining); the body is the same full document either way.
"""

from __future__ import annotations

import datetime
from typing import Any

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, PlainTextResponse, Response

from ..http import body_reader
from ..models import Health, Probe
from ..service import Service
from .deps import ServiceDep


def live() -> dict[str, Any]:
    return {"status": "live"}


def readiness(service: Service) -> tuple[int, dict[str, Any]]:
    if service.ready:
        return 200, {"status": "ready"}
    if service.draining:
        reason = f"draining for shutdown ({service.drain_reason or 'signal'})"
        return 503, {"status": "draining", "error": f"not ready: {reason}"}
    if service.state == "failed":
        return 503, {"status": "failed", "error": f"not ready: startup checks failed: {service.failure}"}
    return 503, {"status": "starting", "error": "not ready: learner validation and backend warm-up still running"}


def ledger_state(service: Service) -> dict[str, Any]:
    shared = service.runner.shared  # PostgreSQL: this replica's side of the shared queue
    extra = {"engine": getattr(service.ledger, "engine", "sqlite"), "feeder": service.runner.feeder.snapshot()}
    if shared is not None:
        extra["shared_queue"] = shared.snapshot()
    try:
        counts = service.ledger.counts()
    except Exception as exc:  # noqa: BLE001 - /health must answer even when the ledger cannot
        if shared is not None:
            extra.update(service.ledger.stats())  # the pool and leases, without a query
        return {"ok": False, "error": str(exc), "path": str(service.ledger.path), **extra}
    return {"ok": True, "path": str(service.ledger.path), "retain_tasks": service.settings.retain_tasks,
            "retain_bytes": service.settings.retain_bytes, "recovered_at_start": service.recovered, **counts,
            **extra}


def uploads_state(service: Service) -> dict[str, Any]:
    """The bodies being received now: the bytes they hold in the upload budget (reserved as they
    arrive, app/http/uploads.py), how many, and how many a reading thread holds."""
    budget = service.uploads
    return {"held_bytes": budget.held, "in_progress": budget.uploads, "capacity_bytes": budget.capacity,
            "read_by_threads": body_reader.busy()}


def health(service: Service) -> tuple[int, dict[str, Any]]:
    """The full document. Calls NVML (through learner.energy): run it in a worker thread."""
    gpu, gpu_reason = service.energy.telemetry()
    doc: dict[str, Any] = {
        "status": service.status,
        "ready": service.ready,
        "device": "cuda" if service.backend in ("cuda", "fused") else "cpu",
        "backend": service.backend,
        "gpu": gpu,
    }
    if gpu is None:
        doc["gpu_reason"] = gpu_reason
    doc.update(
        {
            "energy": {
                "per_request": service.energy.meter is not None,
                "reason": service.energy.reason if service.energy.meter is None else None,
                "idle_baseline_w": service.energy.idle.median_w() if service.energy.meter is not None else None,
                "meters": sorted(service.energy.meters),
            },
            "learner": service.learner_state(),
            "queue": service.executor.snapshot(),
            "admission": service.admission(),
            "seed_cache": service.seed_cache(),
            "uptime_s": round(service.uptime_s, 3),
            "started_at": datetime.datetime.fromtimestamp(service.started_at, datetime.UTC).isoformat(
                timespec="seconds"
            ),
            "workers": service.plan.as_dict(),
            "ledger": ledger_state(service),
            "uploads": uploads_state(service),
            "limits": {
                "queue_size": service.queue_size,
                "max_body_bytes": service.settings.max_body_bytes,
                "task_timeout_s": service.settings.task_timeout_s,
                "drain_timeout_s": service.settings.drain_timeout_s,
                "max_task_work": service.settings.max_task_work,
                "max_task_bytes": service.settings.max_task_bytes,
                "batch_max": service.batch_max,
                "workers": len(service.plan.devices),
            },
            "auth": service.settings.auth_enabled,
            "versions": service.versions(),
        }
    )
    return (200 if service.ready else 503), doc


# --------------------------------------------------------------------------- routes

router = APIRouter(tags=["health"])


@router.get("/health", summary="Status, device, GPU telemetry, learner state, queue, workers, limits, versions",
            response_model=Health, responses={503: {"model": Health, "description": "not ready"}})
async def get_health(service: ServiceDep) -> JSONResponse:
    await service.runner.written(timeout_s=1.0)  # the ledger's counts include every task answered so far
    status, doc = await run_in_threadpool(health, service)
    return JSONResponse(doc, status_code=status)


@router.get("/v2/health/live", summary="Liveness: the process is up", response_model=Probe,
            response_model_exclude_none=True)
async def get_live() -> dict:
    return live()


@router.get("/v2/health/ready", summary="Readiness: validated, warmed up, not draining", response_model=Probe,
            responses={503: {"model": Probe}})
async def get_ready(service: ServiceDep) -> JSONResponse:
    status, doc = readiness(service)
    return JSONResponse(doc, status_code=status)


@router.get("/metrics", summary="Prometheus metrics (text exposition format)", response_class=PlainTextResponse,
            responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                             "description": "Prometheus text format 0.0.4"}})
async def get_metrics(service: ServiceDep) -> Response:
    body, content_type = await run_in_threadpool(service.metrics.render)
    return Response(body, media_type=content_type)
