"""Slow uploads cannot deny service (issue 21): real sockets against real servers.

Connections that send their headers and a few bytes of body, then trickle, hold no upload slot:
a normal upload is answered meanwhile; at the upload deadline each trickler is answered 408 and
its connection closed. A connection that never finishes its headers is closed at the header
timeout. Beyond REV88_MAX_CONNECTIONS, `rev88 serve` answers 503 at once."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from app.http.uploads import UploadBudget
from learner.taskio import task_to_npz_bytes

from .helpers import ROOT, small_task
from .server import free_port, post_task, running_server, wait_for

TRICKLERS = 40


def _open(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _answer(sock: socket.socket, timeout: float) -> bytes:
    """Everything the server sends until it closes the connection (b"" if it just closes)."""
    sock.settimeout(timeout)
    got = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return got
        got += chunk


def test_tricklers_hold_nothing_and_get_408_at_the_deadline(tmp_path):
    env = {"REV88_BACKEND": "cpu-fast", "REV88_WORKERS": "1", "REV88_QUEUE_SIZE": "1",
           "REV88_UPLOAD_TIMEOUT_S": "3", "REV88_UPLOAD_MIN_RATE": str(1 << 30)}
    with running_server(tmp_path, env=env) as server:
        tricklers = []
        for _ in range(TRICKLERS):  # headers and a few bytes of a 100 kB body, then a byte now and then
            sock = _open(server.url)
            sock.sendall(b"POST /tasks HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
                         b"Content-Length: 100000\r\n\r\nPK\x03\x04")
            tricklers.append(sock)
        started = time.monotonic()
        for sock in tricklers[:5]:
            sock.sendall(b"\x00")
        # two upload slots in the old design (queue 1 + 1); 40 tricklers hold none now
        with server.client() as c:
            for seed in range(3):
                r = post_task(c, task_to_npz_bytes(small_task(30, 4, seed=seed)))
                assert r.status_code == 200, r.text
        assert time.monotonic() - started < 3, "the normal uploads must not wait for the tricklers"
        answers = [_answer(sock, 30) for sock in tricklers]
        waited = time.monotonic() - started
        for sock in tricklers:
            sock.close()
        assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers), answers[0][:300]
        assert all(b"connection: close" in a.lower() for a in answers)
        assert b"REV88_UPLOAD_TIMEOUT_S" in answers[0] and b"5 of 100000 bytes in 3 s" in answers[0]
        assert b"4 of 100000 bytes in 3 s" in answers[-1]
        assert 2.5 <= waited < 20
        with server.client() as c:  # and the service goes on
            assert post_task(c, task_to_npz_bytes(small_task(30, 4, seed=9))).status_code == 200
            metrics = c.get("/metrics").text
        assert 'outcome="upload_timeout"' in metrics


def test_a_connection_that_never_finishes_its_headers_is_closed(tmp_path):
    env = {"REV88_BACKEND": "cpu-fast", "REV88_WORKERS": "1", "REV88_HEADER_TIMEOUT_S": "1"}
    with running_server(tmp_path, env=env) as server:
        silent, partial = _open(server.url), _open(server.url)
        partial.sendall(b"POST /tasks HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        t0 = time.monotonic()
        assert _answer(partial, 20) == b"" and _answer(silent, 20) == b""
        assert 0.5 <= time.monotonic() - t0 < 10
        silent.close()
        partial.close()
        with server.client() as c:  # a request that completes its headers in time is unaffected
            assert c.get("/v2/health/live").status_code == 200


def test_the_upload_budget_counts_bytes_not_connections():
    budget = UploadBudget(1000)
    a, b, c = budget.reservation(), budget.reservation(), budget.reservation()
    assert a.take(600) and b.take(300) and not c.take(200)
    assert (budget.held, budget.uploads) == (900, 2)
    assert c.take(100) and budget.uploads == 3
    a.release()
    assert (budget.held, budget.uploads) == (400, 2) and c.take(500)
    for r in (b, c):
        r.release()
    assert (budget.held, budget.uploads) == (0, 0)


def test_an_upload_over_the_budget_is_503_and_names_the_limit(tmp_path):
    env = {"REV88_BACKEND": "cpu-fast", "REV88_WORKERS": "1", "REV88_MAX_BODY_BYTES": "300000",
           "REV88_UPLOAD_BUFFER_BYTES": "300000"}
    with running_server(tmp_path, env=env) as server:
        holder = _open(server.url)  # 250 kB received and held, the rest never sent
        holder.sendall(b"POST /tasks HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
                       b"Content-Length: 290000\r\n\r\n" + b"\x00" * 250000)
        body = task_to_npz_bytes(small_task(200, 20, seed=3))  # ~70 kB: over what is left
        assert len(body) > 50000
        with server.client() as c:
            r = wait_for(lambda: (lambda r: r if r.status_code == 503 else None)(post_task(c, body)), 30,
                         what="a 503 once the holder's bytes are in")
            assert "REV88_UPLOAD_BUFFER_BYTES" in r.json()["error"] and "retry-after" in r.headers
            holder.close()
            ok = wait_for(lambda: (lambda r: r if r.status_code == 200 else None)(post_task(c, body)), 30,
                          what="the upload accepted once the holder is gone")
            assert ok.json()["predictions_sha256"]


@pytest.mark.parametrize("limit", [16])
def test_rev88_serve_refuses_connections_beyond_its_limit(tmp_path, limit):
    port = free_port()
    env = {**os.environ, "REV88_DATA_DIR": str(tmp_path / "data"), "REV88_WORKERS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "rev88", "serve", "--port", str(port), "--backend", "cpu-fast",
                             "--max-connections", str(limit)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    held = []
    try:
        wait_for(lambda: _ready(url), 120, 0.2, "rev88 serve ready")
        held = [_open(url) for _ in range(limit + 4)]  # idle connections, each counted
        time.sleep(0.3)
        r = httpx.get(url + "/v2/health/live", timeout=10)
        assert r.status_code == 503
        for sock in held:
            sock.close()
        held = []
        wait_for(lambda: _ready(url), 30, 0.2, "connections freed")
    finally:
        for sock in held:
            sock.close()
        proc.terminate()
        out = proc.communicate(timeout=60)[0].decode()
    assert "open files" in out


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/v2/health/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
