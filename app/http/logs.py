"""JSON logs, one object per line, carrying the request id of the request being served.

The lines are formatted and written by a thread of their own (``LineWriter``), not by the thread
that logs: on the event loop a line's JSON and its ``write`` to stderr cost about a fifth of a
request's time there (bench/bench_shell.py with REV88_LOG_LEVEL=warning, docs/performance.md).
The logging thread only makes the record, notes its request id and queues it. The writer takes
whatever lines are waiting and writes them in one ``write``; at exit (``logging.shutdown``, and
the service's own stop) every queued line is written first. A process killed with SIGKILL loses
the lines not yet written: those of its last millisecond or so.
"""

from __future__ import annotations

import contextvars
import datetime
import json
import logging
import queue
import sys
import threading

from ..threads import name_os_thread

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("rev88_request_id", default=None)

# LogRecord attributes that are not "extra" fields.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "color_message"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = getattr(record, "request_id", None) or request_id_var.get()
        if rid:
            doc["request_id"] = rid
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in doc:
                doc[key] = value
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)  # the lines' format ("key": value) is what operators grep


_HANDLER_MARK = "_rev88_json"


MAX_QUEUED = 100_000  # lines waiting for a stderr that does not keep up; more are dropped, and counted


class LineWriter(logging.Handler):
    """Queues each record; one daemon thread formats them and writes the lines to ``stream``.
    While ``MAX_QUEUED`` lines wait (a stderr that blocks: a full pipe nobody reads), further
    records are dropped rather than held without bound, and the next write says how many."""

    def __init__(self, stream) -> None:
        super().__init__()
        self.stream = stream
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.dropped = 0  # records not queued: the queue was full
        self._reported = 0
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        # what the line needs from the logging thread: its request id (a context variable) and a
        # copy of the extra dicts and lists, which their owner may change once the call returns
        if getattr(record, "request_id", None) is None:
            rid = request_id_var.get()
            if rid is not None:
                record.request_id = rid
        for key, value in vars(record).items():
            if key not in _STANDARD and isinstance(value, (dict, list)):
                setattr(record, key, type(value)(value))
        if self._thread is None:
            self._start()
        if self.queue.qsize() >= MAX_QUEUED:
            self.dropped += 1
            return
        self.queue.put(record)

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._write_lines, name="rev88-log", daemon=True)
                self._thread.start()

    def _write_lines(self) -> None:
        name_os_thread("rev88-log")
        while True:
            items = [self.queue.get()]
            while True:  # and whatever else is waiting: one write for all of them
                try:
                    items.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            lines = []
            if self.dropped != self._reported:
                lines.append(self._dropped_line())
            for item in items:
                if isinstance(item, threading.Event):
                    continue
                try:
                    lines.append(self.format(item) + "\n")
                except Exception:  # noqa: BLE001 - as logging itself: report it, keep writing
                    self.handleError(item)
            if lines:
                try:
                    self.stream.write("".join(lines))
                    self.stream.flush()
                except Exception:  # noqa: BLE001 - a closed stderr, say
                    pass
            for item in items:
                if isinstance(item, threading.Event):
                    item.set()  # a flush(): every line queued before it is written

    def _dropped_line(self) -> str:
        dropped, self._reported = self.dropped - self._reported, self.dropped
        record = logging.LogRecord("rev88.app.http.logs", logging.WARNING, __file__, 0,
                                   "log lines dropped: stderr did not keep up", None, None)
        record.dropped, record.max_queued = dropped, MAX_QUEUED
        return self.format(record) + "\n"

    def flush(self, timeout_s: float = 5.0) -> None:
        """Wait (at most ``timeout_s``) until every line queued so far is written."""
        thread = self._thread
        if thread is None or not thread.is_alive() or thread is threading.current_thread():
            return
        written = threading.Event()
        self.queue.put(written)
        written.wait(timeout_s)


def _json_handler() -> logging.Handler:
    global _WRITER
    if _WRITER is None or _WRITER.stream is not sys.stderr:
        _WRITER = LineWriter(sys.stderr)
        _WRITER.setFormatter(JsonFormatter())
        setattr(_WRITER, _HANDLER_MARK, True)
    return _WRITER


_WRITER: LineWriter | None = None  # one writer (one queue, so one order) for the service's and uvicorn's lines


def flush_logs() -> None:
    """Every log line queued so far written (the service's stop calls it)."""
    if _WRITER is not None:
        _WRITER.flush()


def configure_logging(level: str) -> None:
    """JSON lines on stderr for the service ("rev88.*") and for uvicorn's own messages.

    uvicorn's access log is switched off: the service logs every request itself, with
    its request id (app/http/middleware.py). Idempotent: one JSON handler per logger.
    """
    ours = logging.getLogger("rev88")
    ours.setLevel(level.upper())
    ours.propagate = False
    if not any(getattr(h, _HANDLER_MARK, False) for h in ours.handlers):
        ours.addHandler(_json_handler())
    server = logging.getLogger("uvicorn")  # "uvicorn.error" propagates here; its level stays uvicorn's
    if not any(getattr(h, _HANDLER_MARK, False) for h in server.handlers):
        server.handlers = [_json_handler()]
    server.propagate = False
    logging.getLogger("uvicorn.access").disabled = True
