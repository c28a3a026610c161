"""The task ledger in PostgreSQL, shared by every replica (issue #22; psycopg 3 + psycopg_pool).

The same interface and behaviour as the SQLite ``Ledger`` (app/ledger/store.py; tests/test_ledger.py
runs against both), plus what replicas sharing one ledger need (``SharedLedger`` in base.py):

Schema. Versioned SQL files in app/ledger/migrations/ (``NNNN_name.sql``), applied at open in
order, each in one transaction together with its row in ``rev88_schema``, under
``pg_advisory_lock``: replicas starting together migrate once, the others wait and find the work
done. A database whose schema is newer than this code's is a ``LedgerError`` (startup stops).
Tables: ``rev88_tasks`` (the rows the SQLite ledger keeps, plus the lease columns) and
``rev88_task_inputs`` (an asynchronous task's npz as bytea, never read by lists or status
reads; deleted in the transaction that records the task's outcome). Times are epoch seconds
from the server's clock, so every replica orders tasks and judges leases by one clock.

Claims, leases, fencing, reaping.

    claim    ``UPDATE … FROM (SELECT … WHERE status='queued' AND lease_owner IS NULL
             ORDER BY created_at FOR UPDATE SKIP LOCKED LIMIT n)``: an idle replica takes up
             to n queued asynchronous tasks (a fused worker: a whole launch), each with a lease
             (``lease_owner`` = this replica, ``lease_expires_at`` = server now + ``lease_s``)
             and a new epoch (``claims`` + 1). Two replicas never claim the same row.
    renew    ``renew(attempts)`` pushes the expiry of the leases of the attempts that still run
             here (task id -> epoch; owner and epoch must still match), on a connection of its
             own (``upkeep``: not the pool's, timeouts of a quarter lease), so request traffic
             cannot starve it; what no longer matches is reported lost, held tasks whose
             cancellation was requested are reported too. A lease with no live attempt here is
             not renewed: it is released, or expires and is reaped.
    fence    by attempt: ``mark_running`` and ``finish`` with the attempt's ``epoch`` are written
             only while the row still carries this replica's owner and that epoch; otherwise
             ``LeaseLost`` and nothing is written (a stale attempt's late result is refused, even
             when the replica that reaped its lease, or claimed the task again, is its own). A
             task nobody holds, or whose lease has expired, is taken over by ``mark_running``
             without an epoch; a live lease of another replica is never overridden.
    reap     ``reap()`` (every replica, periodically): a lease past its expiry is a replica
             that stopped; its asynchronous task is queued again (``expiries`` + 1) until it
             has expired ``lease_attempts`` times, then failed naming why; a synchronous one is
             failed (its client's connection went with its replica); one whose cancellation was
             requested is recorded cancelled.
    wake     ``pg_notify('rev88_queued')`` when a task becomes claimable and
             ``pg_notify('rev88_cancel', id)`` on a cancel request: hints for ``listen()``;
             the claimer still polls, so a lost notification only costs a poll period.

A synchronous task created here (an Idempotency-Key) is held by this replica from its creation,
so a replica that dies while running it leaves a lease that expires, and the task is failed.

Failures. Every connection has a bounded connect timeout, ``statement_timeout`` and
``lock_timeout`` (``timeout_s``), ``tcp_user_timeout`` (a vanished server is noticed within
``timeout_s``, not the kernel's retransmission timeout) and ``target_session_attrs=read-write``
(a standby is never written to); the URL's own values of these two win. A pool with no connection
free within ``timeout_s`` gives up. Any of these, or a lost connection, is ``LedgerUnavailable``
naming the problem and the database (the service answers 503). A lost connection also has the
pool check its idle connections (after a failover or a restart all of them are dead), and a read
(``get``, ``list``, counts, the queue's depth, stored inputs) is tried once more on a fresh one.
``create`` whose connection was lost re-reads its row on a fresh connection: found, the task was
recorded and is answered so (no 503 that means "accepted"); not found, a 503; unreadable, a 503
that says the outcome is unknown (``outcome_unknown``). docs/ledger.md lists every failure.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import psycopg.conninfo
import psycopg.errors
from psycopg_pool import ConnectionPool, PoolClosed, PoolTimeout

from ..task_row import FINISHED, STATUSES, TaskRecord
from . import database
from .base import Claim, LeaseLost, Renewal
from .database import PostgresDatabase
from .outbox import insert_messages, task_rows
from .rows import (
    ALL_COLUMNS,
    SUMMARY_COLUMNS,
    SUMMARY_WIDTH,
    columns_as,
    record_from_row,
)
from .rows import dumps as _dumps
from .store import (
    AlreadyFinished,
    FinishedTask,
    IdempotencyConflict,
    LedgerError,
    LedgerUnavailable,
    Outcome,
    check_finished_task,
    check_new_task,
    check_outcome,
    check_task_id,
)
from .task_reads import POSTGRESQL, TaskReads
from .task_writes import (
    assignments,
    finished_row,
    insert,
    new_row,
    new_rows,
    outcome_row,
    pg_mark,
    pg_named_mark,
)

log = logging.getLogger("rev88." + __name__)

MIGRATIONS_DIR = database.MIGRATIONS_DIR
# What a claim takes (``claim``): queued, unclaimed, not asked to cancel, its tenant under its key's
# max_running (its claimed and running tasks on every replica) -- each picked tenant's oldest ...
CLAIMABLE = ("q.status = 'queued' AND q.mode = 'async' AND q.lease_owner IS NULL AND q.cancel_requested_at IS NULL"
             " AND (k.max_running IS NULL OR k.max_running > (SELECT count(*) FROM rev88_tasks b"
             "      WHERE (b.status = 'running' OR b.lease_owner IS NOT NULL)"
             "      AND COALESCE(b.options::json ->> 'owner', '') = COALESCE(q.options::json ->> 'owner', '')))")
CLAIM_PICKS = (
    "SELECT p.id FROM unnest(%(tenants)s::text[], %(counts)s::int[]) AS w(tenant, n)"
    " CROSS JOIN LATERAL (SELECT q.id FROM rev88_tasks q LEFT JOIN rev88_keys k ON k.id = w.tenant"
    f"   WHERE {CLAIMABLE} AND COALESCE(q.options::json ->> 'owner', '') = w.tenant"
    "   ORDER BY q.created_at, q.id LIMIT w.n FOR UPDATE OF q SKIP LOCKED) p")
# ... and then the oldest of any tenant
CLAIM_OLDEST = (
    "SELECT q.id FROM rev88_tasks q LEFT JOIN rev88_keys k ON k.id = (q.options::json ->> 'owner')"
    f" WHERE {CLAIMABLE} ORDER BY q.created_at, q.id LIMIT %(n)s FOR UPDATE OF q SKIP LOCKED")
# pg_advisory_lock keys (64-bit): the schema migration, and retention (one replica at a time)
MIGRATION_LOCK = 0x7265_7638_0001
RETENTION_LOCK = 0x7265_7638_0002
CHANNEL_QUEUED = "rev88_queued"
CHANNEL_CANCEL = "rev88_cancel"
MIGRATION_LOCK_WAIT_S = 120  # another replica's migration: wait this long for it at most
RETENTION_CHECK_S = 5.0  # a replica also recounts at least this often (others finish tasks too)
REAP_BATCH = 500
CHECK_IDLE_S = 1.0  # a pooled connection idle longer than this is checked (one round trip) before use

NOW = "EXTRACT(EPOCH FROM clock_timestamp())::float8"  # the server's clock, epoch seconds

# the task row's writes (app/ledger/task_writes.py), with PostgreSQL's own part: the server's clock,
# whether an input is kept, the lease (a synchronous task is held by its replica from the start)
_NEW = insert("rev88_tasks", "new", "postgresql", pg_named_mark,
              {"created_at": NOW, "lease_expires_at": f"{NOW} + %(lease)s"})
_NEW_CELLS = insert("rev88_tasks", "new", "postgresql", pg_mark,
                    {"created_at": NOW, "has_input": "false", "lease_owner": "NULL", "lease_expires_at": "NULL",
                     "claims": "0", "idempotency_key": "NULL"})
_OUTCOME = assignments("outcome", "postgresql", pg_named_mark,
                       {"finished_at": NOW, "input_hashes": "COALESCE({}, t.input_hashes)", "has_input": "false",
                        "lease_owner": "NULL", "lease_expires_at": "NULL"})
_FINISHED = insert("rev88_tasks", "finished", "postgresql", pg_mark, {"finished_at": NOW})

# the task row's columns (app/ledger/rows.py, from app/task_row.py), with the alias of an UPDATE's table
T_SUMMARY_COLUMNS = columns_as("t")
T_ALL_COLUMNS = columns_as("t", with_answer=True)
_LOCK_COLUMNS = f"id, status, mode, lease_owner, lease_expires_at, claims, {NOW}"


def load_migrations(folder: Path = MIGRATIONS_DIR) -> list[tuple[int, str, str]]:
    """(version, name, SQL) of every PostgreSQL migration file, in order (app/ledger/database.py)."""
    try:
        return database.load_migrations(folder)
    except ValueError as exc:
        raise LedgerError(str(exc)) from None


MIGRATIONS = load_migrations()
SCHEMA_VERSION: int = MIGRATIONS[-1][0]


def redact(url: str) -> str:
    """The URL without its password (for logs, /health and error messages)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable database URL>"
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


def default_owner() -> str:
    """A lease owner id unique to this process: host, pid and a random part."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _record(row: tuple | Any, with_answer: bool) -> TaskRecord:
    return record_from_row(row, with_answer)


def _connection_lost(exc: BaseException | None) -> bool:
    """Whether ``exc`` is the connection failing (closed, reset, the server shutting down), not a
    statement's own error or a timeout: the write may or may not have been committed."""
    if not isinstance(exc, psycopg.OperationalError) or isinstance(
            exc, (psycopg.errors.QueryCanceled, psycopg.errors.LockNotAvailable)):
        return False
    state = exc.sqlstate
    return state is None or state.startswith("08") or state in ("57P01", "57P02", "57P03")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class _AlreadyRecorded(Exception):
    def __init__(self, record: TaskRecord) -> None:
        self.record = record


class PostgresLedger(TaskReads):
    """The task ledger of every replica, in one PostgreSQL database. Thread-safe (a pool). Its
    reads of tasks are both ledgers' (app/ledger/task_reads.py), in PostgreSQL's dialect."""

    dialect = POSTGRESQL

    shared = True
    engine = "postgresql"

    def __init__(self, url: str, retain_tasks: int = 10_000, retain_bytes: int = 1 << 30, *,
                 pool_size: int = 8, timeout_s: float = 5.0, lease_s: float = 10.0, lease_attempts: int = 3,
                 owner: str | None = None) -> None:
        if retain_tasks < 0 or retain_bytes < 0:
            raise ValueError(f"retain_tasks and retain_bytes must be >= 0, got {retain_tasks}, {retain_bytes}")
        if pool_size < 1 or lease_attempts < 1:
            raise ValueError(f"pool_size and lease_attempts must be >= 1, got {pool_size}, {lease_attempts}")
        if not (math.isfinite(timeout_s) and timeout_s > 0 and math.isfinite(lease_s) and lease_s > 0):
            raise ValueError(f"timeout_s and lease_s must be finite and > 0, got {timeout_s}, {lease_s}")
        self.url = url
        self.path = redact(url)
        self.retain_tasks, self.retain_bytes = retain_tasks, retain_bytes
        self.pool_size, self.timeout_s = pool_size, float(timeout_s)
        self.lease_s, self.lease_attempts = float(lease_s), lease_attempts
        self.owner = owner or default_owner()
        self.schema_version: int | None = None
        self._held: dict[str, int] = {}  # task id -> the epoch of the lease this replica holds
        self._held_lock = threading.Lock()
        self._totals: tuple[int, int] | None = None  # finished tasks, their stored bytes (as last counted)
        self._retain_checked = 0.0
        self._connect_error: str | None = None  # the last failed connection attempt's message
        self._queue_stats: dict[str, Any] | None = None  # the last queue_depth()
        self._pool: ConnectionPool | None = None
        self._upkeep_conn: psycopg.Connection | None = None  # the lease renewals' own connection
        self._upkeep_lock = threading.Lock()
        self._last_used: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # pooled connection -> monotonic
        # the public connection API the side stores use (keys, owners, evaluations, datasets, the
        # webhook outbox: app/ledger/database.py)
        self.database = PostgresDatabase(read=self._read, write=lambda doing, durable: self._conn(doing))
        self._check_url(url)
        self._url_params = set(psycopg.conninfo.conninfo_to_dict(url))
        self._migrate()
        self._pool = self._make_pool()
        try:
            self._pool.open(wait=True, timeout=self.timeout_s)
            self._retain(keep=None, force=True)
        except PoolTimeout as exc:
            self.close()
            raise LedgerError(f"cannot connect to the task ledger's database {self.path}: "
                              f"{self._connect_error or 'no connection within the timeout'}") from exc
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ connections

    @staticmethod
    def _check_url(url: str) -> None:
        try:
            psycopg.conninfo.conninfo_to_dict(url)
        except psycopg.ProgrammingError as exc:
            raise LedgerError(f"REV88_DATABASE_URL is not a PostgreSQL connection URL ({redact(url)}): "
                              f"{_first_line(exc)}") from None

    def _options(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Connection parameters (``timeout_s``: the statement and lock timeout, default the
        ledger's). ``tcp_user_timeout`` and ``target_session_attrs``: the URL's own, if it sets them."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        ms = max(1, int(timeout_s * 1000))
        options = {
            "connect_timeout": max(2, math.ceil(timeout_s)),
            "application_name": "rev88",
            "options": f"-c statement_timeout={ms} -c lock_timeout={ms} "
                       f"-c idle_in_transaction_session_timeout={max(ms * 4, 10_000)}",
            "keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 3, "keepalives_count": 3,
            "tcp_user_timeout": max(1000, int(self.timeout_s * 1000)), "target_session_attrs": "read-write",
        }
        for name in self._url_params & {"tcp_user_timeout", "target_session_attrs"}:
            del options[name]
        return options

    def _make_pool(self) -> ConnectionPool:
        ledger, last_used = self, self._last_used

        class Connection(psycopg.Connection):
            """Remembers why the last connection attempt failed (named in the 503s)."""

            @classmethod
            def connect(cls, conninfo: str = "", **kwargs: Any):  # type: ignore[override]
                try:
                    conn = super().connect(conninfo, **kwargs)
                except psycopg.Error as exc:
                    ledger._connect_error = _first_line(exc)
                    raise
                ledger._connect_error = None
                return conn

        def check(conn: psycopg.Connection) -> None:
            # a connection in use a moment ago is taken as it is (a broken one fails its request
            # once and is discarded); one idle longer -- after an outage, say -- is checked first
            used = last_used.get(conn)
            if used is None or time.monotonic() - used > CHECK_IDLE_S:
                ConnectionPool.check_connection(conn)

        return ConnectionPool(
            self.url, connection_class=Connection, kwargs={"autocommit": True, **self._options()},
            min_size=1, max_size=self.pool_size, timeout=self.timeout_s, check=check,
            # a short give-up: once the server is back, the next request grows the pool afresh
            # (a long one would back off exponentially while the server is down)
            reconnect_timeout=max(2.0, self.timeout_s), name="rev88-ledger", open=False,
        )

    def _describe(self, exc: BaseException, doing: str) -> str:
        if isinstance(exc, PoolTimeout):
            why = (f"the database does not answer: {self._connect_error}" if self._connect_error
                   else f"all {self.pool_size} connections in use (REV88_DB_POOL_SIZE)")
            problem = f"no database connection within {self.timeout_s:g} s ({why})"
        elif isinstance(exc, psycopg.errors.QueryCanceled):
            problem = f"the database did not answer within {self.timeout_s:g} s (statement_timeout)"
        elif isinstance(exc, psycopg.errors.LockNotAvailable):
            problem = f"waited {self.timeout_s:g} s for a lock (lock_timeout)"
        elif isinstance(exc, psycopg.OperationalError):
            problem = f"the database connection failed ({_first_line(exc)})"
        else:
            problem = f"{type(exc).__name__}: {_first_line(exc)}"
        return f"cannot {doing}: {problem} — task ledger PostgreSQL {self.path}"

    @contextlib.contextmanager
    def _conn(self, doing: str, transaction: bool = True) -> Iterator[psycopg.Connection]:
        """A pooled connection (in one transaction unless told otherwise); database failures
        become LedgerUnavailable naming the problem. Integrity errors pass through."""
        pool = self._pool
        if pool is None:
            raise LedgerUnavailable(f"the task ledger {self.path} is closed")
        try:
            with pool.connection(timeout=self.timeout_s) as conn:
                if transaction:
                    with conn.transaction():
                        yield conn
                else:
                    yield conn
                self._last_used[conn] = time.monotonic()
        except psycopg.IntegrityError:
            raise
        except PoolClosed as exc:
            raise LedgerUnavailable(f"the task ledger {self.path} is closed") from exc
        except (psycopg.Error, PoolTimeout) as exc:
            if _connection_lost(exc):  # (a failover or restart: the others idle in the pool are dead too)
                with contextlib.suppress(Exception):
                    pool.check()
            raise LedgerUnavailable(self._describe(exc, doing)) from exc

    def _read(self, doing: str, read: Callable[[psycopg.Connection], Any]) -> Any:
        """An idempotent read on a pooled connection, tried once more on a fresh one when the
        first was lost (a server restarted, a failover)."""
        try:
            with self._conn(doing, transaction=False) as conn:
                return read(conn)
        except LedgerUnavailable as exc:
            if not _connection_lost(exc.__cause__):
                raise
            log.info("task ledger connection lost; reading again on a fresh one", extra={"doing": doing})
        with self._conn(doing, transaction=False) as conn:
            return read(conn)

    @contextlib.contextmanager
    def upkeep(self, doing: str) -> Iterator[psycopg.Connection]:
        """The connection of the lease renewals: one of its own, outside the pool (request traffic
        cannot hold it), with timeouts of a quarter lease (at most ``timeout_s``); reopened after
        a failure. One caller at a time."""
        with self._upkeep_lock:
            try:
                if self._upkeep_conn is None or self._upkeep_conn.closed:
                    self._upkeep_conn = psycopg.connect(self.url, autocommit=True,
                                                        **self._options(self.upkeep_timeout_s))
                yield self._upkeep_conn
            except psycopg.Error as exc:
                conn, self._upkeep_conn = self._upkeep_conn, None
                if conn is not None:
                    with contextlib.suppress(Exception):
                        conn.close()
                raise LedgerUnavailable(self._describe(exc, doing)) from exc

    @property
    def upkeep_timeout_s(self) -> float:
        return min(self.timeout_s, self.lease_s / 4)

    # ------------------------------------------------------------------ schema

    def _migrate(self) -> None:
        try:
            conn = psycopg.connect(self.url, autocommit=True, **self._options())
        except psycopg.Error as exc:
            raise LedgerError(f"cannot connect to the task ledger's database {self.path}: {_first_line(exc)}") from exc
        try:
            with conn:
                conn.execute(f"SET lock_timeout = '{MIGRATION_LOCK_WAIT_S}s'")
                conn.execute("SET statement_timeout = 0")
                conn.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK,))
                try:
                    self.schema_version = self._apply_migrations(conn)
                finally:
                    with contextlib.suppress(psycopg.Error):
                        conn.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK,))
        except LedgerError:
            raise
        except psycopg.Error as exc:
            raise LedgerError(f"cannot migrate the task ledger's database {self.path}: {_first_line(exc)}") from exc

    def _apply_migrations(self, conn: psycopg.Connection) -> int:
        conn.execute("CREATE TABLE IF NOT EXISTS rev88_schema (version integer PRIMARY KEY, name text NOT NULL,"
                     " applied_at timestamptz NOT NULL DEFAULT now())")
        applied = dict(conn.execute("SELECT version, name FROM rev88_schema").fetchall())
        current = max(applied, default=0)
        if current > SCHEMA_VERSION:
            raise LedgerError(
                f"the task ledger's database {self.path} has schema version {current}, newer than this code's "
                f"{SCHEMA_VERSION}: run a newer rev88, or point REV88_DATABASE_URL at another database")
        for version, name, sql in MIGRATIONS:
            if version in applied:
                if applied[version] != name:
                    raise LedgerError(f"the task ledger's database {self.path} recorded migration {version} as "
                                      f"{applied[version]!r}, but this code's is {name!r}: not the same schema")
                continue
            with conn.transaction():
                conn.execute(sql)
                conn.execute("INSERT INTO rev88_schema (version, name) VALUES (%s, %s)", (version, name))
            log.info("task ledger migrated", extra={"version": version, "migration": name, "database": self.path})
            current = version
        return current

    # ------------------------------------------------------------------ leases held here

    def held(self) -> list[str]:
        with self._held_lock:
            return list(self._held)

    def forget(self, task_ids: list[str]) -> None:
        """This replica gives up its leases of ``task_ids`` without telling the database (it does
        not answer): they are not renewed, and expire."""
        for task_id in task_ids:
            self._unhold(task_id)

    def held_epoch(self, task_id: str) -> int | None:
        """The epoch of this replica's lease of ``task_id`` (what its attempt writes under), or None."""
        with self._held_lock:
            return self._held.get(task_id)

    def _hold(self, task_id: str, epoch: int) -> None:
        with self._held_lock:
            self._held[task_id] = epoch

    def _unhold(self, task_id: str, epoch: int | None = None) -> None:
        """This replica no longer holds ``task_id``'s lease (only that ``epoch``'s, if given)."""
        with self._held_lock:
            if epoch is None or self._held.get(task_id) == epoch:
                self._held.pop(task_id, None)

    def _lease_for(self, row: tuple, writing: str) -> int:
        """(Row locked FOR UPDATE: id, status, mode, lease_owner, lease_expires_at, claims, now.)
        The epoch this replica writes the task under: its own lease, or a free or expired one it
        takes over (a new epoch). LeaseLost when another replica's lease is live, or when the
        lease this replica held has passed to another."""
        task_id, _, _, owner, expires, claims, now = row
        with self._held_lock:
            mine = self._held.get(task_id)
        if owner == self.owner and (mine is None or mine == claims):
            return claims
        if mine is not None:
            self._unhold(task_id)
            raise LeaseLost(task_id, f"{writing} of task {task_id} refused: this replica's lease (epoch {mine}) "
                            f"has passed to {owner or 'nobody (queued again)'} (epoch {claims})")
        if owner is None or expires < now:
            return claims + 1
        raise LeaseLost(task_id, f"{writing} of task {task_id} refused: replica {owner} holds its lease for "
                        f"{expires - now:.1f} s more; only the lease holder writes it")

    def _locked(self, conn: psycopg.Connection, task_ids: list[str]) -> dict[str, tuple]:
        rows = conn.execute(f"SELECT {_LOCK_COLUMNS} FROM rev88_tasks WHERE id = ANY(%s) FOR UPDATE",
                            (task_ids,)).fetchall()
        return {row[0]: row for row in rows}

    def _summary(self, conn: psycopg.Connection, task_id: str) -> TaskRecord | None:
        row = conn.execute(f"SELECT {SUMMARY_COLUMNS} FROM rev88_tasks WHERE id = %s", (task_id,)).fetchone()
        return None if row is None else _record(row, False)

    # ------------------------------------------------------------------ the interface

    def create(self, *, task_id: str, kind: str, mode: str, backend: str, config: dict, options: dict,
               train_count: int, test_count: int, body_sha256: str | None, body_bytes: int,
               input_hashes: dict | None = None, body: bytes | None = None,
               idempotency_key: str | None = None) -> tuple[TaskRecord, bool]:
        """Record a new task as queued: (record, True); with ``body`` its npz in the same
        transaction. An asynchronous task is then claimable by any replica (and a wake-up is
        sent); a synchronous one is held by this replica. An ``idempotency_key`` already in the
        ledger: the same body and options give (that task, False), anything else raises
        IdempotencyConflict (one INSERT … ON CONFLICT: unique across replicas)."""
        check_new_task(kind, mode, body, body_bytes, body_sha256, idempotency_key)
        check_task_id(task_id)
        held = mode == "sync"
        params = {
            **new_row(task_id, kind, mode, backend, config, options, train_count, test_count, input_hashes,
                      body_sha256, body_bytes, idempotency_key),
            "has_input": body is not None, "lease_owner": self.owner if held else None,
            "lease": self.lease_s if held else None, "claims": 1 if held else 0,
        }
        insert = _NEW.sql
        if idempotency_key is not None:
            insert += " ON CONFLICT (idempotency_key) DO NOTHING"
        insert += f" RETURNING {ALL_COLUMNS}"
        try:
            for _ in range(3):  # a conflicting row deleted meanwhile (retention): insert again
                with self._recorded_or_lost(task_id, params) as conn:
                    row = conn.execute(insert, params, binary=True).fetchone()
                    if row is None:
                        found = conn.execute(f"SELECT {ALL_COLUMNS} FROM rev88_tasks WHERE idempotency_key = %s",
                                             (idempotency_key,), binary=True).fetchone()
                        if found is None:
                            continue
                        existing = _record(found, True)
                        if not (existing.body_sha256 == body_sha256 and existing.kind == kind
                                and existing.backend == backend and _dumps(existing.config) == params["config"]
                                and _dumps(existing.options) == params["options"]):
                            raise IdempotencyConflict(idempotency_key, existing.id)
                        return existing, False
                    if body is not None:
                        conn.execute("INSERT INTO rev88_task_inputs (task_id, bytes, body) VALUES (%s, %s, %b)",
                                     (task_id, len(body), body))
                    insert_messages(conn, task_rows(task_id, options), "postgresql")  # its webhook's messages (issue #34)
                    if mode == "async":
                        conn.execute("SELECT pg_notify(%s, '')", (CHANNEL_QUEUED,))
                    record = _record(row, True)
                break
            else:  # pragma: no cover - three deletions in a row
                raise LedgerUnavailable(f"cannot record task {task_id}: its Idempotency-Key kept changing hands")
        except _AlreadyRecorded as found:  # the COMMIT went through before the connection was lost
            record = found.record
        except psycopg.errors.UniqueViolation as exc:
            raise ValueError(f"task id {task_id} is already in the ledger ({_first_line(exc)})") from exc
        except psycopg.IntegrityError as exc:
            raise ValueError(f"cannot record task {task_id}: {_first_line(exc)}") from exc
        if held:
            self._hold(task_id, 1)
        return record, True

    def create_many(self, tasks: list[dict], messages: list[tuple] | None = None) -> None:
        """Record many new asynchronous tasks without a body or an Idempotency-Key (a sweep's
        cells) as queued, claimable by any replica, in one transaction (one wake-up), with
        ``messages`` (webhook outbox rows: a sweep's, an evaluation's)."""
        for t in tasks:
            check_new_task(t["kind"], t["mode"], None, t["body_bytes"], t["body_sha256"], None)
            check_task_id(t["task_id"])
        rows = [_NEW_CELLS.values(row) for row in new_rows(tasks)]
        try:
            with self._conn(f"record {len(rows)} task(s)") as conn, conn.cursor() as cur:
                cur.executemany(_NEW_CELLS.sql, rows)
                insert_messages(conn, [m for t in tasks for m in task_rows(t["task_id"], t["options"])]
                                + list(messages or []), "postgresql")
                if any(t["mode"] == "async" for t in tasks):
                    cur.execute("SELECT pg_notify(%s, '')", (CHANNEL_QUEUED,))
        except psycopg.IntegrityError as exc:
            raise ValueError(f"a task id is already in the ledger ({_first_line(exc)})") from exc

    @contextlib.contextmanager
    def _recorded_or_lost(self, task_id: str, params: dict) -> Iterator[psycopg.Connection]:
        """``create``'s transaction. When its connection is lost, the COMMIT may have reached the
        server before it: the row is read again by its id on a fresh connection, and found
        (written by this create: same body and options) it raises _AlreadyRecorded with it. Not
        found: the LedgerUnavailable as it was; unreadable: one that says the outcome is unknown."""
        try:
            with self._conn(f"record task {task_id}") as conn:
                yield conn
        except LedgerUnavailable as exc:
            if not _connection_lost(exc.__cause__):
                raise
            try:
                with self._conn(f"read back task {task_id}", transaction=False) as conn:
                    row = conn.execute(f"SELECT {ALL_COLUMNS} FROM rev88_tasks WHERE id = %s", (task_id,),
                                       binary=True).fetchone()
            except LedgerUnavailable as again:
                unknown = LedgerUnavailable(
                    f"{exc}; whether task {task_id} was recorded is unknown (the connection was lost during its "
                    f"COMMIT, and reading it back failed: {again}); resend it with an Idempotency-Key to be sure "
                    "it runs once")
                unknown.outcome_unknown = True
                raise unknown from exc
            if row is None:
                raise
            found = _record(row, True)
            if found.body_sha256 != params["body_sha256"] or _dumps(found.config) != params["config"]:
                raise  # (another task of that id: cannot be, ids are random; the 503 stands)
            log.warning("task recorded although its connection was lost during COMMIT", extra={"task_id": task_id})
            raise _AlreadyRecorded(found) from None

    # A write of a task's row is one statement, its fence in its WHERE: a task this replica holds
    # is written only under its owner and epoch; any other only while no other replica's lease
    # is live. No row updated: _refused says why (unknown, finished, or LeaseLost).
    _FENCE_HELD = "t.lease_owner = %(owner)s AND t.claims = %(epoch)s"
    _FENCE_FREE = f"(t.lease_owner IS NULL OR t.lease_owner = %(owner)s OR t.lease_expires_at < {NOW})"

    def _epoch(self, task_id: str) -> int | None:
        with self._held_lock:
            return self._held.get(task_id)

    def _refused(self, conn: psycopg.Connection, task_id: str, writing: str, epoch: int | None = None) -> None:
        """Raise why a fenced write of ``task_id`` updated nothing (KeyError, AlreadyFinished,
        LeaseLost); return when the row has become writable meanwhile (write again). ``epoch``:
        the attempt's, which only its own lease lets write."""
        row = conn.execute(f"SELECT {_LOCK_COLUMNS} FROM rev88_tasks WHERE id = %s", (task_id,)).fetchone()
        if row is None:
            raise KeyError(task_id)
        if row[1] in FINISHED:
            raise AlreadyFinished(self._summary(conn, task_id))
        if epoch is not None:
            _, _, _, owner, _, claims, _ = row
            if owner == self.owner and claims == epoch:
                return
            self._unhold(task_id, epoch)
            raise LeaseLost(task_id, f"{writing} of task {task_id} refused: this attempt's lease (epoch {epoch}) has "
                            f"passed to {owner or 'nobody (queued again)'} (epoch {claims})")
        self._lease_for(row, writing)

    def mark_running(self, task_id: str, device: str | None = None, epoch: int | None = None) -> None:
        """queued (or running, re-run after a replica stopped) -> running; sets started_at (server
        clock). With ``epoch`` (the attempt's lease): only under that lease, else LeaseLost;
        without one, takes the task's lease for this replica (LeaseLost if another holds it)."""
        for _ in range(3):
            with self._conn(f"mark task {task_id} running", transaction=False) as conn:
                if self._set_running(conn, [(task_id, device, None, epoch)]):
                    return
                self._refused(conn, task_id, "marking running", epoch)
        raise LedgerUnavailable(f"cannot mark task {task_id} running: its lease kept changing hands")

    def mark_running_many(self, started: list[tuple]) -> list[str]:
        """``(task id, device, started_at[, epoch])`` of tasks a launch started, in one statement:
        each unfinished one this replica may hold -> running, as ``mark_running``. Returns the ids
        it left alone (unknown, finished meanwhile, or held by another replica)."""
        if not started:
            return []
        started = [(t[0], t[1], t[2], t[3] if len(t) > 3 else None) for t in started]
        with self._conn(f"mark {len(started)} task(s) running", transaction=False) as conn:
            marked = self._set_running(conn, started)
        skipped = [t[0] for t in started if t[0] not in marked]
        for task_id in skipped:
            if self._epoch(task_id) is not None:
                log.warning("task not marked running: its lease has passed to another replica",
                            extra={"task_id": task_id})
                self._unhold(task_id)
        return skipped

    def _set_running(self, conn: psycopg.Connection, started: list[tuple]) -> set[str]:
        ids = [t[0] for t in started]
        epochs = [t[3] if t[3] is not None else self._epoch(t[0]) for t in started]
        rows = conn.execute(
            "UPDATE rev88_tasks t SET status = 'running',"
            f" started_at = COALESCE(s.started_at, {NOW}), device = COALESCE(s.device, t.device),"
            f" attempts = t.attempts + 1, lease_owner = %(owner)s, lease_expires_at = {NOW} + %(lease)s,"
            " claims = CASE WHEN t.lease_owner = %(owner)s THEN t.claims ELSE t.claims + 1 END"
            " FROM unnest(%(ids)s::text[], %(devices)s::text[], %(started)s::float8[], %(epochs)s::int[])"
            "      AS s(id, device, started_at, epoch)"
            " WHERE t.id = s.id AND t.status IN ('queued', 'running') AND CASE WHEN s.epoch IS NOT NULL"
            "   THEN t.lease_owner = %(owner)s AND t.claims = s.epoch"
            f"  ELSE {self._FENCE_FREE} END"
            " RETURNING t.id, t.claims",
            {"owner": self.owner, "lease": self.lease_s, "ids": ids, "devices": [t[1] for t in started],
             "started": [t[2] for t in started], "epochs": epochs}).fetchall()
        for task_id, epoch in rows:
            self._hold(task_id, epoch)
        return {r[0] for r in rows}

    def finish(self, task_id: str, status: str, answer: dict | None = None,
               error: dict | None = None, answer_json: bytes | None = None,
               with_answer: bool = True, input_hashes: dict | None = None, epoch: int | None = None) -> TaskRecord:
        """Record the outcome and delete the task's input, in one statement, then apply
        retention. KeyError for an unknown task, AlreadyFinished for a finished one, LeaseLost
        when another replica holds (or has taken over) its lease: fenced by owner and epoch (the
        attempt's ``epoch`` when given: then only that lease writes, whoever holds the task now)."""
        check_outcome(status, answer, error, answer_json)
        params = {**outcome_row(status, answer, error, answer_json, input_hashes), "owner": self.owner, "id": task_id}
        attempt = epoch
        for _ in range(3):
            params["epoch"] = epoch = attempt if attempt is not None else self._epoch(task_id)
            with self._conn(f"record the result of task {task_id}", transaction=False) as conn:
                done = self._write_outcome(conn, params, with_answer, epoch is not None).fetchone()
                if done is None:
                    self._refused(conn, task_id, "the result", attempt)
                    continue
            record = _record(done, with_answer)
            break
        else:
            raise LedgerUnavailable(f"cannot record the result of task {task_id}: its lease kept changing hands")
        self._finished_here([(task_id, attempt, params["answer_bytes"])])
        return record

    def _write_outcome(self, conn: psycopg.Connection, params: dict, with_answer: bool, held: bool,
                       columns: str | None = None) -> psycopg.Cursor:
        """The outcome's UPDATE (fenced: by the attempt's lease when ``held``) and its input's DELETE,
        one statement, sent; its cursor's row is the row written (``columns``: those, by default the
        record's), none when the fence refused it."""
        columns = columns or ", ".join(f"t.{c}" for c in (ALL_COLUMNS if with_answer else SUMMARY_COLUMNS).split(", "))
        return conn.cursor(binary=True).execute(
            f"WITH done AS (UPDATE rev88_tasks t SET {_OUTCOME.sql}"
            " WHERE t.id = %(id)s AND t.status IN ('queued', 'running') AND"
            f" {self._FENCE_HELD if held else self._FENCE_FREE} RETURNING {columns}),"
            " gone AS (DELETE FROM rev88_task_inputs WHERE task_id = %(id)s AND EXISTS (SELECT 1 FROM done))"
            " SELECT * FROM done", params)

    def _finished_here(self, written: list[tuple[str, int | None, int]]) -> None:
        """(task id, its attempt's epoch, its answer's bytes) of outcomes committed: their leases no
        longer held here, the totals counted, retention applied once."""
        for task_id, epoch, _ in written:
            self._unhold(task_id, epoch)
        if self._totals is not None:
            self._totals = (self._totals[0] + len(written), self._totals[1] + sum(n for _, _, n in written))
        if written:
            self._retain(keep=written[-1][0])

    def finish_many(self, outcomes: list[Outcome]) -> list[TaskRecord | bool | Exception]:
        """``finish`` for each of ``outcomes``. A launch's attempts (each with its lease's epoch) in
        ONE transaction -- one commit, one flush of the WAL, for the launch --, their statements
        sent together (libpq's pipeline: one round trip), each fenced by its own lease: a fence
        refused for one is that outcome's result and leaves the others. Outcomes without an epoch
        (a lone task that takes its lease as it writes) one by one. One result per outcome: its
        record (True once written where it wants none: ``Outcome.want_record``), or the exception
        ``finish`` raised for it (KeyError, AlreadyFinished, LeaseLost, ValueError).
        LedgerUnavailable raises (none of the transaction's outcomes are written)."""
        results: list[TaskRecord | bool | Exception | None] = [None] * len(outcomes)
        fenced = [i for i, o in enumerate(outcomes) if o.epoch is not None]
        if len(fenced) > 1:
            written: list[tuple[str, int | None, int]] = []
            with self._conn(f"record the results of {len(fenced)} tasks") as conn:
                sent = []
                # (libpq 14 or later, as psycopg[binary] bundles; an older one sends them one by one)
                with conn.pipeline() if psycopg.Pipeline.is_supported() else contextlib.nullcontext():
                    for i in fenced:
                        o = outcomes[i]
                        try:
                            check_outcome(o.status, o.answer, o.error, o.answer_json)
                        except ValueError as exc:
                            results[i] = exc
                            continue
                        params = {**outcome_row(o.status, o.answer, o.error, o.answer_json, o.hashes()),
                                  "owner": self.owner, "id": o.task_id, "epoch": o.epoch}
                        sent.append((i, params, self._write_outcome(conn, params, o.with_answer, True,
                                                                    None if o.want_record else "t.id")))
                for i, params, cursor in sent:
                    o = outcomes[i]
                    try:
                        done = cursor.fetchone()
                        if done is None:  # refused: why (or, should it be writable now, written again)
                            done = self._written_again(conn, o, params)
                        results[i] = _record(done, o.with_answer) if o.want_record else True
                        written.append((o.task_id, o.epoch, params["answer_bytes"]))
                    except (KeyError, AlreadyFinished, LeaseLost) as exc:
                        results[i] = exc
            self._finished_here(written)
        for i, o in enumerate(outcomes):
            if results[i] is not None:
                continue
            try:
                results[i] = self.finish(o.task_id, o.status, o.answer, o.error, o.answer_json, o.with_answer,
                                         o.hashes(), epoch=o.epoch)
            except (ValueError, KeyError, AlreadyFinished, LeaseLost) as exc:
                results[i] = exc
        return results  # type: ignore[return-value]

    def _written_again(self, conn: psycopg.Connection, o: Outcome, params: dict) -> tuple:
        """An attempt's outcome its fence refused inside a launch's transaction: KeyError,
        AlreadyFinished or LeaseLost -- or, should the row have become writable meanwhile, written."""
        for _ in range(3):
            self._refused(conn, o.task_id, "the result", o.epoch)
            done = self._write_outcome(conn, params, o.with_answer, True,
                                       None if o.want_record else "t.id").fetchone()
            if done is not None:
                return done
        raise LedgerUnavailable(f"cannot record the result of task {o.task_id}: its lease kept changing hands")

    def add_finished(self, tasks: list[FinishedTask]) -> None:
        """Record tasks that ran and finished without a record before, in one transaction, then
        apply retention. ValueError for a bad outcome or an id already in the ledger."""
        for t in tasks:
            check_finished_task(t)
        values = [finished_row(t) for t in tasks]
        rows = [_FINISHED.values(v) for v in values]
        added = sum(v["answer_bytes"] for v in values)
        if not rows:
            return
        try:
            with self._conn(f"record {len(rows)} finished task(s)") as conn, conn.cursor() as cur:
                # Their clients hold the answers (issue #21): the commit need not wait for the WAL's
                # flush (lost only with the database server, within 3 x wal_writer_delay; never torn).
                cur.execute("SET LOCAL synchronous_commit = off")
                cur.executemany(_FINISHED.sql, rows)
                insert_messages(conn, [m for t in tasks for m in task_rows(t.task_id, t.options)], "postgresql")
        except psycopg.IntegrityError as exc:
            raise ValueError(f"a finished task's id is already in the ledger ({_first_line(exc)})") from exc
        if self._totals is not None:
            self._totals = (self._totals[0] + len(rows), self._totals[1] + added)
        self._retain(keep=values[-1]["id"])

    # ------------------------------------------------------------------ retention

    def _retain(self, keep: str | None, force: bool = False) -> None:
        """Retention after a result is committed, in SQL: while more than ``retain_tasks``
        finished tasks are stored or their answers take more than ``retain_bytes``, the task
        that finished longest ago is deleted (never ``keep``, the one just finished; never an
        unfinished one). Within the limits as last counted (and counted less than
        RETENTION_CHECK_S ago: other replicas finish tasks too) nothing is opened. A failure
        loses nothing: reported, retried after the next finish."""
        totals = self._totals
        if (not force and totals is not None and totals[0] <= self.retain_tasks and totals[1] <= self.retain_bytes
                and time.monotonic() - self._retain_checked < RETENTION_CHECK_S):
            return
        try:
            with self._conn("apply retention") as conn:
                self._apply_retention(conn, keep)
            self._retain_checked = time.monotonic()
        except LedgerUnavailable as exc:
            self._totals = None
            log.warning("task ledger retention skipped: %s", exc)

    def _apply_retention(self, conn: psycopg.Connection, keep: str | None) -> int:
        if not conn.execute("SELECT pg_try_advisory_xact_lock(%s)", (RETENTION_LOCK,)).fetchone()[0]:
            return 0  # another replica applies it right now
        count, stored = conn.execute(
            "SELECT count(*), COALESCE(sum(answer_bytes), 0) FROM rev88_tasks WHERE finished_at IS NOT NULL"
        ).fetchone()
        if count <= self.retain_tasks and stored <= self.retain_bytes:
            self._totals = (count, int(stored))
            return 0
        # row i of the finished tasks, oldest first (keep left out), is deleted while the tasks
        # after it would still be over a limit: a prefix of that order, as the SQLite ledger does
        deleted = conn.execute(
            "DELETE FROM rev88_tasks t USING ("
            "  SELECT id, row_number() OVER w AS i, sum(answer_bytes) OVER w - answer_bytes AS before"
            "  FROM rev88_tasks WHERE finished_at IS NOT NULL AND id IS DISTINCT FROM %(keep)s"
            "  WINDOW w AS (ORDER BY finished_at, id)) o"
            " WHERE t.id = o.id AND (%(count)s - (o.i - 1) > %(n)s OR %(stored)s - o.before > %(b)s)"
            " RETURNING t.answer_bytes",
            {"keep": keep, "count": count, "stored": stored, "n": self.retain_tasks, "b": self.retain_bytes},
        ).fetchall()
        self._totals = (count - len(deleted), int(stored) - sum(r[0] for r in deleted))
        return len(deleted)

    # ------------------------------------------------------------------ reads

    def load_upload(self, task_id: str) -> bytes:
        body = self.load_uploads([task_id]).get(task_id)
        if body is None:
            raise LedgerError(f"the upload of task {task_id} is missing: no row in rev88_task_inputs "
                              f"(task ledger PostgreSQL {self.path})")
        return body

    def load_uploads(self, task_ids: list[str]) -> dict[str, bytes]:
        """The stored npz of each task that has one (one query)."""
        if not task_ids:
            return {}
        rows = self._read(f"read the upload of {len(task_ids)} task(s)", lambda conn: conn.execute(
            "SELECT task_id, body FROM rev88_task_inputs WHERE task_id = ANY(%s)", (list(task_ids),),
            binary=True).fetchall())
        return {task_id: bytes(body) for task_id, body in rows}

    def queue_depth(self) -> dict[str, Any]:
        """The shared queue (asynchronous tasks of every replica): queued and not claimed,
        claimed and not yet started, running; the stored bytes of the waiting uploads; and per
        tenant ("" for the admin's and an open service's) its waiting and running tasks. One count
        for the whole deployment."""
        rows = self._read("count the shared queue", lambda conn: conn.execute(
            "SELECT COALESCE(options::json ->> 'owner', ''),"
            " count(*) FILTER (WHERE status = 'queued' AND lease_owner IS NULL),"
            " count(*) FILTER (WHERE status = 'queued' AND lease_owner IS NOT NULL),"
            " count(*) FILTER (WHERE status = 'running'),"
            " COALESCE(sum(body_bytes) FILTER (WHERE status = 'queued' AND has_input), 0),"
            " min(created_at) FILTER (WHERE status = 'queued' AND lease_owner IS NULL)"
            " FROM rev88_tasks WHERE status IN ('queued', 'running') AND mode = 'async' GROUP BY 1").fetchall())
        free = sum(r[1] for r in rows)
        claimed = sum(r[2] for r in rows)
        stats = {"queued": free + claimed, "unclaimed": free, "claimed": claimed, "running": sum(r[3] for r in rows),
                 "bytes": int(sum(r[4] for r in rows)), "at": time.time(),
                 "owners": {r[0]: {"queued": r[1] + r[2], "unclaimed": r[1], "running": r[3], "oldest": r[5]}
                            for r in rows}}
        self._queue_stats = stats
        return stats

    def counts(self) -> dict:
        """Tasks per status, stored answer and input bytes, the shared queue, the pool, schema."""
        def count(conn: psycopg.Connection) -> tuple:
            per_status = dict(conn.execute("SELECT status, count(*) FROM rev88_tasks GROUP BY status").fetchall())
            stored, json_bytes = conn.execute(
                "SELECT COALESCE(sum(answer_bytes), 0), COALESCE(sum(answer_json_bytes), 0) FROM rev88_tasks"
            ).fetchone()
            inputs, input_bytes = conn.execute(
                "SELECT count(*), COALESCE(sum(bytes), 0) FROM rev88_task_inputs").fetchone()
            version = conn.execute("SELECT max(version) FROM rev88_schema").fetchone()[0]
            db_bytes = conn.execute("SELECT pg_total_relation_size('rev88_tasks')"
                                    " + pg_total_relation_size('rev88_task_inputs')").fetchone()[0]
            return per_status, stored, json_bytes, inputs, input_bytes, version, db_bytes

        per_status, stored, json_bytes, inputs, input_bytes, version, db_bytes = self._read("count tasks", count)
        queue = self.queue_depth()
        return {
            "tasks": {name: per_status.get(name, 0) for name in STATUSES},
            "total": sum(per_status.values()),
            "answer_bytes": int(stored),
            "answer_json_bytes": int(json_bytes),
            "db_bytes": int(db_bytes),
            "upload_files": int(inputs),
            "upload_bytes": int(input_bytes),
            "schema_version": version,
            "path": self.path,
            "retain_tasks": self.retain_tasks,
            "retain_bytes": self.retain_bytes,
            **self.stats(),
            "queue": queue,
        }

    def stats(self) -> dict:
        """What /metrics and /health show without a query: engine, pool, leases held, the
        shared queue as last counted."""
        pool = self._pool
        raw = pool.get_stats() if pool is not None else {}
        size = raw.get("pool_size", 0)
        idle = raw.get("pool_available", 0)
        return {
            "engine": self.engine,
            "owner": self.owner,
            "leases_held": len(self._held),
            "lease_s": self.lease_s,
            "lease_attempts": self.lease_attempts,
            "pool": {"max": self.pool_size, "open": size, "in_use": max(0, size - idle), "idle": idle,
                     "waiting": raw.get("requests_waiting", 0), "timeout_s": self.timeout_s,
                     "last_connect_error": self._connect_error},
            "queue": self._queue_stats,
        }

    # ------------------------------------------------------------------ claims and leases

    def claim(self, limit: int, picks: list[tuple[str, int]] | None = None) -> list[Claim]:
        """Up to ``limit`` queued asynchronous tasks leased to this replica (``FOR UPDATE SKIP
        LOCKED``: replicas claiming at once never take the same task): ``picks`` [(tenant, n)] --
        each tenant's ``n`` oldest, as this replica's fair share chose them (app/runtime/
        fair_share.py, by the feeder; key ids, "" for the admin's and an open service's) --, then,
        up to ``limit``, the oldest of any tenant (None: only those). A tenant whose key's
        max_running is reached by its claimed and running tasks, on every replica, waits."""
        if limit < 1:
            return []
        picks = [(t, n) for t, n in picks or [] if n > 0]
        rows: list = []
        with self._conn(f"claim up to {limit} queued task(s)", transaction=False) as conn:
            if picks:
                rows += self._claim_rows(conn, CLAIM_PICKS, {
                    "tenants": [t for t, _ in picks], "counts": [min(int(n), limit) for _, n in picks]})
            if len(rows) < limit:
                rows += self._claim_rows(conn, CLAIM_OLDEST, {"n": limit - len(rows)})
        claims = sorted((Claim(_record(row, False), row[SUMMARY_WIDTH]) for row in rows[:limit]),
                        key=lambda c: (c.record.created_at, c.record.id))  # (t.claims after them)
        for c in claims:
            self._hold(c.record.id, c.epoch)
        return claims

    def _claim_rows(self, conn: psycopg.Connection, chosen: str, params: dict) -> list:
        return conn.execute(
            f"UPDATE rev88_tasks t SET lease_owner = %(owner)s, lease_expires_at = {NOW} + %(lease)s,"
            f" claims = t.claims + 1 FROM ({chosen}) c"
            f" WHERE t.id = c.id RETURNING {T_SUMMARY_COLUMNS}, t.claims",
            {"owner": self.owner, "lease": self.lease_s, **params}, binary=True).fetchall()

    def renew(self, attempts: dict[str, int] | None = None) -> Renewal:
        """Extend by ``lease_s`` (server clock) the leases of ``attempts`` (task id -> the epoch
        its attempt here runs under: the Feeder's live attempts), on the upkeep connection;
        default every lease this replica holds. A held lease not among ``attempts`` has no live
        attempt here: it is dropped (not renewed: it is released, or expires and is reaped).
        Leases that no longer carry this replica's owner and epoch are dropped and reported lost."""
        with self._held_lock:
            if attempts is None:
                snapshot = dict(self._held)
            else:
                snapshot = dict(attempts)
                for task_id in [t for t in self._held if t not in snapshot]:
                    del self._held[task_id]
        if not snapshot:
            return Renewal([], [], [])
        ids = list(snapshot)
        with self.upkeep(f"renew {len(ids)} lease(s)") as conn:
            rows = conn.execute(
                f"UPDATE rev88_tasks t SET lease_expires_at = {NOW} + %(lease)s"
                " FROM unnest(%(ids)s::text[], %(epochs)s::int[]) AS h(id, epoch)"
                " WHERE t.id = h.id AND t.claims = h.epoch AND t.lease_owner = %(owner)s"
                " AND t.status IN ('queued', 'running')"
                " RETURNING t.id, t.cancel_requested_at IS NOT NULL",
                {"lease": self.lease_s, "ids": ids, "epochs": [snapshot[i] for i in ids], "owner": self.owner},
            ).fetchall()
        renewed = {task_id for task_id, _ in rows}
        lost = []
        with self._held_lock:
            for task_id, epoch in snapshot.items():
                if task_id in renewed:
                    continue
                if self._held.get(task_id) == epoch:
                    del self._held[task_id]
                    lost.append(task_id)  # still held under that epoch here, not renewed: lost
                elif attempts is not None:
                    # an attempt not renewed (finished here meanwhile, or its lease reaped, or the
                    # task claimed again): the caller, which knows whether it still runs, decides
                    lost.append(task_id)
        return Renewal(sorted(renewed), lost, sorted(task_id for task_id, cancel in rows if cancel))

    def release(self, task_ids: list[str]) -> list[str]:
        """Give back this replica's leases of unfinished asynchronous tasks (a drain): queued
        again at once for any replica, without counting as an expiry. Returns the ids released."""
        if not task_ids:
            return []
        with self._conn(f"release {len(task_ids)} lease(s)") as conn:
            rows = conn.execute(
                "UPDATE rev88_tasks SET status = 'queued', lease_owner = NULL, lease_expires_at = NULL"
                " WHERE id = ANY(%s) AND lease_owner = %s AND status IN ('queued', 'running') AND mode = 'async'"
                " RETURNING id", (list(task_ids), self.owner)).fetchall()
            if rows:
                conn.execute("SELECT pg_notify(%s, '')", (CHANNEL_QUEUED,))
        for task_id in task_ids:
            self._unhold(task_id)
        return [r[0] for r in rows]

    def reap(self) -> dict[str, int]:
        """Every lease past its expiry (server clock), any replica's: the asynchronous task is
        queued again, or failed once its lease has expired ``lease_attempts`` times; a
        synchronous one is failed; one whose cancellation was requested is cancelled."""
        counts = {"requeued": 0, "failed": 0, "cancelled": 0}
        finished, requeued = [], []
        with self._conn("reap expired leases") as conn:
            rows = conn.execute(
                f"SELECT id, mode, lease_owner, expiries, cancel_requested_at IS NOT NULL FROM rev88_tasks"
                f" WHERE status IN ('queued', 'running') AND lease_owner IS NOT NULL AND lease_expires_at < {NOW}"
                f" ORDER BY lease_expires_at LIMIT {REAP_BATCH} FOR UPDATE SKIP LOCKED").fetchall()
            for task_id, mode, owner, expiries, cancel in rows:
                if cancel:
                    status, error = "cancelled", {"status": 409, "error": (
                        f"cancelled (POST /tasks/{task_id}/cancel); replica {owner}, which held it, stopped "
                        "renewing its lease, so it was recorded cancelled by another replica")}
                elif mode == "sync":
                    status, error = "failed", {"status": 503, "error": (
                        f"replica {owner} stopped while running this synchronous task (its lease expired); its "
                        "client's connection went with it; submit the task again")}
                elif expiries + 1 >= self.lease_attempts:
                    status, error = "failed", {"status": 500, "error": (
                        f"given up: the task's lease expired {expiries + 1} times (REV88_LEASE_ATTEMPTS = "
                        f"{self.lease_attempts}): each replica that claimed it stopped or lost the database "
                        f"before it finished (the last: {owner})")}
                else:
                    requeued.append(task_id)
                    continue
                finished.append((status, _dumps(error), task_id))
                counts[status] += 1
            with conn.cursor() as cur:
                if requeued:
                    cur.execute("UPDATE rev88_tasks SET status = 'queued', lease_owner = NULL, lease_expires_at = NULL,"
                                " expiries = expiries + 1 WHERE id = ANY(%s)", (requeued,))
                    cur.execute("SELECT pg_notify(%s, '')", (CHANNEL_QUEUED,))
                if finished:
                    cur.executemany(f"UPDATE rev88_tasks SET status = %s, finished_at = {NOW}, error = %s,"
                                    " has_input = false, lease_owner = NULL, lease_expires_at = NULL,"
                                    " expiries = expiries + 1 WHERE id = %s", finished)
                    cur.execute("DELETE FROM rev88_task_inputs WHERE task_id = ANY(%s)", ([f[2] for f in finished],))
        counts["requeued"] = len(requeued)
        for task_id in requeued + [f[2] for f in finished]:
            self._unhold(task_id)  # one of this replica's own, if it could not renew in time
        if rows:
            log.warning("reaped expired leases", extra={**counts, "tasks": [r[0] for r in rows]})
        if finished:
            self._totals = None
            self._retain(keep=None, force=True)
        return counts

    def request_cancel(self, task_id: str) -> tuple[str, TaskRecord | None]:
        """A cancel from any replica. A task nobody holds (queued, not claimed) is cancelled
        here: ("cancelled", its record). A held one gets ``cancel_requested_at`` and a
        notification for its holder, which stops it and records it cancelled: ("requested",
        None); should the holder be gone, the reaper records it cancelled once its lease expires.
        KeyError for an unknown task, AlreadyFinished for a finished one."""
        with self._conn(f"cancel task {task_id}") as conn:
            row = self._locked(conn, [task_id]).get(task_id)
            if row is None:
                raise KeyError(task_id)
            if row[1] in FINISHED:
                raise AlreadyFinished(self._summary(conn, task_id))
            if row[3] is None:
                done = conn.execute(
                    f"UPDATE rev88_tasks SET status = 'cancelled', finished_at = {NOW}, error = %s,"
                    f" has_input = false WHERE id = %s RETURNING {SUMMARY_COLUMNS}",
                    (_dumps({"status": 409, "error": "cancelled before it ran"}), task_id)).fetchone()
                conn.execute("DELETE FROM rev88_task_inputs WHERE task_id = %s", (task_id,))
                return "cancelled", _record(done, False)
            conn.execute(f"UPDATE rev88_tasks SET cancel_requested_at = COALESCE(cancel_requested_at, {NOW})"
                         " WHERE id = %s", (task_id,))
            conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL_CANCEL, task_id))
        return "requested", None

    def listen(self, on_notify: Callable[[str, str], None], stop: threading.Event,
               reconnect_s: float = 1.0) -> None:
        """Blocking (run it in a thread of its own until ``stop`` is set): LISTEN for the wake-up
        channels on a connection of its own and call ``on_notify(channel, payload)`` for each
        notification, and ``on_notify("connected", "")`` after every (re)connection (whatever was
        sent meanwhile is lost: the caller polls then). Reconnects by itself."""
        while not stop.is_set():
            try:
                with psycopg.connect(self.url, autocommit=True, **self._options()) as conn:
                    conn.execute(f"LISTEN {CHANNEL_QUEUED}")
                    conn.execute(f"LISTEN {CHANNEL_CANCEL}")
                    on_notify("connected", "")
                    while not stop.is_set():
                        for note in conn.notifies(timeout=0.5):
                            on_notify(note.channel, note.payload)
            except psycopg.Error as exc:
                if not stop.is_set():
                    log.warning("task ledger notifications lost; reconnecting", extra={"error": _first_line(exc)})
                    stop.wait(reconnect_s)

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        with self._upkeep_lock:
            upkeep, self._upkeep_conn = self._upkeep_conn, None
        if upkeep is not None:
            with contextlib.suppress(Exception):
                upkeep.close()
        pool, self._pool = self._pool, None
        if pool is not None:
            with contextlib.suppress(Exception):
                pool.close(timeout=5.0)

    def __enter__(self) -> PostgresLedger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

