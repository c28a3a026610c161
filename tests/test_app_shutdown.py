"""Shutdown: SIGTERM drains an in-flight task (answered 200, then the process exits); a
task outliving the drain timeout is answered 503, not dropped; while draining, ready is
503 and new tasks are refused with Retry-After."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from app.main import create_app
from app.settings import Settings
from learner.config import make_config
from learner.result import run_task
from learner.taskio import task_to_npz_bytes

from .gates import FileGate
from .helpers import small_task
from .server import inprocess_server, post_task, running_job, running_server, wait_for


def log_records(server) -> list[dict]:
    return [json.loads(line) for line in server.logs().splitlines() if line.startswith("{")]


def exited(proc) -> bool:
    return proc.poll() is not None


def test_sigterm_drains_the_in_flight_task_then_exits(tmp_path):
    task = small_task(3000, 300, 1)
    config = make_config({"epochs": 3})
    env = {"REV88_BACKEND": "cpu", "REV88_DRAIN_TIMEOUT_S": "300", "REV88_THREADS": "1"}
    gate = FileGate(tmp_path / "hold")
    with running_server(tmp_path, env=env, gate=gate.path) as server:
        results: dict[str, httpx.Response] = {}

        def send():
            with server.client() as c:
                results["task"] = post_task(c, task_to_npz_bytes(task), params={"epochs": "3"})

        gate.hold()  # the task is in flight, on the device, when the signal comes
        sender = threading.Thread(target=send)
        sender.start()
        wait_for(lambda: (running_job(server) or {}).get("kind") == "task", 60, what="the task running")
        server.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: '"msg": "draining"' in server.logs(), 60, what="the drain to begin")
        gate.release()
        sender.join(600)
        r = results["task"]
        assert r.status_code == 200, r.text
        assert r.json()["predictions_sha256"] == run_task(task, config, "cpu").predictions_sha256
        wait_for(lambda: exited(server.proc), 120, 0.1, "the server to exit")
        assert server.proc.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled
        with pytest.raises(httpx.ConnectError):  # not listening any more
            httpx.get(server.url + "/v2/health/live", timeout=2)
    msgs = [rec["msg"] for rec in log_records(server)]
    assert "draining" in msgs and "stopped" in msgs
    assert msgs.index("draining") < msgs.index("task answered") < msgs.index("stopped")
    stopped = next(rec for rec in log_records(server) if rec["msg"] == "stopped")
    assert stopped["device_thread_ended"] is True
    q = stopped["queue"]
    assert q["accepted"] == q["completed"] == 2 and q["cancelled"] == q["abandoned"] == 0  # warm-up + the task


def test_drain_timeout_answers_what_is_left_with_503_then_exits(tmp_path):
    env = {"REV88_BACKEND": "cpu", "REV88_DRAIN_TIMEOUT_S": "2", "REV88_THREADS": "1", "REV88_WORKERS": "1"}
    body = task_to_npz_bytes(small_task(300, 50, 2))  # held at the gate: longer than the 2 s drain
    small = task_to_npz_bytes(small_task(19, 7, seed=4))
    gate = FileGate(tmp_path / "hold")
    with running_server(tmp_path, env=env, gate=gate.path) as server:
        results: dict[str, httpx.Response] = {}

        def send(name, body, params=None):
            with server.client() as c:
                results[name] = post_task(c, body, params=params)

        gate.hold()
        senders = [threading.Thread(target=send, args=("running", body))]
        senders[0].start()
        wait_for(lambda: (running_job(server) or {}).get("kind") == "task", 60, what="the held task running")
        senders.append(threading.Thread(target=send, args=("queued", small)))
        senders[1].start()
        wait_for(lambda: server.client().get("/health").json()["queue"]["depth"] == 1, 60, what="one task queued")
        server.proc.send_signal(signal.SIGTERM)
        for s in senders:
            s.join(120)
        for name in ("running", "queued"):
            r = results[name]
            assert r.status_code == 503, (name, r.text)
            body = r.json()
            assert "drain timeout of 2 s passed" in body["error"] and body["where"] == name
        gate.release()
        wait_for(lambda: exited(server.proc), 120, 0.1, "the server to exit")
    records = log_records(server)
    assert any(rec["msg"] == "drain timeout passed" and rec["answered_503"] == 2 for rec in records)
    stopped = next(rec for rec in records if rec["msg"] == "stopped")
    q = stopped["queue"]
    assert q["cancelled"] == 1 and q["abandoned"] == 1
    assert q["accepted"] == q["completed"] + q["failed"] + q["expired"] + q["abandoned"] + q["cancelled"]


def test_while_draining_ready_is_503_and_new_tasks_are_refused():
    """A real uvicorn in this process, so the test can start the drain itself (the SIGTERM
    handler calls the same begin_drain) and keep talking to the still-open listener."""
    app = create_app(Settings(backend="cpu", drain_timeout_s=60))
    service = app.state.service
    with inprocess_server(app) as server, server.client() as c:
        assert c.get("/v2/health/ready").status_code == 200
        service.begin_drain("test drain")
        r = c.get("/v2/health/ready")
        assert r.status_code == 503 and r.json()["status"] == "draining"
        assert "draining" in r.json()["error"]
        h = c.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "draining" and h.json()["ready"] is False
        assert h.json()["queue"]["accepting"] is False
        r = post_task(c, task_to_npz_bytes(small_task(19, 7)))
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        assert "draining" in r.json()["error"]
        assert c.get("/v2/health/live").status_code == 200  # still alive while draining
        metrics = c.get("/metrics").text
        assert "rev88_ready 0.0" in metrics
        assert 'rev88_tasks_total{outcome="unavailable"} 1.0' in metrics


def test_a_stalled_upload_cannot_hold_shutdown_past_the_drain_deadline(tmp_path):
    """A client that stops mid-upload keeps its connection open; uvicorn alone would wait for
    it forever. After the drain deadline (plus a short grace) the service makes uvicorn exit."""
    import socket

    env = {"REV88_BACKEND": "cpu", "REV88_DRAIN_TIMEOUT_S": "1"}
    with running_server(tmp_path, env=env) as server:
        port = int(server.url.rsplit(":", 1)[1])
        sock = socket.create_connection(("127.0.0.1", port))
        try:
            sock.sendall(b"POST /tasks HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n4\r\nPK\x03\x04\r\n")  # ... and nothing more
            time.sleep(1.0)  # let the request reach the route, which now waits for the rest of the body
            server.proc.send_signal(signal.SIGTERM)
            wait_for(lambda: exited(server.proc), 60, 0.1, "the server to exit despite the stalled upload")
        finally:
            sock.close()
    assert "requests still open after the drain deadline" in server.logs()
