"""The device workers: one thread per device, all fed by one bounded queue.

A *worker* owns one device (``cpu:0``, ``cpu:1``, ... for the CPU backends, one per usable
core; ``cuda:0``, ``cuda:1``, ... for the GPU backends, one per visible GPU) and runs one
device call at a time. Only work that needs a device runs on a worker (the backend's run,
the warm-up, energy measurements, idle power sampling); parsing, validation and input
hashing happen before ``submit``, in other threads. Code running on a worker learns its
device from :func:`current_worker`.

Every accepted job is answered exactly once, through its ``future``:

* a worker finishes it                   -> its result or its exception;
* it is stopped while queued (timeout,   -> removed from the queue, never runs: ``TaskTimeout``
  its client gone, cancelled)               or ``TaskStopped``;
* it is stopped while running            -> its cancel token is set; the backend stops at its
                                            next safe point (a minibatch on cpu/cpu-fast, an
                                            epoch on cuda; a fused launch cannot be stopped)
                                            and the job is answered with the stop;
* the drain deadline passes at shutdown   -> ``Unavailable`` for queued and running jobs alike
                                            (running ones are also told to stop).

Whoever settles the future first wins (under one lock); the others see it done.
The queue depth counts only jobs waiting for a device; a running job holds its worker.

A job may be *pinned* to one worker (the per-device warm-up); any other job runs on the
first free worker, oldest job first.

Admission by tenant (issue #44). The queue holds at most ``capacity`` jobs, whoever sends them
(only the warm-up is ``reserved``). Work fed from the ledger (asynchronous tasks, sweep and
evaluation cells, recovered work: ``evictable``) is admitted only while there is room, and may be
taken back out (answered ``Requeued``: it waits in the ledger again) to make room for a
synchronous task. A synchronous job is admitted against its tenant's *share* of the queue:
``capacity`` divided by weight among the tenants with work waiting -- in the queue, in the
ledger's backlog (``others``), and the tenant itself -- at least one place each. Past its share it
is refused (503, naming the share and the tenant's figure) however empty the queue; within it, a
full queue makes room by taking back the newest fed job of the tenant furthest over its own
share, and only a queue full of synchronous jobs refuses it. Jobs admitted before another tenant
came keep their places (a client waits on each); from then on a tenant past its share gets no new
place until its count drops under it.

Dynamic batching. A job may carry a :class:`Batch`: a key, its own item, and how to run
many items in one device call. When the job a worker takes has one, ``batch_max > 1`` and
``Batch.ready()`` says the device can take such a call, the worker gathers the queued jobs
with the same key (that job first, then in queue order; at most ``batch_max``) and runs them
in one call; each job is then answered with its own item's outcome. The gathering waits at
most ``batch_wait_s`` for more matching jobs (not at all once the batch is full or the
executor is closed); gathered jobs stay queued -- and may expire, never to run -- until the
call starts. Across keys the queue stays FIFO: only matching jobs move ahead of others.
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
from collections.abc import Awaitable, Callable, Hashable
from typing import Any

from learner.cancel import CancelToken
from learner.errors import TaskCancelled

from ..errors import NotAccepted, QueueFull, Requeued, TaskStopped, TaskTimeout, Unavailable
from ..threads import name_os_thread
from .fair_share import FairShare, Waiting

log = logging.getLogger("rev88." + __name__)

QUEUED, RUNNING, DONE, EXPIRED, ABANDONED, CANCELLED, DROPPED, RETURNED = (
    "queued", "running", "done", "expired", "abandoned", "cancelled", "dropped", "returned",
)
STOP_WAIT_S = 10.0  # how long a timed-out request waits for its running task to confirm the stop

_local = threading.local()


def current_worker() -> Worker | None:
    """The worker whose thread is running this code (None outside a worker)."""
    return getattr(_local, "worker", None)


@dataclasses.dataclass(frozen=True, eq=False)
class Batch:
    """How a job may share one device call with other queued jobs of the same ``key``.

    ``run`` takes the items of the gathered jobs (in order) and returns one outcome per
    item: its value, or an exception instance that becomes that job's answer. It is
    called on the worker, as is ``ready`` (whether jobs of this key can be batched now,
    e.g. the backend has a batched path; False, or an exception, runs the job alone
    through its ``fn``). Jobs of one key must be runnable by the first job's ``run``.
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
    pin: int | None = None  # the index of the only worker that may run it
    cancel: CancelToken = dataclasses.field(default_factory=CancelToken)
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    state: str = QUEUED
    submitted: float = dataclasses.field(default_factory=time.monotonic)
    started: float | None = None
    finished: float | None = None
    launch_size: int = 1  # jobs in the device call that ran this one
    worker: str | None = None  # the device of the worker that ran it
    stop: tuple[str, str] | None = None  # (why, message) once it was told to stop while running
    on_start: Callable[[Job], None] | None = None  # called on the worker when the job starts
    # fair share (issue #33): whose job it is, that tenant's weight and its running limit
    tenant: str = ""
    weight: float = 1.0
    max_running: int | None = None
    evictable: bool = False  # fed from the ledger: may go back there to make room (admission by tenant)
    cost: float = 1.0  # its estimated device work (fair share: app/runtime/fair_share.py)
    tag: float = 0.0  # its start tag in virtual time: the lowest runs next

    @property
    def queue_wait_s(self) -> float | None:
        return None if self.started is None else self.started - self.submitted

    @property
    def device_s(self) -> float | None:
        """Seconds this job held its device (None until it has finished)."""
        return None if self.started is None or self.finished is None else self.finished - self.started


@dataclasses.dataclass
class Stats:
    accepted: int = 0  # jobs put on the queue
    completed: int = 0  # ran and answered with a result
    failed: int = 0  # ran and answered with the error they raised
    expired: int = 0  # timed out while queued: answered 504, never ran
    dropped: int = 0  # left the queue without running: client gone or cancelled
    stopped: int = 0  # stopped on the device before the end (timeout, client gone, cancel, drain)
    abandoned: int = 0  # answered (504 or shutdown 503) while still running on the device
    abandoned_finished: int = 0  # ... of which have since finished (result discarded)
    cancelled: int = 0  # still queued at the drain deadline: answered 503, never ran
    refused_full: int = 0  # not accepted: queue full
    refused_share: int = 0  # not accepted: its tenant's share of the queue taken (of refused_full)
    returned: int = 0  # fed jobs taken back out of the queue for a synchronous one (they wait in the ledger)
    deepest: int = 0  # the most jobs the queue has held at once (never past capacity but for the warm-up)
    refused_closed: int = 0  # not accepted: draining
    refused_input: int = 0  # not accepted after all: its job found its body invalid (app.errors.NotAccepted)
    launches: int = 0  # device calls that ran jobs (a batched call counts once)
    batched: int = 0  # jobs that ran in a call shared with other jobs
    largest_launch: int = 0  # most jobs in one device call so far

    def answered(self) -> int:
        return (self.completed + self.failed + self.expired + self.dropped + self.abandoned + self.cancelled
                + self.refused_input)


def select_cuda_device(device: str) -> None:
    """Make ``cuda:N`` the calling thread's current CUDA device (the CUDA runtime keeps one per
    host thread: without it every worker's bare ``cuda`` work, and every library that uses the
    current device, would land on GPU 0). A CPU worker, or a machine without CUDA (where the GPU
    backends refuse on their own): nothing to select."""
    kind, _, index = device.partition(":")
    if kind != "cuda":
        return
    import torch

    if torch.cuda.is_available():
        torch.cuda.set_device(int(index or 0))


class Worker:
    """One device and the thread that runs its calls."""

    def __init__(self, executor: DeviceExecutor, index: int, device: str) -> None:
        self.executor, self.index, self.device = executor, index, device
        self.running: list[Job] = []  # the jobs of the device call in progress
        self.tasks = 0  # jobs this worker has run
        self.launches = 0
        self.busy_s = 0.0  # seconds spent in device calls
        self.failures = 0  # device calls that raised for every job in them
        self.thread = threading.Thread(target=self._loop, name=f"rev88-worker-{device}", daemon=True)

    def snapshot(self) -> dict[str, Any]:
        first = self.running[0] if self.running else None
        return {
            "index": self.index,
            "device": self.device,
            "busy": bool(self.running),
            "running": None if first is None else {
                "kind": first.kind,
                "id": first.label,
                "seconds": round(time.monotonic() - (first.started or time.monotonic()), 3),
                "jobs": len(self.running),
            },
            "tasks": self.tasks,
            "launches": self.launches,
            "busy_seconds": round(self.busy_s, 3),
            "failed_launches": self.failures,
        }

    def _loop(self) -> None:
        name_os_thread(f"rev88-w{self.index}")
        _local.worker = self
        self.executor.serve(self)


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
        devices: list[str] | None = None,
        select_device: Callable[[str], None] | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        if batch_max < 1:
            raise ValueError("batch_max must be >= 1")
        if not (math.isfinite(batch_wait_s) and batch_wait_s >= 0):
            raise ValueError("batch_wait_s must be a finite number >= 0")
        devices = list(devices or ["cpu:0"])
        if not devices or len(set(devices)) != len(devices):
            raise ValueError(f"devices must be distinct and at least one, got {devices}")
        self.capacity = capacity
        self.batch_max = batch_max
        self.batch_wait_s = batch_wait_s
        self._on_launch = on_launch
        self._select_device = select_device  # each worker's first call on its thread (None: select_cuda_device)
        self._idle_hook = idle_hook
        self._idle_interval_s = idle_interval_s
        self._queue: collections.deque[Job] = collections.deque()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._closed: str | None = None  # reason, once closed to new work
        self._stop = False
        self._mean_run_s = 1.0  # running mean of device time per job, for Retry-After
        self._gathering: dict[Hashable, int] = {}  # batch key -> the worker gathering a launch of it
        self.stats = Stats()
        self.workers = [Worker(self, i, device) for i, device in enumerate(devices)]
        self.fair = FairShare()  # which tenant's job runs next (app/runtime/fair_share.py); under the lock
        self._running: collections.Counter[str] = collections.Counter()  # tenant -> jobs running
        self.tenant_name: Callable[[str], str] = lambda tenant: tenant or "admin/open"  # for refusals

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        for worker in self.workers:
            worker.thread.start()

    def close(self, reason: str) -> None:
        """Refuse new jobs from now on; queued and running jobs continue."""
        with self._cond:
            if self._closed is None:
                self._closed = reason

    @property
    def closed(self) -> bool:
        return self._closed is not None

    def stop(self, timeout_s: float) -> bool:
        """Close, let the queue empty, end every worker; True if all ended within ``timeout_s``."""
        self.close("stopping")
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        deadline = time.monotonic() + timeout_s
        for worker in self.workers:
            if worker.thread.is_alive():
                worker.thread.join(max(0.0, deadline - time.monotonic()))
        return not any(w.thread.is_alive() for w in self.workers)

    # ------------------------------------------------------------------ submitting
    def submit(self, fn: Callable[[], Any], kind: str = "task", label: str = "", reserved: bool = False,
               batch: Batch | None = None, pin: int | None = None, cancel: CancelToken | None = None,
               on_start: Callable[[Job], None] | None = None, tenant: str = "", weight: float = 1.0,
               max_running: int | None = None, evictable: bool = False,
               others: dict[str, float] | None = None, cost: float | None = None) -> Job:
        """Queue ``fn`` for a device. ``reserved`` jobs (the warm-up) skip the capacity check;
        ``evictable`` ones (fed from the ledger) take only a free place and may be taken back out;
        any other is admitted against its tenant's share (``others``: the weights of tenants
        whose work waits in the ledger). ``cost``: its estimated device work, charged to its
        tenant's virtual time as it enters (fair share; None: as its tenant's last job). ``pin`` names the one worker that may run it; ``cancel``
        is the token the job's run checks (a new one by default). With ``batch``, the job may
        instead run in one call with queued jobs of the same key."""
        if pin is not None and not 0 <= pin < len(self.workers):
            raise ValueError(f"pin must name a worker 0..{len(self.workers) - 1}, got {pin}")
        job = Job(fn, kind, label, batch, pin, cancel or CancelToken(), on_start=on_start, tenant=tenant,
                  weight=weight, max_running=max_running, evictable=evictable)
        taken_back = None
        with self._cond:
            if self._closed is not None:
                self.stats.refused_closed += 1
                raise Unavailable(f"the service is {self._closed}; not accepting new tasks", retry_after=self._retry_after_locked())
            if not reserved:
                if evictable:
                    if len(self._queue) >= self.capacity:
                        self.stats.refused_full += 1
                        raise self._full_locked()
                else:
                    taken_back = self._admit_locked(tenant, weight, others or {}, take_back=True)
            if reserved:
                job.tag = float("-inf")
            else:
                job.cost = self.fair.cost_of(tenant) if cost is None else cost
                job.tag = self.fair.enter(tenant, weight, job.cost)
            self._queue.append(job)
            self.stats.accepted += 1
            self.stats.deepest = max(self.stats.deepest, len(self._queue))
            self._cond.notify_all()
        if taken_back is not None:
            log.info("fed task taken back to the ledger for a synchronous one", extra={
                "task_id": taken_back.label, "tenant": taken_back.tenant, "for_tenant": tenant})
        return job

    def _full_locked(self) -> QueueFull:
        return QueueFull(
            f"the device queue is full ({len(self._queue)} of {self.capacity} tasks waiting, REV88_QUEUE_SIZE); retry later",
            retry_after=self._retry_after_locked(), limit="REV88_QUEUE_SIZE", value=self.capacity,
        )

    # ------------------------------------------------------------------ admission by tenant
    def shares(self, others: dict[str, float] | None = None, tenant: str | None = None,
               weight: float = 1.0) -> dict[str, int]:
        """Each waiting tenant's share of the queue (``others``: tenants waiting in the ledger)."""
        with self._cond:
            return self._shares_locked(self._waiting_locked(others or {}, tenant, weight))

    def _waiting_locked(self, others: dict[str, float], tenant: str | None, weight: float) -> dict[str, float]:
        waiting = dict(others)
        for job in self._queue:
            if job.kind != "warmup":
                waiting[job.tenant] = job.weight
        if tenant is not None:
            waiting[tenant] = weight
        return waiting

    def _shares_locked(self, waiting: dict[str, float]) -> dict[str, int]:
        total = sum(max(w, 1e-9) for w in waiting.values()) or 1.0
        return {t: max(1, math.floor(self.capacity * max(w, 1e-9) / total + 1e-9)) for t, w in waiting.items()}

    def queued_by_tenant(self, hard_only: bool = False) -> collections.Counter[str]:
        """Jobs waiting in the queue per tenant (``hard_only``: the ones not fed from the ledger)."""
        with self._cond:
            return collections.Counter(j.tenant for j in self._queue
                                       if j.kind != "warmup" and not (hard_only and j.evictable))

    def running_by_tenant(self) -> dict[str, int]:
        with self._cond:
            return {t: n for t, n in self._running.items() if n > 0}

    def _admit_locked(self, tenant: str, weight: float, others: dict[str, float], take_back: bool) -> Job | None:
        """(Lock held.) Raise QueueFull unless a synchronous job of ``tenant`` may have a place;
        with ``take_back``, make that place (a fed job goes back to the ledger: returned)."""
        waiting = self._waiting_locked(others, tenant, weight)
        shares = self._shares_locked(waiting)
        share = shares[tenant]
        held = sum(1 for j in self._queue if j.tenant == tenant and not j.evictable and j.kind != "warmup")
        name = self.tenant_name(tenant)
        if held >= share and len(waiting) > 1:
            self.stats.refused_full += 1
            self.stats.refused_share += 1
            raise QueueFull(
                f"tenant {name!r} holds {held} of its share of {share} place(s) in the device queue "
                f"(REV88_QUEUE_SIZE {self.capacity}, shared by weight among the {len(waiting)} tenant(s) with "
                "work waiting); retry later", retry_after=self._retry_after_locked(), limit="device_queue_share",
                value=share, queued=held)
        if len(self._queue) < self.capacity:
            return None
        victim = self._victim_locked(shares)
        if victim is None and len(waiting) == 1:  # a tenant alone: the queue is simply full
            self.stats.refused_full += 1
            raise self._full_locked()
        if victim is None:
            self.stats.refused_full += 1
            raise QueueFull(
                f"the device queue is full ({len(self._queue)} of {self.capacity} tasks waiting, REV88_QUEUE_SIZE), "
                f"all of them synchronous tasks admitted before; tenant {name!r} holds {held} of its share of "
                f"{share}; retry later", retry_after=self._retry_after_locked(), limit="REV88_QUEUE_SIZE",
                value=self.capacity, queued=held)
        if take_back:
            self._return_locked(victim)
        return victim

    def _victim_locked(self, shares: dict[str, int]) -> Job | None:
        """(Lock held.) The fed job to take back: the newest of the tenant furthest over its share."""
        counts = collections.Counter(j.tenant for j in self._queue if j.kind != "warmup")
        fed = [j for j in self._queue if j.evictable and j.state == QUEUED]
        if not fed:
            return None
        over = max(fed, key=lambda j: (counts[j.tenant] - shares.get(j.tenant, 1), j.submitted))
        newest = [j for j in fed if j.tenant == over.tenant]
        return max(newest, key=lambda j: j.submitted)

    def _return_locked(self, job: Job) -> None:
        self._dequeue_locked(job)
        job.state = RETURNED
        self.stats.returned += 1
        job.future.set_exception(Requeued(f"task {job.label} went back to the ledger to make room in the device "
                                          "queue; it runs later", where="queued"))
        self._cond.notify_all()

    def check_capacity(self, tenant: str = "", weight: float = 1.0, others: dict[str, float] | None = None) -> None:
        """Refuse early (before an upload is read) when a synchronous job of ``tenant`` could not
        be admitted now (its share taken, or a queue full of synchronous jobs)."""
        with self._cond:
            if self._closed is None:
                self._admit_locked(tenant, weight, others or {}, take_back=False)

    def full(self) -> bool:
        """Whether ``check_capacity`` would refuse now (not counted as a refusal)."""
        return self._closed is None and len(self._queue) >= self.capacity

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

    # ------------------------------------------------------------------ state
    @property
    def depth(self) -> int:
        return len(self._queue)

    @property
    def busy(self) -> bool:
        return any(w.running for w in self.workers)

    def busy_workers(self) -> int:
        return sum(1 for w in self.workers if w.running)

    def in_flight(self) -> int:
        """Jobs accepted and not yet finished on a device (queued + running)."""
        with self._lock:
            return len(self._queue) + sum(len(w.running) for w in self.workers)

    def retry_after(self) -> int:
        with self._lock:
            return self._retry_after_locked()

    def mean_device_seconds(self) -> float:
        """The running mean of device seconds per job (a batched call's shared among its jobs)."""
        return self._mean_run_s

    def _retry_after_locked(self) -> int:
        ahead = len(self._queue) + sum(len(w.running) for w in self.workers)
        per_worker = max(ahead, 1) / len(self.workers)
        return int(min(600, max(1, math.ceil(self._mean_run_s * per_worker))))

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            groups = [w.running for w in self.workers if w.running]
            first = groups[0][0] if groups else None
            return {
                "depth": len(self._queue),
                "capacity": self.capacity,
                "running": None if first is None else {
                    "kind": first.kind,
                    "id": first.label,
                    "seconds": round(time.monotonic() - (first.started or time.monotonic()), 3),
                    "answered": all(j.future.done() for j in groups[0]),
                    "jobs": len(groups[0]),
                    "device": first.worker,
                },
                "running_jobs": sum(len(g) for g in groups),
                "in_flight": len(self._queue) + sum(len(g) for g in groups),
                "accepting": self._closed is None,
                "mean_device_seconds": round(self._mean_run_s, 4),
                "batch_max": self.batch_max,
                "batch_wait_ms": round(self.batch_wait_s * 1000.0, 3),
                "workers": [w.snapshot() for w in self.workers],
                **dataclasses.asdict(self.stats),
            }

    # ------------------------------------------------------------------ the workers' side
    def serve(self, worker: Worker) -> None:
        """The loop of a worker's thread (``Worker.thread`` runs it; nothing else calls it): select
        the worker's device, then until ``stop``, take the job it runs next (``_next_for``) and run
        it -- alone, or with the queued jobs of its batch key gathered into one call -- and, while
        no job waits for it, call the idle hook every ``idle_interval_s``."""
        try:
            (self._select_device or select_cuda_device)(worker.device)  # (looked up now: tests replace it)
        except Exception as exc:  # noqa: BLE001 - said loudly; its jobs then fail on the device itself
            log.error("worker cannot select its device", extra={"device": worker.device, "error": str(exc)})
        while True:
            with self._cond:
                head = self._next_for(worker)
                if head is None and not self._stop:
                    self._cond.wait(self._idle_interval_s if self._idle_hook else None)
                    head = self._next_for(worker)
                if head is None and self._stop:
                    return
            if head is None:
                self._idle()
                continue
            batched = head.batch is not None and self.batch_max > 1 and self._batch_ready(head.batch)
            with self._cond:
                group = self._gather(worker, head) if batched else self._take(worker, [head])
            if group:
                self._run(worker, group)

    def _next_for(self, worker: Worker) -> Job | None:
        """(Lock held.) The job this worker runs next: of each tenant's oldest job it may run (not
        pinned elsewhere, not of a batch key another worker is gathering, its tenant below its
        running limit), the one with the lowest start tag in virtual time (app/runtime/fair_share.py:
        the tenant served least for its weight; ties: the job that has waited longest). FIFO within
        a tenant; with one tenant, FIFO."""
        heads: dict[str, Job] = {}
        for job in self._queue:
            if job.tenant in heads:
                continue
            if job.pin is not None and job.pin != worker.index:
                continue
            if job.batch is not None and self._gathering.get(job.batch.key, worker.index) != worker.index:
                continue
            if job.max_running is not None and self._running[job.tenant] >= job.max_running:
                continue
            heads[job.tenant] = job
        if len(heads) <= 1:
            return next(iter(heads.values()), None)
        return min(heads.values(), key=lambda j: (j.tag, j.submitted))

    def _dequeue_locked(self, job: Job) -> None:
        """(Lock held.) A queued job leaves the queue without running: its charge given back."""
        self._queue.remove(job)
        if job.tag != float("-inf"):
            self.fair.leave(job.tenant, job.tag, job.weight, job.cost)

    def fair_waiting(self, tenants: set[str]) -> None:
        """The tenants whose work waits in the ledger now (fair share: one back from idle re-enters
        at the current virtual time)."""
        with self._cond:
            self.fair.waiting(tenants)

    def fair_order(self, n: int, waiting: dict[str, Waiting]) -> list[str]:
        """The tenants whose waiting work (in the ledger) would be served next, ``n`` picks in the
        device queue's own order (what the feeder claims: app/tasks/claims.py)."""
        with self._cond:
            return self.fair.order(n, waiting)

    def fair_snapshot(self) -> dict[str, float]:
        """Each tenant's virtual time ahead of the device's (/health)."""
        with self._cond:
            return self.fair.snapshot()

    def _batch_ready(self, batch: Batch) -> bool:
        try:
            return bool(batch.ready())
        except Exception:  # e.g. the backend cannot be created: the job's own fn reports that
            log.debug("batch not ready; running the job alone", exc_info=True)
            return False

    def _gather(self, worker: Worker, head: Job) -> list[Job]:
        """(Lock held.) Collect queued jobs of the head's key, waiting up to ``batch_wait_s``
        for more; then take them off the queue. [] if the head is gone (or another worker
        took it)."""
        key = head.batch.key
        if self._gathering.setdefault(key, worker.index) != worker.index:
            return []  # another worker gathers this key (it became so while the lock was free)
        try:
            deadline = time.monotonic() + self.batch_wait_s
            while True:
                if head.state != QUEUED:  # expired, withdrawn or taken while we waited: start over
                    return []
                # the head, then the lowest start tags of its key (fair share: app/runtime/fair_share.py)
                group = sorted((j for j in self._queue if j.batch is not None and j.batch.key == key
                                and j.pin in (None, worker.index)),
                               key=lambda j: (j is not head, j.tag, j.submitted))[: self.batch_max]
                left = deadline - time.monotonic()
                if len(group) >= self.batch_max or left <= 0 or self._closed is not None or self._stop:
                    return self._take(worker, group)
                self._cond.wait(left)
        finally:
            del self._gathering[key]
            self._cond.notify_all()  # the others may take this key's jobs again

    def _take(self, worker: Worker, group: list[Job]) -> list[Job]:
        """(Lock held.) Move still-queued jobs of ``group`` from the queue onto the worker."""
        group = [j for j in group if j.state == QUEUED]
        now = time.monotonic()
        for job in group:
            self._queue.remove(job)
            job.state = RUNNING
            job.started = now
            job.launch_size = len(group)
            job.worker = worker.device
            self._running[job.tenant] += 1
        worker.running = group
        if group:
            self.fair.began(min(j.tag for j in group))
            self.stats.launches += 1
            self.stats.largest_launch = max(self.stats.largest_launch, len(group))
            if len(group) > 1:
                self.stats.batched += len(group)
            self._cond.notify_all()  # another worker's gathering may have lost its head
        return group

    def _run(self, worker: Worker, group: list[Job]) -> None:
        if self._on_launch is not None:
            try:
                self._on_launch(len(group))
            except Exception:  # a metrics hiccup must not lose the jobs
                log.exception("launch hook failed")
        for job in group:
            if job.on_start is not None:
                try:
                    job.on_start(job)
                except Exception:  # e.g. the ledger could not record "running": the run goes on
                    log.exception("job start hook failed", extra={"task_id": job.label})
        outcomes: list[tuple[Any, BaseException | None]]
        t0 = time.monotonic()
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
                worker.failures += 1
                log.error("device call failed for every job in it", extra={
                    "device": worker.device, "jobs": len(group), "error": repr(exc)})
        worker.busy_s += time.monotonic() - t0
        worker.tasks += len(group)
        worker.launches += 1
        self._finish(worker, group, outcomes)
        # A failed run's traceback holds this frame: without these locals, no cycle from it back to
        # the exception and the jobs (their closures hold the tasks' arrays) for the cyclic GC to find.
        del group, outcomes, job

    def _finish(self, worker: Worker, group: list[Job], outcomes: list[tuple[Any, BaseException | None]]) -> None:
        discarded: list[tuple[Job, BaseException | None]] = []
        with self._cond:
            worker.running = []
            now = time.monotonic()
            started = group[0].started or now
            # Retry-After: device seconds per job (a batched call shares its time among its jobs)
            self._mean_run_s = 0.7 * self._mean_run_s + 0.3 * (now - started) / len(group)
            for job, (value, error) in zip(group, outcomes):
                job.finished = now
                self._running[job.tenant] -= 1
                if job.tag != float("-inf"):
                    self.fair.done(job.tenant)
                was_stopped = isinstance(error, TaskCancelled)
                if was_stopped:
                    self.stats.stopped += 1
                if job.future.done():  # answered already (drain deadline, or gave up waiting)
                    self.stats.abandoned_finished += 1
                    discarded.append((job, error))
                    continue
                job.state = DONE
                if error is None:
                    self.stats.completed += 1
                    job.future.set_result(value)
                    continue
                if isinstance(error, NotAccepted):
                    self.stats.refused_input += 1
                else:
                    self.stats.failed += 1
                if was_stopped and job.stop is not None:
                    error = self.stopped_error(job, error)
                job.future.set_exception(error)
            self._cond.notify_all()
        for job, error in discarded:
            log.warning(
                "task finished after it was answered; result discarded",
                extra={"task_id": job.label, "device_s": round(job.device_s or 0.0, 3),
                       "stopped": isinstance(error, TaskCancelled),
                       "error": None if error is None else repr(error)},
            )

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

    def _idle(self) -> None:
        if self._idle_hook is None:
            return
        try:
            self._idle_hook()
        except Exception:  # an idle sample must never stop a worker
            log.exception("idle hook failed")
