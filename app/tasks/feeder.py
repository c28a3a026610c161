"""The feeder: asynchronous work waits in the ledger and is claimed into the device queue by
fair share (issues #22, #44).

Every asynchronous task, sweep cell, evaluation cell and recovered task is recorded queued in the
ledger and ``offer``ed; the feeder moves it into the device queue as room frees, through one claim
path for both stores: the SQLite ledger's claims are in process (app/ledger/local_claims.py), the
PostgreSQL ledger's are leases every replica shares (app/ledger/postgres.py). ``Feeder`` is
that machinery, built by the service beside the ``TaskRunner`` and driving it (the backlog's side
in app/tasks/backlog.py, the leases' in app/tasks/leases.py):

    claim     whenever it may help (woken by a local job ending, by an offer, by a NOTIFY that a
              task was queued, or every ``REV88_CLAIM_POLL_S``), never past the device queue's
              room: while the workers' work in hand is under ``slots + prefetch`` (workers x batch
              size, and one more launch's worth waiting), up to that much, the least-served
              tenants first; and whenever a tenant with work waiting in the ledger holds less than
              its share of the device queue (``capacity`` by weight among the tenants with work
              waiting), up to its share, so that its work runs next even while the workers are
              busy with another tenant's. Each claim is queued on the local workers as a job that
              may be taken back to the ledger (``evictable``: app/runtime/executor.py) to make
              room for a synchronous task under its tenant's share; it is then ``returned`` here and
              waits again. A task offered by this replica is run from the arrays it already
              parsed; any other from its stored npz (or its stored dataset).
    backlog   the ledger's waiting asynchronous work is bounded by REV88_BACKLOG_SIZE tasks and
              REV88_BACKLOG_BYTES of stored uploads (``check_capacity``: 503 naming the limit);
              each tenant by its key's max_queued (the runner's check).
    attempts  (PostgreSQL) every task queued here under a lease (a claim, or a synchronous task
              recorded here) is an attempt with that lease's epoch, from its queueing until its
              settling ends, recorded or not (``attempt_began``/``attempt_ended``, called by the
              runner); each of its writes is fenced by that epoch. A claim that never becomes an
              attempt (its input cannot be read or parsed, the queue refuses it, an older attempt
              of the task still runs here) is released at once, or, with the database away, left
              to expire: nothing holds a lease that no attempt here uses.
    renew     (PostgreSQL) every ``REV88_LEASE_RENEW_S``, on a thread (``rev88-leases``) and a
              database connection of their own (not the pool, not asyncio's threads: request
              traffic cannot starve it; timeouts of a quarter lease): the leases of the live
              attempts, and only those, are extended; an attempt whose lease was lost (it expired
              and was reaped or taken over) is stopped here, its late result would be refused
              anyway (fencing); a held task whose cancellation was requested through another
              replica is stopped and recorded cancelled.
    reap      (PostgreSQL) every ``REV88_CLAIM_POLL_S``: expired leases, any replica's, queued
              again or failed (``ledger.reap``); the backlog is counted for /metrics and for the
              tenants' shares.
    listen    (PostgreSQL) a thread LISTENs for the ledger's notifications: a queued task wakes
              the claimer, a cancel request for a task running here stops it within a moment.
    cancel    (PostgreSQL) a task this replica does not run: a cancel request in its row; the
              answer is its record once its holder (or, should the holder be gone, a reaper)
              records it. (SQLite: the runner cancels a waiting task in the ledger directly.)

The database going away: every loop logs once, keeps going and recovers by itself; tasks keep
running, their results are written when the database answers again (retried while this
replica's lease still holds), and a replica that lost its lease meanwhile has its result refused
while the task runs again elsewhere (runs are deterministic: the same answer).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import threading
from typing import Any

from learner.config import make_config
from learner.taskio import TaskArrays, load_task

from ..ledger import AlreadyFinished, LeaseLost, LedgerUnavailable, TaskRecord
from .backlog import Backlog
from .feed_plan import FeedPlan, Runs
from .leases import LeaseKeeping
from .work import Work

log = logging.getLogger("rev88." + __name__)

BACKLOG_SIZE = 100_000  # REV88_BACKLOG_SIZE's default: waiting asynchronous tasks (rows of ~2 KB each)


class Feeder(Backlog, LeaseKeeping):
    def __init__(self, runner: Runs, ledger: Any, plan: FeedPlan) -> None:
        """``ledger``: what claims (the PostgreSQL ledger itself, or app/ledger/local_claims.py's
        LocalClaims over SQLite)."""
        self.runner, self.ledger = runner, ledger
        self.leases = bool(getattr(ledger, "leases", True))  # PostgreSQL's claims are leases
        self.ready = plan.ready or (lambda: True)
        workers, batch_max = plan.workers, plan.batch_max
        self.slots = max(1, workers * batch_max)  # tasks this replica's workers take at once
        # work claimed ahead, waiting in the device queue so that no worker waits for a claim: one more
        # launch per worker when batching; else, with SQLite, one task per worker -- but with a shared
        # ledger none (a task claimed ahead here could have run at once on an idle replica)
        self.prefetch = self.slots if batch_max > 1 else (0 if self.leases else max(1, workers))
        self.batch_max = batch_max
        self.renew_s, self.poll_s = plan.lease_renew_s, plan.claim_poll_s
        self.limit = plan.backlog_size or BACKLOG_SIZE
        self.limit_bytes = plan.backlog_bytes
        # task id -> (its acceptance, when offered, its arrays' bytes), oldest first
        self.offered: collections.OrderedDict[str, tuple[Work, float, int]] = collections.OrderedDict()
        self.offered_bytes = 0
        self.offered_weight = 0.0  # entries, an upload counting 1 and a dataset's cell CELL_WEIGHT
        self.cache_size = max(1, plan.queue_size)  # offered tasks kept here at most (and OFFER_CACHE_BYTES)
        self.depth: dict[str, Any] | None = None  # the backlog as last counted
        self.counters = {"claimed": 0, "from_stored_input": 0, "leases_lost": 0, "cancels_noticed": 0,
                         "reaped_requeued": 0, "reaped_failed": 0, "reaped_cancelled": 0, "released": 0,
                         "returned": 0, "refused_backlog": 0}
        self.database_error: str | None = None  # the last failure of a loop, until one succeeds
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._wake_scheduled = False  # a wake from another thread is on its way to the loop
        # a NOTIFY said work was queued somewhere: the backlog's tenants are counted again before the
        # next claim (fair share picks among the tenants it knows to have work waiting)
        self._depth_stale = False
        self._tasks: list[asyncio.Task] = []
        self._stop_listening = threading.Event()
        self._listener: threading.Thread | None = None
        self._attempts: dict[str, Work] = {}  # task id -> the attempt running it here under a lease
        self._attempts_lock = threading.Lock()
        self._keeper: threading.Thread | None = None  # the lease renewals' thread

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> dict[str, int]:
        """Reap what stopped replicas left (PostgreSQL) or load what this one left waiting (SQLite),
        start the loops (and the listener); the counts of work queued again and failed."""
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        counts = {"requeued": 0, "failed": 0}
        if self.leases:
            try:
                reaped = await asyncio.to_thread(self.ledger.reap)
                self._count_reaped(reaped)
                counts = {"requeued": reaped["requeued"], "failed": reaped["failed"] + reaped["cancelled"]}
            except LedgerUnavailable as exc:
                self._failed("reap at start", exc)
            self._listener = threading.Thread(target=self.ledger.listen, args=(self._notified, self._stop_listening),
                                              name="rev88-listen", daemon=True)
            self._listener.start()
            self._keeper = threading.Thread(target=self._keep_leases, name="rev88-leases", daemon=True)
            self._keeper.start()
        else:
            counts["requeued"] = await asyncio.to_thread(self.ledger.load)
            self.depth = self.ledger.queue_depth()
        for loop in (self._claim_loop, self._maintain_loop):
            self._tasks.append(asyncio.create_task(loop(), name=f"rev88-{loop.__name__.strip('_')}"))
        self.wake()
        return counts

    async def stop(self) -> None:
        """Stop the loops; give back the leases of unfinished tasks still held (they run
        elsewhere at once, no expiry counted). (SQLite: the ledger keeps them queued for the next start.)"""
        self._stop_listening.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if not self.leases:
            return
        if self._keeper is not None:
            await asyncio.to_thread(self._keeper.join, 5.0)
        held = sorted(set(self.ledger.held()) | set(self.live_attempts()))
        if held:
            try:
                released = await asyncio.to_thread(self.ledger.release, held)
                self.counters["released"] += len(released)
                if released:
                    log.info("released the leases of unfinished tasks", extra={"tasks": released})
            except LedgerUnavailable as exc:
                log.warning("could not release leases at stop (they expire instead)", extra={"error": str(exc)})
        if self._listener is not None:
            await asyncio.to_thread(self._listener.join, 5.0)


    def wake(self) -> None:
        """Look for work now (thread-safe)."""
        if self._loop is None or self._wake is None:
            return
        if self._loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._wake.set()
        elif not self._wake_scheduled:  # (a launch's jobs end together: one wake of the loop, not one each)
            self._wake_scheduled = True
            try:
                self._loop.call_soon_threadsafe(self._woken)
            except RuntimeError:  # the loop closed meanwhile (a stop)
                self._wake_scheduled = False

    def _woken(self) -> None:
        self._wake_scheduled = False
        if self._wake is not None:
            self._wake.set()

    def job_done(self, _future: Any) -> None:
        """A local job ended (any thread): a worker may be free. (SQLite's index is exact: with
        nothing in it, nothing to claim; the next ``offer`` wakes the claimer itself.)"""
        if self.leases or len(self.ledger):
            self.wake()

    # ------------------------------------------------------------------ claims

    def free_slots(self) -> int:
        return self.slots + self.prefetch - self.runner.executor.in_flight()

    def plan(self) -> tuple[int, list[tuple[str, int]] | None] | None:
        """(how many to claim, [(tenant, how many of its oldest)] in fair-share order -- None:
        the oldest of any tenant) now, or None: nothing to claim. Never past the device queue's
        room; enough to keep the workers fed, the tenants in the device queue's own order
        (virtual time: app/runtime/fair_share.py); beyond that only for a tenant under its share
        of the device queue while its work waits in the ledger and another tenant's waits in the
        device queue (the one fair share serves first)."""
        executor = self.runner.executor
        waiting = self.waiting()
        executor.fair_waiting(set(waiting))  # (whatever the room: a tenant's wait counts from its arrival)
        if not waiting and not self.leases:  # (SQLite's index is exact: nothing waits in the ledger)
            return None
        room = executor.capacity - executor.depth
        if room <= 0:
            return None
        free = self.free_slots()
        if free > 0:
            n = min(free, room)
            return n, _counts(executor.fair_order(n, waiting)) if waiting else None
        if not waiting:
            return None
        shares = executor.shares({t: w.weight for t, w in waiting.items()})
        present = executor.queued_by_tenant()
        # (only where another tenant's jobs wait in the device queue: they would run before this
        # tenant's backlog, which a free worker's claim would otherwise reach in fair-share order)
        under = {t: shares[t] - present.get(t, 0) for t in waiting
                 if present.get(t, 0) < shares[t] and any(n for u, n in present.items() if u != t)}
        if not under:
            return None
        # one tenant at a time, up to its own deficit: a claim of several could give one the others' share
        [tenant] = executor.fair_order(1, {t: waiting[t] for t in under})
        n = min(room, under[tenant], waiting[tenant].count)
        return n, [(tenant, n)]

    async def claim_some(self) -> int:
        """Claim while the plan says so; returns how many tasks were queued here."""
        queued = 0
        rounds = 0
        if self.leases and self._depth_stale and self.ready():  # work queued elsewhere (a NOTIFY): whose?
            self._depth_stale = False
            self.depth = await asyncio.to_thread(self.ledger.queue_depth)
        while not self.runner.executor.closed and self.ready() and rounds < 64:
            rounds += 1
            plan = self.plan()
            if plan is None:
                break
            limit, picks = plan
            claims = await asyncio.to_thread(self.ledger.claim, limit, picks)
            self._ok()
            if not claims:  # (a tenant's backlog counted but gone meanwhile: the next wake or poll looks again)
                break
            self.counters["claimed"] += len(claims)
            queued += await self._queue_claims(claims)
        return queued

    async def _claim_loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.poll_s)
            except TimeoutError:
                pass
            self._wake.clear()
            self._trim_offered()
            try:
                await self.claim_some()
            except LedgerUnavailable as exc:
                self._failed("claim", exc)
            except Exception:  # noqa: BLE001 - the loop must go on
                log.exception("claiming queued tasks failed")

    async def _queue_claims(self, claims: list) -> int:
        """Each claim becomes an attempt queued here, or its lease is given back (whatever fails on
        the way: reading or parsing its input, the queue, the database)."""
        attempts: set[str] = set()
        try:
            pending = self.runner.pending  # (an older attempt of a task still running here: not twice)
            # the work offered here, out of the cache at once: an offer meanwhile cannot push it out
            held = {c.task_id: acc for c in claims if c.task_id not in pending
                    and (acc := self._take_offered(c.task_id)) is not None}
            records, bodies = await _read_back([c for c in claims if c.task_id not in held and c.task_id not in pending],
                                               self.runner.ledger, self.ledger)
            for claim in claims:
                task_id = claim.task_id
                if task_id in pending:
                    log.warning("claimed a task an older attempt here still runs; its lease is given back",
                                extra={"task_id": task_id})
                    continue
                acc = held.pop(task_id, None)
                if acc is None:
                    record = records.get(task_id)
                    if record is None or record.finished:  # (gone, or finished, since its claim)
                        continue
                    acc = await self._from_stored(record, bodies.get(task_id), claim.epoch)
                    if acc is None:
                        continue
                    self.counters["from_stored_input"] += 1
                acc.epoch = claim.epoch
                try:
                    await self.runner.submit(acc, claimed=True)  # queued as this claim, settled with its launch
                except Exception as exc:  # noqa: BLE001 - e.g. a drain began: let another replica run it
                    acc.epoch = None
                    log.warning("claimed task not queued here; its lease is given back",
                                extra={"task_id": task_id, "error": str(exc)})
                    continue
                attempts.add(task_id)
        finally:
            await self._give_back([c.task_id for c in claims if c.task_id not in attempts])
        return len(attempts)

    async def _from_stored(self, record: TaskRecord, body: bytes | None, epoch: int) -> Work | None:
        """A claimed task accepted by another replica, from its stored npz; a task that cannot be
        re-run from it is failed, loudly."""
        dataset, labels = record.options.get("dataset"), None
        try:
            if dataset is not None:  # a task on a stored dataset: the dataset, read by this replica
                task, labels = await asyncio.to_thread(self.dataset_task, dataset)
            elif body is None:
                raise ValueError("its stored input is missing from the ledger")
            else:
                task = await asyncio.to_thread(load_task, body)
            config = make_config(record.config)
        except Exception as exc:  # noqa: BLE001
            log.error("cannot run a claimed task", extra={"task_id": record.id, "error": str(exc)})
            try:
                await asyncio.to_thread(functools.partial(self.runner.ledger.finish, record.id, "failed", None, {
                    "status": 500, "error": f"could not run the task from its stored input: {exc}"}, epoch=epoch))
            except (LeaseLost, AlreadyFinished, LedgerUnavailable) as exc2:
                log.warning("could not record the claimed task's failure", extra={"task_id": record.id,
                                                                                    "error": str(exc2)})
            return None
        return Work.from_record(record, task, config, labels)


    # ------------------------------------------------------------------ reaping, depth


    # ------------------------------------------------------------------ state

    def _failed(self, doing: str, exc: Exception) -> None:
        message = str(exc)
        if self.database_error is None:
            log.error("shared ledger unavailable; retrying", extra={"doing": doing, "error": message})
        self.database_error = message

    def _ok(self) -> None:
        if self.database_error is not None:
            log.info("shared ledger available again")
            self.database_error = None

    def dataset_task(self, digest: str) -> tuple[TaskArrays, Any]:
        """(blocking) A stored dataset's parsed arrays and scoring labels (None without), for a
        task recorded on it that runs again (a restart, a claim)."""
        if self.runner.datasets is None:
            raise ValueError(f"the task is on dataset {digest}, but this service has no dataset store")
        return self.runner.datasets.task(digest), self.runner.datasets.labels(digest)

    def snapshot(self) -> dict[str, Any]:
        return {
            "slots": self.slots,
            "in_flight_here": self.runner.executor.in_flight(),
            "leases_held": len(self.live_attempts()),
            "offered_cached": len(self.offered),
            "offered_cached_bytes": self.offered_bytes,
            "limit": self.limit,
            "limit_bytes": self.limit_bytes,
            "depth": self.depth,
            "leases": self.leases,
            "lease_renew_s": self.renew_s,
            "claim_poll_s": self.poll_s,
            "database_error": self.database_error,
            **self.counters,
        }


def _counts(picks: list[str]) -> list[tuple[str, int]]:
    """[(tenant, how many)] from a list of picks, in the order each tenant first comes."""
    counts = collections.Counter(picks)
    return [(t, counts[t]) for t in dict.fromkeys(picks)]


async def _read_back(claims: list, ledger: Any, claims_ledger: Any) -> tuple[dict[str, TaskRecord], dict[str, bytes]]:
    """The records of ``claims`` (read where a claim came without one) and the stored uploads of
    those not on a dataset: what their work is made from when this replica does not hold it."""
    unread = [c.task_id for c in claims if c.record is None]
    records = await asyncio.to_thread(ledger.get_many, unread) if unread else {}
    records.update({c.task_id: c.record for c in claims if c.record is not None})
    stored = [t for t, record in records.items() if not record.finished and not record.options.get("dataset")]
    bodies = await asyncio.to_thread(claims_ledger.load_uploads, stored) if stored else {}
    return records, bodies
