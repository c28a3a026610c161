"""/tasks: submit a task, list the ledger, read a task, its predictions, cancel it."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, Response

from ..errors import Conflict, InvalidRequest, NotFound
from ..models import Status, TaskAnswer, TaskList, TaskStatus, error_responses
from ..tasks.answers import answer_npz, predictions_npy, status_answer
from ..tasks.options import NPZ_TYPE, wants_npz
from . import intake
from .deps import ServiceDep, TenantDep, visible
from .openapi import TASK_OPENAPI, TASK_RESPONSES

router = APIRouter(tags=["tasks"])


async def visible_task(service, task_id: str, tenant=None):
    """The task's record, 404 unless it exists and the tenant may see it (tasks and their deliveries)."""
    record = await service.runner.get(task_id)
    if record is None or (tenant is not None and not visible(tenant, record.options.get("owner"))):
        # (another tenant's task is as absent as one never made: its existence is not revealed)
        if service.runner.shared is not None:
            raise NotFound(f"no task {task_id!r} in the shared ledger of this service's replicas (GET /tasks lists them)")
        raise NotFound(f"no task {task_id!r} on this server (GET /tasks lists its tasks)")
    return record


@router.post("/tasks", summary="Train fresh on a task npz and predict its queries", openapi_extra=TASK_OPENAPI,
             response_class=JSONResponse, responses=TASK_RESPONSES)
async def post_task(request: Request) -> Response:
    # the service from the app itself: no dependency to solve on the hottest route
    return await intake.handle(request, request.app.state.service)


@router.get("/tasks", summary="The ledger's tasks, newest first (no predictions)", response_model=TaskList,
            responses=error_responses(401, 422, 503))
async def list_tasks(service: ServiceDep, tenant: TenantDep, limit: Annotated[int, Query(ge=1, le=500)] = 50,
                     cursor: Annotated[str | None, Query(pattern="^[A-Za-z0-9_-]+$", description=(
                         "next_cursor of the previous page, unchanged (opaque; anything else is 422)"))] = None,
                     status: Annotated[Status | None, Query(description="only tasks in this status")] = None,
                     ) -> JSONResponse:
    await service.runner.written()  # answered tasks' records still on their way to the ledger: in it first
    try:
        records, next_cursor = await run_in_threadpool(service.ledger.list, limit, cursor, status, tenant.owner)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    return JSONResponse({"tasks": [r.summary() for r in records], "next_cursor": next_cursor})


@router.get("/tasks/{task_id}", summary="A task: its status, and once done the answer (or error)",
            responses={200: {"model": TaskAnswer | TaskStatus,
                             "content": {NPZ_TYPE: {"schema": {"type": "string", "format": "binary"}}},
                             "description": "succeeded: the synchronous answer's JSON plus status; otherwise the "
                             "status document. Accept: application/x-npz: the predictions (and scores) as npz"},
                       **error_responses(401, 404, 422, 503)})
async def get_task(task_id: str, request: Request, service: ServiceDep, tenant: TenantDep) -> Response:
    record = await visible_task(service, task_id, tenant)
    if wants_npz(request.headers.get("accept")) and record.status == "succeeded" and record.answer:
        return Response(answer_npz(record.answer), media_type=NPZ_TYPE, headers={
            "Content-Disposition": f'attachment; filename="rev88-{task_id}.npz"',
            "X-Predictions-SHA256": record.answer["predictions_sha256"]})
    body, code = status_answer(record)
    return JSONResponse(body, status_code=code)


@router.get("/tasks/{task_id}/predictions.npy", summary="A succeeded task's predictions as a .npy file (int64)",
            responses={200: {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
                             "description": "the predictions, as np.save writes them"},
                       **error_responses(401, 404, 409, 422, 503)})
async def get_predictions(task_id: str, service: ServiceDep, tenant: TenantDep) -> Response:
    record = await visible_task(service, task_id, tenant)
    if record.status != "succeeded" or not record.answer or "predictions" not in record.answer:
        raise Conflict(f"task {task_id} has no predictions: it is {record.status}")
    return Response(predictions_npy(record.answer["predictions"]), media_type="application/octet-stream",
                    headers={"Content-Disposition": f'attachment; filename="rev88-{task_id}.predictions.npy"',
                             "X-Predictions-SHA256": record.answer["predictions_sha256"]})


@router.post("/tasks/{task_id}/cancel", summary="Cancel a task: queued never runs, running is stopped",
             response_model=TaskStatus, responses=error_responses(401, 404, 409, 422, 503))
async def cancel_task(task_id: str, service: ServiceDep, tenant: TenantDep) -> JSONResponse:
    before = await visible_task(service, task_id, tenant)
    if before.finished:
        raise Conflict(f"task {task_id} has already finished ({before.status}); nothing to cancel",
                       task_status=before.status)
    record = await service.runner.cancel(task_id)
    if record is not None and record.finished and record.status != "cancelled":
        # it completed while the cancel was on its way: the cancel cancelled nothing
        raise Conflict(f"task {task_id} finished ({record.status}) before the cancel took effect; nothing to cancel",
                       task_status=record.status)
    doc = record.document()
    doc.pop("answer", None)
    return JSONResponse(doc, status_code=200)
