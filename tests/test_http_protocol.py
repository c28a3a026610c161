"""app/http/protocol.py: the bodies its protocol hands the app are uvicorn's own, byte for byte.

Two real uvicorn servers on loopback (its httptools protocol, and ours) run one plain ASGI app
that answers with what it received; the same requests go to both: empty, tiny, around the
read-ahead limit, several MiB, chunked transfer encoding, keep-alive in between, and a body
the app refuses unread."""

from __future__ import annotations

import asyncio
import hashlib
import socket
import threading

import httpx
import pytest
import uvicorn

from app.http.protocol import READ_AHEAD_BYTES, protocol_class

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


class Running:
    def __init__(self, http) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(echo, host="127.0.0.1", port=self.port, http=http,
                                                    log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), daemon=True)

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


def test_our_protocol_delivers_uvicorns_bodies_byte_for_byte():
    ours = protocol_class()
    assert ours is not None and issubclass(ours, httptools.HttpToolsProtocol)
    with Running(httptools.HttpToolsProtocol) as plain, Running(ours) as chunked:
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
