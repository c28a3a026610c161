"""Who may see a stored dataset (issue #33). Datasets are stored once, under their SHA-256, whoever
sends the bytes; each tenant that sent (or had the server build) them is one of its owners, a row
``(digest, owner)`` here. Another tenant's dataset is absent to a tenant (404 to HEAD and GET), so
that the store is no oracle for "does anyone have this file".

    SQLite      table ``dataset_owners`` of ``<data_dir>/datasets.sqlite3`` (made here)
    PostgreSQL  ``rev88_dataset_owners`` (migration 0004)

One ``Owners`` store over either, through the database's public API (app/ledger/database.py).
"""

from __future__ import annotations

import time
from typing import Any

from .database import Database, SideStore

SQLITE_TABLE = ("CREATE TABLE IF NOT EXISTS dataset_owners (digest TEXT NOT NULL, owner TEXT NOT NULL,"
                " created_at REAL NOT NULL, PRIMARY KEY (digest, owner))")


class Owners(SideStore):
    tables = {"sqlite": "dataset_owners", "postgresql": "rev88_dataset_owners"}
    datasets_tables = {"sqlite": "datasets", "postgresql": "rev88_datasets"}

    def __init__(self, db: Database) -> None:
        super().__init__(db)
        if db.engine == "sqlite":  # (PostgreSQL's table comes from its migrations)
            self._write("create the dataset owners table", lambda conn: conn.execute(SQLITE_TABLE))

    @property
    def datasets_table(self) -> str:
        return self.datasets_tables[self.db.engine]

    def own(self, digest: str, owner: str) -> bool:
        """``owner`` owns ``digest`` from now on; True when it did not before."""
        return bool(self._write(f"record an owner of dataset {digest}", lambda conn: conn.execute(self._sql(
            f"INSERT INTO {self.table} (digest, owner, created_at) VALUES (?, ?, ?)"
            " ON CONFLICT (digest, owner) DO NOTHING"), (digest, owner, time.time())).rowcount))

    def owns(self, digest: str, owner: str) -> bool:
        return self._read(f"read the owners of dataset {digest}", lambda conn: conn.execute(self._sql(
            f"SELECT 1 FROM {self.table} WHERE digest = ? AND owner = ?"), (digest, owner)).fetchone()) is not None

    def disown(self, digest: str, owner: str | None) -> int:
        """``owner`` (None: every owner) no longer owns it; returns how many owners are left."""

        def run(conn):
            if owner is None:
                conn.execute(self._sql(f"DELETE FROM {self.table} WHERE digest = ?"), (digest,))
            else:
                conn.execute(self._sql(f"DELETE FROM {self.table} WHERE digest = ? AND owner = ?"), (digest, owner))
            return int(conn.execute(self._sql(f"SELECT count(*) FROM {self.table} WHERE digest = ?"),
                                    (digest,)).fetchone()[0])

        return self._write(f"drop an owner of dataset {digest}", run)

    def page(self, owner: str, limit: int, after: tuple[float, str] | None) -> list[str]:
        """The digests ``owner`` owns, newest dataset first (as the datasets' own list pages)."""
        sql = (f"SELECT d.digest, d.created_at FROM {self.datasets_table} d JOIN {self.table} o ON o.digest = d.digest"
               " WHERE o.owner = ?")
        args: list[Any] = [owner]
        if after is not None:
            sql += " AND (d.created_at < ? OR (d.created_at = ? AND d.digest < ?))"
            args += [after[0], after[0], after[1]]
        sql += " ORDER BY d.created_at DESC, d.digest DESC LIMIT ?"
        args.append(limit)
        rows = self._read("list a tenant's datasets", lambda conn: conn.execute(self._sql(sql), args).fetchall())
        return [r[0] for r in rows]


def open_owners(datasets: Any) -> Owners:
    """The owners beside the dataset store (the same engine, the same database)."""
    return Owners(datasets.database)
