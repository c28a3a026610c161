"""Which store a ledger is: ``open_ledger`` picks it from the settings (its own module, so that
the interface, app/ledger/base.py, never imports a store that implements it)."""

from __future__ import annotations

from typing import Any

from .base import TaskLedger
from .store import Ledger


def open_ledger(settings: Any, owner: str | None = None) -> TaskLedger:
    """The ledger the settings name: PostgreSQL at ``settings.database_url`` when it is set
    (migrated at open, under an advisory lock), else SQLite in ``settings.ledger_dir``. A
    ledger that cannot be opened raises LedgerError naming the database and the problem."""
    url = getattr(settings, "database_url", None)
    if not url:
        return Ledger(settings.ledger_dir, settings.retain_tasks, settings.retain_bytes)
    from .postgres import PostgresLedger  # psycopg is needed only here (the `postgres` extra)

    return PostgresLedger(
        url, retain_tasks=settings.retain_tasks, retain_bytes=settings.retain_bytes,
        pool_size=settings.db_pool_size, timeout_s=settings.db_timeout_s, lease_s=settings.lease_s,
        lease_attempts=settings.lease_attempts, owner=owner,
    )


def open_datasets(settings: Any, ledger: TaskLedger):
    """The datasets beside the ledger (app/ledger/datasets.py): in the shared PostgreSQL database
    with a shared ledger, else in the data dir."""
    if getattr(ledger, "shared", False):
        from .datasets_pg import PostgresDatasets

        return PostgresDatasets(ledger, settings.dataset_bytes)
    from .datasets import SqliteDatasets

    return SqliteDatasets(settings.ledger_dir, settings.dataset_bytes)
