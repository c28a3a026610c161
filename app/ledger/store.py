"""The task ledger: every task the service accepts, in an embedded SQLite database (issue #15).

Plain Python, no web code. One ``Ledger`` per replica, in ``REV88_DATA_DIR``:

    <data_dir>/ledger.sqlite3        the database (WAL mode, synchronous=FULL)
    <data_dir>/uploads/<id>.npz      the body of an asynchronous task until it finishes

A row records a task from the moment it is accepted (``queued``) through ``running`` to one of
the finished states (``succeeded``, ``failed``, ``cancelled``): its shape, config, backend,
options (whatever else re-running it needs), input hashes and, once done, the whole JSON answer
(stored as zlib-compressed JSON) or the error.

Durability. ``create(body=...)`` writes the upload (temp file, fsync, rename, fsync of the
folder) before it commits the row, and the commit itself is synchronous=FULL: once ``create``
has returned, a crash or ``kill -9`` loses neither. ``unfinished()`` lists what a restart must
re-queue. ``finish`` commits the result first and deletes the upload after, so a crash between
the two leaves at most an orphaned file, which the next open deletes.

Retention. After each ``finish`` (and at open), while more than ``retain_tasks`` finished tasks
are stored or their stored answers take more than ``retain_bytes``, the task that finished
longest ago is deleted. Queued and running tasks are never deleted, nor is the task that has
just finished (its result stays readable at least until the next finish).

Failures are never silent. Opening a database that is corrupt, newer than this code, or in a
folder that cannot be created or written raises ``LedgerError`` naming the file and the problem
(the service refuses to start). A write that fails at run time (disk full, I/O error) raises
``LedgerUnavailable``, which the service answers as a 503 naming it.

Schema. ``PRAGMA user_version`` holds the schema version; ``MIGRATIONS`` are applied in order,
each in one transaction together with its version bump.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from ..task_row import FINISHED, KINDS, MODES, STATUSES, UNFINISHED, TaskRecord  # noqa: F401 - (re-exported)
from .database import MIGRATIONS_DIR, SqliteDatabase, load_migrations
from .outbox import insert_messages, task_rows
from .rows import (  # noqa: F401 - (answer_columns: re-exported)
    ALL_COLUMNS,
    SUMMARY_COLUMNS,
    answer_columns,
    dumps,
    encode_answer,
    loads,
    record_from_row,
)
from .task_reads import SQLITE, TaskReads
from .task_writes import assignments, finished_row, insert, new_row, new_rows, outcome_row, sqlite_mark

# the task row's writes (app/ledger/task_writes.py): SQLite's own part is whether an upload is kept
_NEW = insert("tasks", "new", "sqlite", sqlite_mark)
_OUTCOME = assignments("outcome", "sqlite", sqlite_mark,
                       {"input_hashes": "COALESCE({}, input_hashes)", "has_upload": "0"})
_FINISHED = insert("tasks", "finished", "sqlite", sqlite_mark)

log = logging.getLogger("rev88." + __name__)

DB_NAME = "ledger.sqlite3"
UPLOADS = "uploads"
UPLOAD_SUFFIX = ".npz"
TMP_SUFFIX = ".tmp"

BUSY_TIMEOUT_MS = 10_000

# The schema's migrations, one file a version (PRAGMA user_version holds the applied one):
# app/ledger/migrations/sqlite/NNNN_name.sql; the task table's columns are app/task_row.py's.
MIGRATIONS: list[tuple[int, str]] = [(v, sql) for v, _, sql in load_migrations(MIGRATIONS_DIR / "sqlite")]
SCHEMA_VERSION: int = MIGRATIONS[-1][0]
assert [v for v, _ in MIGRATIONS] == list(range(1, len(MIGRATIONS) + 1)), "migrations must be numbered 1..N"

# What lists and recovery read, and a full read: app/ledger/rows.py (from app/task_row.py)
_SUMMARY_COLUMNS, _ALL_COLUMNS = SUMMARY_COLUMNS, ALL_COLUMNS


class LedgerError(Exception):
    """The ledger cannot be used: the message names the file and the problem."""


class LedgerUnavailable(LedgerError):
    """A read or write of the ledger failed at run time (disk full, I/O error, ...): answer 503.
    ``outcome_unknown``: a write whose COMMIT may have reached the database before the connection
    was lost, and whose row could not be read back to tell (its 503 says so: a retry without an
    Idempotency-Key might record the task twice)."""

    outcome_unknown = False


class IdempotencyConflict(Exception):
    """The Idempotency-Key is already in the ledger for a task with another body or options."""

    def __init__(self, key: str, task_id: str, message: str | None = None):
        self.key = key
        self.task_id = task_id
        super().__init__(
            message
            or f"Idempotency-Key {key!r} was already used for task {task_id} with a different body or options"
        )


class AlreadyFinished(ValueError):
    """``mark_running`` or ``finish`` on a task that has already finished; ``record`` is it."""

    def __init__(self, record: TaskRecord):
        self.record = record
        super().__init__(f"task {record.id} has already finished ({record.status})")


_dumps, _loads = dumps, loads  # (the names the stores have always used)


@dataclasses.dataclass
class FinishedTask:
    """A task recorded once, when it has finished (``Ledger.add_finished``)."""

    task_id: str
    kind: str
    mode: str
    backend: str
    config: dict
    options: dict
    train_count: int
    test_count: int
    body_bytes: int
    created_at: float
    status: str
    answer: dict | None = None
    answer_json: bytes | None = None
    error: dict | None = None
    input_hashes: dict | Callable[[], dict] | None = None  # a callable is called where it is written
    body_sha256: str | None = None
    started_at: float | None = None
    device: str | None = None
    finished_at: float | None = None  # when it finished (this process's clock); None: when it is written



@dataclasses.dataclass
class Outcome:
    """A queued or running task's result, as ``finish`` takes it (``finish_many`` takes a list)."""

    task_id: str
    status: str
    answer: dict | None = None
    error: dict | None = None
    answer_json: bytes | None = None
    with_answer: bool = True
    input_hashes: dict | Callable[[], dict] | None = None  # a callable is called where it is written
    epoch: int | None = None
    # False: ``finish_many`` answers True for it once written, not its record read back (a launch's
    # cells: their outcomes are what the hooks need, and a read per cell is a query per cell)
    want_record: bool = True

    def hashes(self) -> dict | None:
        return self.input_hashes() if callable(self.input_hashes) else self.input_hashes

# --------------------------------------------------------------------------- argument checks
# Both stores (this one and app/ledger/postgres.py) take the same arguments and refuse the same.


def check_task_id(task_id: str) -> None:
    """An id names an upload file in this store: the same ids are valid in both."""
    if not task_id or "/" in task_id or "\\" in task_id or task_id.startswith("."):
        raise ValueError(f"task id {task_id!r} cannot name an upload file")


def check_new_task(kind: str, mode: str, body: bytes | None, body_bytes: int, body_sha256: str | None,
                   idempotency_key: str | None) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if body is not None and len(body) != body_bytes:
        raise ValueError(f"body_bytes is {body_bytes} but the body has {len(body)} bytes")
    if idempotency_key is not None and not idempotency_key:
        raise ValueError("idempotency_key must be a non-empty string or None")
    if body_sha256 is None and (idempotency_key is not None or body is not None):
        raise ValueError("a task with an idempotency key or a stored upload needs its body_sha256")


def check_outcome(status: str, answer: dict | None, error: dict | None, answer_json: bytes | None) -> None:
    if status not in FINISHED:
        raise ValueError(f"finish status must be one of {', '.join(FINISHED)}, got {status!r}")
    if status == "succeeded" and (answer is None or error is not None):
        raise ValueError("a succeeded task needs its answer and no error")
    if status != "succeeded" and answer is not None:
        raise ValueError(f"a {status} task has no answer")
    if status == "failed" and error is None:
        raise ValueError("a failed task needs its error")
    if answer_json is not None and answer is None:
        raise ValueError("answer_json without the answer it encodes")


def check_finished_task(t: FinishedTask) -> None:
    if t.kind not in KINDS or t.mode not in MODES or t.status not in FINISHED:
        raise ValueError(f"bad finished task {t.task_id}: kind {t.kind!r}, mode {t.mode!r}, status {t.status!r}")
    if (t.status == "succeeded") != (t.answer is not None) or (t.answer is None and t.error is None):
        raise ValueError(f"finished task {t.task_id}: a succeeded task has its answer, any other its error")
    check_task_id(t.task_id)


def _split_sql(script: str) -> list[str]:
    """A migration's statements, one by one (executescript would commit the open transaction)."""
    statements, current = [], ""
    for line in script.splitlines(keepends=True):
        current += line
        if sqlite3.complete_statement(current):
            if current.strip():
                statements.append(current.strip())
            current = ""
    if current.strip():
        raise ValueError(f"incomplete SQL statement in a migration: {current.strip()[:80]!r}")
    return statements


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes, tmp: Path | None = None) -> None:
    """``data`` at ``path``, whole or not at all across a crash: written to ``tmp`` (default
    ``path`` + ``.tmp``), fsynced, renamed over ``path``, its folder fsynced. On an OSError the
    temporary file is removed and the error raised."""
    tmp = tmp or path.with_name(path.name + TMP_SUFFIX)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


class Ledger(TaskReads):
    """The task ledger of one replica. Thread-safe: one connection, guarded by a lock. Its reads
    of tasks are both ledgers' (app/ledger/task_reads.py), in SQLite's dialect."""

    dialect = SQLITE

    shared = False  # one replica's (app/ledger/base.py); PostgresLedger is the shared one
    engine = "sqlite"

    def __init__(self, data_dir: str | Path, retain_tasks: int = 10_000, retain_bytes: int = 1 << 30,
                 *, max_db_bytes: int | None = None):
        """``max_db_bytes``: an optional hard cap on the database file (SQLite's max_page_count);
        writes beyond it fail as a full disk would, with ``LedgerUnavailable``."""
        if retain_tasks < 0 or retain_bytes < 0:
            raise ValueError(f"retain_tasks and retain_bytes must be >= 0, got {retain_tasks}, {retain_bytes}")
        self.data_dir = Path(data_dir)
        self.path = self.data_dir / DB_NAME
        self.uploads_dir = self.data_dir / UPLOADS
        self.retain_tasks = retain_tasks
        self.retain_bytes = retain_bytes
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection | None = None
        self._totals: tuple[int, int] | None = None  # finished tasks, their stored answer bytes
        for folder in (self.data_dir, self.uploads_dir):
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise LedgerError(f"cannot create the ledger folder {folder}: {exc.strerror or exc}") from exc
            if not os.access(folder, os.W_OK | os.X_OK):
                raise LedgerError(f"the ledger folder {folder} is not writable")
        try:
            self._conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_MS / 1000.0, isolation_level=None,
                                         check_same_thread=False)
        except sqlite3.Error as exc:
            raise LedgerError(f"cannot open the task ledger {self.path}: {exc}") from exc
        try:
            self._open(max_db_bytes)
        except BaseException:
            self._conn.close()
            self._conn = None
            raise
        # the public connection API the side stores use (the webhook outbox: app/ledger/database.py)
        self.database = SqliteDatabase(read=self._read, write=lambda doing, durable: self._write(doing, synced=durable))

    # ------------------------------------------------------------------ open, migrations

    def _open(self, max_db_bytes: int | None) -> None:
        conn = self._conn
        try:
            conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            rows = conn.execute("PRAGMA quick_check").fetchall()
            if [r[0] for r in rows] != ["ok"]:
                problems = "; ".join(str(r[0]) for r in rows[:5])
                raise LedgerError(f"the task ledger {self.path} is corrupt (quick_check: {problems}); "
                                  f"move it aside to start with an empty ledger")
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise LedgerError(f"the task ledger {self.path} cannot use WAL mode (journal_mode is {mode!r})")
            conn.execute("PRAGMA synchronous = FULL")
            conn.execute("PRAGMA foreign_keys = ON")
            if max_db_bytes is not None:
                page_size = conn.execute("PRAGMA page_size").fetchone()[0]
                conn.execute(f"PRAGMA max_page_count = {max(1, int(max_db_bytes) // page_size)}")
            self._migrate()
            with self._write("clean up at open"):
                self._apply_retention(conn, keep=None)
            self._clean_uploads()
        except LedgerError:
            raise
        except sqlite3.Error as exc:
            raise LedgerError(self._describe(exc, "cannot open the task ledger")) from exc
        except OSError as exc:
            raise LedgerError(f"cannot open the task ledger in {self.data_dir}: {exc}") from exc

    def _migrate(self) -> None:
        conn = self._conn
        current = conn.execute("PRAGMA user_version").fetchone()[0]
        if current > SCHEMA_VERSION:
            raise LedgerError(
                f"the task ledger {self.path} has schema version {current}, newer than this code's "
                f"{SCHEMA_VERSION}: run a newer rev88, or move the file aside"
            )
        for version, sql in MIGRATIONS:
            if version <= current:
                continue
            conn.execute("BEGIN IMMEDIATE")
            try:
                for statement in _split_sql(sql):
                    conn.execute(statement)
                conn.execute(f"PRAGMA user_version = {int(version)}")
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise

    def _clean_uploads(self) -> None:
        """Delete temp files and uploads whose task is finished or gone (a crash between a
        finish's commit and its file deletion, or during a create before its commit)."""
        keep = {row[0] for row in self._conn.execute(
            "SELECT id FROM tasks WHERE status IN ('queued', 'running') AND has_upload = 1")}
        for entry in self.uploads_dir.iterdir():
            name = entry.name
            if name.endswith(TMP_SUFFIX) or (name.endswith(UPLOAD_SUFFIX) and name[: -len(UPLOAD_SUFFIX)] not in keep):
                with contextlib.suppress(FileNotFoundError):
                    entry.unlink()

    # ------------------------------------------------------------------ helpers

    def _describe(self, exc: BaseException, doing: str) -> str:
        text = str(exc)
        hint = ""
        low = text.lower()
        if "full" in low:
            hint = " (free space in the data dir or raise its size)"
        elif "not a database" in low or "malformed" in low:
            hint = " (the file is corrupt: move it aside to start with an empty ledger)"
        elif "readonly" in low or "read-only" in low or "permission" in low or "unable to open" in low:
            hint = " (check the data dir's permissions)"
        return f"{doing}: {text} — task ledger {self.path} in data dir {self.data_dir}{hint}"

    def _conn_or_fail(self) -> sqlite3.Connection:
        if self._conn is None:
            raise LedgerUnavailable(f"the task ledger {self.path} is closed")
        return self._conn

    @contextlib.contextmanager
    def _write(self, doing: str, synced: bool = True) -> Iterator[sqlite3.Connection]:
        """One write transaction (BEGIN IMMEDIATE .. COMMIT) under the lock; sqlite errors
        become LedgerUnavailable naming the data dir. ``synced=False``: its COMMIT does not wait
        for the disk (``synchronous = NORMAL`` for this transaction: in WAL mode that survives a
        crash of the process, not of the machine, until the next synced commit or checkpoint)."""
        with self._lock:
            conn = self._conn_or_fail()
            try:
                if not synced:
                    conn.execute("PRAGMA synchronous = NORMAL")
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                self._synced_again(conn, synced)
                raise LedgerUnavailable(self._describe(exc, f"cannot {doing}")) from exc
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException as exc:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
                if isinstance(exc, sqlite3.Error) and not isinstance(exc, sqlite3.IntegrityError):
                    raise LedgerUnavailable(self._describe(exc, f"cannot {doing}")) from exc
                raise
            finally:
                self._synced_again(conn, synced)

    @staticmethod
    def _synced_again(conn: sqlite3.Connection, synced: bool) -> None:
        if not synced:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("PRAGMA synchronous = FULL")

    @contextlib.contextmanager
    def _read(self, doing: str) -> Iterator[sqlite3.Connection]:
        with self._lock:
            conn = self._conn_or_fail()
            try:
                yield conn
            except sqlite3.Error as exc:
                raise LedgerUnavailable(self._describe(exc, f"cannot {doing}")) from exc

    @staticmethod
    def _record(row: sqlite3.Row | tuple, with_answer: bool) -> TaskRecord:
        return record_from_row(row, with_answer)

    def _get(self, conn: sqlite3.Connection, task_id: str, with_answer: bool = True) -> TaskRecord | None:
        columns = _ALL_COLUMNS if with_answer else _SUMMARY_COLUMNS
        row = conn.execute(f"SELECT {columns} FROM tasks WHERE id = ?", (task_id,)).fetchone()
        return None if row is None else self._record(row, with_answer)

    def _by_key(self, conn: sqlite3.Connection, key: str) -> TaskRecord | None:
        row = conn.execute(f"SELECT {_ALL_COLUMNS} FROM tasks WHERE idempotency_key = ?", (key,)).fetchone()
        return None if row is None else self._record(row, True)

    def upload_path(self, task_id: str) -> Path:
        check_task_id(task_id)
        return self.uploads_dir / f"{task_id}{UPLOAD_SUFFIX}"

    def _write_upload(self, task_id: str, body: bytes) -> Path:
        final = self.upload_path(task_id)
        tmp = final.with_name(f"{final.name}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}")
        try:
            write_durably(final, body, tmp)
        except OSError as exc:
            with contextlib.suppress(OSError):
                final.unlink()
            what = "no space left on the device" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else exc.strerror or exc
            raise LedgerUnavailable(
                f"cannot store the upload of task {task_id} at {final}: {what} (data dir {self.data_dir})"
            ) from exc
        return final

    @staticmethod
    def _same_request(existing: TaskRecord, kind: str, backend: str, config: dict, options: dict,
                      body_sha256: str | None) -> bool:
        return (existing.body_sha256 == body_sha256 and existing.kind == kind and existing.backend == backend
                and _dumps(existing.config) == _dumps(config) and _dumps(existing.options) == _dumps(options))

    # ------------------------------------------------------------------ the interface

    def create(self, *, task_id: str, kind: str, mode: str, backend: str, config: dict, options: dict,
               train_count: int, test_count: int, body_sha256: str | None, body_bytes: int,
               input_hashes: dict | None = None, body: bytes | None = None,
               idempotency_key: str | None = None) -> tuple[TaskRecord, bool]:
        """Record a new task as queued: (record, True). With ``body`` its upload is durable on disk
        before the row is committed. With an ``idempotency_key`` already in the ledger: the same
        body and options give (that task, False); anything else raises IdempotencyConflict."""
        check_new_task(kind, mode, body, body_bytes, body_sha256, idempotency_key)
        self.upload_path(task_id)  # validates the id

        def existing_for_key(conn) -> TaskRecord | None:
            if idempotency_key is None:
                return None
            found = self._by_key(conn, idempotency_key)
            if found is not None and not self._same_request(found, kind, backend, config, options, body_sha256):
                raise IdempotencyConflict(idempotency_key, found.id)
            return found

        # First look (cheap, no file written), then write the upload outside the write
        # transaction, then look again inside it (another thread may have won meanwhile).
        with self._read("look up the task"):
            conn = self._conn
            found = existing_for_key(conn)
            if found is not None:
                return found, False
            if conn.execute("SELECT 1 FROM tasks WHERE id = ?", (task_id,)).fetchone():
                raise ValueError(f"task id {task_id} is already in the ledger")
        upload = self._write_upload(task_id, body) if body is not None else None
        committed = False
        try:
            with self._write(f"record task {task_id}") as conn:
                found = existing_for_key(conn)
                if found is not None:
                    return found, False
                row = new_row(task_id, kind, mode, backend, config, options, train_count, test_count, input_hashes,
                              body_sha256, body_bytes, idempotency_key, created_at=time.time())
                conn.execute(_NEW.sql, _NEW.values({**row, "has_upload": int(upload is not None)}))
                insert_messages(conn, task_rows(task_id, options), "sqlite")  # its webhook's messages (issue #34)
                record = self._get(conn, task_id)
            committed = True
        except sqlite3.IntegrityError as exc:
            raise ValueError(f"task id {task_id} is already in the ledger ({exc})") from exc
        finally:
            if upload is not None and not committed:
                with contextlib.suppress(OSError):
                    upload.unlink()
        return record, True

    def create_many(self, tasks: list[dict], messages: list[tuple] | None = None) -> None:
        """Record many new tasks without a body or an Idempotency-Key (a sweep's cells: their
        dataset is stored apart) as queued, in one transaction: all of them, or none (ValueError
        for an id already in the ledger). ``tasks``: ``create``'s keyword arguments. ``messages``:
        webhook outbox rows written in the same transaction (a sweep's, an evaluation's)."""
        now = time.time()
        for t in tasks:
            check_new_task(t["kind"], t["mode"], None, t["body_bytes"], t["body_sha256"], None)
            check_task_id(t["task_id"])
        rows = [_NEW.values({**row, "has_upload": 0}) for row in new_rows(tasks, created_at=now)]
        try:
            with self._write(f"record {len(rows)} task(s)") as conn:
                conn.executemany(_NEW.sql, rows)
                insert_messages(conn, [m for t in tasks for m in task_rows(t["task_id"], t["options"], now)]
                                + list(messages or []), "sqlite")
        except sqlite3.IntegrityError as exc:
            raise ValueError(f"a task id is already in the ledger ({exc})") from exc

    def _unfinished_record(self, conn: sqlite3.Connection, task_id: str) -> TaskRecord:
        """The task's record (without its answer); KeyError if unknown, AlreadyFinished if finished."""
        record = self._get(conn, task_id, with_answer=False)
        if record is None:
            raise KeyError(task_id)
        if record.finished:
            raise AlreadyFinished(record)
        return record

    def mark_running(self, task_id: str, device: str | None = None, epoch: int | None = None) -> None:
        """queued (or running, after a restart re-queued it) -> running; sets started_at.
        (``epoch``: a shared ledger's lease fence; one replica has no leases.)"""
        with self._write(f"mark task {task_id} running") as conn:
            self._unfinished_record(conn, task_id)
            self._set_running(conn, task_id, device, time.time())

    @staticmethod
    def _set_running(conn: sqlite3.Connection, task_id: str, device: str | None, started_at: float) -> None:
        conn.execute(
            "UPDATE tasks SET status = 'running', started_at = ?, device = COALESCE(?, device),"
            " attempts = attempts + 1 WHERE id = ?",
            (started_at, device, task_id),
        )

    def mark_running_many(self, started: list[tuple]) -> list[str]:
        """``(task id, device, started_at[, epoch])`` of tasks a launch started, in one
        transaction: each unfinished one -> running, as ``mark_running``. Returns the ids it left
        alone (unknown, or finished meanwhile: cancelled before its run began, say)."""
        ids = [t[0] for t in started]
        with self._write(f"mark {len(started)} task(s) running") as conn:
            unfinished: set[str] = set()
            for i in range(0, len(ids), 500):  # (SQLite's limit on a statement's parameters)
                part = ids[i : i + 500]
                unfinished.update(row[0] for row in conn.execute(
                    f"SELECT id FROM tasks WHERE id IN ({', '.join('?' * len(part))}) AND status IN ('queued', 'running')",
                    part))
            conn.executemany(
                "UPDATE tasks SET status = 'running', started_at = ?, device = COALESCE(?, device),"
                " attempts = attempts + 1 WHERE id = ?",
                [(started_at, device, task_id) for task_id, device, started_at, *_ in started if task_id in unfinished])
        return [task_id for task_id in ids if task_id not in unfinished]

    def finish(self, task_id: str, status: str, answer: dict | None = None,
               error: dict | None = None, answer_json: bytes | None = None,
               with_answer: bool = True, input_hashes: dict | None = None, epoch: int | None = None) -> TaskRecord:
        """Record the outcome (succeeded: the answer; failed: the error; cancelled: the error if
        any), delete the upload, then apply retention (``epoch``: ignored, as by ``mark_running``).
        KeyError for an unknown task,
        AlreadyFinished for a finished one. ``answer_json``: ``answer`` already encoded as JSON
        (stored as given); ``with_answer=False`` returns the record without reading the stored
        answer back (the caller has it); ``input_hashes``: the task's, where ``create`` had none."""
        outcome = self.finish_many([Outcome(task_id, status, answer, error, answer_json, with_answer,
                                            input_hashes, epoch)])[0]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def finish_many(self, outcomes: list[Outcome]) -> list[TaskRecord | Exception]:
        """``finish`` for each of ``outcomes``, all in one transaction (group commit: a stream of
        asynchronous tasks, a sweep's cells, costs one commit per batch, not one per task), then
        retention once. One result per outcome, in order: its record, or the exception ``finish``
        would have raised for it alone (ValueError, KeyError, AlreadyFinished), which leaves the
        others written. A failure of the database itself (LedgerUnavailable) raises: none written."""
        results: list[TaskRecord | Exception | None] = [None] * len(outcomes)
        rows: list[tuple[int, dict]] = []
        for i, o in enumerate(outcomes):
            try:
                check_outcome(o.status, o.answer, o.error, o.answer_json)
            except ValueError as exc:
                results[i] = exc
                continue
            rows.append((i, outcome_row(o.status, o.answer, o.error, o.answer_json, o.hashes())))
        if not rows:
            return results  # type: ignore[return-value]
        written: list[tuple[str, int]] = []
        doing = (f"record the result of task {outcomes[rows[0][0]].task_id}" if len(rows) == 1
                 else f"record the results of {len(rows)} tasks")
        with self._write(doing) as conn:
            now = time.time()
            for i, values in rows:
                task_id = outcomes[i].task_id
                # its status and whether an upload is kept for it: one column each, not its record
                found = conn.execute("SELECT status, has_upload FROM tasks WHERE id = ?", (task_id,)).fetchone()
                if found is None:
                    results[i] = KeyError(task_id)
                    continue
                if found[0] in FINISHED:
                    results[i] = AlreadyFinished(self._get(conn, task_id, with_answer=False))
                    continue
                values["finished_at"] = now
                conn.execute(f"UPDATE tasks SET {_OUTCOME.sql} WHERE id = ?", (*_OUTCOME.values(values), task_id))
                results[i] = self._get(conn, task_id, outcomes[i].with_answer) if outcomes[i].want_record else True
                written.append((task_id, values["answer_bytes"], bool(found[1])))
        if not written:
            return results  # type: ignore[return-value]
        if self._totals is not None:
            self._totals = (self._totals[0] + len(written), self._totals[1] + sum(w[1] for w in written))
        # After the commit: a crash (or a failed unlink) before it leaves an orphan, deleted at open.
        for task_id, _, kept in written:
            if not kept:  # (no upload was kept for it: a task on a dataset, a cell)
                continue
            upload = self.upload_path(task_id)
            try:
                upload.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("cannot delete the upload %s of finished task %s: %s (deleted at the next start)",
                            upload, task_id, exc)
        self._retain(keep=written[-1][0])
        return results  # type: ignore[return-value]

    def _retain(self, keep: str, synced: bool = True) -> None:
        """Retention after a result is committed. A retention that fails (a full disk can refuse
        even a delete) loses nothing, so it is reported and retried after the next finish, not
        raised. Within the limits (the running totals say so) no transaction is opened at all.
        ``synced=False`` (after unsynced records): a delete lost with the machine only leaves
        a task for the next retention."""
        if self._totals is not None and self._totals[0] <= self.retain_tasks and self._totals[1] <= self.retain_bytes:
            return
        try:
            with self._write("apply retention", synced) as conn:
                self._apply_retention(conn, keep=keep)
        except LedgerUnavailable as exc:
            self._totals = None  # recounted next time: the deletes may have been rolled back
            log.warning("task ledger retention skipped: %s", exc)

    def add_finished(self, tasks: list[FinishedTask]) -> None:
        """Record tasks that ran and finished without a record before (synchronous tasks sent
        without an Idempotency-Key: their client holds the answer, so nothing is written before it
        runs), all in one transaction, then apply retention once. ValueError for a bad outcome or
        an id already in the ledger (nothing is written then)."""
        for t in tasks:
            check_finished_task(t)
        now = time.time()  # (a task's own finish time where it has one: a group commit writes several at once,
        # and retention deletes the oldest finished first)
        values = [finished_row(t, now if t.finished_at is None else t.finished_at) for t in tasks]
        rows = [_FINISHED.values(v) for v in values]
        added_bytes = sum(v["answer_bytes"] for v in values)
        if not rows:
            return
        try:
            # Their clients hold the answers (issue #21): the commit need not wait for the disk.
            with self._write(f"record {len(rows)} finished task(s)", synced=False) as conn:
                conn.executemany(_FINISHED.sql, rows)
                insert_messages(conn, [m for t in tasks for m in task_rows(t.task_id, t.options)], "sqlite")
        except sqlite3.IntegrityError as exc:
            raise ValueError(f"a finished task's id is already in the ledger ({exc})") from exc
        if self._totals is not None:
            self._totals = (self._totals[0] + len(rows), self._totals[1] + added_bytes)
        self._retain(keep=values[-1]["id"], synced=False)

    def _apply_retention(self, conn: sqlite3.Connection, keep: str | None) -> int:
        # Finished tasks and their stored bytes: counted once by a scan, then kept up to date
        # here and in finish() (a scan per finish grew with the ledger: docs/performance.md).
        if self._totals is None:
            self._totals = tuple(conn.execute(
                "SELECT COUNT(*), COALESCE(SUM(answer_bytes), 0) FROM tasks WHERE finished_at IS NOT NULL"
            ).fetchone())
        count, stored = self._totals
        if count <= self.retain_tasks and stored <= self.retain_bytes:
            return 0
        doomed = []
        for task_id, size in conn.execute(
            "SELECT id, answer_bytes FROM tasks WHERE finished_at IS NOT NULL ORDER BY finished_at, id"
        ):
            if count <= self.retain_tasks and stored <= self.retain_bytes:
                break
            if task_id == keep:
                continue
            doomed.append((task_id,))
            count -= 1
            stored -= size
        conn.executemany("DELETE FROM tasks WHERE id = ?", doomed)
        self._totals = (count, stored)
        return len(doomed)

    def load_upload(self, task_id: str) -> bytes:
        path = self.upload_path(task_id)
        try:
            return path.read_bytes()
        except FileNotFoundError:
            raise LedgerError(f"the upload of task {task_id} is missing: {path} does not exist") from None
        except OSError as exc:
            raise LedgerUnavailable(f"cannot read the upload of task {task_id} at {path}: {exc}") from exc

    def counts(self) -> dict:
        """Tasks per status, stored answer bytes, file sizes, schema version."""
        with self._read("count tasks") as conn:
            per_status = dict(conn.execute("SELECT status, COUNT(*) FROM tasks GROUP BY status").fetchall())
            stored, json_bytes = conn.execute(
                "SELECT COALESCE(SUM(answer_bytes), 0), COALESCE(SUM(answer_json_bytes), 0) FROM tasks"
            ).fetchone()
            version = conn.execute("PRAGMA user_version").fetchone()[0]

        def size(path: Path) -> int:
            try:
                return path.stat().st_size
            except OSError:
                return 0

        uploads = [p for p in self.uploads_dir.glob(f"*{UPLOAD_SUFFIX}")] if self.uploads_dir.is_dir() else []
        return {
            "tasks": {name: per_status.get(name, 0) for name in STATUSES},
            "total": sum(per_status.values()),
            "answer_bytes": stored,
            "answer_json_bytes": json_bytes,
            "db_bytes": size(self.path),
            "wal_bytes": size(self.path.with_name(self.path.name + "-wal")),
            "upload_files": len(uploads),
            "upload_bytes": sum(size(p) for p in uploads),
            "schema_version": version,
            "path": str(self.path),
            "retain_tasks": self.retain_tasks,
            "retain_bytes": self.retain_bytes,
        }

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                with contextlib.suppress(sqlite3.Error):
                    self._conn.close()
                self._conn = None

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
