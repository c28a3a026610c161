"""The claim path over the embedded SQLite ledger: asynchronous work waits in the ledger here too.

With PostgreSQL, replicas claim queued asynchronous tasks from the shared database under leases
(app/ledger/postgres.py: ``claim``, ``release``, ``renew``, ``reap``). With SQLite one process
owns the ledger, so a claim needs no lease and no database write: ``LocalClaims`` keeps an index
of the ledger's waiting asynchronous tasks (per tenant, oldest first) and hands them out in
fair-share order; the rows stay ``queued`` until a worker starts them, exactly as the ledger has
them. The feeder (app/tasks/feeder.py) drives both stores through the same calls.

    load     at start: every unfinished asynchronous task of the ledger (a stop or a crash left
             it queued or running) waits again; returns how many
    add      a task just recorded queued (an upload, a sweep's or an evaluation's cell)
    claim    each tenant's oldest tasks, as many as the feeder's fair-share plan picks of it
             (app/tasks/feeder.py), then the oldest of any tenant; each claim is checked against
             the ledger (a task cancelled meanwhile is dropped)
    release  tasks claimed here that go back to wait (taken back out of the device queue, a
             drain, a failed queueing): in the index again, in their place
    backlog  the waiting tasks per tenant, and the stored bytes of waiting uploads

Nothing here survives the process: the ledger is the record; the next start loads it again.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable
from typing import Any

from .base import Claim, Renewal
from .store import UNFINISHED, TaskRecord

# an entry of the index: (created_at, task id, stored upload bytes)
Entry = tuple[float, str, int]


def owner_key(owner: str | None) -> str:
    """A tenant as the index and the feeder name it: its key id, or "" for the admin/an open service."""
    return owner or ""


class LocalClaims:
    leases = False  # no lease to renew, reap or release across processes
    lease_s = 0.0

    def __init__(self, ledger: Any) -> None:
        self.ledger = ledger
        self._waiting: dict[str, list[Entry]] = {}  # tenant -> its waiting tasks, oldest first
        self._ids: dict[str, str] = {}  # task id -> its tenant, while waiting
        self._bytes = 0
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ the index
    def load(self) -> int:
        """(blocking) Every unfinished asynchronous task of the ledger waits (again)."""
        records = [r for r in self.ledger.unfinished() if r.mode == "async"]
        for record in records:
            self.add_record(record)
        return len(records)

    def add_record(self, record: TaskRecord) -> None:
        self.add(record.id, record.options.get("owner"), record.created_at, _stored_bytes(record))

    def add(self, task_id: str, owner: str | None, created_at: float, stored_bytes: int = 0) -> None:
        tenant = owner_key(owner)
        with self._lock:
            if task_id in self._ids:
                return
            bisect.insort(self._waiting.setdefault(tenant, []), (created_at, task_id, stored_bytes))
            self._ids[task_id] = tenant
            self._bytes += stored_bytes

    def _pop(self, tenant: str) -> Entry:
        entries = self._waiting[tenant]
        entry = entries.pop(0)
        if not entries:
            del self._waiting[tenant]
        del self._ids[entry[1]]
        self._bytes -= entry[2]
        return entry

    def discard(self, task_id: str) -> None:
        """A waiting task that will not run (cancelled in the ledger): out of the index."""
        with self._lock:
            tenant = self._ids.get(task_id)
            if tenant is None:
                return
            entries = self._waiting[tenant]
            for i, entry in enumerate(entries):
                if entry[1] == task_id:
                    del entries[i]
                    self._bytes -= entry[2]
                    break
            if not entries:
                del self._waiting[tenant]
            del self._ids[task_id]

    def backlog(self) -> dict[str, int]:
        """tenant -> its tasks waiting here (not yet claimed)."""
        with self._lock:
            return {tenant: len(entries) for tenant, entries in self._waiting.items()}

    def waiting(self) -> dict[str, tuple[int, float]]:
        """tenant -> (its tasks waiting here, when its oldest was created)."""
        with self._lock:
            return {tenant: (len(entries), entries[0][0]) for tenant, entries in self._waiting.items()}

    def waiting_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._ids)

    # ------------------------------------------------------------------ the claim path
    def claim(self, limit: int, picks: list[tuple[str, int]] | None = None) -> list[Claim]:
        """(blocking) Up to ``limit`` waiting tasks: ``picks`` [(tenant, n)] -- each tenant's
        ``n`` oldest, the order fair share chose (app/runtime/fair_share.py, by the feeder) --
        then, up to ``limit``, the oldest of any tenant (None: only those); each one's status
        checked against the ledger (a task cancelled while it waited is dropped), its record not
        read (``Claim.record`` None: the feeder holds most of them, offered)."""
        if limit < 1:
            return []
        picked: list[tuple[str, Entry]] = []
        with self._lock:
            for tenant, n in picks or []:
                while n > 0 and len(picked) < limit and tenant in self._waiting:
                    picked.append((tenant, self._pop(tenant)))
                    n -= 1
            while len(picked) < limit and self._waiting:
                tenant = min(self._waiting, key=lambda t: self._waiting[t][0])
                picked.append((tenant, self._pop(tenant)))
        if not picked:
            return []
        try:
            statuses = self.ledger.statuses([entry[1] for _, entry in picked])
        except BaseException:
            for tenant, (created_at, task_id, stored) in picked:  # the ledger could not be read: they wait on
                self.add(task_id, tenant or None, created_at, stored)
            raise
        # (only asynchronous tasks wait here; one cancelled, or gone, while it waited has nothing to run)
        waiting = sorted(entry for _, entry in picked if statuses.get(entry[1]) in UNFINISHED)
        return [Claim(None, None, task_id) for _, task_id, _ in waiting]

    def release(self, task_ids: list[str]) -> list[str]:
        """(blocking) Claimed tasks that wait again (read back from the ledger: unfinished ones only)."""
        if not task_ids:
            return []
        records = self.ledger.get_many(list(task_ids))
        released = []
        for task_id in task_ids:
            record = records.get(task_id)
            if record is not None and not record.finished and record.mode == "async":
                self.add_record(record)
                released.append(task_id)
        return released

    def forget(self, task_ids: list[str]) -> None:
        """Nothing is held here (no lease)."""

    def held(self) -> list[str]:
        return []

    def held_epoch(self, task_id: str) -> None:
        return None

    def renew(self, attempts: dict[str, int] | None = None) -> Renewal:
        return Renewal(sorted(attempts or {}), [], [])

    def reap(self) -> dict[str, int]:
        return {"requeued": 0, "failed": 0, "cancelled": 0}

    def listen(self, on_notify: Callable[[str, str], None], stop: threading.Event, reconnect_s: float = 1.0) -> None:
        stop.wait()

    def load_uploads(self, task_ids: list[str]) -> dict[str, bytes]:
        out = {}
        for task_id in task_ids:
            try:
                out[task_id] = self.ledger.load_upload(task_id)
            except Exception:  # noqa: BLE001 - missing: the feeder fails that task, naming it
                continue
        return out

    def queue_depth(self) -> dict[str, Any]:
        """The backlog as the feeder and /health show it (in memory: no query)."""
        with self._lock:
            owners = {tenant: {"queued": len(entries)} for tenant, entries in self._waiting.items()}
            return {"queued": len(self._ids), "unclaimed": len(self._ids), "claimed": 0, "bytes": self._bytes,
                    "owners": owners}


def _stored_bytes(record: TaskRecord) -> int:
    """The bytes a waiting task keeps on disk: an upload's npz (a task on a stored dataset keeps none)."""
    return 0 if record.options.get("dataset") else int(record.body_bytes or 0)
