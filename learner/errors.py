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
    """Training produced a non-finite loss, scores or state.

    ``details``: ``non_finite`` (what was found non-finite), ``epoch`` and ``step`` (the
    minibatch at which a run was stopped, both counted from 0; None when the problem was
    found after training)."""


class BudgetExceeded(TaskError):
    """The task's estimated work or memory is over the limits (``learner.budget``).

    ``status`` is set per instance: 413 when memory is over its limit, 422 when work is.
    ``details``: ``resource`` ("bytes" or "work"), ``limit``, ``estimate`` and ``env`` (the
    environment variable that sets the limit)."""

    def __init__(self, message: str, status: int = 422, **details: object) -> None:
        super().__init__(message, **details)
        self.status = status


class TaskCancelled(Exception):
    """A run stopped because its ``learner.cancel.CancelToken`` was cancelled.

    Not a TaskError: nothing is wrong with the task; whoever cancelled it knows why
    (``reason``). ``epoch`` and ``step`` (both from 0) name the minibatch the run would
    have trained next; ``epoch == epochs`` means training had finished and the queries
    were not scored (or their result was discarded)."""

    def __init__(self, reason: str, epoch: int, step: int, epochs: int | None = None) -> None:
        self.reason, self.epoch, self.step, self.epochs = reason, epoch, step, epochs
        if epochs is not None and epoch >= epochs:
            where = f"after all {epochs} epochs, before its result"
        elif (epoch, step) == (0, 0):
            where = "before the first minibatch"
        else:
            where = f"before minibatch {step} of epoch {epoch} (both counted from 0)"
        super().__init__(f"task cancelled ({reason}): stopped {where}")
