"""API keys (issue #33): one row per key beside the ledger, so that every replica knows every key.

A key's secret is never stored: only its SHA-256 (``secret_sha256``) and a short ``prefix`` to
recognise it by. A rotation keeps the old hash in ``previous_sha256`` until ``previous_until``
(the grace period), so that clients can move to the new secret without a failed request.
``revoked_at`` set: refused from then on, by every replica that reads the row.

    SQLite      table ``api_keys`` of ``<data_dir>/datasets.sqlite3`` (made here)
    PostgreSQL  ``rev88_keys`` (migration 0004), on the ledger's pool

One ``Keys`` store over either, through the database's public API (app/ledger/database.py).
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from .database import Database, SideStore

COLUMNS = ("id, name, prefix, secret_sha256, previous_sha256, previous_until, scopes, max_queued, max_running,"
           " rate_per_minute, weight, expires_at, created_at, revoked_at, last_used_at")
# The rate limit, a token bucket kept as one number (GCRA): ``rate_tat`` is when the bucket would
# be full again; a request is let through while rate_tat - now <= the burst, and moves it on by
# one request's share of the minute. One atomic UPDATE per limited request, on every replica's rows.
SQLITE_TABLE = (
    "CREATE TABLE IF NOT EXISTS api_keys (id TEXT PRIMARY KEY, name TEXT NOT NULL, prefix TEXT NOT NULL,"
    " secret_sha256 TEXT NOT NULL UNIQUE, previous_sha256 TEXT, previous_until REAL, scopes TEXT NOT NULL,"
    " max_queued INTEGER, max_running INTEGER, rate_per_minute REAL, weight REAL NOT NULL, expires_at REAL,"
    " created_at REAL NOT NULL, revoked_at REAL, last_used_at REAL, rate_tat REAL)")


@dataclasses.dataclass(frozen=True)
class KeyRecord:
    id: str
    name: str
    prefix: str  # the secret's first characters, to recognise it by (not enough to guess it)
    secret_sha256: str
    previous_sha256: str | None
    previous_until: float | None
    scopes: list[str]
    max_queued: int | None
    max_running: int | None
    rate_per_minute: float | None
    weight: float
    expires_at: float | None
    created_at: float
    revoked_at: float | None = None
    last_used_at: float | None = None

    def describe(self) -> dict[str, Any]:
        """What an admin may see: everything but the hashes."""
        return {"id": self.id, "name": self.name, "prefix": self.prefix, "scopes": self.scopes,
                "limits": {"max_queued": self.max_queued, "max_running": self.max_running,
                           "rate_per_minute": self.rate_per_minute, "weight": self.weight},
                "expires_at": self.expires_at, "created_at": self.created_at, "revoked_at": self.revoked_at,
                "last_used_at": self.last_used_at, "previous_secret_valid_until": self.previous_until}


def record_of(row) -> KeyRecord:
    (kid, name, prefix, sha, prev, prev_until, scopes, max_q, max_r, rate, weight, expires, created, revoked,
     used) = row
    return KeyRecord(id=kid, name=name, prefix=prefix, secret_sha256=sha, previous_sha256=prev,
                     previous_until=prev_until, scopes=json.loads(scopes), max_queued=max_q, max_running=max_r,
                     rate_per_minute=rate, weight=float(weight), expires_at=expires, created_at=float(created),
                     revoked_at=revoked, last_used_at=used)


class Keys(SideStore):
    """The keys, in SQL both engines take (``?`` placeholders; the database swaps them for its own)."""

    tables = {"sqlite": "api_keys", "postgresql": "rev88_keys"}

    def __init__(self, db: Database) -> None:
        super().__init__(db)
        if db.engine == "sqlite":  # (PostgreSQL's table comes from its migrations)
            def create(conn):
                conn.execute(SQLITE_TABLE)
                if "rate_tat" not in {row[1] for row in conn.execute("PRAGMA table_info(api_keys)")}:
                    conn.execute("ALTER TABLE api_keys ADD COLUMN rate_tat REAL")
            self._write("create the keys table", create)

    def _one(self, conn, where: str, args: tuple) -> KeyRecord | None:
        row = conn.execute(self._sql(f"SELECT {COLUMNS} FROM {self.table} WHERE {where}"), args).fetchone()
        return None if row is None else record_of(row)

    def create(self, key: KeyRecord) -> KeyRecord:
        def run(conn):
            conn.execute(self._sql(
                f"INSERT INTO {self.table} ({COLUMNS}) VALUES (?, ?, ?, ?, NULL, NULL, ?, ?, ?, ?, ?, ?, ?, NULL, NULL)"),
                (key.id, key.name, key.prefix, key.secret_sha256, json.dumps(key.scopes), key.max_queued,
                 key.max_running, key.rate_per_minute, key.weight, key.expires_at, key.created_at))
            return self._one(conn, "id = ?", (key.id,))

        return self._write(f"record key {key.name!r}", run)

    def get(self, key_id: str) -> KeyRecord | None:
        return self._read(f"read key {key_id}", lambda conn: self._one(conn, "id = ?", (key_id,)))

    def find(self, secret_sha256: str) -> KeyRecord | None:
        """The key whose current secret, or previous one still in its grace period, hashes so."""
        now = time.time()
        return self._read("look up a key", lambda conn: self._one(
            conn, "secret_sha256 = ? OR (previous_sha256 = ? AND previous_until > ?)",
            (secret_sha256, secret_sha256, now)))

    def list(self) -> list[KeyRecord]:
        rows = self._read("list the keys", lambda conn: conn.execute(
            self._sql(f"SELECT {COLUMNS} FROM {self.table} ORDER BY created_at, id")).fetchall())
        return [record_of(r) for r in rows]

    def revoke(self, key_id: str) -> KeyRecord | None:
        def run(conn):
            conn.execute(self._sql(f"UPDATE {self.table} SET revoked_at = COALESCE(revoked_at, ?) WHERE id = ?"),
                         (time.time(), key_id))
            return self._one(conn, "id = ?", (key_id,))

        return self._write(f"revoke key {key_id}", run)

    def rotate(self, key_id: str, secret_sha256: str, prefix: str, grace_until: float) -> KeyRecord | None:
        """A new secret; the current one kept valid until ``grace_until`` (a revoked key: None)."""

        def run(conn):
            conn.execute(self._sql(
                f"UPDATE {self.table} SET previous_sha256 = secret_sha256, previous_until = ?, secret_sha256 = ?,"
                " prefix = ? WHERE id = ? AND revoked_at IS NULL"), (grace_until, secret_sha256, prefix, key_id))
            return self._one(conn, "id = ?", (key_id,))

        return self._write(f"rotate key {key_id}", run)


    def take(self, key_id: str, per_minute: float, now: float) -> tuple[bool, float]:
        """One request against the key's rate (``per_minute``, bursts of up to that many): (let
        through, the bucket's rate_tat afterwards)."""
        interval = 60.0 / per_minute
        burst = 60.0 - interval
        g = self.db.greatest

        def run(conn):
            row = conn.execute(self._sql(
                f"UPDATE {self.table} SET rate_tat = {g}(COALESCE(rate_tat, ?), ?) + ? WHERE id = ?"
                f" AND {g}(COALESCE(rate_tat, ?), ?) - ? <= ? RETURNING rate_tat"),
                (now, now, interval, key_id, now, now, now, burst)).fetchone()
            if row is not None:
                return True, float(row[0])
            row = conn.execute(self._sql(f"SELECT rate_tat FROM {self.table} WHERE id = ?"), (key_id,)).fetchone()
            return False, float(row[0]) if row and row[0] is not None else now

        return self._write(f"count a request of key {key_id}", run)

    def touch(self, key_id: str, when: float) -> None:
        self._write(f"note the use of key {key_id}", lambda conn: conn.execute(
            self._sql(f"UPDATE {self.table} SET last_used_at = ? WHERE id = ?"), (when, key_id)))


def open_keys(datasets: Any) -> Keys:
    """The keys beside the dataset store (the same engine, the same database)."""
    return Keys(datasets.database)
