"""The ledger writes of a task's run, on one thread of their own, in order.

A device worker must not wait for the database: marking a task ``running`` is a committed
SQLite transaction (synchronous=FULL: docs/performance.md), and a batched launch starts up to
``REV88_BATCH_MAX`` tasks at once (132 on an H200), so the worker only hands its tasks over
(``started``) and goes on to the launch. This thread writes them, every ``running`` handed
over since its last write in one transaction (``Ledger.mark_running_many``). The same thread
records the tasks' outcomes (``run``), so a task's ``running`` is always written before its
result: the worker hands it over before its job starts, and the result comes after the job.

A synchronous task sent without an Idempotency-Key is written once, when it has finished
(``finished``): every such record handed over since the last write shares one transaction
(group commit), so a stream of small tasks costs one commit per batch, not three per task.
Nobody waits for these records (their clients hold the answers), so when they are all the
writer has, it waits up to ``LINGER_S`` (20 ms) for more to share the commit: one client's
stream of small tasks shares commits too (bench/bench_shell.py: about half the writer's CPU per
tiny task, docs/performance.md). Any other write ends the wait at once; so does a read that must see them
(``written()``: GET /tasks and /health's counts), and the stop.

An asynchronous task's outcome (``finish``: a sweep's cell, say) is written the same way: every
outcome handed over since the last write shares one transaction (``Ledger.finish_many``), and
when only such records (and ``running`` marks) are queued the writer lingers for more, as above:
nobody holds a connection open for them (their clients poll), and a sweep's cells otherwise cost
two commits each (bench/bench_sweep.py: the writer's CPU per cell cut by about 40 %, docs/performance.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from ..threads import name_os_thread
from .store import FinishedTask, Ledger, Outcome

log = logging.getLogger("rev88." + __name__)

_STOP = object()
LINGER_S = 0.02  # answered tasks' records wait this long at most for others to share their commit
LINGER_MAX = 256
LINGERING = frozenset({"finished", "outcome", "running"})  # what may wait up to LINGER_S for company


class LedgerWriter:
    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="rev88-ledger", daemon=True)
        self._thread.start()
        self.batches = 0  # transactions that marked tasks running (tests/test_ledger_writer.py counts them)
        self.group_commits = 0  # transactions that recorded finished tasks (add_finished)
        self.linger_s = LINGER_S
        self._unwritten = 0  # ``finished`` records handed over and not yet written
        self._count_lock = threading.Lock()

    def started(self, task_id: str, device: str | None, started_at: float, epoch: int | None = None) -> None:
        """From a device worker: returns at once; the task is marked running soon after
        (``epoch``: its attempt's lease, with a shared ledger)."""
        self._queue.put(("running", (task_id, device, started_at, epoch)))

    def finished(self, task: FinishedTask, linger: bool = True) -> concurrent.futures.Future:
        """A finished task's only record (``Ledger.add_finished``), in the next group commit
        (which waits up to ``linger_s`` for more such records to share it; ``linger=False``: a
        caller waits for this one, so it does not)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._count_lock:
            self._unwritten += 1
        self._queue.put(("finished" if linger else "finished-now", (task, future)))
        return future

    def finish(self, outcome: Outcome, linger: bool = True) -> concurrent.futures.Future:
        """A queued or running task's result (``Ledger.finish``), in the next transaction of
        outcomes (``finish_many``); the future's result is the record, or the exception ``finish``
        raised for it. ``linger=False``: a client waits for this record, so the write does not
        wait for others to share it."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put(("outcome" if linger else "outcome-now", (outcome, future)))
        return future

    def finish_launch(self, outcomes: list[Outcome]) -> concurrent.futures.Future:
        """A launch's outcomes (app/tasks/launches.py), written together in the next transaction of
        outcomes, at once (whoever waits on the launch waits for it); the future's result is one item per
        outcome: its record, or the exception ``finish`` raised for it (LeaseLost for a stale
        attempt's, say). A failure of the database itself is the future's exception."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put(("launch", (list(outcomes), future)))
        return future

    def written(self) -> concurrent.futures.Future | None:
        """None when every ``finished`` record handed over is written; else a future done once
        they are (their commit taken at once, not after its linger)."""
        if self._unwritten == 0:
            return None
        return self.call(lambda: None)

    def call(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put(("call", (fn, args, future)))
        return future

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the writer thread, after every write handed over before it."""
        return await asyncio.wrap_future(self.call(fn, *args))

    def close(self, timeout_s: float = 30.0) -> bool:
        """Write what is queued, then stop; True if the thread ended in time."""
        self._queue.put((_STOP, None))
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _loop(self) -> None:
        name_os_thread()  # "rev88-ledger"
        while self._write(self._take()):
            pass  # (no name here keeps a written batch -- its futures, their callbacks' work -- until the next)

    def _take(self) -> list:
        items = [self._queue.get()]
        while True:  # everything queued meanwhile: consecutive "running" marks share a transaction
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                break
        if self.linger_s > 0 and all(kind in LINGERING for kind, _ in items):
            self._linger(items)
        return items

    def _write(self, items: list) -> bool:
        """One batch of what was handed over, in order; False once it held the stop."""
        running: list[tuple[str, str | None, float]] = []
        finished: list[tuple[FinishedTask, concurrent.futures.Future]] = []
        outcomes: list[tuple[Outcome, concurrent.futures.Future]] = []
        for kind, payload in items:
            if kind == "running":
                running.append(payload)
                continue
            if kind in ("finished", "finished-now"):
                finished.append(payload)
                continue
            if kind in ("outcome", "outcome-now"):
                outcomes.append(payload)
                continue
            if kind == "launch":
                launch, future = payload
                outcomes.append((launch, future))
                continue
            self._mark(running)  # (a task's running mark was queued before its outcome)
            self._add(finished)
            self._finish(outcomes)
            running, finished, outcomes = [], [], []
            if kind is _STOP:
                return False
            fn, args, future = payload
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - the caller gets it
                future.set_exception(exc)
        self._mark(running)
        self._add(finished)
        self._finish(outcomes)
        return True

    def _linger(self, items: list) -> None:
        """Only records nobody waits for so far (answered tasks', asynchronous tasks' outcomes,
        running marks): wait up to ``linger_s``
        for more to share their commit, until anything else arrives (a write someone waits
        for, a read's ``written()``, the stop), which ends the wait at once."""
        deadline = time.monotonic() + self.linger_s
        while len(items) < LINGER_MAX:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                item = self._queue.get(timeout=left)
            except queue.Empty:
                return
            items.append(item)
            if item[0] not in LINGERING:
                return

    def _mark(self, running: list[tuple]) -> None:
        if not running:
            return
        try:
            self.ledger.mark_running_many(running)
            self.batches += 1
        except Exception as exc:  # noqa: BLE001 - the runs go on; their results are still recorded
            log.error("could not record tasks as running", extra={"tasks": [t[0] for t in running],
                                                                  "error": str(exc)})

    def _add(self, finished: list[tuple[FinishedTask, concurrent.futures.Future]]) -> None:
        if not finished:
            return
        try:
            self._write_finished(finished)
        finally:
            with self._count_lock:
                self._unwritten -= len(finished)

    def _write_finished(self, finished: list[tuple[FinishedTask, concurrent.futures.Future]]) -> None:
        live = [(task, future) for task, future in finished if future.set_running_or_notify_cancel()]
        if not live:
            return
        try:
            self.ledger.add_finished([task for task, _ in live])
            self.group_commits += 1
        except Exception as exc:  # noqa: BLE001 - every waiting caller gets the failure
            for _, future in live:
                future.set_exception(exc)
            return
        for _, future in live:
            future.set_result(None)

    def _finish(self, outcomes: list[tuple[Outcome | list[Outcome], concurrent.futures.Future]]) -> None:
        """Every outcome handed over (single ones, and launches': a list with one future) in one
        ``finish_many``: one transaction."""
        live = [(o, future) for o, future in outcomes if future.set_running_or_notify_cancel()]
        if not live:
            return
        flat = [x for o, _ in live for x in (o if isinstance(o, list) else [o])]
        try:
            results = self.ledger.finish_many(flat)
        except BaseException as exc:  # noqa: BLE001 - every waiting caller gets the failure
            for _, future in live:
                future.set_exception(exc)
            return
        at = 0
        for o, future in live:
            if isinstance(o, list):
                future.set_result(results[at:at + len(o)])
                at += len(o)
                continue
            result = results[at]
            at += 1
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)
