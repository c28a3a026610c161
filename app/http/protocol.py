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

``protocol_class()`` returns this class, or None where uvicorn's httptools protocol is not
there (uvicorn without the ``[standard]`` extra) or is older than 0.42: ``rev88 serve`` then
keeps uvicorn's default. It touches two uvicorn internals (``HttpToolsProtocol.on_body`` and the
cycle's ``body`` buffer, the same from uvicorn 0.42 to 0.54, checked in their sources); ``tests/test_http_protocol.py`` checks the
bodies it delivers against uvicorn's own protocol, byte for byte, and every test server runs on
it (``uvicorn --http app.http_protocol:ChunkedBodyHttpToolsProtocol``, ``tests/server.py``).
"""

from __future__ import annotations

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
        """``--http app.http_protocol:ChunkedBodyHttpToolsProtocol`` for uvicorn's own CLI."""

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


def protocol_class() -> type | None:
    """The protocol class for ``uvicorn.run(http=...)``, or None (no httptools, uvicorn < 0.42)."""
    return ChunkedBodyHttpToolsProtocol if HttpToolsProtocol is not None else None
