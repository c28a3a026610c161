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

Dynamic batching. A job may carry a :class:`Batch`: a key, its own item, and how
to run many items in one device call. When the job at the head of the queue has
one, ``batch_max > 1`` and ``Batch.ready()`` says the device can take such a call,
the thread gathers the queued jobs with the same key (the head first, then in
queue order; at most ``batch_max``) and runs them in one call; each job is then
answered with its own item's outcome. The gathering waits at most ``batch_wait_s``
after the head was taken for more matching jobs to arrive (not at all once the
batch is full or the executor is closed); gathered jobs stay queued -- and may
expire, never to run -- until the call starts. Across keys the queue stays FIFO:
only matching jobs move ahead of others, and the head is always the oldest job,
so a job of another key waits behind at most one launch per job ahead of it.
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
from collections.abc import Callable, Hashable
from typing import Any

from .errors import QueueFull, TaskTimeout, Unavailable

log = logging.getLogger("rev88.app.executor")

QUEUED, RUNNING, DONE, EXPIRED, ABANDONED, CANCELLED = (
    "queued", "running", "done", "expired", "abandoned", "cancelled",
)


@dataclasses.dataclass(frozen=True, eq=False)
class Batch:
    """How a job may share one device call with other queued jobs of the same ``key``.

    ``run`` takes the items of the gathered jobs (in order) and returns one outcome per
    item: its value, or an exception instance that becomes that job's answer. It is
    called on the device thread, as is ``ready`` (whether jobs of this key can be
    batched now, e.g. the backend has a batched path; False, or an exception, runs
    the job alone through its ``fn``). Jobs of one key must be runnable by the first
    job's ``run``.
    """

    key: Hashable
    item: Any
    run: Callable[[list[Any]], list[Any]]
    ready: Callable[[], bool] = lambda: True


@dataclasses.dataclass(eq=False)
class Job:
    fn: Callable[[], Any]
    kind: str = "task"
    label: str = ""
    batch: Batch | None = None
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    state: str = QUEUED
    submitted: float = dataclasses.field(default_factory=time.monotonic)
    started: float | None = None
    finished: float | None = None
    launch_size: int = 1  # jobs in the device call that ran this one

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
    launches: int = 0  # device calls that ran jobs (a batched call counts once)
    batched: int = 0  # jobs that ran in a call shared with other jobs
    largest_launch: int = 0  # most jobs in one device call so far

    def answered(self) -> int:
        return self.completed + self.failed + self.expired + self.abandoned + self.cancelled


class DeviceExecutor:
    def __init__(
        self,
        capacity: int,
        idle_hook: Callable[[], None] | None = None,
        idle_interval_s: float = 1.0,
        name: str = "rev88-device",
        batch_max: int = 1,
        batch_wait_s: float = 0.0,
        on_launch: Callable[[int], None] | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        if batch_max < 1:
            raise ValueError("batch_max must be >= 1")
        if not (math.isfinite(batch_wait_s) and batch_wait_s >= 0):
            raise ValueError("batch_wait_s must be a finite number >= 0")
        self.capacity = capacity
        self.batch_max = batch_max
        self.batch_wait_s = batch_wait_s
        self._on_launch = on_launch
        self._idle_hook = idle_hook
        self._idle_interval_s = idle_interval_s
        self._queue: collections.deque[Job] = collections.deque()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._running: list[Job] = []  # the jobs of the device call in progress
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
    def submit(self, fn: Callable[[], Any], kind: str = "task", label: str = "", reserved: bool = False,
               batch: Batch | None = None) -> Job:
        """Queue ``fn`` for the device. ``reserved`` jobs (the warm-up) skip the capacity check.
        With ``batch``, the job may instead run in one call with queued jobs of the same key."""
        job = Job(fn, kind, label, batch)
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
            self._cond.notify_all()  # a gathering that waits on this job stops waiting
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
            for job in self._running:
                if job.future.done():
                    continue
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
        return bool(self._running)

    def in_flight(self) -> int:
        """Jobs accepted and not yet finished on the device (queued + running)."""
        with self._lock:
            return len(self._queue) + len(self._running)

    def retry_after(self) -> int:
        with self._lock:
            return self._retry_after_locked()

    def _retry_after_locked(self) -> int:
        ahead = len(self._queue) + len(self._running)
        return int(min(600, max(1, math.ceil(self._mean_run_s * max(ahead, 1)))))

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            group = list(self._running)
            first = group[0] if group else None
            return {
                "depth": len(self._queue),
                "capacity": self.capacity,
                "running": None if first is None else {
                    "kind": first.kind,
                    "id": first.label,
                    "seconds": round(time.monotonic() - (first.started or time.monotonic()), 3),
                    "answered": all(j.future.done() for j in group),
                    "jobs": len(group),
                },
                "in_flight": len(self._queue) + len(group),
                "accepting": self._closed is None,
                "mean_device_seconds": round(self._mean_run_s, 4),
                "batch_max": self.batch_max,
                "batch_wait_ms": round(self.batch_wait_s * 1000.0, 3),
                **dataclasses.asdict(self.stats),
            }

    # ------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        while True:
            with self._cond:
                if not self._queue and not self._stop:
                    self._cond.wait(self._idle_interval_s if self._idle_hook else None)
                head = self._queue[0] if self._queue else None
                if head is None and self._stop:
                    return
            if head is None:
                self._idle()
                continue
            batched = head.batch is not None and self.batch_max > 1 and self._batch_ready(head.batch)
            with self._cond:
                group = self._gather(head) if batched else self._take([head])
            if group:
                self._run(group)

    def _batch_ready(self, batch: Batch) -> bool:
        try:
            return bool(batch.ready())
        except Exception:  # e.g. the backend cannot be created: the job's own fn reports that
            log.debug("batch not ready; running the job alone", exc_info=True)
            return False

    def _gather(self, head: Job) -> list[Job]:
        """(Lock held.) Collect queued jobs of the head's key, waiting up to ``batch_wait_s``
        after taking the head for more; then take them off the queue. [] if the head is gone."""
        key = head.batch.key
        deadline = time.monotonic() + self.batch_wait_s
        while True:
            if head.state != QUEUED:  # expired or cancelled while we waited: start over
                return []
            group = [j for j in self._queue if j.batch is not None and j.batch.key == key][: self.batch_max]
            left = deadline - time.monotonic()
            if len(group) >= self.batch_max or left <= 0 or self._closed is not None or self._stop:
                return self._take(group)
            self._cond.wait(left)

    def _take(self, group: list[Job]) -> list[Job]:
        """(Lock held.) Move still-queued jobs of ``group`` from the queue onto the device."""
        group = [j for j in group if j.state == QUEUED]
        now = time.monotonic()
        for job in group:
            self._queue.remove(job)
            job.state = RUNNING
            job.started = now
            job.launch_size = len(group)
        self._running = group
        if group:
            self.stats.launches += 1
            self.stats.largest_launch = max(self.stats.largest_launch, len(group))
            if len(group) > 1:
                self.stats.batched += len(group)
        return group

    def _run(self, group: list[Job]) -> None:
        if self._on_launch is not None:
            try:
                self._on_launch(len(group))
            except Exception:  # a metrics hiccup must not lose the jobs
                log.exception("launch hook failed")
        outcomes: list[tuple[Any, BaseException | None]]
        if len(group) == 1:
            try:
                outcomes = [(group[0].fn(), None)]
            except BaseException as exc:  # noqa: BLE001 - every failure goes to the one answer
                outcomes = [(None, exc)]
        else:
            try:
                values = group[0].batch.run([j.batch.item for j in group])
                if len(values) != len(group):
                    raise RuntimeError(f"a batched call returned {len(values)} outcomes for {len(group)} jobs")
                outcomes = [(None, v) if isinstance(v, BaseException) else (v, None) for v in values]
            except BaseException as exc:  # noqa: BLE001 - the whole call failed: each job gets that answer
                outcomes = [(None, exc)] * len(group)
        self._finish(group, outcomes)

    def _finish(self, group: list[Job], outcomes: list[tuple[Any, BaseException | None]]) -> None:
        discarded: list[tuple[Job, BaseException | None]] = []
        with self._cond:
            self._running = []
            now = time.monotonic()
            started = group[0].started or now
            # Retry-After: device seconds per job (a batched call shares its time among its jobs)
            self._mean_run_s = 0.7 * self._mean_run_s + 0.3 * (now - started) / len(group)
            for job, (value, error) in zip(group, outcomes):
                job.finished = now
                if job.future.done():  # answered already (timeout or drain deadline)
                    self.stats.abandoned_finished += 1
                    discarded.append((job, error))
                    continue
                job.state = DONE
                if error is None:
                    self.stats.completed += 1
                    job.future.set_result(value)
                else:
                    self.stats.failed += 1
                    job.future.set_exception(error)
            self._cond.notify_all()
        for job, error in discarded:
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
