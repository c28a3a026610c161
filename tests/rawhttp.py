"""Raw HTTP/1.1 over a socket, for tests that send what a real client would never send.

``exchange`` sends byte strings (and pauses) on one connection, reads what comes back, and parses
it into responses with a strict parser (``parse_responses``): every byte the server sent must
belong to exactly one well-framed response, so an answer written inside another one, or junk
between answers, shows as a parse failure, not as a passing status code.
"""

from __future__ import annotations

import dataclasses
import socket
import time


@dataclasses.dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes


@dataclasses.dataclass
class Outcome:
    responses: list[Response]
    closed: bool  # the server closed the connection (EOF, or a reset after its answers)
    reset: bool  # ... with a reset
    leftover: bytes  # bytes after the last complete response (must be empty)

    @property
    def statuses(self) -> list[int]:
        return [r.status for r in self.responses if r.status >= 200]


class FramingError(AssertionError):
    pass


def parse_responses(data: bytes, eof: bool = False) -> tuple[list[Response], bytes]:
    """Every complete response in ``data``, and what follows the last one. A response without a
    declared length runs to the end of the stream (only when ``eof``)."""
    out: list[Response] = []
    pos = 0
    while pos < len(data):
        end = data.find(b"\r\n\r\n", pos)
        if end < 0:
            break
        head = data[pos:end].decode("latin-1")
        lines = head.split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise FramingError(f"not a status line at byte {pos}: {lines[0][:80]!r}")
        status = int(parts[1])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise FramingError(f"not a header line: {line[:80]!r}")
            key = name.strip().lower()
            if key in headers and key != "set-cookie":
                raise FramingError(f"header {key!r} twice in one response")
            headers[key] = value.strip()
        body_start = end + 4
        if 100 <= status < 200 or status in (204, 304):
            out.append(Response(status, headers, b""))
            pos = body_start
            continue
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body, cursor = bytearray(), body_start
            while True:
                line_end = data.find(b"\r\n", cursor)
                if line_end < 0:
                    return out, data[pos:]
                size = int(data[cursor:line_end].split(b";")[0], 16)
                if line_end + 2 + size + 2 > len(data):
                    return out, data[pos:]
                body += data[line_end + 2 : line_end + 2 + size]
                if data[line_end + 2 + size : line_end + 4 + size] != b"\r\n":
                    raise FramingError("a chunk not followed by CRLF")
                cursor = line_end + 4 + size
                if size == 0:
                    break
            out.append(Response(status, headers, bytes(body)))
            pos = cursor
            continue
        if "content-length" in headers:
            length = int(headers["content-length"])
            if body_start + length > len(data):
                break
            out.append(Response(status, headers, data[body_start : body_start + length]))
            pos = body_start + length
            continue
        if not eof:
            break
        out.append(Response(status, headers, data[body_start:]))
        pos = len(data)
    return out, data[pos:]


def request(method: str, path: str, body: bytes = b"", headers: dict[str, str] | list[tuple[str, str]] | None = None,
            version: str = "1.1", length: int | None = None) -> bytes:
    """One request's bytes; ``headers``: a dict, or (name, value) pairs (a name may come twice);
    ``length``: the Content-Length to declare (default: the body's)."""
    pairs = list(headers.items()) if isinstance(headers, dict) else list(headers or ())
    lines = [f"{method} {path} HTTP/{version}", "Host: test"]
    for name, value in pairs:
        lines.append(f"{name}: {value}")
    if body or length is not None or method in ("POST", "PUT"):
        if not any(k.lower() == "transfer-encoding" for k, _ in pairs):
            lines.append(f"Content-Length: {len(body) if length is None else length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def chunked(body: bytes, piece: int = 100_000) -> bytes:
    out = bytearray()
    for i in range(0, len(body), piece):
        part = body[i : i + piece]
        out += b"%x\r\n" % len(part) + part + b"\r\n"
    return bytes(out + b"0\r\n\r\n")


def exchange(port: int, parts, *, want: int, timeout: float = 60.0, read_size: int = 65536,
             read_pause: float = 0.0, rcvbuf: int | None = None, shut_wr: bool = False,
             wait_close: float = 0.0) -> Outcome:
    """Send ``parts`` (bytes, or a float: a pause in seconds) on one connection; read until
    ``want`` final responses have come (or the server closes, or ``timeout``); then, with
    ``wait_close``, up to that long more for the server to close. ``read_pause``: a slow reader
    (each read of ``read_size`` bytes then a pause); ``shut_wr``: half-close after sending."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(timeout)
    sock.connect(("127.0.0.1", port))
    data, closed, reset = bytearray(), False, False
    try:
        for part in parts:
            if isinstance(part, (int, float)):
                time.sleep(part)
            else:
                try:
                    sock.sendall(part)
                except (BrokenPipeError, ConnectionResetError):
                    closed = reset = True
                    break
        if shut_wr and not closed:
            sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + timeout
        while not closed:
            responses, _ = parse_responses(bytes(data))
            if len([r for r in responses if r.status >= 200]) >= want:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                break
            sock.settimeout(left)
            try:
                chunk = sock.recv(read_size)
            except TimeoutError:
                break
            except ConnectionResetError:
                closed = reset = True
                break
            if not chunk:
                closed = True
                break
            data += chunk
            if read_pause:
                time.sleep(read_pause)
        if not closed and wait_close:
            sock.settimeout(wait_close)
            try:
                while True:
                    chunk = sock.recv(65536)
                    if not chunk:
                        closed = True
                        break
                    data += chunk
            except TimeoutError:
                pass
            except ConnectionResetError:
                closed = reset = True
    finally:
        sock.close()
    responses, leftover = parse_responses(bytes(data), eof=closed)
    return Outcome(responses, closed, reset, leftover)


def alive(port: int, parts, **kw) -> tuple[Outcome, bool]:
    """``exchange``, then whether the same connection still answers a GET /v2/health/live."""
    marker = request("GET", "/v2/health/live")
    outcome = exchange(port, [*parts, marker], want=kw.pop("want") + 1, **kw)
    lives = bool(outcome.responses) and outcome.responses[-1].body == b'{"status":"live"}'
    return outcome, lives
