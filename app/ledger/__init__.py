"""The task ledger: the store (SQLite, app/ledger/store.py) and the thread that writes a run's
records (app/ledger/writer.py)."""

from .store import (
    AlreadyFinished,
    FinishedTask,
    IdempotencyConflict,
    Ledger,
    LedgerError,
    LedgerUnavailable,
    TaskRecord,
)
from .writer import LedgerWriter

__all__ = ["AlreadyFinished", "FinishedTask", "IdempotencyConflict", "Ledger", "LedgerError", "LedgerUnavailable", "LedgerWriter",
           "TaskRecord"]
