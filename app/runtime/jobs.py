"""A device job and its bookkeeping: what the executor (app/runtime/executor.py) queues, gathers
into launches and answers once, through its future."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Callable, Hashable
from typing import Any

from learner.cancel import CancelToken

QUEUED, RUNNING, DONE, EXPIRED, ABANDONED, CANCELLED, DROPPED, RETURNED = (
    "queued", "running", "done", "expired", "abandoned", "cancelled", "dropped", "returned",
)
STOP_WAIT_S = 10.0  # how long a timed-out request waits for its running task to confirm the stop

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
