"""uvicorn's httptools protocol, keeping a request body's chunks instead of copying them twice.

uvicorn appends every chunk the parser hands it to a ``bytearray`` (one copy) and gives the app
``bytes(that bytearray)`` (a second copy); ``app.uploads.read_body`` then joins the pieces it
received (a third). For the 6.5 MB draw-0 upload those are three 6.5 MB copies on the event loop
thread, holding the GIL. Here the parser's chunk objects themselves are kept (it makes each one
a fresh ``bytes``) and handed to the app as they are when one arrived since its last receive,
joined otherwise: two copies at most (measured: the body arrives in 256 kB reads, the app
receives it in about 7 pieces), one where every receive holds a single chunk.

The read-ahead limit (uvicorn pauses reading a connection while this much of its body waits for
the app) is 1 MiB instead of uvicorn's 64 KiB: fewer pause/resume round trips per upload, and
at most 1 MiB waiting per connection. Everything else is uvicorn's own code path.

It also closes a connection that has not finished a request's headers within
REV88_HEADER_TIMEOUT_S (10 s by default) of connecting or of the request's first byte: uvicorn
itself waits for ever on a connection that never completes its headers (its keep-alive timer only
starts after a response). The body's own deadline is the app's (app/http/uploads.py, 408).

``protocol_class()`` returns this class, or None where uvicorn's httptools protocol is not
there (uvicorn without the ``[standard]`` extra) or is older than 0.42: ``rev88 serve`` then
keeps uvicorn's default. It touches two uvicorn internals (``HttpToolsProtocol.on_body`` and the
cycle's ``body`` buffer, the same from uvicorn 0.42 to 0.54, checked in their sources); ``tests/test_http_protocol.py`` checks the
bodies it delivers against uvicorn's own protocol, byte for byte, and every test server runs on
it (``uvicorn --http app.http_protocol:ChunkedBodyHttpToolsProtocol``, ``tests/server.py``).
"""

from __future__ import annotations

import functools
import os

import uvicorn

READ_AHEAD_BYTES = 1 << 20


class _Chunks:
    """Stands in for the cycle's ``bytearray`` body: ``+=`` keeps the chunk, ``len`` is the
    byte count, ``bytes()`` the body so far (the chunk itself when there is one)."""

    __slots__ = ("parts", "size")

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0

    def __iadd__(self, data: bytes) -> _Chunks:
        self.parts.append(data)
        self.size += len(data)
        return self

    def __len__(self) -> int:
        return self.size

    def __bytes__(self) -> bytes:
        if len(self.parts) == 1 and type(self.parts[0]) is bytes:
            return self.parts[0]
        return b"".join(self.parts)


# Since uvicorn 0.42 the cycle's body is a bytearray that receive() hands over as
# bytes(self.body); before, it was a bytes object handed over as it is, which this class
# cannot stand in for. Older uvicorns keep their own protocol.
_VERSION = tuple(int(part) for part in uvicorn.__version__.split(".")[:2] if part.isdigit())
try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # uvicorn without httptools
    HttpToolsProtocol = None
if _VERSION < (0, 42):
    HttpToolsProtocol = None

if HttpToolsProtocol is not None:

    class ChunkedBodyHttpToolsProtocol(HttpToolsProtocol):
        """``--http app.http.protocol:ChunkedBodyHttpToolsProtocol`` for uvicorn's own CLI."""

        _header_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def connection_lost(self, exc) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm_header_timer()

        def on_headers_complete(self) -> None:
            self._disarm_header_timer()
            super().on_headers_complete()

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            self._header_timer = self.loop.call_later(header_timeout_s(), self._headers_too_slow)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def on_body(self, body: bytes) -> None:
            cycle = self.cycle
            if (self.parser.should_upgrade() and self._should_upgrade()) or cycle.response_complete:
                return
            if type(cycle.body) is not _Chunks:  # a new cycle, or uvicorn's receive() reset it
                held, cycle.body = cycle.body, _Chunks()
                if held:
                    cycle.body += bytes(held)
            cycle.body += bytes(body)  # bytes already (httptools copies each chunk out): no copy
            if len(cycle.body) > READ_AHEAD_BYTES:
                self.flow.pause_reading()
            cycle.message_event.set()


@functools.cache
def header_timeout_s() -> float:
    """REV88_HEADER_TIMEOUT_S (checked by app.settings when the app starts; 10 s if unset)."""
    try:
        value = float(os.environ.get("REV88_HEADER_TIMEOUT_S") or 10.0)
    except ValueError:
        value = 10.0
    return value if value > 0 else 10.0


def protocol_class() -> type | None:
    """The protocol class for ``uvicorn.run(http=...)``, or None (no httptools, uvicorn < 0.42)."""
    return ChunkedBodyHttpToolsProtocol if HttpToolsProtocol is not None else None
