"""The web page: ``/`` (upload form, recent tasks, health), ``/ui/tasks/{id}`` (one task) and
``/ui/sweeps/{id}`` (one sweep: its cell table and chart), ``/ui/evaluations`` (the leaderboard) and
``/ui/evaluations/{id}`` = ``/evaluations/{id}/report`` (one evaluation's report).

Server-rendered with Jinja2 (templates/) plus a little plain JavaScript (static/rev88.js, no
build step). The HTML carries no task data: the script fetches the JSON API (``/tasks``,
``/health``) and sends the API key a user typed into the page (kept in the browser's
localStorage) as ``Authorization: Bearer``. So these pages and the static files are open
without the key (app/http/middleware.py), while every API route stays protected.

app/main.py calls ``install(app)``: the routes of ``router`` on the app itself, the interactive
API docs (``/docs``, ``/redoc``: api_docs.py, served without a CDN) and the static files mounted
at ``STATIC_PATH``.
"""

from __future__ import annotations

import re
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from learner import __version__
from learner.backends import NAMES
from learner.config import FIELDS, INT_FIELDS, Config, bound_text

from ..http.middleware import prefers_html
from . import api_docs

HERE = Path(__file__).resolve().parent
STATIC_PATH = "/static"
UI_PREFIX = "/ui/"
TASK_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")

# The page's own scripts and styles only; the data comes from this origin's JSON API.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

templates = Jinja2Templates(directory=str(HERE / "templates"))
router = APIRouter(include_in_schema=False)


def static_files() -> StaticFiles:
    return StaticFiles(directory=str(HERE / "static"))


def install(app: FastAPI) -> None:
    """The page's routes and static files on ``app``. The routes are added one by one rather
    than with ``app.include_router(router)``: since FastAPI 0.16x that adds one nested entry to
    ``app.routes`` (no ``.path``), and code that reads the app's route table expects routes."""
    for route in router.routes:
        app.add_api_route(route.path, route.endpoint, methods=sorted(route.methods), name=route.name,
                          summary=route.summary, response_class=HTMLResponse, include_in_schema=False)
    api_docs.install(app)  # (its files' mount, under STATIC_PATH, before the page's own)
    app.mount(STATIC_PATH, static_files(), name="static")


def _config_fields() -> list[dict]:
    """The form's config inputs: name, default (the placeholder) and allowed range (the hint)."""
    defaults = Config().as_dict()
    shown = {"seed": "[0, 2^63 - 1]"}  # the digits would not fit the field's hint
    return [{"name": name, "default": defaults[name], "integer": name in INT_FIELDS,
             "range": shown.get(name, bound_text(name))} for name in FIELDS]


def _context(request: Request, **extra) -> dict:
    state = request.app.state
    settings = getattr(state, "settings", None)
    service = getattr(state, "service", None)
    return {
        "root": request.scope.get("root_path", "").rstrip("/"),
        "version": __version__,
        "auth": bool(settings is not None and settings.api_key is not None),
        "server_backend": getattr(service, "backend", None) or getattr(settings, "backend", "auto"),
        **extra,
    }


@router.get("/", response_class=HTMLResponse, summary="The web page: upload a task, recent tasks, health")
async def index(request: Request) -> HTMLResponse:
    return templates.TemplateResponse(
        request, "index.html",
        _context(request, page="index", config_fields=_config_fields(), backends=NAMES),
        headers=SECURITY_HEADERS,
    )


def _missing(request: Request, heading: str, detail: str) -> HTMLResponse:
    """The not-found page: what is missing, and the ways on (the tasks, the API docs)."""
    return templates.TemplateResponse(request, "not_found.html",
                                      _context(request, page="missing", heading=heading, detail=detail),
                                      status_code=404, headers=SECURITY_HEADERS)


def browser_not_found(request: Request) -> HTMLResponse | None:
    """A browser's page for a path that no route serves; None for any other request (a client's,
    which gets the API's JSON 404 and its hint: app/api/errors.py; app/main.py picks)."""
    if request.method not in ("GET", "HEAD") or not prefers_html(request.headers.get("accept")):
        return None
    return _missing(request, "No such page", f"This service has no page at {request.url.path}.")


def _one(request: Request, template: str, page: str, item_id: str, **names) -> HTMLResponse:
    """The page of one task, sweep or evaluation (its id checked: anything else is the not-found
    page; an id the server does not know is said by the page's script, which asks the API)."""
    if not TASK_ID.match(item_id):
        return _missing(request, f"Not a{'n' if page[0] in 'aeiou' else ''} {page} id",
                        f"{page.capitalize()} ids are 1–128 letters, digits, - or _.")
    return templates.TemplateResponse(request, template, _context(request, page=page, **names),
                                      headers=SECURITY_HEADERS)


@router.get(UI_PREFIX + "tasks/{task_id}", response_class=HTMLResponse, summary="The web page of one task")
async def task_page(request: Request, task_id: str) -> HTMLResponse:
    return _one(request, "task.html", "task", task_id, task_id=task_id)


@router.get(UI_PREFIX + "sweeps/{sweep_id}", response_class=HTMLResponse, summary="The web page of one sweep")
async def sweep_page(request: Request, sweep_id: str) -> HTMLResponse:
    return _one(request, "sweep.html", "sweep", sweep_id, sweep_id=sweep_id)


@router.get(UI_PREFIX + "evaluations", response_class=HTMLResponse, summary="The leaderboard of graded evaluations")
async def leaderboard_page(request: Request) -> HTMLResponse:
    return templates.TemplateResponse(request, "evaluations.html", _context(request, page="evaluations"),
                                      headers=SECURITY_HEADERS)


@router.get(UI_PREFIX + "evaluations/{evaluation_id}", response_class=HTMLResponse,
            summary="The report page of one evaluation")
async def evaluation_page(request: Request, evaluation_id: str) -> HTMLResponse:
    return _one(request, "evaluation.html", "evaluation", evaluation_id, evaluation_id=evaluation_id)


@router.get("/evaluations/{evaluation_id}/report", response_class=HTMLResponse,
            summary="The report page of one evaluation (as /ui/evaluations/{id})")
async def evaluation_report(request: Request, evaluation_id: str) -> HTMLResponse:
    return _one(request, "evaluation.html", "evaluation", evaluation_id, evaluation_id=evaluation_id)
