"""The public connection API of a store's database, and the small base every side store stands on.

The task ledgers (SQLite: app/ledger/store.py; PostgreSQL: app/ledger/postgres.py) and the SQLite
dataset store each give their database as ``.database``: a ``Database``, which is all that the
side stores beside them (keys, dataset owners, evaluations, the webhook outbox) may use of it:

    engine        "sqlite" or "postgresql"
    sql(text)     the text with ``?`` placeholders as the engine takes them (``%s`` for psycopg)
    query(conn, text, args)      the text run on a connection: its cursor
    read(doing, fn)              fn(connection) on a connection for reading; its value
    write(doing, fn, durable)    fn(connection) in one transaction, committed (``durable=False``:
                                 SQLite commits without waiting for the disk), its value
    transaction(doing, durable)  the same as a context manager giving the connection
    greatest, skip_locked        the two pieces of SQL the side stores write differently per engine

Database failures arrive as ``LedgerUnavailable`` naming what was being done (``doing``) and the
database; integrity errors pass through for the caller to judge.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

MIGRATIONS_DIR = Path(__file__).with_name("migrations")  # PostgreSQL's; SQLite's in its sqlite/ folder
_MIGRATION_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")

Connect = Callable[..., contextlib.AbstractContextManager]


def load_migrations(folder: Path) -> list[tuple[int, str, str]]:
    """(version, name, SQL) of every NNNN_name.sql file of ``folder``, in order; numbered 1..N
    without gaps (ValueError otherwise: a packaging mistake, caught by the tests)."""
    found = []
    for path in sorted(folder.glob("*.sql")):
        m = _MIGRATION_NAME.match(path.name)
        if not m:
            raise ValueError(f"migration file {path} is not named NNNN_name.sql")
        found.append((int(m[1]), m[2], path.read_text(encoding="utf-8")))
    if [v for v, _, _ in found] != list(range(1, len(found) + 1)):
        raise ValueError(f"migrations in {folder} must be numbered 0001.. without gaps, found "
                         f"{[v for v, _, _ in found]}")
    return found


class Database:
    """A store's database, as the side stores use it (see the module's docstring)."""

    engine = ""
    greatest = "MAX"
    skip_locked = ""

    def __init__(self, read: Connect, write: Connect) -> None:
        """``read(doing)``: a context manager giving a connection to read on; ``write(doing,
        durable)``: one giving a connection inside a transaction, committed when it exits."""
        self._reading, self._writing = read, write

    def sql(self, text: str) -> str:
        return text

    def query(self, conn: Any, text: str, args: Any = ()) -> Any:
        """``text`` (``?`` placeholders) run on ``conn`` with ``args``: the cursor."""
        return conn.execute(self.sql(text), args)

    def read(self, doing: str, fn: Callable[[Any], Any]) -> Any:
        with self._reading(doing) as conn:
            return fn(conn)

    def write(self, doing: str, fn: Callable[[Any], Any], durable: bool = True) -> Any:
        with self._writing(doing, durable) as conn:
            return fn(conn)

    def transaction(self, doing: str, durable: bool = True) -> contextlib.AbstractContextManager:
        return self._writing(doing, durable)


class SqliteDatabase(Database):
    engine = "sqlite"


class PostgresDatabase(Database):
    engine = "postgresql"
    greatest = "GREATEST"
    skip_locked = " FOR UPDATE SKIP LOCKED"

    def __init__(self, read: Callable[[str, Callable[[Any], Any]], Any], write: Connect) -> None:
        """``read(doing, fn)``: the ledger's idempotent read (tried again on a fresh connection
        when the first was lost); ``write(doing, durable)``: a pooled connection in a transaction."""
        super().__init__(read=None, write=write)  # type: ignore[arg-type]
        self._read_with_retry = read

    def sql(self, text: str) -> str:
        return text.replace("?", "%s")

    def query(self, conn: Any, text: str, args: Any = ()) -> Any:
        return conn.execute(self.sql(text), args, binary=True)  # (bytea as bytes, not hex text)

    def read(self, doing: str, fn: Callable[[Any], Any]) -> Any:
        return self._read_with_retry(doing, fn)


@contextlib.contextmanager
def immediate_transaction(connection: Connect, doing: str) -> Iterator[Any]:
    """SQLite: one write transaction (BEGIN IMMEDIATE .. COMMIT, ROLLBACK on any error) on the
    connection ``connection(doing)`` gives (which holds the store's lock)."""
    with connection(doing) as conn:
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")


class SideStore:
    """A store of rows beside a ledger (keys, dataset owners, evaluations, the webhook outbox): its
    database, through the public API above, and its table's name on each engine."""

    tables: dict[str, str] = {}  # engine -> the table's name there

    def __init__(self, db: Database) -> None:
        self.db = db

    @property
    def engine(self) -> str:
        return self.db.engine

    @property
    def table(self) -> str:
        return self.tables[self.db.engine]

    def _sql(self, text: str) -> str:
        return self.db.sql(text)

    def _read(self, doing: str, fn: Callable[[Any], Any]) -> Any:
        return self.db.read(doing, fn)

    def _write(self, doing: str, fn: Callable[[Any], Any], durable: bool = True) -> Any:
        return self.db.write(doing, fn, durable)
