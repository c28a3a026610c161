"""A large synchronous POST /tasks served off the event loop (app/api/direct.py, app/http/protocol.py's
``DirectExchange``): the same answers as through the app, on a real server and real sockets."""

from __future__ import annotations

import json
import socket
import time

import numpy as np
import pytest

from app.api import direct
from app.http.protocol import protocol_class
from app.main import create_app
from app.settings import Settings
from learner.result import run_task
from learner.taskio import task_to_npz_bytes

from .gates import Gate, gated_engines
from .helpers import small_task
from .server import inprocess_server, post_task, running_job, wait_for

pytestmark = pytest.mark.skipif(protocol_class() is None, reason="needs uvicorn's httptools protocol")

TASK = small_task(600, 500, seed=5)  # 0.36 MB: a body read by a thread
BODY = task_to_npz_bytes(TASK)
SMALL = small_task(30, 6, seed=3)  # 2.7 kB: a body that comes whole with its headers, read by the loop
SMALL_BODY = task_to_npz_bytes(SMALL)
VARYING = ("id", "request_id", "timing")


def _server(tmp_path, name: str, **settings):
    engines = settings.pop("engines", None)
    app = create_app(Settings(backend="cpu", workers=1, data_dir=str(tmp_path / name), **settings), engines=engines)
    return inprocess_server(app, http=protocol_class())


def _same(doc: dict) -> dict:
    """An answer less what differs from run to run (its ids, times, and the process's run count)."""
    out = {k: v for k, v in doc.items() if k not in VARYING}
    if "metadata" in out:
        out["metadata"] = {k: v for k, v in out["metadata"].items() if not k.endswith("_seconds") and k != "run_count"}
    return out


def _raw_request(body: bytes, path: str = "/tasks", extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/octet-stream\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body


def _read_response(sock: socket.socket, buf: bytearray) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response (with a Content-Length) from ``sock``; ``buf`` keeps what follows."""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, "connection closed before a response"
        buf += chunk
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    length = int(headers["content-length"])
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-response"
        rest += chunk
    buf[:] = rest[length:]
    return status, headers, rest[:length]


def test_the_lane_answers_as_the_app_does(tmp_path):
    expected = run_task(TASK, None, "cpu")
    answers, headers = {}, {}
    for name, on in (("lane", True), ("app", False)):
        before = dict(direct.COUNTS)
        with _server(tmp_path, name, direct_tasks=on) as server, server.client() as c:
            first = post_task(c, BODY, headers={"X-Request-ID": f"rid-{name}"})
            second = post_task(c, BODY, params={"include": "scores"})  # the same keep-alive connection
            health = c.get("/health")  # ... and an ordinary request after them
            assert first.status_code == second.status_code == health.status_code == 200, first.text
            assert first.headers["x-request-id"] == first.json()["request_id"] == f"rid-{name}"
            assert first.json()["predictions_sha256"] == expected.predictions_sha256
            assert second.json()["scores_sha256"] == expected.scores_sha256 and "scores" in second.json()
            url = f"/tasks/{first.json()['id']}"
            record = wait_for(lambda u=url: (r := c.get(u).json())["status"] == "succeeded" and r, what="the record")
            assert record["predictions_sha256"] == expected.predictions_sha256
            answers[name] = (_same(first.json()), _same(second.json()))
            headers[name] = sorted(set(first.headers) - {"date"})
        taken = direct.COUNTS["admitted"] - before["admitted"]
        assert taken == (2 if on else 0), (name, taken)
        assert direct.COUNTS["answered"] - before["answered"] == taken
    assert answers["lane"] == answers["app"]
    assert headers["lane"] == headers["app"]


def test_a_refused_body_and_options_on_the_lane(tmp_path):
    garbage = np.random.default_rng(0).integers(0, 256, 300_000, dtype=np.uint8).tobytes()
    with _server(tmp_path, "d") as server, server.client() as c:
        before = dict(direct.COUNTS)
        bad = post_task(c, garbage)
        assert bad.status_code == 400, bad.text
        assert "npz" in bad.json()["error"] and bad.json()["request_id"] == bad.headers["x-request-id"]
        assert direct.COUNTS["answered"] == before["answered"] + 1
        option = post_task(c, BODY, params={"epochs": "many"})  # refused before its body: by the app
        assert option.status_code == 422 and "epochs" in option.json()["error"]
        assert direct.COUNTS["admitted"] == before["admitted"] + 1
        listed = c.get("/tasks").json()
        assert listed["tasks"] == [] or all(t["status"] != "failed" for t in listed["tasks"])  # nothing recorded


def test_requests_pipelined_behind_it_are_answered_in_order(tmp_path):
    with _server(tmp_path, "p") as server:
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=60) as sock:
            sock.sendall(_raw_request(BODY) + _raw_request(BODY, extra="X-Request-ID: second\r\n")
                         + b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n")
            buf = bytearray()
            answers = [_read_response(sock, buf) for _ in range(3)]
    assert [status for status, _, _ in answers] == [200, 200, 200]
    assert json.loads(answers[0][2])["predictions_sha256"] == json.loads(answers[1][2])["predictions_sha256"]
    assert answers[1][1]["x-request-id"] == "second"
    assert json.loads(answers[2][2]) == {"status": "live"} or answers[2][0] == 200


def test_a_body_that_stalls_goes_on_through_the_app(tmp_path):
    with _server(tmp_path, "s") as server:
        host, port = server.url.removeprefix("http://").split(":")
        before = dict(direct.COUNTS)
        raw = _raw_request(BODY)
        with socket.create_connection((host, int(port)), timeout=60) as sock:
            sock.sendall(raw[:150_000])
            time.sleep(0.6)  # longer than the reading thread waits for a body's next 64 KiB
            sock.sendall(raw[150_000:])
            status, _, content = _read_response(sock, bytearray())
    assert status == 200, content
    assert json.loads(content)["predictions_sha256"] == run_task(TASK, None, "cpu").predictions_sha256
    assert direct.COUNTS["admitted"] == before["admitted"] + 1
    assert direct.COUNTS["answered"] == before["answered"]  # the app answered it


def test_a_stalled_body_past_its_deadline_is_a_408(tmp_path):
    with _server(tmp_path, "t", upload_timeout_s=0.5, upload_min_rate=1 << 30) as server:
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=60) as sock:
            sock.sendall(_raw_request(BODY)[:100_000])
            t0 = time.monotonic()
            status, _, content = _read_response(sock, bytearray())
    assert status == 408, content
    assert "REV88_UPLOAD_TIMEOUT_S" in json.loads(content)["error"]
    assert time.monotonic() - t0 < 10


def test_a_client_that_leaves_stops_its_task_and_it_is_recorded(tmp_path):
    gate = Gate()
    with _server(tmp_path, "g", engines=gated_engines(gate)) as server, server.client() as c:
        gate.hold()  # (after the warm-up)
        host, port = server.url.removeprefix("http://").split(":")
        before = dict(direct.COUNTS)
        sock = socket.create_connection((host, int(port)), timeout=60)
        sock.sendall(_raw_request(BODY))
        wait_for(lambda: running_job(server), what="the task to run")
        sock.close()
        record = wait_for(lambda: [t for t in c.get("/tasks").json()["tasks"] if t["status"] == "cancelled"],
                          timeout=60, what="the task recorded cancelled")
        gate.release()
        assert len(record) == 1
        assert direct.COUNTS["admitted"] == before["admitted"] + 1
        assert c.get("/health").status_code == 200  # and the service goes on
        assert post_task(c, BODY).status_code == 200


def test_the_task_timeout_on_the_lane_is_the_apps(tmp_path):
    statuses = {}
    for name, on in (("lane", True), ("app", False)):
        gate = Gate()
        with _server(tmp_path, name, direct_tasks=on, task_timeout_s=0.5, engines=gated_engines(gate)) as server, \
                server.client() as c:
            gate.hold()  # (after the warm-up)
            r = post_task(c, BODY)
            gate.release()
            statuses[name] = (r.status_code, sorted(_same(r.json())))
            assert "timed out" in r.json()["error"]
    assert statuses["lane"] == statuses["app"]


def test_a_small_body_that_comes_with_its_headers_is_served_off_the_loop_too(tmp_path):
    want = run_task(SMALL, None, "cpu")
    with _server(tmp_path, "w") as server, server.client() as c:
        before = dict(direct.COUNTS)
        r = post_task(c, SMALL_BODY, headers={"X-Request-ID": "small-1"})
        assert r.status_code == 200 and r.json()["predictions_sha256"] == want.predictions_sha256
        assert r.headers["x-request-id"] == "small-1"
        assert direct.COUNTS["answered"] == before["answered"] + 1
        assert post_task(c, b"PK\x03\x04 not really").status_code == 400  # refused by its job, as by the app
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=60) as sock:  # two in one read: the app's
            sock.sendall(_raw_request(SMALL_BODY) + _raw_request(SMALL_BODY, extra="X-Request-ID: second\r\n"))
            buf = bytearray()
            answers = [_read_response(sock, buf) for _ in range(2)]
    assert [a[0] for a in answers] == [200, 200] and answers[1][1]["x-request-id"] == "second"
    assert {json.loads(a[2])["predictions_sha256"] for a in answers} == {want.predictions_sha256}
