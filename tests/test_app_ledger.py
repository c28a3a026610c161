"""The task ledger through the service, with a real database file and a real server: asynchronous
tasks, the history, cancel, idempotency, restarts (clean and kill -9), retention, a corrupt file."""

from __future__ import annotations

import hashlib
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import threading

import httpx
import numpy as np
import pytest

from learner.config import make_config
from learner.hashing import array_sha256
from learner.result import run_task
from learner.taskio import load_task, task_to_npz_bytes

from .gates import FileGate
from .helpers import small_task
from .server import ROOT, free_port, post_task, running_job, running_server, wait_for

ASYNC = {"Prefer": "respond-async"}
ENV = {"REV88_BACKEND": "cpu-fast", "REV88_WORKERS": "1"}


def finished(client: httpx.Client, task_id: str, timeout: float = 120) -> dict:
    def done():
        doc = client.get(f"/tasks/{task_id}").json()
        return doc if doc["status"] in ("succeeded", "failed", "cancelled") else None

    return wait_for(done, timeout, 0.05, f"task {task_id} to finish")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ledger-server")
    gate = FileGate(folder / "hold")
    env = {**ENV, "REV88_DATA_DIR": str(folder / "data"), "REV88_QUEUE_SIZE": "8"}
    with running_server(folder, env=env, gate=gate.path) as srv:
        srv.gate, srv.data_dir = gate, folder / "data"
        yield srv
    gate.release()


def test_async_submit_then_poll_gives_the_synchronous_answer(server):
    task = small_task(300, 40, seed=21)
    body = task_to_npz_bytes(task)
    with server.client() as c:
        sync = post_task(c, body)
        assert sync.status_code == 200, sync.text
        r = post_task(c, body, headers=ASYNC)
        assert r.status_code == 202, r.text
        task_id = r.json()["id"]
        assert r.headers["location"] == f"/tasks/{task_id}" and r.json()["status"] in ("queued", "running", "succeeded")
        doc = finished(c, task_id)
        assert doc["status"] == "succeeded"
        assert doc["predictions_sha256"] == sync.json()["predictions_sha256"] == run_task(task, None, "cpu-fast").predictions_sha256
        assert doc["predictions"] == sync.json()["predictions"] and doc["id"] == task_id
        # the synchronous one is in the ledger too, with the same answer
        again = c.get(f"/tasks/{sync.json()['id']}").json()
        assert again["status"] == "succeeded" and again["predictions"] == sync.json()["predictions"]
        assert again["metadata"] == sync.json()["metadata"]
        # a synchronous task without an Idempotency-Key: its body is not hashed (input_hashes name
        # its arrays); the asynchronous one's stored body is
        listed = {t["id"]: t for t in c.get("/tasks", params={"limit": 100}).json()["tasks"]}
        plain, stored = listed[sync.json()["id"]], listed[task_id]
        assert plain["body_sha256"] is None and plain["body_bytes"] == len(body)
        assert plain["input_hashes"] == sync.json()["metadata"]["input_hashes"]
        assert stored["body_sha256"] == hashlib.sha256(body).hexdigest()
        npz = c.get(f"/tasks/{task_id}", headers={"Accept": "application/x-npz"})
        assert npz.headers["content-type"] == "application/x-npz"
        npy = c.get(f"/tasks/{task_id}/predictions.npy")
        import io

        assert array_sha256(np.load(io.BytesIO(npy.content))) == doc["predictions_sha256"]
        assert c.get("/tasks/0123456789abcdef").status_code == 404


def test_the_history_is_newest_first_paged_and_filtered(server):
    with server.client() as c:
        ids = []
        for seed in range(5):
            r = post_task(c, task_to_npz_bytes(small_task(30, 5, seed=100 + seed)))
            assert r.status_code == 200
            ids.append(r.json()["id"])
        seen, cursor = [], None
        while True:
            page = c.get("/tasks", params={"limit": 2, **({"cursor": cursor} if cursor else {})}).json()
            assert len(page["tasks"]) <= 2
            seen += [t["id"] for t in page["tasks"]]
            assert all("predictions" not in t for t in page["tasks"])  # summaries only
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert seen[:5] == ids[::-1]  # newest first
        assert len(seen) == len(set(seen))
        ok = c.get("/tasks", params={"status": "succeeded", "limit": 500}).json()["tasks"]
        assert {t["status"] for t in ok} == {"succeeded"} and set(ids) <= {t["id"] for t in ok}
        bad = c.get("/tasks", params={"status": "done"})
        assert bad.status_code == 422 and "status" in bad.json()["error"]
        assert c.get("/tasks", params={"cursor": "not-a-cursor"}).status_code == 422


def test_cancel_a_queued_and_a_running_task(server):
    with server.client() as c:
        server.gate.hold()
        try:
            running = post_task(c, task_to_npz_bytes(small_task(40, 5, seed=31)), headers=ASYNC).json()["id"]
            wait_for(lambda: (running_job(server) or {}).get("id") == running, 60, what="the first task running")
            queued = post_task(c, task_to_npz_bytes(small_task(40, 5, seed=32)), headers=ASYNC).json()["id"]
            assert c.get(f"/tasks/{queued}").json()["status"] == "queued"
            q = c.post(f"/tasks/{queued}/cancel")
            assert q.status_code == 200 and q.json()["status"] == "cancelled", q.text
            assert q.json()["started_at"] is None  # it never ran
            r = c.post(f"/tasks/{running}/cancel")
            assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
            assert "stopped on the device" in r.json()["error"]["error"]
        finally:
            server.gate.release()
        again = c.post(f"/tasks/{running}/cancel")
        assert again.status_code == 409 and "already finished (cancelled)" in again.json()["error"]
        assert c.post("/tasks/unknown-task/cancel").status_code == 404
        queue = c.get("/health").json()["queue"]
        assert queue["in_flight"] == 0


def test_an_idempotency_key_returns_the_same_task(server):
    body = task_to_npz_bytes(small_task(50, 6, seed=41))
    with server.client() as c:
        first = post_task(c, body, headers={**ASYNC, "Idempotency-Key": "key-41"})
        second = post_task(c, body, headers={**ASYNC, "Idempotency-Key": "key-41"})
        assert first.status_code == second.status_code == 202
        assert first.json()["id"] == second.json()["id"]
        doc = finished(c, first.json()["id"])
        sync = post_task(c, body, headers={"Idempotency-Key": "key-41"})  # waits: the answer of that task
        assert sync.status_code == 200 and sync.json()["id"] == first.json()["id"]
        assert sync.json()["predictions_sha256"] == doc["predictions_sha256"]
        assert sync.headers.get("idempotent-replayed") == "true"
        keyed = post_task(c, body, headers={"Idempotency-Key": "key-41-sync"})  # synchronous, keyed: hashed
        listed = {t["id"]: t for t in c.get("/tasks", params={"limit": 100}).json()["tasks"]}
        assert listed[keyed.json()["id"]]["body_sha256"] == hashlib.sha256(body).hexdigest()
        other = post_task(c, task_to_npz_bytes(small_task(50, 6, seed=42)), headers={"Idempotency-Key": "key-41"})
        assert other.status_code == 409 and "different body" in other.json()["error"]
        bad = post_task(c, body, headers={"Idempotency-Key": "has space"})
        assert bad.status_code == 422
        attempts = c.get(f"/tasks/{first.json()['id']}").json()
    assert attempts["status"] == "succeeded"


def test_a_synchronous_replay_while_the_first_request_runs_waits_for_its_answer(server):
    """The same Idempotency-Key sent again, synchronously, while the first request's task is still
    running here: the second waits for that task and answers its answer (200, replayed), not a 202."""
    body = task_to_npz_bytes(small_task(50, 6, seed=43))
    answers: dict[str, httpx.Response] = {}

    def send(name: str) -> None:
        with server.client() as c:
            answers[name] = post_task(c, body, headers={"Idempotency-Key": "key-43"})

    first, second = (threading.Thread(target=send, args=(n,), daemon=True) for n in ("first", "second"))
    server.gate.hold()
    try:
        first.start()
        wait_for(lambda: running_job(server) is not None, 60, 0.02, "the first request's task running")
        second.start()
        second.join(1.0)  # (held at the gate, the first cannot finish: nothing may answer the second yet)
        assert "second" not in answers, answers["second"].text
    finally:
        server.gate.release()
        first.join(60)
        second.join(60)
    assert answers["first"].status_code == answers["second"].status_code == 200, answers["second"].text
    assert answers["second"].json()["id"] == answers["first"].json()["id"]
    assert answers["second"].json()["predictions_sha256"] == answers["first"].json()["predictions_sha256"]
    assert answers["second"].headers.get("idempotent-replayed") == "true"


def test_kill_9_with_accepted_tasks_queued_then_a_restart_runs_every_one(tmp_path):
    data = tmp_path / "data"
    gate = FileGate(tmp_path / "hold")
    tasks = [small_task(200, 30, seed=50 + i) for i in range(4)]
    configs = [make_config({"epochs": 1 + i % 2}) for i in range(4)]
    env = {**ENV, "REV88_DATA_DIR": str(data)}
    with running_server(tmp_path, env=env, gate=gate.path) as srv:
        gate.hold()  # nothing finishes before the kill
        with srv.client() as c:
            ids = [post_task(c, task_to_npz_bytes(t), headers=ASYNC, params={
                       "epochs": str(cfg.epochs), **({"include": "scores"} if i % 2 else {})}).json()["id"]
                   for i, (t, cfg) in enumerate(zip(tasks, configs))]
            wait_for(lambda: (running_job(srv) or {}).get("id") == ids[0], 60, what="the first task on the device")
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait(30)
    gate.release()
    # the database on disk: four accepted tasks, none finished, each with its npz
    with sqlite3.connect(data / "ledger.sqlite3") as db:
        rows = dict(db.execute("SELECT id, status FROM tasks").fetchall())
    assert {rows[i] for i in ids} <= {"queued", "running"}
    assert all((data / "uploads" / f"{i}.npz").exists() for i in ids)
    with running_server(tmp_path, env=env) as srv, srv.client() as c:
        for i, (task_id, task, cfg) in enumerate(zip(ids, tasks, configs)):
            doc = finished(c, task_id)
            assert doc["status"] == "succeeded", doc
            alone = run_task(task, cfg, "cpu-fast")
            assert doc["predictions_sha256"] == alone.predictions_sha256
            assert ("scores" in doc) == bool(i % 2)  # run again from its stored input, with its own options
            if i % 2:
                assert np.asarray(doc["scores"], dtype=np.float32).tobytes() == alone.scores.astype(np.float32).tobytes()
        assert c.get(f"/tasks/{ids[0]}").json()["metadata"]["config"]["epochs"] == configs[0].epochs
        health = c.get("/health").json()["ledger"]
        assert health["recovered_at_start"] == {"requeued": 4, "failed": 0}
        listed = {t["id"]: t for t in c.get("/tasks", params={"limit": 500}).json()["tasks"]}
    assert listed[ids[0]]["attempts"] == 2  # ran once before the kill, once after
    assert not any((data / "uploads").iterdir())  # uploads deleted once finished


def test_a_restart_keeps_finished_tasks_unchanged(tmp_path):
    env = {**ENV, "REV88_DATA_DIR": str(tmp_path / "data")}
    with running_server(tmp_path, env=env) as srv, srv.client() as c:
        r = post_task(c, task_to_npz_bytes(small_task(60, 8, seed=61)))
        before = c.get(f"/tasks/{r.json()['id']}").json()
    with running_server(tmp_path, env=env) as srv, srv.client() as c:
        after = c.get(f"/tasks/{r.json()['id']}").json()
    assert after == before


def test_retention_deletes_the_oldest_finished_tasks(tmp_path):
    env = {**ENV, "REV88_DATA_DIR": str(tmp_path / "data"), "REV88_RETAIN_TASKS": "3"}
    with running_server(tmp_path, env=env) as srv, srv.client() as c:
        ids = [post_task(c, task_to_npz_bytes(small_task(20, 4, seed=70 + i))).json()["id"] for i in range(6)]
        listed = [t["id"] for t in c.get("/tasks").json()["tasks"]]
        assert listed == ids[:2:-1]  # the three newest, newest first
        assert c.get(f"/tasks/{ids[0]}").status_code == 404


def test_a_corrupt_database_is_a_clear_startup_error(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "ledger.sqlite3").write_bytes(b"this is not a database" * 100)
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("REV88_")}
    port = free_port()
    proc = subprocess.run(
        [sys.executable, "-m", "rev88", "serve", "--port", str(port), "--backend", "cpu-fast", "--data-dir", str(data)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "ledger.sqlite3" in proc.stderr and "not a database" in proc.stderr and "REV88_DATA_DIR" in proc.stderr


def test_a_synchronous_client_that_leaves_is_recorded_cancelled(server):
    with server.client() as c:
        before = {t["id"] for t in c.get("/tasks", params={"limit": 500}).json()["tasks"]}
    server.gate.hold()
    try:
        with pytest.raises(httpx.ReadTimeout):
            with server.client(timeout=httpx.Timeout(30, read=0.5)) as c:
                post_task(c, task_to_npz_bytes(small_task(40, 5, seed=81)))
        with server.client() as c:
            def the_new_one():
                tasks = [t for t in c.get("/tasks", params={"limit": 500}).json()["tasks"] if t["id"] not in before]
                return tasks[0] if tasks and tasks[0]["status"] == "cancelled" else None

            record = wait_for(the_new_one, 30, 0.05, "the abandoned task recorded")
            assert c.get(f"/tasks/{record['id']}").json()["error"]["reason"] == "disconnect"
    finally:
        server.gate.release()


def test_drain_leaves_accepted_async_tasks_for_the_next_start(tmp_path):
    """SIGTERM with async tasks still queued past the drain deadline: nothing accepted is lost."""
    data = tmp_path / "data"
    gate = FileGate(tmp_path / "hold")
    env = {**ENV, "REV88_DATA_DIR": str(data), "REV88_DRAIN_TIMEOUT_S": "1"}
    task = small_task(40, 6, seed=91)
    with running_server(tmp_path, env=env, gate=gate.path) as srv:
        gate.hold()
        with srv.client() as c:
            ids = [post_task(c, task_to_npz_bytes(task), headers=ASYNC).json()["id"] for _ in range(2)]
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(60)
    gate.release()
    with running_server(tmp_path, env=env) as srv, srv.client() as c:
        for task_id in ids:
            assert finished(c, task_id)["status"] == "succeeded"


def test_concurrent_async_submissions_are_each_recorded_once(server):
    bodies = [task_to_npz_bytes(small_task(30, 5, seed=200 + i)) for i in range(6)]
    ids: list[str] = []
    lock = threading.Lock()

    def send(body):
        with server.client() as c:
            r = post_task(c, body, headers=ASYNC)
            assert r.status_code == 202, r.text
            with lock:
                ids.append(r.json()["id"])

    threads = [threading.Thread(target=send, args=(b,)) for b in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    with server.client() as c:
        docs = [finished(c, i) for i in ids]
    assert len(set(ids)) == 6 and all(d["status"] == "succeeded" for d in docs)


def test_a_running_synchronous_task_is_visible_and_cancellable(server):
    """A synchronous task (no Idempotency-Key) is written to the ledger once, when it has finished;
    while it is queued or running this replica still answers for it, and cancels it."""
    body = task_to_npz_bytes(small_task(40, 5, seed=51))
    answers = []
    with server.client() as c:
        server.gate.hold()
        try:
            caller = threading.Thread(target=lambda: answers.append(post_task(server.client(), body)))
            caller.start()
            running = wait_for(lambda: (running_job(server) or {}).get("id"), 60, what="the sync task running")
            doc = c.get(f"/tasks/{running}").json()
            assert doc["status"] == "running" and doc["mode"] == "sync" and doc["train_count"] == 40
            assert running not in {t["id"] for t in c.get("/tasks", params={"limit": 500}).json()["tasks"]}
            cancelled = c.post(f"/tasks/{running}/cancel")
            assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled", cancelled.text
        finally:
            server.gate.release()
        caller.join(60)
        assert answers[0].status_code == 409 and "cancelled" in answers[0].json()["error"]
        listed = {t["id"]: t for t in c.get("/tasks", params={"limit": 500}).json()["tasks"]}
        assert listed[running]["status"] == "cancelled" and listed[running]["attempts"] == 1


def test_a_synchronous_task_is_recorded_when_its_client_leaves_right_after_the_answer(server):
    """The answer is sent only once its one record is handed to the ledger writer and written:
    a client that reads the status line and hangs up still finds its task in the ledger."""
    body = task_to_npz_bytes(small_task(30, 4, seed=52))
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(f"POST /tasks HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/octet-stream\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        head = b""
        while b"\r\n\r\n" not in head:
            head += sock.recv(4096)
        task_id = re.search(rb'"id":"([0-9a-f]+)"', head + sock.recv(65536)).group(1).decode()
    assert head.startswith(b"HTTP/1.1 200")
    with server.client() as c:
        doc = c.get(f"/tasks/{task_id}").json()
        assert doc["status"] == "succeeded"
        listed = {t["id"]: t for t in c.get("/tasks", params={"limit": 500}).json()["tasks"]}
        assert listed[task_id]["mode"] == "sync" and listed[task_id]["input_hashes"] == doc["metadata"]["input_hashes"]
        assert doc["predictions_sha256"] == run_task(load_task(body), None, "cpu-fast").predictions_sha256
