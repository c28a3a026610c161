"""/evaluations: the published draws graded on the server for one config, and the leaderboard
(app/tasks/evaluations.py holds what these routes do; docs/evaluations.md). The report page and
the leaderboard page are the web UI's (app/web): ``GET /evaluations/<id>`` asked for HTML
(``Accept: text/html`` first) is sent there."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from starlette.responses import JSONResponse, RedirectResponse, Response

from learner.report_plot import accuracy_svg

from ..errors import Conflict
from ..http.middleware import prefers_html
from ..models import EvaluationAccepted, EvaluationList, EvaluationRequest, EvaluationState, error_responses
from ..tasks.evaluations import per_draw
from ..tasks.options import parse_options
from .deps import ServiceDep, TenantDep
from .intake import gate, idempotency_key, webhook_of

router = APIRouter(tags=["evaluations"])


@router.post("/evaluations", summary="Grade a config on the published draws (each a task on the server's own draw)",
             status_code=202, response_model=EvaluationAccepted,
             responses=error_responses(400, 401, 409, 413, 422, 503))
async def post_evaluation(body: EvaluationRequest, request: Request, service: ServiceDep,
                          tenant: TenantDep) -> JSONResponse:
    gate(service)
    backend = parse_options([("backend", body.backend)] if body.backend else [], service.backend).backend
    request_body = body.model_dump(exclude_none=True)
    webhook = await webhook_of(service, request_body.pop("webhook", None), request_body.pop("webhook_events", None),
                               ("completed",))
    if webhook is not None:
        request_body["webhook"] = webhook
    ev, created = await service.evaluations.submit(request_body, backend, idempotency_key(request), tenant)
    location = f"/evaluations/{ev.id}"
    headers = {"Location": location} | ({} if created else {"Idempotent-Replayed": "true"})
    return JSONResponse({"id": ev.id, "status": "accepted", "draws": ev.definition["draws"], "location": location,
                         "report": f"{location}/report"}, status_code=202, headers=headers)


@router.get("/evaluations/{evaluation_id}", summary="An evaluation: status, per-draw rows, totals (HTML: its report)",
            response_model=EvaluationState, responses={303: {"description": "Accept: text/html: the report page"},
                                                       **error_responses(401, 404, 422, 503)})
async def get_evaluation(evaluation_id: str, request: Request, service: ServiceDep, tenant: TenantDep) -> Response:
    if prefers_html(request.headers.get("accept")):
        return RedirectResponse(f"{request.scope.get('root_path', '')}/evaluations/{evaluation_id}/report",
                                status_code=303)
    return JSONResponse(await service.evaluations.state(evaluation_id, tenant.owner))


@router.get("/evaluations/{evaluation_id}/accuracy.svg", summary="The per-draw accuracy chart (SVG)",
            response_class=Response, responses={200: {"content": {"image/svg+xml": {"schema": {"type": "string"}}}},
                                                **error_responses(401, 404, 409, 422, 503)})
async def get_chart(evaluation_id: str, service: ServiceDep, tenant: TenantDep) -> Response:
    doc = await service.evaluations.state(evaluation_id, tenant.owner)
    t = doc["totals"]
    if t is None:
        raise Conflict(f"evaluation {evaluation_id} is {doc['status']}: the chart needs every draw's count",
                       evaluation_status=doc["status"])
    draws = per_draw(doc["draws"])  # (with seeds: each draw's runs pooled, as the totals are)
    svg = accuracy_svg([r["draw"] for r in draws], [r["correct"] for r in draws], [r["total"] for r in draws],
                       t["mean_accuracy_percent"], t["sd_accuracy_pp"], [b["band_percent"] for b in t["error_bands"]],
                       [b["met"] for b in t["error_bands"]],
                       title=f"rev88 accuracy per draw ({t['correct_over_total']} correct)")
    return Response(svg, media_type="image/svg+xml")


@router.get("/evaluations", summary="The leaderboard: evaluations, newest first or by accuracy, time or energy",
            response_model=EvaluationList, responses=error_responses(401, 422, 503))
async def list_evaluations(
    service: ServiceDep, tenant: TenantDep, limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[str | None, Query(pattern="^[A-Za-z0-9_-]+$", description=(
        "next_cursor of the previous page, unchanged (with the same sort)"))] = None,
    sort: Annotated[Literal["created", "accuracy", "time", "energy"], Query(description=(
        "created (newest first), accuracy (highest mean first), time or energy (lowest per task first)"))] = "created",
) -> JSONResponse:
    rows, next_cursor = await service.evaluations.page(limit, cursor, sort, tenant.owner)
    return JSONResponse({"evaluations": rows, "next_cursor": next_cursor})


@router.post("/evaluations/{evaluation_id}/cancel", summary="Cancel an evaluation's unfinished draws",
             response_model=EvaluationState, responses=error_responses(401, 404, 409, 422, 503))
async def cancel_evaluation(evaluation_id: str, service: ServiceDep, tenant: TenantDep) -> JSONResponse:
    return JSONResponse(await service.evaluations.cancel(evaluation_id, tenant.owner))
