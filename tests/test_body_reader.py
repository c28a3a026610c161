"""app/http/body_reader.py: a large body read from its socket by a thread, not the event loop.

Real uvicorn servers on loopback (tests/test_http_protocol.py's), real sockets: the body that
arrives is the one sent, byte for byte, whether a thread read all of it, gave a stalled body
back to the loop half way, lost its client, or found every thread busy; and nothing is left
behind (no reservation, no busy thread)."""

from __future__ import annotations

import hashlib
import socket
import time

import pytest

from app.http import body_reader
from app.http.protocol import protocol_class

from .test_http_protocol import BUDGET, LOOPS, Running, bodies, zero_copy_echo


def _counts() -> dict[str, int]:
    return dict(body_reader.COUNTS)


def _delta(before: dict[str, int]) -> dict[str, int]:
    return {k: v - before[k] for k, v in body_reader.COUNTS.items() if v != before[k]}


def _answer(sock: socket.socket, body: bytes) -> bytes:
    want = f"{hashlib.sha256(body).hexdigest()} {len(body)}".encode()
    got = b""
    while not got.endswith(want):
        chunk = sock.recv(65536)
        assert chunk, got
        got += chunk
    return got


def _settled(timeout_s: float = 5.0) -> None:
    """Until no thread reads and every reservation is given back."""
    deadline = time.monotonic() + timeout_s
    while (body_reader.busy() or BUDGET.held) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert body_reader.busy() == 0 and BUDGET.held == 0 and BUDGET.uploads == 0


def _head(n: int) -> bytes:
    return b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % n


@pytest.mark.parametrize("loop", LOOPS)
def test_a_large_body_is_read_by_a_thread_byte_for_byte(loop):
    app, seen = zero_copy_echo()
    big = bodies()[-1]
    before = _counts()
    with Running(protocol_class(), app, loop) as server, \
            socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        for _ in range(3):  # keep-alive: each body its own reading
            sock.sendall(_head(len(big)) + big)
            assert b"HTTP/1.1 200" in _answer(sock, big)
        _settled()
    assert _delta(before) == {"started": 3, "complete": 3}
    assert seen.count(("memoryview", len(big), False)) == 3


@pytest.mark.parametrize("loop", LOOPS)
def test_a_stalled_body_goes_back_to_the_loop_and_arrives_whole(loop):
    app, seen = zero_copy_echo()
    big = bodies()[-1]
    before = _counts()
    with Running(protocol_class(), app, loop) as server, \
            socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        half = len(big) // 2
        sock.sendall(_head(len(big)) + big[:half])
        time.sleep(body_reader.IDLE_S * 4)  # nothing for longer than IDLE_S: the thread lets go
        assert _delta(before) == {"started": 1, "idle": 1}
        sock.sendall(big[half:])  # the loop reads the rest
        assert b"HTTP/1.1 200" in _answer(sock, big)
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")  # and the connection serves on
        _answer(sock, b"abc")
        _settled()
    assert ("memoryview", len(big), False) in seen


@pytest.mark.parametrize("loop", LOOPS)
def test_a_client_gone_mid_body_leaves_nothing_behind(loop):
    app, _ = zero_copy_echo()
    big = bodies()[-1]
    before = _counts()
    with Running(protocol_class(), app, loop) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(_head(len(big)) + big[: len(big) // 3])
            time.sleep(0.05)
        _settled()  # the thread saw the end of the stream; the buffer's reservation is back
        ended = _delta(before)
        assert ended["started"] == 1 and ended.get("eof", 0) + ended.get("error", 0) + ended.get("stopped", 0) \
            + ended.get("idle", 0) == 1
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:  # the server serves on
            sock.sendall(_head(len(big)) + big)
            _answer(sock, big)
        _settled()


@pytest.mark.parametrize("loop", LOOPS)
def test_with_every_thread_busy_the_loop_reads_the_body(loop, monkeypatch):
    monkeypatch.setattr(body_reader, "THREADS", 1)
    app, _ = zero_copy_echo()
    big = bodies()[-1]
    before = _counts()
    with Running(protocol_class(), app, loop) as server, \
            socket.create_connection(("127.0.0.1", server.port), timeout=30) as slow, \
            socket.create_connection(("127.0.0.1", server.port), timeout=30) as fast:
        slow.sendall(_head(len(big)) + big[:300_000])
        deadline = time.monotonic() + 5
        while body_reader.busy() == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert body_reader.busy() == 1  # the slow body holds the one thread
        # keep it busy (more than SLOW_BYTES per IDLE_S) while another large body comes in
        sent, step = 300_000, body_reader.SLOW_BYTES // 2
        fast.sendall(_head(len(big)) + big)
        fast_answer = b""
        want = f"{hashlib.sha256(big).hexdigest()} {len(big)}".encode()
        fast.settimeout(body_reader.IDLE_S / 4)
        while not fast_answer.endswith(want):
            slow.sendall(big[sent : sent + step])
            sent += step
            try:
                chunk = fast.recv(65536)
            except TimeoutError:
                continue
            assert chunk, fast_answer
            fast_answer += chunk
        assert body_reader.busy() == 1 and _delta(before).get("all_busy") == 1  # read by the loop meanwhile
        slow.sendall(big[sent:])
        assert b"HTTP/1.1 200" in _answer(slow, big)
        _settled()
    assert _delta(before)["complete"] == 1


@pytest.mark.parametrize("loop", LOOPS)
def test_a_trickling_body_cannot_keep_a_thread(loop):
    """A byte now and then (never IDLE_S without one) still gives the thread back: too slow."""
    app, seen = zero_copy_echo()
    big = bodies()[-1]
    before = _counts()
    with Running(protocol_class(), app, loop) as server, \
            socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(_head(len(big)) + big[:300_000])
        sent = 300_000
        deadline = time.monotonic() + body_reader.IDLE_S * 10
        while _delta(before).get("idle", 0) == 0 and time.monotonic() < deadline:
            sock.sendall(big[sent : sent + 1])
            sent += 1
            time.sleep(body_reader.IDLE_S / 5)
        assert _delta(before) == {"started": 1, "idle": 1} and body_reader.busy() == 0
        sock.sendall(big[sent:])
        assert b"HTTP/1.1 200" in _answer(sock, big)
        _settled()
    assert ("memoryview", len(big), False) in seen
