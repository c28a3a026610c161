"""Webhook receivers for tests: real HTTP servers on loopback addresses (127.0.0.0/8 only).

``Receiver(host)`` listens on ``host`` (127.0.0.2 stands for an allowed public target in the
tests, 127.0.0.3 for a refused one), records every request (headers, body, time) and answers
each from a script: ``plan`` is a list of replies used in order (the last one repeats), each an
int status, ``(status, headers)``, ``"hang"`` (hold the request until ``release()``), or
``"drop"`` (close the connection without answering), or ``"endless"`` (200 and a body that
never ends).
"""

from __future__ import annotations

import dataclasses
import http.server
import socket
import threading
import time
from typing import Any


@dataclasses.dataclass
class Received:
    at: float
    path: str
    headers: dict[str, str]
    body: bytes


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Receiver:
    def __init__(self, host: str = "127.0.0.2", plan: list[Any] | None = None) -> None:
        self.host = host
        self.plan = list(plan or [204])
        self.requests: list[Received] = []
        self.endless_sent: list[int] = []  # bytes an "endless" reply got out before the sender hung up
        self.arrived = threading.Condition()
        self._release = threading.Event()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):  # noqa: N802 - http.server's name
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length)
                with receiver.arrived:
                    index = len(receiver.requests)
                    receiver.requests.append(Received(time.time(), self.path, {k.lower(): v for k, v in
                                                                              self.headers.items()}, body))
                    receiver.arrived.notify_all()
                reply = receiver.plan[min(index, len(receiver.plan) - 1)]
                if reply == "hang":
                    receiver._release.wait(120)
                    reply = 200
                if reply == "endless":  # 200, then a body that never ends (until the sender hangs up)
                    self.send_response(200)
                    self.send_header("transfer-encoding", "chunked")
                    self.end_headers()
                    chunk = b"x" * 65536
                    sent, deadline = 0, time.monotonic() + 30
                    try:
                        while time.monotonic() < deadline:
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                            sent += len(chunk)
                    except OSError:
                        pass
                    receiver.endless_sent.append(sent)
                    self.close_connection = True
                    return
                if reply == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                status, headers = reply if isinstance(reply, tuple) else (reply, {})
                payload = b"ok" if status != 204 else b""
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = http.server.ThreadingHTTPServer((host, 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/hook"

    def __enter__(self) -> Receiver:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._release.set()
        self.server.shutdown()
        self.server.server_close()

    def release(self) -> None:
        self._release.set()

    def wait_for(self, count: int, timeout: float = 60.0) -> list[Received]:
        """The first ``count`` requests, once they have arrived (AssertionError after ``timeout``)."""
        deadline = time.monotonic() + timeout
        with self.arrived:
            while len(self.requests) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"{len(self.requests)} webhook request(s) arrived within {timeout} s, "
                                         f"expected {count}")
                self.arrived.wait(left)
            return list(self.requests[:count])
