"""A device worker's loop, for the executor (app/runtime/executor.py): which job it runs next,
the launch it gathers around it, the run and its answers.

Which job: of each tenant's oldest job the worker may run (not pinned elsewhere, not of a batch key
another worker is gathering, its tenant below its running limit), the lowest start tag in
virtual time (fair share: app/runtime/fair_share.py). Dynamic batching: when that job has a
``Batch``, ``batch_max > 1`` and ``Batch.ready()`` says the device can take such a call, the
worker gathers the queued jobs of its key -- the head, then the lowest start tags, at most
``batch_max`` -- waiting at most ``batch_wait_s`` for more (not at all once the launch is full or
the executor is closed), and runs them in one call; each job is answered with its own item's
outcome. Gathered jobs stay queued, and may expire, never to run, until the call starts.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from learner.errors import TaskCancelled

from ..errors import NotAccepted
from ..threads import name_os_thread
from .jobs import DONE, QUEUED, RUNNING, Batch, Job

log = logging.getLogger("rev88.app.runtime.executor")

_local = threading.local()


def current_worker() -> Worker | None:
    """The worker whose thread is running this code (None outside a worker)."""
    return getattr(_local, "worker", None)


def select_cuda_device(device: str) -> None:
    """Make ``cuda:N`` the calling thread's current CUDA device (the CUDA runtime keeps one per
    host thread: without it every worker's bare ``cuda`` work, and every library that uses the
    current device, would land on GPU 0). A CPU worker, or a machine without CUDA (where the GPU
    backends refuse on their own): nothing to select."""
    kind, _, index = device.partition(":")
    if kind != "cuda":
        return
    import torch

    if torch.cuda.is_available():
        torch.cuda.set_device(int(index or 0))


class Worker:
    """One device and the thread that runs its calls."""

    def __init__(self, executor: Any, index: int, device: str) -> None:  # (a DeviceExecutor)
        self.executor, self.index, self.device = executor, index, device
        self.running: list[Job] = []  # the jobs of the device call in progress
        self.tasks = 0  # jobs this worker has run
        self.launches = 0
        self.busy_s = 0.0  # seconds spent in device calls
        self.failures = 0  # device calls that raised for every job in them
        self.thread = threading.Thread(target=self._loop, name=f"rev88-worker-{device}", daemon=True)

    def snapshot(self) -> dict[str, Any]:
        first = self.running[0] if self.running else None
        return {
            "index": self.index,
            "device": self.device,
            "busy": bool(self.running),
            "running": None if first is None else {
                "kind": first.kind,
                "id": first.label,
                "seconds": round(time.monotonic() - (first.started or time.monotonic()), 3),
                "jobs": len(self.running),
            },
            "tasks": self.tasks,
            "launches": self.launches,
            "busy_seconds": round(self.busy_s, 3),
            "failed_launches": self.failures,
        }

    def _loop(self) -> None:
        name_os_thread(f"rev88-w{self.index}")
        _local.worker = self
        self.executor.serve(self)


class WorkerLoop:
    """(A part of DeviceExecutor: its queue, lock, workers, fair share and stats.)"""

    def serve(self, worker: Worker) -> None:
        """The loop of a worker's thread (``Worker.thread`` runs it; nothing else calls it): select
        the worker's device, then until ``stop``, take the job it runs next (``_next_for``) and run
        it -- alone, or with the queued jobs of its batch key gathered into one call -- and, while
        no job waits for it, call the idle hook every ``idle_interval_s``."""
        try:
            (self._select_device or select_cuda_device)(worker.device)  # (looked up now: tests replace it)
        except Exception as exc:  # noqa: BLE001 - said loudly; its jobs then fail on the device itself
            log.error("worker cannot select its device", extra={"device": worker.device, "error": str(exc)})
        while True:
            with self._cond:
                head = self._next_for(worker)
                if head is None and not self._stop:
                    self._cond.wait(self._idle_interval_s if self._idle_hook else None)
                    head = self._next_for(worker)
                if head is None and self._stop:
                    return
            if head is None:
                self._idle()
                continue
            batched = head.batch is not None and self.batch_max > 1 and self._batch_ready(head.batch)
            with self._cond:
                group = self._gather(worker, head) if batched else self._take(worker, [head])
            if group:
                self._run(worker, group)
            # not kept while this worker waits for its next job: the jobs' closures hold their tasks
            del head, group

    def _next_for(self, worker: Worker) -> Job | None:
        """(Lock held.) The job this worker runs next: of each tenant's oldest job it may run (not
        pinned elsewhere, not of a batch key another worker is gathering, its tenant below its
        running limit), the one with the lowest start tag in virtual time (app/runtime/fair_share.py:
        the tenant served least for its weight; ties: the job that has waited longest). FIFO within
        a tenant; with one tenant, FIFO."""
        heads: dict[str, Job] = {}
        for job in self._queue:
            if job.tenant in heads:
                continue
            if job.pin is not None and job.pin != worker.index:
                continue
            if job.batch is not None and self._gathering.get(job.batch.key, worker.index) != worker.index:
                continue
            if job.max_running is not None and self._running[job.tenant] >= job.max_running:
                continue
            heads[job.tenant] = job
        if len(heads) <= 1:
            return next(iter(heads.values()), None)
        return min(heads.values(), key=lambda j: (j.tag, j.submitted))

    def _batch_ready(self, batch: Batch) -> bool:
        try:
            return bool(batch.ready())
        except Exception:  # e.g. the backend cannot be created: the job's own fn reports that
            log.debug("batch not ready; running the job alone", exc_info=True)
            return False

    def _gather(self, worker: Worker, head: Job) -> list[Job]:
        """(Lock held.) Collect queued jobs of the head's key, waiting up to ``batch_wait_s``
        for more; then take them off the queue. [] if the head is gone (or another worker
        took it)."""
        key = head.batch.key
        if self._gathering.setdefault(key, worker.index) != worker.index:
            return []  # another worker gathers this key (it became so while the lock was free)
        try:
            deadline = time.monotonic() + self.batch_wait_s
            while True:
                if head.state != QUEUED:  # expired, withdrawn or taken while we waited: start over
                    return []
                # the head, then the lowest start tags of its key (fair share: app/runtime/fair_share.py)
                group = sorted((j for j in self._queue if j.batch is not None and j.batch.key == key
                                and j.pin in (None, worker.index)),
                               key=lambda j: (j is not head, j.tag, j.submitted))[: self.batch_max]
                left = deadline - time.monotonic()
                if len(group) >= self.batch_max or left <= 0 or self._closed is not None or self._stop:
                    return self._take(worker, group)
                self._cond.wait(left)
        finally:
            del self._gathering[key]
            self._cond.notify_all()  # the others may take this key's jobs again

    def _take(self, worker: Worker, group: list[Job]) -> list[Job]:
        """(Lock held.) Move still-queued jobs of ``group`` from the queue onto the worker."""
        group = [j for j in group if j.state == QUEUED]
        now = time.monotonic()
        for job in group:
            self._queue.remove(job)
            job.state = RUNNING
            job.started = now
            job.launch_size = len(group)
            job.worker = worker.device
            self._running[job.tenant] += 1
        worker.running = group
        if group:
            self.fair.began(min(j.tag for j in group))
            self.stats.launches += 1
            self.stats.largest_launch = max(self.stats.largest_launch, len(group))
            if len(group) > 1:
                self.stats.batched += len(group)
            self._cond.notify_all()  # another worker's gathering may have lost its head
        return group

    def _run(self, worker: Worker, group: list[Job]) -> None:
        if self._on_launch is not None:
            try:
                self._on_launch(len(group))
            except Exception:  # a metrics hiccup must not lose the jobs
                log.exception("launch hook failed")
        for job in group:
            if job.on_start is not None:
                try:
                    job.on_start(job)
                except Exception:  # e.g. the ledger could not record "running": the run goes on
                    log.exception("job start hook failed", extra={"task_id": job.label})
        outcomes: list[tuple[Any, BaseException | None]]
        t0 = time.monotonic()
        if len(group) == 1:
            try:
                outcomes = [(group[0].fn(), None)]
            except BaseException as exc:  # noqa: BLE001 - every failure goes to the one answer
                outcomes = [(None, exc)]
        else:
            try:
                values = group[0].batch.run([j.batch.item for j in group])
                if len(values) != len(group):
                    raise RuntimeError(f"a batched call returned {len(values)} outcomes for {len(group)} jobs")
                outcomes = [(None, v) if isinstance(v, BaseException) else (v, None) for v in values]
            except BaseException as exc:  # noqa: BLE001 - the whole call failed: each job gets that answer
                outcomes = [(None, exc)] * len(group)
                worker.failures += 1
                log.error("device call failed for every job in it", extra={
                    "device": worker.device, "jobs": len(group), "error": repr(exc)})
        worker.busy_s += time.monotonic() - t0
        worker.tasks += len(group)
        worker.launches += 1
        self._finish(worker, group, outcomes)
        # A failed run's traceback holds this frame: without these locals, no cycle from it back to
        # the exception and the jobs (their closures hold the tasks' arrays) for the cyclic GC to find.
        del group, outcomes, job

    def _finish(self, worker: Worker, group: list[Job], outcomes: list[tuple[Any, BaseException | None]]) -> None:
        discarded: list[tuple[Job, BaseException | None]] = []
        with self._cond:
            worker.running = []
            now = time.monotonic()
            started = group[0].started or now
            # Retry-After: device seconds per job (a batched call shares its time among its jobs)
            self._mean_run_s = 0.7 * self._mean_run_s + 0.3 * (now - started) / len(group)
            for job, (value, error) in zip(group, outcomes):
                job.finished = now
                self._running[job.tenant] -= 1
                if job.tag != float("-inf"):
                    self.fair.done(job.tenant)
                was_stopped = isinstance(error, TaskCancelled)
                if was_stopped:
                    self.stats.stopped += 1
                if job.future.done():  # answered already (drain deadline, or gave up waiting)
                    self.stats.abandoned_finished += 1
                    discarded.append((job, error))
                    continue
                job.state = DONE
                if error is None:
                    self.stats.completed += 1
                    job.future.set_result(value)
                    continue
                if isinstance(error, NotAccepted):
                    self.stats.refused_input += 1
                else:
                    self.stats.failed += 1
                if was_stopped and job.stop is not None:
                    error = self.stopped_error(job, error)
                job.future.set_exception(error)
            self._cond.notify_all()
        for job, error in discarded:
            log.warning(
                "task finished after it was answered; result discarded",
                extra={"task_id": job.label, "device_s": round(job.device_s or 0.0, 3),
                       "stopped": isinstance(error, TaskCancelled),
                       "error": None if error is None else repr(error)},
            )

    def _idle(self) -> None:
        if self._idle_hook is None:
            return
        try:
            self._idle_hook()
        except Exception:  # an idle sample must never stop a worker
            log.exception("idle hook failed")
