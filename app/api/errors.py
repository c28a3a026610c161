"""Every exception a route lets through becomes the JSON error body of app/errors.py's
``error_answer`` -- the same mapping the task runner uses for a failed task."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import iter_route_contexts
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from learner.backends import BackendUnavailable
from learner.errors import TaskError

from ..errors import ServiceError, error_answer, json_safe
from ..http.logs import request_id_var
from ..ledger import LedgerUnavailable


def _request_id(request: Request) -> str | None:
    return getattr(request.state, "request_id", None)


async def _any_error(request: Request, exc: Exception) -> JSONResponse:
    status, body, headers = error_answer(exc, _request_id(request))
    return JSONResponse(body, status_code=status, headers=headers)


def _allowed(request: Request) -> str:
    """Every method the app's routes serve at this path (Starlette names only the first route's)."""
    methods: set[str] = set()
    for route in iter_route_contexts(request.app.routes):  # (an included router's routes too)
        regex = getattr(route, "path_regex", None)
        if regex is not None and regex.match(request.url.path):
            methods |= set(getattr(route, "methods", None) or ())
    return ", ".join(sorted(methods))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    """Anything no other handler takes: a 500, logged with its traceback. Starlette calls this one
    from its outermost layer (ServerErrorMiddleware), outside the request middleware
    (app/http/middleware.py), so the log line's request id and the X-Request-ID header are set
    here. Starlette then raises the exception on to uvicorn, which closes the connection: the
    answer says so (``Connection: close``), so that a client does not send its next request on it."""
    rid = _request_id(request)
    token = request_id_var.set(rid)
    try:
        response = await _any_error(request, exc)
    finally:
        request_id_var.reset(token)
    if rid is not None:
        response.headers["X-Request-ID"] = rid
    response.headers["Connection"] = "close"
    return response


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    headers = dict(getattr(exc, "headers", None) or {})
    if exc.status_code == 405:
        headers["Allow"] = _allowed(request)
    return JSONResponse({"error": str(exc.detail), "request_id": _request_id(request)}, status_code=exc.status_code,
                        headers=headers)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    problems = "; ".join(f"{' '.join(str(part) for part in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors())
    body = {"error": f"invalid request: {problems}", **json_safe({"details": exc.errors()}),
            "request_id": _request_id(request)}
    return JSONResponse(body, status_code=422)


def install(app: FastAPI) -> None:
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    for known in (ServiceError, TaskError, BackendUnavailable, LedgerUnavailable):
        app.add_exception_handler(known, _any_error)
    app.add_exception_handler(Exception, _unexpected)  # anything else: 500, logged (Starlette re-raises it after)
