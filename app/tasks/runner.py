"""The task runner: a task from acceptance to its recorded answer, whoever waits for it.

``TaskRunner`` is built by the service (app/service.py) from the parts it needs -- the ledger
and its writer, the device executor, the energy meters, the metrics -- and never imports the
service. It owns the tasks in flight in this process (``pending``) and the settling of the
asynchronous ones (``background``).

``record``  writes the task to the ledger (an asynchronous one together with its npz, durable
            before the 202).
``queue``   puts its job on the device workers.
``settle``  waits for its job (timeout; client disconnect for a synchronous request), builds
            the answer or the error, records it in the ledger and returns it. The synchronous
            route awaits it; an asynchronous task has it run in the background.
``cancel``  stops a task: a queued one never runs, a running one is stopped at its next safe
            point; the answer is its record once the ledger says it has finished.
``recover`` at start: every asynchronous task the ledger still has queued or running (the
            service stopped before it finished, say by ``kill -9``) is queued again from its
            stored npz -- runs are deterministic, so its answer is the one the first run would
            have given; a synchronous one (its client's connection is gone) is recorded failed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from learner.budget import estimate
from learner.cancel import CancelToken
from learner.config import Config
from learner.taskio import TaskArrays

from ..errors import Forbidden, NotAccepted, Requeued, TaskStopped, Unavailable, error_answer, outcome_of
from ..ledger import (
    AlreadyFinished,
    FinishedTask,
    LeaseLost,
    Ledger,
    LedgerUnavailable,
    LedgerWriter,
    Outcome,
    TaskRecord,
)
from ..runtime.executor import Batch, DeviceExecutor, Job
from ..runtime.metrics import Metrics
from .answers import Settled, encode_json, input_hashes, run_timing, task_answer
from .datasets import score
from .device import (
    DeviceOutcome,
    Engines,
    has_run_many,
    launch_key,
    measure_on_device,
    run_on_device,
    worker_engine,
)
from .launches import Finishing, Launches
from .options import measure_timeout_s
from .submit import Submitted, submit

log = logging.getLogger("rev88." + __name__)


@dataclasses.dataclass
class Answered:
    """A synchronous task's answer as its job built it on the device worker: the device outcome,
    the answer's document and its JSON."""

    outcome: DeviceOutcome
    body: dict[str, Any]
    content: bytes


def new_task_id() -> str:
    return uuid.uuid4().hex


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


@dataclasses.dataclass
class Accepted:
    """Everything a task's job needs, now or after a restart (``options`` is what the ledger keeps)."""

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
    job: Job | None = None
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
    # stays in ``pending`` with this until the ledger has it, and reads as finished meanwhile.
    finished: FinishedTask | None = None
    finished_at: float | None = None
    # set on the device worker as its job starts: the queue's wait and the start (time.monotonic)
    queue_wait_s: float = 0.0
    started_mono: float | None = None
    # A shared ledger's lease this attempt runs under (its claim's epoch, or 1 for a synchronous
    # task recorded here): every write of its row is fenced by it, and it is renewed only while
    # this attempt lives (app/tasks/claims.py). None: no lease (SQLite, a deferred task).
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
    # fed from the ledger to a batching backend: answered with its launch by the finisher thread,
    # no coroutine of its own (app/tasks/launches.py); ``timer``: its timeout on the loop
    launch_path: bool = False
    timer: Any = None
    precision: str | None = None  # ?precision=: its products' precision (None: the backend's own, the tuned table's)

    @property
    def kind(self) -> str:
        return "measure" if self.measure is not None else "task"

    def options(self) -> dict[str, Any]:
        options = {"include_scores": self.include_scores, "measure": self.measure}
        if self.dataset is not None:
            options["dataset"] = self.dataset
        if self.sweep is not None:
            options["sweep"] = self.sweep
        if self.evaluation is not None:
            options["evaluation"] = self.evaluation
        if self.owner is not None:
            options["owner"] = self.owner
        if self.webhook is not None:
            options["webhook"] = self.webhook
        if self.precision is not None:
            options["precision"] = self.precision
        return options

    def parsed(self) -> TaskArrays | None:
        """The task, parsing its body here if its job has not yet (None: a body its job will refuse)."""
        if self.task is None and self.late is not None:
            try:
                self.task = self.late()
            except Exception:  # noqa: BLE001 - its job answers the refusal
                return None
        return self.task

    def _finished_record(self, done: FinishedTask) -> TaskRecord:
        """What the ledger will hold for ``done`` once its group commit is through (the answer as the
        client got it: decoded from the bytes sent)."""
        answer = orjson.loads(done.answer_json) if done.answer_json is not None else done.answer
        timing = (answer or {}).get("timing") or {}
        energy = (answer or {}).get("energy")
        return TaskRecord(
            id=self.task_id, status=done.status, kind=self.kind, mode=self.mode, created_at=self.created_at,
            started_at=self.started_at, finished_at=self.finished_at, backend=self.backend,
            config=self.config.as_dict(), options=self.options(), train_count=done.train_count,
            test_count=done.test_count, input_hashes=input_hashes(self.task), body_sha256=None,
            body_bytes=self.body_bytes, idempotency_key=None, device=self.device, answer=answer, error=done.error,
            predictions_sha256=(answer or {}).get("predictions_sha256"), run_ms=timing.get("run_ms"),
            energy_j=energy.get("gross_j") if isinstance(energy, dict) else None, attempts=1)

    def record(self) -> TaskRecord:
        """A deferred task's record while it is queued or running here, or answered but not yet in
        the ledger (the ledger has none yet)."""
        if self.finished is not None:
            return self._finished_record(self.finished)
        task = self.parsed()
        return TaskRecord(
            id=self.task_id, status="queued" if self.started_at is None else "running", kind=self.kind,
            mode=self.mode, created_at=self.created_at, started_at=self.started_at, finished_at=None,
            backend=self.backend, config=self.config.as_dict(), options=self.options(),
            train_count=task.train_count if task else 0, test_count=task.test_count if task else 0, input_hashes=None,
            body_sha256=None, body_bytes=self.body_bytes, idempotency_key=None, device=self.device, answer=None,
            error=None, predictions_sha256=None, run_ms=None, energy_j=None,
            attempts=0 if self.started_at is None else 1)


def _unrecorded(acc: Accepted, exc: BaseException) -> bool:
    """Log why a task's answer is not in the ledger; True when the ledger itself failed (not a
    result another holder's record stands in for)."""
    if isinstance(exc, LeaseLost):  # shared ledger: another replica holds the task now; its result stands
        log.warning("result refused by the ledger: lease lost", extra={"task_id": acc.task_id, "error": str(exc)})
        return False
    if isinstance(exc, AlreadyFinished):  # cancelled in the ledger meanwhile (a restart's leftovers)
        log.warning("task finished after the ledger recorded it finished", extra={"task_id": acc.task_id})
        return False
    log.error("could not record the answer in the ledger", extra={"task_id": acc.task_id, "error": str(exc)})
    return True


def work_cost(acc: Accepted) -> float | None:
    """A task's device work for fair share (app/runtime/fair_share.py): its budget estimate, in
    millions of work units (None while its body is not parsed: its tenant's last task's)."""
    if acc.task is None:
        return None
    return estimate(acc.task.train_count, acc.task.test_count, acc.config).work / 1e6


def with_dataset(body: dict[str, Any], acc: Accepted, outcome: DeviceOutcome) -> dict[str, Any]:
    """A task from a stored dataset: its answer names the dataset, and, with the dataset's labels,
    counts its correct predictions (issue #31)."""
    if acc.dataset is not None:
        body["dataset"] = acc.dataset
        if acc.labels is not None:
            body.update(score(outcome.result.predictions, acc.labels))
    return body


class TaskRunner:
    """Accept, settle, cancel and recover tasks over the ledger and the device executor."""

    def __init__(self, *, ledger: Ledger, writer: LedgerWriter, executor: DeviceExecutor, energy: Any,
                 engines: Engines, metrics: Metrics, task_timeout_s: float, batch_max: int,
                 versions: Callable[[], dict[str, Any]]) -> None:
        self.ledger, self.writer, self.executor = ledger, writer, executor
        self.energy, self.engines, self.metrics = energy, engines, metrics
        self.task_timeout_s, self.batch_max, self.versions = task_timeout_s, batch_max, versions
        self.pending: dict[str, Accepted] = {}  # task id -> its acceptance, while queued or running here
        # called with (acc, Outcome) once a task's outcome is in the ledger, on the event loop
        # (app/tasks/sweeps.py keeps its cells' rows from them)
        self.recorded_hooks: list[Callable[[Accepted, Outcome], None]] = []
        # (acc, status, answer) of every finished task, recorded now or deferred (per-tenant metrics)
        self.finished_hooks: list[Callable[[Accepted, str, dict | None], None]] = []
        # a tenant's (weight, max_running) for the executor's fair share (the service's key ring)
        self.shares: Callable[[str], tuple[float, int | None]] = lambda owner: (1.0, None)
        self.keys: Any = None  # the service's key ring (app/tasks/tenants.py): the quotas' messages
        self.background: set[asyncio.Task] = set()  # settling asynchronous tasks
        # The feeder (app/tasks/claims.py): asynchronous work waits in the ledger and is claimed into
        # the device queue by fair share, with either store. ``shared`` is the same object when the
        # ledger is shared by replicas (PostgreSQL: leases, fencing, cancels across replicas); None
        # with SQLite.
        self.feeder: Any = None
        self.shared: Any = None
        self.record_retry_s = 60.0  # a claimed task's result: retried this long while the database is away
        self.datasets: Any = None  # the DatasetCatalog (app/tasks/datasets.py): tasks on stored datasets
        self.launches = Launches(self)  # batched launches' host side: the finisher thread (app/tasks/launches.py)
        self.io_pool: concurrent.futures.Executor | None = None  # the service's io pool (a large body's hashes)

    def dataset_task(self, digest: str) -> tuple[TaskArrays, Any]:
        """(blocking) A stored dataset's parsed arrays and scoring labels (None without), for a
        task recorded on it that runs again (a restart, a claim)."""
        if self.datasets is None:
            raise ValueError(f"the task is on dataset {digest}, but this service has no dataset store")
        return self.datasets.task(digest), self.datasets.labels(digest)

    # ------------------------------------------------------------------ accept
    async def submit(self, work: Accepted | list[Accepted], **how: Any) -> Submitted:
        """The one way work enters (app/tasks/submit.py says what it decides): an upload, a
        ``?dataset=`` task, a sweep's or an evaluation's cells, a claim (``claimed=True``)."""
        return await submit(self, work, **how)

    def prepare_ahead(self, accs: list[Accepted]) -> None:
        """Work about to be launched (a sweep's or an evaluation's cells as they are recorded):
        the seed-derived states of its first two launches computed now, on the prepare thread
        (app/tasks/launches.py), not by the worker once they are gathered."""
        self.launches.prepare_ahead(accs[:self.launches_ahead])

    def prepare_states_ahead(self, wanted: list[tuple[Config, int]]) -> None:
        """``prepare_ahead`` for (config, training count) pairs: a sweep's cells as soon as its
        request is checked, before they are built or recorded."""
        self.launches.prepare_states_ahead(wanted[:self.launches_ahead])

    @property
    def launches_ahead(self) -> int:
        """How many of a job's cells ``prepare_ahead`` takes: its first two launches'."""
        return 2 * max(1, self.batch_max)

    def record(self, acc: Accepted, body_sha256: str | None, body_bytes: int, body: bytes | None,
               idempotency_key: str | None) -> tuple[TaskRecord, bool]:
        """Write the task to the ledger (blocking: call it in a thread). ``body`` makes it durable.
        A synchronous task's input hashes are still being computed beside it: they are recorded
        when it finishes (``settle``)."""
        record, created = self.ledger.create(
            task_id=acc.task_id, kind=acc.kind, mode=acc.mode, backend=acc.backend, config=acc.config.as_dict(),
            options=acc.options(), train_count=acc.task.train_count, test_count=acc.task.test_count,
            body_sha256=body_sha256, body_bytes=body_bytes,
            input_hashes=input_hashes(acc.task) if acc.mode == "async" else None,
            body=body, idempotency_key=idempotency_key,
        )
        if created and self.shared is not None and acc.mode == "sync":  # held here from its creation
            acc.epoch = self.ledger.held_epoch(acc.task_id)
        return record, created

    def weight_of(self, tenant: str) -> float:
        """A tenant's fair-share weight ("" -- the admin, an open service -- weighs 1)."""
        return self.shares(tenant)[0] if tenant else 1.0

    def refusal(self, acc: Accepted) -> Forbidden | None:
        """(a device worker, blocking on a key cache miss) Why this task may not run now that it
        reaches the device -- its tenant's key was revoked while it waited -- or None. Its answer
        is that error, alone: the other tasks of its launch run."""
        if acc.owner is None or self.keys is None:
            return None
        reason = self.keys.barred(acc.owner)
        if reason is None:
            return None
        return Forbidden(f"{reason} while this task waited; it was not run")

    def others_waiting(self) -> dict[str, float]:
        """The tenants whose work waits in the ledger, with their weights (their shares of the
        device queue are kept for them: app/runtime/executor.py)."""
        return self.feeder.backlog_weights() if self.feeder is not None else {}

    def check_sync_capacity(self, owner: str | None) -> None:
        """Before a synchronous task's body is read: QueueFull unless its tenant may have a place
        in the device queue now (its share, app/runtime/executor.py)."""
        tenant = owner or ""
        self.executor.check_capacity(tenant, self.weight_of(tenant), self.others_waiting())

    def unfinished_of(self, owner: str) -> int:
        """(blocking) The tenant's queued and running tasks: the ledger's, and this process's
        synchronous ones that are recorded only once they finish."""
        unrecorded = sum(1 for a in list(self.pending.values())
                         if a.deferred and a.owner == owner and a.finished is None)
        return self.ledger.count_unfinished(owner) + unrecorded

    async def check_queued(self, tenant: Any, adding: int) -> None:
        """TooManyRequests when ``adding`` more tasks would pass the tenant's max_queued."""
        key = getattr(tenant, "key", None)
        if key is None or key.max_queued is None:
            return
        count = await asyncio.to_thread(self.unfinished_of, tenant.id)
        self.keys.check_queued(tenant, adding, count)

    def record_many(self, accs: list[Accepted], messages: list[tuple] | None = None) -> None:
        """Write many asynchronous tasks on stored datasets (a sweep's or an evaluation's cells)
        in one transaction, with ``messages`` (the sweep's or evaluation's webhook outbox rows;
        blocking: call it in a thread)."""
        self.ledger.create_many([dict(
            task_id=acc.task_id, kind=acc.kind, mode=acc.mode, backend=acc.backend, config=acc.config.as_dict(),
            options=acc.options(), train_count=acc.task.train_count, test_count=acc.task.test_count,
            body_sha256=acc.dataset.split(":", 1)[1], body_bytes=acc.body_bytes, input_hashes=input_hashes(acc.task))
            for acc in accs], messages)

    def task_batch(self, acc: Accepted) -> Batch | None:
        """How a task job may share a launch with queued tasks of its launch key
        (None when REV88_BATCH_MAX is 1). Whether it does is decided on the device
        thread: only when the backend object has ``run_many``. The launch's host side is
        app/tasks/launches.py's."""
        if self.batch_max <= 1:
            return None
        backend, precision = acc.backend, acc.precision
        return Batch(
            key=launch_key(acc.task, acc.config, backend, precision),
            item=(acc.task, acc.config, acc.cancel, acc),
            run=lambda items: self.launches.run(items, backend, precision),
            ready=lambda: has_run_many(worker_engine(backend, self.engines)),
        )

    def queue(self, acc: Accepted, fed: bool = False) -> Job:
        """Queue the task's job on the workers: ``fed`` (claimed from the ledger by the feeder)
        takes a free place only and may go back to the ledger; anything else is admitted against
        its tenant's share of the device queue (QueueFull otherwise)."""
        self.pending[acc.task_id] = acc

        def started(job) -> None:  # on the device worker: hands the write over, does not wait for it
            acc.queue_wait_s, acc.started_mono = job.queue_wait_s or 0.0, job.started
            if acc.deferred:
                acc.started_at, acc.device = time.time(), job.worker
            else:
                self.writer.started(acc.task_id, job.worker, time.time(), acc.epoch)

        weight, max_running = self.shares(acc.owner) if acc.owner is not None else (1.0, None)
        share = dict(tenant=acc.owner or "", weight=weight, max_running=max_running,  # fair share (executor)
                     evictable=fed, others=None if fed else self.others_waiting(), cost=work_cost(acc))
        if acc.measure is not None:
            arguments = acc.measure

            def measure() -> dict:
                refused = self.refusal(acc)  # (its tenant's key revoked while it waited: not run)
                if refused is not None:
                    raise refused
                return measure_on_device(acc.task, acc.config, acc.backend, arguments, self.energy, self.engines,
                                         acc.precision)

            job = self.executor.submit(measure, kind="measure", label=acc.task_id, cancel=acc.cancel,
                                       on_start=started, **share)
        else:
            acc.launch_path = fed and self.batch_max > 1  # answered with its launch (app/tasks/launches.py)

            def run() -> DeviceOutcome | Answered | Finishing:
                if acc.launch_path:  # (its tenant's key checked there, with its launch's)
                    return self.launches.run_alone(acc)
                refused = self.refusal(acc)
                if refused is not None:
                    raise refused
                if acc.task is None:  # a deferred task's body: parsed here, on the worker
                    acc.task = self._parse_late(acc)
                outcome = run_on_device(acc.task, acc.config, acc.backend, self.energy, self.engines, cancel=acc.cancel,
                                        precision=acc.precision)
                if not acc.deferred:
                    return outcome
                # A synchronous task's answer, built here beside its run rather than on the event
                # loop: its document, its log line and its JSON (bench/bench_shell.py). What the
                # loop does with it (send it, record it, or drop it for a client gone) stays the loop's.
                device_s = time.monotonic() - (acc.started_mono or time.monotonic())
                body = self.answer_for(acc, outcome, acc.queue_wait_s, device_s, 1, worker=acc.device)
                return Answered(outcome, body, encode_json(body))

            job = self.executor.submit(
                run,
                kind="task", label=acc.task_id,
                batch=self.task_batch(acc),
                cancel=acc.cancel, on_start=started, **share,
            )
        acc.job = job
        self.launches.prepare_ahead([acc])  # its seed-derived state computed while it waits, not at its launch
        if self.feeder is not None:  # a worker frees up when it ends: claim more
            job.future.add_done_callback(self.feeder.job_done)
        if self.shared is not None:
            if acc.epoch is not None:  # its lease is renewed while this attempt lives (until settle ends)
                self.shared.attempt_began(acc)
        return job

    def _parse_late(self, acc: Accepted) -> TaskArrays:
        t = time.perf_counter()
        try:
            task = acc.late()
        except Exception as exc:  # noqa: BLE001 - answered as the refusal it is
            raise NotAccepted(exc) from None
        acc.parse_s = time.perf_counter() - t
        self.metrics.parse_seconds.observe(acc.parse_s)
        return task

    def timeout_for(self, acc: Accepted) -> float:
        if acc.measure is not None:
            return measure_timeout_s(acc.measure, self.task_timeout_s)
        return self.task_timeout_s

    # ------------------------------------------------------------------ settle
    async def settle(self, acc: Accepted, gone: Awaitable | None = None) -> Settled:
        """Wait for the task's job, build its answer (or error), record it, return it. The task
        stays in ``pending`` until the ledger has its outcome, so a cancel arriving meanwhile
        finds it here (and that its job has ended) rather than a record to mark cancelled."""
        try:
            return await self._settle(acc, gone)
        finally:
            if acc.finished is None:  # (else its group commit takes it out: _committed)
                self.pending.pop(acc.task_id, None)
            if self.shared is not None and acc.epoch is not None:
                self.shared.attempt_ended(acc)  # recorded or not, this attempt no longer renews its lease
            # The job's closures hold ``acc`` (its arrays, megabytes): without this link back the
            # pair is a reference cycle, freed only by the cyclic GC's next full pass, not here.
            acc.job = None

    async def _settle(self, acc: Accepted, gone: Awaitable | None) -> Settled:
        job = acc.job
        try:
            value = await self.executor.wait(job, self.timeout_for(acc), gone)
            if isinstance(value, Finishing):  # a launch's task, its result finished off the worker
                value = value.outcome(await asyncio.wrap_future(value.future))
                if isinstance(value, BaseException):
                    raise value
        except NotAccepted as refused:  # its body, parsed by its job: answered as refused on arrival, not recorded
            # (the job's future holds ``refused``, whose traceback holds this frame: without ``job``
            # here that is no reference cycle, tests/test_memory_soak.py)
            job = None
            return self.refused(acc, refused)
        except Requeued as exc:  # fed work taken back out of the device queue: it waits in the ledger again
            job = None
            await self.feeder.returned(acc)
            return Settled(exc.status, {"error": exc.message})
        except BaseException as exc:  # noqa: BLE001 - every failure is answered and recorded
            settled = self.failed(acc, exc)
            await self.record_failure(acc, exc, settled)
            return settled
        if acc.measure is not None:
            settled = Settled(200, self.measure_answer(acc, job, value))
        elif isinstance(value, Answered):  # built by its job, on the worker
            settled = Settled(200, value.body, outcome=value.outcome, content=value.content)
        else:
            settled = Settled(200, self.answer_for(acc, value, job.queue_wait_s or 0.0, job.device_s or 0.0,
                                                   job.launch_size, worker=job.worker), outcome=value)
        if acc.deferred:
            return self.answered(acc, settled)
        try:
            content = settled.json()
            task = acc.task  # the hashes on the writer thread, never waited for on the loop
            await self._write_outcome(acc, Outcome(acc.task_id, "succeeded", settled.body, None, content, False,
                                                   lambda: input_hashes(task), epoch=acc.epoch))
        except Exception as exc:  # noqa: BLE001 - the answer stands, whatever the ledger says
            if _unrecorded(acc, exc):
                settled.headers["X-Ledger-Error"] = str(exc)[:200]
        self.metrics.outcome("ok")
        return settled

    # The ends of a task's wait (``_settle``). None of them waits.
    def refused(self, acc: Accepted, refused: NotAccepted) -> Settled:
        """A deferred task whose own job found its body invalid: answered as refused on arrival."""
        status, body, headers = error_answer(refused.error, acc.request_id)
        self.metrics.outcome(outcome_of(refused.error))
        return Settled(status, body, headers=headers)

    def failed(self, acc: Accepted, exc: BaseException) -> Settled:
        """The answer of a task that failed (its record is the caller's: ``failure_write``)."""
        status, body, headers = error_answer(exc, acc.request_id)
        self.metrics.outcome(outcome_of(exc) if isinstance(exc, Exception) else "error")
        return Settled(status, body, headers=headers)

    def answered(self, acc: Accepted, settled: Settled) -> Settled:
        """A deferred task's answer: its client holds it, so its record goes to the next group
        commit and the answer does not wait for it. The task stays in ``pending``, read as
        finished, until the ledger has it (``_committed``)."""
        try:
            content = settled.json()
            acc.finished_at = time.time()
            acc.finished = self.finished_task(acc, "succeeded", answer=settled.body, answer_json=content)
            self._commit_later(acc, self.writer.finished(acc.finished))
            self._finished(acc, "succeeded", settled.body)
        except Exception as exc:  # noqa: BLE001 - the answer stands, whatever the ledger says
            if _unrecorded(acc, exc):
                settled.headers["X-Ledger-Error"] = str(exc)[:200]
        self.metrics.outcome("ok")
        return settled

    def failure_write(self, acc: Accepted, exc: BaseException, settled: Settled) -> concurrent.futures.Future | None:
        """A failed deferred task's one record, handed to the ledger writer at once (its answer
        waits for it: a client told 'failed' finds the record); None when there is none to write
        (its body was invalid: it was never accepted)."""
        if acc.parsed() is None:
            return None
        status = "cancelled" if isinstance(exc, TaskStopped) else "failed"
        error = {"status": settled.status, **settled.body}
        error.pop("request_id", None)
        self._finished(acc, status, None)
        return self.writer.finished(self.finished_task(acc, status, error=error), linger=False)

    def _finished(self, acc: Accepted, status: str, answer: dict | None) -> None:
        for hook in self.finished_hooks:
            try:
                hook(acc, status, answer)
            except Exception:  # noqa: BLE001 - a metric must not lose the task
                log.exception("finished hook failed", extra={"task_id": acc.task_id})

    def _commit_later(self, acc: Accepted, write) -> None:
        write.add_done_callback(lambda future: self._committed(acc, future))

    def _committed(self, acc: Accepted, write) -> None:
        """A deferred task's record has reached the ledger (or failed to): out of ``pending``. On
        the ledger writer's thread, without waking the event loop (a dict's get and pop are
        atomic, and task ids are never reused)."""
        if self.pending.get(acc.task_id) is acc:
            self.pending.pop(acc.task_id, None)
        if write.exception() is not None:
            _unrecorded(acc, write.exception())

    def answer_for(self, acc: Accepted, outcome: DeviceOutcome, queue_wait_s: float, device_s: float,
                   launch_size: int, worker: str | None) -> dict[str, Any]:
        """The answer's document (and its metrics and log line), on the event loop or on the
        device worker that ran the task (``device_s``: the worker's time on it so far)."""
        run_ms, clock = run_timing(outcome.result)
        self.metrics.queue_wait_seconds.observe(queue_wait_s)
        self.metrics.run_seconds.observe(run_ms / 1000.0)
        if outcome.energy is not None and self.metrics.task_energy is not None and outcome.energy.get("gross_j"):
            self.metrics.task_energy.inc(outcome.energy["gross_j"])
        if acc.late is not None:  # its job parsed the body first: that time is parse_ms, not device_ms
            device_s = max(0.0, device_s - acc.parse_s)
        timing = {
            "receive_ms": _ms(acc.receive_s),
            "parse_ms": _ms(acc.parse_s),
            "queue_wait_ms": _ms(queue_wait_s),
            "run_ms": round(run_ms, 3),
            "run_clock": clock,
            "device_ms": _ms(device_s),
            "tasks_in_launch": launch_size,
            "total_ms": _ms(time.perf_counter() - acc.t0),
        }
        extra = {"task_id": acc.task_id, "train_count": acc.task.train_count, "test_count": acc.task.test_count,
                 "backend": outcome.result.metadata["backend"], "device": worker, "mode": acc.mode, "timing": timing}
        if acc.request_id is not None:  # (the worker's thread is not in the request's context)
            extra["request_id"] = acc.request_id
        log.info("task answered", extra=extra)
        body = task_answer(acc.task_id, acc.request_id, outcome, timing, acc.include_scores)
        return with_dataset(body, acc, outcome)

    def measure_answer(self, acc: Accepted, job: Job, doc: dict) -> dict[str, Any]:
        self.metrics.queue_wait_seconds.observe(job.queue_wait_s or 0.0)
        timing = {
            "receive_ms": _ms(acc.receive_s),
            "parse_ms": _ms(acc.parse_s),
            "queue_wait_ms": _ms(job.queue_wait_s or 0.0),
            "device_ms": _ms(job.device_s or 0.0),
            "total_ms": _ms(time.perf_counter() - acc.t0),
        }
        answer = {
            "id": acc.task_id,
            "request_id": acc.request_id,
            "measure": "energy",
            "protocol": acc.measure,
            "predictions_sha256": doc.get("predictions_sha256"),
            "scores_sha256": doc.get("scores_sha256"),
            "energy": doc.get("energy"),
        }
        if doc.get("energy") is None:
            answer["energy_reason"] = doc.get("energy_reason")
        answer.update({"measurement": doc, "timing": timing, "device": doc.get("device"), "versions": self.versions()})
        log.info("measurement answered", extra={"task_id": acc.task_id, "timing": timing})
        return answer

    async def record_failure(self, acc: Accepted, exc: BaseException, settled: Settled) -> None:
        if isinstance(exc, Unavailable) and acc.mode == "async":
            # the drain deadline: an accepted asynchronous task stays queued in the ledger and the
            # next start runs it again; nothing accepted is lost
            log.warning("asynchronous task left for the next start", extra={"task_id": acc.task_id})
            if self.shared is not None:  # shared ledger: another replica runs it now
                try:
                    await asyncio.to_thread(self.shared.ledger.release, [acc.task_id])
                except LedgerUnavailable as exc2:
                    log.warning("lease not released (it expires instead)", extra={"task_id": acc.task_id,
                                                                                 "error": str(exc2)})
            return
        status = "cancelled" if isinstance(exc, TaskStopped) else "failed"
        error = {"status": settled.status, **settled.body}
        error.pop("request_id", None)
        try:
            if acc.deferred:
                write = self.failure_write(acc, exc, settled)
                if write is not None:  # (None: it never ran, and its job would have refused its body)
                    await asyncio.wrap_future(write)
            else:
                task = acc.task
                await self._write_outcome(acc, Outcome(acc.task_id, status, None, error,
                                                       input_hashes=lambda: input_hashes(task), epoch=acc.epoch))
        except LeaseLost as exc2:
            log.warning("outcome refused by the ledger: lease lost", extra={"task_id": acc.task_id, "error": str(exc2)})
        except AlreadyFinished:
            pass
        except Exception as exc2:  # noqa: BLE001
            log.error("could not record the failure in the ledger", extra={"task_id": acc.task_id, "error": str(exc2)})

    async def _write_outcome(self, acc: Accepted, outcome: Outcome) -> Any:
        """``outcome`` written by the ledger writer (``finish``). With a shared ledger a task's outcome is
        retried while the database is unavailable (``record_retry_s``), its lease renewed
        meanwhile (the attempt lives until ``settle`` ends): if still this attempt's when the
        database answers, it keeps the result; if not, the write is refused (LeaseLost) and the
        task's new holder records it. (A synchronous task's answer waits for its record: a 200
        is never followed by a record that says it failed.)"""
        deadline = time.monotonic() + (self.record_retry_s if self.shared is not None else 0)
        delay = 0.25
        while True:
            try:
                # An asynchronous task's outcome shares a commit with others (its client polls);
                # a synchronous task's answer waits for its record, so that write goes at once.
                record = await asyncio.wrap_future(self.writer.finish(outcome, linger=acc.mode == "async"))
                for hook in self.recorded_hooks:
                    hook(acc, outcome)
                if outcome.status in ("succeeded", "failed", "cancelled"):
                    self._finished(acc, outcome.status, outcome.answer)
                return record
            except LedgerUnavailable as exc:
                if time.monotonic() + delay > deadline:
                    raise
                log.warning("ledger unavailable; retrying the task's outcome", extra={"task_id": acc.task_id,
                                                                                     "error": str(exc)})
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    @staticmethod
    def finished_task(acc: Accepted, status: str, **outcome: Any) -> FinishedTask:
        """A deferred task's one record (its input hashes read on the ledger writer's thread; the
        closure holds the task, not ``acc``, which holds the record: no reference cycle)."""
        task = acc.task
        return FinishedTask(
            task_id=acc.task_id, kind=acc.kind, mode=acc.mode, backend=acc.backend, config=acc.config.as_dict(),
            options=acc.options(), train_count=acc.task.train_count, test_count=acc.task.test_count,
            body_bytes=acc.body_bytes, created_at=acc.created_at, status=status,
            input_hashes=lambda: input_hashes(task), started_at=acc.started_at, device=acc.device,
            finished_at=acc.finished_at if acc.finished_at is not None else time.time(), **outcome)

    def settle_fed(self, acc: Accepted) -> None:
        """Work the feeder queued (a claim): answered with its launch when it is on the launch path
        (app/tasks/launches.py), else settled in the background as any asynchronous task."""
        if acc.launch_path:
            self.launches.watch(acc, self.timeout_for(acc))
        else:
            self.settle_in_background(acc)

    def launch_recorded(self, rows: list[tuple[Accepted, Outcome]], results: list) -> None:
        """(the loop, once per launch) A launch's fed cells are in the ledger: their hooks (sweeps'
        rows, webhooks, tenants' counts), and each out of ``pending``."""
        for (acc, outcome), result in zip(rows, results):
            try:
                if isinstance(result, BaseException):
                    _unrecorded(acc, result)
                    continue
                for hook in self.recorded_hooks:
                    hook(acc, outcome)
                self._finished(acc, outcome.status, outcome.answer)
            except Exception:  # noqa: BLE001 - a hook must not keep the others from running
                log.exception("a launch cell's hooks failed", extra={"task_id": acc.task_id})
            finally:
                self.launch_cell_done(acc)

    def retry_launch_outcomes(self, rows: list[tuple[Accepted, Outcome]]) -> None:
        """(the loop) A launch's outcomes the ledger refused together (unavailable): each retried on
        its own, as a settled task's outcome is (``_write_outcome``)."""
        async def one(acc: Accepted, outcome: Outcome) -> None:
            try:
                await self._write_outcome(acc, outcome)
            except Exception as exc:  # noqa: BLE001 - logged
                _unrecorded(acc, exc)
            finally:
                self.launch_cell_done(acc)

        for acc, outcome in rows:
            task = asyncio.get_running_loop().create_task(one(acc, outcome))
            self.background.add(task)
            task.add_done_callback(self.background.discard)

    def launch_cell_done(self, acc: Accepted) -> None:
        """(the loop) A launch-path cell has its outcome (or its failure) recorded, or went back to
        the ledger: its timer off, out of ``pending``, its lease no longer renewed."""
        if acc.timer is not None:
            acc.timer.cancel()
            acc.timer = None
        if self.pending.get(acc.task_id) is acc:
            self.pending.pop(acc.task_id, None)
        if self.shared is not None and acc.epoch is not None:
            self.shared.attempt_ended(acc)
        acc.job = None

    def settle_in_background(self, acc: Accepted) -> None:
        """An asynchronous task: settle it without a waiting client."""
        task = asyncio.get_running_loop().create_task(self.settle(acc))
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def finished_record(self, task_id: str, timeout: float) -> TaskRecord | None:
        """Wait (within ``timeout``) for a task of this process to finish, then for its settling
        coroutine to record it; its record as the ledger then holds it."""
        acc = self.pending.get(task_id)
        # only the job's future here: a stop's traceback keeps this frame, and with ``acc`` in it,
        # its arrays, in a reference cycle (asyncio's wait_for frame <-> the exception)
        future = acc.job.future if acc is not None and acc.job is not None else None
        del acc
        if future is not None:
            try:
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout)
            except BaseException:  # noqa: BLE001 - the job's own outcome is recorded by settle
                pass
        record = None
        for _ in range(100):  # settle runs on this loop: let it record
            record = await self.get(task_id)
            if record is None or record.finished:
                return record
            await asyncio.sleep(0.02)
        return record

    async def get(self, task_id: str) -> TaskRecord | None:
        """The task's record: a deferred task's own while it is in flight here (or answered, its
        record not yet committed), else the ledger's. In that order: the record leaves ``pending``
        only once the ledger has it, so no moment finds it in neither."""
        acc = self.pending.get(task_id)
        if acc is not None and acc.deferred:
            return acc.record()
        return await asyncio.to_thread(self.ledger.get, task_id)

    async def written(self, timeout_s: float | None = None) -> None:
        """Once every answered task's record handed to the ledger so far is in it (the ledger
        writer holds them a moment to share one commit: a list or a count reads them after), or
        ``timeout_s`` has passed (a ledger that does not answer: the reader goes on without)."""
        barrier = self.writer.written()
        if barrier is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.wrap_future(barrier), timeout_s)

    # ------------------------------------------------------------------ cancel
    async def cancel(self, task_id: str) -> TaskRecord | None:
        """Stop a task: a queued one never runs, a running one is stopped at its next safe point.
        Returns its record once the ledger says it has finished (None for an unknown id); a task
        that finished some other way first (it completed meanwhile) has that status, not
        ``cancelled``."""
        record = await self.get(task_id)
        if record is None or record.finished:
            return record
        acc = self.pending.get(task_id)
        if acc is not None and acc.job is not None:
            self.executor.withdraw(acc.job, "cancel", f"was cancelled (POST /tasks/{task_id}/cancel)")
            return await self.finished_record(task_id, 15.0)
        if self.shared is not None:  # shared ledger: queued for any replica, or running on another
            return await self.shared.cancel_elsewhere(task_id)
        # waiting in the ledger, not yet claimed into this process's device queue
        try:
            record = await asyncio.to_thread(self.ledger.finish, task_id, "cancelled", None,
                                             {"status": 409, "error": "cancelled before it ran"})
        except AlreadyFinished as exc:
            return exc.record
        if self.feeder is not None:
            self.feeder.discard(task_id)
        return record

    # ------------------------------------------------------------------ recover
    async def recover(self) -> dict[str, int]:
        """What a stop left unfinished: asynchronous work waits in the ledger and the feeder claims
        it again (runs are deterministic: its answer is the one the first run would have given);
        a synchronous task (its client's connection went with the stop) is recorded failed. With a
        shared ledger, unfinished tasks may be other replicas' live work: only expired leases are
        reaped (app/tasks/claims.py)."""
        self.launches.loop = asyncio.get_running_loop()
        failed = 0
        if self.shared is None:
            for rec in await asyncio.to_thread(self.ledger.unfinished):
                if rec.mode == "async":
                    continue
                await asyncio.to_thread(self.ledger.finish, rec.id, "failed", None, {
                    "status": 503, "error": "the service stopped while this synchronous task was queued or running; "
                    "its client's connection was lost with it; submit the task again"})
                failed += 1
        counts = await self.feeder.start()
        counts["failed"] += failed
        if counts["requeued"] or counts["failed"]:
            log.info("recovered the ledger's unfinished tasks", extra=counts)
        return counts
