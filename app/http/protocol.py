"""uvicorn's httptools protocol, with a request body's bytes copied as few times as they can be.

uvicorn appends every chunk the parser hands it to a ``bytearray`` (one copy) and gives the app
``bytes(that bytearray)`` (a second copy); the app then joins the pieces it received (a third),
all on the event loop thread, holding the GIL. Here the parser's chunk objects themselves are
kept (it makes each one a fresh ``bytes``) and handed to the app as they are when one arrived
since its last receive, joined otherwise.

The read-ahead limit (uvicorn pauses reading a connection while this much of its body waits for
the app) is 1 MiB instead of uvicorn's 64 KiB: fewer pause/resume round trips per upload, and
at most 1 MiB waiting per connection. Everything else is uvicorn's own code path.

A large body (a Content-Length of at least ``ZERO_COPY_MIN_BYTES``, within REV88_MAX_BODY_BYTES)
goes further: once its headers are parsed, the connection reads it straight from the socket into
one buffer of its declared size (``asyncio.BufferedProtocol``: the kernel's copy is the only
one), bypassing the parser, and hands the app that buffer whole, as a memoryview, in one
``http.request`` message. ASGI says bytes, so only an app that asks for it gets this: its
lifespan startup sets ``ZERO_COPY_STATE`` in the lifespan state (app/main.py does); any other app
gets bytes, as from uvicorn's own protocol. The buffer's bytes are reserved in the upload budget first (the same
``UploadBudget`` the app counts in); when the budget cannot hold them, the body takes the
ordinary path above. After such a body the connection's parser starts afresh for the next
request. Headers and small bodies are read into one scratch buffer shared by every connection of
the loop and copied out at once, as asyncio's own reads do.

A request that ``DIRECT_STATE``'s lane admits at its headers (a synchronous POST /tasks,
app/api/direct.py) never becomes an ASGI cycle: its ``DirectExchange`` has a reading thread read
a large body (or takes the body that came whole with its headers), gives it to the lane's
handler, and writes the answer the handler gives it from whatever thread it comes; the loop hears
only that the body is in and that the answer is out. What the client sends meanwhile waits,
parsed once the answer is out; a stalled body, no free thread, or a read that holds another
request too goes the ordinary way, from the headers on, with what was read so far.

A POST or PUT request's scope carries ``GONE``, a future the connection completes when its client
disconnects before the response is complete: the app waits on it beside its task, instead of a
task of its own blocked in ``receive()`` (uvicorn reports a disconnect only through receive).

It also closes a connection that has not finished a request's headers within
REV88_HEADER_TIMEOUT_S (10 s by default) of connecting or of the request's first byte: uvicorn
itself waits for ever on a connection that never completes its headers (its keep-alive timer only
starts after a response). The body's own deadline is the app's (app/http/uploads.py, 408). What each step costs: docs/performance.md (bench/bench_shell.py).

``protocol_class()`` returns the transport-side class (``BufferedHttpToolsProtocol``), or None where uvicorn's httptools protocol is not
there (uvicorn without the ``[standard]`` extra) or is older than 0.42: ``rev88 serve`` then
keeps uvicorn's default. It touches uvicorn internals: ``HttpToolsProtocol.on_body`` and the
cycle's ``body`` buffer (the same from uvicorn 0.42 to 0.54, checked in their sources), and for a
body read whole the cycle's ``receive``/``send``, ``more_body``, ``message_event`` and the
connection's parser (checked against uvicorn 0.54.0, the version installed here).
``tests/test_http_protocol.py`` checks the bodies it delivers against uvicorn's own protocol,
byte for byte, on asyncio's loop and on uvloop, and every test server runs on
it (``uvicorn --http app.http.protocol:BufferedHttpToolsProtocol``, ``tests/server.py``).
"""

from __future__ import annotations

import asyncio
import functools
import os
import socket
import time
import weakref

import numpy as np
import uvicorn

from . import body_reader, uploads

READ_AHEAD_BYTES = 1 << 20
ZERO_COPY_STATE = "rev88.zero_copy_body"  # lifespan state: the app takes a body as one memoryview
ZERO_COPY_MIN_BYTES = 256 * 1024
# lifespan state: what serves a synchronous POST /tasks off the event loop (app/api/direct.py):
# ``admit(headers, query_string)`` -> a handler, or None for the ordinary way (see ``DirectExchange``)
DIRECT_STATE = "rev88.direct"
# scope key: a future of the loop's, done when the request's client disconnects before its
# response is complete (POST and PUT requests; what app/api/intake.py waits on beside the task)
GONE = "rev88.gone"
# One event loop per process: reads never interleave. 64 KiB: a large body's first read (with its
# headers) is the loop's, the rest its reading thread's (256 KiB: 0.1 ms more of the loop's CPU per
# large upload, bench/bench_shell.py)
_SCRATCH = memoryview(bytearray(64 * 1024))


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
    from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
except ImportError:  # uvicorn without httptools
    HttpToolsProtocol = STATUS_LINE = None
if _VERSION < (0, 42):
    HttpToolsProtocol = None

class ZeroCopyBody:
    """A body read straight into its buffer: ``data`` (a memoryview of its bytes) and the upload
    budget's reservation that holds them until the request's response is complete."""

    __slots__ = ("data", "reservation", "pos")

    def __init__(self, data: memoryview, reservation: uploads.Reservation, pos: int = 0) -> None:
        self.data, self.reservation = data, reservation
        self.pos = pos  # bytes of it read so far (what a 408 says arrived)


def _whole_body_receive(cycle, view: memoryview):
    """The cycle's ``receive`` for a body read straight into ``view``: one message with all of it
    once it is complete, then uvicorn's own receive (which reports the disconnect)."""
    own = cycle.receive
    delivered = False

    async def receive():
        nonlocal delivered
        if delivered:
            return await own()
        if cycle.waiting_for_100_continue and not cycle.transport.is_closing():  # as uvicorn's receive
            cycle.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            cycle.waiting_for_100_continue = False
        while cycle.more_body and not cycle.disconnected and not cycle.response_complete:
            cycle.flow.resume_reading()
            await cycle.message_event.wait()
            cycle.message_event.clear()
        if cycle.disconnected or cycle.response_complete:
            return {"type": "http.disconnect"}
        delivered = True
        return {"type": "http.request", "body": view, "more_body": False}

    return receive


def _releasing_send(cycle, body: ZeroCopyBody):
    """The cycle's ``send``, giving the body's reservation back (and dropping the buffer from the
    scope) once this request's response is complete: an idle keep-alive connection, or one whose
    next request is pipelined behind it, keeps no buffer."""
    own = cycle.send

    async def send(message) -> None:
        try:
            await own(message)
        finally:
            if cycle.response_complete or cycle.disconnected:
                body.reservation.release()
                cycle.scope.pop("rev88.body", None)
                # the cycle holds these two closures and they hold the cycle (and the body's buffer):
                # unlinked here, the request is freed when it ends, not at the cyclic GC's next full
                # pass (bench/bench_soak.py; tests/test_memory_soak.py)
                vars(cycle).pop("receive", None)
                vars(cycle).pop("send", None)

    return send


class _HeadersWithBody:
    """The cycle's transport, but that a response's status line and headers (uvicorn writes them
    as soon as the app starts its response) wait for its first body bytes and go out with them:
    one ``send`` and one segment instead of two, for a response that declares its length. They go
    out on their own as soon as anything else happens instead: the response ends without a
    body write (HEAD, an empty body), the connection closes. A chunked response, whose body may
    come much later, and the ``100 Continue`` line before a response are written at once."""

    __slots__ = ("_transport", "_cycle", "_held", "_done")

    def __init__(self, transport, cycle) -> None:
        # (the cycle holds this object: a weak reference back, so that the pair is no reference
        # cycle and a request is freed when it ends, tests/test_memory_soak.py)
        self._transport, self._cycle, self._held, self._done = transport, weakref.ref(cycle), None, False

    def write(self, data) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            self._transport.writelines((held, data))
            return
        cycle = self._cycle()
        if not self._done and cycle is not None and cycle.response_started and not cycle.response_complete:
            self._done = True  # only the first write of the response: its status line and headers
            if cycle.chunked_encoding is False:
                self._held = data
                return
        self._transport.write(data)

    def flush(self) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            self._transport.write(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name):
        return getattr(self._transport, name)


class DirectExchange:
    """A request served off the event loop, from its headers to its answer: its body read by a
    ``rev88-recv`` thread into one buffer, then handed to the handler that ``DIRECT_STATE``'s
    ``admit`` returned, which answers through ``respond`` from whatever thread ends its work.

    The handler's side: ``body(view, exchange)`` (the reading thread, once the body is complete;
    it must call ``respond`` exactly once, at once or later), ``armed(loop)`` (the loop, once the
    body is in: its timers), ``gone()`` (the loop: the client disconnected before the answer;
    may come after ``respond``), ``ended()`` (the loop, the exchange over); and its attribute
    ``upload_deadline_s``: the body must be in by then (from the headers), else the app gets it.

    ``respond`` sends what the socket takes at once from the calling thread (a duplicate of the
    connection's, kept open by this exchange until it ends, so the answer never reaches another
    connection that reused the number) and hands the rest, and the end, to the loop."""

    __slots__ = ("protocol", "handler", "length", "keep_alive", "client", "started_mono", "held", "array", "view",
                 "reservation", "sock", "reading", "whole", "body_in", "rest", "pipelined", "closed")

    def __init__(self, protocol, handler, length: int, keep_alive: bool) -> None:
        self.protocol, self.handler, self.length, self.keep_alive = protocol, handler, length, keep_alive
        self.client = protocol.client[0] if protocol.client else None  # (the access log's)
        self.started_mono = time.monotonic()
        self.held: list[bytes] | None = []  # body bytes that came with the headers
        self.array = self.view = self.reservation = self.sock = self.reading = None
        self.whole = False  # the body came whole with the headers (read by the loop)
        self.body_in = False  # the body is complete and its handler has it
        self.rest: bytes | None = None  # set once answered: what the loop still has to write
        self.pipelined: list[bytes] = []  # what the client sent after the body: parsed once answered
        self.closed = False

    def respond(self, status: int, headers: list[tuple[bytes, bytes]], content: bytes) -> None:
        """Send the answer (any thread): the status line, uvicorn's default headers (date,
        server), ``headers``, the length, and ``content``."""
        protocol = self.protocol
        if protocol is None:
            return
        head = [STATUS_LINE[status]]
        length = (b"content-length", str(len(content)).encode())
        for name, value in (*protocol.server_state.default_headers, *headers):
            if name == b"content-type" and length is not None:  # (where Starlette's responses put it)
                head += [length[0], b": ", length[1], b"\r\n"]
                length = None
            head += [name, b": ", value, b"\r\n"]
        if length is not None:
            head += [length[0], b": ", length[1], b"\r\n"]
        if not self.keep_alive:
            head.append(b"connection: close\r\n")
        head.append(b"\r\n")
        data = b"".join(head)
        sent = 0
        try:
            self.sock.settimeout(0.0)
            sent = self.sock.sendmsg([data, content])
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:  # the connection is gone: nothing to send
            sent = len(data) + len(content)
        rest = b"" if sent >= len(data) + len(content) else (data + content)[sent:]
        try:
            protocol.loop.call_soon_threadsafe(protocol._direct_responded, self, rest)
        except RuntimeError:  # the loop has closed
            pass

    def close(self) -> None:
        """(the loop) Give back what the exchange holds: its buffer's reservation, its socket."""
        if self.closed:
            return
        self.closed = True
        if self.reservation is not None:
            self.reservation.release()
        if self.sock is not None:
            self.sock.close()
        self.protocol = self.handler = self.array = self.view = self.reading = None
        self.held = self.pipelined = None


def _declared_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The one Content-Length of a request without Transfer-Encoding, else None."""
    lengths = [value for name, value in headers if name == b"content-length"]
    if len(lengths) != 1 or any(name == b"transfer-encoding" for name, _ in headers):
        return None
    try:
        return int(lengths[0])
    except ValueError:
        return None


if HttpToolsProtocol is not None:
    import httptools

    class ChunkedBodyHttpToolsProtocol(HttpToolsProtocol, asyncio.BufferedProtocol):
        """The HTTP side; the transport's protocol is ``BufferedHttpToolsProtocol``, which holds one
        (``--http app.http.protocol:BufferedHttpToolsProtocol`` for uvicorn's own CLI)."""

        _header_timer = None
        _zc_pending = 0  # the declared length of a body about to be read straight into its buffer
        _zc_array = None  # that buffer (numpy: no zero-filling of megabytes that are overwritten)
        _zc_view = None
        _zc_pos = 0
        _zc_cycle = None
        _zc_reservation = None
        _zc_bodies = None  # the ZeroCopyBody of each request of this connection not yet answered
        _zc_reading = None  # a thread reading the body into that buffer (app/http/body_reader.py)
        _gones = None  # (cycle, its GONE future) of the connection's POST/PUT requests

        # ---------------------------------------------------------------- reading
        def get_buffer(self, sizehint: int) -> memoryview:
            if self._zc_view is not None:
                return self._zc_view[self._zc_pos:]
            return _SCRATCH

        def buffer_updated(self, nbytes: int) -> None:
            if self._zc_view is not None:
                self._unset_keepalive_if_required()
                self._zc_pos += nbytes
                self._zc_bodies[-1].pos = self._zc_pos
                if self._zc_pos >= len(self._zc_view):
                    self._zc_complete()
                return
            self._feed(bytes(_SCRATCH[:nbytes]))

        _read = b""  # what the parser is being fed now, and the messages it began and ended in it
        _read_began = 0
        _read_ended = 0

        def _feed(self, data: bytes) -> None:
            """Parse ``data``; then a body to read into a buffer of its own, or a request whose body
            came whole with its headers to serve off the loop."""
            self._read, self._read_began, self._read_ended = data, 0, 0
            self.data_received(data)
            self._read = b""
            direct = self._direct
            if direct is not None and direct.held is not None:
                if direct.whole:
                    self._direct_serve_whole()
                else:
                    self._direct_start()
            elif self._zc_pending and self.parser is not None:
                self._zc_enter()

        def _zc_enter(self) -> None:
            length, self._zc_pending = self._zc_pending, 0
            cycle = self.cycle
            if cycle is None or cycle.response_complete or not cycle.more_body or self.pipeline \
                    or not self.app_state.get(ZERO_COPY_STATE):
                return
            have = len(cycle.body)
            if have >= length:
                return  # it all came with the headers: the parser has it
            reservation = uploads.BUDGET.reservation()
            if not reservation.take(length):
                reservation.release()
                return  # no room for it now: the ordinary path, counted by the app as it arrives
            array = np.empty(length, dtype=np.uint8)
            view = memoryview(array)
            if have:
                view[:have] = bytes(cycle.body)
                cycle.body = bytearray()
            self._zc_attach(cycle, array, view, have, reservation)
            if length - have >= body_reader.MIN_BYTES and self.scheme == "http":  # (TLS: the loop's reads only)
                self._zc_offload()

        def _zc_attach(self, cycle, array, view: memoryview, pos: int, reservation) -> None:
            """The cycle's body goes on into ``view`` (``pos`` bytes in), reserved by ``reservation``."""
            self._zc_array, self._zc_view, self._zc_pos = array, view, pos
            self._zc_cycle, self._zc_reservation = cycle, reservation
            cycle.scope["rev88.body"] = body = ZeroCopyBody(view, reservation, pos)  # its bytes are reserved already
            cycle.receive = _whole_body_receive(cycle, view)  # the app's task has not started yet
            cycle.send = _releasing_send(cycle, body)
            self._zc_bodies = [b for b in self._zc_bodies or () if b.reservation.bytes]  # the answered go
            self._zc_bodies.append(body)

        def _zc_offload(self) -> None:
            sock = self.transport.get_extra_info("socket")
            if sock is None:
                return
            loop, view = self.loop, self._zc_view

            def done(pos: int, how: str) -> None:  # in the reading thread
                try:
                    loop.call_soon_threadsafe(self._zc_read_done, view, pos)
                except RuntimeError:  # the loop has closed
                    pass

            self.flow.hold()
            self._zc_reading = body_reader.start(sock.fileno(), view, self._zc_pos, done)
            if self._zc_reading is None:
                self.flow.release()

        def _zc_read_done(self, view: memoryview, pos: int) -> None:
            self._zc_reading = None
            if self._zc_view is view:  # (else the connection was lost meanwhile)
                self._zc_pos = self._zc_bodies[-1].pos = pos
                if pos >= len(view):
                    self._zc_complete()
            self.flow.release()  # the loop reads the connection again: the rest of a stalled body, or what follows

        def _zc_complete(self) -> None:
            cycle, reservation = self._zc_cycle, self._zc_reservation
            self._zc_array = self._zc_view = self._zc_cycle = self._zc_reservation = None
            self._zc_pos = 0
            self._fresh_parser()
            if cycle.response_complete or cycle.disconnected:
                reservation.release()
                return
            cycle.more_body = False
            cycle.message_event.set()

        def _fresh_parser(self) -> None:
            """The parser saw a request's headers only (its body was read into a buffer): a fresh
            one for the connection's next request."""
            self.parser = httptools.HttpRequestParser(self)
            try:
                self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
            except AttributeError:  # httptools < 0.6.3
                pass

        def _zc_release(self) -> None:
            if self._zc_reading is not None:
                self._zc_reading.stop()
            if self._zc_reservation is not None:
                self._zc_reservation.release()
            self._zc_array = self._zc_view = self._zc_cycle = self._zc_reservation = None
            self._zc_pos = 0


        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.flow = body_reader.HeldFlow(transport)  # uvicorn's, but it cannot resume a connection a thread reads
            self._arm_header_timer()

        def connection_lost(self, exc) -> None:
            direct, self._direct = self._direct, None
            if direct is not None:  # (its buffer and socket are given back when its thread is done with them)
                if direct.reading is not None:
                    direct.reading.stop()
                elif direct.held is not None or direct.rest is not None:
                    direct.close()  # (not started, or answered: no thread holds it)
                else:
                    direct.handler.gone()
            for cycle, gone in self._gones or ():  # every request of the connection not yet answered
                if not cycle.response_complete and not gone.done():
                    gone.set_result(None)
            self._gones = None
            self._disarm_header_timer()
            self._zc_release()
            for body in self._zc_bodies or ():  # requests of this connection still holding a body
                body.reservation.release()
            self._zc_bodies = None
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            self._read_began += 1
            super().on_message_begin()
            self._arm_header_timer()

        def on_headers_complete(self) -> None:
            self._disarm_header_timer()
            lane = self.app_state.get(DIRECT_STATE)
            if lane is not None and self._direct_admit(lane):
                return
            self._headers_complete()

        def _headers_complete(self) -> None:
            super().on_headers_complete()
            cycle = self.cycle
            if cycle is not None:
                cycle.transport = transport = _HeadersWithBody(self.transport, cycle)
                own = cycle.on_response

                def on_response() -> None:  # (a response that ended without a body write)
                    transport.flush()
                    own()

                cycle.on_response = on_response
            if self.scope.get("method") not in ("POST", "PUT"):
                return
            self.scope[GONE] = gone = self.loop.create_future()
            self._gones = [(c, g) for c, g in self._gones or () if not c.response_complete]
            self._gones.append((self.cycle, gone))
            length = _declared_length(self.headers)
            if length is not None and ZERO_COPY_MIN_BYTES <= length <= max_body_bytes() \
                    and self.cycle is not None and self.cycle.scope is self.scope:
                self._zc_pending = length

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
            if self._direct is not None:  # (what came with the headers of a request served off the loop)
                self._direct.held.append(bytes(body))
                return
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


        # ------------------------------------------------------ served off the loop (DirectExchange)
        _direct = None  # the DirectExchange of the request being served off the loop

        def _direct_admit(self, lane) -> bool:
            """A request the lane serves off the loop: a POST with one declared Content-Length of a
            large body, nothing before it still unanswered on this connection, over plain HTTP/1.1,
            and that the lane's ``admit`` takes. Anything else goes the ordinary way."""
            parser = self.parser
            if self.scheme != "http" or parser.get_method() != b"POST" or parser.get_http_version() != "1.1" \
                    or self.pipeline or (self.cycle is not None and not self.cycle.response_complete) \
                    or self.root_path or self.expect_100_continue or parser.should_upgrade():
                return False
            if self.limit_concurrency is not None and (
                    len(self.connections) >= self.limit_concurrency or len(self.tasks) >= self.limit_concurrency):
                return False  # (uvicorn answers it 503)
            length = _declared_length(self.headers)
            if length is None or not 0 < length <= max_body_bytes():
                return False
            url = httptools.parse_url(self.url)
            if url.path != b"/tasks":
                return False
            handler = lane.admit(self.headers, url.query or b"")
            if handler is None:
                return False
            self._direct = DirectExchange(self, handler, length, parser.should_keep_alive())
            return True

        def _direct_hold(self, direct: DirectExchange):
            """The body's bytes reserved in the upload budget and a duplicate of the connection's
            socket for the answer: (reservation, socket), or None (no room, no socket)."""
            reservation = uploads.BUDGET.reservation()
            if reservation.take(direct.length):
                try:
                    return reservation, socket.socket(fileno=os.dup(self.transport.get_extra_info("socket").fileno()))
                except (OSError, AttributeError):
                    pass
            reservation.release()
            return None

        def _direct_to_app(self, direct: DirectExchange, held: list[bytes]) -> None:
            """The request goes the ordinary way after all, from its headers on, with the body
            bytes ``held`` so far."""
            self._direct = None
            direct.close()
            self._headers_complete()
            for chunk in held:
                self.on_body(chunk)

        def _direct_body_in(self, direct: DirectExchange) -> None:
            """Its handler has the whole body: its timers; and the end, if it has answered already."""
            direct.body_in = True
            direct.handler.armed(self.loop)
            if direct.rest is not None:
                self._direct_end(direct)

        def _direct_start(self) -> None:
            """Right after the request's first read: its body to a reading thread, or, when no
            thread or no room in the upload budget is free, the ordinary way."""
            direct = self._direct
            held, direct.held = direct.held, None
            have = sum(map(len, held))
            hold = self._direct_hold(direct)
            if hold is not None:
                reservation, sock = hold
                array = np.empty(direct.length, dtype=np.uint8)
                view = memoryview(array)
                view[:have] = b"".join(held)
                direct.array, direct.view, direct.reservation, direct.sock = array, view, reservation, sock
                loop = self.loop

                def done(pos: int, how: str) -> None:  # in the reading thread
                    if how == "complete":
                        direct.handler.body(view, direct)
                    try:
                        loop.call_soon_threadsafe(self._direct_read, direct, pos, how)
                    except RuntimeError:  # the loop has closed
                        pass

                self.flow.hold()
                deadline = direct.started_mono + direct.handler.upload_deadline_s
                direct.reading = body_reader.start(-1, view, have, done, sock=sock, deadline=deadline)
                if direct.reading is not None:
                    return
                self.flow.release()  # (no free thread: direct.close() gives the reservation and socket back)
            self._direct_to_app(direct, held)
            if self._zc_pending and self.parser is not None:
                self._zc_enter()

        def _direct_serve_whole(self) -> None:
            """A request whose body came whole with its headers: its handler has it now, here."""
            direct = self._direct
            held, direct.held = direct.held, None
            hold = self._direct_hold(direct)
            if hold is None:  # the ordinary way (which answers a full upload budget itself)
                self._direct_to_app(direct, held)
                super().on_message_complete()
                return
            view = memoryview(held[0] if len(held) == 1 else b"".join(held))
            direct.view, (direct.reservation, direct.sock) = view, hold
            direct.handler.body(view, direct)
            self._direct_body_in(direct)

        def _direct_read(self, direct: DirectExchange, pos: int, how: str) -> None:
            """(the loop) The reading thread is done with the body: complete (its handler has it),
            or the client closed, or it stalled (the loop reads the rest, as an ordinary request)."""
            direct.reading = None
            if direct is not self._direct:  # the connection was lost meanwhile
                if how == "complete":
                    direct.handler.gone()
                    if direct.rest is None:
                        return  # (closed once answered: _direct_responded)
                direct.close()
                return
            if how == "complete":
                self._fresh_parser()
                self.flow.release()  # reads again: a disconnect, or what the client sends next (held)
                self._direct_body_in(direct)
                return
            self._direct = None
            if how in ("eof", "error"):
                direct.close()
                self.transport.close()
                return
            # stalled: the app gets the request now and the loop reads the rest of its body, under
            # the body's deadline counted from its start
            self._headers_complete()
            self._zc_pending = 0
            cycle = self.cycle
            cycle.scope[uploads.UPLOAD_STARTED] = direct.started_mono
            self._zc_attach(cycle, direct.array, direct.view, pos, direct.reservation)
            direct.reservation = None  # (the cycle's now)
            direct.close()
            self.flow.release()

        def _direct_responded(self, direct: DirectExchange, rest: bytes) -> None:
            """(the loop) The handler has answered; ``rest``: what the socket did not take at once."""
            if direct is not self._direct:  # the connection was lost meanwhile
                if direct.reading is None:
                    direct.close()
                else:
                    direct.rest = rest  # (its reading thread's callback closes it)
                return
            direct.rest = rest
            if direct.body_in:
                self._direct_end(direct)

        def _direct_end(self, direct: DirectExchange) -> None:
            """The exchange is over: the connection goes on with what the client sent after it, or
            waits for its next request, or closes."""
            self._direct = None
            direct.handler.ended()
            if direct.rest:
                self.transport.write(direct.rest)
            pipelined, keep_alive = direct.pipelined, direct.keep_alive
            direct.close()
            self.server_state.total_requests += 1
            if not keep_alive or self.transport.is_closing():
                self.transport.close()
                return
            self.flow.resume_reading()
            if pipelined:  # (what the client sent once it had the answer, before the loop knew)
                self._feed(b"".join(pipelined))
            else:
                self.timeout_keep_alive_task = self.loop.call_later(
                    self.timeout_keep_alive, self.timeout_keep_alive_handler)

        def data_received(self, data: bytes) -> None:
            direct = self._direct
            if direct is not None and direct.held is None:  # sent while a request is served off the loop
                # (most often the client's next request, sent as soon as it had the answer, before the
                # loop has heard that it is out): kept for then, and nothing more is read meanwhile,
                # so that its body too is read by a thread, not here
                direct.pipelined.append(data)
                self.flow.pause_reading()
                return
            super().data_received(data)

        def on_message_complete(self) -> None:
            self._read_ended += 1
            direct = self._direct
            if direct is not None:
                if direct.held is None:
                    return  # (its body is read into its buffer, not by the parser)
                # All of it came with its headers. When it is all this read holds (the read began
                # with it, and nothing follows it that the parser would go on with), it is served
                # off the loop once the parser is done (_feed); otherwise the ordinary way.
                data = self._read
                if self._read_began == 1 and self._read_ended == 1 and data.find(b"\r\n\r\n") + 4 + direct.length \
                        == len(data) and not data.startswith(b"\r\n"):
                    direct.whole = True
                    return
                self._direct_to_app(direct, direct.held)
            super().on_message_complete()

        def shutdown(self) -> None:
            if self._direct is not None:  # the server stops: this answer is the connection's last
                self._direct.keep_alive = False
                return
            super().shutdown()


@functools.cache
def max_body_bytes() -> int:
    """REV88_MAX_BODY_BYTES (64 MiB if unset): a larger declared body never gets a buffer here."""
    try:
        return int(os.environ.get("REV88_MAX_BODY_BYTES") or 64 * 1024 * 1024)
    except ValueError:
        return 64 * 1024 * 1024


@functools.cache
def header_timeout_s() -> float:
    """REV88_HEADER_TIMEOUT_S (checked by app.settings when the app starts; 10 s if unset)."""
    try:
        value = float(os.environ.get("REV88_HEADER_TIMEOUT_S") or 10.0)
    except ValueError:
        value = 10.0
    return value if value > 0 else 10.0


if HttpToolsProtocol is not None:

    class BufferedHttpToolsProtocol(asyncio.BufferedProtocol):
        """What the transport sees: a buffered protocol (uvloop reads into ``get_buffer``'s memory
        only for a protocol that is not an ``asyncio.Protocol``, which uvicorn's is), forwarding
        every event to the ``ChunkedBodyHttpToolsProtocol`` it holds."""

        __slots__ = ("http", "get_buffer", "buffer_updated", "connection_lost", "eof_received",
                     "pause_writing", "resume_writing")

        def __init__(self, *args, **kwargs) -> None:
            http = self.http = ChunkedBodyHttpToolsProtocol(*args, **kwargs)
            self.get_buffer, self.buffer_updated = http.get_buffer, http.buffer_updated
            self.connection_lost, self.eof_received = http.connection_lost, http.eof_received
            self.pause_writing, self.resume_writing = http.pause_writing, http.resume_writing

        def connection_made(self, transport) -> None:
            self.http.connection_made(transport)


def protocol_class() -> type | None:
    """The protocol class for ``uvicorn.run(http=...)``, or None (no httptools, uvicorn < 0.42)."""
    return BufferedHttpToolsProtocol if HttpToolsProtocol is not None else None
