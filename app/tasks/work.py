"""One unit of work -- a task, a sweep's or an evaluation's cell, a measurement -- and its life.

Every unit lives the same life, whichever way it came in (an upload, a task on a stored dataset,
a cell, a claim from the ledger, a restart's recovery), and its state only moves forward, one
method per step (an illegal step raises ``IllegalStep``: a bug, said at once)::

    admitted --record--> recorded --wait--> waiting --queue--> queued --start--> running
        |                   |                  ^                  |                 |
        +------------------(queue)-------------|---(give_back)----+                 |
                                                                                    v
    (any state before told) ----------------finish----------------------------> finished --tell--> told

    admitted   checked and parsed (or to be parsed by its own job: ``late``), not yet anywhere
    recorded   in the ledger (durable: an asynchronous task's 202, a key's replay)
    waiting    in the ledger's backlog, for the feeder's fair-share claim (app/tasks/feeder.py)
    queued     in the device queue (a synchronous task from ``admitted`` or ``recorded``; a claim
               from ``waiting``); ``give_back``: taken back out for a synchronous task, it waits again
    running    on a device worker
    finished   its answer (or error) built by the finisher (app/tasks/finisher.py); ``finish``
               is taken once: the first outcome wins, a late one is dropped
    told       its outcome recorded (or handed to the ledger's next commit) and whoever waits told

Who moves it: the route and the runner's entry (admitted, record, wait, queue: app/tasks/runner.py),
the feeder (wait, queue, give_back), the device worker (start: app/runtime/executor.py's on_start),
the finisher (finish, tell). What stays the same for its whole life -- its config, options and
owner -- is set when it is admitted; ``options()`` is what the ledger keeps of it and
``from_record`` reads it back (a claim on another replica, a restart).
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import time
from collections.abc import Callable
from typing import Any

import orjson

from learner.cancel import CancelToken
from learner.config import Config
from learner.taskio import TaskArrays

from ..ledger import FinishedTask, TaskRecord
from .answers import input_hashes


class State(enum.Enum):
    ADMITTED = "admitted"
    RECORDED = "recorded"
    WAITING = "waiting"
    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"
    TOLD = "told"


class IllegalStep(RuntimeError):
    """A step its work's state does not allow: a bug in who moves it."""


S = State
_STEPS: dict[str, tuple[frozenset[State], State]] = {
    "record": (frozenset({S.ADMITTED}), S.RECORDED),
    "wait": (frozenset({S.RECORDED, S.WAITING}), S.WAITING),
    "queue": (frozenset({S.ADMITTED, S.RECORDED, S.WAITING}), S.QUEUED),
    "give_back": (frozenset({S.QUEUED}), S.WAITING),
    "start": (frozenset({S.QUEUED}), S.RUNNING),
    "tell": (frozenset({S.FINISHED}), S.TOLD),
}


@dataclasses.dataclass(eq=False)
class Work:
    """Everything a unit of work needs, now or after a restart (``options()`` is what the ledger keeps)."""

    task_id: str
    task: TaskArrays | None  # None until ``late`` has run (on the device worker)
    config: Config
    backend: str
    include_scores: bool = False
    measure: dict[str, Any] | None = None
    mode: str = "sync"
    request_id: str | None = None
    t0: float = dataclasses.field(default_factory=time.perf_counter)  # arrival (perf_counter)
    receive_s: float = 0.0
    parse_s: float = 0.0
    cancel: CancelToken = dataclasses.field(default_factory=CancelToken)
    job: Any = None  # its device job while queued or running (app/runtime/executor.py)
    # A synchronous task without an Idempotency-Key is recorded once, when it has finished (its
    # client holds the answer): nothing is written before it runs, nothing waits for the disk.
    deferred: bool = False
    created_at: float = dataclasses.field(default_factory=time.time)
    body_bytes: int = 0
    started_at: float | None = None
    device: str | None = None
    # A deferred task's body (synchronous, no batching) is parsed and budget-checked by its own job, on the
    # device worker, not on the event loop: ``late()`` returns the task or raises what refuses it.
    late: Callable[[], TaskArrays] | None = None
    # A deferred task answered, its one record on its way to the ledger (its group commit): it
    # stays in the runner's ``pending`` with this until the ledger has it, and reads as finished meanwhile.
    finished: FinishedTask | None = None
    finished_at: float | None = None
    # set on the device worker as its job starts: the queue's wait and the start (time.monotonic)
    queue_wait_s: float = 0.0
    started_mono: float | None = None
    # A shared ledger's lease this attempt runs under (its claim's epoch, or 1 for a synchronous
    # task recorded here): every write of its row is fenced by it, and it is renewed only while
    # this attempt lives (app/tasks/leases.py). None: no lease (SQLite, a deferred task).
    epoch: int | None = None
    # POST /tasks?dataset=: the stored dataset it trains on (kept in its options, so a restart or
    # another replica reads it from there), and that dataset's scoring labels, if attached: its
    # answer then counts its correct predictions (the labels reach neither the task nor the answer)
    dataset: str | None = None
    labels: Any = None
    sweep: str | None = None  # the sweep it is a cell of (app/tasks/sweeps.py)
    evaluation: str | None = None  # the evaluation it is a cell of (app/tasks/evaluations.py)
    owner: str | None = None  # the tenant whose key made it (app/tasks/tenants.py); None: admin or open
    webhook: dict | None = None  # {"url", "events"}: its webhook (app/webhooks/; the ledger writes its messages)
    precision: str | None = None  # ?precision=: its products' precision (None: the backend's own, the tuned table's)
    timer: Any = None  # work nobody awaits (fed from the ledger): its timeout's timer on the loop
    state: State = State.ADMITTED
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    # ------------------------------------------------------------------ the steps
    def _step(self, name: str) -> None:
        allowed, to = _STEPS[name]
        with self._lock:
            if self.state not in allowed:
                raise IllegalStep(f"work {self.task_id}: {name} from {self.state.value}")
            self.state = to

    def record(self) -> None:
        self._step("record")

    def wait(self) -> None:
        self._step("wait")

    def queue(self) -> None:
        self._step("queue")

    def give_back(self) -> None:
        self._step("give_back")

    def start(self) -> None:
        self._step("start")

    def finish(self) -> bool:
        """Its outcome is being built: True for the first caller only (a late second outcome -- a
        run that ended after its timeout answered -- is dropped by whoever gets False)."""
        with self._lock:
            if self.state in (S.FINISHED, S.TOLD):
                return False
            self.state = S.FINISHED
            return True

    def tell(self) -> None:
        self._step("tell")

    @property
    def over(self) -> bool:
        return self.state in (S.FINISHED, S.TOLD)

    # ------------------------------------------------------------------ what it is
    @property
    def kind(self) -> str:
        return "measure" if self.measure is not None else "task"

    def options(self) -> dict[str, Any]:
        options = {"include_scores": self.include_scores, "measure": self.measure}
        for name in ("dataset", "sweep", "evaluation", "owner", "webhook", "precision"):
            value = getattr(self, name)
            if value is not None:
                options[name] = value
        return options

    @classmethod
    def from_record(cls, record: TaskRecord, task: TaskArrays, config: Config, labels: Any = None) -> Work:
        """A recorded asynchronous task to run again here (a claim of another replica's, a restart's
        leftover), waiting: what it was admitted with, read back from what ``options()`` kept."""
        o = record.options
        return cls(task_id=record.id, task=task, config=config, backend=record.backend, state=State.WAITING,
                   include_scores=bool(o.get("include_scores")), measure=o.get("measure"), mode="async",
                   body_bytes=record.body_bytes, created_at=record.created_at, dataset=o.get("dataset"),
                   labels=labels, sweep=o.get("sweep"), evaluation=o.get("evaluation"), owner=o.get("owner"),
                   webhook=o.get("webhook"), precision=o.get("precision"))

    def parsed(self) -> TaskArrays | None:
        """The task, parsing its body here if its job has not yet (None: a body its job will refuse)."""
        if self.task is None and self.late is not None:
            try:
                self.task = self.late()
            except Exception:  # noqa: BLE001 - its job answers the refusal
                return None
        return self.task

    def finished_task(self, status: str, **outcome: Any) -> FinishedTask:
        """A deferred task's one record (its input hashes read on the ledger writer's thread; the
        closure holds the task, not the work, which holds the record: no reference cycle)."""
        task = self.task
        return FinishedTask(
            task_id=self.task_id, kind=self.kind, mode=self.mode, backend=self.backend, config=self.config.as_dict(),
            options=self.options(), train_count=task.train_count, test_count=task.test_count,
            body_bytes=self.body_bytes, created_at=self.created_at, status=status,
            input_hashes=lambda: input_hashes(task), started_at=self.started_at, device=self.device,
            finished_at=self.finished_at if self.finished_at is not None else time.time(), **outcome)

    def in_flight_record(self) -> TaskRecord:
        """A deferred task's record while it is queued or running here, or answered but not yet in
        the ledger (the ledger has none yet)."""
        done = self.finished
        if done is not None:  # the answer as the client got it: decoded from the bytes sent
            answer = orjson.loads(done.answer_json) if done.answer_json is not None else done.answer
            timing = (answer or {}).get("timing") or {}
            energy = (answer or {}).get("energy")
            return TaskRecord(
                id=self.task_id, status=done.status, kind=self.kind, mode=self.mode, created_at=self.created_at,
                started_at=self.started_at, finished_at=self.finished_at, backend=self.backend,
                config=self.config.as_dict(), options=self.options(), train_count=done.train_count,
                test_count=done.test_count, input_hashes=input_hashes(self.task), body_bytes=self.body_bytes,
                device=self.device, answer=answer, error=done.error,
                predictions_sha256=(answer or {}).get("predictions_sha256"), run_ms=timing.get("run_ms"),
                energy_j=energy.get("gross_j") if isinstance(energy, dict) else None, attempts=1)
        task = self.parsed()
        return TaskRecord(
            id=self.task_id, status="queued" if self.started_at is None else "running", kind=self.kind,
            mode=self.mode, created_at=self.created_at, started_at=self.started_at, backend=self.backend,
            config=self.config.as_dict(), options=self.options(), train_count=task.train_count if task else 0,
            test_count=task.test_count if task else 0, body_bytes=self.body_bytes, device=self.device,
            attempts=0 if self.started_at is None else 1)
