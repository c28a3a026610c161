"""What the feeder (app/tasks/feeder.py) is built from: its plan (``FeedPlan``) and what it needs of
the runner that owns it (``Runs``) -- the feeder's imports point one way: the runner builds the
feeder, never the reverse."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from ..ledger import TaskRecord
from .work import Work

if TYPE_CHECKING:
    from ..runtime.executor import DeviceExecutor
    from .datasets import DatasetCatalog


class Runs(Protocol):
    """What the feeder needs of the runner that owns it (app/tasks/runner.py): its queue and
    what waits in it, its ledger and datasets, the one way in, a tenant's weight and a task's
    record (the feeder's imports point one way: the runner builds the feeder, never the reverse)."""

    executor: DeviceExecutor
    ledger: Any
    pending: dict[str, Work]
    datasets: DatasetCatalog

    async def submit(self, work: Work | list[Work], **how: Any) -> Any: ...

    def weight_of(self, tenant: str) -> float: ...

    async def get(self, task_id: str) -> TaskRecord | None: ...


@dataclasses.dataclass(frozen=True)
class FeedPlan:
    """How the feeder takes work: the replica's workers and launches, its device queue, the
    leases' renewal and the claims' poll, the backlog's bounds, and ``ready``: whether this replica
    may take work (its warm-up has passed; claims wait for it)."""

    workers: int
    batch_max: int
    queue_size: int
    lease_renew_s: float
    claim_poll_s: float
    backlog_size: int | None = None
    backlog_bytes: int | None = None
    ready: Callable[[], bool] | None = None
