"""The task runner: a unit of work from its entry to the finisher, whoever waits for it.

``TaskRunner`` is built by the service (app/service.py) from the parts it needs -- the ledger
and its writer, the device executor, the energy meters, the metrics -- and never imports the
service. It owns the work in flight in this process (``pending``); the finisher
(app/tasks/finisher.py) ends every unit's life (app/tasks/work.py).

``submit``  the one entry (app/tasks/submit.py): an upload, a ``?dataset=`` task, a sweep's or an
            evaluation's cells, a claim from the ledger.
``record``  writes the work to the ledger (an asynchronous task together with its npz, durable
            before the 202).
``queue``   puts its job on the device workers; every job is a launch (of one, or gathered with
            others of its key) whose outcome the finisher makes into its answer and records.
``settle``  a synchronous client's wait: its timeout and its disconnect stop the job; its answer
            is what the finisher made. Work nobody awaits (fed from the ledger) has no coroutine:
            ``watch`` gives it a timer, and a job that fails before its launch goes to the finisher.
``cancel``  a queued job never runs, a running one is stopped at its next safe point; the answer
            is its record once the ledger says it has finished.
``recover`` at start: every asynchronous task the ledger still has queued or running is claimed
            again (runs are deterministic: its answer is the one the first run would have given);
            a synchronous one (its client's connection is gone) is recorded failed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from learner.budget import estimate
from learner.config import Config
from learner.seed_processes import SeedProcesses
from learner.taskio import TaskArrays

from ..errors import NotAccepted, Requeued
from ..ledger import AlreadyFinished, Ledger, LedgerWriter, TaskRecord
from ..runtime.executor import Batch, DeviceExecutor, Job
from ..runtime.metrics import Metrics
from .answers import Settled, input_hashes
from .datasets import DatasetCatalog
from .device import Engines, has_run_many, launch_key, worker_engine
from .feed_plan import FeedPlan
from .feeder import Feeder
from .finisher import Finisher, unrecorded
from .launches import Finishing, Launches
from .options import measure_timeout_s
from .submit import Submitted, submit
from .tenant_gate import TenantGate
from .tenants import KeyRing
from .work import Work

log = logging.getLogger("rev88." + __name__)


def new_task_id() -> str:
    return uuid.uuid4().hex


def work_cost(work: Work) -> float | None:
    """A task's device work for fair share (app/runtime/fair_share.py): its budget estimate, in
    millions of work units (None while its body is not parsed: its tenant's last task's)."""
    if work.task is None:
        return None
    return estimate(work.task.train_count, work.task.test_count, work.config).work / 1e6


class TaskRunner(TenantGate):
    """Accept, queue, wait for, cancel and recover work over the ledger and the device executor."""

    def __init__(self, *, ledger: Ledger, writer: LedgerWriter, executor: DeviceExecutor, energy: Any,
                 engines: Engines, metrics: Metrics, task_timeout_s: float, batch_max: int,
                 versions: Callable[[], dict[str, Any]], datasets: DatasetCatalog, keys: KeyRing, claims: Any,
                 feed: FeedPlan, io_pool: Callable[[], concurrent.futures.Executor | None],
                 seed_processes: SeedProcesses | None = None) -> None:
        """``claims``: what the feeder claims from (the PostgreSQL ledger itself, or
        app/ledger/local_claims.py's LocalClaims over SQLite); ``io_pool``: the service's io pool
        once it has started (a large body's hashes); ``seed_processes``: REV88_SEED_PROCESSES's."""
        self.ledger, self.writer, self.executor = ledger, writer, executor
        self.energy, self.engines, self.metrics = energy, engines, metrics
        self.task_timeout_s, self.batch_max, self.versions = task_timeout_s, batch_max, versions
        self.datasets = datasets  # tasks on stored datasets (app/tasks/datasets.py)
        self.keys = keys  # the key ring (app/tasks/tenants.py): the quotas and their messages
        self.shares: Callable[[str], tuple[float, int | None]] = keys.share  # (weight, max_running): fair share
        self.io_pool = io_pool
        self.pending: dict[str, Work] = {}  # task id -> its work, while queued or running here
        # The feeder (app/tasks/feeder.py): asynchronous work waits in the ledger and is claimed into
        # the device queue by fair share, with either store. ``shared`` is the same object when the
        # ledger is shared by replicas (PostgreSQL: leases, fencing, cancels across replicas); None
        # with SQLite.
        self.feeder = Feeder(self, claims, feed)
        self.shared: Feeder | None = self.feeder if self.feeder.leases else None
        self.finisher = Finisher(writer=writer, metrics=metrics, versions=versions, pending=self.pending,
                                 leases=self.shared)
        self.recorded_hooks = self.finisher.recorded_hooks  # (work, Outcome) once in the ledger (sweeps' rows)
        self.finished_hooks = self.finisher.finished_hooks  # (work, status, answer) of every end (tenants' counts)
        self.launches = Launches(self, self.finisher, seed_processes)  # the worker's side of launches

    @property
    def background(self) -> set[asyncio.Task]:
        return self.finisher.background

    @property
    def record_retry_s(self) -> float:
        return self.finisher.record_retry_s

    @record_retry_s.setter
    def record_retry_s(self, value: float) -> None:
        self.finisher.record_retry_s = value

    # ------------------------------------------------------------------ accept
    async def submit(self, work: Work | list[Work], **how: Any) -> Submitted:
        """The one way work enters (app/tasks/submit.py says what it decides)."""
        return await submit(self, work, **how)

    def prepare_ahead(self, works: list[Work]) -> None:
        """Work about to be launched: the seed-derived states of its first two launches computed
        now, on the prepare thread (app/tasks/launches.py), not by the worker once they are gathered."""
        self.launches.prepare_ahead(works[:self.launches_ahead])

    def prepare_states_ahead(self, wanted: list[tuple[Config, int]]) -> None:
        """``prepare_ahead`` for (config, training count) pairs: a sweep's cells as soon as its
        request is checked, before they are built or recorded."""
        self.launches.prepare_states_ahead(wanted[:self.launches_ahead])

    @property
    def launches_ahead(self) -> int:
        """How many of a job's cells ``prepare_ahead`` takes: its first two launches'."""
        return 2 * max(1, self.batch_max)

    def record(self, work: Work, body_sha256: str | None, body_bytes: int, body: bytes | None,
               idempotency_key: str | None) -> tuple[TaskRecord, bool]:
        """Write the work to the ledger (blocking: call it in a thread). ``body`` makes it durable.
        A synchronous task's input hashes are computed by its run: recorded when it finishes."""
        record, created = self.ledger.create(
            task_id=work.task_id, kind=work.kind, mode=work.mode, backend=work.backend, config=work.config.as_dict(),
            options=work.options(), train_count=work.task.train_count, test_count=work.task.test_count,
            body_sha256=body_sha256, body_bytes=body_bytes,
            input_hashes=input_hashes(work.task) if work.mode == "async" else None,
            body=body, idempotency_key=idempotency_key,
        )
        if created and self.shared is not None and work.mode == "sync":  # held here from its creation
            work.epoch = self.ledger.held_epoch(work.task_id)
        return record, created

    def record_many(self, works: list[Work], messages: list[tuple] | None = None) -> None:
        """Write many asynchronous tasks on stored datasets (a sweep's or an evaluation's cells)
        in one transaction, with ``messages`` (their webhook's outbox rows; blocking)."""
        self.ledger.create_many([dict(
            task_id=w.task_id, kind=w.kind, mode=w.mode, backend=w.backend, config=w.config.as_dict(),
            options=w.options(), train_count=w.task.train_count, test_count=w.task.test_count,
            body_sha256=w.dataset.split(":", 1)[1], body_bytes=w.body_bytes, input_hashes=input_hashes(w.task))
            for w in works], messages)

    # ------------------------------------------------------------------ admission
    # ------------------------------------------------------------------ queue
    def task_batch(self, work: Work) -> Batch | None:
        """How a task's job may share a launch with queued tasks of its launch key (None when
        REV88_BATCH_MAX is 1, or for a measurement). Whether it does is decided on the device
        thread: only when the backend object has ``run_many``."""
        if self.batch_max <= 1 or work.measure is not None or work.task is None:
            return None
        backend, precision = work.backend, work.precision
        return Batch(
            key=launch_key(work.task, work.config, backend, precision),
            item=(work.task, work.config, work.cancel, work),
            run=lambda items: self.launches.run(items, backend, precision),
            ready=lambda: has_run_many(worker_engine(backend, self.engines)),
        )

    def queue(self, work: Work, fed: bool = False) -> Job:
        """Queue the work's job on the workers: ``fed`` (claimed from the ledger by the feeder)
        takes a free place only and may go back to the ledger; anything else is admitted against
        its tenant's share of the device queue (QueueFull otherwise)."""
        self.pending[work.task_id] = work
        work.queue()

        def started(job) -> None:  # on the device worker: hands the write over, does not wait for it
            work.start()
            work.queue_wait_s, work.started_mono = job.queue_wait_s or 0.0, job.started
            work.started_at, work.device = time.time(), job.worker
            if not work.deferred:
                self.writer.started(work.task_id, job.worker, work.started_at, work.epoch)

        weight, max_running = self.shares(work.owner) if work.owner is not None else (1.0, None)
        try:
            job = self.executor.submit(
                lambda: self.launches.run_alone(work), kind=work.kind, label=work.task_id,
                batch=self.task_batch(work), cancel=work.cancel, on_start=started, tenant=work.owner or "",
                weight=weight, max_running=max_running, evictable=fed, others=None if fed else self.others_waiting(),
                cost=work_cost(work))
        except BaseException:
            self.pending.pop(work.task_id, None)
            work.finish()  # (refused: never queued)
            raise
        work.job = job
        self.launches.prepare_ahead([work])  # its seed-derived state computed while it waits, not at its launch
        if self.feeder is not None:  # a worker frees up when it ends: claim more
            job.future.add_done_callback(self.feeder.job_done)
        if self.shared is not None and work.epoch is not None:  # its lease renewed while this attempt lives
            self.shared.attempt_began(work)
        return job

    def parse_late(self, work: Work) -> TaskArrays:
        """(a device worker) A deferred task's body, parsed by its own job; NotAccepted refuses it."""
        t = time.perf_counter()
        try:
            task = work.late()
        except Exception as exc:  # noqa: BLE001 - answered as the refusal it is
            raise NotAccepted(exc) from None
        work.parse_s = time.perf_counter() - t
        self.metrics.parse_seconds.observe(work.parse_s)
        return task

    def timeout_for(self, work: Work) -> float:
        if work.measure is not None:
            return measure_timeout_s(work.measure, self.task_timeout_s)
        return self.task_timeout_s

    # ------------------------------------------------------------------ wait
    async def settle(self, work: Work, gone: Awaitable | None = None) -> Settled:
        """A synchronous client's wait for its work's answer (its timeout and its disconnect stop
        the job): the answer the finisher made, or the failure it recorded."""
        finisher = self.finisher
        finisher.loop = asyncio.get_running_loop()
        try:
            finishing: Finishing = await self.executor.wait(work.job, self.timeout_for(work), gone)
            done = finishing.future  # (a lone task's launch is finished on its worker: done already, no hop)
            ended = finishing.outcome(done.result() if done.done() and done.exception() is None
                                      else await asyncio.wrap_future(done))
        except BaseException as exc:  # noqa: BLE001 - every failure is answered and recorded
            return await finisher.failed(work, exc)
        if ended is None:  # (another outcome came first: its record stands)
            return Settled(409, {"error": f"task {work.task_id} had already finished"})
        if ended.retry is not None:  # the ledger was away for its launch's write: its client waits for it
            try:
                await finisher.write(work, ended.retry)
            except Exception as exc:  # noqa: BLE001 - the answer stands, whatever the ledger says
                if unrecorded(work, exc):
                    ended.settled.headers["X-Ledger-Error"] = str(exc)[:200]
            finally:
                finisher.ended(work)
        return ended.settled

    def watch(self, work: Work) -> None:
        """(the loop) Work nobody awaits, just queued: its timeout is one timer; a failure before
        its launch (a timeout or cancel while queued, a drain) goes to the finisher; taken back to
        the ledger, it waits there again."""
        loop = asyncio.get_running_loop()
        self.finisher.loop = loop
        timeout_s = self.timeout_for(work)
        work.timer = loop.call_later(timeout_s, self._timed_out, work, timeout_s)
        work.job.future.add_done_callback(lambda future: self._job_done(work, future))

    def _timed_out(self, work: Work, timeout_s: float) -> None:
        job = work.job
        if job is not None and not job.future.done():
            self.executor.expire(job, timeout_s)

    def _job_done(self, work: Work, future: concurrent.futures.Future) -> None:
        """(any thread) Its job answered: a launch's Finishing (the finisher has it), or an exception."""
        if future.exception() is not None:
            self.finisher.call_on_loop(self._failed_before, work, future.exception())

    def _failed_before(self, work: Work, exc: BaseException) -> None:
        if isinstance(exc, Requeued):  # taken back out of the device queue: it waits in the ledger again
            work.give_back()
            self.finisher.in_background(self._returned(work))
        else:
            self.finisher.in_background(self.finisher.failed(work, exc))

    async def _returned(self, work: Work) -> None:
        try:
            await self.feeder.returned(work)
        finally:
            self.finisher.ended(work)

    async def get(self, task_id: str) -> TaskRecord | None:
        """The task's record: a deferred task's own while it is in flight here (or answered, its
        record not yet committed), else the ledger's. In that order: the record leaves ``pending``
        only once the ledger has it, so no moment finds it in neither."""
        work = self.pending.get(task_id)
        if work is not None and work.deferred:
            return work.in_flight_record()
        return await asyncio.to_thread(self.ledger.get, task_id)

    async def finished_record(self, task_id: str, timeout: float) -> TaskRecord | None:
        """Wait (within ``timeout``) for a task of this process to finish, then for the finisher
        to record it; its record as the ledger then holds it."""
        work = self.pending.get(task_id)
        # only the job's future here: a stop's traceback keeps this frame, and with ``work`` in it,
        # its arrays, in a reference cycle (asyncio's wait_for frame <-> the exception)
        future = work.job.future if work is not None and work.job is not None else None
        del work
        if future is not None:
            try:
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout)
            except BaseException:  # noqa: BLE001 - the job's own outcome is recorded by the finisher
                pass
            finally:  # (its exception's traceback keeps this frame: without the future in it, no cycle)
                future = None
        record = None
        for _ in range(100):  # the finisher records it: let it
            record = await self.get(task_id)
            if record is None or record.finished:
                return record
            await asyncio.sleep(0.02)
        return record

    async def written(self, timeout_s: float | None = None) -> None:
        """Once every answered task's record handed to the ledger so far is in it, or ``timeout_s``
        has passed (a ledger that does not answer: the reader goes on without)."""
        barrier = self.writer.written()
        if barrier is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.wrap_future(barrier), timeout_s)

    # ------------------------------------------------------------------ cancel, recover
    async def cancel(self, task_id: str) -> TaskRecord | None:
        """Stop a task: a queued one never runs, a running one is stopped at its next safe point.
        Returns its record once the ledger says it has finished (None for an unknown id); a task
        that finished some other way first has that status, not ``cancelled``."""
        record = await self.get(task_id)
        if record is None or record.finished:
            return record
        work = self.pending.get(task_id)
        if work is not None and work.job is not None:
            self.executor.withdraw(work.job, "cancel", f"was cancelled (POST /tasks/{task_id}/cancel)")
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

    async def recover(self) -> dict[str, int]:
        """What a stop left unfinished: asynchronous work waits in the ledger and the feeder claims
        it again; a synchronous task (its client's connection went with the stop) is recorded
        failed. With a shared ledger, only expired leases are reaped (app/tasks/feeder.py)."""
        self.finisher.loop = asyncio.get_running_loop()
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
