"""One ledger interface, two stores (issue #22).

``TaskLedger`` is what the service asks of a ledger; both stores provide all of it with the same
behaviour, and tests/test_ledger.py runs against each:

    SQLite      app/ledger/store.py     ``Ledger``: embedded, one replica, the data dir
    PostgreSQL  app/ledger/postgres.py  ``PostgresLedger``: many replicas share one database

``shared`` tells them apart where the service must act differently: with a shared ledger an
asynchronous task is not queued on the replica that accepted it but claimed from the database by
whichever replica has an idle worker (``SharedLedger``: claims, leases, fencing, reaping; see
postgres.py). ``open_ledger`` (app/ledger/engines.py) picks the store from the settings: ``database_url`` set means
PostgreSQL, otherwise SQLite in the data dir, as before.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

from .store import FinishedTask, Outcome, TaskRecord


class LeaseLost(Exception):
    """A write of a leased task refused because this replica no longer holds its lease (it
    expired and another replica claimed the task, or it was released): the task's row is left
    as the current holder has it. Its message names the task and who holds it now."""

    def __init__(self, task_id: str, message: str) -> None:
        self.task_id = task_id
        super().__init__(message)


@dataclasses.dataclass
class Claim:
    """A queued asynchronous task this replica has claimed: its record, and the lease's epoch
    (``claims``: the fence a result is written under, together with the owner). ``record`` None:
    not read (app/ledger/local_claims.py checks its status alone; the feeder runs most claims
    from the work it was offered, and reads the others)."""

    record: TaskRecord | None
    epoch: int | None
    task_id: str = ""

    def __post_init__(self) -> None:
        if self.record is not None:
            self.task_id = self.record.id


@dataclasses.dataclass
class Renewal:
    """What a lease renewal found: ids still held, ids lost (expired and taken over, or
    finished by someone else), and held ids whose cancellation was requested."""

    held: list[str]
    lost: list[str]
    cancel: list[str]


@runtime_checkable
class TaskLedger(Protocol):
    """The interface both stores implement (their docstrings hold the details)."""

    shared: bool
    engine: str
    path: Any  # the SQLite file, or the database URL without its password

    def create(self, *, task_id: str, kind: str, mode: str, backend: str, config: dict, options: dict,
               train_count: int, test_count: int, body_sha256: str | None, body_bytes: int,
               input_hashes: dict | None = None, body: bytes | None = None,
               idempotency_key: str | None = None) -> tuple[TaskRecord, bool]: ...

    def create_many(self, tasks: list[dict], messages: list[tuple] | None = None) -> None: ...

    def mark_running(self, task_id: str, device: str | None = None, epoch: int | None = None) -> None: ...

    def mark_running_many(self, started: list[tuple]) -> list[str]: ...

    def finish(self, task_id: str, status: str, answer: dict | None = None, error: dict | None = None,
               answer_json: bytes | None = None, with_answer: bool = True,
               input_hashes: dict | None = None, epoch: int | None = None) -> TaskRecord: ...

    def finish_many(self, outcomes: list[Outcome]) -> list[TaskRecord | Exception]: ...

    def add_finished(self, tasks: list[FinishedTask]) -> None: ...

    def get(self, task_id: str) -> TaskRecord | None: ...

    def get_many(self, task_ids: list[str], predictions: bool = True) -> dict[str, TaskRecord]: ...

    def statuses(self, task_ids: list[str]) -> dict[str, str]: ...

    def list(self, limit: int = 50, cursor: str | None = None, status: str | None = None,
             owner: str | None = None) -> tuple[list[TaskRecord], str | None]: ...

    def unfinished(self) -> list[TaskRecord]: ...

    def count_unfinished(self, owner: str) -> int: ...

    def usage(self, owner: str | None, since: float) -> list[tuple]: ...

    def load_upload(self, task_id: str) -> bytes: ...

    def counts(self) -> dict: ...

    def close(self) -> None: ...


@runtime_checkable
class SharedLedger(TaskLedger, Protocol):
    """What a ledger shared by replicas adds (PostgresLedger)."""

    owner: str

    def claim(self, limit: int) -> list[Claim]: ...

    def renew(self, attempts: dict[str, int] | None = None) -> Renewal: ...

    def held_epoch(self, task_id: str) -> int | None: ...

    def forget(self, task_ids: list[str]) -> None: ...

    def release(self, task_ids: list[str]) -> list[str]: ...

    def reap(self) -> dict[str, int]: ...

    def request_cancel(self, task_id: str) -> tuple[str, TaskRecord | None]: ...

    def load_uploads(self, task_ids: list[str]) -> dict[str, bytes]: ...

    def held(self) -> list[str]: ...

    def stats(self) -> dict: ...


def ledger_engine(ledger: Any) -> str:
    """'sqlite' or 'postgresql' (a ledger without the attribute is the SQLite one)."""
    return getattr(ledger, "engine", "sqlite")


def is_shared(ledger: Any) -> bool:
    return bool(getattr(ledger, "shared", False))
