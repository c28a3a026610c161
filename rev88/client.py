"""``rev88.Client``: the Python client of the rev88 service (one keep-alive ``httpx.Client``).

::

    from rev88 import Client

    with Client("http://127.0.0.1:8000", api_key=None) as client:
        answer = client.run("task.npz", backend="cpu", epochs=3)   # POST /tasks, waits for the answer
        answer.predictions          # numpy int64, checked against answer.predictions_sha256
        task_id = client.submit("task.npz")                        # Prefer: respond-async -> the id
        answer = client.wait(task_id, timeout=600)                 # polls GET /tasks/{id}

A task is a path to an npz file (streamed from disk), the npz bytes, or a mapping (or a
``learner.taskio.TaskArrays``) of exactly ``train_images``, ``train_labels`` and ``test_images``,
which the client writes as an npz; a mapping with any other key (query labels above all) is
refused with ``BadInput`` before anything is sent. Config overrides (``epochs=3``) go as query
parameters, as the service reads them; the service validates them.

Errors (all ``ClientError``: ``.status``, ``.message``, ``.document``, ``.url``):

    Refused           a 4xx answer: ``.message`` is the service's own ``error`` text
    ServerError       a 5xx answer (``Unavailable``: a 503 still there after the retries)
    ConnectionFailed  no connection, or it broke (httpx's transport errors, the URL named)
    TimedOut          no answer within ``timeout`` (``NotFinished``: ``wait`` ran out of time)
    TaskFailed        ``wait``: the task failed or was cancelled (its status document attached)
    BadAnswer         an answer that is not what the service documents (e.g. a hash mismatch)
    BadInput          refused here, before anything was sent (also a ``ValueError``)

Retry policy, the one of the whole project (the CLI and ``rev88 evaluate --url`` use it): a
``503`` (queue full, starting, draining) is retried at most ``retries`` times (default 5). Before
each retry the client waits what the service's ``Retry-After`` says (delta-seconds, or an HTTP
date: the seconds until then; a date in the past is 0); without a usable ``Retry-After`` it waits
1 s, then 2, 4, 8 ... (``DEFAULT_RETRY_WAIT_S * 2**retry``). Every wait is capped at ``max_wait``
(default 120 s), so ``retries`` waits take at most ``retries * max_wait``. Nothing else is retried:
not a connection failure, not a timeout, not another status. A refused 503 was not accepted, so
retrying a POST never trains a task twice (an ``Idempotency-Key`` makes any resubmission safe) --
except a 503 whose body says ``"accepted": "unknown"`` (the shared ledger lost its database
connection during the task's commit and could not read it back): that one is retried only when
the request carries an Idempotency-Key; without one it is raised (``Unavailable``) at once.

``wait`` polls every 0.1 s at first, the interval growing by half each time to at most 2 s.

``AsyncClient`` is the same client over ``httpx.AsyncClient``: every operation is written once,
as a generator that yields the requests (and pauses) it needs; ``Client`` and ``AsyncClient``
only carry them out.
"""

from __future__ import annotations

import asyncio
import email.utils
import hashlib
import io
import json
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any
from urllib.parse import quote, urljoin

import httpx
import numpy as np

from learner import __version__
from learner.hashing import array_sha256
from learner.taskio import ALLOWED_MEMBERS, LABEL_WORDS, task_to_npz_bytes

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 900.0  # seconds to wait for an answer (read and write); a task trains meanwhile
CONNECT_TIMEOUT_S = 10.0
DEFAULT_RETRIES = 5
DEFAULT_RETRY_WAIT_S = 1.0  # a 503 without Retry-After: 1 s, doubling with each retry
MAX_RETRY_WAIT_S = 120.0  # the longest single wait, whatever Retry-After says
POLL_FIRST_S, POLL_MAX_S, POLL_GROWTH = 0.1, 2.0, 1.5
CHUNK = 256 * 1024  # upload chunk
TASK_STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")  # the ledger's (app.ledger)
FINISHED = ("succeeded", "failed", "cancelled")
OPTION_PARAMS = ("backend", "include", "measure", "trials", "target_seconds", "settle_seconds", "idle_seconds")
JSON = "application/json"
NPZ_BODY = "application/octet-stream"


# --------------------------------------------------------------------------- errors


class ClientError(Exception):
    """Anything the client could not do. ``status``: the HTTP status (None when there was no
    answer); ``message``: the service's own error text where it sent one, else the description;
    ``document``: the JSON the service answered (or the task's status document), if any."""

    def __init__(self, text: str, *, message: str | None = None, status: int | None = None,
                 document: dict[str, Any] | None = None, url: str | None = None) -> None:
        super().__init__(text)
        self.message = text if message is None else message
        self.status, self.document, self.url = status, document, url


class BadInput(ClientError, ValueError):
    """Refused by the client itself, before any request: a task it will not send, a bad argument."""


class Refused(ClientError):
    """The service refused the request (4xx); ``message`` is its ``error``."""


class ServerError(ClientError):
    """The service failed (5xx)."""


class Unavailable(ServerError):
    """503 (queue full, starting, draining, ledger unavailable) still after the retries.
    ``retry_after``: the seconds the last answer asked to wait (None without a usable header)."""

    def __init__(self, text: str, *, retry_after: float | None = None, **kw: Any) -> None:
        super().__init__(text, **kw)
        self.retry_after = retry_after


class ConnectionFailed(ClientError):
    """No connection to the service, or the connection broke (an httpx transport error)."""


class TimedOut(ClientError):
    """No answer within the client's timeout."""


class NotFinished(TimedOut):
    """``wait``: the task had not finished within its timeout; ``document``: its last status."""


class TaskFailed(ClientError):
    """``wait``/``run``: the task failed or was cancelled. ``document``: its status document;
    ``status``: the HTTP status its error was recorded with (e.g. 422, 504), ``task_status``:
    ``"failed"`` or ``"cancelled"``."""

    def __init__(self, text: str, *, task_status: str, **kw: Any) -> None:
        super().__init__(text, **kw)
        self.task_status = task_status


class BadAnswer(ClientError):
    """An answer unlike what the service documents: not JSON, missing fields, or predictions that
    do not hash to the ``predictions_sha256`` sent with them."""


# --------------------------------------------------------------------------- the retry policy


def _outcome_unknown(response: httpx.Response) -> bool:
    """A 503 that says the task may have been recorded after all (``"accepted": "unknown"``)."""
    try:
        doc = response.json()
    except ValueError:
        return False
    return isinstance(doc, dict) and doc.get("accepted") == "unknown"


def retry_after_seconds(value: str | None, attempt: int = 0, cap: float = MAX_RETRY_WAIT_S) -> float:
    """Seconds to wait before retry ``attempt + 1`` (``attempt`` counts from 0) after a 503 whose
    Retry-After header is ``value``: its delta-seconds, or the seconds until its HTTP date (never
    below 0); without a usable value ``DEFAULT_RETRY_WAIT_S * 2**attempt``; at most ``cap``."""
    wait = _retry_after(value)
    if wait is None:
        wait = DEFAULT_RETRY_WAIT_S * 2.0 ** min(max(attempt, 0), 30)
    return min(wait, cap)


def _retry_after(value: str | None) -> float | None:
    if value is None or not value.strip():
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when is None:
            return None
        seconds = when.timestamp() - time.time()
    return max(0.0, seconds) if math.isfinite(seconds) else None


# --------------------------------------------------------------------------- what the service answers


@dataclass(frozen=True, eq=False)
class Answer:
    """A succeeded task's answer (POST /tasks, or GET /tasks/{id} once succeeded).

    ``document`` is the JSON as sent. ``predictions`` and ``scores`` are decoded on first use and
    checked then against ``predictions_sha256`` and ``scores_sha256`` (the learner's array hash,
    ``learner.hashing.array_sha256``); a mismatch raises ``BadAnswer``. ``verify()`` checks both now.
    """

    document: dict[str, Any]

    def __post_init__(self) -> None:
        doc = self.document
        if not isinstance(doc, dict) or not isinstance(doc.get("predictions"), list) \
                or not isinstance(doc.get("predictions_sha256"), str) \
                or not isinstance(doc.get("metadata", {}), dict):
            raise BadAnswer("the service's answer is not the documented JSON (a predictions list, "
                            "predictions_sha256, metadata)", document=doc if isinstance(doc, dict) else None)

    @property
    def task_id(self) -> str | None:
        return self.document.get("id")

    @property
    def status(self) -> str:
        return "succeeded"

    @property
    def finished(self) -> bool:
        return True  # as TaskStatus.finished: what get() returns answers it either way

    @property
    def predictions_sha256(self) -> str:
        return self.document["predictions_sha256"]

    @property
    def scores_sha256(self) -> str | None:
        return self.document.get("scores_sha256")

    @property
    def metadata(self) -> dict[str, Any]:
        return self.document.get("metadata") or {}

    @property
    def timing(self) -> dict[str, Any]:
        return self.document.get("timing") or {}

    @property
    def energy(self) -> dict[str, Any] | None:
        return self.document.get("energy")

    @cached_property
    def predictions(self) -> np.ndarray:
        """(M,) int64, one class 0..9 per query, checked against ``predictions_sha256``."""
        raw = self.document["predictions"]
        if not all(type(p) is int and 0 <= p <= 9 for p in raw):
            raise BadAnswer("the service's predictions are not all class numbers 0..9", document=self.document)
        array = np.asarray(raw, dtype=np.int64).reshape(len(raw))
        digest = array_sha256(array)
        for where, claimed in (("predictions_sha256", self.predictions_sha256),
                               ("metadata.predictions_sha256", self.metadata.get("predictions_sha256", digest))):
            if digest != claimed:
                raise BadAnswer(f"the service's predictions do not hash to the {where} it reported ({claimed}); "
                                f"they hash to {digest}", document=self.document)
        return array

    @cached_property
    def scores(self) -> np.ndarray | None:
        """(M, 10) float32 when asked for (``include_scores=True``), checked against ``scores_sha256``."""
        raw = self.document.get("scores")
        if raw is None:
            return None
        try:
            array = np.asarray(raw, dtype=np.float32)  # the JSON floats are float32 values exactly
        except (TypeError, ValueError):
            raise BadAnswer("the service's scores are not an (M, 10) table of numbers", document=self.document) from None
        if array.ndim != 2 or array.shape[0] != len(self.document["predictions"]):
            raise BadAnswer(f"the service's scores have shape {array.shape}, not (queries, classes)",
                            document=self.document)
        if self.scores_sha256 is not None and array_sha256(array) != self.scores_sha256:
            raise BadAnswer(f"the service's scores do not hash to the scores_sha256 it reported ({self.scores_sha256})",
                            document=self.document)
        return array

    def verify(self) -> Answer:
        """Decode and check the predictions (and scores) now; returns self."""
        _ = self.predictions, self.scores
        return self


@dataclass(frozen=True, eq=False)
class TaskStatus:
    """A task that is not (or not yet) an answer: its status document (GET /tasks/{id} while
    queued or running or once failed or cancelled, the 202 of an asynchronous submit, a cancel's
    answer, or one summary of GET /tasks). ``location``: the task's absolute URL from a 202."""

    document: dict[str, Any]
    location: str | None = None

    @property
    def id(self) -> str:
        return str(self.document.get("id", ""))

    @property
    def status(self) -> str:
        return str(self.document.get("status", ""))

    @property
    def finished(self) -> bool:
        return self.status in FINISHED

    @property
    def error(self) -> dict[str, Any] | None:
        """A failed or cancelled task's recorded error: ``{"status": 422, "error": "..."}``."""
        err = self.document.get("error")
        return err if isinstance(err, dict) else None


@dataclass(frozen=True)
class Dataset:
    """A dataset stored on the service (``put_dataset`` answers one): pass it where a task goes
    (``run``, ``submit``, ``send``) to train on it without sending it again."""

    digest: str

    def __post_init__(self) -> None:
        if not (isinstance(self.digest, str) and self.digest.startswith("sha256:") and len(self.digest) == 71):
            raise BadInput(f"a dataset is named by its digest, sha256:<64 hex digits>, got {self.digest!r}")


@dataclass(frozen=True)
class SweepResult:
    """A sweep's document (GET /sweeps/{id}): ``status``, ``counts``, and ``rows`` (one per cell:
    its ``config``, ``status``, ``task_id``, ``predictions_sha256``, ``timing``, and
    ``correct``/``accuracy`` when the dataset has labels)."""

    document: dict[str, Any]

    @property
    def id(self) -> str:
        return self.document["id"]

    @property
    def status(self) -> str:
        return self.document["status"]

    @property
    def finished(self) -> bool:
        return self.status in ("completed", "cancelled")

    @property
    def counts(self) -> dict[str, int]:
        return self.document["counts"]

    @property
    def rows(self) -> list[dict[str, Any]]:
        return self.document["cells"]


@dataclass(frozen=True)
class EvaluationResult:
    """An evaluation's document (GET /evaluations/{id}): ``status``, ``draws`` (one row per draw:
    ``correct``, ``accuracy``, ``predictions_sha256``, ``task_id``...) and, once every draw has
    succeeded, ``totals`` (as ``rev88 evaluate``'s summary.json has them)."""

    document: dict[str, Any]

    @property
    def id(self) -> str:
        return self.document["id"]

    @property
    def status(self) -> str:
        return self.document["status"]

    @property
    def finished(self) -> bool:
        return self.status in ("completed", "failed", "cancelled")

    @property
    def draws(self) -> list[dict[str, Any]]:
        return self.document["draws"]

    @property
    def totals(self) -> dict[str, Any] | None:
        return self.document.get("totals")


@dataclass(frozen=True)
class TaskPage:
    """One page of GET /tasks: its summaries, newest first, and the next page's cursor (None: the last)."""

    tasks: list[TaskStatus]
    next_cursor: str | None


# --------------------------------------------------------------------------- requests (shared by both clients)


ProgressCallback = Callable[[int, int], None]  # (bytes sent so far in this try, total bytes)


class _Body:
    """An upload, made afresh for each try (a retried request sends the whole body again)."""

    def __init__(self, source: Path | bytes, progress: ProgressCallback | None) -> None:
        self.source, self.progress = source, progress
        self.size = source.stat().st_size if isinstance(source, Path) else len(source)

    def sync(self) -> bytes | Iterator[bytes]:
        if isinstance(self.source, bytes) and self.progress is None:
            return self.source
        return self._chunks()

    def _chunks(self) -> Iterator[bytes]:
        report = self.progress or _no_progress
        sent = 0
        report(0, self.size)
        with self._open() as fh:
            while chunk := fh.read(CHUNK):
                yield chunk
                sent += len(chunk)
                report(sent, self.size)

    async def aiter(self) -> AsyncIterator[bytes]:
        report = self.progress or _no_progress
        sent = 0
        report(0, self.size)
        with self._open() as fh:
            while chunk := await asyncio.to_thread(fh.read, CHUNK):
                yield chunk
                sent += len(chunk)
                report(sent, self.size)

    def _open(self):
        return open(self.source, "rb") if isinstance(self.source, Path) else io.BytesIO(self.source)


def _no_progress(sent: int, total: int) -> None:
    pass


@dataclass
class _Call:
    """One HTTP request an operation needs. ``what`` names it in error messages."""

    method: str
    url: str
    what: str
    params: list[tuple[str, str]] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)
    body: _Body | None = None
    retry: bool = True  # retry a 503 (not for /health, whose 503 is an answer: "not ready")


@dataclass(frozen=True)
class _Pause:
    seconds: float


Op = Generator["_Call | _Pause", "httpx.Response | None", Any]


def _task_body(task: Any, progress: ProgressCallback | None) -> _Body:
    """The npz to upload, from a path, npz bytes, or a mapping/TaskArrays of the three arrays.
    A mapping with any other key is refused here: nothing has been sent."""
    if isinstance(task, (str, os.PathLike)):
        path = Path(task)
        if not path.is_file():
            raise BadInput(f"task file not found: {path}")
        return _Body(path, progress)
    if isinstance(task, (bytes, bytearray, memoryview)):
        return _Body(bytes(task), progress)
    if hasattr(task, "as_dict") and not isinstance(task, Mapping):  # learner.taskio.TaskArrays
        task = task.as_dict()
    if not isinstance(task, Mapping):
        raise BadInput(f"a task is a path to an npz file, npz bytes, or a mapping of {', '.join(ALLOWED_MEMBERS)}; "
                       f"got {type(task).__name__}")
    names = [str(k) for k in task]
    extra = [n for n in names if n not in ALLOWED_MEMBERS]
    if extra:
        labels = [n for n in extra if any(w in n.lower() for w in LABEL_WORDS)]
        note = (" — query labels must never be sent: the service sees only the task's three arrays"
                if labels else "")
        raise BadInput(f"the task mapping holds key(s) not allowed: {', '.join(map(repr, extra))}{note}; "
                       f"allowed are exactly {', '.join(ALLOWED_MEMBERS)}; nothing was sent")
    missing = [m for m in ALLOWED_MEMBERS if m not in names]
    if missing:
        raise BadInput(f"the task mapping is missing {', '.join(missing)}; nothing was sent")
    arrays = {name: np.asarray(task[name]) for name in ALLOWED_MEMBERS}
    for name, arr in arrays.items():
        if arr.dtype.hasobject:
            raise BadInput(f"the task's {name} is an array of Python objects ({arr.dtype}); "
                           "it must be numbers (the service never unpickles); nothing was sent")
    return _Body(task_to_npz_bytes(arrays), progress)


def _param(name: str, value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise BadInput(f"config override {name} must be a number, got {value!r}")
    return repr(value) if isinstance(value, float) else str(value)


def _task_params(backend: str | None, include_scores: bool, config: Mapping[str, Any]) -> list[tuple[str, str]]:
    reserved = [k for k in config if k in OPTION_PARAMS]
    if reserved:
        raise BadInput(f"{', '.join(reserved)}: not config fields (use backend=..., include_scores=True)")
    params = [("backend", str(backend))] if backend else []
    if include_scores:
        params.append(("include", "scores"))
    config, hook = _webhook_options(config)
    params += [(k, v if isinstance(v, str) else ",".join(v)) for k, v in hook.items()]
    params += [(str(k), _param(str(k), v)) for k, v in config.items()]
    return params


WEBHOOK_OPTIONS = ("webhook", "webhook_events")


def _webhook_options(config: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config overrides, webhook options): ``webhook=<url>`` and ``webhook_events=["started",
    "completed"]`` (or a comma string) are a request's webhook (docs/webhooks.md), not config."""
    rest = {k: v for k, v in config.items() if k not in WEBHOOK_OPTIONS}
    hook = {}
    for name in WEBHOOK_OPTIONS:
        value = config.get(name)
        if value is None:
            continue
        if name == "webhook" and not isinstance(value, str):
            raise BadInput(f"webhook must be a URL string, got {value!r}")
        if name == "webhook_events":
            value = [value] if isinstance(value, str) else list(value)
            if not all(isinstance(v, str) for v in value):
                raise BadInput(f"webhook_events must be event names (started, completed), got {value!r}")
        hook[name] = value
    return rest, hook


def error_message(response: httpx.Response) -> str:
    """The service's ``{"error": ...}`` text, or the start of whatever it sent."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        for key in ("error", "detail"):
            if key in body:
                value = body[key]
                return value if isinstance(value, str) else str(value)[:300]
    text = response.text.strip()
    return text[:300] if text else response.reason_phrase or "no message"


def _document(response: httpx.Response) -> dict[str, Any] | None:
    try:
        doc = response.json()
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def _json_object(response: httpx.Response) -> dict[str, Any]:
    doc = _document(response)
    if doc is None:
        raise BadAnswer(f"the server answered {response.status_code} but not with a JSON object: "
                        f"{response.text[:200]!r}", status=response.status_code, url=str(response.url))
    return doc


def _http_error(response: httpx.Response, call: _Call, retries: int) -> ClientError:
    status, message = response.status_code, error_message(response)
    kw = {"message": message, "status": status, "document": _document(response), "url": call.url}
    if status == 503:
        return Unavailable(f"server still busy after {retries} retries (503): {message}",
                           retry_after=_retry_after(response.headers.get("Retry-After")), **kw)
    if 400 <= status < 500:
        return Refused(f"the server refused {call.what} ({status}): {message}", **kw)
    if status >= 500:
        return ServerError(f"the server failed ({status}): {message}", **kw)
    return BadAnswer(f"the server answered {call.what} with an unexpected {status}: {message}", **kw)


def _transport_error(exc: httpx.HTTPError, call: _Call) -> ClientError:
    if isinstance(exc, httpx.TimeoutException):
        return TimedOut(f"no answer from {call.url} within the timeout ({type(exc).__name__})", url=call.url)
    if isinstance(exc, httpx.ConnectError):
        return ConnectionFailed(f"cannot connect to {call.url}: {exc} (is the service running?)", url=call.url)
    return ConnectionFailed(f"request to {call.url} failed: {type(exc).__name__}: {exc}", url=call.url)


def task_error_text(doc: dict[str, Any]) -> str:
    """A failed or cancelled task's recorded error as text: ``(422) what was wrong``."""
    err = doc.get("error")
    if isinstance(err, dict):
        code = err.get("status")
        return f"({code}) {err.get('error', 'no message')}" if code is not None else str(err.get("error"))
    return str(err) if err else "no error recorded"


def _outcome(doc: dict[str, Any], location: str | None = None) -> Answer | TaskStatus:
    if doc.get("status") == "succeeded" and "predictions" in doc:
        return Answer(doc)
    return TaskStatus(doc, location)


def base_url(url: str) -> str:
    """The service's base URL from its base or its /tasks URL; BadInput unless http(s)."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise BadInput(f"the service URL must start with http:// or https://, got {url!r}")
    url = url.rstrip("/")
    return url[: -len("/tasks")] if url.endswith("/tasks") else url


class _Core:
    """Everything both clients share: settings, request building, answer parsing, and each
    operation as a generator (it yields a ``_Call`` and is sent the response, or a ``_Pause``)."""

    def __init__(self, url: str, api_key: str | None, timeout: float, retries: int, max_wait: float,
                 on_retry: Callable[[Unavailable, float, int], None] | None, clock: Callable[[], float]) -> None:
        self.url = base_url(url)
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise BadInput(f"retries must be an integer >= 0, got {retries!r}")
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise BadInput(f"timeout must be > 0 seconds, got {timeout!r}")
        if not (isinstance(max_wait, (int, float)) and max_wait >= 0):
            raise BadInput(f"max_wait must be >= 0 seconds, got {max_wait!r}")
        self.api_key, self.timeout, self.retries, self.max_wait = api_key, float(timeout), retries, float(max_wait)
        self.on_retry, self._clock = on_retry, clock

    def _httpx_options(self) -> dict[str, Any]:
        headers = {"User-Agent": f"rev88-client/{__version__}"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        timeout = httpx.Timeout(connect=CONNECT_TIMEOUT_S, read=self.timeout, write=self.timeout, pool=CONNECT_TIMEOUT_S)
        return {"headers": headers, "timeout": timeout}

    @property
    def tasks_url(self) -> str:
        return self.url + "/tasks"

    def task_url(self, task_id: str) -> str:
        """``…/tasks/{id}``, the id quoted (an id never needs it; a typo might)."""
        if not isinstance(task_id, str) or not task_id.strip():
            raise BadInput("a task id is required")
        return f"{self.tasks_url}/{quote(task_id.strip(), safe='')}"

    # ------------------------------------------------------------------ the exchange
    def _exchange(self, call: _Call) -> Op:
        """One request; a 503 retried as the policy says (module docstring). Returns the last response."""
        for attempt in range(self.retries + 1):
            response = yield call
            if response.status_code != 503 or not call.retry or attempt == self.retries:
                return response
            if _outcome_unknown(response) and "Idempotency-Key" not in (call.headers or {}):
                return response  # it may have been recorded: resending it could train it twice
            wait = retry_after_seconds(response.headers.get("Retry-After"), attempt, self.max_wait)
            busy = _http_error(response, call, self.retries)
            if self.on_retry is not None:
                self.on_retry(busy, wait, attempt + 1)
            else:
                log.warning("%s: 503 %s; retry %d of %d in %.1f s", call.url, busy.message, attempt + 1,
                            self.retries, wait)
            yield _Pause(wait)
        raise AssertionError("unreachable")  # the last try returns whatever it got

    def _expect(self, call: _Call, *ok: int) -> Op:
        response = yield from self._exchange(call)
        if response.status_code not in ok:
            raise _http_error(response, call, self.retries)
        return response

    # ------------------------------------------------------------------ operations
    def _op_send(self, task: Any, respond_async: bool, backend: str | None, include_scores: bool,
                 idempotency_key: str | None, progress: ProgressCallback | None, config: Mapping[str, Any]) -> Op:
        params = _task_params(backend, include_scores, config)
        if isinstance(task, Dataset):  # a stored dataset: named, not sent
            body, headers = None, {"Accept": JSON}
            params.append(("dataset", task.digest))
        else:
            body = _task_body(task, progress)  # every local check before anything is sent
            headers = {"Content-Type": NPZ_BODY, "Content-Length": str(body.size), "Accept": JSON}
        if respond_async:
            headers["Prefer"] = "respond-async"
        if idempotency_key is not None:
            headers["Idempotency-Key"] = idempotency_key
        call = _Call("POST", self.tasks_url, "the task", params, headers, body)
        response = yield from self._expect(call, 200, 202)
        doc = _json_object(response)
        if response.status_code == 202:
            location = response.headers.get("Location")
            return TaskStatus(doc, urljoin(str(response.url), location) if location else None)
        return Answer(doc)

    def _op_run(self, task: Any, backend: str | None, include_scores: bool, idempotency_key: str | None,
                progress: ProgressCallback | None, config: Mapping[str, Any]) -> Op:
        got = yield from self._op_send(task, False, backend, include_scores, idempotency_key, progress, config)
        if isinstance(got, TaskStatus):  # an Idempotency-Key's earlier task, not finished yet: wait for it
            got = yield from self._op_wait(got.id, self.timeout)
        return got

    def _op_submit(self, task: Any, backend: str | None, include_scores: bool, idempotency_key: str | None,
                   progress: ProgressCallback | None, config: Mapping[str, Any]) -> Op:
        got = yield from self._op_send(task, True, backend, include_scores, idempotency_key, progress, config)
        if isinstance(got, TaskStatus) and not got.id:
            raise BadAnswer("the server accepted the task but named no task id", document=got.document)
        return got.id if isinstance(got, TaskStatus) else got.task_id

    def _op_get(self, task_id: str) -> Op:
        call = _Call("GET", self.task_url(task_id), f"the lookup of task {task_id}", headers={"Accept": JSON})
        response = yield from self._expect(call, 200)
        return _outcome(_json_object(response))

    def _op_wait(self, task_id: str, timeout: float) -> Op:
        if not (isinstance(timeout, (int, float)) and timeout >= 0):
            raise BadInput(f"timeout must be >= 0 seconds, got {timeout!r}")
        deadline = self._clock() + timeout
        interval = POLL_FIRST_S
        while True:
            got = yield from self._op_get(task_id)
            if isinstance(got, Answer):
                return got
            if got.status in ("failed", "cancelled"):
                err = got.error or {}
                code = err.get("status")
                raise TaskFailed(f"task {task_id} {got.status}: {task_error_text(got.document)}", task_status=got.status,
                                 status=code if isinstance(code, int) else None, message=str(err.get("error", "")),
                                 document=got.document, url=self.task_url(task_id))
            if got.finished:
                raise BadAnswer(f"task {task_id} is {got.status} but the server sent no answer", document=got.document)
            left = deadline - self._clock()
            if left <= 0:
                raise NotFinished(f"task {task_id} is still {got.status or '?'} after {timeout:g} s",
                                  document=got.document, url=self.task_url(task_id))
            yield _Pause(min(interval, left))
            interval = min(POLL_MAX_S, interval * POLL_GROWTH)

    def _op_cancel(self, task_id: str) -> Op:
        call = _Call("POST", self.task_url(task_id) + "/cancel", f"to cancel task {task_id}",
                     headers={"Accept": JSON})
        response = yield from self._expect(call, 200)
        return TaskStatus(_json_object(response))

    def _op_page(self, status: str | None, limit: int | None, cursor: str | None) -> Op:
        params = [(k, str(v)) for k, v in (("status", status), ("limit", limit), ("cursor", cursor)) if v is not None]
        call = _Call("GET", self.tasks_url, "the task list", params, {"Accept": JSON})
        response = yield from self._expect(call, 200)
        page = _json_object(response)
        tasks, next_cursor = page.get("tasks"), page.get("next_cursor")
        if not isinstance(tasks, list) or not all(isinstance(t, dict) for t in tasks):
            raise BadAnswer("the server's task list has no 'tasks' list of objects", document=page)
        if next_cursor is not None and not isinstance(next_cursor, str):
            raise BadAnswer(f"the server's next_cursor is not a string: {next_cursor!r}", document=page)
        return TaskPage([TaskStatus(t) for t in tasks], next_cursor)

    def _op_predictions(self, task_id: str) -> Op:
        call = _Call("GET", self.task_url(task_id) + "/predictions.npy", f"the predictions of task {task_id}")
        response = yield from self._expect(call, 200)
        claimed = response.headers.get("X-Predictions-SHA256")
        try:
            array = np.load(io.BytesIO(response.content), allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:
            raise BadAnswer(f"the predictions of task {task_id} are not a .npy array: {exc}", url=call.url) from None
        if not isinstance(array, np.ndarray) or array.dtype != np.int64 or array.ndim != 1:
            raise BadAnswer(f"the predictions of task {task_id} are not a 1-D int64 array", url=call.url)
        digest = array_sha256(array)
        if claimed is None or digest != claimed.strip().lower():
            raise BadAnswer(f"the predictions of task {task_id} hash to {digest}, not to the "
                            f"X-Predictions-SHA256 {claimed!r} sent with them", url=call.url)
        return array

    def _op_put_dataset(self, task: Any, progress: ProgressCallback | None) -> Op:
        body = _task_body(task, progress)
        data = body.source if isinstance(body.source, bytes) else Path(body.source).read_bytes()
        dataset = Dataset("sha256:" + hashlib.sha256(data).hexdigest())
        url = f"{self.url}/datasets/{dataset.digest}"
        there = yield from self._exchange(_Call("HEAD", url, f"the check for dataset {dataset.digest}"))
        if there.status_code == 200:
            return dataset
        if there.status_code != 404:
            raise _http_error(there, _Call("HEAD", url, "the dataset check"), self.retries)
        call = _Call("PUT", url, f"the upload of dataset {dataset.digest}",
                     headers={"Content-Type": NPZ_BODY, "Content-Length": str(len(data)), "Accept": JSON},
                     body=_Body(data, progress))
        yield from self._expect(call, 200, 201)
        return dataset

    def _op_put_labels(self, dataset: Dataset | str, labels: Any) -> Op:
        digest = dataset.digest if isinstance(dataset, Dataset) else Dataset(dataset).digest
        array = np.asarray(labels)
        if array.ndim != 1 or array.dtype.kind not in "iu":
            raise BadInput(f"labels are a 1-d integer array, one per query; got shape {array.shape}, dtype {array.dtype}")
        buf = io.BytesIO()
        np.save(buf, array.astype(np.int64), allow_pickle=False)
        call = _Call("PUT", f"{self.url}/datasets/{digest}/labels", f"the labels of dataset {digest}",
                     headers={"Content-Type": NPZ_BODY, "Accept": JSON}, body=_Body(buf.getvalue(), None))
        response = yield from self._expect(call, 200, 201)
        return _json_object(response)

    def _op_dataset(self, dataset: Dataset | str) -> Op:
        digest = dataset.digest if isinstance(dataset, Dataset) else Dataset(dataset).digest
        call = _Call("GET", f"{self.url}/datasets/{digest}", f"dataset {digest}", headers={"Accept": JSON})
        response = yield from self._expect(call, 200)
        return _json_object(response)

    def _op_sweep(self, dataset: Dataset | str, grid: Mapping[str, Any] | None, seeds: Any, backend: str | None,
                  include_scores: bool, name: str | None, idempotency_key: str | None,
                  config: Mapping[str, Any]) -> Op:
        digest = dataset.digest if isinstance(dataset, Dataset) else Dataset(dataset).digest
        config, hook = _webhook_options(config)
        definition: dict[str, Any] = {"dataset": digest, "config": dict(config), "grid": {k: list(v) for k, v in
                                                                                         (grid or {}).items()}, **hook}
        if seeds is not None:
            definition["seeds"] = list(seeds) if not isinstance(seeds, Mapping) else dict(seeds)
        if backend is not None:
            definition["backend"] = backend
        if include_scores:
            definition["include_scores"] = True
        if name is not None:
            definition["name"] = name
        headers = {"Content-Type": JSON, "Accept": JSON}
        if idempotency_key is not None:
            headers["Idempotency-Key"] = idempotency_key
        data = json.dumps(definition).encode()
        call = _Call("POST", f"{self.url}/sweeps", "the sweep", headers=headers, body=_Body(data, None))
        response = yield from self._expect(call, 202)
        return _json_object(response)["id"]

    def _op_sweep_status(self, sweep_id: str) -> Op:
        call = _Call("GET", f"{self.url}/sweeps/{quote(sweep_id, safe='')}", f"sweep {sweep_id}",
                     headers={"Accept": JSON})
        response = yield from self._expect(call, 200)
        return SweepResult(_json_object(response))

    def _op_wait_sweep(self, sweep_id: str, timeout: float, progress: Callable[[SweepResult], None] | None) -> Op:
        deadline = self._clock() + timeout
        interval = POLL_FIRST_S
        while True:
            got = yield from self._op_sweep_status(sweep_id)
            if progress is not None:
                progress(got)
            if got.finished:
                return got
            left = deadline - self._clock()
            if left <= 0:
                raise NotFinished(f"sweep {sweep_id} is still {got.status} after {timeout:g} s ({got.counts})")
            yield _Pause(min(interval, left))
            interval = min(interval * 1.5, POLL_MAX_S)

    def _op_sweep_csv(self, sweep_id: str) -> Op:
        call = _Call("GET", f"{self.url}/sweeps/{quote(sweep_id, safe='')}", f"sweep {sweep_id}'s table",
                     params=[("format", "csv")], headers={"Accept": "text/csv"})
        response = yield from self._expect(call, 200)
        return response.text

    def _op_cancel_sweep(self, sweep_id: str) -> Op:
        call = _Call("POST", f"{self.url}/sweeps/{quote(sweep_id, safe='')}/cancel", f"the cancel of sweep {sweep_id}",
                     headers={"Accept": JSON})
        response = yield from self._expect(call, 200)
        return SweepResult(_json_object(response))

    def _op_evaluate(self, draws: Any, backend: str | None, name: str | None, measure: str | None,
                     protocol: Mapping[str, Any] | None, idempotency_key: str | None,
                     config: Mapping[str, Any], seeds: Any = None) -> Op:
        config, hook = _webhook_options(config)
        request: dict[str, Any] = {"draws": draws if isinstance(draws, str) else list(draws), "config": dict(config),
                                   **hook}
        if seeds is not None:
            request["seeds"] = dict(seeds) if isinstance(seeds, Mapping) else list(seeds)
        for key, value in (("backend", backend), ("name", name), ("measure", measure), ("protocol", protocol)):
            if value is not None:
                request[key] = dict(value) if isinstance(value, Mapping) else value
        headers = {"Content-Type": JSON, "Accept": JSON}
        if idempotency_key is not None:
            headers["Idempotency-Key"] = idempotency_key
        call = _Call("POST", f"{self.url}/evaluations", "the evaluation", headers=headers,
                     body=_Body(json.dumps(request).encode(), None))
        response = yield from self._expect(call, 202)
        return _json_object(response)["id"]

    def _op_evaluation(self, evaluation_id: str) -> Op:
        call = _Call("GET", f"{self.url}/evaluations/{quote(evaluation_id, safe='')}", f"evaluation {evaluation_id}",
                     headers={"Accept": JSON})
        response = yield from self._expect(call, 200)
        return EvaluationResult(_json_object(response))

    def _op_wait_evaluation(self, evaluation_id: str, timeout: float,
                            progress: Callable[[EvaluationResult], None] | None) -> Op:
        deadline = self._clock() + timeout
        interval = POLL_FIRST_S
        while True:
            got = yield from self._op_evaluation(evaluation_id)
            if progress is not None:
                progress(got)
            if got.finished:
                return got
            left = deadline - self._clock()
            if left <= 0:
                raise NotFinished(f"evaluation {evaluation_id} is still {got.status} after {timeout:g} s "
                                  f"({got.document.get('counts')})")
            yield _Pause(min(interval, left))
            interval = min(interval * 1.5, POLL_MAX_S)

    def _op_run_evaluation(self, draws: Any, backend: str | None, name: str | None, measure: str | None,
                           protocol: Mapping[str, Any] | None, idempotency_key: str | None, config: Mapping[str, Any],
                           timeout: float, progress: Callable[[EvaluationResult], None] | None, seeds: Any = None) -> Op:
        evaluation_id = yield from self._op_evaluate(draws, backend, name, measure, protocol, idempotency_key, config,
                                                     seeds)
        return (yield from self._op_wait_evaluation(evaluation_id, timeout, progress))

    def _op_cancel_evaluation(self, evaluation_id: str) -> Op:
        call = _Call("POST", f"{self.url}/evaluations/{quote(evaluation_id, safe='')}/cancel",
                     f"the cancel of evaluation {evaluation_id}", headers={"Accept": JSON})
        response = yield from self._expect(call, 200)
        return EvaluationResult(_json_object(response))

    def _op_leaderboard(self, sort: str, limit: int | None, cursor: str | None) -> Op:
        params = [("sort", sort)] + ([("limit", str(limit))] if limit is not None else []) + (
            [("cursor", cursor)] if cursor is not None else [])
        call = _Call("GET", f"{self.url}/evaluations", "the leaderboard", params=params, headers={"Accept": JSON})
        response = yield from self._expect(call, 200)
        return _json_object(response)

    def _op_keys(self, method: str, path: str, what: str, body: dict[str, Any] | None, expect: int,
                 root: str = "/keys") -> Op:
        headers = {"Accept": JSON}
        data = None
        if body is not None:
            headers["Content-Type"] = JSON
            data = _Body(json.dumps(body).encode(), None)
        call = _Call(method, f"{self.url}{root}{path}", what, headers=headers, body=data)
        response = yield from self._expect(call, expect)
        return _json_object(response)

    def _op_health(self) -> Op:
        call = _Call("GET", self.url + "/health", "the health check", headers={"Accept": JSON}, retry=False)
        response = yield from self._expect(call, 200, 503)  # 503: not ready, and the document says why
        return _json_object(response)

    @staticmethod
    def _next_cursor(page: TaskPage, seen: set[str]) -> str | None:
        cursor = page.next_cursor
        if cursor is not None:
            if cursor in seen:  # a server handing back a cursor twice would never end
                raise BadAnswer(f"the server repeated the page cursor {cursor!r}; stopping")
            seen.add(cursor)
        return cursor


# --------------------------------------------------------------------------- the clients


class Client(_Core):
    """The rev88 service's synchronous client (one keep-alive ``httpx.Client``; close it, or use
    ``with``). ``url``: the service's base URL (or its /tasks URL); ``api_key``: sent as
    ``Authorization: Bearer``; ``timeout``: seconds to wait for each answer (a synchronous task's
    includes its queue wait and training); ``retries``/``max_wait``: the 503 retry policy (module
    docstring). ``on_retry(error, wait_s, retry)`` is told of each retry (default: a log warning);
    ``sleep``, ``clock`` and ``transport`` (an httpx transport) let a caller replace time and network.
    """

    def __init__(self, url: str, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT_S,
                 retries: int = DEFAULT_RETRIES, *, max_wait: float = MAX_RETRY_WAIT_S,
                 on_retry: Callable[[Unavailable, float, int], None] | None = None,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic,
                 transport: httpx.BaseTransport | None = None) -> None:
        super().__init__(url, api_key, timeout, retries, max_wait, on_retry, clock)
        self._sleep = sleep
        self._http = httpx.Client(transport=transport, **self._httpx_options())

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _drive(self, op: Op) -> Any:
        reply: httpx.Response | None = None
        try:
            while True:
                try:
                    step = op.send(reply)
                except StopIteration as done:
                    return done.value
                if isinstance(step, _Pause):
                    self._sleep(step.seconds)
                    reply = None
                else:
                    reply = self._perform(step)
        finally:
            op.close()

    def _perform(self, call: _Call) -> httpx.Response:
        try:
            return self._http.request(call.method, call.url, params=call.params, headers=call.headers,
                                      content=call.body.sync() if call.body is not None else None)
        except httpx.HTTPError as exc:
            raise _transport_error(exc, call) from None

    def run(self, task: Any, *, backend: str | None = None, include_scores: bool = False,
            idempotency_key: str | None = None, progress: ProgressCallback | None = None, **config: Any) -> Answer:
        """Train on ``task`` and return its answer (POST /tasks, synchronous). ``config``: overrides
        such as ``epochs=3``; ``include_scores``: the (M, 10) scores too; ``progress(sent, total)``
        is called as the upload goes (from 0 again on a retry). With an ``idempotency_key`` seen
        before, the answer is that task's (waited for when it has not finished)."""
        return self._drive(self._op_run(task, backend, include_scores, idempotency_key, progress, config))

    def submit(self, task: Any, *, backend: str | None = None, include_scores: bool = False,
               idempotency_key: str | None = None, progress: ProgressCallback | None = None, **config: Any) -> str:
        """Send ``task`` with ``Prefer: respond-async`` and return its id once the service has stored
        it (202); ``wait(id)`` for the answer."""
        return self._drive(self._op_submit(task, backend, include_scores, idempotency_key, progress, config))

    def send(self, task: Any, *, respond_async: bool = False, backend: str | None = None,
             include_scores: bool = False, idempotency_key: str | None = None, progress: ProgressCallback | None = None,
             **config: Any) -> Answer | TaskStatus:
        """POST /tasks and return what the service answered: an ``Answer`` (200) or the
        ``TaskStatus`` of a 202 (asynchronous, or an Idempotency-Key's task still unfinished)."""
        return self._drive(self._op_send(task, respond_async, backend, include_scores, idempotency_key,
                                         progress, config))

    def get(self, task_id: str) -> Answer | TaskStatus:
        """GET /tasks/{id}: the ``Answer`` once succeeded, otherwise its ``TaskStatus``."""
        return self._drive(self._op_get(task_id))

    def wait(self, task_id: str, timeout: float = DEFAULT_TIMEOUT_S) -> Answer:
        """Poll GET /tasks/{id} until the task has finished: its ``Answer``; ``TaskFailed`` when it
        failed or was cancelled; ``NotFinished`` after ``timeout`` seconds (the task goes on)."""
        return self._drive(self._op_wait(task_id, timeout))

    def cancel(self, task_id: str) -> TaskStatus:
        """POST /tasks/{id}/cancel: the task's status once the cancel is recorded. A task that had
        already finished is ``Refused`` (409, the message names its status)."""
        return self._drive(self._op_cancel(task_id))

    def page(self, status: str | None = None, limit: int | None = None, cursor: str | None = None) -> TaskPage:
        """One page of GET /tasks (newest first): ``limit`` summaries at most (the server's default 50)."""
        return self._drive(self._op_page(status, limit, cursor))

    def tasks(self, status: str | None = None, limit: int | None = None,
              cursor: str | None = None) -> Iterator[TaskStatus]:
        """Every task the service lists (newest first, optionally of one ``status``), page after
        page to the last; ``limit`` is the page size asked for, ``cursor`` a page to start at."""
        seen: set[str] = set()
        while True:
            page = self.page(status, limit, cursor)
            yield from page.tasks
            cursor = self._next_cursor(page, seen)
            if cursor is None:
                return

    def predictions(self, task_id: str) -> np.ndarray:
        """A succeeded task's predictions (GET /tasks/{id}/predictions.npy, int64), checked
        against the X-Predictions-SHA256 header sent with them."""
        return self._drive(self._op_predictions(task_id))

    def health(self) -> dict[str, Any]:
        """GET /health: the service's whole state (``ready`` says whether it takes tasks; a 503
        here is an answer, not retried)."""
        return self._drive(self._op_health())

    def put_dataset(self, task: Any, *, progress: ProgressCallback | None = None) -> Dataset:
        """Store ``task`` (a path, npz bytes, or the three arrays) as a dataset and return it
        (``Dataset``: pass it to ``run``/``submit``). Asks first (HEAD) and uploads only when the
        service does not have those bytes."""
        return self._drive(self._op_put_dataset(task, progress))

    def put_labels(self, dataset: Dataset | str, labels: Any) -> dict[str, Any]:
        """Attach the scoring labels of the dataset's queries (kept by the service, never
        returned): answers of tasks on it then count ``correct``/``total``."""
        return self._drive(self._op_put_labels(dataset, labels))

    def dataset(self, dataset: Dataset | str) -> dict[str, Any]:
        """GET /datasets/{digest}: its size, counts, input hashes, whether labels are attached."""
        return self._drive(self._op_dataset(dataset))

    def sweep(self, dataset: Dataset | str, *, grid: Mapping[str, Any] | None = None, seeds: Any = None,
              backend: str | None = None, include_scores: bool = False, name: str | None = None,
              idempotency_key: str | None = None, **config: Any) -> str:
        """POST /sweeps: the grid's product × the seeds (a list, or {"start", "count"}) over the
        stored ``dataset``, ``config`` the base overrides; returns the sweep's id."""
        return self._drive(self._op_sweep(dataset, grid, seeds, backend, include_scores, name, idempotency_key, config))

    def sweep_status(self, sweep_id: str) -> SweepResult:
        return self._drive(self._op_sweep_status(sweep_id))

    def wait_sweep(self, sweep_id: str, timeout: float = DEFAULT_TIMEOUT_S,
                   progress: Callable[[SweepResult], None] | None = None) -> SweepResult:
        """Poll until the sweep has completed (or was cancelled); ``progress(result)`` after each poll."""
        return self._drive(self._op_wait_sweep(sweep_id, timeout, progress))

    def cancel_sweep(self, sweep_id: str) -> SweepResult:
        return self._drive(self._op_cancel_sweep(sweep_id))

    def sweep_csv(self, sweep_id: str) -> str:
        """The sweep's cell table as CSV (a column per config key)."""
        return self._drive(self._op_sweep_csv(sweep_id))

    def evaluate(self, draws: str | Sequence[int] = "0-10", *, seeds: Sequence[int] | Mapping[str, int] | None = None,
                 backend: str | None = None, name: str | None = None,
                 measure: str | None = None, protocol: Mapping[str, Any] | None = None,
                 idempotency_key: str | None = None, timeout: float = DEFAULT_TIMEOUT_S,
                 progress: Callable[[EvaluationResult], None] | None = None, **config: Any) -> EvaluationResult:
        """POST /evaluations and wait for it: the published ``draws`` (``"0-10"``, ``"0,3"`` or a
        list) graded on the server for ``config``, each at every one of ``seeds`` when given (a list
        or ``{"start": S, "count": N}``); the labels stay there. Returns the finished
        evaluation (``status`` completed, failed or cancelled); ``NotFinished`` after ``timeout``."""
        return self._drive(self._op_run_evaluation(draws, backend, name, measure, protocol, idempotency_key, config,
                                                   timeout, progress, seeds))

    def submit_evaluation(self, draws: str | Sequence[int] = "0-10", *,
                          seeds: Sequence[int] | Mapping[str, int] | None = None, backend: str | None = None,
                          name: str | None = None, measure: str | None = None,
                          protocol: Mapping[str, Any] | None = None, idempotency_key: str | None = None,
                          **config: Any) -> str:
        """POST /evaluations without waiting: the evaluation's id."""
        return self._drive(self._op_evaluate(draws, backend, name, measure, protocol, idempotency_key, config,
                                             seeds))

    def evaluation(self, evaluation_id: str) -> EvaluationResult:
        return self._drive(self._op_evaluation(evaluation_id))

    def wait_evaluation(self, evaluation_id: str, timeout: float = DEFAULT_TIMEOUT_S,
                        progress: Callable[[EvaluationResult], None] | None = None) -> EvaluationResult:
        return self._drive(self._op_wait_evaluation(evaluation_id, timeout, progress))

    def cancel_evaluation(self, evaluation_id: str) -> EvaluationResult:
        return self._drive(self._op_cancel_evaluation(evaluation_id))

    def leaderboard(self, sort: str = "accuracy", limit: int | None = None, cursor: str | None = None) -> dict[str, Any]:
        """One page of GET /evaluations: ``{"evaluations": [...], "next_cursor": ...}``."""
        return self._drive(self._op_leaderboard(sort, limit, cursor))

    def create_key(self, name: str, *, scopes: Sequence[str] | None = None,
                   expires_at: float | None = None) -> dict[str, Any]:
        """POST /keys (the admin key): a tenant's key; its secret (``["key"]``) is shown this once."""
        body: dict[str, Any] = {"name": name}
        if scopes is not None:
            body["scopes"] = list(scopes)
        if expires_at is not None:
            body["expires_at"] = expires_at
        return self._drive(self._op_keys("POST", "", f"the key {name!r}", body, 201))

    def keys(self) -> list[dict[str, Any]]:
        """GET /keys (the admin key): every key, never a secret."""
        return self._drive(self._op_keys("GET", "", "the keys", None, 200))["keys"]

    def whoami(self) -> dict[str, Any]:
        """GET /key: the key this client sends (its name, scopes; admin, open)."""
        return self._drive(self._op_keys("GET", "", "this client's key", None, 200, root="/key"))

    def revoke_key(self, key_id: str) -> dict[str, Any]:
        return self._drive(self._op_keys("DELETE", f"/{quote(key_id, safe='')}", f"the revocation of {key_id}",
                                         None, 200))

    def rotate_key(self, key_id: str, grace_seconds: float | None = None) -> dict[str, Any]:
        """A new secret for the key (``["key"]``); the old one keeps working ``grace_seconds``."""
        body = {} if grace_seconds is None else {"grace_seconds": grace_seconds}
        return self._drive(self._op_keys("POST", f"/{quote(key_id, safe='')}/rotate", f"the rotation of {key_id}",
                                         body, 200))


    def webhook_secret(self) -> dict[str, Any]:
        """GET /webhooks/secret: ``{"key": "whsec_...", "previous_valid_until": ...}``, the secret
        the service signs this tenant's webhooks with (``rev88.webhooks.verify`` checks them)."""
        return self._drive(self._op_keys("GET", "/secret", "the webhook secret", None, 200, root="/webhooks"))

    def rotate_webhook_secret(self) -> dict[str, Any]:
        """POST /webhooks/secret/rotate: a new secret; the old one also signs for a while."""
        return self._drive(self._op_keys("POST", "/secret/rotate", "the webhook secret's rotation", {}, 200,
                                         root="/webhooks"))

    def deliveries(self, subject_id: str, kind: str = "task") -> dict[str, Any]:
        """GET /{tasks|sweeps|evaluations}/<id>/deliveries: its webhook messages and every attempt."""
        return self._drive(self._op_keys("GET", f"/{quote(subject_id, safe='')}/deliveries",
                                         f"the deliveries of {kind} {subject_id}", None, 200, root=_collection(kind)))

    def redeliver(self, subject_id: str, kind: str = "task") -> list[str]:
        """POST .../deliveries/redeliver: its messages sent again (same ids); returns their ids."""
        return self._drive(self._op_keys("POST", f"/{quote(subject_id, safe='')}/deliveries/redeliver",
                                         f"the redelivery of {kind} {subject_id}", {}, 202,
                                         root=_collection(kind)))["redelivered"]


def _collection(kind: str) -> str:
    roots = {"task": "/tasks", "sweep": "/sweeps", "evaluation": "/evaluations"}
    if kind not in roots:
        raise BadInput(f"kind must be one of {', '.join(roots)}, got {kind!r}")
    return roots[kind]


class AsyncClient(_Core):
    """``Client`` over ``httpx.AsyncClient``: the same operations, awaited (``async with``, ``aclose``);
    ``tasks`` is an async iterator, ``sleep`` an async callable."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT_S,
                 retries: int = DEFAULT_RETRIES, *, max_wait: float = MAX_RETRY_WAIT_S,
                 on_retry: Callable[[Unavailable, float, int], None] | None = None,
                 sleep: Callable[[float], Any] = asyncio.sleep, clock: Callable[[], float] = time.monotonic,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        super().__init__(url, api_key, timeout, retries, max_wait, on_retry, clock)
        self._sleep = sleep
        self._http = httpx.AsyncClient(transport=transport, **self._httpx_options())

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _drive(self, op: Op) -> Any:
        reply: httpx.Response | None = None
        try:
            while True:
                try:
                    step = op.send(reply)
                except StopIteration as done:
                    return done.value
                if isinstance(step, _Pause):
                    await self._sleep(step.seconds)
                    reply = None
                else:
                    reply = await self._perform(step)
        finally:
            op.close()

    async def _perform(self, call: _Call) -> httpx.Response:
        try:
            return await self._http.request(call.method, call.url, params=call.params, headers=call.headers,
                                            content=call.body.aiter() if call.body is not None else None)
        except httpx.HTTPError as exc:
            raise _transport_error(exc, call) from None

    async def run(self, task: Any, *, backend: str | None = None, include_scores: bool = False,
                  idempotency_key: str | None = None, progress: ProgressCallback | None = None, **config: Any) -> Answer:
        return await self._drive(self._op_run(task, backend, include_scores, idempotency_key, progress, config))

    async def submit(self, task: Any, *, backend: str | None = None, include_scores: bool = False,
                     idempotency_key: str | None = None, progress: ProgressCallback | None = None, **config: Any) -> str:
        return await self._drive(self._op_submit(task, backend, include_scores, idempotency_key, progress, config))

    async def send(self, task: Any, *, respond_async: bool = False, backend: str | None = None,
                   include_scores: bool = False, idempotency_key: str | None = None,
                   progress: ProgressCallback | None = None, **config: Any) -> Answer | TaskStatus:
        return await self._drive(self._op_send(task, respond_async, backend, include_scores, idempotency_key,
                                               progress, config))

    async def get(self, task_id: str) -> Answer | TaskStatus:
        return await self._drive(self._op_get(task_id))

    async def wait(self, task_id: str, timeout: float = DEFAULT_TIMEOUT_S) -> Answer:
        return await self._drive(self._op_wait(task_id, timeout))

    async def cancel(self, task_id: str) -> TaskStatus:
        return await self._drive(self._op_cancel(task_id))

    async def page(self, status: str | None = None, limit: int | None = None, cursor: str | None = None) -> TaskPage:
        return await self._drive(self._op_page(status, limit, cursor))

    async def tasks(self, status: str | None = None, limit: int | None = None,
                    cursor: str | None = None) -> AsyncIterator[TaskStatus]:
        seen: set[str] = set()
        while True:
            page = await self.page(status, limit, cursor)
            for task in page.tasks:
                yield task
            cursor = self._next_cursor(page, seen)
            if cursor is None:
                return

    async def predictions(self, task_id: str) -> np.ndarray:
        return await self._drive(self._op_predictions(task_id))

    async def health(self) -> dict[str, Any]:
        return await self._drive(self._op_health())

    async def put_dataset(self, task: Any, *, progress: ProgressCallback | None = None) -> Dataset:
        return await self._drive(self._op_put_dataset(task, progress))

    async def put_labels(self, dataset: Dataset | str, labels: Any) -> dict[str, Any]:
        return await self._drive(self._op_put_labels(dataset, labels))

    async def dataset(self, dataset: Dataset | str) -> dict[str, Any]:
        return await self._drive(self._op_dataset(dataset))

    async def sweep(self, dataset: Dataset | str, *, grid: Mapping[str, Any] | None = None, seeds: Any = None,
                    backend: str | None = None, include_scores: bool = False, name: str | None = None,
                    idempotency_key: str | None = None, **config: Any) -> str:
        return await self._drive(self._op_sweep(dataset, grid, seeds, backend, include_scores, name, idempotency_key,
                                                config))

    async def sweep_status(self, sweep_id: str) -> SweepResult:
        return await self._drive(self._op_sweep_status(sweep_id))

    async def wait_sweep(self, sweep_id: str, timeout: float = DEFAULT_TIMEOUT_S,
                         progress: Callable[[SweepResult], None] | None = None) -> SweepResult:
        return await self._drive(self._op_wait_sweep(sweep_id, timeout, progress))

    async def cancel_sweep(self, sweep_id: str) -> SweepResult:
        return await self._drive(self._op_cancel_sweep(sweep_id))

    async def sweep_csv(self, sweep_id: str) -> str:
        return await self._drive(self._op_sweep_csv(sweep_id))

    async def evaluate(self, draws: str | Sequence[int] = "0-10", *,
                       seeds: Sequence[int] | Mapping[str, int] | None = None, backend: str | None = None,
                       name: str | None = None, measure: str | None = None, protocol: Mapping[str, Any] | None = None,
                       idempotency_key: str | None = None, timeout: float = DEFAULT_TIMEOUT_S,
                       progress: Callable[[EvaluationResult], None] | None = None, **config: Any) -> EvaluationResult:
        return await self._drive(self._op_run_evaluation(draws, backend, name, measure, protocol, idempotency_key,
                                                         config, timeout, progress, seeds))

    async def submit_evaluation(self, draws: str | Sequence[int] = "0-10", *,
                                seeds: Sequence[int] | Mapping[str, int] | None = None, backend: str | None = None,
                                name: str | None = None, measure: str | None = None,
                                protocol: Mapping[str, Any] | None = None, idempotency_key: str | None = None,
                                **config: Any) -> str:
        return await self._drive(self._op_evaluate(draws, backend, name, measure, protocol, idempotency_key,
                                                   config, seeds))

    async def evaluation(self, evaluation_id: str) -> EvaluationResult:
        return await self._drive(self._op_evaluation(evaluation_id))

    async def wait_evaluation(self, evaluation_id: str, timeout: float = DEFAULT_TIMEOUT_S,
                              progress: Callable[[EvaluationResult], None] | None = None) -> EvaluationResult:
        return await self._drive(self._op_wait_evaluation(evaluation_id, timeout, progress))

    async def cancel_evaluation(self, evaluation_id: str) -> EvaluationResult:
        return await self._drive(self._op_cancel_evaluation(evaluation_id))

    async def leaderboard(self, sort: str = "accuracy", limit: int | None = None,
                          cursor: str | None = None) -> dict[str, Any]:
        return await self._drive(self._op_leaderboard(sort, limit, cursor))

    async def webhook_secret(self) -> dict[str, Any]:
        return await self._drive(self._op_keys("GET", "/secret", "the webhook secret", None, 200, root="/webhooks"))

    async def rotate_webhook_secret(self) -> dict[str, Any]:
        return await self._drive(self._op_keys("POST", "/secret/rotate", "the webhook secret's rotation", {}, 200,
                                               root="/webhooks"))

    async def deliveries(self, subject_id: str, kind: str = "task") -> dict[str, Any]:
        return await self._drive(self._op_keys("GET", f"/{quote(subject_id, safe='')}/deliveries",
                                               f"the deliveries of {kind} {subject_id}", None, 200,
                                               root=_collection(kind)))

    async def redeliver(self, subject_id: str, kind: str = "task") -> list[str]:
        doc = await self._drive(self._op_keys("POST", f"/{quote(subject_id, safe='')}/deliveries/redeliver",
                                              f"the redelivery of {kind} {subject_id}", {}, 202,
                                              root=_collection(kind)))
        return doc["redelivered"]
