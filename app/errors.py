"""Errors the service itself raises (the task's own errors are learner.errors.TaskError).

Each carries its HTTP status and the outcome label counted in /metrics; the
app turns every one into a JSON body ``{"error": message, ...}``.
"""

from __future__ import annotations


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


class Unauthorized(ServiceError):
    status = 401
    outcome = "unauthorized"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": 'Bearer realm="rev88"'}


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


class NotFound(ServiceError):
    status = 404
    outcome = "not_found"


class LedgerDown(ServiceError):
    """The task ledger cannot be read or written (disk full, I/O error): nothing is accepted."""

    status = 503
    outcome = "unavailable"
