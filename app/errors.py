"""Errors the service itself raises (the task's own errors are learner.errors.TaskError).

Each carries its HTTP status and the outcome label counted in /metrics. ``error_answer`` is the
one mapping from any exception to its HTTP status, JSON body ``{"error": message, ...,
"request_id": ...}`` and headers: the exception handlers (app/api/errors.py) and the task runner
(a failed task's recorded error) both use it.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from learner.backends import BackendUnavailable
from learner.errors import (
    ArchiveError,
    ArchiveTooLargeError,
    BudgetExceeded,
    TaskError,
    TrainingDivergedError,
)

from .ledger import LedgerUnavailable

log = logging.getLogger("rev88." + __name__)


class ServiceError(Exception):
    status = 500
    outcome = "error"

    def __init__(self, message: str, retry_after: int | None = None, **details: object) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after
        self.details = details

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}


class BadRequest(ServiceError):
    status = 400
    outcome = "bad_archive"


class UploadTimeout(ServiceError):
    """The body did not arrive in time (REV88_UPLOAD_TIMEOUT_S): answered, then the connection closed."""

    status = 408
    outcome = "upload_timeout"

    def headers(self) -> dict[str, str]:
        return {"Connection": "close"}


class BodyTooLarge(ServiceError):
    status = 413
    outcome = "too_large"


class UnsupportedMediaType(ServiceError):
    status = 415
    outcome = "unsupported_media_type"


class InvalidRequest(ServiceError):
    """A request parameter or multipart field the service cannot use."""

    status = 422
    outcome = "invalid"


class QueueFull(ServiceError):
    status = 503
    outcome = "queue_full"


class Unavailable(ServiceError):
    """Draining for shutdown, or the learner failed its startup checks."""

    status = 503
    outcome = "unavailable"


class Requeued(Unavailable):
    """A job fed from the ledger, taken back out of the device queue before it ran (a synchronous
    task under its tenant's share needed the place): it waits in the ledger again, nobody is
    answered with this (app/runtime/executor.py, app/tasks/feeder.py)."""

    outcome = "requeued"


class TaskTimeout(ServiceError):
    status = 504
    outcome = "timeout"


class TaskStopped(ServiceError):
    """The task was cancelled (``POST /tasks/{id}/cancel``) or its client went away; a running
    task was stopped on the device, a queued one never ran."""

    status = 409
    outcome = "stopped"


class Conflict(ServiceError):
    """The request contradicts what the ledger holds: an Idempotency-Key reused with another
    body, or a cancel of a task that has already finished."""

    status = 409
    outcome = "conflict"


class NotAccepted(Exception):
    """A task whose body is parsed by its own job (a synchronous one without an Idempotency-Key,
    app/api/intake.py) turned out not to be acceptable: ``error`` is what parsing or the budget check raised. It is
    answered as that error, as if refused on arrival, and recorded nowhere."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class TooManyRequests(ServiceError):
    """A tenant over one of its key's limits (issue #33): 429 with Retry-After and the IETF
    draft's RateLimit-Policy and RateLimit headers for that limit."""

    status = 429
    outcome = "rate_limited"

    def __init__(self, message: str, retry_after: int, policy: str, remaining: int = 0, **details: object) -> None:
        super().__init__(message, retry_after=retry_after, **details)
        self.policy, self.remaining = policy, remaining

    def headers(self) -> dict[str, str]:
        name = self.policy.split(";", 1)[0]
        return {**super().headers(), "RateLimit-Policy": self.policy,
                "RateLimit": f"{name};r={self.remaining};t={self.retry_after}"}


class Forbidden(ServiceError):
    """The key is valid but lacks the scope the route needs (an admin route, a write with a
    read-only key)."""

    status = 403
    outcome = "forbidden"


class NotFound(ServiceError):
    status = 404
    outcome = "not_found"


def outcome_of(exc: BaseException) -> str:
    """The /metrics outcome label of a failed request."""
    if isinstance(exc, ServiceError):
        return exc.outcome
    if isinstance(exc, ArchiveTooLargeError):
        return "too_large"
    if isinstance(exc, ArchiveError):
        return "bad_archive"
    if isinstance(exc, TrainingDivergedError):
        return "diverged"
    if isinstance(exc, BudgetExceeded):
        return "over_budget"
    if isinstance(exc, (TaskError, BackendUnavailable)):
        return "invalid"
    return "error"


def json_safe(details: dict[str, Any]) -> dict[str, Any]:
    """Error details as plain JSON values (anything else becomes its str())."""
    return json.loads(json.dumps(details, default=str))


def error_answer(exc: BaseException, request_id: str | None) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, JSON body, headers) of the error answer for ``exc``."""
    headers: dict[str, str] = {}
    if isinstance(exc, ServiceError):
        status, body, headers = exc.status, {"error": exc.message, **json_safe(exc.details)}, exc.headers()
    elif isinstance(exc, TaskError):
        status, body = exc.status, {"error": exc.message, "type": type(exc).__name__, **json_safe(exc.details)}
    elif isinstance(exc, BackendUnavailable):
        status, body = 422, {"error": str(exc), "type": "BackendUnavailable"}
    elif isinstance(exc, LedgerUnavailable):
        status, body, headers = 503, {"error": f"the task ledger is unavailable: {exc}"}, {"Retry-After": "5"}
        if exc.outcome_unknown:  # (its COMMIT may have gone through: a retry needs an Idempotency-Key)
            body["accepted"] = "unknown"
    else:
        log.error("unexpected error", exc_info=exc)
        status, body = 500, {"error": f"internal error: {type(exc).__name__}: {exc}"}
    body["request_id"] = request_id
    return status, body, headers
