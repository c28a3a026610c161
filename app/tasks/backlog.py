"""The ledger's backlog as one replica's feeder knows it (app/tasks/feeder.py): its limits, the work
offered here (its parsed arrays kept a while, to be run without reading it back), and its waiting
work per tenant, as fair share weighs it.

    backlog   the ledger's waiting asynchronous work is bounded by REV88_BACKLOG_SIZE tasks (every
              task a request adds: a sweep's cells all count) and REV88_BACKLOG_BYTES of stored
              uploads (cells on a stored dataset keep none): ``check_capacity``, a 503 naming the
              limit; each tenant by its key's max_queued (the runner's check)
    offered   asynchronous work just recorded here; a cancelled one leaves the backlog at once
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from learner.cancel import CancelToken

from ..errors import QueueFull
from ..ledger import LedgerUnavailable
from ..ledger.local_claims import owner_key
from ..runtime.fair_share import Waiting
from .work import Work

CELL_WEIGHT = 1 / 40  # an offered task on a stored dataset (no arrays of its own) against an upload
# Offered tasks' parsed arrays kept for this replica's own claim: at most this many bytes, this
# long (a task another replica claimed is simply forgotten; this one then reads no body back)
OFFER_CACHE_BYTES = 256 << 20
OFFER_CACHE_S = 30.0


class Backlog:
    """(A part of Feeder: its ledger, offered cache, limits and counters.)"""

    def backlog(self) -> dict[str, Any]:
        """The ledger's waiting asynchronous work: tasks, stored upload bytes, per tenant (as last
        counted; SQLite's is exact)."""
        depth = self.ledger.queue_depth() if not self.leases else (self.depth or {})
        return {"tasks": depth.get("queued", 0), "bytes": depth.get("bytes", 0), "limit": self.limit,
                "limit_bytes": self.limit_bytes, "owners": depth.get("owners", {})}

    def check_capacity(self, adding: int = 1, uploads: bool = True) -> None:
        """Before asynchronous work is read or recorded: refuse (503) while the ledger's backlog
        is full -- ``adding`` more tasks would pass REV88_BACKLOG_SIZE, or (``uploads``: each
        keeps its npz) the waiting uploads already hold REV88_BACKLOG_BYTES."""
        backlog = self.backlog()
        retry = max(1, round(self.poll_s * 2))
        if backlog["tasks"] + adding > self.limit:
            self.counters["refused_backlog"] += 1
            raise QueueFull(
                f"the ledger's backlog is full ({backlog['tasks']} asynchronous tasks waiting; {adding} more would "
                f"pass REV88_BACKLOG_SIZE {self.limit}); retry later", retry_after=retry,
                limit="REV88_BACKLOG_SIZE", value=self.limit, waiting=backlog["tasks"])
        if uploads and self.limit_bytes is not None and backlog["bytes"] >= self.limit_bytes:
            self.counters["refused_backlog"] += 1
            raise QueueFull(
                f"the ledger's backlog is full (the waiting uploads hold {backlog['bytes']} bytes, REV88_BACKLOG_BYTES "
                f"{self.limit_bytes}); retry later", retry_after=retry, limit="REV88_BACKLOG_BYTES",
                value=self.limit_bytes, waiting_bytes=backlog["bytes"])

    def offer(self, acc: Work) -> None:
        """Asynchronous work just recorded (queued) here: the feeder claims it by fair share (with
        a shared ledger, whichever replica is idle); this one keeps its parsed arrays a while, to
        run it without reading it back."""
        acc.wait()
        size = acc.task.train_images.nbytes + acc.task.test_images.nbytes if acc.dataset is None else 0
        self.offered[acc.task_id] = (acc, time.monotonic(), size)
        self.offered_bytes += size
        self.offered_weight += 1.0 if size else CELL_WEIGHT
        self._trim_offered()
        if not self.leases:
            self.ledger.add(acc.task_id, acc.owner, acc.created_at, 0 if acc.dataset is not None else acc.body_bytes)
        elif self.depth is not None:
            owners = dict(self.depth.get("owners") or {})
            mine = dict(owners.get(owner_key(acc.owner)) or {})
            mine["queued"] = mine.get("queued", 0) + 1
            mine["unclaimed"] = mine.get("unclaimed", 0) + 1
            owners[owner_key(acc.owner)] = mine
            self.depth = {**self.depth, "queued": self.depth.get("queued", 0) + 1, "owners": owners}
        self.wake()

    def discard(self, task_id: str) -> None:
        """A waiting task cancelled in the ledger (SQLite): out of the backlog and the cache."""
        self._take_offered(task_id)
        if not self.leases:
            self.ledger.discard(task_id)

    def _take_offered(self, task_id: str) -> Work | None:
        entry = self.offered.pop(task_id, None)
        if entry is None:
            return None
        self.offered_bytes -= entry[2]
        self.offered_weight -= 1.0 if entry[2] else CELL_WEIGHT
        return entry[0]

    def _trim_offered(self) -> None:
        """Oldest out first, past the cache's bounds: OFFER_CACHE_BYTES of uploads' arrays, this many
        entries (a sweep's cells hold no arrays of their own -- they share their dataset's --, so
        each counts a fortieth of an upload: a 1,320-cell sweep stays here), OFFER_CACHE_S."""
        old = time.monotonic() - OFFER_CACHE_S
        while self.offered:
            _, (_, at, _) = next(iter(self.offered.items()))
            if (self.offered_weight <= self.cache_size and self.offered_bytes <= OFFER_CACHE_BYTES and at >= old):
                break
            _, (_, _, size) = self.offered.popitem(last=False)
            self.offered_bytes -= size
            self.offered_weight -= 1.0 if size else CELL_WEIGHT

    def backlog_tenants(self) -> dict[str, int]:
        """tenant -> its work waiting in the ledger, not yet claimed ("" the admin's/an open
        service's): SQLite's exactly; PostgreSQL's as last counted, with what was offered here since."""
        return {t: w[0] for t, w in self._backlog().items()}

    def _backlog(self) -> dict[str, tuple[int, float]]:
        """tenant -> (its unclaimed tasks, when its oldest was created)."""
        if not self.leases:
            return self.ledger.waiting()
        out = {t: (v.get("unclaimed", v.get("queued", 0)), v.get("oldest") or 0.0)
               for t, v in ((self.depth or {}).get("owners") or {}).items()}
        for acc, _, _ in self.offered.values():
            tenant = owner_key(acc.owner)
            count, oldest = out.get(tenant, (0, acc.created_at))
            out[tenant] = (max(count, 1), min(oldest, acc.created_at) if oldest else acc.created_at)
        return {t: w for t, w in out.items() if w[0] > 0}

    def backlog_weights(self) -> dict[str, float]:
        """tenant -> its weight, for the tenants whose work waits in the ledger (the device queue's
        shares count them as waiting)."""
        return {t: self.runner.weight_of(t) for t in self.backlog_tenants()}

    def waiting(self) -> dict[str, Waiting]:
        """The ledger's waiting work per tenant, as fair share weighs it."""
        return {t: Waiting(self.runner.weight_of(t), oldest, count) for t, (count, oldest) in self._backlog().items()}

    async def returned(self, acc: Work) -> None:
        """A fed task taken back out of the device queue before it ran: it waits in the ledger
        again (its claim released), its parsed arrays kept here for its next claim."""
        self.counters["returned"] += 1
        acc.cancel = CancelToken()
        acc.job = None
        try:
            released = await asyncio.to_thread(self.ledger.release, [acc.task_id])
        except LedgerUnavailable as exc:  # (PostgreSQL: its lease expires instead, and it is reaped)
            self.ledger.forget([acc.task_id])
            self._failed("give back a returned task", exc)
            return
        if released:
            size = 0 if acc.dataset is not None else acc.task.train_images.nbytes + acc.task.test_images.nbytes
            self.offered[acc.task_id] = (acc, time.monotonic(), size)
            self.offered_bytes += size
            self.offered_weight += 1.0 if size else CELL_WEIGHT
            self._trim_offered()
        self.wake()

