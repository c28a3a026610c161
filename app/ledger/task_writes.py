"""The rows both task ledgers insert, generated from the row's one definition (app/task_row.py),
as their reads are (app/ledger/task_reads.py): the values of a new queued task and of a task
recorded once it has finished, by column, and the INSERT statement of any set of columns in an
engine's dialect. No column list is spelled anywhere else: a name that is not a column of the
engine's table is refused here, when the statement is made."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..task_row import columns_of
from .rows import dumps


@dataclasses.dataclass(frozen=True)
class WriteDialect:
    engine: str  # "sqlite" or "postgresql"
    table: str
    now: str  # the database's clock as a SQL expression (epoch seconds)

    def mark(self, name: str, named: bool) -> str:
        """A parameter's placeholder (PostgreSQL's binary one for the answer's blob)."""
        if self.engine == "sqlite":
            return f":{name}" if named else "?"
        kind = "b" if name == "answer" else "s"
        return f"%({name}){kind}" if named else f"%{kind}"


SQLITE = WriteDialect("sqlite", "tasks", "CAST(strftime('%s', 'now') AS REAL)")
POSTGRESQL = WriteDialect("postgresql", "rev88_tasks", "extract(epoch from clock_timestamp())")


def insert(dialect: WriteDialect, names: list[str] | tuple[str, ...], sql: Mapping[str, str] | None = None,
           named: bool = False) -> str:
    """``INSERT INTO <table> (names..., sql's names...) VALUES (placeholders..., sql's expressions...)``:
    ``names`` bound as parameters (positional in that order, or by name), ``sql`` as SQL expressions."""
    sql = dict(sql or {})
    known = {c.name for c in columns_of(dialect.engine)}
    unknown = [n for n in [*names, *sql] if n not in known]
    if unknown:
        raise ValueError(f"not columns of the {dialect.engine} task table: {', '.join(unknown)}")
    columns = ", ".join([*names, *sql])
    values = ", ".join([*(dialect.mark(n, named) for n in names), *sql.values()])
    return f"INSERT INTO {dialect.table} ({columns}) VALUES ({values})"


def queued_values(*, task_id: str, kind: str, mode: str, backend: str, config: dict, options: dict, train_count: int,
                  test_count: int, input_hashes: dict | None, body_sha256: str | None, body_bytes: int,
                  idempotency_key: str | None = None, **engine: Any) -> dict[str, Any]:
    """A new queued task's row by column (its JSON columns encoded), ``engine``: that engine's own
    bookkeeping columns (``has_upload``, ``lease_owner``, ...)."""
    return {"id": task_id, "status": "queued", "kind": kind, "mode": mode, "backend": backend,
            "config": dumps(config), "options": dumps(options), "train_count": int(train_count),
            "test_count": int(test_count), "input_hashes": None if input_hashes is None else dumps(input_hashes),
            "body_sha256": body_sha256, "body_bytes": int(body_bytes), "idempotency_key": idempotency_key, **engine}
