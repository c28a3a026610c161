"""The FastAPI app: ``create_app(settings) -> FastAPI`` assembles the parts; nothing else lives here.

Run it with ``rev88 serve`` or ``uvicorn --factory app.main:create_app`` (settings come from the
REV88_* environment variables, see app/settings.py).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from learner import __version__

from . import api, web
from .api import errors
from .api.openapi import DESCRIPTION
from .http import protocol, versions
from .http.logs import configure_logging
from .http.middleware import RequestMiddleware
from .service import Service
from .settings import Settings


def create_app(settings: Settings | None = None, engines: Callable[[str], Any] | None = None) -> FastAPI:
    """The app. ``engines`` (backend name -> backend object; default: the learner's registry
    ``learner.backends.get_backend``) lets code that embeds the service supply its own backend
    objects; it is not reachable from HTTP or the environment."""
    settings = settings or Settings.from_env()
    refusal = protocol.refusal(settings.stock_http)  # (the body protocol's release gate; rev88 serve asks too)
    if refusal:
        raise RuntimeError(refusal)
    configure_logging(settings.log_level)
    if settings.stock_http:
        logging.getLogger("rev88.app").warning(versions.STOCK_HTTP_LOST)
    service = Service(settings, engines)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await service.start()
        # What is alive now lives as long as the service (torch, FastAPI, the learner: ~200,000
        # objects the cyclic GC tracks). A full collection walks all of them on the event loop
        # (what that cost: docs/performance.md); frozen, the collector leaves them out of every pass.
        gc.collect()
        gc.freeze()
        try:
            # what the body protocol needs (app/http/protocol.py): large bodies as one memoryview,
            # within this app's body limit and upload budget; its header timeout
            yield {protocol.STATE: protocol.Policy(max_body_bytes=settings.max_body_bytes, budget=service.uploads,
                                                   header_timeout_s=settings.header_timeout_s)}
        finally:
            await service.stop()
            gc.unfreeze()  # collectable again at exit (native extensions report what is never freed)

    app = FastAPI(title="rev88 service", version=__version__, description=DESCRIPTION, lifespan=lifespan,
                  docs_url=None, redoc_url=None)  # (/docs and /redoc without a CDN: app/web/api_docs.py)
    app.state.service = service
    app.state.settings = settings
    app.add_middleware(RequestMiddleware, api_key=settings.api_key, metrics=service.metrics,  # (who: app/tasks/tenants.py)
                       resolve=service.keys.resolve, resolve_fast=service.keys.resolve_fast, limit=service.keys.rate)
    errors.install(app)
    for router in api.ROUTERS:  # each resource's routes (app/api/__init__.py)
        app.include_router(router)
    web.install(app)  # the web page (app/web): / and /ui/tasks/{id}, /docs and /redoc, scripts and styles under /static

    async def not_found(request, exc):  # a path no route serves: a browser gets a page, a client the JSON and a hint
        return web.browser_not_found(request) or await errors.http_error(request, exc)

    app.add_exception_handler(404, not_found)
    return app
