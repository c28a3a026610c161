"""Launches, not cells: what a device worker does around a launch (issues #46, #55).

A device worker runs a launch of gathered tasks (``launch_on_device``: each task's seed-derived
state from learner/seed_state.py, one ``run_many``) -- or one task alone (``run_alone``: a backend
that cannot batch, a measurement, the only task of its key): a launch of one -- and goes back to
the queue at once. What follows is the finisher's (app/tasks/finisher.py), on its own thread,
while the device runs the next launch (the pipeline: launch k+1 is gathered and started by the
worker while launch k is finished there; a thread, not CUDA streams, because what follows a
launch is Python and hashing, not device work). Every task's job answers a ``Finishing``: the
future of its launch's finishing and its place in it.

Ahead of the launch, on the *prepare* thread: the seed-derived state of each task as it is
queued on the device (and of a sweep's or an evaluation's first cells as they are accepted, while
the ledger records them), so that the worker's ``prepare`` finds it kept while launch k runs, not
after it (``prepare_ahead``; learner/seed_state.py waits for a state under way rather than
computing it twice). One thread: it computes states faster than the device uses them
(docs/performance.md, "Small costs inside a request").

The device never runs far ahead of the finisher: a worker starts a launch (``run``: every task of
a backend that batches) only while fewer than ``UNFINISHED_MAX`` launches (this one counted) are
out of the device and not yet finished. A launch's outputs are host memory (a 132-task launch's scores alone are 53 MB); a device faster
than the host's finishing -- an H200 against two cores -- would otherwise pile them up for a whole
sweep (25 of a 5,280-cell sweep's 40 launches held at once against the stand-in device). The
bound leaves the pipeline its overlap: launch k runs while k-1 and k-2 are finished.

One bad task fails alone: its own error is its outcome, among the others' -- a task that diverged,
one cancelled, one whose tenant's key was revoked while it waited (checked as its launch is
gathered: it does not run).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from typing import Any

from learner import seed_state
from learner.seed_processes import SeedProcess, SeedProcesses

from ..threads import name_os_thread
from .answers import Measured
from .device import (
    finish_launch,
    has_run_many,
    launch_on_device,
    measure_on_device,
    run_on_device,
    worker_engine,
)
from .finisher import Ended, Finisher

log = logging.getLogger("rev88." + __name__)

STATES_PER_BATCH = 32  # seed states computed together: a seed-state process's request, the prepare thread's batch
UNFINISHED_MAX = 3  # a device worker's launches out of the device and not yet finished, the one running counted


@dataclasses.dataclass(frozen=True)
class Finishing:
    """A task's outcome in a launch still being finished: ``future`` gives the launch's outcomes."""

    future: concurrent.futures.Future
    index: int

    def outcome(self, ended: list[Ended | None]) -> Ended | None:
        return ended[self.index]


class Launches:
    """A worker's side of launches, for a ``TaskRunner`` (which owns the tasks), finished by ``finisher``."""

    def __init__(self, runner: Any, finisher: Finisher, seed_processes: SeedProcesses | None = None) -> None:
        """``seed_processes``: where states are computed apart from this process's GIL, in batches
        (REV88_SEED_PROCESSES; learner/seed_processes.py): one prepare thread waits on each."""
        self.runner, self.finisher = runner, finisher
        self.seed_processes = seed_processes
        self._drains_max = max(1, seed_processes.count if seed_processes is not None else 0)
        self.preparer = concurrent.futures.ThreadPoolExecutor(
            max_workers=self._drains_max, thread_name_prefix="rev88-prepare", initializer=name_os_thread,
            initargs=("rev88-prepare",))
        self._ahead: collections.OrderedDict[tuple, tuple] = collections.OrderedDict()  # states wanted, not begun
        self._ahead_lock = threading.Lock()
        self._drains = 0  # prepare threads taking states from _ahead
        self.counters = finisher.counters  # (the finisher's counts, and what was prepared ahead)
        self.counters["states_prepared_ahead"] = self.counters["states_prepared_apart"] = 0
        self._worker = threading.local()  # each device worker's places: one for each launch until it is finished
        self._unrecorded: set[concurrent.futures.Future] = set()  # launches handed to the finisher, not yet recorded

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop preparing; every launch handed to the finisher finished and its records written."""
        with self._ahead_lock:
            self._ahead.clear()
        self.preparer.shutdown(wait=True)
        self.finisher.close()
        concurrent.futures.wait(list(self._unrecorded), timeout=timeout_s)

    # ------------------------------------------------------------------ ahead of the launch
    def prepare_ahead(self, accs: list[Any]) -> None:
        """(any thread; cheap) Compute, on the prepare thread, the seed-derived states of these
        tasks that are neither kept nor under way. Skipped: a task not parsed yet (its job parses
        it), states beyond half the cache's bound (they would push out each other before their
        launch), and everything when the cache keeps nothing (REV88_SEED_CACHE_BYTES=0)."""
        self.prepare_states_ahead([(acc.config, acc.task.train_count) for acc in accs if acc.task is not None])

    def prepare_states_ahead(self, wanted: list[tuple[Any, int]]) -> None:
        """``prepare_ahead`` for (config, training count) pairs: work known before its tasks are
        built (a sweep's cells as soon as its request is checked)."""
        cache = seed_state.states
        if cache.max_bytes <= 0 or not wanted:
            return
        with self._ahead_lock:
            for config, rows in wanted:
                key = cache.key(config, rows)
                if key in self._ahead or not cache.missing(config, rows):
                    continue
                if (len(self._ahead) + 1) * seed_state.estimate_bytes(config, rows) > cache.max_bytes // 2:
                    break
                self._ahead[key] = (config, rows)
            drains = min(self._drains_max - self._drains, -(-len(self._ahead) // STATES_PER_BATCH))
            self._drains += max(0, drains)
        for _ in range(drains):
            try:
                self.preparer.submit(self._prepare_wanted)
            except RuntimeError:  # (shut down: the launches prepare their own)
                with self._ahead_lock:
                    self._ahead.clear()
                    self._drains -= 1

    def _prepare_wanted(self) -> None:
        cache = seed_state.states
        while True:
            process = self.seed_processes.take() if self.seed_processes is not None else None
            with self._ahead_lock:
                wanted = [self._ahead.popitem(last=False)[1]
                          for _ in range(min(STATES_PER_BATCH, len(self._ahead)))]
                if not wanted:
                    self._drains -= 1
            if process is not None:
                try:
                    if wanted:
                        self._prepare_apart(process, wanted)
                finally:
                    self.seed_processes.give(process)
            elif wanted:  # (no process ready: in this thread, the batch together)
                try:
                    self.counters["states_prepared_ahead"] += cache.prepare(wanted)
                except Exception:  # noqa: BLE001 - their launches compute them again and answer what fails
                    log.debug("seed states prepared ahead failed", exc_info=True)
            if not wanted:
                return

    def _prepare_apart(self, process: SeedProcess, wanted: list[tuple[Any, int]]) -> None:
        """States computed by a seed-state process, each under way in the cache meanwhile (a launch
        that needs one waits for it); one it does not give back is computed by its launch."""
        cache = seed_state.states
        claimed = [(key, pair) for pair in wanted if (key := cache.claim(*pair)) is not None]
        states: list = [None] * len(claimed)
        try:
            if claimed:
                states = process.states([pair for _, pair in claimed])
                self.counters["states_prepared_ahead"] += len(states)
                self.counters["states_prepared_apart"] += len(states)
        except Exception:  # noqa: BLE001 - said; a process gone is not lent again
            log.warning("a seed-state process did not compute its batch; its launches compute those states",
                        exc_info=True)
        finally:  # every claimed state settled: a launch waits for each until it is
            for i, (key, _) in enumerate(claimed):
                cache.settle(key, states[i] if i < len(states) else None)

    # ------------------------------------------------------------------ the worker's part
    def run(self, items: list[tuple], backend: str, precision: str | None) -> list[Finishing]:
        """(a device worker) The launch on the device; its finishing handed to the finisher thread.
        An item is (task, config, cancel token, its work)."""
        r = self.runner
        places = getattr(self._worker, "places", None)
        if places is None:
            places = self._worker.places = threading.BoundedSemaphore(UNFINISHED_MAX)
        places.acquire()  # (waits while this worker's last UNFINISHED_MAX - 1 launches are being finished)
        done: concurrent.futures.Future = concurrent.futures.Future()  # the launch's outcomes, once recorded
        try:
            launch = launch_on_device(items, backend, r.energy, r.engines, precision, refuse=self._refusal)
            self.finisher.thread.submit(self._finish, launch, done)
        except BaseException:
            places.release()
            raise
        done.add_done_callback(lambda _: places.release())
        self._watch(done)
        return [Finishing(done, i) for i in range(len(items))]

    def _watch(self, done: concurrent.futures.Future) -> None:
        """A launch's outcomes until they are recorded (``close`` waits for them); its failure said."""
        self._unrecorded.add(done)
        done.add_done_callback(self._unrecorded.discard)
        done.add_done_callback(_log_failure)

    def _finish(self, launch, done: concurrent.futures.Future) -> None:
        try:
            outcomes = finish_launch(launch, self.finisher.hashers)
            count = sum(1 for run in launch.runs if isinstance(run, tuple))
            self.finisher.launch([(item[3], value) for item, value in zip(launch.items, outcomes)],
                                 launch.device_s, count, done)
        except BaseException as exc:  # noqa: BLE001 - said loudly (_log_failure)
            if not done.done():
                done.set_exception(exc)

    def run_alone(self, work: Any) -> Finishing:
        """(a device worker) One task's job: in a launch of its own on a backend that batches (with
        REV88_BATCH_MAX > 1), else the single run (a measurement: its protocol); then the same
        finishing (a plain synchronous task's on this worker). What stops it before
        its result -- its tenant's key revoked, a body its job finds invalid, a run that raised --
        is its job's exception (the executor answers it; the runner hands it to the finisher)."""
        r = self.runner
        engine = worker_engine(work.backend, r.engines, work.precision)
        if work.measure is None and work.task is not None and r.batch_max > 1 and has_run_many(engine):
            return self.run([(work.task, work.config, work.cancel, work)], work.backend, work.precision)[0]
        refused = r.refusal(work)
        if refused is not None:
            raise refused
        if work.task is None:  # a deferred task's body: parsed here, on the worker
            work.task = r.parse_late(work)
        t0 = time.monotonic()
        if work.measure is not None:
            value: Any = Measured(measure_on_device(work.task, work.config, work.backend, work.measure, r.energy,
                                                    r.engines, work.precision))
        else:
            value = run_on_device(work.task, work.config, work.backend, r.energy, r.engines, cancel=work.cancel,
                                  precision=work.precision)
        device_s = time.monotonic() - (work.started_mono or t0)
        future: concurrent.futures.Future = concurrent.futures.Future()
        if not work.deferred:  # its outcome is written before anyone is told: on the finisher's thread
            self.finisher.thread.submit(self._finish_one, work, value, device_s, future)
            self._watch(future)
            return Finishing(future, 0)
        # A plain synchronous task (its record goes to the next group commit, nobody waits for the
        # disk): finished here, on this worker, by the same finisher, without the hop to its thread
        # (bench/bench_shell.py: the hop cost a tiny task more server CPU than its answer)
        self._finish_one(work, value, device_s, future)
        future.add_done_callback(_log_failure)
        return Finishing(future, 0)

    def _finish_one(self, work: Any, value: Any, device_s: float, done: concurrent.futures.Future) -> None:
        try:
            self.finisher.launch([(work, value)], device_s, 1, done)
        except Exception as exc:  # noqa: BLE001 - said loudly, as a launch's finishing that failed
            if not done.done():
                done.set_exception(exc)

    def _refusal(self, item: tuple) -> BaseException | None:
        work = item[3] if len(item) > 3 else None
        return self.runner.refusal(work) if work is not None else None


def _log_failure(future: concurrent.futures.Future) -> None:
    """A launch's finishing that failed as a whole (a bug: every task's own error is its outcome) is
    said loudly: its cells stay unfinished in the ledger and run again at the next start."""
    exc = future.exception()
    if exc is not None:
        log.error("finishing a launch failed", exc_info=(type(exc), exc, exc.__traceback__))
