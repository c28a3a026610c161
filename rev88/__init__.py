"""rev88: the front door, above both packages (it may import ``learner`` and ``app``).

``from rev88 import Client`` is the service's Python client (rev88/client.py; docs/client.md);
``rev88.cli`` is the command line. Importing ``rev88`` imports neither ``app`` nor torch.
"""

from .client import (
    Answer,
    AsyncClient,
    BadAnswer,
    BadInput,
    Client,
    ClientError,
    ConnectionFailed,
    Dataset,
    EvaluationResult,
    NotFinished,
    Refused,
    ServerError,
    SweepResult,
    TaskFailed,
    TaskPage,
    TaskStatus,
    TimedOut,
    Unavailable,
)

__all__ = ["Answer", "AsyncClient", "BadAnswer", "BadInput", "Client", "ClientError", "ConnectionFailed", "Dataset",
           "EvaluationResult", "NotFinished", "Refused", "ServerError", "SweepResult", "TaskFailed", "TaskPage", "TaskStatus", "TimedOut",
           "Unavailable"]
