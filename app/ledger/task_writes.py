"""The writes both task ledgers make to the task row, generated from its one definition (TASK_ROW,
each column's ``writes``), as app/ledger/task_reads.py's reads are: which columns a write sets, in
which order, their values built once for both engines. An engine's statement adds only what is its
own -- its clock, its lease fence, its bookkeeping -- through ``given``: a column's SQL expression in
place of a plain parameter ("{}" in it stands for the parameter's mark; without one, the column
takes no parameter).

    new        a task recorded queued (``create``, ``create_many``)
    outcome    its outcome recorded (``finish``, ``finish_many``: the UPDATE's assignments)
    finished   a task that ran and finished without a record before, recorded whole (``add_finished``)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..task_row import TASK_ROW
from .rows import answer_columns, dumps, encode_answer

WRITES = ("new", "outcome", "finished")


def columns(write: str, engine: str) -> tuple[str, ...]:
    """The columns ``write`` sets on ``engine``'s table, in the row's order."""
    if write not in WRITES:
        raise ValueError(f"unknown write {write!r}: one of {', '.join(WRITES)}")
    return tuple(c.name for c in TASK_ROW if write in c.writes and c.engine in (None, engine))


@dataclasses.dataclass(frozen=True)
class Statement:
    sql: str  # the column list and its values (an INSERT), or the assignments (an UPDATE's SET)
    names: tuple[str, ...]  # the columns whose values it takes as parameters, in order

    def values(self, row: dict[str, Any]) -> tuple:
        """The positional parameters for ``row`` (a value per column name)."""
        return tuple(row[name] for name in self.names)


def _parts(write: str, engine: str, mark: Callable[[str], str],
           given: dict[str, str] | None) -> tuple[tuple[str, ...], list[str], tuple[str, ...]]:
    given = dict(given or {})
    names = columns(write, engine)
    unknown = set(given) - set(names)
    if unknown:
        raise ValueError(f"the {write!r} write sets no column {', '.join(sorted(unknown))} on {engine}")
    expressions, params = [], []
    for name in names:
        expression = given.get(name, "{}")
        if "{}" in expression:
            params.append(name)
        expressions.append(expression.replace("{}", mark(name)))
    return names, expressions, tuple(params)


def insert(table: str, write: str, engine: str, mark: Callable[[str], str],
           given: dict[str, str] | None = None) -> Statement:
    """``INSERT INTO table (columns) VALUES (...)`` of ``write`` (``new`` or ``finished``)."""
    names, expressions, params = _parts(write, engine, mark, given)
    return Statement(f"INSERT INTO {table} ({', '.join(names)}) VALUES ({', '.join(expressions)})", params)


def assignments(write: str, engine: str, mark: Callable[[str], str],
                given: dict[str, str] | None = None) -> Statement:
    """``column = value, ...`` of ``write`` (``outcome``), for an UPDATE's SET."""
    names, expressions, params = _parts(write, engine, mark, given)
    return Statement(", ".join(f"{name} = {e}" for name, e in zip(names, expressions)), params)


# how each engine marks a parameter: SQLite's "?"; psycopg's "%s" (binary "%b" for the answer's
# bytes), by position or by name
def sqlite_mark(name: str) -> str:
    return "?"


def pg_mark(name: str) -> str:
    return "%b" if name == "answer" else "%s"


def pg_named_mark(name: str) -> str:
    return f"%({name})b" if name == "answer" else f"%({name})s"


def _json(value: Any) -> str | None:
    return None if value is None else dumps(value)


def new_row(task_id: str, kind: str, mode: str, backend: str, config: dict, options: dict, train_count: int,
            test_count: int, input_hashes: dict | None, body_sha256: str | None, body_bytes: int,
            idempotency_key: str | None = None, created_at: float | None = None,
            encode: Callable[[Any], str | None] = _json) -> dict[str, Any]:
    """The values of a task recorded queued (its engine adds its own bookkeeping's). ``encode``:
    its JSON columns' encoder (``new_rows`` passes one that remembers)."""
    return {"id": task_id, "status": "queued", "kind": kind, "mode": mode, "created_at": created_at,
            "backend": backend, "config": encode(config), "options": encode(options), "train_count": int(train_count),
            "test_count": int(test_count), "input_hashes": encode(input_hashes), "body_sha256": body_sha256,
            "body_bytes": int(body_bytes), "idempotency_key": idempotency_key}


def new_rows(tasks: list[dict], created_at: float | None = None) -> list[dict[str, Any]]:
    """``new_row`` for many tasks (``create_many``'s keyword dicts): a sweep's cells share their
    options and input hashes, so a flat JSON value equal to one already encoded in this batch is
    not encoded again (docs/performance.md)."""
    encode = _Remembered()
    return [new_row(t["task_id"], t["kind"], t["mode"], t["backend"], t["config"], t["options"], t["train_count"],
                    t["test_count"], t.get("input_hashes"), t["body_sha256"], t["body_bytes"],
                    created_at=created_at, encode=encode) for t in tasks]


_SCALARS = (str, int, float, bool, type(None))


class _Remembered:
    """``_json``, remembering the text of each flat dict (every value a scalar) it has encoded: the
    key holds each value's type, so that 1, 1.0 and True are three values, as JSON has them."""

    def __init__(self) -> None:
        self.texts: dict[tuple, str | None] = {}

    def __call__(self, value: Any) -> str | None:
        if type(value) is not dict or not all(type(v) in _SCALARS for v in value.values()):
            return _json(value)
        key = tuple((k, type(v), v) for k, v in value.items())
        text = self.texts.get(key)
        if text is None:
            text = self.texts[key] = _json(value)
        return text


def outcome_row(status: str, answer: dict | None, error: dict | None, answer_json: bytes | None,
                input_hashes: dict | None, finished_at: float | None = None) -> dict[str, Any]:
    """The values of an outcome: the answer encoded (app/ledger/rows.py) and the columns lists read
    from it."""
    blob, json_bytes, codec = encode_answer(answer, answer_json) if answer is not None else (None, 0, None)
    sha, run_ms, energy_j = answer_columns(answer)
    return {"status": status, "finished_at": finished_at, "answer": blob, "answer_codec": codec,
            "answer_bytes": len(blob or b""), "answer_json_bytes": json_bytes, "error": _json(error),
            "predictions_sha256": sha, "run_ms": run_ms, "energy_j": energy_j, "input_hashes": _json(input_hashes)}


def finished_row(t: Any, finished_at: float | None = None) -> dict[str, Any]:
    """The values of a task that ran and finished without a record before (a ``FinishedTask``),
    whole; ``finished_at``: where its engine's clock does not set it."""
    hashes = t.input_hashes() if callable(t.input_hashes) else t.input_hashes
    row = new_row(t.task_id, t.kind, t.mode, t.backend, t.config, t.options, t.train_count, t.test_count, None,
                  t.body_sha256, t.body_bytes, created_at=t.created_at)
    row.update(outcome_row(t.status, t.answer, t.error, t.answer_json, hashes, finished_at))
    row.update(started_at=t.started_at, attempts=1 if t.started_at is not None else 0, device=t.device)
    return row
