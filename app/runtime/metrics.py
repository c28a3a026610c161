"""Prometheus metrics, in a registry of the app's own (two apps in one process never mix).

    rev88_tasks_total{outcome}            POST /tasks answers by outcome
    rev88_request_seconds{route}          request latency, arrival to response start
    rev88_parse_seconds                   npz read + validation (worker threads)
    rev88_queue_wait_seconds              accepted -> device start
    rev88_run_seconds                     the learner's own run time (CUDA events where present)
    rev88_launch_tasks                    tasks per device launch (> 1: a batched launch)
    rev88_queue_depth                     tasks waiting for the device
    rev88_tasks_in_flight                 tasks accepted and not yet off the device (queued + running)
    rev88_device_busy                     1 while a job holds the device
    rev88_ready                           1 when /v2/health/ready answers 200
    rev88_ledger_info{engine}             1 (sqlite | postgresql)
    rev88_ledger_up                       1 while the ledger's last operations succeeded
    rev88_ledger_pool_connections{state}  PostgreSQL: in_use | idle | waiting (clients) | max
    rev88_shared_queue_depth              PostgreSQL: asynchronous tasks queued in the shared ledger,
                                          every replica's, counted once (the same value on each
                                          replica: aggregate with max, not sum; deploy/README.md)
    rev88_shared_tasks_running            PostgreSQL: asynchronous tasks running on any replica
    rev88_leases_held                     PostgreSQL: leases this replica holds
    rev88_ledger_events_total{event}      PostgreSQL: claimed, leases_lost, reaped_*, released, ...
    rev88_backlog_tasks                   asynchronous tasks waiting in the ledger (SQLite: exact;
                                          PostgreSQL: as last counted, every replica's)
    rev88_backlog_bytes                   the stored npz of the waiting uploads
    rev88_device_queue_deepest            the most tasks the device queue has held at once
    rev88_tenant_queued{tenant}           a tenant's tasks in the device queue
    rev88_tenant_backlog{tenant}          a tenant's tasks waiting in the ledger
    rev88_tenant_running{tenant}          a tenant's tasks running here
    rev88_tenant_queue_share{tenant}      a tenant's share of the device queue now (places)
    rev88_webhook_deliveries_total{outcome}  webhook attempts: delivered, retry, failed, stopped, lease_lost
    rev88_webhook_oldest_pending_seconds  age of the oldest message not yet delivered (the outbox's, all replicas)

Where NVML exists (never on the development machine, so unverified there):

    rev88_gpu_power_watts                 instantaneous board power
    rev88_gpu_temperature_celsius
    rev88_gpu_energy_joules_total         the GPU's cumulative energy counter (since driver load)
    rev88_task_energy_joules_total        summed gross joules of the tasks' metered runs
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

OUTCOMES = (
    "ok", "bad_archive", "too_large", "unsupported_media_type", "invalid", "diverged",
    "queue_full", "unavailable", "timeout", "upload_timeout", "stopped", "over_budget", "conflict", "error",
)
ROUTES = ("/tasks", "/health", "/v2/health/live", "/v2/health/ready", "/metrics", "other")
LAUNCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class GpuCollector:
    """Reads NVML telemetry at scrape time through a telemetry function (learner.energy.gpu_telemetry)."""

    def __init__(self, telemetry: Callable[[], tuple[dict | None, str | None]]) -> None:
        self._telemetry = telemetry

    def describe(self):
        return []  # no scrape at registration time

    def collect(self):
        gpu, _ = self._telemetry()
        if gpu is None:
            return
        labels = ["gpu"]
        name = [str(gpu.get("uuid") or gpu.get("name") or "0")]
        if gpu.get("power_w") is not None:
            g = GaugeMetricFamily("rev88_gpu_power_watts", "GPU board power draw (NVML)", labels=labels)
            g.add_metric(name, float(gpu["power_w"]))
            yield g
        if gpu.get("temperature_c") is not None:
            g = GaugeMetricFamily("rev88_gpu_temperature_celsius", "GPU temperature (NVML)", labels=labels)
            g.add_metric(name, float(gpu["temperature_c"]))
            yield g
        if gpu.get("energy_counter_mj") is not None:
            c = CounterMetricFamily(
                "rev88_gpu_energy_joules", "GPU cumulative energy since the driver loaded (NVML)", labels=labels
            )
            c.add_metric(name, gpu["energy_counter_mj"] / 1000.0)
            yield c


class WorkerCollector:
    """Per-worker state and the executor's stop counters, read at scrape time."""

    def __init__(self, executor) -> None:
        self._executor = executor

    def describe(self):
        return []

    def collect(self):
        snap = self._executor.snapshot()
        busy = GaugeMetricFamily("rev88_worker_busy", "1 while the worker's device runs a job", labels=["device"])
        tasks = CounterMetricFamily("rev88_worker_tasks", "Jobs run by the worker", labels=["device"])
        seconds = CounterMetricFamily("rev88_worker_busy_seconds", "Seconds the worker's device spent in jobs",
                                      labels=["device"])
        for w in snap["workers"]:
            busy.add_metric([w["device"]], 1.0 if w["busy"] else 0.0)
            tasks.add_metric([w["device"]], float(w["tasks"]))
            seconds.add_metric([w["device"]], float(w["busy_seconds"]))
        yield busy
        yield tasks
        yield seconds
        stops = CounterMetricFamily("rev88_tasks_stopped", "Tasks stopped before they finished, by where",
                                    labels=["where"])
        stops.add_metric(["running"], float(snap["stopped"]))  # stopped on the device
        stops.add_metric(["queued"], float(snap["dropped"] + snap["expired"]))  # never ran
        yield stops


class LedgerCollector:
    """The ledger's engine, pool and the shared queue, read at scrape time from a function that
    makes no query (the shared queue depth is the one its maintenance loop last counted)."""

    def __init__(self, stats: Callable[[], dict]) -> None:
        self._stats = stats

    def describe(self):
        return []

    def collect(self):
        stats = self._stats()
        info = GaugeMetricFamily("rev88_ledger_info", "The task ledger's engine", labels=["engine"])
        info.add_metric([str(stats.get("engine", "sqlite"))], 1.0)
        yield info
        up = GaugeMetricFamily("rev88_ledger_up", "1 while the task ledger's last operations succeeded")
        up.add_metric([], 1.0 if stats.get("up", True) else 0.0)
        yield up
        pool = stats.get("pool")
        if pool:
            g = GaugeMetricFamily("rev88_ledger_pool_connections", "Database connections of this replica's pool",
                                  labels=["state"])
            for state in ("in_use", "idle", "waiting", "max"):
                g.add_metric([state], float(pool.get(state) or 0))
            yield g
        if "leases_held" in stats:
            held = GaugeMetricFamily("rev88_leases_held", "Leases of shared-ledger tasks this replica holds")
            held.add_metric([], float(stats["leases_held"]))
            yield held
            queue = stats.get("queue") or {}
            depth = GaugeMetricFamily("rev88_shared_queue_depth", "Asynchronous tasks queued in the shared ledger "
                                      "(all replicas; the same on each)")
            depth.add_metric([], float(queue.get("queued", 0)))
            yield depth
            running = GaugeMetricFamily("rev88_shared_tasks_running", "Asynchronous tasks running on any replica")
            running.add_metric([], float(queue.get("running", 0)))
            yield running
            events = CounterMetricFamily("rev88_ledger_events", "Claims, lost leases, reaped and released leases "
                                         "on this replica", labels=["event"])
            for event, n in sorted((stats.get("counters") or {}).items()):
                events.add_metric([event], float(n))
            yield events


TENANT_SERIES = 50  # how many tenants' names get their own /metrics series (the rest: "other")


class AdmissionCollector:
    """The device queue, the ledger's backlog and the tenants' counts (Service.admission), read at
    scrape time; the first TENANT_SERIES tenants by name get their own series, the rest "other"."""

    def __init__(self, admission: Callable[[], dict]) -> None:
        self._admission = admission

    def describe(self):
        return []

    def collect(self):
        doc = self._admission()
        for name, value, help_ in (
                ("rev88_backlog_tasks", doc["backlog"]["tasks"], "Asynchronous tasks waiting in the ledger"),
                ("rev88_backlog_bytes", doc["backlog"]["bytes"], "Stored bytes of the waiting asynchronous uploads"),
                ("rev88_device_queue_deepest", doc["device_queue"]["deepest"],
                 "The most tasks the device queue has held at once")):
            g = GaugeMetricFamily(name, help_)
            g.add_metric([], float(value or 0))
            yield g
        series = {key: GaugeMetricFamily(name, help_, labels=["tenant"]) for key, name, help_ in (
            ("queued", "rev88_tenant_queued", "A tenant's tasks in the device queue"),
            ("backlog", "rev88_tenant_backlog", "A tenant's tasks waiting in the ledger"),
            ("running", "rev88_tenant_running", "A tenant's tasks running on this replica's devices"),
            ("share", "rev88_tenant_queue_share", "A tenant's share of the device queue now (places)"))}
        rows: dict[str, dict[str, float]] = {}
        for i, (name, row) in enumerate(sorted(doc["tenants"].items())):
            label = name if i < TENANT_SERIES else "other"
            total = rows.setdefault(label, {})
            for key in series:
                total[key] = total.get(key, 0.0) + float(row.get(key) or 0)
        for label, total in rows.items():
            for key, family in series.items():
                family.add_metric([label], total[key])
        yield from series.values()


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.tasks = Counter("rev88_tasks", "POST /tasks answers by outcome", ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.tasks.labels(outcome)
        self.request_seconds = Histogram(
            "rev88_request_seconds", "Request latency, arrival to response", ["route"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.parse_seconds = Histogram(
            "rev88_parse_seconds", "npz read and validation time", buckets=LATENCY_BUCKETS, registry=r
        )
        self.queue_wait_seconds = Histogram(
            "rev88_queue_wait_seconds", "Time an accepted task waited for the device",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.run_seconds = Histogram(
            "rev88_run_seconds", "The learner's run time per task (device-timed where possible)",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.launch_tasks = Histogram(
            "rev88_launch_tasks", "Jobs per device launch (more than one: a batched launch)",
            buckets=LAUNCH_BUCKETS, registry=r,
        )
        self.queue_depth = Gauge("rev88_queue_depth", "Tasks waiting for the device", registry=r)
        self.in_flight = Gauge("rev88_tasks_in_flight", "Tasks accepted and not yet off the device", registry=r)
        self.device_busy = Gauge("rev88_device_busy", "Workers whose device runs a job now", registry=r)
        self.ready = Gauge("rev88_ready", "1 when the service is ready for tasks", registry=r)
        self.task_energy: Counter | None = None
        # per tenant (issue #33): a key's name as the label, for the first TENANT_SERIES names; the rest "other"
        self.tenant_tasks = Counter("rev88_tenant_tasks", "Finished tasks by tenant (key name) and status",
                                    ["tenant", "status"], registry=r)
        self.tenant_device_seconds = Counter("rev88_tenant_device_seconds", "Learner run seconds by tenant (key name)",
                                             ["tenant"], registry=r)
        self._tenant_names: set[str] = set()
        # (metric, labels) -> its labelled series: prometheus_client's ``labels()`` checks and locks on
        # every call; the label values are bounded (OUTCOMES, ROUTES, TENANT_SERIES names)
        self._series: dict[tuple, object] = {}
        self.webhook_deliveries = Counter(
            "rev88_webhook_deliveries", "Webhook attempts by outcome: delivered, retry, failed, stopped, lease_lost",
            ["outcome"], registry=r)
        self.webhook_oldest_pending = Gauge(
            "rev88_webhook_oldest_pending_seconds",
            "Age of the oldest webhook message waiting to be delivered (0: none; every replica's, as last counted)",
            registry=r)

    def bind(self, depth: Callable[[], float], in_flight: Callable[[], float], busy: Callable[[], float],
             ready: Callable[[], float]) -> None:
        """Gauges read live state at scrape time."""
        self.queue_depth.set_function(depth)
        self.in_flight.set_function(in_flight)
        self.device_busy.set_function(busy)
        self.ready.set_function(ready)

    def watch_workers(self, executor) -> None:
        self.registry.register(WorkerCollector(executor))

    def watch_ledger(self, stats: Callable[[], dict]) -> None:
        self.registry.register(LedgerCollector(stats))

    def watch_admission(self, admission: Callable[[], dict]) -> None:
        self.registry.register(AdmissionCollector(admission))

    def watch_webhooks(self, oldest_pending_s: Callable[[], float]) -> None:
        self.webhook_oldest_pending.set_function(oldest_pending_s)

    def _labelled(self, metric, *labels: str):
        series = self._series.get((metric, labels))
        if series is None:
            series = self._series[(metric, labels)] = metric.labels(*labels)
        return series

    def webhook_delivery(self, outcome: str) -> None:
        self._labelled(self.webhook_deliveries, outcome).inc()

    def enable_gpu(self, telemetry: Callable[[], tuple[dict | None, str | None]]) -> None:
        self.registry.register(GpuCollector(telemetry))
        self.task_energy = Counter(
            "rev88_task_energy_joules", "Summed gross joules of metered task runs (NVML counter deltas)",
            registry=self.registry,
        )

    def tenant_finished(self, name: str, status: str, run_seconds: float | None) -> None:
        """A finished task of the tenant ``name`` (its key's name; "admin" or "open" otherwise)."""
        if name not in self._tenant_names:
            if len(self._tenant_names) >= TENANT_SERIES:
                name = "other"
            else:
                self._tenant_names.add(name)
        self._labelled(self.tenant_tasks, name, status).inc()
        if run_seconds:
            self._labelled(self.tenant_device_seconds, name).inc(run_seconds)

    def outcome(self, outcome: str) -> None:
        self._labelled(self.tasks, outcome if outcome in OUTCOMES else "error").inc()

    def request(self, path: str, seconds: float) -> None:
        self._labelled(self.request_seconds, path if path in ROUTES else "other").observe(seconds)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
