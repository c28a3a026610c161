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

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from learner import __version__
from learner.backends import NAMES, BackendUnavailable
from learner.config import FIELDS
from learner.errors import TaskError

from . import health as health_docs
from . import submit
from .errors import ServiceError
from .logs import configure_logging
from .middleware import RequestMiddleware
from .service import Service
from .settings import Settings
from .tasks import MEASURE_PARAMS, NPZ_TYPE

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
    "responses": {
        "200": {"description": "predictions, hashes, metadata, timing, energy (JSON; an npz of predictions "
                "and scores with Accept: application/x-npz)",
                "content": {"application/json": {}, NPZ_TYPE: {}}},
        **{str(code): {"description": text} for code, text in (
            (400, "not a zip/npz, truncated or corrupt"), (401, "missing or wrong Bearer key"),
            (413, "body or archive over the limits"), (415, "unsupported content type"),
            (422, "invalid arrays, members, config or diverged training"),
            (503, "queue full, not ready or draining (Retry-After)"), (504, "task timeout"))},
    },
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
              response_class=JSONResponse)
    async def post_task(request: Request) -> Response:
        return await submit.handle(request, service)

    @app.get("/health", summary="Status, device, GPU telemetry, learner state, queue, versions")
    async def get_health() -> JSONResponse:
        status, doc = await run_in_threadpool(health_docs.health, service)
        return JSONResponse(doc, status_code=status)

    @app.get("/v2/health/live", summary="Liveness: the process is up")
    async def get_live() -> dict:
        return health_docs.live()

    @app.get("/v2/health/ready", summary="Readiness: validated, warmed up, not draining")
    async def get_ready() -> JSONResponse:
        status, doc = health_docs.readiness(service)
        return JSONResponse(doc, status_code=status)

    @app.get("/metrics", summary="Prometheus metrics")
    async def get_metrics() -> Response:
        body, content_type = await run_in_threadpool(service.metrics.render)
        return Response(body, media_type=content_type)

    return app
