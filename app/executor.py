"""The one device executor: a single thread that owns the device, fed by a bounded queue.

Only work that needs the device runs here (the backend's run, the startup
warm-up, energy measurements, idle power sampling); parsing and validation
happen before ``submit`` in worker threads.

Every accepted job is answered exactly once, through its ``future``:

* the thread finishes it                  -> its result or its exception;
* its request times out while queued      -> removed from the queue, never runs, ``TaskTimeout``;
* its request times out while running     -> ``TaskTimeout`` now; the device cannot be
                                             interrupted, so the job keeps the device until it
                                             ends and its result is then discarded (logged);
* the drain deadline passes at shutdown   -> ``Unavailable`` for queued and running jobs alike.

Whoever settles the future first wins (under one lock); the others see it done.
The queue depth counts only jobs waiting for the device; a job that is running
(answered or not) holds the device, not a queue slot.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from .errors import QueueFull, TaskTimeout, Unavailable

log = logging.getLogger("rev88.app.executor")

QUEUED, RUNNING, DONE, EXPIRED, ABANDONED, CANCELLED = (
    "queued", "running", "done", "expired", "abandoned", "cancelled",
)


@dataclasses.dataclass(eq=False)
class Job:
    fn: Callable[[], Any]
    kind: str = "task"
    label: str = ""
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    state: str = QUEUED
    submitted: float = dataclasses.field(default_factory=time.monotonic)
    started: float | None = None
    finished: float | None = None

    @property
    def queue_wait_s(self) -> float | None:
        return None if self.started is None else self.started - self.submitted

    @property
    def device_s(self) -> float | None:
        """Seconds this job held the device (None until it has finished)."""
        return None if self.started is None or self.finished is None else self.finished - self.started


@dataclasses.dataclass
class Stats:
    accepted: int = 0  # jobs put on the queue
    completed: int = 0  # ran and answered with a result
    failed: int = 0  # ran and answered with the error they raised
    expired: int = 0  # timed out while queued: answered 504, never ran
    abandoned: int = 0  # answered (504 or shutdown 503) while running on the device
    abandoned_finished: int = 0  # ... of which have since finished (result discarded)
    cancelled: int = 0  # still queued at the drain deadline: answered 503, never ran
    refused_full: int = 0  # not accepted: queue full
    refused_closed: int = 0  # not accepted: draining

    def answered(self) -> int:
        return self.completed + self.failed + self.expired + self.abandoned + self.cancelled


class DeviceExecutor:
    def __init__(
        self,
        capacity: int,
        idle_hook: Callable[[], None] | None = None,
        idle_interval_s: float = 1.0,
        name: str = "rev88-device",
    ) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._idle_hook = idle_hook
        self._idle_interval_s = idle_interval_s
        self._queue: collections.deque[Job] = collections.deque()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._running: Job | None = None
        self._closed: str | None = None  # reason, once closed to new work
        self._stop = False
        self._mean_run_s = 1.0  # running mean of device time per job, for Retry-After
        self.stats = Stats()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._thread.start()

    def close(self, reason: str) -> None:
        """Refuse new jobs from now on; queued and running jobs continue."""
        with self._cond:
            if self._closed is None:
                self._closed = reason

    @property
    def closed(self) -> bool:
        return self._closed is not None

    def stop(self, timeout_s: float) -> bool:
        """Close, let the queue empty, end the thread; True if it ended within ``timeout_s``."""
        self.close("stopping")
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # ------------------------------------------------------------------ submitting
    def submit(self, fn: Callable[[], Any], kind: str = "task", label: str = "", reserved: bool = False) -> Job:
        """Queue ``fn`` for the device. ``reserved`` jobs (the warm-up) skip the capacity check."""
        job = Job(fn, kind, label)
        with self._cond:
            if self._closed is not None:
                self.stats.refused_closed += 1
                raise Unavailable(f"the service is {self._closed}; not accepting new tasks", retry_after=self._retry_after_locked())
            if not reserved and len(self._queue) >= self.capacity:
                self.stats.refused_full += 1
                raise QueueFull(
                    f"the device queue is full ({len(self._queue)} of {self.capacity} tasks waiting); retry later",
                    retry_after=self._retry_after_locked(),
                )
            self._queue.append(job)
            self.stats.accepted += 1
            self._cond.notify_all()
        return job

    def check_capacity(self) -> None:
        """Refuse early (before an upload is read) when the queue is already full."""
        with self._cond:
            if self._closed is None and len(self._queue) >= self.capacity:
                self.stats.refused_full += 1
                raise QueueFull(
                    f"the device queue is full ({len(self._queue)} of {self.capacity} tasks waiting); retry later",
                    retry_after=self._retry_after_locked(),
                )

    async def wait(self, job: Job, timeout_s: float | None) -> Any:
        """The job's answer; on timeout expire it (unless it finished first) and answer that."""
        fut = asyncio.wrap_future(job.future)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout_s)
        except TimeoutError:
            self.expire(job, timeout_s or 0.0)
            return await fut  # the result if the job won the race, else the TaskTimeout

    def expire(self, job: Job, timeout_s: float) -> None:
        with self._cond:
            if job.future.done():
                return
            now = time.monotonic()
            if job.state == QUEUED:
                self._queue.remove(job)
                job.state = EXPIRED
                self.stats.expired += 1
                err = TaskTimeout(
                    f"task timed out after {timeout_s:g} s waiting for the device; it never ran",
                    where="queued",
                )
            else:  # RUNNING: the device cannot be interrupted
                job.state = ABANDONED
                self.stats.abandoned += 1
                err = TaskTimeout(
                    f"task timed out after {timeout_s:g} s ({now - (job.started or now):.1f} s of it on the "
                    "device); it is still running and its result will be discarded",
                    where="running",
                )
            job.future.set_exception(err)
        log.warning("task timed out", extra={"task_id": job.label, "where": err.details["where"], "timeout_s": timeout_s})

    def abandon_all(self, reason: str) -> int:
        """Drain deadline: answer every queued and running job with 503 now. Returns how many."""
        n = 0
        with self._cond:
            while self._queue:
                job = self._queue.popleft()
                job.state = CANCELLED
                self.stats.cancelled += 1
                job.future.set_exception(Unavailable(f"{reason}; the task never ran", where="queued"))
                n += 1
            job = self._running
            if job is not None and not job.future.done():
                job.state = ABANDONED
                self.stats.abandoned += 1
                job.future.set_exception(
                    Unavailable(f"{reason} while the task was running; its result is lost", where="running")
                )
                n += 1
            self._cond.notify_all()
        return n

    # ------------------------------------------------------------------ state
    @property
    def depth(self) -> int:
        return len(self._queue)

    @property
    def busy(self) -> bool:
        return self._running is not None

    def in_flight(self) -> int:
        """Jobs accepted and not yet finished on the device (queued + running)."""
        with self._lock:
            return len(self._queue) + (1 if self._running is not None else 0)

    def retry_after(self) -> int:
        with self._lock:
            return self._retry_after_locked()

    def _retry_after_locked(self) -> int:
        ahead = len(self._queue) + (1 if self._running is not None else 0)
        return int(min(600, max(1, math.ceil(self._mean_run_s * max(ahead, 1)))))

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            running = self._running
            return {
                "depth": len(self._queue),
                "capacity": self.capacity,
                "running": None if running is None else {
                    "kind": running.kind,
                    "id": running.label,
                    "seconds": round(time.monotonic() - (running.started or time.monotonic()), 3),
                    "answered": running.future.done(),
                },
                "in_flight": len(self._queue) + (1 if running is not None else 0),
                "accepting": self._closed is None,
                "mean_device_seconds": round(self._mean_run_s, 4),
                **dataclasses.asdict(self.stats),
            }

    # ------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        while True:
            job = None
            with self._cond:
                if not self._queue and not self._stop:
                    self._cond.wait(self._idle_interval_s if self._idle_hook else None)
                if self._queue:
                    job = self._queue.popleft()
                    job.state = RUNNING
                    job.started = time.monotonic()
                    self._running = job
                elif self._stop:
                    return
            if job is None:
                self._idle()
                continue
            value, error = None, None
            try:
                value = job.fn()
            except BaseException as exc:  # noqa: BLE001 - every failure goes to the one answer
                error = exc
            self._finish(job, value, error)

    def _finish(self, job: Job, value: Any, error: BaseException | None) -> None:
        with self._cond:
            self._running = None
            job.finished = time.monotonic()
            self._mean_run_s = 0.7 * self._mean_run_s + 0.3 * (job.finished - (job.started or job.finished))
            discarded = job.future.done()  # answered already (timeout or drain deadline)
            if discarded:
                self.stats.abandoned_finished += 1
            else:
                job.state = DONE
                if error is None:
                    self.stats.completed += 1
                    job.future.set_result(value)
                else:
                    self.stats.failed += 1
                    job.future.set_exception(error)
            self._cond.notify_all()
        if discarded:
            log.warning(
                "task finished after it was answered; result discarded",
                extra={"task_id": job.label, "device_s": round(job.device_s or 0.0, 3),
                       "error": None if error is None else repr(error)},
            )

    def _idle(self) -> None:
        if self._idle_hook is None:
            return
        try:
            self._idle_hook()
        except Exception:  # an idle sample must never stop the device thread
            log.exception("idle hook failed")
