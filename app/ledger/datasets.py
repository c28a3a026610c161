"""Datasets: task npz files stored once, addressed by the SHA-256 of their bytes (issue #31).

A dataset is the bytes of a task npz (train_images, train_labels, test_images: the same three
members a task has), its digest ``sha256:<hex>`` the SHA-256 of those bytes, and what reading it
found (the train and query counts, the input hashes a task's metadata carries). Scoring labels
for its queries may be attached: an ``.npy`` kept apart, never part of a task, never returned.

Two stores, one interface (``DatasetStore``), chosen with the ledger (``open_datasets``, app/ledger/engines.py):

    SQLite      ``SqliteDatasets``: ``<data_dir>/datasets/<hex>.npz`` (and ``<hex>.labels.npy``),
                indexed by ``<data_dir>/datasets.sqlite3``; one replica
    PostgreSQL  ``PostgresDatasets`` (app/ledger/datasets_pg.py): rows of ``rev88_datasets`` in
                the shared database; every replica reads every dataset

Durability: a dataset's file is written to a temporary name, fsynced, renamed, its folder
fsynced, and only then is its row committed (synchronous=FULL); a ``kill -9`` at any moment
leaves the dataset whole or absent (an orphaned file is deleted at the next open). A total size
cap (``capacity_bytes``, REV88_DATASET_BYTES) refuses a dataset that does not fit
(``DatasetsFull``). Nothing here parses npz files: the caller (app/tasks/datasets.py) reads and
checks a dataset before it is stored.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import re
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Protocol

import orjson

from .database import SqliteDatabase, immediate_transaction
from .store import LedgerError, LedgerUnavailable, write_durably

DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


def not_a_digest(value: object) -> str:
    """What a refusal of ``value`` as a dataset's digest says: the expected form, what was given,
    and the digest meant when only the ``sha256:`` prefix is missing."""
    text = f"a dataset is named by its digest, sha256:<64 lowercase hex digits> (the SHA-256 of the npz bytes), got {value!r}"
    if isinstance(value, str) and re.fullmatch(r"[0-9a-fA-F]{64}", value):
        text += f": did you mean sha256:{value.lower()}?"
    return text

DB_NAME = "datasets.sqlite3"
FOLDER = "datasets"


class DatasetsFull(Exception):
    """The datasets' total size cap would be passed."""

    def __init__(self, size: int, used: int, capacity: int) -> None:
        self.size, self.used, self.capacity = size, used, capacity
        super().__init__(f"a dataset of {size} bytes does not fit: {used} of {capacity} bytes are stored "
                         "(REV88_DATASET_BYTES); delete one (DELETE /datasets/<digest>) or raise the limit")


@dataclasses.dataclass(frozen=True)
class DatasetRecord:
    digest: str  # "sha256:<hex>" of the npz bytes
    bytes: int
    train_count: int
    test_count: int
    input_hashes: dict[str, str]
    created_at: float
    labels_sha256: str | None = None  # the attached scoring labels' .npy, if any
    labels_bytes: int = 0

    def describe(self) -> dict[str, Any]:
        """What a client may see (never the labels themselves)."""
        return {"digest": self.digest, "bytes": self.bytes, "train_count": self.train_count,
                "test_count": self.test_count, "input_hashes": self.input_hashes, "created_at": self.created_at,
                "labels": {"attached": self.labels_sha256 is not None, "sha256": self.labels_sha256}}


@dataclasses.dataclass(frozen=True)
class SweepRecord:
    """A sweep (app/tasks/sweeps.py): its definition as sent (checked), and its cells: one task
    each, ``{"task_id", "config"}`` with the cell's whole effective config (its seed included)."""

    id: str
    created_at: float
    dataset: str
    definition: dict[str, Any]
    cells: list[dict[str, Any]]
    idempotency_key: str | None = None
    cancelled_at: float | None = None
    owner: str | None = None  # the tenant whose key made it (None: the admin, or an open service)


SWEEP_COLUMNS = "id, created_at, dataset, definition, cells, idempotency_key, cancelled_at, owner"


def sweep_of(row) -> SweepRecord:
    sweep_id, created, dataset, definition, cells, key, cancelled, owner = row
    # (orjson: a third of json's time for a large sweep's cells, docs/performance.md; every poll of GET /sweeps reads them)
    return SweepRecord(id=sweep_id, created_at=float(created), dataset=dataset, definition=orjson.loads(definition),
                       cells=orjson.loads(cells), idempotency_key=key,
                       cancelled_at=None if cancelled is None else float(cancelled), owner=owner)


class DatasetStore(Protocol):
    def put(self, record: DatasetRecord, body: bytes) -> tuple[DatasetRecord, bool]: ...

    def get(self, digest: str) -> DatasetRecord | None: ...

    def body(self, digest: str) -> bytes | None: ...

    def labels(self, digest: str) -> bytes | None: ...

    def put_labels(self, digest: str, npy: bytes, sha256: str) -> tuple[DatasetRecord, bool]: ...

    def list(self, limit: int, cursor: str | None) -> tuple[list[DatasetRecord], str | None]: ...

    def delete(self, digest: str) -> bool: ...

    def create_sweep(self, sweep: SweepRecord) -> tuple[SweepRecord, bool]: ...

    def get_sweep(self, sweep_id: str) -> SweepRecord | None: ...

    def list_sweeps(self, limit: int, cursor: str | None,
                    owner: str | None = None) -> tuple[list[SweepRecord], str | None]: ...

    def cancel_sweep(self, sweep_id: str) -> None: ...

    def sweeps_of(self, digest: str) -> list[str]: ...

    def close(self) -> None: ...


class LabelsConflict(Exception):
    """Other labels are attached to the dataset already."""


def encode_cursor(created_at: float, digest: str) -> str:
    return base64.urlsafe_b64encode(json.dumps([created_at, digest]).encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[float, str]:
    try:
        created_at, digest = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        return float(created_at), str(digest)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"cursor {cursor!r} is not one this service gave (use next_cursor as it is)") from exc


def next_cursor_of(rows: list, limit: int, key) -> str | None:
    """Trim a page read with one row more than ``limit``: the next page's cursor, or None."""
    if len(rows) <= limit:
        return None
    del rows[limit:]
    return encode_cursor(*key(rows[-1]))


def page(db: Any, table: str, columns: str, key: str, limit: int, cursor: str | None, make,
         owner: str | None = None) -> list:
    """Newest first (created_at, then ``key``), ``limit`` + 1 rows from ``cursor`` on (``owner``:
    its only), on either engine's database (app/ledger/database.py)."""
    sql, args, where = f"SELECT {columns} FROM {table}", [], []
    if cursor is not None:
        created_at, last = decode_cursor(cursor)
        where.append(f"(created_at, {key}) < (?, ?)")
        args += [created_at, last]
    if owner is not None:
        where.append("owner = ?")
        args.append(owner)
    if where:
        sql += " WHERE " + " AND ".join(where)
    sql += f" ORDER BY created_at DESC, {key} DESC LIMIT ?"
    args.append(limit + 1)
    return [make(r) for r in db.read(f"list {table}", lambda conn: db.query(conn, sql, args).fetchall())]


def hex_of(digest: str) -> str:
    if not DIGEST.match(digest):
        raise ValueError(f"a dataset digest is sha256:<64 lowercase hex digits>, got {digest!r}")
    return digest.split(":", 1)[1]


DATASET_COLUMNS = "digest, bytes, train_count, test_count, input_hashes, created_at, labels_sha256, labels_bytes"


def record_of(row) -> DatasetRecord:
    digest, size, train, test, hashes, created, labels_sha, labels_bytes = row
    return DatasetRecord(digest=digest, bytes=int(size), train_count=int(train), test_count=int(test),
                         input_hashes=json.loads(hashes), created_at=float(created), labels_sha256=labels_sha,
                         labels_bytes=int(labels_bytes or 0))


class SqliteDatasets:
    """One replica's datasets in its data dir (see the module docstring). Thread-safe."""

    engine = "sqlite"

    def __init__(self, data_dir: str | Path, capacity_bytes: int) -> None:
        self.folder = Path(data_dir) / FOLDER
        self.path = Path(data_dir) / DB_NAME
        self.capacity = int(capacity_bytes)
        self._lock = threading.Lock()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=5.0)
            self._conn.execute("PRAGMA journal_mode = WAL")
            self._conn.execute("PRAGMA synchronous = FULL")
            self._conn.execute(
                "CREATE TABLE IF NOT EXISTS datasets (digest TEXT PRIMARY KEY, bytes INTEGER NOT NULL,"
                " train_count INTEGER NOT NULL, test_count INTEGER NOT NULL, input_hashes TEXT NOT NULL,"
                " created_at REAL NOT NULL, labels_sha256 TEXT, labels_bytes INTEGER NOT NULL DEFAULT 0)")
            self._conn.execute(
                "CREATE TABLE IF NOT EXISTS sweeps (id TEXT PRIMARY KEY, created_at REAL NOT NULL, dataset TEXT NOT NULL,"
                " definition TEXT NOT NULL, cells TEXT NOT NULL, idempotency_key TEXT UNIQUE, cancelled_at REAL)")
            self._conn.execute("CREATE INDEX IF NOT EXISTS sweeps_dataset ON sweeps (dataset)")
            if "owner" not in {row[1] for row in self._conn.execute("PRAGMA table_info(sweeps)")}:
                self._conn.execute("ALTER TABLE sweeps ADD COLUMN owner TEXT")  # (issue #33: a store made before)
            self._clean()
        except (OSError, sqlite3.Error) as exc:
            raise LedgerError(f"cannot open the dataset store {self.path}: {exc}") from exc
        # the public connection API the side stores beside it use (keys, owners, evaluations:
        # app/ledger/database.py): reads on its connection, writes in BEGIN IMMEDIATE transactions
        self.database = SqliteDatabase(read=self._db, write=lambda doing, durable: immediate_transaction(self._db, doing))

    def _clean(self) -> None:
        """At open: temporary files, and files no row names (a crash before the commit), deleted;
        a row whose file is gone (deleted by hand) dropped."""
        digests = {row[0] for row in self._conn.execute("SELECT digest FROM datasets")}
        hexes = {d.split(":", 1)[1] for d in digests}
        for entry in self.folder.iterdir():
            stem = entry.name.split(".", 1)[0]
            if entry.name.endswith(".tmp") or stem not in hexes:
                with contextlib.suppress(FileNotFoundError):
                    entry.unlink()
        for digest in digests:
            if not self._file(digest).exists():
                self._conn.execute("DELETE FROM datasets WHERE digest = ?", (digest,))

    def _file(self, digest: str, labels: bool = False) -> Path:
        return self.folder / (hex_of(digest) + (".labels.npy" if labels else ".npz"))

    @contextlib.contextmanager
    def _db(self, doing: str):
        with self._lock:
            try:
                yield self._conn
            except (OSError, sqlite3.Error) as exc:
                raise LedgerUnavailable(f"cannot {doing}: {exc} (the dataset store {self.path})") from exc

    def put(self, record: DatasetRecord, body: bytes) -> tuple[DatasetRecord, bool]:
        with self._db(f"store dataset {record.digest}") as conn:
            existing = self._get(conn, record.digest)
            if existing is not None:
                return existing, False
            used = self._used(conn)
            if used + len(body) > self.capacity:
                raise DatasetsFull(len(body), used, self.capacity)
            write_durably(self._file(record.digest), body)
            conn.execute(f"INSERT INTO datasets ({DATASET_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, NULL, 0)",
                         (record.digest, record.bytes, record.train_count, record.test_count,
                          json.dumps(record.input_hashes), record.created_at or time.time()))
            return self._get(conn, record.digest), True

    @staticmethod
    def _get(conn, digest: str) -> DatasetRecord | None:
        row = conn.execute(f"SELECT {DATASET_COLUMNS} FROM datasets WHERE digest = ?", (digest,)).fetchone()
        return None if row is None else record_of(row)

    @staticmethod
    def _used(conn) -> int:
        return int(conn.execute("SELECT COALESCE(sum(bytes + labels_bytes), 0) FROM datasets").fetchone()[0])

    def get(self, digest: str) -> DatasetRecord | None:
        hex_of(digest)
        with self._db(f"read dataset {digest}") as conn:
            return self._get(conn, digest)

    def body(self, digest: str) -> bytes | None:
        if self.get(digest) is None:
            return None
        try:
            return self._file(digest).read_bytes()
        except OSError as exc:
            raise LedgerUnavailable(f"cannot read dataset {digest}: {exc}") from exc

    def labels(self, digest: str) -> bytes | None:
        record = self.get(digest)
        if record is None or record.labels_sha256 is None:
            return None
        try:
            return self._file(digest, labels=True).read_bytes()
        except OSError as exc:
            raise LedgerUnavailable(f"cannot read the labels of dataset {digest}: {exc}") from exc

    def put_labels(self, digest: str, npy: bytes, sha256: str) -> tuple[DatasetRecord, bool]:
        with self._db(f"store the labels of dataset {digest}") as conn:
            record = self._get(conn, digest)
            if record is None:
                raise KeyError(digest)
            if record.labels_sha256 == sha256:
                return record, False
            if record.labels_sha256 is not None:
                raise LabelsConflict(f"dataset {digest} has other labels attached (sha256 {record.labels_sha256})")
            used = self._used(conn)
            if used + len(npy) > self.capacity:
                raise DatasetsFull(len(npy), used, self.capacity)
            write_durably(self._file(digest, labels=True), npy)
            conn.execute("UPDATE datasets SET labels_sha256 = ?, labels_bytes = ? WHERE digest = ?",
                         (sha256, len(npy), digest))
            return self._get(conn, digest), True

    def list(self, limit: int, cursor: str | None) -> tuple[list[DatasetRecord], str | None]:
        records = self._page("datasets", DATASET_COLUMNS, "digest", limit, cursor, record_of)
        return records, next_cursor_of(records, limit, lambda r: (r.created_at, r.digest))

    def _page(self, table: str, columns: str, key: str, limit: int, cursor: str | None, make,
              owner: str | None = None) -> list:
        return page(self.database, table, columns, key, limit, cursor, make, owner)

    def delete(self, digest: str) -> bool:
        hex_of(digest)
        with self._db(f"delete dataset {digest}") as conn:
            gone = conn.execute("DELETE FROM datasets WHERE digest = ?", (digest,)).rowcount
            for path in (self._file(digest), self._file(digest, labels=True)):  # after the commit
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            return bool(gone)

    # ------------------------------------------------------------------ sweeps
    def create_sweep(self, sweep: SweepRecord) -> tuple[SweepRecord, bool]:
        """Record a sweep; an Idempotency-Key recorded already: (that sweep, False)."""
        with self._db(f"record sweep {sweep.id}") as conn:
            if sweep.idempotency_key is not None:
                row = conn.execute(f"SELECT {SWEEP_COLUMNS} FROM sweeps WHERE idempotency_key = ?",
                                   (sweep.idempotency_key,)).fetchone()
                if row is not None:
                    return sweep_of(row), False
            conn.execute(f"INSERT INTO sweeps ({SWEEP_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, NULL, ?)",
                         (sweep.id, sweep.created_at, sweep.dataset, json.dumps(sweep.definition),
                          json.dumps(sweep.cells), sweep.idempotency_key, sweep.owner))
            return sweep, True

    def get_sweep(self, sweep_id: str) -> SweepRecord | None:
        with self._db(f"read sweep {sweep_id}") as conn:
            row = conn.execute(f"SELECT {SWEEP_COLUMNS} FROM sweeps WHERE id = ?", (sweep_id,)).fetchone()
        return None if row is None else sweep_of(row)

    def list_sweeps(self, limit: int, cursor: str | None, owner: str | None = None) -> tuple[list[SweepRecord], str | None]:
        sweeps = self._page("sweeps", SWEEP_COLUMNS, "id", limit, cursor, sweep_of, owner)
        return sweeps, next_cursor_of(sweeps, limit, lambda r: (r.created_at, r.id))

    def cancel_sweep(self, sweep_id: str) -> None:
        with self._db(f"cancel sweep {sweep_id}") as conn:
            conn.execute("UPDATE sweeps SET cancelled_at = COALESCE(cancelled_at, ?) WHERE id = ?",
                         (time.time(), sweep_id))

    def sweeps_of(self, digest: str) -> list[str]:
        with self._db(f"list the sweeps of dataset {digest}") as conn:
            return [r[0] for r in conn.execute("SELECT id FROM sweeps WHERE dataset = ? ORDER BY created_at",
                                               (digest,))]

    def close(self) -> None:
        with self._lock:
            with contextlib.suppress(sqlite3.Error):
                self._conn.close()
