"""(PostgreSQL) The leases of the work one replica runs, for its feeder (app/tasks/feeder.py).

    attempts  every task queued here under a lease (a claim, or a synchronous task recorded here)
              is an attempt with that lease's epoch, from its queueing until the finisher ends it,
              recorded or not (``attempt_began``/``attempt_ended``); each of its writes is fenced
              by that epoch
    renew     every ``REV88_LEASE_RENEW_S``, on a thread (``rev88-leases``) and a database connection
              of their own: the live attempts' leases, and only those, are extended; an attempt
              whose lease was lost is stopped here (its late result would be refused anyway); a
              held task whose cancellation was requested through another replica is stopped
    listen    a thread LISTENs for the ledger's notifications: a queued task wakes the claimer (and
              the backlog's tenants are counted again), a cancel request for a task here stops it
    cancel    a task this replica does not run: a cancel request in its row; the answer is its
              record once its holder (or a reaper) records it
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ..ledger import AlreadyFinished, LedgerUnavailable, TaskRecord
from ..threads import name_os_thread
from .work import Work

log = logging.getLogger("rev88.app.tasks.feeder")


class LeaseKeeping:
    """(A part of Feeder: its ledger, loop, attempts and counters.)"""

    def attempt_began(self, acc: Work) -> None:
        """(the runner, as it queues a task under a lease) Its lease is renewed while it lives."""
        with self._attempts_lock:
            self._attempts[acc.task_id] = acc

    def attempt_ended(self, acc: Work) -> None:
        """(the runner, as its settling ends, recorded or not) Its lease is renewed no more."""
        with self._attempts_lock:
            if self._attempts.get(acc.task_id) is acc:
                del self._attempts[acc.task_id]

    def live_attempts(self) -> dict[str, int]:
        """task id -> the epoch of the attempt running it here (thread-safe)."""
        with self._attempts_lock:
            return {task_id: acc.epoch for task_id, acc in self._attempts.items() if acc.epoch is not None}

    def _keep_leases(self) -> None:
        """The ``rev88-leases`` thread: every ``renew_s``, the live attempts' leases renewed on the
        ledger's upkeep connection; what it found handed to the loop."""
        name_os_thread("rev88-leases")
        while not self._stop_listening.wait(self.renew_s):
            attempts = self.live_attempts()
            try:
                renewal = self.ledger.renew(attempts)
            except LedgerUnavailable as exc:
                self._to_loop(self._failed, "renew leases", exc)
                continue
            except Exception:  # noqa: BLE001 - the thread must go on
                log.exception("renewing leases failed")
                continue
            self._to_loop(self._renewed, renewal, attempts)

    def _to_loop(self, fn, *args) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # the loop closed meanwhile
                pass

    def _renewed(self, renewal: Any, attempts: dict[str, int]) -> None:
        """(the loop) A renewal's findings: attempts whose lease was lost are stopped here."""
        self._ok()
        for task_id in renewal.lost:
            with self._attempts_lock:
                acc = self._attempts.get(task_id)
            if acc is None or acc.epoch != attempts.get(task_id):
                continue  # (it finished here meanwhile)
            self.counters["leases_lost"] += 1
            log.warning("lease lost: the task runs on another replica now, or is queued again; stopping it here",
                        extra={"task_id": task_id, "epoch": acc.epoch})
            self._stop_here(task_id, "lease", "lost its lease (it expired and was reaped or taken over)")
        for task_id in renewal.cancel:
            self._cancel_here(task_id)

    def _stop_here(self, task_id: str, why: str, reason: str) -> bool:
        acc = self.runner.pending.get(task_id)
        if acc is None or acc.job is None:
            return False
        return self.runner.executor.withdraw(acc.job, why, reason)

    def _cancel_here(self, task_id: str) -> None:
        if self._stop_here(task_id, "cancel", f"was cancelled (POST /tasks/{task_id}/cancel)"):
            self.counters["cancels_noticed"] += 1

    def _notified(self, channel: str, payload: str) -> None:
        """From the listener thread."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        if channel == "rev88_cancel":
            loop.call_soon_threadsafe(self._cancel_here, payload)
        else:  # a task queued somewhere, or the listener (re)connected: look for work
            self._depth_stale = True
            loop.call_soon_threadsafe(self._wake.set)

    async def cancel_elsewhere(self, task_id: str) -> TaskRecord | None:
        """Cancel a task this replica does not run: its record once recorded finished (None for an
        unknown id); waits for its holder at most a lease and a few polls."""
        try:
            outcome, record = await asyncio.to_thread(self.ledger.request_cancel, task_id)
        except KeyError:
            return None
        except AlreadyFinished as exc:
            return exc.record
        if outcome == "cancelled":
            return record
        return await self.wait_finished(task_id, self.ledger.lease_s + 2 * self.poll_s + 5.0)

    async def wait_finished(self, task_id: str, timeout: float) -> TaskRecord | None:
        """Poll the shared ledger until the task has finished (or ``timeout``); its record then."""
        deadline = time.monotonic() + timeout
        delay = 0.02
        while True:
            record = await self.runner.get(task_id)
            if record is None or record.finished or time.monotonic() >= deadline:
                return record
            await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 1.5, 0.25)

    def _count_reaped(self, reaped: dict[str, int]) -> None:
        for outcome, n in reaped.items():
            self.counters[f"reaped_{outcome}"] += n

    async def _maintain_loop(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            if not self.leases:  # (SQLite: the backlog is counted in memory; a poll claims what the plan allows)
                self.depth = self.ledger.queue_depth()
                self.wake()
                continue
            try:
                reaped = await asyncio.to_thread(self.ledger.reap)
                self._count_reaped(reaped)
                if reaped["requeued"]:
                    self.wake()
                self.depth = await asyncio.to_thread(self.ledger.queue_depth)
                self._ok()
            except LedgerUnavailable as exc:
                self._failed("reap expired leases", exc)
            except Exception:  # noqa: BLE001
                log.exception("reaping expired leases failed")

    async def _give_back(self, task_ids: list[str]) -> None:
        """Release claims no attempt here runs (queued again at once, no expiry counted); with the
        database away they are only forgotten here, and expire."""
        if not task_ids:
            return
        try:
            released = await asyncio.to_thread(self.ledger.release, task_ids)
            self.counters["released"] += len(released)
        except LedgerUnavailable as exc:
            self.ledger.forget(task_ids)
            self._failed("give back claims", exc)

