"""/sweeps: one stored dataset, a grid of configs × seeds, one request (app/tasks/sweeps.py holds
what these routes do; docs/sweeps.md)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from starlette.responses import JSONResponse, Response

from ..errors import InvalidRequest
from ..models import SweepAccepted, SweepList, SweepRequest, SweepState, error_responses
from ..tasks.answers import encode_json
from ..tasks.options import parse_options
from ..tasks.sweeps import as_csv
from .deps import ServiceDep, TenantDep
from .intake import gate, idempotency_key, webhook_of

router = APIRouter(tags=["sweeps"])


@router.post("/sweeps", summary="A sweep: the grid's product × the seeds, each cell a task on the stored dataset",
             status_code=202, response_model=SweepAccepted, responses=error_responses(400, 401, 404, 409, 413, 422, 503))
async def post_sweep(body: SweepRequest, request: Request, service: ServiceDep, tenant: TenantDep) -> JSONResponse:
    gate(service)
    backend = parse_options([("backend", body.backend)] if body.backend else [], service.backend).backend
    definition = body.model_dump(exclude_none=True)
    webhook = await webhook_of(service, definition.pop("webhook", None), definition.pop("webhook_events", None),
                               ("completed",))
    if webhook is not None:
        definition["webhook"] = webhook  # (part of the definition: a replay must carry the same)
    sweep, created = await service.sweeps.submit(definition, backend, idempotency_key(request), tenant.owner,
                                                 tenant)
    location = f"/sweeps/{sweep.id}"
    headers = {"Location": location} | ({} if created else {"Idempotent-Replayed": "true"})
    return JSONResponse({"id": sweep.id, "status": "accepted", "cells": len(sweep.cells), "location": location},
                        status_code=202, headers=headers)


@router.get("/sweeps/{sweep_id}", summary="A sweep: its status, counts, and a row per cell (?format=csv: the table)",
            response_model=SweepState,
            responses={200: {"content": {"text/csv": {"schema": {"type": "string"}}}},
                       **error_responses(401, 404, 422, 503)})
async def get_sweep(sweep_id: str, service: ServiceDep, tenant: TenantDep,
                    format: Annotated[Literal["json", "csv"], Query(description="json (default) or csv")] = "json",
                    ) -> Response:
    doc = await service.sweeps.state(sweep_id, tenant.owner)
    if format == "csv":
        return Response(as_csv(doc), media_type="text/csv",
                        headers={"Content-Disposition": f'attachment; filename="rev88-{sweep_id}.csv"'})
    # (a sweep's document lists every cell: encoded once by orjson, not the standard encoder)
    return Response(encode_json(doc), media_type="application/json")


@router.get("/sweeps", summary="The sweeps, newest first, each with its status and counts (no cell rows)",
            response_model=SweepList,
            responses=error_responses(401, 422, 503))
async def list_sweeps(service: ServiceDep, tenant: TenantDep, limit: Annotated[int, Query(ge=1, le=500)] = 50,
                      cursor: Annotated[str | None, Query(pattern="^[A-Za-z0-9_-]+$", description=(
                          "next_cursor of the previous page, unchanged"))] = None) -> JSONResponse:
    try:
        rows, next_cursor = await service.sweeps.page(limit, cursor, tenant.owner)
    except ValueError as exc:
        raise InvalidRequest(str(exc), field="cursor") from None
    return JSONResponse({"sweeps": rows, "next_cursor": next_cursor})


@router.post("/sweeps/{sweep_id}/cancel", summary="Cancel a sweep's unfinished cells (finished ones are kept)",
             response_model=SweepState, responses=error_responses(401, 404, 409, 422, 503))
async def cancel_sweep(sweep_id: str, service: ServiceDep, tenant: TenantDep) -> JSONResponse:
    return JSONResponse(await service.sweeps.cancel(sweep_id, tenant.owner))
