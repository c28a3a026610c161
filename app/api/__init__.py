"""The HTTP routes, one APIRouter module per resource: tasks.py (/tasks), datasets.py (/datasets),
sweeps.py (/sweeps), evaluations.py (/evaluations), keys.py (/keys, /key), usage.py (/usage),
webhooks.py (/webhooks/*, each record's deliveries), health.py (/health, /v2/health/*, /metrics);
beside them intake.py (POST /tasks from arrival to answer), deps.py (what a route may ask for),
errors.py (exception -> JSON body) and openapi.py (what FastAPI cannot infer).

``ROUTERS``: the resources' routers, each included on the app (app/main.py) in this order, the
order a request's path is matched in (POST /tasks first). Each on the app itself, not one router
that includes them all: with FastAPI 0.165 a nested include costs every request's routing more
on the event loop (docs/performance.md, the sixth pass). The web page's routes are app/web's.
"""

from __future__ import annotations

from . import datasets, evaluations, health, keys, sweeps, tasks, usage, webhooks

ROUTERS = tuple(module.router for module in (tasks, datasets, sweeps, evaluations, keys, usage, webhooks, health))
