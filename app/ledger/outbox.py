"""The webhook outbox (issue #34): messages, their attempts, the tenants' signing secrets and the
URLs a receiver asked to stop (410), in the task ledger's own database, so that every replica
sees every message.

    SQLite      tables ``webhook_*`` of ``<data_dir>/ledger.sqlite3`` (the
                tasks' database: schema version 3, app/ledger/store.py)
    PostgreSQL  ``rev88_webhook_*`` (migration 0005), on the ledger's pool

Nothing lost. A message is written in the same transaction as the record it is about: a task's
with the task's row (``create``, ``create_many``, ``add_finished``: ``message_rows`` from the
task's ``options["webhook"]``), a sweep's or an evaluation's with its cells' rows. It waits
(``waiting``) until the event has happened in the committed state of that record -- a task
running or finished, a sweep or an evaluation complete -- and is then given its type and body
once (``promote``: ``pending``; the body never changes after, so every retry carries the same
id and the same bytes). A replica that records a task's end and is killed before sending
leaves a pending message any replica sends. Sending is claimed with a lease (``claim``): the
replica that holds it writes the attempt (``record``, fenced by the lease owner); a lease that
expires (its replica died mid-attempt) lets another replica claim the message again.

States: waiting -> pending -> delivered | failed (attempts exhausted) | stopped (410, or a URL
stopped before); waiting -> skipped (a ``started`` event of a task cancelled before it ran, or
a record deleted by retention before its event).
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any

from .database import SideStore

FINISHED = ("succeeded", "failed", "cancelled")
EVENTS = ("started", "completed")
SUBJECTS = ("task", "sweep", "evaluation")
SETTLED = ("delivered", "failed", "stopped", "skipped")

_TABLES = """
CREATE TABLE {p}webhook_messages (
    id text PRIMARY KEY,               -- msg_<hex>: the webhook-id header of every attempt
    owner text NOT NULL,               -- the tenant: a key id, or empty for admin and an open service
    subject_kind text NOT NULL,        -- task | sweep | evaluation
    subject_id text NOT NULL,
    event text NOT NULL,               -- started | completed
    url text NOT NULL,
    state text NOT NULL,               -- waiting | pending | delivered | failed | stopped | skipped
    type text,                         -- task.succeeded, ...: set with the body when the event happens
    body {blob},                       -- the JSON body, the same bytes on every attempt
    created_at {real} NOT NULL,
    ready_at {real},                   -- when the event happened (pending from then)
    next_at {real},                    -- the next attempt, while pending
    attempts integer NOT NULL DEFAULT 0,
    round_start integer NOT NULL DEFAULT 0,  -- attempts before the last redelivery: its schedule restarts
    lease_owner text,
    lease_expires_at {real},
    finished_at {real},
    last_error text,
    checked_at {real}                  -- when the state of a sweep or an evaluation was last looked at
);
CREATE INDEX {p}webhook_messages_state ON {p}webhook_messages (state, next_at);
CREATE INDEX {p}webhook_messages_subject ON {p}webhook_messages (subject_id);
CREATE TABLE {p}webhook_attempts (
    message_id text NOT NULL,
    n integer NOT NULL,                -- 1, 2, ...: every attempt, redeliveries included
    at {real} NOT NULL,
    url text NOT NULL,
    address text,                      -- the checked address the request went to
    status_code integer,
    duration_ms {real},
    error text,
    outcome text NOT NULL,             -- delivered | retry | failed | stopped
    next_at {real},
    replica text,
    PRIMARY KEY (message_id, n)
);
CREATE TABLE {p}webhook_secrets (
    owner text PRIMARY KEY,
    secret text NOT NULL,              -- whsec_...: signs (a shared secret, so kept as it is)
    previous_secret text,              -- the secret before the last rotation ...
    previous_until {real},             -- ... signing too until then
    created_at {real} NOT NULL,
    rotated_at {real}
);
CREATE TABLE {p}webhook_stopped (
    owner text NOT NULL,
    url text NOT NULL,
    at {real} NOT NULL,                -- when the 410 came
    message_id text,
    PRIMARY KEY (owner, url)
);
"""
SQLITE_SCHEMA = _TABLES.format(p="", blob="BLOB", real="REAL")
POSTGRES_SCHEMA = _TABLES.format(p="rev88_", blob="bytea", real="double precision")

_MESSAGE = ("id, owner, subject_kind, subject_id, event, url, state, type, body, created_at, ready_at, next_at,"
            " attempts, round_start, lease_owner, lease_expires_at, finished_at, last_error")
_INSERT = ("INSERT INTO {p}webhook_messages (id, owner, subject_kind, subject_id, event, url, state, created_at)"
           " VALUES (?, ?, ?, ?, ?, ?, 'waiting', ?)")


@dataclasses.dataclass
class Message:
    id: str
    owner: str
    subject_kind: str
    subject_id: str
    event: str
    url: str
    state: str
    type: str | None
    body: bytes | None
    created_at: float
    ready_at: float | None
    next_at: float | None
    attempts: int
    round_start: int
    lease_owner: str | None
    lease_expires_at: float | None
    finished_at: float | None
    last_error: str | None

    @property
    def round_attempts(self) -> int:
        """Attempts since the message became pending (or since its last redelivery)."""
        return self.attempts - self.round_start


def _message(row) -> Message:
    values = list(row)
    if values[8] is not None:
        values[8] = bytes(values[8])
    return Message(*values)


@dataclasses.dataclass
class Attempt:
    n: int
    at: float
    url: str
    address: str | None
    status_code: int | None
    duration_ms: float | None
    error: str | None
    outcome: str
    next_at: float | None
    replica: str | None

    def document(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex


def subscription(url: str, events: list[str]) -> dict[str, Any]:
    """What a task's options (or a sweep's, an evaluation's definition) keep of a webhook."""
    return {"url": url, "events": list(events)}


def message_rows(subject_kind: str, subject_id: str, webhook: dict[str, Any] | None, owner: str | None,
                 now: float | None = None) -> list[tuple]:
    """The outbox rows of a record's webhook (one per event asked for), for ``insert``."""
    if not webhook:
        return []
    now = time.time() if now is None else now
    return [(new_message_id(), owner or "", subject_kind, subject_id, event, webhook["url"], now)
            for event in webhook.get("events") or ["completed"]]


def task_rows(task_id: str, options: dict[str, Any] | None, now: float | None = None) -> list[tuple]:
    """A task's outbox rows, from its options (``webhook``, ``owner``)."""
    options = options or {}
    return message_rows("task", task_id, options.get("webhook"), options.get("owner"), now)


PREFIXES = {"sqlite": "", "postgresql": "rev88_"}  # the outbox's tables: {p}webhook_*
TASKS_TABLES = {"sqlite": "tasks", "postgresql": "rev88_tasks"}


def insert_messages(conn, rows: list[tuple], engine: str) -> None:
    """Inside a caller's transaction (the record's own, on ``engine``): the rows of ``message_rows``."""
    if rows:
        sql = _INSERT.replace("{p}", PREFIXES[engine])
        if engine == "postgresql":
            sql = sql.replace("?", "%s")
        conn.cursor().executemany(sql, rows)


class Outbox(SideStore):
    """The outbox, in SQL both engines take (``?`` placeholders and ``{p}`` for the tables' prefix).
    SQLite's own writes (promote, claim, attempts) commit without waiting for the disk
    (``durable=False``: they survive a crash of the process, not of the machine): one lost with the
    machine is a message promoted again from the same committed task, a lease taken again, or an
    attempt made again (at-least-once, as a receiver must expect anyway). The messages themselves
    are written in the tasks' synced transactions, and secrets and stopped URLs durably."""

    tables = TASKS_TABLES  # (the tasks its messages are about)

    @property
    def prefix(self) -> str:
        return PREFIXES[self.engine]

    @property
    def tasks_table(self) -> str:
        return self.table

    @property
    def skip_locked(self) -> str:
        return self.db.skip_locked

    def _sql(self, sql: str) -> str:
        return self.db.sql(sql.replace("{p}", self.prefix))

    # ------------------------------------------------------------------ events
    def due_tasks(self, limit: int) -> list[tuple]:
        """Waiting task messages whose event has happened (or whose task is gone), with the
        task's columns a body needs: (message id, event, task id, status, created_at, started_at,
        finished_at, predictions_sha256, run_ms, energy_j, error, backend, device, mode)."""
        sql = self._sql(
            "SELECT m.id, m.event, m.subject_id, t.status, t.created_at, t.started_at, t.finished_at,"
            " t.predictions_sha256, t.run_ms, t.energy_j, t.error, t.backend, t.device, t.mode"
            " FROM {p}webhook_messages m LEFT JOIN " + self.tasks_table + " t ON t.id = m.subject_id"
            " WHERE m.state = 'waiting' AND m.subject_kind = 'task' AND (t.id IS NULL"
            " OR t.status IN ('succeeded', 'failed', 'cancelled') OR (m.event = 'started' AND t.status = 'running'))"
            " ORDER BY m.created_at LIMIT ?")
        return self._read("read due webhook messages", lambda conn: list(conn.execute(sql, (limit,))))

    def waiting_others(self, limit: int, checked_before: float) -> list[tuple[str, str, str]]:
        """Waiting sweep and evaluation messages not looked at since ``checked_before``:
        (message id, subject kind, subject id); marked looked at now."""
        now = time.time()
        select = self._sql("SELECT id, subject_kind, subject_id FROM {p}webhook_messages WHERE state = 'waiting'"
                           " AND subject_kind <> 'task' AND (checked_at IS NULL OR checked_at < ?)"
                           " ORDER BY checked_at IS NOT NULL, checked_at LIMIT ?")
        mark = self._sql("UPDATE {p}webhook_messages SET checked_at = ? WHERE id = ?")

        rows = self._read("read waiting webhook messages",
                          lambda conn: [tuple(r) for r in conn.execute(select, (checked_before, limit))])
        if rows:  # (no write transaction when there is nothing to look at: the common case)
            self._write("mark waiting webhook messages",
                        lambda conn: conn.cursor().executemany(mark, [(now, r[0]) for r in rows]), durable=False)
        return rows

    def waiting_of(self, subject_id: str) -> list[str]:
        sql = self._sql("SELECT id FROM {p}webhook_messages WHERE subject_id = ? AND state = 'waiting'")
        return self._read("read webhook messages", lambda conn: [r[0] for r in conn.execute(sql, (subject_id,))])

    def promote(self, message_id: str, type_: str, body: bytes, when: float | None = None,
                delay_s: float = 0.0) -> bool:
        """The event happened (at ``when``): the message's type and body, fixed; pending, its
        first attempt ``delay_s`` from now. False when another replica did it first."""
        now = time.time()
        sql = self._sql("UPDATE {p}webhook_messages SET state = 'pending', type = ?, body = ?, ready_at = ?,"
                        " next_at = ? WHERE id = ? AND state = 'waiting'")
        return self._write(f"promote webhook message {message_id}", lambda conn: conn.execute(
            sql, (type_, body, now, now + delay_s, message_id)).rowcount == 1, durable=False)

    def promote_many(self, events: list[tuple[str, str, bytes, float]], delay_s: float = 0.0) -> int:
        """``promote`` for many (message id, type, body, when) in one transaction; returns how
        many this call promoted."""
        now = time.time()
        sql = self._sql("UPDATE {p}webhook_messages SET state = 'pending', type = ?, body = ?, ready_at = ?,"
                        " next_at = ? WHERE id = ? AND state = 'waiting'")

        def run(conn):
            return sum(conn.execute(sql, (t, b, now, now + delay_s, m)).rowcount for m, t, b, _ in events)

        return self._write(f"promote {len(events)} webhook message(s)", run, durable=False) if events else 0

    def skip(self, message_id: str, reason: str) -> None:
        sql = self._sql("UPDATE {p}webhook_messages SET state = 'skipped', last_error = ?, finished_at = ?"
                        " WHERE id = ? AND state = 'waiting'")
        self._write(f"skip webhook message {message_id}",
                    lambda conn: conn.execute(sql, (reason, time.time(), message_id)), durable=False)

    # ------------------------------------------------------------------ sending
    def claim(self, replica: str, limit: int, lease_s: float) -> list[Message]:
        """Up to ``limit`` pending messages due now, leased to ``replica`` for ``lease_s``."""
        now = time.time()
        sql = self._sql(
            "UPDATE {p}webhook_messages SET lease_owner = ?, lease_expires_at = ? WHERE id IN ("
            " SELECT id FROM {p}webhook_messages WHERE state = 'pending' AND next_at <= ?"
            " AND (lease_owner IS NULL OR lease_expires_at < ?) ORDER BY next_at LIMIT ?" + self.skip_locked + ")"
            " RETURNING " + _MESSAGE)
        return self._write("claim webhook messages", lambda conn: [
            _message(r) for r in conn.execute(sql, (replica, now + lease_s, now, now, limit))], durable=False)

    def record(self, message: Message, replica: str, attempt: Attempt, state: str) -> bool:
        """One attempt's outcome, under the lease (False: the lease was lost, nothing written).
        ``state``: pending (``attempt.next_at`` the next try), delivered, failed or stopped."""
        update = self._sql(
            "UPDATE {p}webhook_messages SET attempts = attempts + 1, state = ?, next_at = ?, lease_owner = NULL,"
            " lease_expires_at = NULL, finished_at = ?, last_error = ? WHERE id = ? AND lease_owner = ?"
            " AND attempts = ? RETURNING attempts")
        insert = self._sql(
            "INSERT INTO {p}webhook_attempts (message_id, n, at, url, address, status_code, duration_ms, error,"
            " outcome, next_at, replica) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")
        finished = None if state == "pending" else time.time()

        def run(conn):
            row = conn.execute(update, (state, attempt.next_at, finished, attempt.error, message.id, replica,
                                        message.attempts)).fetchone()
            if row is None:
                return False
            attempt.n = int(row[0])
            conn.execute(insert, (message.id, attempt.n, attempt.at, attempt.url, attempt.address,
                                  attempt.status_code, attempt.duration_ms, attempt.error, attempt.outcome,
                                  attempt.next_at, attempt.replica))
            return True

        return self._write(f"record webhook attempt of {message.id}", run, durable=False)

    # ------------------------------------------------------------------ reading, redelivering
    def messages_of(self, subject_id: str, owner: str | None = None) -> list[tuple[Message, list[Attempt]]]:
        """The subject's messages with their attempts; ``owner`` given: only that tenant's (None:
        every tenant's, the admin's view)."""
        mine = "" if owner is None else " AND owner = ?"
        args = (subject_id,) if owner is None else (subject_id, owner)
        messages = self._sql(f"SELECT {_MESSAGE} FROM {{p}}webhook_messages WHERE subject_id = ?{mine}"
                             " ORDER BY created_at, id")
        attempts = self._sql("SELECT n, at, url, address, status_code, duration_ms, error, outcome, next_at, replica"
                             " FROM {p}webhook_attempts WHERE message_id = ? ORDER BY n")

        def run(conn):
            out = []
            for row in list(conn.execute(messages, args)):
                m = _message(row)
                out.append((m, [Attempt(*a) for a in conn.execute(attempts, (m.id,))]))
            return out

        return self._read(f"read the webhook messages of {subject_id}", run)

    def redeliver(self, subject_id: str, owner: str | None = None) -> list[str]:
        """Every message of the subject whose event has happened (``owner`` given: that tenant's
        only): pending again now, its schedule from the start, its id and body unchanged. Returns
        their ids."""
        now = time.time()
        mine = "" if owner is None else " AND owner = ?"
        args = (now, subject_id) if owner is None else (now, subject_id, owner)
        sql = self._sql("UPDATE {p}webhook_messages SET state = 'pending', next_at = ?, round_start = attempts,"
                        " finished_at = NULL, lease_owner = NULL, lease_expires_at = NULL"
                        f" WHERE subject_id = ? AND body IS NOT NULL AND state <> 'skipped'{mine} RETURNING id")
        return self._write(f"redeliver the webhook messages of {subject_id}",
                           lambda conn: [r[0] for r in conn.execute(sql, args)])

    def stats(self) -> dict[str, Any]:
        """Messages by state, and the ready time of the oldest pending one (None: none pending)."""
        counts = self._sql("SELECT state, COUNT(*) FROM {p}webhook_messages GROUP BY state")
        oldest = self._sql("SELECT MIN(ready_at) FROM {p}webhook_messages WHERE state = 'pending'")

        def run(conn):
            return {"states": {s: int(n) for s, n in conn.execute(counts)},
                    "oldest_pending_at": conn.execute(oldest).fetchone()[0]}

        return self._read("count webhook messages", run)

    def prune(self, before: float) -> int:
        """Settled messages (and their attempts) settled before ``before``; returns how many."""
        ids = self._sql("SELECT id FROM {p}webhook_messages WHERE finished_at < ? AND state IN"
                        " ('delivered', 'failed', 'stopped', 'skipped') LIMIT 1000")
        drop_attempts = self._sql("DELETE FROM {p}webhook_attempts WHERE message_id = ?")
        drop = self._sql("DELETE FROM {p}webhook_messages WHERE id = ?")

        def run(conn):
            found = [(r[0],) for r in conn.execute(ids, (before,))]
            conn.cursor().executemany(drop_attempts, found)
            conn.cursor().executemany(drop, found)
            return len(found)

        return self._write("prune webhook messages", run)

    # ------------------------------------------------------------------ secrets, stopped URLs
    def secrets(self, owner: str, make: Any) -> tuple[str, str | None, float | None]:
        """(secret, previous secret, previous valid until) of the tenant; made (``make()``) on
        first use."""
        select = self._sql("SELECT secret, previous_secret, previous_until FROM {p}webhook_secrets WHERE owner = ?")
        row = self._read("read a webhook secret", lambda conn: conn.execute(select, (owner,)).fetchone())
        if row is not None:
            return tuple(row)
        insert = self._sql("INSERT INTO {p}webhook_secrets (owner, secret, created_at) VALUES (?, ?, ?)"
                           " ON CONFLICT (owner) DO NOTHING")
        self._write("make a webhook secret", lambda conn: conn.execute(insert, (owner, make(), time.time())))
        return tuple(self._read("read a webhook secret", lambda conn: conn.execute(select, (owner,)).fetchone()))

    def rotate(self, owner: str, new_secret: str, overlap_s: float, make: Any) -> tuple[str, str | None, float | None]:
        self.secrets(owner, make)  # (one to rotate)
        now = time.time()
        sql = self._sql("UPDATE {p}webhook_secrets SET previous_secret = secret, previous_until = ?, secret = ?,"
                        " rotated_at = ? WHERE owner = ?")
        self._write("rotate a webhook secret", lambda conn: conn.execute(sql, (now + overlap_s, new_secret, now, owner)))
        return self.secrets(owner, make)

    def stop(self, owner: str, url: str, message_id: str) -> None:
        sql = self._sql("INSERT INTO {p}webhook_stopped (owner, url, at, message_id) VALUES (?, ?, ?, ?)"
                        " ON CONFLICT (owner, url) DO NOTHING")
        self._write("stop a webhook URL", lambda conn: conn.execute(sql, (owner, url, time.time(), message_id)))

    def stopped(self, owner: str, url: str | None = None) -> list[dict[str, Any]]:
        sql = self._sql("SELECT url, at, message_id FROM {p}webhook_stopped WHERE owner = ?"
                        + (" AND url = ?" if url is not None else "") + " ORDER BY at")
        args = (owner,) if url is None else (owner, url)
        return self._read("read stopped webhook URLs", lambda conn: [
            {"url": u, "stopped_at": at, "message_id": m} for u, at, m in conn.execute(sql, args)])

    def resume(self, owner: str, url: str) -> bool:
        sql = self._sql("DELETE FROM {p}webhook_stopped WHERE owner = ? AND url = ?")
        return self._write("resume a webhook URL", lambda conn: conn.execute(sql, (owner, url)).rowcount > 0)


def open_outbox(ledger: Any) -> Outbox:
    """The outbox of the task ledger (the same engine, the same database)."""
    return Outbox(ledger.database)


def dumps_body(value: dict[str, Any]) -> bytes:
    """A message's body: compact JSON, UTF-8 (the signed bytes)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")
