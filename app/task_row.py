"""The task row, defined once: its columns, their kinds (how they are stored and decoded), and what
the API shows of them.

Everything else derives from ``TASK_ROW``:

    TaskRecord            the record both ledgers return (a dataclass of the record columns)
    the SQL column lists  app/ledger/rows.py: what lists read, what a full read adds
    the row mapper        app/ledger/rows.py ``record_from_row``: one for both engines
    the writes            app/ledger/task_writes.py: the INSERTs and the outcome's UPDATE of both
                          engines, from each column's ``writes``
    TaskSummary           app/models.py: the API model of a listed task (the ``api`` columns)
    the schemas           tests/test_task_row.py: each engine's table (its migrations:
                          app/ledger/migrations/sqlite/ and app/ledger/migrations/) has exactly
                          these columns, of these kinds, and its engine's own

Adding a column: a ``Column`` here, one migration per engine, and nothing else (the API shows it
when it has an ``api`` annotation; a record field gets its default until it is written).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

Status = Literal["queued", "running", "succeeded", "failed", "cancelled"]
STATUSES: tuple[str, ...] = ("queued", "running", "succeeded", "failed", "cancelled")
FINISHED: tuple[str, ...] = ("succeeded", "failed", "cancelled")
UNFINISHED: tuple[str, ...] = ("queued", "running")
KINDS: tuple[str, ...] = ("task", "measure")
MODES: tuple[str, ...] = ("sync", "async")

class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()  # a column with no default: every record and summary has it
# how a kind is stored: SQLite's declared type, PostgreSQL's data_type (information_schema)
KIND_TYPES = {
    "text": ("TEXT", "text"), "real": ("REAL", "double precision"), "integer": ("INTEGER", "integer"),
    "bigint": ("INTEGER", "bigint"), "json": ("TEXT", "text"), "blob": ("BLOB", "bytea"),
    "flag": ("INTEGER", "boolean"),
}


@dataclasses.dataclass(frozen=True)
class Column:
    name: str
    kind: str  # a key of KIND_TYPES; "json" columns hold canonical JSON text, decoded into the record
    api: Any = None  # its annotation in the API's task summary (None: not shown there)
    default: Any = REQUIRED
    description: str | None = None
    record: bool = True  # a field of TaskRecord
    listed: bool = True  # read by lists and summaries (False: read only with the answer, or never)
    engine: str | None = None  # only this engine's table has it (its own bookkeeping)
    # the writes that set it (app/ledger/task_writes.py generates their statements): "new" (a task
    # recorded queued), "outcome" (its outcome recorded), "finished" (a task recorded finished, whole)
    writes: tuple[str, ...] = ()


NEW, OUTCOME, WHOLE = ("new",), ("outcome",), ("finished",)


TASK_ROW: tuple[Column, ...] = (
    Column("id", "text", str, writes=NEW + WHOLE),
    Column("status", "text", Status, writes=NEW + OUTCOME + WHOLE),
    Column("kind", "text", Literal["task", "measure"], writes=NEW + WHOLE),
    Column("mode", "text", Literal["sync", "async"], writes=NEW + WHOLE),
    Column("created_at", "real", float, description="unix seconds", writes=NEW + WHOLE),
    Column("started_at", "real", float | None, None, writes=WHOLE),
    Column("finished_at", "real", float | None, None, writes=OUTCOME + WHOLE),
    Column("attempts", "integer", int, 0, "runs started; 2 or more: run again after a restart", writes=WHOLE),
    Column("backend", "text", str, writes=NEW + WHOLE),
    Column("config", "json", dict[str, Any], writes=NEW + WHOLE),
    Column("options", "json", dict[str, Any], writes=NEW + WHOLE),
    Column("train_count", "integer", int, writes=NEW + WHOLE),
    Column("test_count", "integer", int, writes=NEW + WHOLE),
    Column("input_hashes", "json", dict[str, str] | None, None, writes=NEW + OUTCOME + WHOLE),
    Column("body_sha256", "text", str | None, None,
           "SHA-256 of the uploaded body; null for a synchronous task sent without an Idempotency-Key "
           "(not hashed: input_hashes identify its arrays)", writes=NEW + WHOLE),
    Column("body_bytes", "bigint", int, writes=NEW + WHOLE),
    Column("idempotency_key", "text", str | None, None, writes=NEW),
    Column("device", "text", str | None, None, writes=WHOLE),
    Column("error", "json", None, None, "failed or cancelled: {status, error, ...}", writes=OUTCOME + WHOLE),
    Column("predictions_sha256", "text", str | None, None, writes=OUTCOME + WHOLE),
    Column("run_ms", "real", float | None, None, writes=OUTCOME + WHOLE),
    Column("energy_j", "real", float | None, None, "the answer's energy.gross_j (null where it has none)",
           writes=OUTCOME + WHOLE),
    Column("answer_bytes", "integer", None, 0, "the stored (compressed) answer's size", writes=OUTCOME + WHOLE),
    # the answer itself: stored compressed (its codec beside it), decoded into the record when asked for
    Column("answer", "blob", None, None, listed=False, writes=OUTCOME + WHOLE),
    Column("answer_codec", "text", None, None, record=False, listed=False, writes=OUTCOME + WHOLE),
    Column("answer_json_bytes", "integer", None, 0, record=False, listed=False, writes=OUTCOME + WHOLE),
    # each engine's own bookkeeping
    Column("has_upload", "flag", record=False, listed=False, default=0, engine="sqlite", writes=NEW + OUTCOME),
    Column("has_input", "flag", record=False, listed=False, default=False, engine="postgresql",
           writes=NEW + OUTCOME),
    Column("lease_owner", "text", record=False, listed=False, default=None, engine="postgresql", writes=NEW + OUTCOME),
    Column("lease_expires_at", "real", record=False, listed=False, default=None, engine="postgresql",
           writes=NEW + OUTCOME),
    Column("claims", "integer", record=False, listed=False, default=0, engine="postgresql", writes=NEW),
    Column("expiries", "integer", record=False, listed=False, default=0, engine="postgresql"),
    Column("cancel_requested_at", "real", record=False, listed=False, default=None, engine="postgresql"),
)

RECORD_COLUMNS = tuple(c for c in TASK_ROW if c.record)
LISTED_COLUMNS = tuple(c for c in TASK_ROW if c.listed)  # what lists read, in this order
API_COLUMNS = tuple(c for c in TASK_ROW if c.api is not None)


def columns_of(engine: str) -> tuple[Column, ...]:
    """The columns of ``engine``'s task table ("sqlite" or "postgresql")."""
    return tuple(c for c in TASK_ROW if c.engine in (None, engine))


def _record_class() -> type:
    fields = [(c.name, Any, dataclasses.field(default=None if c.default is REQUIRED else c.default))
              for c in RECORD_COLUMNS]

    def finished(self) -> bool:
        return self.status in FINISHED

    def summary(self) -> dict:
        """JSON-able, without the answer or error (lists, 202 Accepted): the API's columns."""
        return {c.name: getattr(self, c.name) for c in API_COLUMNS}

    def document(self) -> dict:
        """JSON-able status document: the summary, plus the answer (succeeded) or the error."""
        doc = self.summary()
        doc["answer"] = self.answer
        doc["error"] = self.error
        return doc

    cls = dataclasses.make_dataclass(
        "TaskRecord", fields, kw_only=True,
        namespace={"finished": property(finished), "summary": summary, "document": document,
                   "__doc__": "A task as a ledger holds it: a field per record column of TASK_ROW "
                              "(``answer`` decoded, None unless read with it)."})
    cls.__module__ = __name__
    return cls


TaskRecord = _record_class()
