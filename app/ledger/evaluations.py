"""Graded evaluations (issue #32): their definitions, their cells' task ids, and, once every cell
has finished, their result, kept beside the datasets and sweeps.

An evaluation's cells are ordinary tasks (their rows in the task ledger carry their state); this
table keeps what the evaluation adds: the draws and their datasets, and the graded result written
once when the last cell has finished (``finish``: the first writer wins, so replicas finishing at
once record one result). The leaderboard (``list``) sorts on columns copied out of the result.

    SQLite      table ``evaluations`` of ``<data_dir>/datasets.sqlite3`` (made here)
    PostgreSQL  ``rev88_evaluations`` (migration 0003), on the ledger's pool

One ``Evaluations`` store over either, through the database's public API (app/ledger/database.py).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import time
from typing import Any

from .database import Database, SideStore

# the leaderboard's orders: (SQL, what it means); NULLs (unfinished, not measured) last
SORTS = {
    "created": "created_at DESC, id DESC",
    "accuracy": "(mean_accuracy IS NULL), mean_accuracy DESC, created_at DESC, id DESC",
    "time": "(ms_per_task IS NULL), ms_per_task ASC, created_at DESC, id DESC",
    "energy": "(mj_per_task IS NULL), mj_per_task ASC, created_at DESC, id DESC",
}
COLUMNS = ("id, created_at, name, definition, cells, idempotency_key, cancelled_at, finished_at, status, result,"
           " mean_accuracy, ms_per_task, mj_per_task, owner")
SQLITE_TABLE = (
    "CREATE TABLE IF NOT EXISTS evaluations (id TEXT PRIMARY KEY, created_at REAL NOT NULL, name TEXT,"
    " definition TEXT NOT NULL, cells TEXT NOT NULL, idempotency_key TEXT UNIQUE, cancelled_at REAL,"
    " finished_at REAL, status TEXT NOT NULL, result TEXT, mean_accuracy REAL, ms_per_task REAL, mj_per_task REAL,"
    " owner TEXT)")


@dataclasses.dataclass(frozen=True)
class EvaluationRecord:
    id: str
    created_at: float
    name: str | None
    definition: dict[str, Any]  # as checked: draws (a sorted list), config, backend, measure, protocol
    cells: list[dict[str, Any]]  # per draw: draw, dataset, task_id (and measure_task_id when measured)
    idempotency_key: str | None = None
    cancelled_at: float | None = None
    finished_at: float | None = None
    status: str = "running"  # running until ``finish``: completed, failed or cancelled
    result: dict[str, Any] | None = None
    mean_accuracy: float | None = None
    ms_per_task: float | None = None
    mj_per_task: float | None = None
    owner: str | None = None  # the tenant whose key made it (None: the admin, or an open service)


def record_of(row) -> EvaluationRecord:
    (eid, created, name, definition, cells, key, cancelled, finished, status, result, acc, ms, mj, owner) = row
    return EvaluationRecord(
        id=eid, created_at=float(created), name=name, definition=json.loads(definition), cells=json.loads(cells),
        idempotency_key=key, cancelled_at=None if cancelled is None else float(cancelled),
        finished_at=None if finished is None else float(finished), status=status,
        result=None if result is None else json.loads(result), mean_accuracy=acc, ms_per_task=ms, mj_per_task=mj,
        owner=owner)


def encode_cursor(sort: str, offset: int) -> str:
    return base64.urlsafe_b64encode(json.dumps([sort, offset]).encode()).decode().rstrip("=")


def decode_cursor(cursor: str, sort: str) -> int:
    try:
        given, offset = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        offset = int(offset)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"cursor {cursor!r} is not one this service gave (use next_cursor as it is)") from exc
    if given != sort or offset < 0:
        raise ValueError(f"cursor {cursor!r} belongs to another order (sort={given}); use it with that sort")
    return offset


class Evaluations(SideStore):
    """The evaluations, in SQL both engines take (``?`` placeholders; the database swaps them)."""

    tables = {"sqlite": "evaluations", "postgresql": "rev88_evaluations"}

    def __init__(self, db: Database) -> None:
        super().__init__(db)
        if db.engine == "sqlite":  # (PostgreSQL's table comes from its migrations)
            def create(conn):
                conn.execute(SQLITE_TABLE)
                if "owner" not in {row[1] for row in conn.execute("PRAGMA table_info(evaluations)")}:
                    conn.execute("ALTER TABLE evaluations ADD COLUMN owner TEXT")  # (a store made before issue #33)
            self._write("create the evaluations table", create)

    def create(self, record: EvaluationRecord) -> tuple[EvaluationRecord, bool]:
        """Record an evaluation; an Idempotency-Key recorded already: (that evaluation, False)."""

        def run(conn):
            inserted = conn.execute(self._sql(
                f"INSERT INTO {self.table} (id, created_at, name, definition, cells, idempotency_key, status, owner)"
                " VALUES (?, ?, ?, ?, ?, ?, 'running', ?) ON CONFLICT (idempotency_key) DO NOTHING"),
                (record.id, record.created_at, record.name, json.dumps(record.definition), json.dumps(record.cells),
                 record.idempotency_key, record.owner)).rowcount
            if inserted:
                return record, True
            row = conn.execute(self._sql(f"SELECT {COLUMNS} FROM {self.table} WHERE idempotency_key = ?"),
                               (record.idempotency_key,)).fetchone()  # (replicas sending one key at once: one row)
            return record_of(row), False

        return self._write(f"record evaluation {record.id}", run)

    def get(self, evaluation_id: str) -> EvaluationRecord | None:
        row = self._read(f"read evaluation {evaluation_id}", lambda conn: conn.execute(
            self._sql(f"SELECT {COLUMNS} FROM {self.table} WHERE id = ?"), (evaluation_id,)).fetchone())
        return None if row is None else record_of(row)

    def by_key(self, key: str) -> EvaluationRecord | None:
        row = self._read("read an evaluation by its Idempotency-Key", lambda conn: conn.execute(
            self._sql(f"SELECT {COLUMNS} FROM {self.table} WHERE idempotency_key = ?"), (key,)).fetchone())
        return None if row is None else record_of(row)

    def finish(self, evaluation_id: str, status: str, result: dict[str, Any], mean_accuracy: float | None,
               ms_per_task: float | None, mj_per_task: float | None) -> EvaluationRecord | None:
        """Write the result once (a result there already is kept); returns the stored record."""

        def run(conn):
            conn.execute(self._sql(f"UPDATE {self.table} SET status = ?, result = ?, finished_at = ?,"
                                   " mean_accuracy = ?, ms_per_task = ?, mj_per_task = ? WHERE id = ? AND result IS NULL"),
                         (status, json.dumps(result), time.time(), mean_accuracy, ms_per_task, mj_per_task,
                          evaluation_id))
            row = conn.execute(self._sql(f"SELECT {COLUMNS} FROM {self.table} WHERE id = ?"),
                               (evaluation_id,)).fetchone()
            return None if row is None else record_of(row)

        return self._write(f"record the result of evaluation {evaluation_id}", run)

    def cancel(self, evaluation_id: str) -> None:
        self._write(f"cancel evaluation {evaluation_id}", lambda conn: conn.execute(
            self._sql(f"UPDATE {self.table} SET cancelled_at = COALESCE(cancelled_at, ?) WHERE id = ?"),
            (time.time(), evaluation_id)))

    def unfinished(self) -> list[EvaluationRecord]:
        rows = self._read("list the unfinished evaluations", lambda conn: conn.execute(
            self._sql(f"SELECT {COLUMNS} FROM {self.table} WHERE result IS NULL ORDER BY created_at")).fetchall())
        return [record_of(r) for r in rows]

    def list(self, limit: int, cursor: str | None, sort: str = "created",
             owner: str | None = None) -> tuple[list[EvaluationRecord], str | None]:
        """One page in the order ``sort`` names (SORTS; ``owner``: its only); the next page's cursor, or None."""
        if sort not in SORTS:
            raise ValueError(f"sort {sort!r} is not known; one of {', '.join(SORTS)}")
        offset = 0 if cursor is None else decode_cursor(cursor, sort)
        where, args = ("WHERE owner = ? ", (owner,)) if owner is not None else ("", ())
        rows = self._read("list the evaluations", lambda conn: conn.execute(
            self._sql(f"SELECT {COLUMNS} FROM {self.table} {where}ORDER BY {SORTS[sort]} LIMIT ? OFFSET ?"),
            (*args, limit + 1, offset)).fetchall())
        records = [record_of(r) for r in rows]
        more = len(records) > limit
        return records[:limit], encode_cursor(sort, offset + limit) if more else None


def open_evaluations(datasets: Any) -> Evaluations:
    """The evaluations beside the dataset store (the same engine, the same database)."""
    return Evaluations(datasets.database)
