"""Bounded work over real HTTP: config bounds and the task budget refused before the queue,
and a task stopped on the device when its time is up, its client leaves, or a queued task's
client leaves (it never runs). The device is held by a gate, never by an assumed slowness."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from app.main import create_app
from app.settings import Settings
from learner.budget import estimate
from learner.config import SEED_MAX, make_config
from learner.result import run_task
from learner.taskio import task_to_npz_bytes

from .gates import Gate, gated_engines
from .helpers import small_task
from .server import inprocess_server, post_task, wait_for


@pytest.fixture(scope="module")
def gated():
    gate = Gate()
    engines = gated_engines(gate)
    settings = Settings(backend="cpu-fast", task_timeout_s=2.0, queue_size=4, workers=1,
                        max_task_work=100_000, max_task_bytes=8 * 1024 * 1024)
    app = create_app(settings, engines=engines)
    with inprocess_server(app) as server:
        server.gate, server.service, server.engines = gate, app.state.service, engines
        yield server
    gate.release()


def small_body(seed: int = 0, n: int = 40, m: int = 9) -> bytes:
    return task_to_npz_bytes(small_task(n, m, seed))


def queue(server) -> dict:
    return server.service.executor.snapshot()


# --------------------------------------------------------------------------- refused before the queue


@pytest.mark.parametrize(("params", "status", "words"), [
    ({"seed": str(2**70)}, 422, ["config.seed", str(SEED_MAX)]),
    ({"seed": "-1"}, 422, ["config.seed"]),
    ({"depth": "100000"}, 422, ["config.depth"]),
    ({"epochs": "100000"}, 422, ["config.epochs"]),
    ({"batch_size": str(10**9)}, 422, ["config.batch_size"]),
    ({"learning_rate": "inf"}, 422, ["config.learning_rate"]),
])
def test_config_out_of_bounds_is_refused_with_the_range(gated, params, status, words):
    before = queue(gated)["accepted"]
    with gated.client() as c:
        r = post_task(c, small_body(), params=params)
    assert r.status_code == status, r.text
    for word in words:
        assert word in r.json()["error"], r.json()
    assert queue(gated)["accepted"] == before  # nothing queued


def test_over_the_work_budget_is_422_naming_the_limit_and_its_variable(gated):
    # 200 rows x 1,000 epochs x depth 2: 528,018 work units (4.5 MB), over the 100,000 this server allows
    assert estimate(200, 9, make_config({"epochs": 1000})).work == 528_018
    with gated.client() as c:
        r = post_task(c, small_body(n=200), params={"epochs": "1000"})
    assert r.status_code == 422, r.text
    body = r.json()
    assert "REV88_MAX_TASK_WORK" in body["error"] and "100,000" in body["error"]
    assert body["type"] == "BudgetExceeded"


def test_over_the_memory_budget_is_413_naming_the_limit_and_its_variable(gated):
    # depth 64 on 50 rows x 10 epochs: little work (53,056 units) but an estimated 13.4 MB of
    # parameter state, over the 8 MiB this server allows
    config = make_config({"depth": 64, "epochs": 10})
    est = estimate(50, 9, config)
    assert est.work <= 100_000 and est.bytes > 8 * 1024 * 1024
    with gated.client() as c:
        r = post_task(c, small_body(n=50), params={"depth": "64", "epochs": "10"})
    assert r.status_code == 413, r.text
    assert "REV88_MAX_TASK_BYTES" in r.json()["error"] and r.json()["type"] == "BudgetExceeded"


def test_both_ends_of_the_seed_range_are_accepted(gated):
    task = small_task(40, 9, 3)
    for seed in (0, SEED_MAX):
        with gated.client() as c:
            r = post_task(c, task_to_npz_bytes(task), params={"seed": str(seed)})
        assert r.status_code == 200, r.text
        assert r.json()["predictions_sha256"] == run_task(task, make_config({"seed": seed}), "cpu-fast").predictions_sha256


def test_limits_are_shown_in_health(gated):
    with gated.client() as c:
        limits = c.get("/health").json()["limits"]
    assert limits["max_task_work"] == 100_000 and limits["max_task_bytes"] == 8 * 1024 * 1024


# --------------------------------------------------------------------------- stopped on the device


def test_a_running_task_whose_client_disconnects_is_stopped(gated):
    before = queue(gated)
    gated.gate.hold()
    try:
        with pytest.raises(httpx.ReadTimeout):
            with gated.client(timeout=httpx.Timeout(30, read=0.5)) as c:
                post_task(c, small_body(7))  # gives up after 0.5 s, closing its connection
        wait_for(lambda: queue(gated)["stopped"] - before["stopped"] == 1, 30, what="the task stopped")
        snap = queue(gated)
        assert snap["running"] is None and snap["in_flight"] == 0
    finally:
        gated.gate.release()
    assert queue(gated)["completed"] == before["completed"]  # it never finished


def test_a_queued_task_whose_client_disconnects_never_runs(gated):
    before = queue(gated)
    engine = gated.engines("cpu-fast", "cpu")
    entered = engine.entered
    gated.gate.hold()
    results = {}

    def blocker():
        with gated.client() as c:
            results["blocker"] = post_task(c, small_body(8))

    t = threading.Thread(target=blocker)
    t.start()
    try:
        wait_for(lambda: engine.waiting == 1, 30, what="the blocker on the device")
        with pytest.raises(httpx.ReadTimeout):
            with gated.client(timeout=httpx.Timeout(30, read=0.5)) as c:
                post_task(c, small_body(9))
        wait_for(lambda: queue(gated)["dropped"] - before["dropped"] == 1, 30, what="the queued task dropped")
        assert queue(gated)["depth"] == 0
    finally:
        gated.gate.release()
    t.join(60)
    assert results["blocker"].status_code == 200
    assert engine.entered - entered == 1  # only the blocker ever reached the device


def test_a_timed_out_task_frees_the_device_and_the_504_says_it_was_stopped(gated):
    gated.gate.hold()
    try:
        with gated.client() as c:
            t0 = time.monotonic()
            r = post_task(c, small_body(10))
            waited = time.monotonic() - t0
    finally:
        gated.gate.release()
    assert r.status_code == 504 and r.json()["stopped"] is True and r.json()["where"] == "running"
    assert waited >= 2.0  # answered after the timeout, once the stop was confirmed
    assert queue(gated)["running"] is None


def test_a_client_that_closes_its_socket_mid_wait_stops_its_task(gated):
    """The same with a raw socket: the request is complete, then the client just closes."""
    before = queue(gated)
    body = small_body(11)
    port = int(gated.url.rsplit(":", 1)[1])
    gated.gate.hold()
    try:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"POST /tasks HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_for(lambda: queue(gated)["running"] is not None, 30, what="the task running")
        sock.close()
        wait_for(lambda: queue(gated)["stopped"] - before["stopped"] == 1, 30, what="the task stopped")
    finally:
        gated.gate.release()
