"""Webhooks (issue #34; app/webhooks/ holds what these routes do; docs/webhooks.md): the tenant's
signing secret, the URLs that answered 410, and each task's, sweep's and evaluation's delivery log."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, Response

from ..errors import Conflict, Forbidden, NotFound
from ..models import DeliveryLog, Redelivered, StoppedWebhooks, WebhookSecret, error_responses
from .deps import ServiceDep, TenantDep
from .tasks import visible_task

router = APIRouter(tags=["webhooks"])


def _signer(tenant) -> None:
    if not tenant.can("write"):  # the secret lets its holder sign messages: not for a read-only key
        raise Forbidden(f"key {tenant.name!r} lacks the write scope the webhook signing secret needs")


@router.get("/webhooks/secret", summary="The tenant's webhook signing secret (made on first use)",
            response_model=WebhookSecret, responses=error_responses(401, 403, 503))
async def get_secret(service: ServiceDep, tenant: TenantDep) -> JSONResponse:
    _signer(tenant)
    return JSONResponse(await run_in_threadpool(service.webhooks.secret, tenant.owner))


@router.post("/webhooks/secret/rotate",
             summary="A new signing secret; the old one also signs for REV88_WEBHOOK_SECRET_OVERLAP_S",
             response_model=WebhookSecret, responses=error_responses(401, 403, 503))
async def rotate_secret(service: ServiceDep, tenant: TenantDep) -> JSONResponse:
    _signer(tenant)
    return JSONResponse(await run_in_threadpool(service.webhooks.rotate, tenant.owner))


@router.get("/webhooks/stopped", summary="The tenant's webhook URLs that answered 410 Gone (no more deliveries)",
            response_model=StoppedWebhooks, responses=error_responses(401, 503))
async def list_stopped(service: ServiceDep, tenant: TenantDep) -> JSONResponse:
    rows = await run_in_threadpool(service.webhooks.outbox.stopped, tenant.owner or "")
    return JSONResponse({"stopped": rows})


@router.delete("/webhooks/stopped", summary="Deliver to a URL that answered 410 again (later messages)",
               status_code=204, responses=error_responses(401, 404, 422, 503))
async def resume_stopped(service: ServiceDep, tenant: TenantDep,
                         url: Annotated[str, Query(max_length=2048, description="the stopped URL, exactly")]):
    if not await run_in_threadpool(service.webhooks.resume, tenant.owner, url):
        raise NotFound(f"webhook URL {url[:200]!r} is not stopped for this tenant")
    return Response(status_code=204)


async def _subject(service, kind: str, subject_id: str, tenant) -> None:
    """404 unless the tenant may see the task, sweep or evaluation."""
    if kind == "task":
        await visible_task(service, subject_id, tenant)
    elif kind == "sweep":
        sweep = await run_in_threadpool(service.datasets.store.get_sweep, subject_id)
        if sweep is None or (tenant.owner is not None and sweep.owner != tenant.owner):
            raise NotFound(f"no sweep {subject_id!r} here")
    else:
        await service.evaluations.get(subject_id, tenant.owner)


def _routes(kind: str, collection: str) -> None:
    @router.get(f"/{collection}/{{subject_id}}/deliveries", summary=f"A {kind}'s webhook messages and attempts",
                response_model=DeliveryLog, responses=error_responses(401, 404, 422, 503),
                name=f"{kind}_deliveries")
    async def deliveries(subject_id: str, service: ServiceDep, tenant: TenantDep) -> JSONResponse:
        await _subject(service, kind, subject_id, tenant)
        return JSONResponse(await run_in_threadpool(service.webhooks.log_of, kind, subject_id, tenant.owner))

    @router.post(f"/{collection}/{{subject_id}}/deliveries/redeliver", status_code=202,
                 summary=f"Send a {kind}'s webhook messages again (same ids, same bodies, the schedule anew)",
                 response_model=Redelivered, responses=error_responses(401, 404, 409, 422, 503),
                 name=f"{kind}_redeliver")
    async def redeliver(subject_id: str, service: ServiceDep, tenant: TenantDep) -> JSONResponse:
        await _subject(service, kind, subject_id, tenant)
        ids = await run_in_threadpool(service.webhooks.redeliver, subject_id, tenant.owner)
        if not ids:
            log = await run_in_threadpool(service.webhooks.log_of, kind, subject_id, tenant.owner)
            why = ("it was submitted without a webhook" if not log["messages"]
                   else "its event has not happened yet (its messages are waiting)")
            raise Conflict(f"nothing to redeliver for {kind} {subject_id}: {why}", field="webhook")
        return JSONResponse({"redelivered": ids}, status_code=202)


for _kind, _collection in (("task", "tasks"), ("sweep", "sweeps"), ("evaluation", "evaluations")):
    _routes(_kind, _collection)
