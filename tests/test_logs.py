"""The service's JSON log lines are formatted and written by a thread of their own
(app/http/logs.py): the same lines, in order, with the logging thread's request id."""

from __future__ import annotations

import io
import json
import logging
import threading

from app.http.logs import JsonFormatter, LineWriter, request_id_var


def writer_on(stream) -> tuple[logging.Logger, LineWriter]:
    handler = LineWriter(stream)
    handler.setFormatter(JsonFormatter())
    log = logging.getLogger(f"rev88.test.logs.{id(stream)}")
    log.handlers, log.propagate = [handler], False
    log.setLevel("INFO")
    return log, handler


def test_lines_in_order_with_the_callers_request_id_and_its_extras_as_they_were():
    out = io.StringIO()
    log, handler = writer_on(out)
    timing = {"run_ms": 1.5}
    token = request_id_var.set("rid-7")
    try:
        log.info("task answered", extra={"timing": timing, "n": 3})
    finally:
        request_id_var.reset(token)
    timing["run_ms"] = 99.0  # changed once the call returned: the line keeps what was logged
    for i in range(200):
        log.info("line %d", i)

    def from_a_thread():
        token = request_id_var.set("rid-thread")
        log.warning("from a thread")
        request_id_var.reset(token)

    t = threading.Thread(target=from_a_thread)
    t.start()
    t.join()
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    handler.flush()
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines[0]["msg"] == "task answered" and lines[0]["request_id"] == "rid-7"
    assert lines[0]["timing"] == {"run_ms": 1.5} and lines[0]["n"] == 3
    assert [rec["msg"] for rec in lines[1:201]] == [f"line {i}" for i in range(200)]
    assert all("request_id" not in rec for rec in lines[1:201])  # none set: no key, as before
    assert lines[201]["msg"] == "from a thread" and lines[201]["request_id"] == "rid-thread"
    assert lines[202]["level"] == "error" and "ValueError: boom" in lines[202]["exc"]
    assert len(lines) == 203


def test_flush_waits_for_every_line_queued_before_it():
    class Slow(io.StringIO):
        def write(self, text):
            gate.wait(30)
            return super().write(text)

    gate = threading.Event()
    out = Slow()
    log, handler = writer_on(out)
    log.info("first")
    assert out.getvalue() == ""  # the writer is held: the logging thread did not wait for it
    gate.set()
    handler.flush()
    assert json.loads(out.getvalue())["msg"] == "first"


def test_a_stderr_that_does_not_keep_up_holds_a_bounded_queue_and_the_drop_is_said(monkeypatch):
    from app.http import logs

    class Blocked(io.StringIO):
        def write(self, text):
            gate.wait(30)
            return super().write(text)

    gate = threading.Event()
    monkeypatch.setattr(logs, "MAX_QUEUED", 10)
    out = Blocked()
    log, handler = writer_on(out)
    for i in range(50):  # the writer holds what it took at the blocked write; ten more queue, no more
        log.info("line %d", i)
    assert handler.queue.qsize() <= 10 and handler.dropped >= 50 - 10 - 11
    gate.set()
    handler.flush()
    log.info("after")
    handler.flush()
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    said = [rec for rec in lines if rec["msg"].startswith("log lines dropped")]
    assert len(said) == 1 and said[0]["dropped"] == handler.dropped and said[0]["level"] == "warning"
    assert lines[-1]["msg"] == "after" and len(lines) == 50 - handler.dropped + 2
