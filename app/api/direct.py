"""A synchronous POST /tasks served off the event loop, from its headers to its answer.

Through the app, such a request costs its event loop about 0.7 ms of CPU for a small body and 2 ms
for a 6.5 MB one (bench/bench_shell.py, docs/performance.md): the ASGI steps in and out (the
cycle, its task, the request middleware, the intake's gates, the wait, the response's messages)
and, for a large body, two more hand-overs, all Python on the one loop that every request of the
process shares. Here the loop only parses the request's headers and asks ``DirectLane.admit``
whether to serve it this way. The connection (app/http/protocol.py, ``DirectExchange``) then has
a ``rev88-recv`` thread read a large body, which queues the task (``DirectTask.body``); a body that
came whole with its headers is queued by the loop at once. The device worker that ends the job
answers it (``DirectTask._concluded``) and writes the answer to the socket itself. The loop's part
after the headers: two callbacks (the body is in: its timer and the disconnect watch; the answer
is out: the connection's next request).

What the lane takes: a synchronous task (no ``Prefer: respond-async``, no ``Idempotency-Key``,
no ``measure``, a JSON answer) in a raw npz body (``application/octet-stream`` or
``application/x-npz``, not multipart) declared by a Content-Length up to REV88_MAX_BODY_BYTES,
on a backend that does not batch, with the API key when one is set, and only while the service
takes tasks and its queue has room. Everything else, and every request whose check fails (a bad
option, no room: the app answers it, with its own error), goes through the app as before; so does
a request that shares its read with another (pipelined). REV88_DIRECT_TASKS=0 sends every request
through the app.

The answer is the app's (``tests/test_direct_lane.py`` compares the two): the same task runner
makes it (``Accepted``, its job's ``Answered``, ``TaskRunner.answered`` and its record's group
commit, ``refused`` and ``failed`` with ``failure_write``), with the same headers but their order,
the same access-log line (with ``"lane": "direct"``) and request metric. A large body that stalls
(less than 64 KiB in 0.2 s) is handed to the app mid-way and read by the loop under its deadline
counted from its start; a client that disconnects stops its task, as through the app; the task
timeout is the same.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl

from starlette.datastructures import Headers

from ..errors import NotAccepted, error_answer, outcome_of
from ..http import uploads
from ..http.logs import request_id_var
from ..http.middleware import authorized, request_id_from
from ..runtime.executor import STOP_WAIT_S
from ..tasks.answers import Settled
from ..tasks.options import parse_options, wants_npz
from ..tasks.runner import Accepted, new_task_id
from .hot_path import telemetry_enabled
from .intake import gate, late_task, wants_async

if TYPE_CHECKING:
    from ..service import Service

log = logging.getLogger("rev88.app.http.middleware")  # the access log's logger: the same lines as the app's

PATH = "/tasks"
# requests this lane took, and those it answered (the rest: handed to the app mid-body, or their
# client left before the body was in)
COUNTS = dict.fromkeys(("admitted", "answered"), 0)
_LOOKED_AT = frozenset((b"idempotency-key", b"transfer-encoding", b"expect", b"prefer", b"accept"))


class DirectLane:
    """``admit`` (on the event loop, for a large POST /tasks's headers): a ``DirectTask`` that
    serves it, or None for the app."""

    def __init__(self, app) -> None:
        self.app = app
        self.service: Service = app.state.service
        # (created once the service has started: FastAPI's telemetry is configured by then, and
        # looking it up costs more than the rest of ``admit``)
        settings = self.service.settings
        self.on = settings.direct_tasks and self.service.runner.batch_max <= 1 and not telemetry_enabled(app)

    def admit(self, raw_headers: list[tuple[bytes, bytes]], query: bytes) -> DirectTask | None:
        service = self.service
        if not self.on:
            return None
        seen = {name: value for name, value in raw_headers if name in _LOOKED_AT}  # (one pass, no decoding)
        if b"idempotency-key" in seen or b"transfer-encoding" in seen or b"expect" in seen:
            return None
        headers = Headers(raw=raw_headers)
        if uploads.media_type(headers.get("content-type")) not in uploads.RAW_TYPES \
                or (b"prefer" in seen and wants_async(headers.get("prefer"))) \
                or (b"accept" in seen and wants_npz(headers.get("accept"))):
            return None
        api_key = service.settings.api_key
        if api_key is not None and not authorized(headers, api_key):
            return None
        options = config = None
        try:
            gate(service)
            if query:  # (checked before the body is read, as the app does; no query: the defaults, later)
                options = parse_options(parse_qsl(query.decode("latin-1"), keep_blank_values=True), service.backend)
                config = options.config(None)
        except Exception:  # noqa: BLE001 - the app answers it, with its own error
            return None
        if (options is not None and options.measure is not None) or service.executor.full():
            return None
        COUNTS["admitted"] += 1
        return DirectTask(service, headers, options, config)


class DirectTask:
    """One request served off the loop (see app/http/protocol.py's ``DirectExchange`` for when
    each method is called, and on which thread)."""

    def __init__(self, service: Service, headers: Headers, options, config) -> None:
        self.service, self.headers, self.options, self.config = service, headers, options, config
        self.t0 = time.perf_counter()
        settings = service.settings
        self.upload_deadline_s = uploads.upload_deadline_s(int(headers["content-length"]), settings.upload_timeout_s,
                                                           settings.upload_min_rate)
        self.request_id: str | None = None
        self.acc: Accepted | None = None
        self.exchange = None
        self.timer = None
        self.answered = False

    # ------------------------------------------------------------ the reading thread
    def body(self, view: memoryview, exchange) -> None:
        """The body is complete: the task is queued (its own job parses it, on the device worker)."""
        self.exchange = exchange
        self.request_id = rid = request_id_from(self.headers)
        service = self.service
        t_parse = time.perf_counter()
        try:
            gate(service)  # a drain may have begun while the body streamed in
            if self.options is None:  # (no query: the defaults)
                self.options = parse_options([], service.backend)
                self.config = self.options.config(None)
            settings = service.settings
            acc = Accepted(
                task_id=new_task_id(), task=None, config=self.config, backend=self.options.backend,
                include_scores=self.options.include_scores, mode="sync", request_id=rid, t0=self.t0,
                receive_s=t_parse - self.t0, body_bytes=len(view), deferred=True,
                late=functools.partial(late_task, view, self.config, settings.max_task_work,
                                       settings.max_task_bytes, service.io_pool),
            )
            service.runner.queue(acc)
        except Exception as exc:  # noqa: BLE001 - not accepted after all (draining, the queue filled up)
            service.metrics.outcome(outcome_of(exc))
            status, doc, headers = error_answer(exc, rid)
            self._answer(Settled(status, doc, headers=headers))
            return
        self.acc = acc
        acc.job.future.add_done_callback(self._concluded)

    # ------------------------------------------------------------ the loop
    def armed(self, loop) -> None:
        """The body is in: the task's timeout, as the app's wait has it."""
        if self.acc is not None and not self.answered:
            self.timer = loop.call_later(self.service.runner.timeout_for(self.acc), self._expire, loop)

    def _expire(self, loop) -> None:
        acc = self.acc
        if acc is None or acc.job is None or acc.job.future.done():
            return
        timeout = self.service.runner.timeout_for(acc)
        self.service.executor.expire(acc.job, timeout)
        self.timer = loop.call_later(STOP_WAIT_S, self._give_up, timeout)

    def _give_up(self, timeout: float) -> None:
        acc = self.acc
        if acc is not None and acc.job is not None and not acc.job.future.done():
            self.service.executor.give_up(acc.job, timeout)

    def gone(self) -> None:
        """The client disconnected before its answer: its task stops (answered to nobody, recorded)."""
        acc = self.acc
        if acc is not None and acc.job is not None and not acc.job.future.done():
            self.service.executor.withdraw(acc.job, "disconnect", "its client disconnected")

    def ended(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = self.exchange = None

    # ------------------------------------------------------------ the thread that ends the job
    def _concluded(self, future) -> None:
        """The job has ended (on its device worker, or wherever its future was completed)."""
        acc, runner = self.acc, self.service.runner
        recording = False
        try:
            exc = future.exception()
            if exc is None:
                value = future.result()
                self._answer(runner.answered(acc, Settled(200, value.body, outcome=value.outcome,
                                                          content=value.content)))
            elif isinstance(exc, NotAccepted):
                self._answer(runner.refused(acc, exc))
            else:
                settled = runner.failed(acc, exc)
                write = None
                try:
                    write = runner.failure_write(acc, exc, settled)
                except Exception as exc2:  # noqa: BLE001
                    log.error("could not record the failure in the ledger",
                              extra={"task_id": acc.task_id, "error": str(exc2)})
                if write is None:
                    self._answer(settled)
                else:  # answered once its record is in (on the ledger writer's thread), and
                    recording = True  # it stays in ``pending`` until then: no moment finds it nowhere
                    write.add_done_callback(lambda w: self._recorded(w, acc, settled))
        finally:
            if acc.finished is None and not recording:  # (else its group commit takes it out)
                runner.pending.pop(acc.task_id, None)
            acc.job = None  # (the job's closures hold acc: no reference cycle)

    def _recorded(self, write, acc: Accepted, settled: Settled) -> None:
        if write.exception() is not None:
            log.error("could not record the failure in the ledger",
                      extra={"task_id": acc.task_id, "error": str(write.exception())})
        self.service.runner.pending.pop(acc.task_id, None)
        self._answer(settled)

    def _answer(self, settled: Settled) -> None:
        """Send the answer, then its access-log line and request metric (as the app's request
        middleware writes them)."""
        self.answered = True
        COUNTS["answered"] += 1
        exchange = self.exchange
        self.acc = None
        rid = self.request_id
        headers = [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in settled.headers.items()]
        headers += [(b"content-type", b"application/json"), (b"x-request-id", rid.encode())]
        exchange.respond(settled.status, headers, settled.json())
        seconds = time.perf_counter() - self.t0
        self.service.metrics.request(PATH, seconds)
        token = request_id_var.set(rid)
        try:
            log.info("request", extra={"method": "POST", "path": PATH, "status": settled.status,
                                       "duration_ms": round(seconds * 1000, 3), "client": exchange.client,
                                       "lane": "direct"})
        finally:
            request_id_var.reset(token)
