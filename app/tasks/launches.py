"""Launches, not cells: what the host does around a batched launch (issue #46).

A device worker runs a launch of gathered tasks (``launch_on_device``: each task's seed-derived
state from learner/seed_state.py, one ``run_many``) and goes back to the queue at once: the rest is
the host's, on the *finisher* thread, while the device runs the next launch (the pipeline: launch
k+1 is gathered and started by the worker while launch k is finished here; a second thread, not
CUDA streams, because what follows a launch is Python and hashing, not device work):

    finish     each task's result checked, hashed and assembled (``finish_launch``: the same
               ``finish_task`` a single task uses), the large buffers' hashes (scores,
               predictions) on a pool of ``hash_threads`` threads sized to the host's cores
               (hashlib lets go of the GIL on them), the rest on this thread
    answers    the launch's asynchronous cells fed from the ledger (sweep and evaluation cells,
               asynchronous tasks: ``Accepted.launch_path``) answered together: their documents
               built, their outcomes written in ONE ledger transaction (``LedgerWriter.finish_launch``;
               the answers stored compactly: app/ledger/rows.py), then the event loop woken ONCE for
               the launch (its hooks: sweeps' rows, webhooks, tenants' counts; the tasks out of
               ``pending``)
    others     a synchronous task in the launch (a client waits on the loop) gets its outcome
               through the future its job was answered with (``Finishing``), as before

and, ahead of the launch, on the *prepare* thread: the seed-derived state of each task as it is
queued on the device (and of a sweep's or an evaluation's first cells as they are accepted, while
the ledger records them), so that the worker's ``prepare`` finds it kept while launch k runs, not
after it (``prepare_ahead``; learner/seed_state.py waits for a state under way rather than
computing it twice). One thread: it computes states faster than the device uses them
(docs/performance.md, "Small costs inside a request").

A launch-path cell has no coroutine of its own: its failures before the launch (a timeout while
queued, a cancel, a drain, taken back to the ledger) come through its job's future
(``watch``), its timeout from one timer on the loop. One bad cell fails alone: its own error is
its outcome, in the same transaction as the others' -- a cell that diverged, one cancelled, one
whose tenant's key was revoked while it waited (checked as its launch is gathered: it does not run).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
from typing import Any

from learner import seed_state

from ..errors import Requeued, TaskTimeout, error_answer, outcome_of
from ..ledger import LeaseLost, LedgerUnavailable, Outcome
from ..threads import name_os_thread
from .answers import input_hashes
from .device import DeviceOutcome, finish_launch, has_run_many, launch_on_device, run_on_device, worker_engine

log = logging.getLogger("rev88." + __name__)


@dataclasses.dataclass(frozen=True)
class Finishing:
    """A task's outcome in a launch still being finished: ``future`` gives the launch's outcomes."""

    future: concurrent.futures.Future
    index: int

    def outcome(self, outcomes: list) -> Any:
        return outcomes[self.index]


class Launches:
    """The host side of batched launches, for a ``TaskRunner`` (which owns the tasks)."""

    def __init__(self, runner: Any, hash_threads: int | None = None) -> None:
        self.runner = runner
        threads = hash_threads or max(1, os.cpu_count() or 1)
        self.finisher = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="rev88-finish", initializer=name_os_thread, initargs=("rev88-finish",))
        self.hashers = concurrent.futures.ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix="rev88-hash", initializer=name_os_thread, initargs=("rev88-hash",))
        self.preparer = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="rev88-prepare", initializer=name_os_thread, initargs=("rev88-prepare",))
        self._ahead: collections.OrderedDict[tuple, tuple] = collections.OrderedDict()  # states wanted, not begun
        self._ahead_lock = threading.Lock()
        self._draining = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.counters = {"launches": 0, "cells_answered": 0, "cells_failed": 0, "ledger_transactions": 0,
                         "states_prepared_ahead": 0}

    def close(self) -> None:
        with self._ahead_lock:
            self._ahead.clear()
        self.preparer.shutdown(wait=True)
        self.finisher.shutdown(wait=True)
        self.hashers.shutdown(wait=True)

    # ------------------------------------------------------------------ ahead of the launch
    def prepare_ahead(self, accs: list[Any]) -> None:
        """(any thread; cheap) Compute, on the prepare thread, the seed-derived states of these
        tasks that are neither kept nor under way. Skipped: a task not parsed yet (its job parses
        it), states beyond half the cache's bound (they would push out each other before their
        launch), and everything when the cache keeps nothing (REV88_SEED_CACHE_BYTES=0)."""
        self.prepare_states_ahead([(acc.config, acc.task.train_count) for acc in accs if acc.task is not None])

    def prepare_states_ahead(self, wanted: list[tuple[Any, int]]) -> None:
        """``prepare_ahead`` for (config, training count) pairs: work known before its tasks are
        built (a sweep's cells as soon as its request is checked)."""
        cache = seed_state.states
        if cache.max_bytes <= 0 or not wanted:
            return
        with self._ahead_lock:
            for config, rows in wanted:
                key = cache.key(config, rows)
                if key in self._ahead or not cache.missing(config, rows):
                    continue
                if (len(self._ahead) + 1) * seed_state.estimate_bytes(config, rows) > cache.max_bytes // 2:
                    break
                self._ahead[key] = (config, rows)
            if not self._ahead or self._draining:
                return
            self._draining = True
        try:
            self.preparer.submit(self._prepare_wanted)
        except RuntimeError:  # (shut down: the launches prepare their own)
            with self._ahead_lock:
                self._ahead.clear()
                self._draining = False

    def _prepare_wanted(self) -> None:
        cache = seed_state.states
        while True:
            with self._ahead_lock:
                if not self._ahead:
                    self._draining = False
                    return
                _, (config, rows) = self._ahead.popitem(last=False)
            try:
                cache.get(config, rows)
                self.counters["states_prepared_ahead"] += 1
            except Exception:  # noqa: BLE001 - its launch computes it again and answers what fails
                log.debug("a seed state prepared ahead failed", exc_info=True)

    # ------------------------------------------------------------------ the worker's part
    def run(self, items: list[tuple], backend: str, precision: str | None) -> list[Finishing]:
        """(a device worker) The launch on the device; its finishing handed to the finisher thread."""
        r = self.runner
        launch = launch_on_device(items, backend, r.energy, r.engines, precision, refuse=self._refusal)
        future = self.finisher.submit(self._finish, launch)
        future.add_done_callback(_log_failure)
        return [Finishing(future, i) for i in range(len(items))]

    def run_alone(self, acc: Any) -> Finishing:
        """(a device worker) A launch-path cell run by itself (its backend cannot batch, or it was
        the only one of its key): the single run, then the same finishing."""
        r = self.runner
        engine = worker_engine(acc.backend, r.engines, acc.precision)
        if has_run_many(engine):  # (its tenant's key checked there, as a launch's tasks are)
            return self.run([(acc.task, acc.config, acc.cancel, acc)], acc.backend, acc.precision)[0]
        refused = r.refusal(acc)
        if refused is not None:  # (its tenant's key revoked while it waited: its answer, not run)
            future = self.finisher.submit(self._record, [(0, acc)], [refused], 0.0, 0)
            future.add_done_callback(_log_failure)
            return Finishing(future, 0)
        t0 = time.monotonic()
        try:
            outcome: DeviceOutcome | BaseException = run_on_device(
                acc.task, acc.config, acc.backend, r.energy, r.engines, cancel=acc.cancel, precision=acc.precision)
        except Exception as exc:  # noqa: BLE001 - its answer
            outcome = exc
        device_s = time.monotonic() - t0
        future = self.finisher.submit(self._record, [(0, acc)], [outcome], device_s, 1)
        future.add_done_callback(_log_failure)
        return Finishing(future, 0)

    def _refusal(self, item: tuple) -> BaseException | None:
        acc = item[3] if len(item) > 3 else None
        return self.runner.refusal(acc) if acc is not None else None

    # ------------------------------------------------------------------ the finisher's part
    def _finish(self, launch) -> list:
        outcomes = finish_launch(launch, self.hashers)
        fed = [(i, item[3]) for i, item in enumerate(launch.items)
               if len(item) > 3 and getattr(item[3], "launch_path", False)]
        count = sum(1 for run in launch.runs if isinstance(run, tuple))
        self.counters["launches"] += 1
        if fed:
            self._record(fed, outcomes, launch.device_s, count)
        return outcomes

    def _record(self, fed: list[tuple[int, Any]], outcomes: list, device_s: float, launch_size: int) -> list:
        """The launch's fed cells answered together: one ledger transaction, one wake of the loop."""
        r = self.runner
        rows: list[tuple[Any, Outcome]] = []
        for i, acc in fed:
            value = outcomes[i]
            if isinstance(value, DeviceOutcome):
                body = r.answer_for(acc, value, acc.queue_wait_s, device_s, launch_size, worker=acc.job.worker if acc.job is not None else None)
                rows.append((acc, Outcome(acc.task_id, "succeeded", body, None, None, False,
                                          _hashes_of(acc), epoch=acc.epoch, want_record=False)))
                r.metrics.outcome("ok")
                self.counters["cells_answered"] += 1
                continue
            exc = value
            stop = acc.job.stop if acc.job is not None else None
            if stop is not None and stop[0] == "timeout":  # its time ran out during the launch
                exc = TaskTimeout(f"{stop[1]}; the launch it ran in could not be stopped, its result is discarded",
                                  where="running", stopped=True)
            status, body, _ = error_answer(exc, acc.request_id)
            r.metrics.outcome(outcome_of(exc) if isinstance(exc, Exception) else "error")
            body.pop("request_id", None)
            state = "cancelled" if type(exc).__name__ in ("TaskCancelled", "TaskStopped") else "failed"
            rows.append((acc, Outcome(acc.task_id, state, None, {"status": status, **body},
                                      input_hashes=_hashes_of(acc), epoch=acc.epoch, want_record=False)))
            self.counters["cells_failed"] += 1
        try:
            results = r.writer.finish_launch([o for _, o in rows]).result()
            self.counters["ledger_transactions"] += 1
        except LedgerUnavailable as exc:  # the database is away: each cell's outcome retried on its own
            log.warning("a launch's outcomes could not be recorded together; retrying them one by one",
                        extra={"tasks": len(rows), "error": str(exc)})
            self._to_loop(r.retry_launch_outcomes, rows)
            return outcomes
        self._to_loop(r.launch_recorded, rows, results)
        return outcomes

    def _to_loop(self, fn, *args) -> None:
        loop = self.loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed meanwhile (a stop)
            pass

    # ------------------------------------------------------------------ a cell's job, before its launch
    def watch(self, acc: Any, timeout_s: float) -> None:
        """(the loop) A launch-path cell just queued: its job's failures before the launch come back
        to the loop; its timeout is one timer."""
        loop = asyncio.get_running_loop()
        self.loop = loop
        acc.timer = loop.call_later(timeout_s, self._timed_out, acc, timeout_s)
        acc.job.future.add_done_callback(lambda future: self._job_done(acc, future))

    def _timed_out(self, acc: Any, timeout_s: float) -> None:
        job = acc.job
        if job is not None and not job.future.done():
            self.runner.executor.expire(job, timeout_s)

    def _job_done(self, acc: Any, future: concurrent.futures.Future) -> None:
        """(any thread) Its job answered: a launch's Finishing (recorded by the finisher), or an
        exception from before the launch (recorded on the loop, as a settled task's failure is)."""
        if future.exception() is None:
            return
        exc = future.exception()
        self._to_loop(self._failed_before, acc, exc)

    def _failed_before(self, acc: Any, exc: BaseException) -> None:
        r = self.runner
        task = asyncio.get_running_loop().create_task(self._settle_failure(acc, exc))
        r.background.add(task)
        task.add_done_callback(r.background.discard)

    async def _settle_failure(self, acc: Any, exc: BaseException) -> None:
        r = self.runner
        try:
            if isinstance(exc, Requeued):
                await r.feeder.returned(acc)
                return
            settled = r.failed(acc, exc)
            await r.record_failure(acc, exc, settled)
        except (LeaseLost, Exception):  # noqa: BLE001 - logged by the runner's writes
            log.exception("recording a failed cell failed", extra={"task_id": acc.task_id})
        finally:
            r.launch_cell_done(acc)


def _log_failure(future: concurrent.futures.Future) -> None:
    """A launch's finishing that failed as a whole (a bug: every task's own error is its outcome) is
    said loudly: its cells stay unfinished in the ledger and run again at the next start."""
    exc = future.exception()
    if exc is not None:
        log.error("finishing a launch failed", exc_info=(type(exc), exc, exc.__traceback__))


def _hashes_of(acc: Any):
    task = acc.task
    return lambda: input_hashes(task)
