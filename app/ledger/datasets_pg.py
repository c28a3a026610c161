"""The datasets in the shared PostgreSQL database (issue #31): ``rev88_datasets`` (migration
0002), one row a dataset with its bytes and its labels apart in their own column, read by every
replica. The same interface and behaviour as ``SqliteDatasets`` (app/ledger/datasets.py), on the
ledger's pool and its failure handling (LedgerUnavailable naming the problem: a 503). The size cap
is checked in the inserting transaction under an advisory lock, so replicas storing at once
cannot pass it together."""

from __future__ import annotations

import json
from typing import Any

from .datasets import (
    DATASET_COLUMNS,
    SWEEP_COLUMNS,
    DatasetRecord,
    DatasetsFull,
    LabelsConflict,
    SweepRecord,
    hex_of,
    next_cursor_of,
    page,
    record_of,
    sweep_of,
)

CAPACITY_LOCK = 0x7265_7638_0003  # pg_advisory_xact_lock key: the datasets' size cap
NOW = "EXTRACT(EPOCH FROM clock_timestamp())::float8"


class PostgresDatasets:
    engine = "postgresql"

    def __init__(self, ledger: Any, capacity_bytes: int) -> None:
        self.ledger, self.capacity = ledger, int(capacity_bytes)
        self.path = ledger.path
        self.database = ledger.database  # (the side stores beside it use the same)

    def _get(self, conn, digest: str) -> DatasetRecord | None:
        row = conn.execute(f"SELECT {DATASET_COLUMNS} FROM rev88_datasets WHERE digest = %s", (digest,)).fetchone()
        return None if row is None else record_of(row)

    def _reserve(self, conn, size: int) -> None:
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (CAPACITY_LOCK,))
        used = int(conn.execute("SELECT COALESCE(sum(bytes + labels_bytes), 0) FROM rev88_datasets").fetchone()[0])
        if used + size > self.capacity:
            raise DatasetsFull(size, used, self.capacity)

    def put(self, record: DatasetRecord, body: bytes) -> tuple[DatasetRecord, bool]:
        with self.database.transaction(f"store dataset {record.digest}") as conn:
            existing = self._get(conn, record.digest)
            if existing is not None:
                return existing, False
            self._reserve(conn, len(body))
            row = conn.execute(
                f"INSERT INTO rev88_datasets (digest, bytes, train_count, test_count, input_hashes, created_at, body)"
                f" VALUES (%s, %s, %s, %s, %s, {NOW}, %b) ON CONFLICT (digest) DO NOTHING RETURNING {DATASET_COLUMNS}",
                (record.digest, record.bytes, record.train_count, record.test_count, json.dumps(record.input_hashes),
                 body)).fetchone()
            if row is None:  # another replica stored the same bytes meanwhile
                return self._get(conn, record.digest), False
            return record_of(row), True

    def get(self, digest: str) -> DatasetRecord | None:
        hex_of(digest)
        return self.database.read(f"read dataset {digest}", lambda conn: self._get(conn, digest))

    def body(self, digest: str) -> bytes | None:
        hex_of(digest)
        row = self.database.read(f"read dataset {digest}", lambda conn: conn.execute(
            "SELECT body FROM rev88_datasets WHERE digest = %s", (digest,), binary=True).fetchone())
        return None if row is None else bytes(row[0])

    def labels(self, digest: str) -> bytes | None:
        hex_of(digest)
        row = self.database.read(f"read the labels of dataset {digest}", lambda conn: conn.execute(
            "SELECT labels FROM rev88_datasets WHERE digest = %s", (digest,), binary=True).fetchone())
        return None if row is None or row[0] is None else bytes(row[0])

    def put_labels(self, digest: str, npy: bytes, sha256: str) -> tuple[DatasetRecord, bool]:
        with self.database.transaction(f"store the labels of dataset {digest}") as conn:
            row = conn.execute(f"SELECT {DATASET_COLUMNS} FROM rev88_datasets WHERE digest = %s FOR UPDATE",
                               (digest,)).fetchone()
            if row is None:
                raise KeyError(digest)
            record = record_of(row)
            if record.labels_sha256 == sha256:
                return record, False
            if record.labels_sha256 is not None:
                raise LabelsConflict(f"dataset {digest} has other labels attached (sha256 {record.labels_sha256})")
            self._reserve(conn, len(npy))
            row = conn.execute(f"UPDATE rev88_datasets SET labels = %b, labels_sha256 = %s, labels_bytes = %s"
                               f" WHERE digest = %s RETURNING {DATASET_COLUMNS}", (npy, sha256, len(npy), digest)).fetchone()
            return record_of(row), True

    def list(self, limit: int, cursor: str | None) -> tuple[list[DatasetRecord], str | None]:
        records = self._page("rev88_datasets", DATASET_COLUMNS, "digest", limit, cursor, record_of)
        return records, next_cursor_of(records, limit, lambda r: (r.created_at, r.digest))

    def _page(self, table: str, columns: str, key: str, limit: int, cursor: str | None, make,
              owner: str | None = None) -> list:
        return page(self.database, table, columns, key, limit, cursor, make, owner)

    def delete(self, digest: str) -> bool:
        hex_of(digest)
        with self.database.transaction(f"delete dataset {digest}") as conn:
            return conn.execute("DELETE FROM rev88_datasets WHERE digest = %s", (digest,)).rowcount > 0

    def create_sweep(self, sweep: SweepRecord) -> tuple[SweepRecord, bool]:
        with self.database.transaction(f"record sweep {sweep.id}") as conn:
            row = conn.execute(
                f"INSERT INTO rev88_sweeps ({SWEEP_COLUMNS}) VALUES (%s, {NOW}, %s, %s, %s, %s, NULL, %s)"
                f" ON CONFLICT (idempotency_key) DO NOTHING RETURNING {SWEEP_COLUMNS}",
                (sweep.id, sweep.dataset, json.dumps(sweep.definition), json.dumps(sweep.cells),
                 sweep.idempotency_key, sweep.owner)).fetchone()
            if row is not None:
                return sweep_of(row), True
            row = conn.execute(f"SELECT {SWEEP_COLUMNS} FROM rev88_sweeps WHERE idempotency_key = %s",
                               (sweep.idempotency_key,)).fetchone()
            return sweep_of(row), False

    def get_sweep(self, sweep_id: str) -> SweepRecord | None:
        row = self.database.read(f"read sweep {sweep_id}", lambda conn: conn.execute(
            f"SELECT {SWEEP_COLUMNS} FROM rev88_sweeps WHERE id = %s", (sweep_id,)).fetchone())
        return None if row is None else sweep_of(row)

    def list_sweeps(self, limit: int, cursor: str | None, owner: str | None = None) -> tuple[list[SweepRecord], str | None]:
        sweeps = self._page("rev88_sweeps", SWEEP_COLUMNS, "id", limit, cursor, sweep_of, owner)
        return sweeps, next_cursor_of(sweeps, limit, lambda r: (r.created_at, r.id))

    def cancel_sweep(self, sweep_id: str) -> None:
        with self.database.transaction(f"cancel sweep {sweep_id}") as conn:
            conn.execute(f"UPDATE rev88_sweeps SET cancelled_at = COALESCE(cancelled_at, {NOW}) WHERE id = %s",
                         (sweep_id,))

    def sweeps_of(self, digest: str) -> list[str]:
        rows = self.database.read(f"list the sweeps of dataset {digest}", lambda conn: conn.execute(
            "SELECT id FROM rev88_sweeps WHERE dataset = %s ORDER BY created_at", (digest,)).fetchall())
        return [r[0] for r in rows]

    def close(self) -> None:  # (the ledger's pool: closed with the ledger)
        pass
