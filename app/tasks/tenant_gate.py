"""Who may queue what, by tenant, for the task runner (app/tasks/runner.py): a tenant's weight,
a key revoked while its work waited, a synchronous task's place in the device queue (its share:
app/runtime/admission.py), a key's max_queued."""

from __future__ import annotations

import asyncio
from typing import Any

from ..errors import Forbidden
from .work import Work


class TenantGate:
    """(A part of TaskRunner: its key ring, shares, feeder, executor, ledger and pending work.)"""

    def weight_of(self, tenant: str) -> float:
        """A tenant's fair-share weight ("" -- the admin, an open service -- weighs 1)."""
        return self.shares(tenant)[0] if tenant else 1.0

    def refusal(self, work: Work) -> Forbidden | None:
        """(a device worker, blocking on a key cache miss) Why this work may not run now that it
        reaches the device -- its tenant's key was revoked while it waited -- or None."""
        if work.owner is None or self.keys is None:
            return None
        reason = self.keys.barred(work.owner)
        return None if reason is None else Forbidden(f"{reason} while this task waited; it was not run")

    def others_waiting(self) -> dict[str, float]:
        """The tenants whose work waits in the ledger, with their weights."""
        return self.feeder.backlog_weights() if self.feeder is not None else {}

    def check_sync_capacity(self, owner: str | None) -> None:
        """Before a synchronous task's body is read: QueueFull unless its tenant may have a place
        in the device queue now (its share, app/runtime/executor.py)."""
        tenant = owner or ""
        self.executor.check_capacity(tenant, self.weight_of(tenant), self.others_waiting())

    def unfinished_of(self, owner: str) -> int:
        """(blocking) The tenant's queued and running tasks: the ledger's, and this process's
        synchronous ones that are recorded only once they finish."""
        unrecorded_here = sum(1 for w in list(self.pending.values())
                              if w.deferred and w.owner == owner and w.finished is None)
        return self.ledger.count_unfinished(owner) + unrecorded_here

    async def check_queued(self, tenant: Any, adding: int) -> None:
        """TooManyRequests when ``adding`` more tasks would pass the tenant's max_queued."""
        key = getattr(tenant, "key", None)
        if key is None or key.max_queued is None:
            return
        count = await asyncio.to_thread(self.unfinished_of, tenant.id)
        self.keys.check_queued(tenant, adding, count)
