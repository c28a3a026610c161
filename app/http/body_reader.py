"""A large request body read from its socket by a thread of its own, not by the event loop.

Copying a draw-0 body out of the kernel (``recv``) costs the thread that does it CPU, and the
acknowledgements it sends back cost more: moved here, off the event loop, the process's total
unchanged (the A/B: docs/performance.md). A thread only reads: every answer still goes out
through the transport.

The protocol (app/http/protocol.py) hands a body over once the app has asked for it and its
buffer exists: the transport stops reading (``HeldFlow.hold``: uvicorn's own flow control
cannot resume it meanwhile), and a ``rev88-recv`` thread reads the body from a duplicate of the
connection's socket straight into the buffer, ``WINDOW`` bytes at most per read, each read's
bytes taken from the upload budget as they arrive, until the body is complete, the budget refuses
a read, the client closes, or an ``IDLE_S`` window brings less than ``SLOW_BYTES``. Then the loop
takes the connection back: a body that stalls or trickles goes on on the loop's ordinary reads,
under the app's deadline, and holds no thread (a client cannot keep one by sending a byte now and
then). At most ``THREADS`` bodies (one per core, 2 to 8) are read this way at a time; the rest
are read by the loop. The thread never reads past the body's declared length, so a request
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
WINDOW = 1 << 20  # bytes one read may bring (the most a read holds beyond what the budget took)

_work: queue.SimpleQueue = queue.SimpleQueue()  # bodies for the reading threads (one put, one wake-up)
_threads: list[threading.Thread] = []
_busy = 0
_lock = threading.Lock()
# bodies handed to a thread, how their readings ended, and bodies left to the loop (every thread busy)
COUNTS = dict.fromkeys(("started", "complete", "idle", "eof", "stopped", "refused", "error", "all_busy"), 0)


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

    def force_resume(self) -> None:
        """Read again, whatever was asked before (a lingering close reads only to throw away)."""
        self.held = self.read_paused = False
        if not self._transport.is_closing():
            self._transport.resume_reading()


class Reading:
    """One body being read by a thread: ``stop()`` asks it to end (the connection was lost, or the
    request answered). When it ends, the thread calls ``start``'s ``done(pos, how)`` with the bytes
    the buffer now holds and why: "complete", "idle", "eof", "stopped", "refused" (the upload
    budget could not take a read) or "error"."""

    __slots__ = ("stopped",)

    def __init__(self) -> None:
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True


def start(fd: int, view: memoryview, pos: int, reservation, done) -> Reading | None:
    """Read ``view[pos:]`` from the socket ``fd`` in a thread, each read's bytes taken by
    ``reservation`` (app/http/uploads.py), or None: every reading thread is busy (or the socket
    cannot be duplicated) and the loop keeps reading."""
    global _busy
    with _lock:
        if _busy >= THREADS:
            COUNTS["all_busy"] += 1
            return None
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
    _work.put((sock, view, pos, reservation, reading, done))
    return reading


def _serve() -> None:
    name_os_thread("rev88-recv")
    while True:
        _read(*_work.get())


def _read(sock: socket.socket, view: memoryview, pos: int, reservation, reading: Reading, done) -> None:
    global _busy
    how = "complete"
    try:
        sock.settimeout(IDLE_S)  # the file is non-blocking already (the loop's): this only bounds each wait
        window_end, window_pos = time.monotonic() + IDLE_S, pos
        while pos < len(view):
            if reading.stopped:
                how = "stopped"
                break
            try:
                n = sock.recv_into(view[pos : pos + WINDOW])
            except TimeoutError:
                how = "idle"
                break
            if n == 0:
                how = "eof"
                break
            pos += n
            if not reservation.take(n):
                how = "refused"
                break
            if time.monotonic() >= window_end:  # a window has passed: did it bring enough?
                if pos - window_pos < SLOW_BYTES:
                    how = "idle"
                    break
                window_end, window_pos = time.monotonic() + IDLE_S, pos
    except Exception:  # noqa: BLE001 - a reset connection, say: the loop finds out for itself
        how = "error"
    finally:
        sock.close()  # the duplicate only: the connection stays the loop's
        with _lock:
            _busy -= 1
            COUNTS[how] += 1
        done(pos, how)


def busy() -> int:
    """Bodies being read by threads now."""
    return _busy
