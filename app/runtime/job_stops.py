"""How a job ends other than by running to its end, for the executor (app/runtime/executor.py):
a client's wait with its timeout and disconnect, a cancel, a timeout, the drain deadline.

* stopped while queued (timeout, its client gone, cancelled) -> removed from the queue, never runs:
  ``TaskTimeout`` or ``TaskStopped``;
* stopped while running -> its cancel token is set; the backend stops at its next safe point (a
  minibatch on cpu/cpu-fast, an epoch on cuda; a fused launch cannot be stopped) and the job is
  answered with the stop;
* the drain deadline -> ``Unavailable`` for queued and running jobs alike.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from learner.errors import TaskCancelled

from ..errors import TaskStopped, TaskTimeout, Unavailable
from .jobs import ABANDONED, CANCELLED, DONE, DROPPED, EXPIRED, QUEUED, RETURNED, STOP_WAIT_S, Job

log = logging.getLogger("rev88.app.runtime.executor")


class JobStops:
    """(A part of DeviceExecutor: its queue, lock, workers and stats.)"""

    async def wait(self, job: Job, timeout_s: float | None, gone: Awaitable | None = None) -> Any:
        """The job's answer. On timeout, stop the job (unless it finished first) and answer
        that. ``gone`` (an awaitable that completes when the client disconnects: a future, or a
        coroutine run as a task of its own meanwhile) stops the job too; the answer is then an
        exception nobody reads.

        One loop future is woken by whichever comes first (the job's end, from its worker
        thread; the disconnect; the timer): no task, no ``asyncio.wait`` per request."""
        loop = asyncio.get_running_loop()
        wake = loop.create_future()

        def woken(_=None) -> None:
            if not wake.done():
                wake.set_result(None)

        def job_done(_) -> None:  # in the worker's thread (or here, if it is done already)
            try:
                loop.call_soon_threadsafe(woken)
            except RuntimeError:  # the loop has closed
                pass

        own_task = gone is not None and not asyncio.isfuture(gone)
        if own_task:
            gone = asyncio.ensure_future(gone)
        job.future.add_done_callback(job_done)
        if gone is not None:
            gone.add_done_callback(woken)
        timer = loop.call_later(timeout_s, woken) if timeout_s is not None else None
        try:
            await wake
            if job.future.done():
                if job.future.exception() is None:
                    return job.future.result()
                # raised from an asyncio future, which restores the exception's own traceback each
                # time (a concurrent future's lets every raise add its frames to the one exception
                # object, and the frames hold the task: a reference cycle, tests/test_memory_soak.py)
                return await asyncio.wrap_future(job.future)
            if gone is not None and gone.done():
                self.withdraw(job, "disconnect", "its client disconnected")
                return await asyncio.wrap_future(job.future)
            self.expire(job, timeout_s or 0.0)
            fut = asyncio.wrap_future(job.future)
            try:
                return await asyncio.wait_for(asyncio.shield(fut), STOP_WAIT_S)
            except TimeoutError:
                self.give_up(job, timeout_s or 0.0)
                return await fut
        finally:
            if timer is not None:
                timer.cancel()
            if gone is not None:
                gone.remove_done_callback(woken)
                if own_task and not gone.done():
                    gone.cancel()
            job = None  # a job's exception raised here holds this frame (see _run)

    def expire(self, job: Job, timeout_s: float) -> None:
        """Its time is up: a queued job never runs; a running one is told to stop."""
        msg = f"task timed out after {timeout_s:g} s (REV88_TASK_TIMEOUT_S)"
        self._stop_job(job, "timeout", msg, lambda: TaskTimeout(f"{msg} waiting for the device; it never ran",
                                                               where="queued", stopped=False))
        log.warning("task timed out", extra={"task_id": job.label, "where": job.state, "timeout_s": timeout_s})

    def withdraw(self, job: Job, why: str, reason: str) -> bool:
        """Its client is gone, or it was cancelled: a queued job never runs (answered
        ``TaskStopped``); a running one is told to stop. False if it had already ended."""
        return self._stop_job(job, why, f"task {reason}", lambda: TaskStopped(
            f"task {reason} before it ran; it never ran", where="queued", stopped=False, reason=why))

    def _stop_job(self, job: Job, why: str, message: str, queued_error: Callable[[], Exception]) -> bool:
        with self._cond:
            if job.future.done() or job.state in (DONE, EXPIRED, DROPPED, CANCELLED, RETURNED):
                return False
            if job.state == QUEUED:
                self._dequeue_locked(job)
                job.state = EXPIRED if why == "timeout" else DROPPED
                if why == "timeout":
                    self.stats.expired += 1
                else:
                    self.stats.dropped += 1
                job.cancel.cancel(message)
                job.future.set_exception(queued_error())
                self._cond.notify_all()  # a gathering that waits on this job stops waiting
                return True
            if job.stop is None:  # RUNNING: ask the backend to stop at its next safe point
                job.stop = (why, message)
                job.cancel.cancel(message)
            return True

    def give_up(self, job: Job, timeout_s: float) -> None:
        """A running job did not confirm its stop in time (e.g. a fused launch): answer now;
        its result, when it comes, is discarded."""
        with self._cond:
            if job.future.done():
                return
            job.state = ABANDONED
            self.stats.abandoned += 1
            now = time.monotonic()
            job.future.set_exception(TaskTimeout(
                f"task timed out after {timeout_s:g} s (REV88_TASK_TIMEOUT_S; {now - (job.started or now):.1f} s "
                f"of it on {job.worker}); the backend could not stop it within {STOP_WAIT_S:g} s, so it is still "
                "running and its result will be discarded",
                where="running", stopped=False,
            ))

    def find(self, label: str) -> Job | None:
        """The queued or running job with this label, if any."""
        with self._lock:
            for job in self._queue:
                if job.label == label:
                    return job
            for worker in self.workers:
                for job in worker.running:
                    if job.label == label:
                        return job
        return None

    def abandon_all(self, reason: str) -> int:
        """Drain deadline: answer every queued and running job with 503 now (running ones
        are also told to stop). Returns how many."""
        n = 0
        with self._cond:
            while self._queue:
                job = self._queue[0]
                self._dequeue_locked(job)
                job.state = CANCELLED
                self.stats.cancelled += 1
                job.cancel.cancel(reason)
                job.future.set_exception(Unavailable(f"{reason}; the task never ran", where="queued"))
                n += 1
            for worker in self.workers:
                for job in worker.running:
                    if job.future.done():
                        continue
                    job.state = ABANDONED
                    self.stats.abandoned += 1
                    job.stop = job.stop or ("drain", reason)
                    job.cancel.cancel(reason)
                    job.future.set_exception(
                        Unavailable(f"{reason} while the task was running; it was told to stop and its result is lost",
                                    where="running")
                    )
                    n += 1
            self._cond.notify_all()
        return n

    @staticmethod
    def stopped_error(job: Job, error: TaskCancelled) -> Exception:
        """What a job told to stop (``job.stop``) and stopped on the device is answered with."""
        why, message = job.stop
        where = f"{error}" if str(error) else "at its next safe point"
        held = f"{(job.finished or time.monotonic()) - (job.started or 0.0):.2f} s on {job.worker}"
        if why == "timeout":
            return TaskTimeout(f"{message}; it was stopped on the device ({where}) after {held}",
                               where="running", stopped=True)
        return TaskStopped(f"{message}; it was stopped on the device ({where}) after {held}",
                           where="running", stopped=True, reason=why)
