"""POST /tasks served by its handler straight from the app's entry, past FastAPI's own layers.

Every request of a FastAPI app goes in and out through about a dozen ASGI layers before and
after its route (FastAPI's telemetry and body-limit wrappers, Starlette's error and exception
middlewares, the router, the route's request/response adapter, dependency solving, an exit
stack), each a coroutine call on the way in and a wrapped ``send`` on the way out. On the event
loop that was about a tenth of a task request's time (bench/bench_shell.py, docs/performance.md),
for a route that needs none of it: ``post_task`` (app/api/tasks.py) takes only the request.

``ServiceApp`` is that FastAPI app, except that a ``POST /tasks`` goes from ``__call__`` to
``hot`` (create_app sets it: the request middleware, app/http/middleware.py, around
``post_tasks`` here) and from there to the same handler the route calls (``intake.handle``). An
exception it lets through is answered by the app's own exception handlers (app/api/errors.py),
as Starlette would, except that an unexpected one (the catch-all handler's: logged with its
traceback, answered 500) is not raised on to uvicorn afterwards, which would close the connection. Everything else, and any request this entry cannot take as the router
would (a root path, FastAPI's telemetry switched on), goes the ordinary way; so does every request
with REV88_STOCK_HTTP set (app/http/versions.py). The route stays in
the app's table: the OpenAPI document describes it, and it serves what the lane leaves.
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.requests import Request

from . import intake


class ServiceApp(FastAPI):
    hot = None  # the ASGI app that serves POST /tasks (create_app: RequestMiddleware(post_tasks))

    async def __call__(self, scope, receive, send) -> None:
        if (self.hot is not None and scope["type"] == "http" and scope["path"] == "/tasks"
                and scope["method"] == "POST" and not self.root_path and not scope.get("root_path")
                and "fastapi.telemetry" not in scope):
            scope["app"] = self
            await self.hot(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def telemetry_enabled(app: FastAPI) -> bool:
    """FastAPI's native telemetry (off unless configured): when on, its layer must see every
    request, so the lifespan (app/main.py) turns this entry off once the app has started."""
    # (private: the FastAPI releases of app/http/versions.py have it; create_app checks the release)
    return app._native_telemetry.enabled()


def exception_handler(app: FastAPI, exc: Exception):
    """The app's handler for ``exc`` (registered for the most specific of its classes, as
    Starlette looks it up), or None."""
    handlers = app.exception_handlers
    for cls in type(exc).__mro__:
        if cls in handlers:
            return handlers[cls]
    return None


async def post_tasks(scope, receive, send) -> None:
    request = Request(scope, receive, send)
    app = scope["app"]
    try:
        response = await intake.handle(request, app.state.service)
    except Exception as exc:  # noqa: BLE001 - answered by the app's handlers, as Starlette would
        handler = exception_handler(app, exc)
        if handler is None:
            raise
        # (the catch-all one logs an unexpected error with its traceback and answers 500; unlike
        # Starlette's ServerErrorMiddleware the exception ends here, so the connection stays open)
        await (await handler(request, exc))(scope, receive, send)
        return
    await response(scope, receive, send)
