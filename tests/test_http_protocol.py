"""app/http/protocol.py: the bodies its protocol hands the app are uvicorn's own, byte for byte.

Two real uvicorn servers on loopback (its httptools protocol, and ours) run one plain ASGI app
that answers with what it received; the same requests go to both: empty, tiny, around the
read-ahead limit, several MiB, chunked transfer encoding, keep-alive in between, and a body
the app refuses unread. And an app that asks for it (a Policy in its lifespan state) gets a
large body whole, read straight into one buffer: the same bytes, one message."""

from __future__ import annotations

import asyncio
import hashlib
import socket
import threading

import httpx
import pytest
import uvicorn

from app.http.protocol import (
    READ_AHEAD_BYTES,
    STATE,
    ZERO_COPY_MIN_BYTES,
    ChunkedBodyHttpToolsProtocol,
    Policy,
    protocol_class,
)
from app.http.uploads import UploadBudget

BUDGET = UploadBudget(9 * 64 * 1024 * 1024)  # the echo apps' (a service has its own)
httptools = pytest.importorskip("uvicorn.protocols.http.httptools_impl")


async def echo(scope, receive, send):
    """Answers ``sha256 size chunks`` of the body it read, or 413 unread for /refuse."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["path"] == "/refuse":
        await send({"type": "http.response.start", "status": 413, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"no"})
        return
    h, size, chunks = hashlib.sha256(), 0, 0
    while True:
        message = await receive()
        assert type(message["body"]) is bytes  # ASGI: the body is bytes
        h.update(message["body"])
        size += len(message["body"])
        chunks += 1
        if not message.get("more_body"):
            break
    body = f"{h.hexdigest()} {size}".encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


LOOPS = ["asyncio", pytest.param("uvloop", marks=pytest.mark.skipif(
    __import__("importlib").util.find_spec("uvloop") is None, reason="uvloop is not installed"))]


class Running:
    def __init__(self, http, app=echo, loop: str = "asyncio") -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, http=http,
                                                    log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=lambda: self._run(loop), daemon=True)

    def _run(self, loop: str) -> None:
        if loop == "uvloop":  # what rev88 serve runs on (uvicorn's loop="auto" with uvloop installed)
            import uvloop

            runner = uvloop.new_event_loop()
            try:
                runner.run_until_complete(self.server.serve())
            finally:
                runner.close()
        else:
            asyncio.run(self.server.serve())

    def __enter__(self) -> Running:
        self.thread.start()
        for _ in range(500):
            if self.server.started:
                return self
            self.thread.join(0.01)
        raise AssertionError("uvicorn did not start")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def bodies():
    block = hashlib.sha256(b"rev88").digest()
    big = block * ((6 * 1024 * 1024) // len(block) + 7)  # ~6 MiB: several read-aheads
    return [b"", b"x", big[: 64 * 1024 + 1], big[: READ_AHEAD_BYTES + 17], big]


@pytest.mark.parametrize("loop", LOOPS)
def test_our_protocol_delivers_uvicorns_bodies_byte_for_byte(loop):
    ours = protocol_class()  # a buffered protocol holding a subclass of uvicorn's own
    assert ours is not None and issubclass(ours, asyncio.BufferedProtocol)
    assert issubclass(ChunkedBodyHttpToolsProtocol, httptools.HttpToolsProtocol)
    with Running(httptools.HttpToolsProtocol, loop=loop) as plain, Running(ours, loop=loop) as chunked:
        for server in (plain, chunked):
            with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=60) as c:  # one keep-alive connection
                got = []
                for body in bodies():
                    r = c.post("/", content=body)
                    assert r.status_code == 200
                    assert r.text == f"{hashlib.sha256(body).hexdigest()} {len(body)}"
                    got.append(r.text)

                    def parts(data=body):  # chunked transfer encoding, uneven pieces
                        for i in range(0, len(data), 300_001):
                            yield data[i : i + 300_001]

                    r = c.post("/", content=parts())
                    assert r.status_code == 200 and r.text == got[-1]
                r = c.post("/refuse", content=bodies()[-1])  # answered without reading the body
                assert r.status_code == 413
                again = c.post("/", content=b"after a refusal")  # the connection still serves
                assert again.text == f"{hashlib.sha256(b'after a refusal').hexdigest()} 15"
            server.seen = got
        assert plain.seen == chunked.seen


def zero_copy_echo():
    """The echo app, asking for large bodies whole (the lifespan state app/main.py sets too)."""
    seen_types = []

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    scope["state"][STATE] = Policy(max_body_bytes=64 * 1024 * 1024, budget=BUDGET)
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["path"] == "/refuse":
            await send({"type": "http.response.start", "status": 413, "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"no"})
            return
        h, size = hashlib.sha256(), 0
        while True:
            message = await receive()
            seen_types.append((type(message["body"]).__name__, len(message["body"]), message.get("more_body", False)))
            h.update(message["body"])
            size += len(message["body"])
            if not message.get("more_body"):
                break
        body = f"{h.hexdigest()} {size}".encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    return app, seen_types


@pytest.mark.parametrize("loop", LOOPS)
def test_a_large_body_is_read_whole_into_one_buffer_for_an_app_that_asks(loop):
    app, seen = zero_copy_echo()
    server = Running(protocol_class(), app, loop)
    assert BUDGET.held == 0
    with server, httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=60) as c:
        for body in bodies():  # the same answers as uvicorn's own protocol gives, on one connection
            r = c.post("/", content=body)
            assert r.text == f"{hashlib.sha256(body).hexdigest()} {len(body)}"
        big = bodies()[-1]
        whole = [t for t in seen if t[1] == len(big)]
        assert whole and whole[0] == ("memoryview", len(big), False)  # one message, the buffer itself
        assert all(t[0] == "bytes" for t in seen if t[1] < ZERO_COPY_MIN_BYTES)  # small ones as before
        assert c.post("/refuse", content=big).status_code == 413  # refused unread: the rest is skipped
        assert c.post("/", content=b"after").text.endswith(" 5")  # and the connection serves on
    assert BUDGET.held == 0 and BUDGET.uploads == 0  # every buffer's reservation given back


@pytest.mark.parametrize("loop", LOOPS)
def test_pipelined_requests_after_a_body_read_whole(loop):
    app, _ = zero_copy_echo()
    server = Running(protocol_class(), app, loop)
    big = bodies()[-1]
    with server, socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(big) + big
                     + b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
        got = b""
        while got.count(b"HTTP/1.1 200") < 2 or not got.endswith(b" 3"):
            chunk = sock.recv(65536)
            assert chunk, got
            got += chunk
    assert f"{hashlib.sha256(big).hexdigest()} {len(big)}".encode() in got
    assert got.endswith(f"{hashlib.sha256(b'abc').hexdigest()} 3".encode())
    assert BUDGET.held == 0


@pytest.mark.parametrize("loop", LOOPS)
def test_a_body_behind_expect_100_continue_is_read_whole_too(loop):
    """curl sends a large body only after ``100 Continue``: the server sends it when the app first
    receives, as uvicorn does, and the body is then read straight into its buffer."""
    app, seen = zero_copy_echo()
    server = Running(protocol_class(), app, loop)
    big = bodies()[-1]
    with server, socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(big))
        interim = b""
        while b"\r\n\r\n" not in interim:
            chunk = sock.recv(4096)
            assert chunk, interim
            interim += chunk
        assert interim.startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        sock.sendall(big)
        got = interim.split(b"\r\n\r\n", 1)[1]
        want = f"{hashlib.sha256(big).hexdigest()} {len(big)}".encode()
        while not got.endswith(want):
            chunk = sock.recv(65536)
            assert chunk, got
            got += chunk
    assert ("memoryview", len(big), False) in seen and BUDGET.held == 0


@pytest.mark.parametrize("loop", LOOPS)
def test_headers_and_a_body_in_one_read_arrive_byte_for_byte(loop):
    """One sendall of the headers and the body: the protocol's first read holds both (up to its
    256 KiB scratch), and feeds the parser the headers, then the rest -- into a large body's own
    buffer, or to the parser for a smaller one. Keep-alive, pipelining and a bad request too."""
    app, seen = zero_copy_echo()
    server = Running(protocol_class(), app, loop)
    block = hashlib.sha256(b"one read").digest()
    sizes = [100_000, ZERO_COPY_MIN_BYTES + 1, 300_000, 3 * 1024 * 1024]
    with server, socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        for size in sizes:
            body = (block * (size // len(block) + 1))[:size]
            sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % size + body)
            want = f"{hashlib.sha256(body).hexdigest()} {size}".encode()
            got = b""
            while not got.endswith(want):
                chunk = sock.recv(65536)
                assert chunk, (size, got)
                got += chunk
        two = (block * 5000)[:150_000]  # two requests in one write: the second behind the first
        sock.sendall((b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(two) + two) * 2)
        want = f"{hashlib.sha256(two).hexdigest()} {len(two)}".encode()
        got = b""
        while got.count(want) < 2:
            chunk = sock.recv(65536)
            assert chunk, got
            got += chunk
    assert ("memoryview", 300_000, False) in seen and ("memoryview", 3 * 1024 * 1024, False) in seen
    with Running(protocol_class(), app, loop) as server, \
            socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n" + b"x" * 200_000)
        got = b""
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except ConnectionResetError:  # closed with the rest unread: the kernel may reset
            pass
        assert got.count(b"HTTP/1.1 400") <= 1 and got.replace(b"HTTP/1.1 400", b"").count(b"HTTP/1.1") == 0
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as again:  # still serving
            again.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
            assert again.recv(65536).startswith(b"HTTP/1.1 200")
    assert BUDGET.held == 0


async def shapes(scope, receive, send):
    """Responses of every shape: a declared length, none at all (HEAD, empty), chunked with a pause."""
    if scope["type"] == "lifespan":
        await echo(scope, receive, send)
        return
    path = scope["path"]
    if path == "/chunked":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await asyncio.sleep(0.3)  # headers already out: a chunked body may come much later
        await send({"type": "http.response.body", "body": b"late", "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    body = b"" if path == "/empty" else b"hello"
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(body)).encode())]})
    if scope["method"] != "HEAD":
        await send({"type": "http.response.body", "body": body})
    else:
        await send({"type": "http.response.body", "body": b""})


def read_until(sock, predicate, what: str) -> bytes:
    got = b""
    while not predicate(got):
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before {what}: {got!r}"
        got += chunk
    return got


@pytest.mark.parametrize("loop", LOOPS)
def test_headers_go_out_with_the_body_and_every_response_shape_still_completes(loop):
    """A response's status line and headers are held for its first body bytes (one send); a HEAD,
    an empty body, a chunked response that pauses, and pipelined requests are all answered."""
    with Running(protocol_class(), shapes, loop) as server, \
            socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
        first = sock.recv(65536)  # one segment: the headers and the body together
        assert first.startswith(b"HTTP/1.1 200") and first.endswith(b"\r\n\r\nhello"), first
        sock.sendall(b"HEAD /hello HTTP/1.1\r\nHost: x\r\n\r\n")
        head = read_until(sock, lambda g: g.endswith(b"\r\n\r\n"), "the HEAD's headers")
        assert b"content-length: 5" in head
        sock.sendall(b"GET /empty HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"content-length: 0" in read_until(sock, lambda g: g.endswith(b"\r\n\r\n"), "the empty response")
        sock.sendall(b"GET /chunked HTTP/1.1\r\nHost: x\r\n\r\n")
        early = read_until(sock, lambda g: g.endswith(b"\r\n\r\n"), "the chunked response's headers")
        assert b"transfer-encoding: chunked" in early  # before its body, which comes 0.3 s later
        read_until(sock, lambda g: g.endswith(b"0\r\n\r\n"), "the chunked body")
        sock.sendall(b"HEAD /hello HTTP/1.1\r\nHost: x\r\n\r\nGET /empty HTTP/1.1\r\nHost: x\r\n\r\n"
                     b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
        piped = read_until(sock, lambda g: g.count(b"HTTP/1.1 200") == 3 and g.endswith(b"hello"), "three answers")
        assert piped.count(b"content-length: 5") == 2 and piped.count(b"content-length: 0") == 1


def test_the_held_headers_are_written_with_the_body_in_one_call():
    from app.http.protocol import _HeadersWithBody

    class Cycle:  # a cycle's flags (the transport keeps a weak reference to its cycle)
        def __init__(self, **flags):
            vars(self).update(flags)

    class Transport:
        def __init__(self):
            self.calls = []

        def write(self, data):
            self.calls.append(("write", bytes(data)))

        def writelines(self, parts):
            self.calls.append(("writelines", b"".join(parts)))

        def close(self):
            self.calls.append(("close", b""))

    cycle = Cycle(response_started=False, response_complete=False, chunked_encoding=None)
    real = Transport()
    t = _HeadersWithBody(real, cycle)
    t.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # before the response: at once
    cycle.response_started, cycle.chunked_encoding = True, False
    t.write(b"HTTP/1.1 200 OK\r\n\r\n")  # held
    assert real.calls == [("write", b"HTTP/1.1 100 Continue\r\n\r\n")]
    t.write(b"body")
    assert real.calls[-1] == ("writelines", b"HTTP/1.1 200 OK\r\n\r\nbody") and len(real.calls) == 2
    t.write(b"more")  # the rest as it comes
    assert real.calls[-1] == ("write", b"more")

    chunked = Cycle(response_started=True, response_complete=False, chunked_encoding=True)
    real2 = Transport()
    _HeadersWithBody(real2, chunked).write(b"HTTP/1.1 200 OK\r\n\r\n")
    assert real2.calls == [("write", b"HTTP/1.1 200 OK\r\n\r\n")]  # a chunked response's headers: at once

    real3 = Transport()
    t3 = _HeadersWithBody(real3, Cycle(response_started=True, response_complete=False,
                                                  chunked_encoding=False))
    t3.write(b"HTTP/1.1 200 OK\r\n\r\n")
    t3.close()  # closed before any body: the headers first
    assert real3.calls == [("write", b"HTTP/1.1 200 OK\r\n\r\n"), ("close", b"")]
