"""Cooperative cancellation: a token a caller (the service's executor, a test) hands to
``learner.result.run_task`` and may cancel from another thread while the task runs.

    token = CancelToken()
    threading.Thread(target=lambda: run_task(task, config, "cpu-fast", cancel=token)).start()
    token.cancel("timed out")      # the run raises TaskCancelled at its next check

Where each backend checks (the run raises ``learner.errors.TaskCancelled`` with the epoch
and step it would have trained next):

    cpu        before every minibatch, and before scoring the queries
    cpu-fast   the C kernel reads ``flag`` once per minibatch (GIL released, all threads
               stop at the same minibatch), and before scoring
    cuda       before every epoch's graph replay (unverified on a GPU)
    fused      only before the launch; a token cancelled while the launch runs discards
               its result once the launch returns (a running kernel is not interrupted)

``run_task`` also checks after preparation and before building the result, so a
cancelled task never returns a result.
"""

from __future__ import annotations

import threading

import numpy as np

from .errors import TaskCancelled


class CancelToken:
    """A thread-safe, one-way stop request for one task.

    ``flag`` is a numpy int32 array of shape (1,): 0 while the task may run, 1 once
    cancelled. The cpu-fast kernel reads it directly while Python's GIL is released.

    ``progress`` (numpy int64, shape (1,)) is the run's side: the minibatches trained so
    far, set by the cpu and cpu-fast backends after each one and by cuda after each epoch
    (a caller may watch it, e.g. to cancel once a run is known to be under way).
    """

    def __init__(self) -> None:
        self.flag = np.zeros(1, dtype=np.int32)
        self.progress = np.zeros(1, dtype=np.int64)
        self._reason: str | None = None
        self._lock = threading.Lock()

    def cancel(self, reason: str = "cancelled") -> bool:
        """Ask the task to stop. Idempotent: the first reason is kept. True if this call
        cancelled the token, False if it was already cancelled."""
        with self._lock:
            if self._reason is not None:
                return False
            self._reason = str(reason)
            self.flag[0] = 1
            return True

    @property
    def cancelled(self) -> bool:
        return self._reason is not None

    @property
    def reason(self) -> str | None:
        return self._reason

    def check(self, epoch: int, step: int, epochs: int | None = None) -> None:
        """Raise TaskCancelled (naming ``epoch``, ``step``) if the token is cancelled.
        Cheap (one attribute read): the cpu backend calls it before every minibatch."""
        if self._reason is not None:
            raise TaskCancelled(self._reason, epoch, step, epochs)

    def __repr__(self) -> str:
        return f"CancelToken(cancelled={self.cancelled}, reason={self._reason!r})"


def check(token: CancelToken | None, epoch: int, step: int, epochs: int | None = None) -> None:
    """``token.check(...)`` where a token may be absent."""
    if token is not None:
        token.check(epoch, step, epochs)
