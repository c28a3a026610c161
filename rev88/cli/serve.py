"""``rev88 serve``: run the HTTP service.

The flags become the ``REV88_*`` environment variables that :mod:`app.settings` reads (a flag
overrides the environment); they are checked the way the service will check them, and then
uvicorn runs the ``app.main:create_app`` factory.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
from collections.abc import MutableMapping

from .common import CliError

# --------------------------------------------------------------------------- serve

# flag destination -> the environment variable app.settings reads
SERVE_ENV = {
    "host": "REV88_HOST",
    "port": "REV88_PORT",
    "backend": "REV88_BACKEND",
    "queue_size": "REV88_QUEUE_SIZE",
    "max_body_bytes": "REV88_MAX_BODY_BYTES",
    "task_timeout": "REV88_TASK_TIMEOUT_S",
    "drain_timeout": "REV88_DRAIN_TIMEOUT_S",
    "api_key": "REV88_API_KEY",
    "log_level": "REV88_LOG_LEVEL",
    "threads": "REV88_THREADS",
    "batch_max": "REV88_BATCH_MAX",
    "batch_wait_ms": "REV88_BATCH_WAIT_MS",
    "workers": "REV88_WORKERS",
    "max_task_work": "REV88_MAX_TASK_WORK",
    "max_task_bytes": "REV88_MAX_TASK_BYTES",
    "data_dir": "REV88_DATA_DIR",
    "retain_tasks": "REV88_RETAIN_TASKS",
    "retain_bytes": "REV88_RETAIN_BYTES",
    "upload_timeout": "REV88_UPLOAD_TIMEOUT_S",
    "upload_min_rate": "REV88_UPLOAD_MIN_RATE",
    "upload_buffer_bytes": "REV88_UPLOAD_BUFFER_BYTES",
    "header_timeout": "REV88_HEADER_TIMEOUT_S",
    "keepalive": "REV88_KEEPALIVE_S",
    "max_connections": "REV88_MAX_CONNECTIONS",
    "stock_http": "REV88_STOCK_HTTP",
    "database_url": "REV88_DATABASE_URL",
    "db_pool_size": "REV88_DB_POOL_SIZE",
    "db_timeout": "REV88_DB_TIMEOUT_S",
    "lease": "REV88_LEASE_S",
    "lease_renew": "REV88_LEASE_RENEW_S",
    "lease_attempts": "REV88_LEASE_ATTEMPTS",
    "claim_poll": "REV88_CLAIM_POLL_S",
    "backlog_size": "REV88_BACKLOG_SIZE",
    "backlog_bytes": "REV88_BACKLOG_BYTES",
    "dataset_bytes": "REV88_DATASET_BYTES",
    "dataset_cache_bytes": "REV88_DATASET_CACHE_BYTES",
    "seed_cache_bytes": "REV88_SEED_CACHE_BYTES",
    "seed_processes": "REV88_SEED_PROCESSES",
    "device_dataset_bytes": "REV88_DEVICE_DATASET_BYTES",
    "sweep_max_cells": "REV88_SWEEP_MAX_CELLS",
    "sweep_max_work": "REV88_SWEEP_MAX_WORK",
    "webhook_retry_schedule": "REV88_WEBHOOK_RETRY_SCHEDULE",
    "webhook_timeout": "REV88_WEBHOOK_TIMEOUT_S",
    "webhook_allow_cidrs": "REV88_WEBHOOK_ALLOW_CIDRS",
    "webhook_secret_overlap": "REV88_WEBHOOK_SECRET_OVERLAP_S",
    "webhook_concurrency": "REV88_WEBHOOK_CONCURRENCY",
    "webhook_poll": "REV88_WEBHOOK_POLL_S",
    "webhook_retain": "REV88_WEBHOOK_RETAIN_S",
}


def apply_serve_flags(args: argparse.Namespace, environ: MutableMapping[str, str] = os.environ) -> None:
    """Copy every flag given on the command line into its REV88_* variable."""
    for dest, var in SERVE_ENV.items():
        value = getattr(args, dest, None)
        if value is not None:
            environ[var] = str(value)


def graceful_shutdown_s(drain_timeout_s: float, force_exit_grace_s: float) -> int:
    """Whole seconds uvicorn waits for open requests after SIGTERM."""
    return max(1, math.ceil(drain_timeout_s + force_exit_grace_s))


def cmd_serve(args: argparse.Namespace) -> int:
    apply_serve_flags(args)
    from app.settings import Settings, SettingsError

    try:
        settings = Settings.from_env()
    except SettingsError as exc:
        raise CliError(str(exc)) from None

    import uvicorn

    from app.runtime.devices import PlanError, plan
    from app.service import FORCE_EXIT_GRACE_S
    from app.tasks.options import check_backend
    from learner.backends import BackendUnavailable

    try:
        backend = check_backend(settings.backend)  # e.g. "cuda" without a GPU: say so before uvicorn starts
    except BackendUnavailable as exc:
        raise CliError(f"{exc} (REV88_BACKEND / --backend)") from None
    try:
        workers = plan(backend, settings.workers, settings.queue_size, settings.batch_max)
    except PlanError as exc:
        raise CliError(f"{exc} (REV88_WORKERS / --workers)") from None

    from app.ledger import LedgerError, open_ledger

    try:  # a corrupt, newer, unreachable or unwritable ledger: say so before uvicorn starts
        ledger = open_ledger(settings)  # PostgreSQL: migrated here, under its advisory lock
        ledger_shown = ledger.path
        ledger.close()
    except ImportError as exc:
        raise CliError(f"REV88_DATABASE_URL needs psycopg: pip install 'rev88[postgres]' ({exc})") from None
    except LedgerError as exc:
        where = "REV88_DATABASE_URL / --database-url" if settings.database_url else "REV88_DATA_DIR / --data-dir"
        raise CliError(f"{exc} ({where})") from None

    from app.http import protocol as http_protocol
    from app.http import versions
    from app.runtime import allocator

    # The body protocol uses private parts of uvicorn: on a release it was not tested on, refuse
    # rather than run without a word (the same gate as create_app's)
    refusal = http_protocol.refusal(settings.stock_http)
    if refusal:
        raise CliError(f"refusing to start: {refusal}")
    if settings.stock_http:
        print(f"rev88 serve: warning: {versions.STOCK_HTTP_LOST}", file=sys.stderr)
        protocol = "auto"  # uvicorn's own: httptools where installed, else h11
    else:
        protocol = http_protocol.protocol_class()
    malloc = allocator.tune()  # before the app allocates its first task
    files = raise_open_files(settings.max_connections)
    shown = "[::1]" if settings.host == "::1" else settings.host
    print(
        f"rev88 serve: http://{shown}:{settings.port} (backend {settings.backend}, {len(workers.devices)} "
        f"worker(s), queue {workers.queue_size}, ledger {ledger_shown}, drain {settings.drain_timeout_s:g} s, auth "
        f"{'on' if settings.auth_enabled else 'off'}; {malloc}; {files}); API docs at /docs",
        file=sys.stderr,
    )
    # On SIGTERM the app starts draining (ready -> 503, no new tasks) and uvicorn stops
    # accepting and waits for open requests: a task waiting or running holds its request
    # open. At the drain timeout the app answers what is left with 503 and, if a client
    # still holds uvicorn FORCE_EXIT_GRACE_S later, tells it to exit. uvicorn's own
    # graceful-shutdown timeout is the same total, a backstop that never cuts earlier.
    # (Kubernetes: terminationGracePeriodSeconds must exceed preStop + this.)
    previous = {sig: signal.signal(sig, _stopped) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        uvicorn.run(
            "app.main:create_app",
            factory=True,
            host=settings.host,
            port=settings.port,
            workers=1,
            log_level=settings.log_level,
            access_log=False,  # the app logs each request itself (JSON, with its request id)
            timeout_graceful_shutdown=graceful_shutdown_s(settings.drain_timeout_s, FORCE_EXIT_GRACE_S),
            proxy_headers=False,
            http=protocol,  # the body protocol over uvicorn's httptools one (app/http/protocol.py)
            limit_concurrency=settings.max_connections,  # beyond: 503 at once (uvicorn)
            timeout_keep_alive=settings.keepalive_s,
        )
    except _Stopped:
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def raise_open_files(connections: int) -> str:
    """Raise the soft open-file limit to fit ``connections`` sockets (plus 256 for the rest), as
    far as the hard limit allows; says what it is."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = connections + 256
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < want:
        return (f"open files {soft}: fewer than REV88_MAX_CONNECTIONS {connections} + 256, "
                "connections beyond it are refused by the kernel")
    return f"open files {soft}"


class _Stopped(BaseException):  # not an Exception: no "except Exception" in the startup swallows it
    pass


def _stopped(signum, frame) -> None:
    # uvicorn handles SIGTERM/SIGINT while it runs (the app drains), and once it has shut
    # down it raises the same signal again under the handlers it found: this one, so a
    # drained shutdown ends with status 0 (and Ctrl-C without a KeyboardInterrupt trace).
    raise _Stopped()


def add_serve(sub) -> None:
    from app.settings import BACKENDS, LOG_LEVELS

    p = sub.add_parser(
        "serve",
        help="run the HTTP service (uvicorn); flags override the REV88_* environment variables",
        description="Run the rev88 HTTP service. Each flag sets the REV88_* variable named in its help "
        "and overrides it; unset flags keep the environment's value or the default.",
    )
    p.add_argument("--host", help="bind address [REV88_HOST, default 127.0.0.1; the container uses 0.0.0.0]")
    p.add_argument("--port", type=int, help="bind port [REV88_PORT, default 8000]")
    p.add_argument("--backend", help=f"{' | '.join(BACKENDS)} [REV88_BACKEND, default auto: the GPU when one is usable]")
    p.add_argument("--queue-size", type=int, help="tasks that may wait for a device [REV88_QUEUE_SIZE, default: "
                   "max(8, 4 x workers) on the CPU, 2 x batch_max x workers on GPUs]")
    p.add_argument("--max-body-bytes", type=int, help="largest request body [REV88_MAX_BODY_BYTES, default 64 MiB]")
    p.add_argument("--task-timeout", type=float, help="seconds of queue wait + run per task [REV88_TASK_TIMEOUT_S, default 300]")
    p.add_argument("--drain-timeout", type=float,
                   help="seconds to finish accepted work after SIGTERM [REV88_DRAIN_TIMEOUT_S, default 30]")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route but health "
                   "[REV88_API_KEY; prefer the variable: a flag shows in the process list]")
    p.add_argument("--log-level", help=f"{' | '.join(LOG_LEVELS)} [REV88_LOG_LEVEL, default info]")
    p.add_argument("--threads", type=int, help="torch/BLAS threads [REV88_THREADS, default: library default]")
    p.add_argument("--batch-max", type=int,
                   help="most tasks of one shape and config in one launch on a backend with batched launches "
                   "(fused); 1 turns batching off [REV88_BATCH_MAX, default: the GPU's SM count; 1 on the CPU]")
    p.add_argument("--batch-wait-ms", type=float,
                   help="milliseconds a launch waits for more matching tasks [REV88_BATCH_WAIT_MS, default 5]")
    p.add_argument("--workers", type=int, help="device workers [REV88_WORKERS, default: one per usable core "
                   "for the CPU backends, one per visible GPU for cuda/fused]")
    p.add_argument("--max-task-work", type=int, help="a task's estimated work limit [REV88_MAX_TASK_WORK, "
                   "default 50,000,000; see learner/budget.py]")
    p.add_argument("--data-dir", help="the task ledger's folder [REV88_DATA_DIR, default $XDG_DATA_HOME/rev88 "
                   "or ~/.local/share/rev88]")
    p.add_argument("--retain-tasks", type=int, help="finished tasks kept in the ledger [REV88_RETAIN_TASKS, default 10000]")
    p.add_argument("--retain-bytes", type=int, help="bytes of stored answers kept [REV88_RETAIN_BYTES, default 1 GiB]")
    p.add_argument("--max-task-bytes", type=int, help="a task's estimated memory limit in bytes "
                   "[REV88_MAX_TASK_BYTES, default 1 GiB]")
    p.add_argument("--upload-timeout", type=float, help="seconds a request body may take, plus 1 s per "
                   "--upload-min-rate bytes it declares; then 408 and the connection closed [REV88_UPLOAD_TIMEOUT_S, "
                   "default 60]")
    p.add_argument("--upload-min-rate", type=int, help="bytes per second an upload is allowed beyond the timeout "
                   "[REV88_UPLOAD_MIN_RATE, default 1 MiB]")
    p.add_argument("--upload-buffer-bytes", type=int, help="bytes the bodies being received or parsed may hold "
                   "together; beyond, 503 [REV88_UPLOAD_BUFFER_BYTES, default (queue size + 1) x max body bytes]")
    p.add_argument("--header-timeout", type=float, help="seconds a connection has to send a request's headers "
                   "[REV88_HEADER_TIMEOUT_S, default 10]")
    p.add_argument("--keepalive", type=float, help="seconds an idle keep-alive connection stays open "
                   "[REV88_KEEPALIVE_S, default 5]")
    p.add_argument("--max-connections", type=int, help="connections (and requests) at once; beyond, 503 at once "
                   "[REV88_MAX_CONNECTIONS, default 4096; the open-file limit is raised to fit where it can]")
    p.add_argument("--stock-http", action="store_const", const="1", help="run uvicorn's own HTTP protocol "
                   "instead of the body protocol (needed on a uvicorn release the service was not tested on; "
                   "loses the header timeout, the lingering close, uploads reserved as they arrive, large bodies in "
                   "one buffer) [REV88_STOCK_HTTP, default off]")
    p.add_argument("--database-url", help="postgresql://user:password@host:port/db: the ledger in PostgreSQL, "
                   "shared by every replica (claims, leases; docs/ledger.md) [REV88_DATABASE_URL; default: SQLite in "
                   "the data dir; prefer the variable: a flag shows in the process list]")
    p.add_argument("--db-pool-size", type=int, help="database connections this replica may open "
                   "[REV88_DB_POOL_SIZE, default 8; replicas x this must stay under the server's max_connections]")
    p.add_argument("--db-timeout", type=float, help="seconds to connect, to wait for a pooled connection and for a "
                   "statement; then 503 [REV88_DB_TIMEOUT_S, default 5]")
    p.add_argument("--lease", type=float, help="seconds a claimed task's lease lasts unless renewed; a stopped "
                   "replica's tasks run elsewhere after it [REV88_LEASE_S, default 10]")
    p.add_argument("--lease-renew", type=float, help="seconds between lease renewals [REV88_LEASE_RENEW_S, default 2; "
                   "at most half the lease]")
    p.add_argument("--lease-attempts", type=int, help="lease expiries before a task is failed "
                   "[REV88_LEASE_ATTEMPTS, default 3]")
    p.add_argument("--claim-poll", type=float, help="seconds between looks for queued work (and reaps of expired "
                   "leases) when no notification came [REV88_CLAIM_POLL_S, default 1]")
    p.add_argument("--backlog-size", type=int, help="asynchronous tasks (uploads, sweep and evaluation cells) that "
                   "may wait in the ledger; beyond, 503 [REV88_BACKLOG_SIZE, default 100000]")
    p.add_argument("--backlog-bytes", type=int, help="bytes the waiting asynchronous uploads may keep stored; beyond, "
                   "503 [REV88_BACKLOG_BYTES, default half the data dir's free disk at start; PostgreSQL: 16 GiB]")
    p.add_argument("--dataset-bytes", type=int, help="bytes the stored datasets and their labels may take in all; "
                   "beyond, 413 naming it [REV88_DATASET_BYTES, default 4 GiB]")
    p.add_argument("--dataset-cache-bytes", type=int, help="parsed datasets kept in memory per process "
                   "[REV88_DATASET_CACHE_BYTES, default 512 MiB]")
    p.add_argument("--seed-cache-bytes", type=int, help="seed-derived state (initial parameters, epoch permutations and "
                   "their hashes) kept per process, least recently used out first [REV88_SEED_CACHE_BYTES, default 256 MiB]")
    p.add_argument("--seed-processes", type=int, help="processes that compute seed-derived state apart from the "
                   "server's GIL, for work over many distinct seeds on a many-core host "
                   "[REV88_SEED_PROCESSES, default 0: in the server's own thread]")
    p.add_argument("--device-dataset-bytes", type=int, help="datasets (images, labels) kept on each GPU by the fused "
                   "backend, least recently used out first; 0 keeps none [REV88_DEVICE_DATASET_BYTES, default 2 GiB]")
    p.add_argument("--sweep-max-cells", type=int, help="cells one sweep may have [REV88_SWEEP_MAX_CELLS, default 1000]")
    p.add_argument("--sweep-max-work", type=int, help="estimated work of one sweep's cells together "
                   "[REV88_SWEEP_MAX_WORK, default 10,000,000,000]")
    p.add_argument("--webhook-retry-schedule", help="the delay in seconds before each webhook attempt, comma-separated "
                   "(the first from the event) [REV88_WEBHOOK_RETRY_SCHEDULE, default 0,5,300,1800,7200,18000,36000,36000]")
    p.add_argument("--webhook-timeout", type=float, help="seconds one webhook attempt may take in all "
                   "[REV88_WEBHOOK_TIMEOUT_S, default 15]")
    p.add_argument("--webhook-allow-cidrs", help="address ranges webhooks may target beside public ones, "
                   "comma-separated [REV88_WEBHOOK_ALLOW_CIDRS, default none]")
    p.add_argument("--webhook-secret-overlap", type=float, help="seconds a rotated-out webhook secret still signs "
                   "[REV88_WEBHOOK_SECRET_OVERLAP_S, default 86400]")
    p.add_argument("--webhook-concurrency", type=int, help="webhook attempts at once per replica "
                   "[REV88_WEBHOOK_CONCURRENCY, default 8]")
    p.add_argument("--webhook-poll", type=float, help="how often the webhook outbox is looked at, seconds "
                   "[REV88_WEBHOOK_POLL_S, default 1]")
    p.add_argument("--webhook-retain", type=float, help="seconds a delivered or failed webhook message is kept "
                   "[REV88_WEBHOOK_RETAIN_S, default 604800]")
    p.set_defaults(func=cmd_serve)
