"""/usage: what each tenant has used, per UTC day (issue #33; docs/tenants.md)."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Query
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse

from ..models import UsageReport, error_responses
from .deps import ServiceDep, TenantDep

router = APIRouter(tags=["keys"])


@router.get("/usage", summary="Tasks, device seconds and joules per day: one's own (the admin: every tenant's)",
            response_model=UsageReport, responses=error_responses(401, 422, 503))
async def get_usage(service: ServiceDep, tenant: TenantDep,
                    days: Annotated[int, Query(ge=1, le=366, description="how many days back (UTC)")] = 30,
                    ) -> JSONResponse:
    await service.runner.written()
    since = (time.time() // 86400 - (days - 1)) * 86400
    rows = await run_in_threadpool(service.ledger.usage, tenant.owner, since)
    names = {k.id: k.name for k in await run_in_threadpool(service.keys.store.list)} if tenant.owner is None else {
        tenant.id: tenant.name}
    out = [{"tenant": owner or "admin", "name": names.get(owner, "admin" if owner is None else owner), "day": day,
            "tasks": int(tasks), "succeeded": int(ok or 0), "device_seconds": round(float(seconds or 0.0), 6),
            "joules": None if joules is None else float(joules)}
           for owner, day, tasks, ok, seconds, joules in rows]
    return JSONResponse({"since": since, "days": days, "usage": out,
                         "device_seconds_definition": "the sum of the tasks' timing.run_ms: the learner's own run "
                         "(a batched launch's time shared among its tasks)"})
