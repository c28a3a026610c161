"""POST /tasks is served from the app's entry (app/api/hot_path.py), past FastAPI's layers, with
the same answers the route gave: auth, request ids, errors by the app's own handlers, the
answer itself; every other request still goes through the whole stack."""

from __future__ import annotations

from app.main import create_app
from app.settings import Settings
from learner.result import run_task
from learner.taskio import task_to_npz_bytes

from .helpers import small_task
from .server import inprocess_server, post_task


class Counting:
    """A plain ASGI middleware in the app's stack: it sees what goes through FastAPI's layers."""

    def __init__(self, app, seen: list) -> None:
        self.app, self.seen = app, seen

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            self.seen.append((scope["method"], scope["path"]))
        await self.app(scope, receive, send)


def test_post_tasks_goes_past_the_stack_with_the_same_answers(tmp_path):
    seen: list = []
    app = create_app(Settings(backend="cpu", workers=1, data_dir=str(tmp_path / "data"), api_key="k3y"))
    app.add_middleware(Counting, seen=seen)
    task = small_task(30, 6, seed=2)
    body = task_to_npz_bytes(task)
    auth = {"Authorization": "Bearer k3y"}
    with inprocess_server(app) as server, server.client() as c:
        seen.clear()
        r = post_task(c, body, headers={**auth, "X-Request-ID": "lane-1"})
        assert r.status_code == 200, r.text
        assert r.json()["predictions_sha256"] == run_task(task, None, "cpu").predictions_sha256
        assert r.headers["x-request-id"] == "lane-1" and r.json()["request_id"] == "lane-1"

        refused = post_task(c, body)  # no key: the request middleware answers, as before
        assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Bearer")
        bad = c.post("/tasks", content=b"not an npz", headers={**auth, "Content-Type": "text/plain"})
        assert bad.status_code == 415, bad.text  # raised by the handler, answered by the app's handlers
        assert bad.json()["request_id"] == bad.headers["x-request-id"] and "content type" in bad.json()["error"].lower()
        bad_key = post_task(c, body, headers={**auth, "Idempotency-Key": "has space"})
        assert bad_key.status_code == 422 and "Idempotency-Key" in bad_key.json()["error"]
        assert seen == []  # none of these went through the stack

        assert c.get("/tasks", headers=auth).status_code == 200
        other = c.post("/tasks/", content=body, headers=auth, follow_redirects=False)  # not the lane's path
        assert other.status_code == 307 and other.headers["location"].endswith("/tasks")  # the router's answer
    assert ("GET", "/tasks") in seen and ("POST", "/tasks/") in seen
    assert ("POST", "/tasks") not in seen


def test_an_unexpected_error_on_the_lane_is_a_json_500_with_its_request_id(tmp_path, monkeypatch):
    from app.api import intake

    async def broken(request, service):
        raise RuntimeError("something no handler expects")

    app = create_app(Settings(backend="cpu", workers=1, data_dir=str(tmp_path / "data")))
    with inprocess_server(app) as server, server.client() as c:
        monkeypatch.setattr(intake, "handle", broken)
        r = post_task(c, task_to_npz_bytes(small_task(10, 2)), headers={"X-Request-ID": "lane-500"})
        assert r.status_code == 500, r.text
        assert r.json()["request_id"] == "lane-500" and r.headers["x-request-id"] == "lane-500"
        monkeypatch.undo()
        assert post_task(c, task_to_npz_bytes(small_task(10, 2))).status_code == 200  # the service goes on


def test_with_fastapis_telemetry_on_post_tasks_goes_through_its_layers(tmp_path):
    """FastAPI's native telemetry must see every request: when it is configured (looked up once
    the app has started), POST /tasks takes FastAPI's own layers, with the same answer."""
    from opentelemetry.trace import NoOpTracerProvider

    seen: list = []
    app = create_app(Settings(backend="cpu", workers=1, data_dir=str(tmp_path / "data")))
    app.add_middleware(Counting, seen=seen)
    app._telemetry["tracer_provider"] = NoOpTracerProvider()  # (FastAPI's config; app/http/versions.py pins it)
    task = small_task(30, 6, seed=4)
    with inprocess_server(app) as server, server.client() as c:
        assert app.hot is None
        r = post_task(c, task_to_npz_bytes(task))
        assert r.status_code == 200 and r.json()["predictions_sha256"] == run_task(task, None, "cpu").predictions_sha256
    assert ("POST", "/tasks") in seen
