"""The task ledger: one interface (app/ledger/base.py), two stores -- SQLite (app/ledger/store.py,
the default) and PostgreSQL (app/ledger/postgres.py, REV88_DATABASE_URL: shared by replicas) --
and the thread that writes a run's records (app/ledger/writer.py)."""

from .base import Claim, LeaseLost, Renewal, SharedLedger, TaskLedger, is_shared, ledger_engine
from .engines import open_ledger
from .store import (
    AlreadyFinished,
    FinishedTask,
    IdempotencyConflict,
    Ledger,
    LedgerError,
    LedgerUnavailable,
    Outcome,
    TaskRecord,
)
from .writer import LedgerWriter

__all__ = ["AlreadyFinished", "FinishedTask", "IdempotencyConflict", "Ledger", "LedgerError", "LedgerUnavailable", "LedgerWriter",
           "Outcome", "TaskRecord", "Claim", "LeaseLost", "Renewal", "SharedLedger", "TaskLedger", "is_shared", "ledger_engine",
           "open_ledger"]
