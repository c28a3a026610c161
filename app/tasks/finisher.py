"""The finisher: where every unit of work's life ends (app/tasks/work.py), and nowhere else.

Success, failure, cancel, timeout: each outcome is made into its answer (or error) here, its
record handed to the ledger here, its hooks (sweeps' rows, webhooks, tenants' counts) run and
whoever waits told from here. Two doors, one set of rules:

    launch(entries)   (the finisher thread) a launch's outcomes (a lone task's: a launch of one)
                      as the device worker hands them over: each answer built (its JSON encoded
                      once), recorded work's outcomes handed to the writer as ONE transaction, a
                      deferred task's record to the next group commit; once written, the loop
                      woken ONCE for the launch (``_told``, from the writer's thread: this one
                      answers the next launch meanwhile) and its future given one ``Ended`` each
    failed(work, exc) (the loop) work that failed where no launch finishes it: a timeout or cancel
                      while it waited, a drain, a refusal, a run that raised; recorded the same
                      way (a lone write, retried while a shared database is away)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from learner.errors import TaskCancelled

from ..errors import NotAccepted, TaskStopped, TaskTimeout, Unavailable, error_answer, outcome_of
from ..ledger import AlreadyFinished, LeaseLost, LedgerUnavailable, LedgerWriter, Outcome
from ..runtime.executor import DeviceExecutor
from ..runtime.metrics import Metrics
from ..threads import name_os_thread
from .answers import Measured, Settled, device_answer, input_hashes, measure_answer, run_timing, say_answered
from .device import DeviceOutcome
from .work import Work

log = logging.getLogger("rev88." + __name__)


@dataclasses.dataclass
class Told:
    """What the loop does for one unit once its launch is finished (``Finisher._told``)."""

    work: Work
    status: str
    answer: dict | None
    outcome: Outcome | None  # recorded: the recorded hooks get it
    hooks: bool  # the finished hooks run (False: not recorded, or nothing to record)
    retry: Outcome | None = None  # the ledger was away: written again, alone


@dataclasses.dataclass
class Ended:
    """One entry of a launch as the finisher made it: the answer or error as HTTP sees it, and --
    when the ledger was away for the launch's write -- the outcome the loop writes again (with
    retries) before its client is answered."""

    settled: Settled
    retry: Outcome | None = None


def unrecorded(work: Work, exc: BaseException) -> bool:
    """Log why an outcome is not in the ledger; True when the ledger itself failed (not a result
    another holder's record stands in for)."""
    if isinstance(exc, LeaseLost):  # shared ledger: another replica holds the task now; its result stands
        log.warning("result refused by the ledger: lease lost", extra={"task_id": work.task_id, "error": str(exc)})
        return False
    if isinstance(exc, AlreadyFinished):  # cancelled in the ledger meanwhile (a restart's leftovers)
        log.warning("task finished after the ledger recorded it finished", extra={"task_id": work.task_id})
        return False
    log.error("could not record the answer in the ledger", extra={"task_id": work.task_id, "error": str(exc)})
    return True


class Finisher:
    """Builds every answer and records every outcome, for a ``TaskRunner`` (which owns ``pending``)."""

    def __init__(self, *, writer: LedgerWriter, metrics: Metrics, versions: Callable[[], dict[str, Any]],
                 pending: dict[str, Work], leases: Any = None, hash_threads: int | None = None) -> None:
        self.writer, self.metrics, self.versions, self.pending = writer, metrics, versions, pending
        self.leases = leases  # (PostgreSQL) app/tasks/feeder.py: an attempt's lease ends with its outcome
        self.thread = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="rev88-finish", initializer=name_os_thread, initargs=("rev88-finish",))
        self.hashers = concurrent.futures.ThreadPoolExecutor(
            max_workers=hash_threads or max(1, os.cpu_count() or 1), thread_name_prefix="rev88-hash",
            initializer=name_os_thread, initargs=("rev88-hash",))
        # called on the loop once an outcome is in the ledger (sweeps keep their cells' rows; webhooks)
        self.recorded_hooks: list[Callable[[Work, Outcome], None]] = []
        # (work, status, answer) of every finished unit, recorded now or deferred (per-tenant metrics)
        self.finished_hooks: list[Callable[[Work, str, dict | None], None]] = []
        self.record_retry_s = 60.0  # an outcome: retried this long while a shared database is away
        self.background: set[asyncio.Task] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.counters = {"launches": 0, "cells_answered": 0, "cells_failed": 0, "ledger_transactions": 0}

    def close(self) -> None:
        self.thread.shutdown(wait=True)
        self.hashers.shutdown(wait=True)

    # ------------------------------------------------------------------ answers
    def answer_for(self, work: Work, outcome: DeviceOutcome, device_s: float, launch_size: int) -> dict[str, Any]:
        """The answer's document (and its metrics; its log line is its launch's, ``say_answered``);
        ``device_s``: its launch's time on the device (a task whose job parsed its body first: that
        time is its parse_ms)."""
        run_ms, clock = run_timing(outcome.result)
        self.metrics.queue_wait_seconds.observe(work.queue_wait_s)
        self.metrics.run_seconds.observe(run_ms / 1000.0)
        if outcome.energy is not None and self.metrics.task_energy is not None and outcome.energy.get("gross_j"):
            self.metrics.task_energy.inc(outcome.energy["gross_j"])
        return device_answer(work, outcome, (run_ms, clock), device_s, launch_size)

    def failure(self, work: Work, exc: BaseException) -> tuple[Settled, str, dict]:
        """A failed unit's answer, its status (cancelled or failed) and its error record."""
        status, body, headers = error_answer(exc, work.request_id)
        self.metrics.outcome(outcome_of(exc) if isinstance(exc, Exception) else "error")
        error = {"status": status, **body}
        error.pop("request_id", None)
        state = "cancelled" if isinstance(exc, (TaskStopped, TaskCancelled)) else "failed"
        return Settled(status, body, headers=headers), state, error

    # ------------------------------------------------------------------ the finisher thread
    def launch(self, entries: list[tuple[Work, Any]], device_s: float, launch_size: int,
               done: concurrent.futures.Future | None = None) -> concurrent.futures.Future:
        """A launch's outcomes (a ``DeviceOutcome``, a ``Measured`` document, or the exception that
        is its answer), in order: ``done`` (made here when not given) gets one ``Ended`` each (None
        where another outcome came first) once their records are written. This thread does not
        wait for the write: the ledger writer's thread tells the loop, and ``done``, when it is
        done, while this one answers the next launch."""
        done = done if done is not None else concurrent.futures.Future()
        self.counters["launches"] += 1
        ended: list[Ended | None] = [None] * len(entries)
        rows: list[tuple[int, Work, Outcome]] = []  # recorded work: one transaction
        told: list[Told] = []
        answered: list[tuple[Work, dict, str]] = []  # (work, answer, backend) of each run answered: the log's line
        for i, (work, value) in enumerate(entries):
            if not work.finish():
                continue  # (answered already: its timeout, say; this late outcome is dropped)
            settled, status, record = self._made(work, value, device_s, launch_size)
            ended[i] = Ended(settled)
            if isinstance(value, DeviceOutcome) and status == "succeeded":
                answered.append((work, settled.body, value.result.metadata["backend"]))
            if work.deferred:
                recorded = self._deferred(work, settled, status, record)
                told.append(Told(work, status, settled.body if status == "succeeded" else None, None, recorded))
                continue
            if status == "succeeded":
                outcome = Outcome(work.task_id, status, settled.body, None, settled.content if work.mode == "sync"
                                  else None, False, _hashes_of(work), epoch=work.epoch, want_record=False)
            else:
                outcome = Outcome(work.task_id, status, None, record, input_hashes=_hashes_of(work), epoch=work.epoch,
                                  want_record=False)
            rows.append((i, work, outcome))
        say_answered(answered, launch_size)
        if not rows:
            self.call_on_loop(self._told, told)
            done.set_result(ended)
            return done
        write = self.writer.finish_launch([o for _, _, o in rows])
        write.add_done_callback(lambda write: self._written(write, rows, ended, told, done))
        return done

    def _written(self, write: concurrent.futures.Future, rows: list[tuple[int, Work, Outcome]],
                 ended: list[Ended | None], told: list[Told], done: concurrent.futures.Future) -> None:
        """(the ledger writer's thread, once a launch's records are written) Who is told what."""
        try:
            try:
                results = write.result()
                self.counters["ledger_transactions"] += 1
            except LedgerUnavailable as exc:  # the database is away: each outcome retried on its own, on the loop
                log.warning("a launch's outcomes could not be recorded together; retrying them one by one",
                            extra={"tasks": len(rows), "error": str(exc)})
                results = [None] * len(rows)
            told += told_of(rows, results, ended)
        except BaseException as exc:  # noqa: BLE001 - said loudly by whoever holds ``done``
            done.set_exception(exc)
            return
        self.call_on_loop(self._told, told)
        done.set_result(ended)

    def _made(self, work: Work, value: Any, device_s: float, launch_size: int) -> tuple[Settled, str, dict | None]:
        """(the answer as HTTP sees it, its status, its error record) of one outcome."""
        if isinstance(value, DeviceOutcome):
            body = self.answer_for(work, value, device_s, launch_size)
            self.metrics.outcome("ok")
            self.counters["cells_answered"] += 1
            settled = Settled(200, body, outcome=value)
            if work.mode == "sync":
                settled.json()  # (encoded here, once: what is sent, and what a deferred record keeps)
            return settled, "succeeded", None
        if isinstance(value, Measured):
            self.metrics.outcome("ok")
            self.metrics.queue_wait_seconds.observe(work.queue_wait_s)
            settled = Settled(200, measure_answer(work, value.doc, device_s, self.versions()))
            log.info("measurement answered", extra={"task_id": work.task_id, "timing": settled.body["timing"]})
            settled.json()
            return settled, "succeeded", None
        exc = value
        job = work.job
        if isinstance(exc, TaskCancelled) and job is not None and job.stop is not None:
            if job.stop[0] == "timeout":  # its time ran out during the launch
                exc = TaskTimeout(f"{job.stop[1]}; the launch it ran in could not be stopped, its result is discarded",
                                  where="running", stopped=True)
            else:
                exc = DeviceExecutor.stopped_error(job, exc)
        self.counters["cells_failed"] += 1
        return self.failure(work, exc)

    def _deferred(self, work: Work, settled: Settled, status: str, record: dict | None) -> bool:
        """A deferred task's one record, handed to the ledger writer: an answer's goes to the next
        group commit (its client holds the answer; the task reads as finished from ``pending``
        until the ledger has it); a failure's is written at once and waited for (a client told
        'failed' finds the record). False: nothing to record (a body refused by its own job)."""
        if status == "succeeded":
            work.finished_at = time.time()
            work.finished = work.finished_task("succeeded", answer=settled.body, answer_json=settled.json())
            self.writer.finished(work.finished).add_done_callback(lambda write: self._committed(work, write))
            return True
        if work.parsed() is None:
            return False
        try:
            self.writer.finished(work.finished_task(status, error=record), linger=False).result()
        except Exception as exc:  # noqa: BLE001 - the answer stands
            unrecorded(work, exc)
        return True

    def _committed(self, work: Work, write: concurrent.futures.Future) -> None:
        """A deferred task's record has reached the ledger (or failed to): out of ``pending``. On
        the ledger writer's thread (a dict's get and pop are atomic; task ids are never reused)."""
        if self.pending.get(work.task_id) is work:
            self.pending.pop(work.task_id, None)
        if write.exception() is not None:
            unrecorded(work, write.exception())

    def call_on_loop(self, fn, *args) -> None:
        loop = self.loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed meanwhile (a stop)
            pass

    # ------------------------------------------------------------------ the loop
    def _told(self, told: list[Told]) -> None:
        """(the loop, once per launch) Each unit's hooks, its end (out of ``pending``, its lease and
        timer ended); an outcome the ledger could not take now is retried on its own: for work
        nobody awaits, here; a synchronous task's client retries it before it is answered."""
        for t in told:
            if t.retry is not None:
                if t.work.mode == "async":
                    self.in_background(self._retry(t.work, t.retry))
                continue
            try:
                if t.outcome is not None:
                    for hook in self.recorded_hooks:
                        hook(t.work, t.outcome)
                if t.hooks:
                    self._finished(t.work, t.status, t.answer)
            except Exception:  # noqa: BLE001 - a hook must not keep the others from running
                log.exception("a launch's hooks failed", extra={"task_id": t.work.task_id})
            finally:
                self.ended(t.work)

    async def _retry(self, work: Work, outcome: Outcome) -> None:
        try:
            await self.write(work, outcome)
        except Exception as exc:  # noqa: BLE001 - logged
            unrecorded(work, exc)
        finally:
            self.ended(work)

    def ended(self, work: Work) -> None:
        """(the loop) A unit's outcome is recorded (or could not be): its timer off, out of
        ``pending`` (a deferred one leaves once its group commit has it), its lease no longer renewed."""
        if work.timer is not None:
            work.timer.cancel()
            work.timer = None
        if not work.deferred or work.finished is None:
            if self.pending.get(work.task_id) is work:
                self.pending.pop(work.task_id, None)
        if self.leases is not None and work.epoch is not None:
            self.leases.attempt_ended(work)
        if work.state.value == "finished":
            work.tell()
        # The job's closures hold the work (its arrays, megabytes): without this link back the
        # pair is a reference cycle, freed only by the cyclic GC's next full pass, not here.
        work.job = None

    def _finished(self, work: Work, status: str, answer: dict | None) -> None:
        for hook in self.finished_hooks:
            try:
                hook(work, status, answer)
            except Exception:  # noqa: BLE001 - a metric must not lose the task
                log.exception("finished hook failed", extra={"task_id": work.task_id})

    def in_background(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def write(self, work: Work, outcome: Outcome) -> Any:
        """``outcome`` written by the ledger writer, alone. With a shared ledger it is retried while
        the database is unavailable (``record_retry_s``), its lease renewed meanwhile: if still this
        attempt's when the database answers, it keeps the result; if not, the write is refused
        (LeaseLost) and the task's new holder records it. (A synchronous task's answer waits for its
        record: a 200 is never followed by a record that says it failed.)"""
        deadline = time.monotonic() + (self.record_retry_s if self.leases is not None else 0)
        delay = 0.25
        while True:
            try:
                record = await asyncio.wrap_future(self.writer.finish(outcome, linger=work.mode == "async"))
                for hook in self.recorded_hooks:
                    hook(work, outcome)
                self._finished(work, outcome.status, outcome.answer)
                return record
            except LedgerUnavailable as exc:
                if time.monotonic() + delay > deadline:
                    raise
                log.warning("ledger unavailable; retrying the task's outcome", extra={"task_id": work.task_id,
                                                                                     "error": str(exc)})
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def failed(self, work: Work, exc: BaseException) -> Settled:
        """(the loop) Work that failed where no launch finished it: its answer, and its record."""
        if not work.finish():
            return Settled(409, {"error": "the task had already finished"})  # (nobody reads it: the first stands)
        if isinstance(exc, NotAccepted):  # its body, parsed by its own job: refused as on arrival, not recorded
            status, body, headers = error_answer(exc.error, work.request_id)
            self.metrics.outcome(outcome_of(exc.error))
            self.ended(work)
            return Settled(status, body, headers=headers)
        settled, status, error = self.failure(work, exc)
        try:
            if isinstance(exc, Unavailable) and work.mode == "async":
                # the drain deadline: an accepted asynchronous task stays queued in the ledger and the
                # next start runs it again; nothing accepted is lost
                log.warning("asynchronous task left for the next start", extra={"task_id": work.task_id})
                if self.leases is not None:  # shared ledger: another replica runs it now
                    try:
                        await asyncio.to_thread(self.leases.ledger.release, [work.task_id])
                    except LedgerUnavailable as exc2:
                        log.warning("lease not released (it expires instead)", extra={"task_id": work.task_id,
                                                                                     "error": str(exc2)})
                return settled
            if work.deferred:
                if work.parsed() is not None:
                    self._finished(work, status, None)
                    await asyncio.wrap_future(self.writer.finished(work.finished_task(status, error=error),
                                                                   linger=False))
            else:
                await self.write(work, Outcome(work.task_id, status, None, error, input_hashes=_hashes_of(work),
                                               epoch=work.epoch))
        except (LeaseLost, AlreadyFinished) as exc2:
            unrecorded(work, exc2)
        except Exception as exc2:  # noqa: BLE001
            log.error("could not record the failure in the ledger", extra={"task_id": work.task_id, "error": str(exc2)})
        finally:
            self.ended(work)
        return settled


def told_of(rows: list[tuple[int, Work, Outcome]], results: list, ended: list[Ended | None]) -> list[Told]:
    """What each of a launch's recorded units is told, from its write's result: its record; an
    exception (not recorded: a lease lost, say); None (the database was away: retried on its own)."""
    told = []
    for (i, work, outcome), result in zip(rows, results):
        if result is None:  # (its write is retried: the retry tells)
            ended[i].retry = outcome
            told.append(Told(work, outcome.status, None, None, False, retry=outcome))
        elif isinstance(result, BaseException):
            if unrecorded(work, result):
                ended[i].settled.headers["X-Ledger-Error"] = str(result)[:200]
            told.append(Told(work, outcome.status, None, None, False))
        else:
            told.append(Told(work, outcome.status, outcome.answer, outcome, True))
    return told


def _hashes_of(work: Work):
    task = work.task
    return lambda: input_hashes(task)
