"""The device queue's admission by tenant (issue #44) and its fair share (issue #54), for the
executor (app/runtime/executor.py, which holds the lock every method here is called under or takes).

A synchronous job is admitted against its tenant's *share* of the queue: ``capacity`` divided by
weight among the tenants with work waiting -- in the queue, in the ledger's backlog (``others``),
and the tenant itself -- at least one place each; past it, refused (503) however empty the queue;
within it, a full queue makes room by taking back the newest fed job of the tenant furthest over
its own share. Which queued job runs next, and which tenants' waiting work the feeder claims, is
fair share by virtual time (app/runtime/fair_share.py).
"""

from __future__ import annotations

import collections
import math

from ..errors import QueueFull, Requeued
from .fair_share import Waiting
from .jobs import QUEUED, RETURNED, Job


class TenantAdmission:
    """(A part of DeviceExecutor: its queue, lock, capacity, stats and fair share.)"""

    def _full_locked(self) -> QueueFull:
        return QueueFull(
            f"the device queue is full ({len(self._queue)} of {self.capacity} tasks waiting, REV88_QUEUE_SIZE); retry later",
            retry_after=self._retry_after_locked(), limit="REV88_QUEUE_SIZE", value=self.capacity,
        )

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
        device queue's own order (what the feeder claims: app/tasks/feeder.py)."""
        with self._cond:
            return self.fair.order(n, waiting)
