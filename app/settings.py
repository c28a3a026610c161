"""The service's settings, read once from documented environment variables.

    REV88_HOST              bind address                           127.0.0.1
    REV88_PORT              bind port                              8000
    REV88_BACKEND           auto | cpu | cuda | fused | cpu-fast   auto
    REV88_WORKERS           device workers                         one per usable core (CPU backends)
                                                                   or per visible GPU (cuda, fused)
    REV88_QUEUE_SIZE        tasks that may wait for a device       CPU: max(8, 4 x workers);
                                                                   GPU: 2 x batch_max x workers
    REV88_MAX_BODY_BYTES    largest accepted request body          67108864 (64 MiB)
    REV88_TASK_TIMEOUT_S    queue wait + run, per task             300
    REV88_DRAIN_TIMEOUT_S   SIGTERM: time to finish accepted work  30
    REV88_API_KEY           Bearer key for every route but the     (unset or empty: no auth)
                            health probes
    REV88_LOG_LEVEL         debug | info | warning | error         info
    REV88_THREADS           torch/BLAS threads                     (unset: library default)
    REV88_BATCH_MAX         most tasks in one batched launch       GPU: the SM count; CPU: 1
                            (backends with run_many: fused);
                            1 turns batching off
    REV88_BATCH_WAIT_MS     how long a launch waits for more       5
                            tasks of its shape and config
    REV88_MAX_TASK_WORK     a task's estimated work limit          50,000,000 (learner.budget)
    REV88_MAX_TASK_BYTES    a task's estimated memory limit        1 GiB (learner.budget)
    REV88_DATA_DIR          the task ledger's folder (SQLite +     $XDG_DATA_HOME/rev88, else
                            uploads of asynchronous tasks)         ~/.local/share/rev88
    REV88_RETAIN_TASKS      finished tasks kept in the ledger      10000
    REV88_RETAIN_BYTES      stored answers kept, in bytes          1073741824 (1 GiB)
    REV88_DATABASE_URL      postgresql://... : the ledger in       (unset: SQLite in the data dir)
                            PostgreSQL, shared by every replica
    REV88_DB_POOL_SIZE      connections this replica may open      8
    REV88_DB_TIMEOUT_S      connect, pool wait and statement       5
                            timeout (then 503)
    REV88_LEASE_S           a claimed task's lease (server clock)  10
    REV88_LEASE_RENEW_S     how often the holder renews it         2 (at most REV88_LEASE_S / 2)
    REV88_LEASE_ATTEMPTS    lease expiries before a task is failed 3
    REV88_CLAIM_POLL_S      idle replicas look for work, and reap  1 (notifications wake them sooner)
                            expired leases, at least this often
    REV88_BACKLOG_SIZE      asynchronous tasks waiting in the      100000
                            ledger (uploads, cells, recovered)
                            before an asynchronous request is 503
                            (REV88_SHARED_QUEUE_SIZE: its old name)
    REV88_BACKLOG_BYTES     the waiting uploads' stored npz, in    SQLite: half the data dir's free
                            bytes, before an asynchronous upload   disk at start; PostgreSQL: 16 GiB
                            is 503

    REV88_DATASET_BYTES     stored datasets and labels, in all     4294967296 (4 GiB)
    REV88_DATASET_CACHE_BYTES  parsed datasets kept in memory      536870912 (512 MiB)
    REV88_SEED_CACHE_BYTES  seed-derived state kept in memory      268435456 (256 MiB)
                            (initial parameters, permutations)
    REV88_SEED_PROCESSES    processes computing seed-derived       0 (in this process)
                            state apart from the server's GIL
    REV88_DEVICE_DATASET_BYTES  datasets kept on each GPU           2147483648 (2 GiB)
                            (fused backend: images, labels)
    REV88_SWEEP_MAX_CELLS   cells of one sweep                     1000
    REV88_SWEEP_MAX_WORK    a sweep's estimated work in all        200 x the task default

    REV88_WEBHOOK_RETRY_SCHEDULE  delay before each attempt, seconds   0,5,300,1800,7200,18000,36000,36000
                            (the first from the event; ±10 % jitter)
    REV88_WEBHOOK_TIMEOUT_S one attempt, connect to last byte      15
    REV88_WEBHOOK_ALLOW_CIDRS  ranges allowed beside public ones   (none)
                            (comma list, e.g. 10.1.0.0/16)
    REV88_WEBHOOK_SECRET_OVERLAP_S  a rotated-out secret signs     86400
    REV88_WEBHOOK_CONCURRENCY  attempts at once, per replica       8
    REV88_WEBHOOK_POLL_S    outbox poll period                     1
    REV88_WEBHOOK_RETAIN_S  settled messages kept                  604800 (7 days)

A bad value stops the service at startup with a message naming the variable.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
from collections.abc import Mapping

from learner.backends import NAMES
from learner.budget import BYTES_ENV, DEFAULT_MAX_TASK_BYTES, DEFAULT_MAX_TASK_WORK, WORK_ENV

BACKENDS = NAMES  # learner.backends.NAMES: the registry is the one list
MAX_BATCH_WAIT_MS = 1000.0
MAX_WEBHOOK_ATTEMPTS = 32
MAX_WEBHOOK_DELAY_S = 7 * 86_400.0
MAX_SEED_PROCESSES = 64  # REV88_SEED_PROCESSES: each is a Python with torch (~1 s to start, ~230 MB resident)
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def default_data_dir() -> str:
    """Per user: $XDG_DATA_HOME/rev88, else ~/.local/share/rev88 (the image sets REV88_DATA_DIR)."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "rev88")


class SettingsError(ValueError):
    """An environment variable holds a value the service cannot use."""


@dataclasses.dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8000
    backend: str = "auto"
    queue_size: int | None = None  # None: derived from the workers (app/runtime/devices.py)
    max_body_bytes: int = 64 * 1024 * 1024
    task_timeout_s: float = 300.0
    drain_timeout_s: float = 30.0
    api_key: str | None = dataclasses.field(default=None, repr=False)
    log_level: str = "info"
    threads: int | None = None
    batch_max: int | None = None  # None: derived from the device (app/runtime/devices.py)
    batch_wait_ms: float = 5.0
    workers: int | None = None  # None: one per usable core / visible GPU
    max_task_work: int = DEFAULT_MAX_TASK_WORK
    max_task_bytes: int = DEFAULT_MAX_TASK_BYTES
    data_dir: str | None = None  # None: default_data_dir() (per user)
    retain_tasks: int = 10_000
    retain_bytes: int = 1 << 30
    # Slow uploads (docs/configuration.md): a body must arrive within upload_timeout_s plus one
    # second per upload_min_rate bytes it declares, else 408 and the connection is closed; the
    # bodies being received or parsed hold at most upload_buffer_bytes (None: (queue + 1) x
    # max_body_bytes); a connection must finish its request headers within header_timeout_s;
    # at most max_connections connections at once (uvicorn's limit_concurrency: 503 beyond).
    upload_timeout_s: float = 60.0
    upload_min_rate: int = 1 << 20
    upload_buffer_bytes: int | None = None
    header_timeout_s: float = 10.0
    keepalive_s: float = 5.0
    max_connections: int = 4096
    # uvicorn's own HTTP protocol, on a uvicorn release the service was not tested on
    # (app/http/versions.py); off: the body protocol (app/http/protocol.py)
    stock_http: bool = False
    # The shared ledger (app/ledger/postgres.py, docs/ledger.md): PostgreSQL at database_url, a
    # pool of db_pool_size connections, every wait bounded by db_timeout_s; asynchronous tasks
    # claimed under leases of lease_s renewed every lease_renew_s, failed after lease_attempts
    # expiries; claimers poll (and reapers run) every claim_poll_s.
    database_url: str | None = dataclasses.field(default=None, repr=False)  # may hold a password
    db_pool_size: int = 8
    db_timeout_s: float = 5.0
    lease_s: float = 10.0
    lease_renew_s: float = 2.0
    lease_attempts: int = 3
    claim_poll_s: float = 1.0
    backlog_size: int | None = None  # None: app/tasks/claims.BACKLOG_SIZE
    backlog_bytes: int | None = None  # None: half the data dir's free disk (SQLite), 16 GiB (PostgreSQL)
    # Datasets (app/tasks/datasets.py, docs/sweeps.md): the stored npz files and labels together
    # hold at most dataset_bytes; parsed datasets kept in memory, at most dataset_cache_bytes.
    dataset_bytes: int = 4 << 30
    dataset_cache_bytes: int = 512 << 20
    seed_cache_bytes: int = 256 << 20  # seed-derived state kept per process (learner/seed_state.py)
    seed_processes: int = 0  # processes computing seed-derived state apart (learner/seed_processes.py)
    device_dataset_bytes: int = 2 << 30  # datasets kept on each device (learner/backends/device_datasets.py)
    # Sweeps (app/tasks/sweeps.py): at most sweep_max_cells cells, sweep_max_work estimated work in all
    sweep_max_cells: int = 1000
    sweep_max_work: int = 200 * DEFAULT_MAX_TASK_WORK
    # Webhooks (app/webhooks/, docs/webhooks.md): the delay before each attempt (the first one's
    # from the event), the whole attempt's timeout, extra target ranges for the SSRF guard, how
    # long a rotated-out secret still signs, attempts at once, the poll period, and how long a
    # settled message and its attempts are kept.
    webhook_retry_schedule: tuple[float, ...] = (0.0, 5.0, 300.0, 1800.0, 7200.0, 18000.0, 36000.0, 36000.0)
    webhook_timeout_s: float = 15.0
    webhook_allow_cidrs: str = ""
    webhook_secret_overlap_s: float = 86_400.0
    webhook_concurrency: int = 8
    webhook_poll_s: float = 1.0
    webhook_retain_s: float = 7 * 86_400.0

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise SettingsError(f"REV88_BACKEND must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if not 0 < self.port < 65536:
            raise SettingsError(f"REV88_PORT must be in 1..65535, got {self.port}")
        if self.queue_size is not None and self.queue_size < 1:
            raise SettingsError(f"REV88_QUEUE_SIZE must be >= 1, got {self.queue_size}")
        if self.max_body_bytes < 1:
            raise SettingsError(f"REV88_MAX_BODY_BYTES must be >= 1, got {self.max_body_bytes}")
        for name, value in (("REV88_TASK_TIMEOUT_S", self.task_timeout_s), ("REV88_DRAIN_TIMEOUT_S", self.drain_timeout_s)):
            if not math.isfinite(value) or value <= 0:
                raise SettingsError(f"{name} must be a finite number of seconds > 0, got {value}")
        if self.api_key is not None and not self.api_key.strip():
            raise SettingsError("REV88_API_KEY is only whitespace; unset it to turn auth off")
        if self.log_level not in LOG_LEVELS:
            raise SettingsError(f"REV88_LOG_LEVEL must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.threads is not None and self.threads < 1:
            raise SettingsError(f"REV88_THREADS must be >= 1, got {self.threads}")
        if self.workers is not None and self.workers < 1:
            raise SettingsError(f"REV88_WORKERS must be >= 1, got {self.workers}")
        if self.max_task_work < 1:
            raise SettingsError(f"{WORK_ENV} must be >= 1, got {self.max_task_work}")
        if self.max_task_bytes < 1:
            raise SettingsError(f"{BYTES_ENV} must be >= 1, got {self.max_task_bytes}")
        if self.retain_tasks < 1:
            raise SettingsError(f"REV88_RETAIN_TASKS must be >= 1, got {self.retain_tasks}")
        if self.retain_bytes < 0:
            raise SettingsError(f"REV88_RETAIN_BYTES must be >= 0, got {self.retain_bytes}")
        for name, value in (("REV88_UPLOAD_TIMEOUT_S", self.upload_timeout_s),
                            ("REV88_HEADER_TIMEOUT_S", self.header_timeout_s), ("REV88_KEEPALIVE_S", self.keepalive_s)):
            if not math.isfinite(value) or value <= 0:
                raise SettingsError(f"{name} must be a finite number of seconds > 0, got {value}")
        if self.upload_min_rate < 1:
            raise SettingsError(f"REV88_UPLOAD_MIN_RATE must be >= 1 byte per second, got {self.upload_min_rate}")
        if self.upload_buffer_bytes is not None and self.upload_buffer_bytes < self.max_body_bytes:
            raise SettingsError(f"REV88_UPLOAD_BUFFER_BYTES must be at least REV88_MAX_BODY_BYTES "
                                f"({self.max_body_bytes}), got {self.upload_buffer_bytes}")
        for name, value in (("REV88_SWEEP_MAX_CELLS", self.sweep_max_cells), ("REV88_SWEEP_MAX_WORK", self.sweep_max_work)):
            if value < 1:
                raise SettingsError(f"{name} must be >= 1, got {value}")
        for name, value in (("REV88_DATASET_BYTES", self.dataset_bytes),
                            ("REV88_DATASET_CACHE_BYTES", self.dataset_cache_bytes),
                            ("REV88_SEED_CACHE_BYTES", self.seed_cache_bytes),
                            ("REV88_DEVICE_DATASET_BYTES", self.device_dataset_bytes)):
            if value < 0:
                raise SettingsError(f"{name} must be >= 0 bytes, got {value}")
        if not 0 <= self.seed_processes <= MAX_SEED_PROCESSES:
            raise SettingsError(f"REV88_SEED_PROCESSES must be a number of processes in [0, {MAX_SEED_PROCESSES}] "
                                f"(0: seed states computed in this process), got {self.seed_processes}")
        if self.max_connections < 16:
            raise SettingsError(f"REV88_MAX_CONNECTIONS must be >= 16, got {self.max_connections}")
        if self.database_url is not None and not self.database_url.startswith(("postgresql://", "postgres://")):
            raise SettingsError("REV88_DATABASE_URL must be a postgresql://user:password@host:port/database URL")
        if self.db_pool_size < 1:
            raise SettingsError(f"REV88_DB_POOL_SIZE must be >= 1, got {self.db_pool_size}")
        for name, value in (("REV88_DB_TIMEOUT_S", self.db_timeout_s), ("REV88_LEASE_S", self.lease_s),
                            ("REV88_LEASE_RENEW_S", self.lease_renew_s), ("REV88_CLAIM_POLL_S", self.claim_poll_s)):
            if not math.isfinite(value) or value <= 0:
                raise SettingsError(f"{name} must be a finite number of seconds > 0, got {value}")
        if self.lease_renew_s > self.lease_s / 2:
            raise SettingsError(f"REV88_LEASE_RENEW_S ({self.lease_renew_s:g}) must be at most half of REV88_LEASE_S "
                                f"({self.lease_s:g}): a lease must survive a late renewal")
        if self.lease_attempts < 1:
            raise SettingsError(f"REV88_LEASE_ATTEMPTS must be >= 1, got {self.lease_attempts}")
        if self.backlog_size is not None and self.backlog_size < 1:
            raise SettingsError(f"REV88_BACKLOG_SIZE must be >= 1, got {self.backlog_size}")
        if self.backlog_bytes is not None and self.backlog_bytes < 1:
            raise SettingsError(f"REV88_BACKLOG_BYTES must be >= 1, got {self.backlog_bytes}")
        if self.batch_max is not None and self.batch_max < 1:
            raise SettingsError(f"REV88_BATCH_MAX must be >= 1 (1 turns batching off), got {self.batch_max}")
        if not (math.isfinite(self.batch_wait_ms) and 0 <= self.batch_wait_ms <= MAX_BATCH_WAIT_MS):
            raise SettingsError(
                f"REV88_BATCH_WAIT_MS must be a number of milliseconds in [0, {MAX_BATCH_WAIT_MS:g}], got {self.batch_wait_ms}"
            )
        schedule = self.webhook_retry_schedule
        if not schedule or len(schedule) > MAX_WEBHOOK_ATTEMPTS or not all(
                math.isfinite(d) and 0 <= d <= MAX_WEBHOOK_DELAY_S for d in schedule):
            raise SettingsError(f"REV88_WEBHOOK_RETRY_SCHEDULE must be 1 to {MAX_WEBHOOK_ATTEMPTS} comma-separated "
                                f"delays in seconds, each in [0, {MAX_WEBHOOK_DELAY_S:g}], got "
                                f"{','.join(f'{d:g}' for d in schedule)!r}")
        for name, value in (("REV88_WEBHOOK_TIMEOUT_S", self.webhook_timeout_s),
                            ("REV88_WEBHOOK_POLL_S", self.webhook_poll_s)):
            if not (math.isfinite(value) and 0 < value <= 3600):
                raise SettingsError(f"{name} must be in (0, 3600] seconds, got {value}")
        for name, value in (("REV88_WEBHOOK_SECRET_OVERLAP_S", self.webhook_secret_overlap_s),
                            ("REV88_WEBHOOK_RETAIN_S", self.webhook_retain_s)):
            if not (math.isfinite(value) and 0 <= value <= 365 * 86_400):
                raise SettingsError(f"{name} must be in [0, 31536000] seconds, got {value}")
        if self.webhook_concurrency < 1:
            raise SettingsError(f"REV88_WEBHOOK_CONCURRENCY must be >= 1, got {self.webhook_concurrency}")
        for part in self.webhook_allow_cidrs.split(","):
            try:
                if part.strip():
                    ipaddress.ip_network(part.strip(), strict=False)
            except ValueError:
                raise SettingsError(f"REV88_WEBHOOK_ALLOW_CIDRS: {part.strip()!r} is not an address range like "
                                    "203.0.113.0/24") from None

    @property
    def ledger_dir(self) -> str:
        return self.data_dir or default_data_dir()

    @property
    def auth_enabled(self) -> bool:
        return self.api_key is not None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ

        def text(name: str, default: str | None) -> str | None:
            value = env.get(name)
            return default if value is None or value == "" else value

        def integer(name: str, default: int | None) -> int | None:
            raw = text(name, None)
            if raw is None:
                return default
            try:
                return int(raw)
            except ValueError:
                raise SettingsError(f"{name} must be an integer, got {raw!r}") from None

        def number(name: str, default: float, unit: str = "seconds") -> float:
            raw = text(name, None)
            if raw is None:
                return default
            try:
                return float(raw)
            except ValueError:
                raise SettingsError(f"{name} must be a number of {unit}, got {raw!r}") from None

        def switch(name: str, default: bool) -> bool:
            raw = text(name, None)
            if raw is None:
                return default
            if raw.strip().lower() in ("1", "true", "yes", "on"):
                return True
            if raw.strip().lower() in ("0", "false", "no", "off"):
                return False
            raise SettingsError(f"{name} must be 1 or 0 (on or off), got {raw!r}")

        def schedule(name: str, default: tuple[float, ...]) -> tuple[float, ...]:
            raw = text(name, None)
            if raw is None:
                return default
            try:
                return tuple(float(part) for part in raw.split(","))
            except ValueError:
                raise SettingsError(f"{name} must be comma-separated delays in seconds (like 0,5,300), "
                                    f"got {raw!r}") from None

        defaults = cls()
        api_key = env.get("REV88_API_KEY") or None  # empty means unset (compose files often pass "")
        return cls(
            host=text("REV88_HOST", defaults.host),
            port=integer("REV88_PORT", defaults.port),
            backend=text("REV88_BACKEND", defaults.backend).lower(),
            queue_size=integer("REV88_QUEUE_SIZE", None),
            max_body_bytes=integer("REV88_MAX_BODY_BYTES", defaults.max_body_bytes),
            task_timeout_s=number("REV88_TASK_TIMEOUT_S", defaults.task_timeout_s),
            drain_timeout_s=number("REV88_DRAIN_TIMEOUT_S", defaults.drain_timeout_s),
            api_key=api_key,
            log_level=text("REV88_LOG_LEVEL", defaults.log_level).lower(),
            threads=integer("REV88_THREADS", None),
            batch_max=integer("REV88_BATCH_MAX", None),
            batch_wait_ms=number("REV88_BATCH_WAIT_MS", defaults.batch_wait_ms, "milliseconds"),
            workers=integer("REV88_WORKERS", None),
            max_task_work=integer(WORK_ENV, defaults.max_task_work),
            max_task_bytes=integer(BYTES_ENV, defaults.max_task_bytes),
            data_dir=text("REV88_DATA_DIR", None),
            retain_tasks=integer("REV88_RETAIN_TASKS", defaults.retain_tasks),
            retain_bytes=integer("REV88_RETAIN_BYTES", defaults.retain_bytes),
            upload_timeout_s=number("REV88_UPLOAD_TIMEOUT_S", defaults.upload_timeout_s),
            upload_min_rate=integer("REV88_UPLOAD_MIN_RATE", defaults.upload_min_rate),
            upload_buffer_bytes=integer("REV88_UPLOAD_BUFFER_BYTES", None),
            header_timeout_s=number("REV88_HEADER_TIMEOUT_S", defaults.header_timeout_s),
            keepalive_s=number("REV88_KEEPALIVE_S", defaults.keepalive_s),
            max_connections=integer("REV88_MAX_CONNECTIONS", defaults.max_connections),
            stock_http=switch("REV88_STOCK_HTTP", defaults.stock_http),
            database_url=text("REV88_DATABASE_URL", None),
            db_pool_size=integer("REV88_DB_POOL_SIZE", defaults.db_pool_size),
            db_timeout_s=number("REV88_DB_TIMEOUT_S", defaults.db_timeout_s),
            lease_s=number("REV88_LEASE_S", defaults.lease_s),
            lease_renew_s=number("REV88_LEASE_RENEW_S", defaults.lease_renew_s),
            lease_attempts=integer("REV88_LEASE_ATTEMPTS", defaults.lease_attempts),
            claim_poll_s=number("REV88_CLAIM_POLL_S", defaults.claim_poll_s),
            # (REV88_SHARED_QUEUE_SIZE: its name before the backlog was every store's)
            backlog_size=integer("REV88_BACKLOG_SIZE", integer("REV88_SHARED_QUEUE_SIZE", None)),
            backlog_bytes=integer("REV88_BACKLOG_BYTES", None),
            dataset_bytes=integer("REV88_DATASET_BYTES", defaults.dataset_bytes),
            dataset_cache_bytes=integer("REV88_DATASET_CACHE_BYTES", defaults.dataset_cache_bytes),
            seed_cache_bytes=integer("REV88_SEED_CACHE_BYTES", defaults.seed_cache_bytes),
            seed_processes=integer("REV88_SEED_PROCESSES", defaults.seed_processes),
            device_dataset_bytes=integer("REV88_DEVICE_DATASET_BYTES", defaults.device_dataset_bytes),
            sweep_max_cells=integer("REV88_SWEEP_MAX_CELLS", defaults.sweep_max_cells),
            sweep_max_work=integer("REV88_SWEEP_MAX_WORK", defaults.sweep_max_work),
            webhook_retry_schedule=schedule("REV88_WEBHOOK_RETRY_SCHEDULE", defaults.webhook_retry_schedule),
            webhook_timeout_s=number("REV88_WEBHOOK_TIMEOUT_S", defaults.webhook_timeout_s),
            webhook_allow_cidrs=text("REV88_WEBHOOK_ALLOW_CIDRS", defaults.webhook_allow_cidrs) or "",
            webhook_secret_overlap_s=number("REV88_WEBHOOK_SECRET_OVERLAP_S", defaults.webhook_secret_overlap_s),
            webhook_concurrency=integer("REV88_WEBHOOK_CONCURRENCY", defaults.webhook_concurrency),
            webhook_poll_s=number("REV88_WEBHOOK_POLL_S", defaults.webhook_poll_s),
            webhook_retain_s=number("REV88_WEBHOOK_RETAIN_S", defaults.webhook_retain_s),
        )
