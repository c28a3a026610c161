"""The reads both task ledgers answer alike: one SQL text each, the engines differing only in
their dialect (``TaskReads.dialect``: the table's name, how an owner and a day are read) and in
how their database runs a query (app/ledger/database.py's public API)."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import math
from collections.abc import Iterator
from typing import Any

from ..task_row import STATUSES, TaskRecord
from .rows import ALL_COLUMNS, SUMMARY_COLUMNS, record_from_row

IN_CHUNK = 500  # ids per statement (SQLite's limit on a statement's parameters)


@dataclasses.dataclass(frozen=True)
class Dialect:
    table: str  # the task table
    owner: str  # a row's tenant: its options' "owner"
    day: str  # the UTC day (YYYY-MM-DD) of finished_at
    ids_any: bool  # ids as one array parameter (PostgreSQL's = ANY) rather than IN (?, ...)


SQLITE = Dialect("tasks", "json_extract(options, '$.owner')", "date(finished_at, 'unixepoch')", ids_any=False)
POSTGRESQL = Dialect("rev88_tasks", "(options::json ->> 'owner')",
                     "to_char(to_timestamp(finished_at) AT TIME ZONE 'UTC', 'YYYY-MM-DD')", ids_any=True)


def check_page(limit: int, status: str | None) -> None:
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be a positive integer, got {limit!r}")
    if status is not None and status not in STATUSES:
        raise ValueError(f"status must be one of {', '.join(STATUSES)}, got {status!r}")


def encode_cursor(created_at: float, task_id: str) -> str:
    raw = json.dumps([created_at, task_id], separators=(",", ":")).encode("utf-8")
    return base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


def decode_cursor(cursor: str) -> tuple[float, str]:
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        created_at, task_id = json.loads(base64.urlsafe_b64decode(padded.encode("ascii")))
        if isinstance(created_at, bool) or not isinstance(created_at, (int, float)) or not isinstance(task_id, str):
            raise ValueError
        if not math.isfinite(created_at):
            raise ValueError
    except (ValueError, TypeError, UnicodeError, binascii.Error):
        raise ValueError(
            f"bad cursor {cursor[:80]!r}: pass the next_cursor of a previous page unchanged"
        ) from None
    return float(created_at), task_id


class TaskReads:
    """A mixin of both ledgers: ``database`` (its public connection API) and ``dialect``."""

    database: Any
    dialect: Dialect

    def _rows(self, doing: str, sql: str, args: Any = ()) -> list:
        db = self.database
        return db.read(doing, lambda conn: db.query(conn, sql, args).fetchall())

    def _by_ids(self, ids: list[str]) -> Iterator[tuple[str, list]]:
        """(``id`` condition, its arguments) for ``ids``, in as many statements as the engine needs."""
        if self.dialect.ids_any:
            yield "id = ANY(?)", [list(ids)]
            return
        for i in range(0, len(ids), IN_CHUNK):
            part = list(ids[i : i + IN_CHUNK])
            yield f"id IN ({', '.join('?' * len(part))})", part

    def get(self, task_id: str) -> TaskRecord | None:
        rows = self._rows(f"read task {task_id}", f"SELECT {ALL_COLUMNS} FROM {self.dialect.table} WHERE id = ?",
                          (task_id,))
        return record_from_row(rows[0], True) if rows else None

    def get_many(self, task_ids: list[str], predictions: bool = True) -> dict[str, TaskRecord]:
        """The records (with answers) of those of ``task_ids`` the ledger has, by id
        (``predictions=False``: answers without their predictions where stored apart: rows.py)."""
        out: dict[str, TaskRecord] = {}
        for where, args in self._by_ids(task_ids) if task_ids else ():
            for row in self._rows(f"read {len(task_ids)} task(s)",
                                  f"SELECT {ALL_COLUMNS} FROM {self.dialect.table} WHERE {where}", args):
                out[row[0]] = record_from_row(row, True, predictions)
        return out

    def statuses(self, task_ids: list[str]) -> dict[str, str]:
        """The status of those of ``task_ids`` the ledger has, by id: the status column alone (the
        lists of sweeps and evaluations count their cells with it)."""
        out: dict[str, str] = {}
        for where, args in self._by_ids(task_ids) if task_ids else ():
            out.update(self._rows(f"read the status of {len(task_ids)} task(s)",
                                  f"SELECT id, status FROM {self.dialect.table} WHERE {where}", args))
        return out

    def list(self, limit: int = 50, cursor: str | None = None, status: str | None = None,
             owner: str | None = None) -> tuple[list[TaskRecord], str | None]:
        """Newest first (created_at, then id), keyset-paged; ``owner``: only that tenant's. Returns
        (records without their answers, the cursor of the next page or None at the end)."""
        check_page(limit, status)
        where, args = [], []
        if status is not None:
            where.append("status = ?")
            args.append(status)
        if owner is not None:
            where.append(f"{self.dialect.owner} = ?")
            args.append(owner)
        if cursor is not None:
            created_at, last_id = decode_cursor(cursor)
            where.append("(created_at, id) < (?, ?)")
            args += [created_at, last_id]
        sql = f"SELECT {SUMMARY_COLUMNS} FROM {self.dialect.table}"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY created_at DESC, id DESC LIMIT ?"
        args.append(limit + 1)
        rows = self._rows("list tasks", sql, args)
        records = [record_from_row(row, False) for row in rows[:limit]]
        next_cursor = None
        if len(rows) > limit:
            last = records[-1]
            next_cursor = encode_cursor(last.created_at, last.id)
        return records, next_cursor

    def usage(self, owner: str | None, since: float) -> list[tuple]:
        """(owner, UTC day, tasks finished, succeeded, run seconds, joules) per tenant and day,
        for tasks finished since ``since`` (``owner``: that tenant's only; None: every tenant's,
        the admin's and an open service's as owner None)."""
        d = self.dialect
        sql = (f"SELECT {d.owner} AS o, {d.day} AS day, count(*),"
               " sum(CASE WHEN status = 'succeeded' THEN 1 ELSE 0 END), COALESCE(sum(run_ms), 0) / 1000.0,"
               f" sum(energy_j) FROM {d.table} WHERE finished_at IS NOT NULL AND finished_at >= ?")
        args: list = [since]
        if owner is not None:
            sql += f" AND {d.owner} = ?"
            args.append(owner)
        sql += " GROUP BY o, day ORDER BY day, o"
        return [tuple(r) for r in self._rows("sum the tenants' usage", sql, args)]

    def count_unfinished(self, owner: str) -> int:
        """How many of the tenant's tasks are queued or running (its max_queued counts them)."""
        rows = self._rows("count a tenant's unfinished tasks",
                          f"SELECT count(*) FROM {self.dialect.table} WHERE status IN ('queued', 'running')"
                          f" AND {self.dialect.owner} = ?", (owner,))
        return int(rows[0][0])

    def unfinished(self) -> list[TaskRecord]:
        """Queued and running tasks, oldest first (every replica's, with a shared ledger)."""
        rows = self._rows("list unfinished tasks", f"SELECT {SUMMARY_COLUMNS} FROM {self.dialect.table}"
                          " WHERE status IN ('queued', 'running') ORDER BY created_at, id")
        return [record_from_row(row, False) for row in rows]
