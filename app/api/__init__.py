"""The HTTP routes, one APIRouter module per resource: tasks.py (/tasks), health.py (/health,
/v2/health/*, /metrics); deps.py (what a route may ask for), errors.py (exception -> JSON body),
openapi.py (what FastAPI cannot infer), intake.py (POST /tasks from arrival to answer)."""

from __future__ import annotations

from fastapi import APIRouter, FastAPI


def add_routes(app: FastAPI, router: APIRouter) -> None:
    """``router``'s routes on the app's own route table. Not ``app.include_router``: since FastAPI
    0.16x that adds one nested entry to ``app.routes`` (no ``.path``), and code that reads the
    app's route table (the tests, the deploy checks) expects routes."""
    app.router.routes.extend(router.routes)
