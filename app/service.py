"""The service: it builds the parts (ledger and writer, device executor, energy meters, metrics,
task runner) from the settings, and owns the warm-up, readiness and draining.

Lifecycle (driven by the FastAPI lifespan):

    start()   open the NVML meter (or learn why not), start the device thread, queue
              the warm-up (learner validation + one tiny synthetic task on the configured
              backend) ahead of everything, and hook SIGTERM/SIGINT.
    ready     once the warm-up succeeded and while not draining.
    SIGTERM   begin_drain(): ready -> 503, new tasks -> 503; uvicorn then stops listening
              and waits for open requests; accepted tasks keep running. At
              REV88_DRAIN_TIMEOUT_S after the signal, every task still waiting or running
              is answered 503 (never dropped), and if uvicorn is still held by a client
              (say, a stalled upload) a few seconds later, it is told to exit now.
    stop()    lifespan shutdown: end the device thread within what is left of the budget.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import signal
import threading
import time
from typing import Any

import numpy as np

from learner import permutations, seed_state
from learner.backends import device_datasets, get_backend, loaded_backends
from learner.config import Config
from learner.hashing import lanes_speedup
from learner.result import run_task, versions
from learner.seed_processes import SeedProcesses
from learner.taskio import validate_task
from learner.validate import cached_validation

from .errors import NotFound
from .http import uploads
from .http.logs import flush_logs
from .ledger import LedgerWriter, is_shared, open_ledger
from .ledger.engines import open_datasets
from .ledger.local_claims import LocalClaims
from .runtime.devices import GPU_BACKENDS, PlanError, plan
from .runtime.energy import Energy
from .runtime.executor import DeviceExecutor
from .runtime.metrics import Metrics
from .settings import Settings, SettingsError
from .tasks.datasets import DatasetCatalog
from .tasks.device import Engines, worker_engine
from .tasks.evaluations import Evaluations
from .tasks.feed_plan import FeedPlan
from .tasks.options import check_backend
from .tasks.runner import TaskRunner
from .tasks.sweeps import Sweeps
from .tasks.tenants import KeyRing
from .threads import name_os_thread
from .webhooks.delivery import Webhooks

log = logging.getLogger("rev88." + __name__)

FORCE_EXIT_GRACE_S = 5.0  # after the drain deadline, before uvicorn is told to stop waiting
BACKLOG_BYTES_SHARED = 16 << 30  # REV88_BACKLOG_BYTES's default with PostgreSQL (its disk is the database's)
SEED_PROCESS_START_S = 60.0  # the warm-up waits this long for the seed-state processes (they import torch)
IDLE_SAMPLE_INTERVAL_S = 1.0


def warmup_task():
    """A tiny fixed synthetic task (16 train, 4 queries) for the startup warm-up."""
    rng = np.random.Generator(np.random.PCG64(88))
    return validate_task(
        rng.random((16, 1, 9, 9), dtype=np.float32),
        (np.arange(16) % 10).astype(np.int64),
        rng.random((4, 1, 9, 9), dtype=np.float32),
    )


def _describe(engine) -> dict:
    """engine.describe() read from another thread: retry if the device thread changes it meanwhile."""
    for _ in range(3):
        try:
            return engine.describe()
        except RuntimeError:  # e.g. its graph cache changed size during iteration
            time.sleep(0.01)
    return {"backend": engine.name, "device": engine.device, "describe": "busy; retry"}


class Service:
    """``engines`` maps a backend name to the backend object that runs it; the default,
    ``learner.backends.get_backend``, is the registry every other path uses. Embedding
    code may pass its own (the tests use it to observe batched launches); it is a Python
    argument only, never reachable from HTTP or the environment."""

    def __init__(self, settings: Settings, engines: Engines | None = None) -> None:
        self.settings = settings
        self.engines: Engines = engines or get_backend
        self.io_pool: concurrent.futures.ThreadPoolExecutor | None = None  # asyncio.to_thread's, from start()
        self.backend = check_backend(settings.backend)  # "cuda" without a GPU stops startup here
        try:
            self.plan = plan(self.backend, settings.workers, settings.queue_size, settings.batch_max)
        except PlanError as exc:
            raise SettingsError(str(exc)) from None
        self.queue_size = self.plan.queue_size
        self.batch_max = self.plan.batch_max
        # The task ledger: SQLite in the data dir, or PostgreSQL shared by every replica when
        # REV88_DATABASE_URL is set (app/ledger/base.py). A corrupt, newer, unreachable or
        # unwritable one stops startup here (LedgerError).
        self.ledger = open_ledger(settings)
        self.ledger_writer = LedgerWriter(self.ledger)  # running marks and results, off the device workers
        # Datasets stored once and parsed once (app/tasks/datasets.py): beside the ledger
        self.datasets = DatasetCatalog(open_datasets(settings, self.ledger), settings.dataset_cache_bytes)
        seed_state.configure(settings.seed_cache_bytes)  # seed-derived state kept per process (learner/seed_state.py)
        # states computed apart from this process's GIL (learner/seed_processes.py), started by start()
        self.seed_processes = SeedProcesses(settings.seed_processes) if settings.seed_processes else None
        device_datasets.configure(settings.device_dataset_bytes)  # datasets kept per device (fused backend)
        self.recovered: dict[str, int] | None = None
        self.started_at = time.time()
        self._t0 = time.monotonic()
        self.state = "starting"  # starting | ready | failed
        self.failure: str | None = None
        self.warmup: dict[str, Any] | None = None  # the first worker's warm-up
        self.warmups: list[dict[str, Any]] = []
        self._warmups_left = 0
        self.validation: dict | None = None
        self.draining = False
        self.drain_reason: str | None = None
        self.energy = Energy()
        self.metrics = Metrics()
        self.keys = KeyRing(self.datasets.store, settings.api_key)  # tenants' keys (app/tasks/tenants.py)
        self.executor = DeviceExecutor(
            self.queue_size, idle_hook=self.energy.sample_idle, idle_interval_s=IDLE_SAMPLE_INTERVAL_S,
            batch_max=self.batch_max, batch_wait_s=settings.batch_wait_ms / 1000.0,
            on_launch=self.metrics.launch_tasks.observe, devices=self.plan.devices,
            tenant_name=lambda tenant: self.keys.name_of(tenant) if tenant else "admin/open",
        )
        self.metrics.bind(
            depth=lambda: self.executor.depth,
            in_flight=self.executor.in_flight,
            busy=self.executor.busy_workers,
            ready=lambda: 1 if self.ready else 0,
        )
        self.metrics.watch_workers(self.executor)
        # Asynchronous work waits in the ledger; the runner's feeder claims it into the device queue by
        # fair share (app/tasks/feeder.py): SQLite's claims in process, PostgreSQL's leases shared by replicas
        self.runner = TaskRunner(
            ledger=self.ledger, writer=self.ledger_writer, executor=self.executor, energy=self.energy,
            engines=self.engines, metrics=self.metrics, task_timeout_s=settings.task_timeout_s,
            batch_max=self.batch_max, versions=self.versions, datasets=self.datasets, keys=self.keys,
            claims=self.ledger if is_shared(self.ledger) else LocalClaims(self.ledger),
            feed=FeedPlan(workers=len(self.plan.devices), batch_max=self.batch_max, queue_size=self.queue_size,
                          lease_renew_s=settings.lease_renew_s, claim_poll_s=settings.claim_poll_s,
                          backlog_size=settings.backlog_size, backlog_bytes=self._backlog_bytes(settings),
                          ready=lambda: self.state == "ready"),
            io_pool=lambda: self.io_pool, seed_processes=self.seed_processes,
        )
        self.sweeps = Sweeps(self.runner, self.datasets, settings)
        self.evaluations = Evaluations(self.runner, self.datasets, settings)
        self.runner.finished_hooks.append(self._count_for_tenant)
        self.metrics.watch_ledger(self.ledger_stats)
        self.metrics.watch_admission(self.admission)
        # Signed webhooks from the ledger's outbox (app/webhooks/): any replica delivers any message
        self.webhooks = Webhooks(self.ledger, settings, self.metrics,
                                 readers={"sweep": self._sweep_document, "evaluation": self._evaluation_document})
        self.runner.recorded_hooks.append(self._webhook_hint)
        # The bytes of the bodies being received or parsed (app/http/uploads.py): by default what
        # queue_size + 1 uploads of the largest size hold.
        # (the body protocol reserves in it too: app/main.py hands it over, app/http/protocol.py)
        self.uploads = uploads.UploadBudget(settings.upload_buffer_bytes or (self.queue_size + 1) * settings.max_body_bytes)
        self._uploads_lock = threading.Lock()  # the warm-ups' bookkeeping
        self._loop: asyncio.AbstractEventLoop | None = None
        self._previous_handlers: dict[int, Any] = {}
        self._timers: list[threading.Timer] = []
        self._drain_started: float | None = None

    # ------------------------------------------------------------------ state
    @property
    def ready(self) -> bool:
        return self.state == "ready" and not self.draining

    @property
    def status(self) -> str:
        if self.draining:
            return "draining"
        return {"ready": "ok"}.get(self.state, self.state)

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self._t0

    def learner_state(self) -> dict[str, Any]:
        backends = {name: _describe(engine) for name, engine in loaded_backends().items()}
        graphs = [
            {"backend": name, **program}
            for name, info in backends.items()
            for program in info.get("cached_programs", [])
        ]
        validation = self.validation
        lanes = lanes_speedup() if lanes_speedup.cache_info().currsize else None  # (once measured)
        return {
            "validated": bool(validation and validation.get("passed")),
            "validation": None if validation is None else {
                "passed": validation.get("passed"),
                "device": validation.get("device"),
                "checks": len(validation.get("checks", [])),
            },
            "backend": self.backend,
            "warm_backends": sorted(backends) if self.warmup else [],
            "backends": backends,
            "cached_graphs": graphs,
            # a launch's SHA-256s sixteen side by side (learner/hashing.py): whether, and how much faster
            "sha256_lanes": None if lanes is None else {"used": lanes > 1.0, "speedup_vs_hashlib": round(lanes, 2)},
            # a batch of seeds' epoch permutations in one call (learner/permutations.py): built and numpy's
            # here (checked at the first seed state, the warm-up's; not on this loop)
            "fast_permutations": permutations.fast() if permutations.fast.cache_info().currsize else None,
            "warmup": self.warmup,
            "failure": self.failure,
        }

    def _count_for_tenant(self, acc, status: str, answer: dict | None) -> None:
        """A finished task in its tenant's /metrics series (named by its key's name)."""
        name = "admin" if acc.owner is None else self.keys.name_of(acc.owner)
        run_ms = ((answer or {}).get("timing") or {}).get("run_ms")
        self.metrics.tenant_finished(name, status, None if run_ms is None else run_ms / 1000.0)

    def _webhook_hint(self, acc, outcome) -> None:
        """A task's outcome is in the ledger here: its webhook, its sweep's or its evaluation's
        may be due now (the outbox's poll finds the others')."""
        for subject in (acc.sweep, acc.evaluation):
            if subject is not None:
                self.webhooks.wake(subject)
        if acc.webhook is not None:
            self.webhooks.wake()

    async def _sweep_document(self, sweep_id: str) -> dict[str, Any] | None:
        try:
            return await self.sweeps.state(sweep_id)
        except NotFound:
            return None

    async def _evaluation_document(self, evaluation_id: str) -> dict[str, Any] | None:
        try:
            return await self.evaluations.state(evaluation_id)
        except NotFound:
            return None

    def versions(self) -> dict[str, Any]:
        return versions()

    def seed_cache(self) -> dict[str, Any]:
        """The seed-derived state kept (learner/seed_state.py): states, bytes, bound, hits, misses,
        how many were computed ahead of their launch (app/tasks/launches.py ``prepare_ahead``), how
        many of those by the seed-state processes, and how many of those are ready."""
        counters = self.runner.launches.counters
        return {**seed_state.states.snapshot(), "prepared_ahead": counters["states_prepared_ahead"],
                "prepared_apart": counters["states_prepared_apart"],
                "processes": self.seed_processes.snapshot()["ready"] if self.seed_processes is not None else 0}

    def admission(self) -> dict[str, Any]:
        """Admission by tenant as /health and /metrics show it (issue #44): the device queue (its
        capacity, depth, the most it held, the fed tasks taken back, the refusals by share), the
        ledger's backlog of waiting asynchronous work and its limits, and per tenant (by key
        name) its tasks in the device queue (of them synchronous), waiting in the ledger, running
        here, and its share of the device queue now. (blocking on a key's cache miss)"""
        executor, feeder = self.executor, self.runner.feeder
        backlog = feeder.backlog()
        waiting = {t: v.get("unclaimed", v.get("queued", 0)) for t, v in (backlog.get("owners") or {}).items()}
        queued, hard = executor.queued_by_tenant(), executor.queued_by_tenant(hard_only=True)
        running = executor.running_by_tenant()
        shares = executor.shares({t: self.runner.weight_of(t) for t, n in waiting.items() if n > 0})
        tenants = {}
        for t in sorted(set(waiting) | set(queued) | set(running) | set(shares)):
            name = self.keys.name_of(t) if t else ("admin" if self.settings.auth_enabled else "open")
            row = {"id": t or None, "queued": queued.get(t, 0), "synchronous": hard.get(t, 0),
                   "backlog": waiting.get(t, 0), "running": running.get(t, 0), "share": shares.get(t)}
            if self.runner.shared is not None:
                row["running_all_replicas"] = ((backlog.get("owners") or {}).get(t) or {}).get("running", 0)
            tenants[name] = row
        stats = executor.stats
        return {
            "device_queue": {"capacity": executor.capacity, "depth": executor.depth, "deepest": stats.deepest,
                             "returned_to_ledger": stats.returned, "refused_by_share": stats.refused_share},
            "backlog": {k: backlog[k] for k in ("tasks", "bytes", "limit", "limit_bytes")},
            "tenants": tenants,
        }

    def _backlog_bytes(self, settings: Settings) -> int | None:
        """REV88_BACKLOG_BYTES, or its default: half the free space of the data dir's disk when the
        service starts (SQLite keeps the waiting uploads there); with PostgreSQL the database's
        disk is not this replica's to measure: BACKLOG_BYTES_SHARED."""
        if settings.backlog_bytes is not None:
            return settings.backlog_bytes
        if is_shared(self.ledger):
            return BACKLOG_BYTES_SHARED
        import shutil

        return max(1 << 30, shutil.disk_usage(self.ledger.data_dir).free // 2)

    def ledger_stats(self) -> dict[str, Any]:
        """The ledger as /metrics shows it, without a query: engine, and for a shared ledger the
        pool, the leases held here and the shared queue as last counted."""
        if not is_shared(self.ledger):
            return {"engine": getattr(self.ledger, "engine", "sqlite"), "up": True}
        shared = self.runner.shared
        return {**self.ledger.stats(), "up": shared is None or shared.database_error is None,
                "queue": shared.depth if shared is not None else None,
                "counters": dict(shared.counters) if shared is not None else {}}

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        # asyncio.to_thread's pool, its threads named for the OS (bench/bench_shell.py, top -H)
        self.io_pool = concurrent.futures.ThreadPoolExecutor(
            thread_name_prefix="rev88-io", initializer=name_os_thread, initargs=("rev88-io",))
        self._loop.set_default_executor(self.io_pool)
        if self.settings.threads:
            import torch

            # Not changed otherwise, not even for several CPU workers: the cpu backend's scores
            # (torch reductions) depend on torch's thread count, and must equal `rev88 run`'s.
            torch.set_num_threads(self.settings.threads)
        await asyncio.to_thread(self.energy.open, self.plan.devices)
        if self.energy.meter is not None and self.energy.gpu_telemetry is not None:
            self.metrics.enable_gpu(self.energy.gpu_telemetry)
        if self.seed_processes is not None:
            self.seed_processes.start()  # (ready before the service is: the warm-up waits for them)
        self.executor.start()
        # Each GPU worker warms its own device (its graphs, its compiled kernel); CPU workers
        # share one set of backend objects, so one warm-up serves them all.
        warm = range(len(self.plan.devices)) if self.backend in GPU_BACKENDS else range(1)
        self._warmups_left = len(warm)
        for i in warm:
            job = self.executor.submit(self._warm_up, kind="warmup", label=f"warm-up {self.plan.devices[i]}",
                                       reserved=True, pin=i)
            job.future.add_done_callback(self._warmed_up)
        self.recovered = await self.runner.recover()  # accepted asynchronous tasks a stop left unfinished
        await self.webhooks.start()
        self._hook_signals()
        log.info(
            "service starting",
            extra={"backend": self.backend, "queue_size": self.queue_size, "workers": self.plan.devices,
                   "auth": self.settings.auth_enabled, "energy": self.energy.meter is not None,
                   "energy_reason": self.energy.reason},
        )

    def _warm_up(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        validation = cached_validation()
        self.validation = validation
        lanes_speedup()  # (measured here once, not in the first launch's hashing)
        if not validation.get("passed"):
            failed = [f"{c['dtype']} depth {c['depth']}" for c in validation.get("checks", []) if not c.get("passed")]
            raise RuntimeError(f"learner validation failed: {', '.join(failed) or 'see /health'}")
        t1 = time.perf_counter()
        if self.seed_processes is not None:
            ready = self.seed_processes.wait_ready(SEED_PROCESS_START_S)
            if ready < self.seed_processes.count:
                log.warning("seed-state processes not ready; states are computed in this process instead",
                            extra={"ready": ready, "processes": self.seed_processes.count})
        engine = worker_engine(self.backend, self.engines)
        result = run_task(warmup_task(), Config(), engine)
        t2 = time.perf_counter()
        return {
            "backend": self.backend,
            "device": engine.device,
            "validation_ms": round((t1 - t0) * 1000, 3),
            "task_ms": round((t2 - t1) * 1000, 3),
            "train_count": 16,
            "test_count": 4,
            "predictions_sha256": result.predictions_sha256,
        }

    def _warmed_up(self, future) -> None:
        try:
            result = future.result()
        except Exception as exc:  # validation or the backend failed: never ready
            self.state = "failed"
            self.failure = f"{type(exc).__name__}: {exc}"
            log.error("warm-up failed; the service will not become ready", extra={"failure": self.failure})
            return
        with self._uploads_lock:
            self.warmups.append(result)
            self._warmups_left -= 1
            done = self._warmups_left == 0
        if self.warmup is None:
            self.warmup = result
        if done and self.state != "failed":
            self.state = "ready"
            log.info("ready", extra={"warmup": self.warmups, "workers": self.plan.devices})

    def _hook_signals(self) -> None:
        """Chain SIGTERM/SIGINT: mark draining, then let uvicorn's own handler stop the server."""
        if threading.current_thread() is not threading.main_thread():
            return  # e.g. a server run in a test thread: drain with begin_drain() instead
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous = signal.getsignal(sig)
            self._previous_handlers[sig] = previous

            def handler(signum, frame, previous=previous):
                # A signal handler may interrupt code holding any lock: only set flags here.
                self.draining = True
                if self._loop is not None:
                    self._loop.call_soon_threadsafe(self.begin_drain, f"received {signal.Signals(signum).name}")
                if callable(previous):
                    previous(signum, frame)
                elif previous == signal.SIG_DFL:
                    signal.signal(signum, signal.SIG_DFL)
                    signal.raise_signal(signum)

            signal.signal(sig, handler)

    def _unhook_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous_handlers.items():
            signal.signal(sig, previous)
        self._previous_handlers.clear()

    def begin_drain(self, reason: str = "draining") -> None:
        """Stop accepting; accepted tasks keep their place; a deadline answers the rest with 503."""
        self.draining = True
        if self._drain_started is not None:
            return
        self._drain_started = time.monotonic()
        self.drain_reason = reason
        self.executor.close("draining for shutdown")
        timeout = self.settings.drain_timeout_s
        log.info("draining", extra={"reason": reason, "drain_timeout_s": timeout, "queue": self.executor.snapshot()})
        self._start_timer(timeout, self._drain_deadline)

    def _start_timer(self, seconds: float, fn) -> None:
        timer = threading.Timer(seconds, fn)
        timer.daemon = True
        timer.start()
        self._timers.append(timer)

    def _drain_deadline(self) -> None:
        n = self.executor.abandon_all(
            f"the server is shutting down and its drain timeout of {self.settings.drain_timeout_s:g} s passed"
        )
        log.warning("drain timeout passed", extra={"answered_503": n})
        if self._previous_handlers:
            self._start_timer(FORCE_EXIT_GRACE_S, self._force_exit)

    def _force_exit(self) -> None:
        log.error("requests still open after the drain deadline; telling uvicorn to exit now")
        signal.raise_signal(signal.SIGINT)  # uvicorn: a second SIGINT means exit without waiting

    async def stop(self) -> None:
        if not self.draining:
            self.begin_drain("lifespan shutdown")
        left = self.settings.drain_timeout_s
        if self._drain_started is not None:
            left = max(0.0, self.settings.drain_timeout_s - (time.monotonic() - self._drain_started))
        ended = await asyncio.to_thread(self.executor.stop, left + 1.0)
        for timer in self._timers:
            timer.cancel()
        # launches being finished (app/tasks/launches.py) record their cells, then settling
        # asynchronous tasks record what the workers answered
        await asyncio.to_thread(self.runner.launches.close)
        if self.seed_processes is not None:
            await asyncio.to_thread(self.seed_processes.close)
        if self.runner.background:
            await asyncio.wait(list(self.runner.background), timeout=5.0)
        await self.runner.feeder.stop()  # stop claiming; (PostgreSQL) leases of unfinished tasks given back
        self._unhook_signals()
        await self.webhooks.stop()  # attempts in flight finish (5 s at most); pending ones stay in the outbox
        if not await asyncio.to_thread(self.ledger_writer.close, 10.0):
            log.error("the ledger writer did not finish its writes within 10 s")
        self.datasets.store.close()
        self.ledger.close()
        log.info("stopped", extra={"device_thread_ended": ended, "queue": self.executor.snapshot()})
        await asyncio.to_thread(flush_logs)  # every line written before the process goes
