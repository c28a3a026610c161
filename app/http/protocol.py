"""uvicorn's httptools protocol, with what the service needs beside it. One path for every request:
each is an ASGI cycle of uvicorn's, and each answer goes out through the connection's transport,
in the order the requests came.

What it adds to uvicorn's own protocol (``HttpToolsProtocol``, which it subclasses):

- **A large body read into one buffer.** For an app that asks for it (its lifespan state holds a
  ``Policy`` under ``STATE``: app/main.py), a body declared by a Content-Length of at least
  ``ZERO_COPY_MIN_BYTES`` and at most the policy's ``max_body_bytes`` is read, once the app first
  asks for it, straight from the socket into one buffer of its declared size
  (``asyncio.BufferedProtocol``: the kernel's copy is the only one), bypassing the parser, and
  handed over whole, as a memoryview, in one ``http.request`` message. A large body's reads are
  made by a ``rev88-recv`` thread while the transport is paused (app/http/body_reader.py: less of
  the loop's CPU per upload, docs/performance.md); a body that stalls goes back to
  the loop's reads. Any other app gets bytes, as from uvicorn's own protocol.
- **Uploads reserve what has arrived**: each read's bytes are taken from the upload budget
  (``Policy.budget``, app/http/uploads.py) as they come, never the declared length; when it is
  full the app's ``receive`` raises ``QueueFull`` (a 503 naming REV88_UPLOAD_BUFFER_BYTES). A
  connection that declares 64 MiB and sends two bytes holds two bytes.
- **An answer given before its body was read closes the connection.** The response says
  ``connection: close``; once it is written the connection stops reading into any buffer, sends
  its FIN and reads what the client still sends only to throw it away, for at most ``LINGER_S``
  (so that the client reads the answer instead of a reset, as nginx's lingering close), then
  closes. Nothing is read on without a budget or a timer.
- **A bad request behind unanswered ones is answered after them**: uvicorn writes its 400 for an
  unparseable request at once, before the answers of requests pipelined ahead of it. A request
  whose own body does not parse (a bad chunk) while it waits behind others never runs: the 400 is
  its answer, as soon as the answers before it are out (it does not wait for a body that cannot come).
- **A header timeout**: a connection that has not finished a request's headers within
  ``Policy.header_timeout_s`` (REV88_HEADER_TIMEOUT_S) of connecting, or of the request's first
  byte, is closed. uvicorn waits for ever there (its keep-alive timer only runs between requests).
  The body's own deadline is the app's (app/http/uploads.py, 408).
- **A POST's or PUT's disconnect as a future**: the scope carries ``GONE``, completed when the
  client disconnects before the response is complete, which the app waits on beside its task
  (uvicorn reports a disconnect only through ``receive``).
- **A response's headers go out with its first body bytes** (one send) when it declares its
  length (``_HeadersWithBody``).
- **An Upgrade is ignored** (RFC 9110 §7.8: a server may ignore one it does not take; this one
  takes none, neither WebSocket nor h2c): the request is served as HTTP/1.1, its body framed by
  its own Content-Length or Transfer-Encoding, and the connection goes on as any other. The
  parser (llhttp) skips the body of a request it takes for an upgrade and stops after its headers
  (``HttpParserUpgrade``); uvicorn then drops what follows, so the app ran on an empty body. Here a
  parser of its own reads on from there (``_upgrade_ignored``).

It touches uvicorn's internals (the cycle's ``body``, ``more_body``, ``message_event``,
``receive``/``send``, ``keep_alive``, the connection's parser and flow control), so it runs only
on the uvicorn releases it was tested on (app/http/versions.py; pyproject.toml pins the same range)
and ``problem()`` says why it cannot load otherwise: ``refusal()``, the release gate that
``create_app`` and ``rev88 serve`` both ask, then refuses to start unless told to run uvicorn's
own protocol (REV88_STOCK_HTTP, ``--stock-http``). Its tests: tests/test_http_protocol.py
(the bodies byte for byte against uvicorn's own protocol), tests/test_http_hostile.py (raw byte
streams against it and against uvicorn's own, compared), tests/test_body_reader.py,
tests/test_http_upgrade.py (requests that offer an Upgrade).
"""

from __future__ import annotations

import asyncio
import dataclasses
import weakref

import numpy as np

from . import body_reader, uploads, versions

READ_AHEAD_BYTES = 256 * 1024  # body bytes a connection holds for the app before it stops reading
ZERO_COPY_MIN_BYTES = 256 * 1024  # a declared body at least this large is read into one buffer
LINGER_S = 5.0  # after an answer given before its body was read: what the client still sends is
# read and thrown away for at most this long, then the connection is closed
STATE = "rev88.protocol"  # lifespan state: the app's Policy
# scope key: a future of the loop's, done when the request's client disconnects before its
# response is complete (POST and PUT requests; what app/api/intake.py waits on beside the task)
GONE = "rev88.gone"
BODY = uploads.BODY  # scope key: the request's ZeroCopyBody, while it holds a buffer
# One event loop per process: reads never interleave. 64 KiB: a large body's first read (with its
# headers) is the loop's, the rest its reading thread's
_SCRATCH = memoryview(bytearray(64 * 1024))


@dataclasses.dataclass(frozen=True)
class Policy:
    """What the app tells the protocol (its lifespan state, under ``STATE``)."""

    max_body_bytes: int  # a larger declared body never gets a buffer (the app answers it 413)
    budget: uploads.UploadBudget  # the bytes the bodies being received may hold together
    header_timeout_s: float = 10.0


DEFAULT_HEADER_TIMEOUT_S = Policy.header_timeout_s  # for an app that gives no policy


_PROBLEM = None
try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError as exc:  # uvicorn without httptools (pyproject.toml asks for both)
    HttpToolsProtocol = None
    _PROBLEM = f"uvicorn's httptools protocol does not import ({exc}); install httptools (pyproject.toml's range)"
else:
    if versions.untested(("uvicorn",)):
        HttpToolsProtocol = None
        _PROBLEM = versions.untested(("uvicorn",))[0]


def problem() -> str | None:
    """Why this protocol cannot run here, or None."""
    return _PROBLEM


def refusal(stock_http: bool) -> str | None:
    """The release gate, the one both ``create_app`` and ``rev88 serve`` ask: why the service
    refuses to start, or None. It refuses when this protocol cannot run here (``problem()``)
    unless told to run uvicorn's own (``stock_http``: REV88_STOCK_HTTP, ``rev88 serve --stock-http``)."""
    if stock_http or _PROBLEM is None:
        return None
    return (f"{_PROBLEM}. Install the pinned release (pip install -e . or the image), or set REV88_STOCK_HTTP=1 "
            "(rev88 serve --stock-http) to run uvicorn's own HTTP protocol, without what this one adds")


class ZeroCopyBody:
    """A body being read straight into its buffer: ``data`` (a memoryview of all of it), ``pos``
    (the bytes in so far), the upload budget's ``reservation`` that holds them until the request's
    response is complete, and ``refused`` (the budget could not take a read: the app gets
    ``QueueFull``)."""

    __slots__ = ("data", "pos", "reservation", "refused", "__weakref__")

    def __init__(self, data: memoryview, reservation: uploads.Reservation) -> None:
        self.data, self.reservation, self.pos, self.refused = data, reservation, 0, False


class _HeadersWithBody:
    """The cycle's transport, but that a response's status line and headers (uvicorn writes them
    as soon as the app starts its response) wait for its first body bytes and go out with them:
    one ``send`` and one segment instead of two, for a response that declares its length. They go
    out on their own as soon as anything else happens instead: the response ends without a
    body write (HEAD, an empty body), the connection closes. A chunked response, whose body may
    come much later, and the ``100 Continue`` line before a response are written at once.
    ``close`` (uvicorn's, once a response that does not keep the connection alive is complete)
    is the protocol's: a lingering close when the request's body was not all read."""

    __slots__ = ("_transport", "_cycle", "_held", "_done", "_protocol")

    def __init__(self, transport, cycle, protocol=None) -> None:
        # (the cycle holds this object: weak references back, so that the objects form no reference
        # cycle and a request is freed when it ends, tests/test_memory_soak.py)
        self._transport, self._cycle, self._held, self._done = transport, weakref.ref(cycle), None, False
        self._protocol = weakref.ref(protocol) if protocol is not None else None

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
        protocol = self._protocol() if self._protocol is not None else None
        if protocol is not None:
            protocol.close_after_answer(self._cycle())
        else:
            self._transport.close()

    def __getattr__(self, name):
        return getattr(self._transport, name)


def _body_framing(headers: list[tuple[bytes, bytes]]) -> tuple[int | None, bool]:
    """(the one declared Content-Length or None, whether the request carries a body at all)."""
    lengths = [value for name, value in headers if name == b"content-length"]
    chunked = any(name == b"transfer-encoding" for name, _ in headers)
    length = None
    if len(lengths) == 1 and not chunked:
        try:
            length = int(lengths[0])
        except ValueError:
            length = None
    return length, chunked or any(value.strip() != b"0" for value in lengths)


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


def _answering_send(protocol, cycle, has_body: bool):
    """The cycle's ``send``: a response started before the request's body is all in does not keep
    the connection alive (uvicorn then writes ``connection: close``, and closes once it is out:
    ``close_after_answer``); once the response is complete, a buffer's reservation is given back
    and the closures are unlinked from the cycle."""
    own = cycle.send
    ref = weakref.ref(protocol)

    async def send(message) -> None:
        if has_body and not cycle.response_started and cycle.more_body:
            cycle.keep_alive = False  # answered before its body was read
            conn = ref()
            if conn is not None:
                conn.answering_early(cycle)
        try:
            await own(message)
        finally:
            if cycle.response_complete or cycle.disconnected:
                body = cycle.scope.pop(BODY, None)
                if body is not None:
                    body.reservation.release()
                # the cycle holds these closures and they hold the cycle (and a body's buffer):
                # unlinked here, the request is freed when it ends, not at the cyclic GC's next full
                # pass (bench/bench_soak.py; tests/test_memory_soak.py)
                vars(cycle).pop("receive", None)
                vars(cycle).pop("send", None)

    return send


def _zero_copy_receive(protocol, cycle, length: int):
    """The cycle's ``receive`` for a body that may be read into one buffer: at the first call the
    rest of the body goes into its buffer (``enter_zero_copy``) and one message brings all of it;
    a body that came whole with its headers comes as bytes; then uvicorn's own receive (which
    reports the disconnect)."""
    own = cycle.receive
    ref = weakref.ref(protocol)
    delivered = False

    async def receive():
        nonlocal delivered
        if delivered:
            return await own()
        delivered = True
        conn = ref()
        body = conn.enter_zero_copy(cycle, length) if conn is not None else None
        if body is None:
            return await own()  # it came whole already, or the connection is gone
        if cycle.waiting_for_100_continue and not cycle.transport.is_closing():  # as uvicorn's receive
            cycle.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            cycle.waiting_for_100_continue = False
        while cycle.more_body and not body.refused and not cycle.disconnected and not cycle.response_complete:
            cycle.flow.resume_reading()
            await cycle.message_event.wait()
            cycle.message_event.clear()
        if cycle.disconnected or cycle.response_complete:
            return {"type": "http.disconnect"}
        if body.refused:
            raise uploads.budget_full(body.reservation.budget)
        return {"type": "http.request", "body": body.data, "more_body": False}

    return receive


def _framing_head(headers: list[tuple[bytes, bytes]], http_version: str) -> bytes:
    """A request head that frames a body as ``headers`` do: their Content-Length and Transfer-Encoding
    headers, as sent (what llhttp refuses in them, it refuses here too: a 400)."""
    lines = [b"POST / HTTP/" + http_version.encode("ascii")]
    lines += [name + b": " + value for name, value in headers if name in (b"content-length", b"transfer-encoding")]
    return b"\r\n".join(lines) + b"\r\n\r\n"


class _AfterIgnoredUpgrade:
    """The callbacks of the parser that reads on after an ignored Upgrade, for a request with a body
    (``_upgrade_ignored``): first a head that frames that body (``_framing_head``), whose callbacks
    end here (the request is the protocol's already); then the body and every request after it,
    whose callbacks are the protocol's."""

    __slots__ = ("_protocol", "_head")

    def __init__(self, protocol) -> None:
        self._protocol, self._head = protocol, True

    def on_message_begin(self) -> None:
        if not self._head:
            self._protocol.on_message_begin()

    def on_url(self, url: bytes) -> None:
        if not self._head:
            self._protocol.on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._head:
            self._protocol.on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._head:
            self._head = False
            return
        self._protocol.on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._protocol.on_body(body)

    def on_message_complete(self) -> None:
        self._protocol.on_message_complete()


if HttpToolsProtocol is not None:
    import httptools

    class ChunkedBodyHttpToolsProtocol(HttpToolsProtocol, asyncio.BufferedProtocol):
        """The HTTP side; the transport's protocol is ``BufferedHttpToolsProtocol``, which holds one
        (``--http app.http.protocol:BufferedHttpToolsProtocol`` for uvicorn's own CLI)."""

        _policy: Policy | None = None
        _header_timer = None
        _zc: ZeroCopyBody | None = None  # the body being read into its buffer now
        _zc_cycle = None  # its cycle
        _zc_reading = None  # the thread reading it (app/http/body_reader.py), or None: the loop
        _bodies = None  # weak references to the ZeroCopyBody of each request of this connection
        _gones = None  # (cycle, its GONE future) of the connection's POST/PUT requests
        _lingering = None  # the timer that ends a lingering close (the connection only discards now)
        _refusal: str | None = None  # a 400's message, waiting for the answers before it
        _upgrade_body = False  # the request whose Upgrade is ignored has a body: _upgrade_ignored frames it

        # ---------------------------------------------------------------- reading
        def get_buffer(self, sizehint: int) -> memoryview:
            zc = self._zc
            if zc is not None:
                return zc.data[zc.pos : zc.pos + body_reader.WINDOW]
            return _SCRATCH

        def buffer_updated(self, nbytes: int) -> None:
            zc = self._zc
            if zc is not None:
                self._zc_read(zc, nbytes)
                return
            if self._lingering is not None or self._refusal is not None:
                return  # thrown away: an answered request's unread body, or what follows a bad request
            self._feed(bytes(_SCRATCH[:nbytes]))

        def _feed(self, data: bytes) -> None:
            self.data_received(data)

        def data_received(self, data: bytes) -> None:
            # uvicorn's, but for an Upgrade: ignored (_upgrade_ignored), where uvicorn's drops what
            # follows the request's headers
            self._unset_keepalive_if_required()
            while True:
                try:
                    self.parser.feed_data(data)
                    return
                except httptools.HttpParserUpgrade as exc:
                    rest = data[exc.args[0]:]  # (where the request's headers ended in ``data``)
                    try:
                        self._upgrade_ignored()
                    except httptools.HttpParserError as refused:  # a body that cannot be framed
                        self._invalid(refused)
                        return
                    if not rest:
                        return
                    data = rest
                except httptools.HttpParserError as exc:
                    self._invalid(exc)
                    return

        def _invalid(self, exc: Exception) -> None:
            """uvicorn's 400 for bytes that do not parse, naming what the parser found wrong
            (llhttp's reason: "Invalid character in chunk size", ...)."""
            reason = "" if isinstance(exc, httptools.HttpParserCallbackError) else str(exc)
            named = reason and reason.isascii() and reason.isprintable() and len(reason) <= 200
            msg = f"Invalid HTTP request received: {reason}." if named else "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)

        def _should_upgrade(self) -> bool:
            return False  # (uvicorn's: whether to hand the connection to its WebSocket protocol) never

        def _upgrade_ignored(self) -> None:
            """The parser stopped after the headers of a request it takes for an upgrade
            (``Connection: upgrade`` with an ``Upgrade``, or CONNECT), having skipped its body: the
            service takes no upgrade, so the request is served as HTTP/1.1 (its cycle runs as any
            other, and nothing answers 101). A fresh parser reads on: the request's body, framed by
            its own Content-Length or Transfer-Encoding (a head of those headers is parsed first,
            ``_AfterIgnoredUpgrade``), then the requests after it. Raises the parser's error for a
            body that cannot be framed (a 400)."""
            version = self.parser.get_http_version()
            if not self._upgrade_body:
                self._fresh_parser()  # no body: the next request follows the headers
                return
            self._upgrade_body = False
            self.parser = httptools.HttpRequestParser(_AfterIgnoredUpgrade(self))
            try:
                self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
            except AttributeError:  # httptools < 0.6.3
                pass
            self.parser.feed_data(_framing_head(self.headers, version))

        def _zc_read(self, zc: ZeroCopyBody, nbytes: int) -> None:
            """(the loop) ``nbytes`` more of the body are in its buffer."""
            zc.pos += nbytes
            if not zc.reservation.take(nbytes):
                self._zc_refused(zc)
            elif zc.pos >= len(zc.data):
                self._zc_complete()

        def enter_zero_copy(self, cycle, length: int) -> ZeroCopyBody | None:
            """(the app's first ``receive``) The rest of the cycle's body goes into a buffer of
            its own, or None: it is all in already (the parser has it), or the cycle is not the
            connection's current one (it is gone)."""
            if not cycle.more_body or cycle.disconnected or self.cycle is not cycle or self._zc is not None \
                    or self._lingering is not None or self.parser is None:
                return None
            policy = self._policy
            reservation = policy.budget.reservation()
            body = ZeroCopyBody(memoryview(np.empty(length, dtype=np.uint8)), reservation)  # (no zero-filling)
            cycle.scope[BODY] = body  # (the app's read_body: reserved already; what a 408 says arrived)
            self._bodies = [b for b in self._bodies or () if b() is not None and b().reservation.bytes]
            self._bodies.append(weakref.ref(body))
            have = 0
            for part in getattr(cycle.body, "parts", None) or (cycle.body,):  # (a _Chunks, or uvicorn's bytearray)
                body.data[have : have + len(part)] = part
                have += len(part)
            cycle.body = bytearray()
            body.pos = have
            if not reservation.take(have):
                body.refused = True
                self.flow.pause_reading()
                return body
            self._zc, self._zc_cycle = body, cycle
            if length - have >= body_reader.MIN_BYTES and self.scheme == "http":  # (TLS: the loop's reads only)
                self._zc_offload(body)
            return body

        def _zc_offload(self, body: ZeroCopyBody) -> None:
            sock = self.transport.get_extra_info("socket")
            if sock is None:
                return
            loop = self.loop

            def done(pos: int, how: str) -> None:  # in the reading thread
                try:
                    loop.call_soon_threadsafe(self._zc_read_done, body, pos, how)
                except RuntimeError:  # the loop has closed
                    pass

            self.flow.hold()
            self._zc_reading = body_reader.start(sock.fileno(), body.data, body.pos, body.reservation, done)
            if self._zc_reading is None:
                self.flow.release()

        def _zc_read_done(self, body: ZeroCopyBody, pos: int, how: str) -> None:
            """(the loop) The reading thread is done: the body is complete, or the budget refused a
            read, or it stalled or the client closed (the loop reads on and finds out)."""
            self._zc_reading = None
            body.pos = pos
            if self._zc is body:  # (else the connection was lost, or it answered, meanwhile)
                if how == "refused":
                    self._zc_refused(body)
                elif pos >= len(body.data):
                    self._zc_complete()
            if self._lingering is not None:
                self.flow.force_resume()  # what the client still sends is read and thrown away
            else:
                self.flow.release()  # the loop reads the connection again: the rest of a stalled body, or what follows

        def _zc_refused(self, body: ZeroCopyBody) -> None:
            """The upload budget could not take the body's latest read: nothing more is read into its
            buffer, and its request is refused (503; the connection closes once that is out)."""
            body.refused = True
            cycle = self._zc_cycle
            self._zc = self._zc_cycle = None
            self.flow.pause_reading()
            if cycle is not None:
                cycle.message_event.set()

        def _zc_complete(self) -> None:
            cycle = self._zc_cycle
            self._zc = self._zc_cycle = None
            self._fresh_parser()
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

        # ---------------------------------------------------------------- answering
        def answering_early(self, cycle) -> None:
            """``cycle`` starts its response before its body is all in: nothing more is read into
            a buffer for it (the connection closes once the response is out)."""
            if self._zc_cycle is cycle:
                if self._zc_reading is not None:
                    self._zc_reading.stop()
                self._zc = self._zc_cycle = None
                self.flow.pause_reading()

        def close_after_answer(self, cycle) -> None:
            """uvicorn closes the connection after a response that does not keep it alive. If the
            request's body was not all read, a lingering close instead: the FIN after the answer,
            and what the client still sends read and thrown away for at most ``LINGER_S``."""
            transport = self.transport
            if transport.is_closing():
                return
            if cycle is None or not cycle.more_body or self._lingering is not None:
                transport.close()
                return
            try:
                transport.write_eof()  # once the answer is written
            except (NotImplementedError, AttributeError, RuntimeError, OSError):  # (TLS cannot half-close)
                transport.close()
                return
            self._disarm_header_timer()
            self._unset_keepalive_if_required()
            self._lingering = self.loop.call_later(LINGER_S, self._linger_end)
            if self._zc_reading is None:  # (else once its thread is done: _zc_read_done)
                self.flow.force_resume()

        def _linger_end(self) -> None:
            self._lingering = None
            if not self.transport.is_closing():
                self.transport.close()

        def send_400_response(self, msg: str) -> None:
            cycle = self.cycle
            unanswered = cycle is not None and not cycle.response_complete and not cycle.disconnected
            own_body = unanswered and cycle.more_body and not cycle.response_started  # (the error is in its body)
            if own_body:
                queued = [entry for entry in self.pipeline if entry[0] is cycle]
                if queued:  # its body is bad before it ran: it never runs, the 400 is its answer
                    self.pipeline.remove(queued[0])
                    self._refusal = msg  # once the requests before it are answered (they are not yet)
                    return
            if self.pipeline or (unanswered and not own_body):
                # answers go out in order: this one once the requests before it are answered
                # (then the connection closes, as after uvicorn's own 400)
                self._refusal = msg
                return
            super().send_400_response(msg)

        def on_response_complete(self) -> None:
            if self._lingering is not None:
                self.server_state.total_requests += 1
                return
            if self._refusal is not None and not self.pipeline:
                self.server_state.total_requests += 1
                msg, self._refusal = self._refusal, None
                if not self.transport.is_closing():
                    super().send_400_response(msg)
                return
            super().on_response_complete()

        # ---------------------------------------------------------------- the connection
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._policy = self.app_state.get(STATE)
            self.flow = body_reader.HeldFlow(transport)  # uvicorn's, but it cannot resume a connection a thread reads
            self._arm_header_timer()

        def connection_lost(self, exc) -> None:
            for cycle, gone in self._gones or ():  # every request of the connection not yet answered
                if not cycle.response_complete and not gone.done():
                    gone.set_result(None)
            self._gones = None
            self._disarm_header_timer()
            if self._lingering is not None:
                self._lingering.cancel()
                self._lingering = None
            if self._zc_reading is not None:
                self._zc_reading.stop()  # (the thread gives its socket back; the buffer is the body's)
            self._zc = self._zc_cycle = None
            for ref in self._bodies or ():  # requests of this connection still holding a body
                body = ref()
                if body is not None:
                    body.reservation.release()
            self._bodies = None
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm_header_timer()

        def on_message_complete(self) -> None:
            if self.parser.should_upgrade() and _body_framing(self.headers)[1]:
                # the parser takes it for an upgrade and skipped its body: not complete, its body
                # follows (_upgrade_ignored)
                self._upgrade_body = True
                return
            super().on_message_complete()

        def on_headers_complete(self) -> None:
            self._disarm_header_timer()
            super().on_headers_complete()
            cycle = self.cycle
            if cycle is None or cycle.scope is not self.scope:  # (never: an Upgrade is ignored, every request is ours)
                return
            cycle.transport = transport = _HeadersWithBody(self.transport, cycle, self)
            own = cycle.on_response

            def on_response() -> None:  # (a response that ended without a body write)
                transport.flush()
                own()

            cycle.on_response = on_response
            length, has_body = _body_framing(self.headers)
            if self.scope.get("method") in ("POST", "PUT"):
                self.scope[GONE] = gone = self.loop.create_future()
                self._gones = [(c, g) for c, g in self._gones or () if not c.response_complete]
                self._gones.append((cycle, gone))
            if has_body:
                cycle.send = _answering_send(self, cycle, has_body)
                policy = self._policy
                if policy is not None and length is not None and ZERO_COPY_MIN_BYTES <= length <= policy.max_body_bytes:
                    cycle.receive = _zero_copy_receive(self, cycle, length)
                    # nothing more is read until the app asks for the body: then into its buffer
                    # (what came with the headers goes through the parser, and is copied over)
                    self.flow.pause_reading()

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            timeout = self._policy.header_timeout_s if self._policy is not None else DEFAULT_HEADER_TIMEOUT_S
            self._header_timer = self.loop.call_later(timeout, self._headers_too_slow)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete and not cycle.disconnected:
                self._arm_header_timer()  # a request before it is still being answered: its time counts from then
                return
            if not self.transport.is_closing():
                self.transport.close()

        def on_body(self, body: bytes) -> None:
            cycle = self.cycle
            if cycle.response_complete:
                return
            if type(cycle.body) is not _Chunks:  # a new cycle, or uvicorn's receive() reset it
                held, cycle.body = cycle.body, _Chunks()
                if held:
                    cycle.body += bytes(held)
            cycle.body += bytes(body)  # bytes already (httptools copies each chunk out): no copy
            if len(cycle.body) > READ_AHEAD_BYTES:
                self.flow.pause_reading()
            cycle.message_event.set()

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
    """The protocol class for ``uvicorn.run(http=...)``, or None (``problem()`` says why)."""
    return BufferedHttpToolsProtocol if HttpToolsProtocol is not None else None
