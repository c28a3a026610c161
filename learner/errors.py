"""Errors a task can raise. Each carries the HTTP status the service answers with,
so the CLI and the service classify a problem the same way."""

from __future__ import annotations


class TaskError(Exception):
    """Base class: something about the task (not the service) is wrong."""

    status = 422

    def __init__(self, message: str, **details: object) -> None:
        super().__init__(message)
        self.message = message
        self.details = details


class ConfigError(TaskError):
    """An unknown config key or a value out of range."""


class ArchiveError(TaskError):
    """Not a zip/npz, truncated or corrupt."""

    status = 400


class ArchiveMemberError(TaskError):
    """The archive holds members besides the three allowed (e.g. query labels)."""


class ArchiveTooLargeError(TaskError):
    """Declared or actual sizes over the limits (zip bombs, oversized arrays)."""

    status = 413


class InputError(TaskError):
    """An array has the wrong dtype, shape, range or label values."""


class TrainingDivergedError(TaskError):
    """Training produced non-finite scores or state."""
