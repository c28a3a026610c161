"""The HTTP routes, one APIRouter module per resource: tasks.py (/tasks), datasets.py (/datasets),
sweeps.py (/sweeps), evaluations.py (/evaluations), keys.py (/keys, /key), usage.py (/usage),
webhooks.py (/webhooks/*, each record's deliveries), health.py (/health, /v2/health/*, /metrics);
beside them intake.py (POST /tasks from arrival to answer), deps.py (what a route may ask for),
errors.py (exception -> JSON body) and openapi.py (what FastAPI cannot infer).

``router`` holds them all; the app includes it (app/main.py). The web page's routes are app/web's.
"""

from __future__ import annotations

from fastapi import APIRouter

from . import datasets, evaluations, health, keys, sweeps, tasks, usage, webhooks

router = APIRouter()
for _resource in (tasks, datasets, sweeps, evaluations, keys, usage, webhooks, health):
    router.include_router(_resource.router)
