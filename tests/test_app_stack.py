"""The app is FastAPI's, whole: POST /tasks is served by its route alone, through the same
layers as every other request (the request middleware, FastAPI's router, the app's exception
handlers as FastAPI calls them), with the answers it always gave: auth, request ids, errors as
JSON, the answer itself. The routes are included as routers; 405's Allow lists their methods."""

from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.routing import iter_route_contexts

from app.http.logs import request_id_var
from app.main import create_app
from app.settings import Settings
from learner.result import run_task
from learner.taskio import task_to_npz_bytes

from .helpers import small_task
from .server import inprocess_server, post_task


class Counting:
    """A plain ASGI middleware in the app's stack: it sees every request the app serves."""

    def __init__(self, app, seen: list) -> None:
        self.app, self.seen = app, seen

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            self.seen.append((scope["method"], scope["path"]))
        await self.app(scope, receive, send)


def test_the_app_is_fastapis_own_with_its_routes_included_as_routers(tmp_path):
    app = create_app(Settings(backend="cpu", workers=1, data_dir=str(tmp_path / "data")))
    assert type(app) is FastAPI  # no entry of its own before FastAPI's
    served = {(method, route.path) for route in iter_route_contexts(app.routes) for method in route.methods or ()}
    assert {("POST", "/tasks"), ("GET", "/tasks/{task_id}"), ("PUT", "/datasets/{digest}"), ("GET", "/health"),
            ("GET", "/metrics"), ("GET", "/")} <= served
    assert app.user_middleware[0].cls.__name__ == "RequestMiddleware" and len(app.user_middleware) == 1


def test_post_tasks_goes_through_the_stack_with_the_same_answers(tmp_path):
    seen: list = []
    app = create_app(Settings(backend="cpu", workers=1, data_dir=str(tmp_path / "data"), api_key="k3y"))
    app.add_middleware(Counting, seen=seen)
    task = small_task(30, 6, seed=2)
    body = task_to_npz_bytes(task)
    auth = {"Authorization": "Bearer k3y"}
    with inprocess_server(app) as server, server.client() as c:
        seen.clear()
        r = post_task(c, body, headers={**auth, "X-Request-ID": "route-1"})
        assert r.status_code == 200, r.text
        assert r.json()["predictions_sha256"] == run_task(task, None, "cpu").predictions_sha256
        assert r.headers["x-request-id"] == "route-1" and r.json()["request_id"] == "route-1"

        refused = post_task(c, body)  # no key: the request middleware answers
        assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Bearer")
        bad = c.post("/tasks", content=b"not an npz", headers={**auth, "Content-Type": "text/plain"})
        assert bad.status_code == 415, bad.text  # raised by the handler, answered by the app's handlers
        assert bad.json()["request_id"] == bad.headers["x-request-id"] and "content type" in bad.json()["error"].lower()
        bad_key = post_task(c, body, headers={**auth, "Idempotency-Key": "has space"})
        assert bad_key.status_code == 422 and "Idempotency-Key" in bad_key.json()["error"]
        assert seen == [("POST", "/tasks")] * 4  # every one through the app's stack

        assert c.get("/tasks", headers=auth).status_code == 200
        other = c.post("/tasks/", content=body, headers=auth, follow_redirects=False)
        assert other.status_code == 307 and other.headers["location"].endswith("/tasks")  # the router's answer


def test_a_method_a_path_does_not_serve_is_405_naming_every_method_its_routers_serve(tmp_path):
    app = create_app(Settings(backend="cpu", workers=1, data_dir=str(tmp_path / "data")))
    with inprocess_server(app) as server, server.client() as c:
        r = c.delete("/tasks")
        assert r.status_code == 405 and r.headers["allow"] == "GET, POST", r.headers
        assert r.json()["request_id"] == r.headers["x-request-id"]
        r = c.patch("/datasets/sha256:" + "0" * 64)
        assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET, HEAD, PUT", r.headers


def test_an_unexpected_error_is_a_json_500_with_its_request_id(tmp_path, monkeypatch):
    """Starlette's outermost layer calls the app's catch-all handler (outside the request
    middleware), which logs the error with the request's id, answers 500 with it in the body and
    the header, says ``Connection: close`` and lets Starlette raise it on to uvicorn, which closes
    that connection."""
    from app import errors as app_errors
    from app.api import intake

    async def broken(request, service):
        raise RuntimeError("something no handler expects")

    logged: list = []

    class Seen(logging.Handler):
        def emit(self, record) -> None:
            logged.append((record.getMessage(), request_id_var.get()))

    seen = Seen()
    app_errors.log.addHandler(seen)
    app = create_app(Settings(backend="cpu", workers=1, data_dir=str(tmp_path / "data")))
    try:
        with inprocess_server(app) as server, server.client() as c:
            monkeypatch.setattr(intake, "handle", broken)
            r = post_task(c, task_to_npz_bytes(small_task(10, 2)), headers={"X-Request-ID": "route-500"})
            assert r.status_code == 500, r.text
            assert r.json()["request_id"] == "route-500" and r.headers["x-request-id"] == "route-500"
            assert "RuntimeError: something no handler expects" in r.json()["error"]
            assert r.headers["connection"] == "close"  # (uvicorn closes it: the client must not reuse it)
            monkeypatch.undo()
            assert post_task(c, task_to_npz_bytes(small_task(10, 2))).status_code == 200  # the service goes on
    finally:
        app_errors.log.removeHandler(seen)
    assert ("unexpected error", "route-500") in logged
