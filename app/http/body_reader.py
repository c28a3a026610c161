"""A large request body read from its socket by a thread of its own, not by the event loop.

Copying a 6.5 MB body out of the kernel (``recv``) costs the thread that does it about a
millisecond of CPU, and the acknowledgements it sends back cost more (bench/bench_shell.py; on
loopback the kernel delivers them in the receiver's time). On the event loop that is time no
other request can use; in a thread it runs beside the loop, without the GIL (``recv_into``
releases it).

The protocol (app/http/protocol.py) hands a body over once its headers are parsed and its
buffer is reserved: the transport stops reading (``HeldFlow.hold``: uvicorn's own flow control
cannot resume it meanwhile), and a ``rev88-recv`` thread reads the body from a duplicate of the
connection's socket straight into the buffer, until the body is complete, the client closes,
or an ``IDLE_S`` window brings less than ``SLOW_BYTES``. Then the loop takes the connection back:
a body that stalls or trickles goes on on the loop's ordinary reads, under the app's deadline,
and holds no thread (a client cannot keep one by sending a byte now and then). At most
``THREADS`` bodies (one per core, 2 to 8) are read this way at a time; the rest are read
by the loop as before. The thread never reads past the body's declared length, so a request
pipelined behind it stays in the socket for the loop.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time

from uvicorn.protocols.http.flow_control import FlowControl

from ..threads import name_os_thread

THREADS = min(8, max(2, os.cpu_count() or 2))  # bodies read by threads at a time: one per core, 2 to 8
IDLE_S = 0.2  # a body that sends less than SLOW_BYTES in this long goes back to the loop
SLOW_BYTES = 64 * 1024
MIN_BYTES = 128 * 1024  # a smaller rest (after what came with the headers) the loop reads itself

_work: queue.SimpleQueue = queue.SimpleQueue()  # bodies for the reading threads (one put, one wake-up)
_threads: list[threading.Thread] = []
_busy = 0
_lock = threading.Lock()
# bodies handed to a thread, how their readings ended, and bodies left to the loop (every thread busy)
COUNTS = dict.fromkeys(("started", "complete", "idle", "eof", "stopped", "error", "all_busy"), 0)


class HeldFlow(FlowControl):
    """uvicorn's flow control, except that while a thread reads the connection (``held``) the
    transport stays paused, whatever uvicorn asks; on ``release`` it reads again unless uvicorn
    has paused it meanwhile."""

    held = False

    def pause_reading(self) -> None:
        if not self.read_paused:
            self.read_paused = True
            if not self.held:
                self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused:
            self.read_paused = False
            if not self.held:
                self._transport.resume_reading()

    def hold(self) -> None:
        self.held = True
        self._transport.pause_reading()

    def release(self) -> None:
        self.held = False
        if not self.read_paused and not self._transport.is_closing():
            self._transport.resume_reading()


class Reading:
    """One body being read by a thread: ``stop()`` asks it to end (the connection was lost). When
    it ends, the thread calls ``start``'s ``done(pos, how)`` with the bytes the buffer now holds
    and why: "complete", "idle", "eof", "stopped" or "error"."""

    __slots__ = ("stopped",)

    def __init__(self) -> None:
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True


def start(fd: int, view: memoryview, pos: int, done, sock: socket.socket | None = None,
          deadline: float | None = None) -> Reading | None:
    """Read ``view[pos:]`` from the socket ``fd`` in a thread, or None: every reading thread is busy
    (or the socket cannot be duplicated) and the loop keeps reading. ``sock``: a duplicate of
    ``fd`` the caller owns (and closes), read instead of one of its own; ``deadline``
    (time.monotonic): the reading ends, as "idle", once it has passed."""
    global _busy
    with _lock:
        if _busy >= THREADS:
            COUNTS["all_busy"] += 1
            return None
        owned = sock is None
        if owned:
            try:
                sock = socket.socket(fileno=socket.dup(fd))
            except OSError:
                return None
        _busy += 1
        COUNTS["started"] += 1
        while len(_threads) < _busy:  # a thread for every body being read (started once, kept)
            thread = threading.Thread(target=_serve, name=f"rev88-recv-{len(_threads)}", daemon=True)
            thread.start()
            _threads.append(thread)
    reading = Reading()
    _work.put((sock, owned, view, pos, deadline, reading, done))
    return reading


def _serve() -> None:
    name_os_thread("rev88-recv")
    while True:
        _read(*_work.get())


def _read(sock: socket.socket, owned: bool, view: memoryview, pos: int, deadline: float | None, reading: Reading,
          done) -> None:
    global _busy
    how = "complete"
    try:
        sock.settimeout(IDLE_S)  # the file is non-blocking already (the loop's): this only bounds each wait
        window_end, window_pos = time.monotonic() + IDLE_S, pos
        while pos < len(view):
            if reading.stopped:
                how = "stopped"
                break
            if deadline is not None and time.monotonic() >= deadline:
                how = "idle"
                break
            try:
                n = sock.recv_into(view[pos:])
            except TimeoutError:
                how = "idle"
                break
            if n == 0:
                how = "eof"
                break
            pos += n
            if time.monotonic() >= window_end:  # a window has passed: did it bring enough?
                if pos - window_pos < SLOW_BYTES:
                    how = "idle"
                    break
                window_end, window_pos = time.monotonic() + IDLE_S, pos
    except Exception:  # noqa: BLE001 - a reset connection, say: the loop finds out for itself
        how = "error"
    finally:
        if owned:
            sock.close()  # the duplicate only: the connection stays the loop's
        with _lock:
            _busy -= 1
            COUNTS[how] += 1
        done(pos, how)


def busy() -> int:
    """Bodies being read by threads now."""
    return _busy
