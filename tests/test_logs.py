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


def test_a_launch_of_several_tasks_is_one_line_naming_each_and_a_task_alone_keeps_its_own():
    """app/tasks/answers.py ``say_answered``: a launch's line as JSON, its lists in its tasks'
    order (a request id only where one of them has one); a task run alone, ``task answered``."""
    from types import SimpleNamespace

    from app.tasks.answers import say_answered

    out = io.StringIO()
    handler = LineWriter(out)
    handler.setFormatter(JsonFormatter())
    log = logging.getLogger("rev88.app.tasks.finisher")
    old = log.handlers, log.propagate, log.level
    log.handlers, log.propagate = [handler], False
    log.setLevel("INFO")

    def work(i, request_id=None, mode="async"):
        task = SimpleNamespace(train_count=100 + i, test_count=10 + i)
        timing = {"queue_wait_ms": 1.0 + i, "run_ms": 2.0 + i, "total_ms": 3.0 + i, "device_ms": 9.5}
        return SimpleNamespace(task_id=f"t{i}", task=task, request_id=request_id, mode=mode, device="cuda:0"), \
            {"timing": timing}

    try:
        say_answered([(*work(i), "fused") for i in range(3)], 3)
        say_answered([(*work(0), "fused"), (*work(1, "rid-1", "sync"), "fused")], 4)
        say_answered([(*work(7, "rid-7", "sync"), "cpu-fast")], 1)
        handler.flush()
    finally:
        log.handlers, log.propagate, log.level = old
    cells, mixed, alone = [json.loads(line) for line in out.getvalue().splitlines()]
    assert cells["msg"] == "launch answered" and "request_ids" not in cells
    assert {k: cells[k] for k in ("tasks", "tasks_in_launch", "backend", "device", "device_ms", "task_ids", "modes",
                                  "train_count", "test_count", "queue_wait_ms", "run_ms", "total_ms")} == {
        "tasks": 3, "tasks_in_launch": 3, "backend": "fused", "device": "cuda:0", "device_ms": 9.5,
        "task_ids": ["t0", "t1", "t2"], "modes": ["async"] * 3, "train_count": [100, 101, 102],
        "test_count": [10, 11, 12], "queue_wait_ms": [1.0, 2.0, 3.0], "run_ms": [2.0, 3.0, 4.0],
        "total_ms": [3.0, 4.0, 5.0]}
    assert mixed["msg"] == "launch answered" and mixed["request_ids"] == [None, "rid-1"]
    assert mixed["tasks"] == 2 and mixed["tasks_in_launch"] == 4 and mixed["modes"] == ["async", "sync"]
    assert alone["msg"] == "task answered" and alone["task_id"] == "t7" and alone["request_id"] == "rid-7"
    assert alone["timing"]["run_ms"] == 9.0 and alone["backend"] == "cpu-fast" and alone["mode"] == "sync"
