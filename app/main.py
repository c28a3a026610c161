"""The FastAPI app: ``create_app(settings) -> FastAPI``; routes stay thin.

Run it with ``rev88 serve`` or ``uvicorn --factory app.main:create_app``
(settings come from the REV88_* environment variables, see app/settings.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from learner import __version__
from learner.backends import NAMES, BackendUnavailable
from learner.config import FIELDS
from learner.errors import TaskError

from . import health as health_docs
from . import lifecycle, submit, web
from .errors import Conflict, InvalidRequest, NotFound, ServiceError
from .ledger import LedgerUnavailable
from .logs import configure_logging
from .middleware import RequestMiddleware
from .models import Health, Probe, TaskAnswer, TaskList, TaskStatus, TaskSummary, error_responses
from .service import Service
from .settings import Settings
from .tasks import MEASURE_PARAMS, NPZ_TYPE, answer_npz, predictions_npy, wants_npz

log = logging.getLogger("rev88.app")

DESCRIPTION = """Train the rev88 learner fresh on every uploaded task and return its predictions,
hashes, timing and (on an NVIDIA GPU) energy. The same npz and backend give byte-identical
predictions and hashes to `rev88 run`.

Errors are JSON `{"error": "..."}`: 400 not a zip / truncated / corrupt, 401 missing or wrong
Bearer key (when REV88_API_KEY is set), 413 body or archive over the limits, 415 unsupported
content type, 422 invalid arrays, config, labels or diverged training, 503 queue full / not ready /
draining (with Retry-After), 504 task timeout."""


def _json_safe(details: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(details, default=str))


def error_response(request: Request, status: int, message: str, headers: dict[str, str] | None = None,
                   **details: Any) -> JSONResponse:
    body = {"error": message, **_json_safe(details)}
    body["request_id"] = getattr(request.state, "request_id", None)
    return JSONResponse(body, status_code=status, headers=headers)


def _task_params() -> list[dict[str, Any]]:
    params: list[dict[str, Any]] = [
        {"name": "backend", "in": "query", "required": False,
         "schema": {"type": "string", "enum": list(NAMES)},
         "description": "backend to run on (default: the server's REV88_BACKEND)"},
        {"name": "include", "in": "query", "required": False, "schema": {"type": "string", "enum": ["scores"]},
         "description": "include=scores adds the (M, 10) float32 scores to the JSON answer"},
        {"name": "measure", "in": "query", "required": False, "schema": {"type": "string", "enum": ["energy"]},
         "description": "measure=energy runs the paired-idle energy protocol (learner.measure) instead"},
    ]
    for name, (kind, low, high, default) in MEASURE_PARAMS.items():
        params.append({"name": name, "in": "query", "required": False,
                       "schema": {"type": "integer" if kind is int else "number", "minimum": low, "maximum": high,
                                  "default": default},
                       "description": f"measure=energy only: {name}"})
    for name in FIELDS:
        params.append({"name": name, "in": "query", "required": False, "schema": {"type": "number"},
                       "description": f"config override {name} (validated as in the CLI; unknown keys are 422)"})
    return params


TASK_OPENAPI = {
    "parameters": _task_params(),
    "requestBody": {
        "required": True,
        "description": "the task npz (train_images float32 (N,1,9,9), train_labels int (N,), test_images float32 (M,1,9,9))",
        "content": {
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
            NPZ_TYPE: {"schema": {"type": "string", "format": "binary"}},
            "multipart/form-data": {"schema": {"type": "object", "required": ["file"], "properties": {
                "file": {"type": "string", "format": "binary"},
                "config": {"type": "string", "description": "JSON object of config overrides"},
            }}},
        },
    },
}
TASK_OPENAPI["parameters"] += [
    {"name": "Prefer", "in": "header", "required": False, "schema": {"type": "string", "enum": ["respond-async"]},
     "description": "respond-async: answer 202 with Location: /tasks/{id} once the task is durable"},
    {"name": "Idempotency-Key", "in": "header", "required": False, "schema": {"type": "string", "maxLength": 200},
     "description": "the same key with the same body returns the same task (another body: 409)"},
]
TASK_RESPONSES = {
    200: {"model": TaskAnswer, "description": "predictions, hashes, metadata, timing, energy (JSON; an npz of "
          "predictions and scores with Accept: application/x-npz)", "content": {NPZ_TYPE: {}}},
    202: {"model": TaskSummary, "description": "Prefer: respond-async: accepted and durable; poll Location"},
    **error_responses(400, 401, 409, 413, 415, 422, 503, 504),
}


def create_app(settings: Settings | None = None, engines: Callable[[str], Any] | None = None) -> FastAPI:
    """The app. ``engines`` (backend name -> backend object; default: the learner's
    registry ``learner.backends.get_backend``) lets code that embeds the service supply
    its own backend objects; it is not reachable from HTTP or the environment."""
    settings = settings or Settings.from_env()
    configure_logging(settings.log_level)
    service = Service(settings, engines)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(title="rev88 service", version=__version__, description=DESCRIPTION, lifespan=lifespan)
    app.state.service = service
    app.state.settings = settings
    app.add_middleware(RequestMiddleware, api_key=settings.api_key, metrics=service.metrics)

    # ------------------------------------------------------------------ errors -> {"error": ...}
    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError):
        return error_response(request, exc.status, exc.message, exc.headers(), **exc.details)

    @app.exception_handler(TaskError)
    async def _task_error(request: Request, exc: TaskError):
        return error_response(request, exc.status, exc.message, type=type(exc).__name__, **exc.details)

    @app.exception_handler(BackendUnavailable)
    async def _backend_error(request: Request, exc: BackendUnavailable):
        return error_response(request, 422, str(exc), type="BackendUnavailable")

    @app.exception_handler(LedgerUnavailable)
    async def _ledger_error(request: Request, exc: LedgerUnavailable):
        return error_response(request, 503, f"the task ledger is unavailable: {exc}", {"Retry-After": "30"})

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error_response(request, exc.status_code, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return error_response(request, 422, "invalid request", details=exc.errors())

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log.exception("unhandled error", exc_info=exc)
        return error_response(request, 500, f"internal error: {type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------ routes
    @app.post("/tasks", summary="Train fresh on a task npz and predict its queries", openapi_extra=TASK_OPENAPI,
              response_class=JSONResponse, responses=TASK_RESPONSES)
    async def post_task(request: Request) -> Response:
        return await submit.handle(request, service)

    @app.get("/tasks", summary="The ledger's tasks, newest first (no predictions)", response_model=TaskList,
             responses=error_responses(401, 422, 503))
    async def list_tasks(limit: int = Query(50, ge=1, le=500), cursor: str | None = None,
                         status: str | None = Query(None, description="queued, running, succeeded, failed, cancelled"),
                         ) -> JSONResponse:
        try:
            records, next_cursor = await run_in_threadpool(service.ledger.list, limit, cursor, status)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        return JSONResponse({"tasks": [r.summary() for r in records], "next_cursor": next_cursor})

    @app.get("/tasks/{task_id}", summary="A task: its status, and once done the answer (or error)",
             responses={200: {"model": TaskAnswer | TaskStatus, "content": {NPZ_TYPE: {}},
                              "description": "succeeded: the synchronous answer's JSON plus status; otherwise the "
                              "status document. Accept: application/x-npz: the predictions (and scores) as npz"},
                        **error_responses(401, 404, 503)})
    async def get_task(task_id: str, request: Request) -> Response:
        record = await run_in_threadpool(service.ledger.get, task_id)
        if record is None:
            raise NotFound(f"no task {task_id!r} in this replica's ledger (each replica keeps its own)")
        if wants_npz(request.headers.get("accept")) and record.status == "succeeded" and record.answer:
            return Response(answer_npz(record.answer), media_type=NPZ_TYPE, headers={
                "Content-Disposition": f'attachment; filename="rev88-{task_id}.npz"',
                "X-Predictions-SHA256": record.answer["predictions_sha256"]})
        body, code = submit.status_answer(record)
        return JSONResponse(body, status_code=code)

    @app.get("/tasks/{task_id}/predictions.npy", summary="A succeeded task's predictions as a .npy file (int64)",
             responses={200: {"content": {"application/octet-stream": {}}}, **error_responses(401, 404, 409, 503)})
    async def get_predictions(task_id: str) -> Response:
        record = await run_in_threadpool(service.ledger.get, task_id)
        if record is None:
            raise NotFound(f"no task {task_id!r} in this replica's ledger")
        if record.status != "succeeded" or not record.answer or "predictions" not in record.answer:
            raise Conflict(f"task {task_id} has no predictions: it is {record.status}")
        return Response(predictions_npy(record.answer["predictions"]), media_type="application/octet-stream",
                        headers={"Content-Disposition": f'attachment; filename="rev88-{task_id}.predictions.npy"',
                                 "X-Predictions-SHA256": record.answer["predictions_sha256"]})

    @app.post("/tasks/{task_id}/cancel", summary="Cancel a task: queued never runs, running is stopped",
              response_model=TaskStatus, responses=error_responses(401, 404, 409, 503))
    async def cancel_task(task_id: str) -> JSONResponse:
        before = await run_in_threadpool(service.ledger.get, task_id)
        if before is None:
            raise NotFound(f"no task {task_id!r} in this replica's ledger")
        if before.finished:
            raise Conflict(f"task {task_id} has already finished ({before.status}); nothing to cancel",
                           task_status=before.status)
        record = await lifecycle.cancel(service, task_id)
        doc = record.document()
        doc.pop("answer", None)
        return JSONResponse(doc, status_code=200)

    @app.get("/health", summary="Status, device, GPU telemetry, learner state, queue, workers, limits, versions",
             response_model=Health, responses={503: {"model": Health, "description": "not ready"}})
    async def get_health() -> JSONResponse:
        status, doc = await run_in_threadpool(health_docs.health, service)
        return JSONResponse(doc, status_code=status)

    @app.get("/v2/health/live", summary="Liveness: the process is up", response_model=Probe,
             response_model_exclude_none=True)
    async def get_live() -> dict:
        return health_docs.live()

    @app.get("/v2/health/ready", summary="Readiness: validated, warmed up, not draining", response_model=Probe,
             responses={503: {"model": Probe}})
    async def get_ready() -> JSONResponse:
        status, doc = health_docs.readiness(service)
        return JSONResponse(doc, status_code=status)

    @app.get("/metrics", summary="Prometheus metrics")
    async def get_metrics() -> Response:
        body, content_type = await run_in_threadpool(service.metrics.render)
        return Response(body, media_type=content_type)

    web.install(app)  # the web page (app/web): / and /ui/tasks/{id}, its script and styles under /static
    return app
