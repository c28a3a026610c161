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

import collections
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

from learner.cancel import CancelToken

from ..errors import Unavailable
from .admission import TenantAdmission
from .fair_share import FairShare
from .job_stops import JobStops
from .jobs import (  # noqa: F401 - the executor's names, as its users import them
    ABANDONED,
    CANCELLED,
    DONE,
    DROPPED,
    EXPIRED,
    QUEUED,
    RETURNED,
    RUNNING,
    STOP_WAIT_S,
    Batch,
    Job,
    Stats,
)
from .worker_loop import Worker, WorkerLoop, current_worker, select_cuda_device  # noqa: F401 - (its users import them here)

log = logging.getLogger("rev88." + __name__)

class DeviceExecutor(TenantAdmission, JobStops, WorkerLoop):
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
        tenant_name: Callable[[str], str] | None = None,
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
        # a tenant's name in refusals (the service's key ring names its keys)
        self.tenant_name: Callable[[str], str] = tenant_name or (lambda tenant: tenant or "admin/open")

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

