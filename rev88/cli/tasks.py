"""``rev88 submit``, ``tasks``, ``task`` and ``cancel``: the service's client end on the command line.

``submit`` uploads a task npz to a running service with httpx, streaming the file
with a progress bar on stderr, retries a 503 (queue full, not ready, draining) as
the server's Retry-After asks within a bounded number of tries, and writes the
JSON answer. Exit status: 0 answer written; 2 the server refused the task (4xx,
its message printed) or bad local input; 1 anything else (no connection, 5xx,
still busy after the last retry). ``submit --async`` asks for ``Prefer: respond-async``
and prints the task id (the last line of stdout) once the server has stored the task.

``tasks`` lists the ledger (GET /tasks, newest first, ``--all`` through every page), ``task ID``
shows one (GET /tasks/{id}; ``--wait`` polls until it has finished; ``--output`` writes its JSON
and a succeeded task's predictions .npy beside it) and ``cancel ID`` cancels one
(POST /tasks/{id}/cancel). Every request retries a 503 the same way. Exit status as above:
an unknown id (404) or a cancel of a finished task (409) is 2; ``task --wait`` is 0 only if
the task succeeded, 1 if it failed, was cancelled or is still unfinished at ``--timeout``.
"""

from __future__ import annotations

import argparse
import email.utils
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from .common import CliError, write_json

# --------------------------------------------------------------------------- submit

CHUNK = 256 * 1024
DEFAULT_RETRY_WAIT_S = 2.0  # when a 503 names no Retry-After
_sleep = time.sleep  # the tests replace this to record the waits


class Progress:
    """An upload progress bar on a stream: redrawn in place on a terminal,
    one summary line otherwise (logs stay readable)."""

    def __init__(self, total: int, stream: IO[str] | None = None, enabled: bool = True, width: int = 30,
                 waiting: str = "waiting for the result (queue + training)..."):
        self.total, self.done, self.width = total, 0, width
        self.waiting = waiting
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last = 0.0
        self._t0 = time.monotonic()

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.tty and (now - self._last >= 0.1 or self.done >= self.total):
            self._last = now
            self.stream.write("\r" + self.line())
            self.stream.flush()

    def line(self) -> str:
        frac = 1.0 if self.total == 0 else min(1.0, self.done / self.total)
        filled = int(round(frac * self.width))
        bar = "#" * filled + "." * (self.width - filled)
        return f"upload [{bar}] {frac * 100:5.1f}% {_mb(self.done)}/{_mb(self.total)}"

    def finish(self) -> None:
        if not self.enabled:
            return
        secs = time.monotonic() - self._t0
        if self.tty:
            self.stream.write("\r" + self.line() + f" in {secs:.1f} s\n")
        else:
            self.stream.write(f"uploaded {_mb(self.done)} in {secs:.1f} s\n")
        self.stream.write(self.waiting + "\n")
        self.stream.flush()


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def file_chunks(path: Path, progress: Progress) -> Iterator[bytes]:
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            progress.update(len(chunk))
            yield chunk
    progress.finish()


def retry_after_seconds(value: str | None, default: float = DEFAULT_RETRY_WAIT_S) -> float:
    """Seconds to wait from a Retry-After header: delta-seconds or an HTTP date."""
    if value is None or not value.strip():
        return default
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return default
        if when is None:
            return default
        seconds = when.timestamp() - time.time()
    if not math.isfinite(seconds):
        return default
    return max(0.0, seconds)


def error_message(response) -> str:
    """The server's {"error": ...} message, or the start of whatever it sent."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and "error" in body:
        return str(body["error"])
    text = response.text.strip()
    return text[:300] if text else response.reason_phrase or "no message"


def config_params(path: str) -> dict[str, str]:
    """A JSON object of config overrides -> query parameters (the server validates them)."""
    from learner.config import read_config_json
    from learner.errors import ConfigError

    try:
        data = read_config_json(path)
    except ConfigError as exc:
        raise CliError(exc.message) from None
    params = {}
    for key, value in data.items():
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise CliError(f"config file {path}: {key} must be a number, got {value!r}")
        params[str(key)] = repr(value) if isinstance(value, float) else str(value)
    return params


def tasks_url(url: str) -> str:
    """Accept the service's base URL or its /tasks URL."""
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise CliError(f"--url must start with http:// or https://, got {url!r}")
    return url if url.endswith("/tasks") else url + "/tasks"


# --------------------------------------------------------------------------- the tasks API client

TASK_STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")  # app.ledger.STATUSES
FINISHED = ("succeeded", "failed", "cancelled")
POLL_FIRST_S, POLL_MAX_S, POLL_GROWTH = 0.1, 2.0, 1.5
_clock = time.monotonic  # with _sleep, what a test may replace to wait without waiting


def task_url(url: str, task_id: str) -> str:
    """…/tasks/{id}, the id quoted (an id never needs it, a typo might)."""
    from urllib.parse import quote

    if not task_id or not task_id.strip():
        raise CliError("a task id is required")
    return f"{tasks_url(url)}/{quote(task_id.strip(), safe='')}"


def _auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _send(client, method: str, target: str, *, retries: int, max_wait: float, stream: IO[str],
          content=None, timeout_hint: str = "", **kw):
    """One request, a 503 retried as its Retry-After asks (at most ``retries`` times, each
    wait capped by ``max_wait``); a connection failure or timeout -> CliError(…, 1).
    ``content`` may be a callable that makes the body afresh for each try (a streamed file)."""
    import httpx

    for attempt in range(retries + 1):
        body = content() if callable(content) else content
        try:
            response = client.request(method, target, content=body, **kw)
        except httpx.ConnectError as exc:
            raise CliError(f"cannot connect to {target}: {exc} (is the service running?)", 1) from None
        except httpx.TimeoutException as exc:
            raise CliError(f"no answer from {target} within the timeout ({type(exc).__name__})"
                           f"{timeout_hint}", 1) from None
        except httpx.HTTPError as exc:
            raise CliError(f"request to {target} failed: {type(exc).__name__}: {exc}", 1) from None
        if response.status_code == 503 and attempt < retries:
            wait = min(retry_after_seconds(response.headers.get("Retry-After")), max_wait)
            stream.write(f"server busy (503: {error_message(response)}); retrying in {wait:g} s "
                         f"(retry {attempt + 1} of {retries})\n")
            stream.flush()
            _sleep(wait)
            continue
        return response
    raise AssertionError("unreachable")  # the last try returns whatever it got


def _refused(response, what: str, retries: int) -> CliError:
    """The CliError for a response that is not the one hoped for: 2 for a 4xx, 1 otherwise."""
    status, message = response.status_code, error_message(response)
    if status == 503:
        return CliError(f"server still busy after {retries} retries (503): {message}", 1)
    if 400 <= status < 500:
        return CliError(f"the server refused {what} ({status}): {message}", 2)
    return CliError(f"the server failed ({status}): {message}", 1)


def _json_object(response) -> dict[str, Any]:
    try:
        data = response.json()
    except ValueError:
        raise CliError(f"the server answered {response.status_code} but not with JSON: "
                       f"{response.text[:200]!r}", 1) from None
    if not isinstance(data, dict):
        raise CliError(f"the server answered {response.status_code} with JSON that is not an object", 1)
    return data


def _client(timeout: float):
    import httpx

    return httpx.Client(timeout=httpx.Timeout(connect=10.0, read=timeout, write=timeout, pool=10.0))


def get_task(url: str, task_id: str, *, api_key: str | None = None, retries: int = 5, max_wait: float = 60.0,
             timeout: float = 60.0, stream: IO[str] | None = None, client=None) -> dict[str, Any]:
    """GET /tasks/{id}: the answer (succeeded) or the status document. 404 -> CliError(…, 2)."""
    stream = stream if stream is not None else sys.stderr
    target = task_url(url, task_id)
    if client is None:
        with _client(timeout) as own:
            return get_task(url, task_id, api_key=api_key, retries=retries, max_wait=max_wait,
                            timeout=timeout, stream=stream, client=own)
    response = _send(client, "GET", target, retries=retries, max_wait=max_wait, stream=stream,
                     headers={"Accept": "application/json", **_auth(api_key)})
    if response.status_code != 200:
        raise _refused(response, f"the lookup of task {task_id}", retries)
    return _json_object(response)


def wait_task(url: str, task_id: str, *, api_key: str | None = None, timeout: float = 900.0, retries: int = 5,
              max_wait: float = 60.0, stream: IO[str] | None = None, first: dict[str, Any] | None = None,
              ) -> dict[str, Any]:
    """Poll GET /tasks/{id} until it has finished (the interval grows from 0.1 s to 2 s);
    CliError(…, 1) if it has not within ``timeout`` seconds. Returns its last document."""
    stream = stream if stream is not None else sys.stderr
    deadline = _clock() + timeout
    interval = POLL_FIRST_S
    with _client(60.0) as client:
        doc = first if first is not None else get_task(url, task_id, api_key=api_key, retries=retries,
                                                       max_wait=max_wait, stream=stream, client=client)
        while doc.get("status") not in FINISHED:
            left = deadline - _clock()
            if left <= 0:
                raise CliError(f"task {task_id} is still {doc.get('status', '?')} after {timeout:g} s "
                               f"(--timeout); it goes on: rev88 task {task_id} --wait", 1)
            _sleep(min(interval, left))
            interval = min(POLL_MAX_S, interval * POLL_GROWTH)
            doc = get_task(url, task_id, api_key=api_key, retries=retries, max_wait=max_wait,
                           stream=stream, client=client)
    return doc


def post_task(
    path: Path,
    url: str,
    *,
    api_key: str | None = None,
    params: dict[str, str] | None = None,
    asynchronous: bool = False,
    idempotency_key: str | None = None,
    retries: int = 5,
    max_wait: float = 60.0,
    timeout: float = 900.0,
    progress: bool = True,
    stream: IO[str] | None = None,
) -> tuple[int, dict[str, Any], str | None]:
    """Upload ``path`` to ``url`` (…/tasks): (status 200 or 202, its JSON, the absolute
    Location of a 202). Anything else raises CliError."""
    from urllib.parse import urljoin

    stream = stream if stream is not None else sys.stderr
    size = path.stat().st_size
    headers = {"Content-Type": "application/octet-stream", "Content-Length": str(size), **_auth(api_key)}
    if asynchronous:
        headers["Prefer"] = "respond-async"
    if idempotency_key is not None:
        headers["Idempotency-Key"] = idempotency_key
    target = tasks_url(url)
    waiting = ("waiting for the server to accept it..." if asynchronous
               else "waiting for the result (queue + training)...")
    with _client(timeout) as client:
        response = _send(
            client, "POST", target, retries=retries, max_wait=max_wait, stream=stream,
            content=lambda: file_chunks(path, Progress(size, stream=stream, enabled=progress, waiting=waiting)),
            params=params or {}, headers=headers, timeout_hint="; raise --timeout for long tasks",
        )
    if response.status_code not in (200, 202):
        raise _refused(response, "the task", retries)
    location = response.headers.get("Location")
    return response.status_code, _json_object(response), urljoin(target, location) if location else None


def submit(path: Path, url: str, **kw) -> dict[str, Any]:
    """Upload ``path`` to ``url`` (…/tasks) and return the JSON answer; raise CliError otherwise.
    (With ``asynchronous=True``: the 202's summary.)"""
    return post_task(path, url, **kw)[1]


def _check_finished(doc: dict[str, Any], task_id: str) -> None:
    """A task that failed or was cancelled -> CliError: 2 when its error was a 4xx (the task's
    own fault, or a cancel), 1 otherwise."""
    status = doc.get("status")
    if status in ("failed", "cancelled"):
        err = doc.get("error") or {}
        code = err.get("status") if isinstance(err, dict) else None
        exit_code = 2 if isinstance(code, int) and 400 <= code < 500 else 1
        raise CliError(f"task {task_id} {status}: {_error_text(doc)}", exit_code)


def cmd_submit(args: argparse.Namespace) -> int:
    path = Path(args.task)
    if not path.is_file():
        raise CliError(f"task file not found: {path}")
    if args.retries < 0:
        raise CliError(f"--retries must be >= 0, got {args.retries}")
    if not args.max_wait >= 0:
        raise CliError(f"--max-wait must be >= 0 seconds, got {args.max_wait}")
    if not args.asynchronous and not args.output:
        raise CliError("--output is required (where to write the JSON answer) unless --async")
    params: dict[str, str] = {}
    if args.config:
        params.update(config_params(args.config))
    if args.backend:
        params["backend"] = args.backend
    if args.include_scores:
        params["include"] = "scores"
    status, answer, location = post_task(
        path,
        args.url,
        api_key=args.api_key,
        params=params,
        asynchronous=args.asynchronous,
        idempotency_key=args.idempotency_key,
        retries=args.retries,
        max_wait=args.max_wait,
        timeout=args.timeout,
        progress=not args.no_progress,
    )
    output = Path(args.output) if args.output else None
    if args.asynchronous:
        task_id = str(answer.get("id", ""))
        if not task_id:
            raise CliError("the server accepted the task but named no task id", 1)
        if output is not None:
            write_json(output, answer)
        print(f"task {task_id} {answer.get('status', 'accepted')}; poll {location or task_url(args.url, task_id)}"
              f" or: rev88 task {task_id} --url {args.url} --wait" + (f"; wrote {output}" if output else ""))
        print(task_id)
        return 0
    if status == 202:  # an Idempotency-Key seen before whose task has not finished yet: wait for it
        task_id = str(answer.get("id", ""))
        print(f"task {task_id} (this Idempotency-Key's) is {answer.get('status', '?')}; waiting for it",
              file=sys.stderr)
        answer = wait_task(args.url, task_id, api_key=args.api_key, timeout=args.timeout,
                           retries=args.retries, max_wait=args.max_wait, first=answer)
    _check_finished(answer, str(answer.get("id", "?")))
    write_json(output, answer)
    predictions = answer.get("predictions")
    count = len(predictions) if isinstance(predictions, list) else "?"
    timing = answer.get("timing") or {}
    backend = (answer.get("metadata") or {}).get("backend", "?")
    sha = str(answer.get("predictions_sha256", "?"))
    print(
        f"{count} predictions from backend {backend} (run {timing.get('run_ms', '?')} ms, total "
        f"{timing.get('total_ms', '?')} ms); predictions_sha256 {sha[:16]}…; wrote {output}"
    )
    return 0


def _add_client_flags(p, timeout_help: str, timeout: float = 60.0) -> None:
    p.add_argument("--url", required=True, help="the service, e.g. http://127.0.0.1:8000")
    p.add_argument("--api-key", default=os.environ.get("REV88_API_KEY") or None,
                   help="sent as 'Authorization: Bearer KEY' [default: $REV88_API_KEY]")
    p.add_argument("--retries", type=int, default=5, help="how often to retry a 503 (default 5)")
    p.add_argument("--max-wait", type=float, default=60.0,
                   help="longest wait between retries in seconds, whatever Retry-After says (default 60)")
    p.add_argument("--timeout", type=float, default=timeout, help=timeout_help)


def add_submit(sub) -> None:
    p = sub.add_parser("submit", help="upload a task npz to a running service and save its JSON answer "
                       "(--async: print its task id instead of waiting)")
    p.add_argument("task", help="task npz: train_images, train_labels, test_images")
    p.add_argument("--async", dest="asynchronous", action="store_true",
                   help="ask for 'Prefer: respond-async': print the task id (last line of stdout) once the "
                   "server has stored the task, without waiting; fetch it with 'rev88 task ID --wait'")
    p.add_argument("--idempotency-key", help="sent as Idempotency-Key: the same key and file give the same task "
                   "(a retry never trains twice); another file with the same key is refused (409)")
    p.add_argument("--backend", help="ask for a backend (e.g. cpu); default: the server's")
    p.add_argument("--config", help="JSON object of config overrides, e.g. {\"batch_size\": 64}")
    p.add_argument("--include-scores", action="store_true", help="ask for the (M, 10) scores too")
    p.add_argument("--output", help="where to write the JSON answer (required without --async; with it, "
                   "the 202's task summary)")
    p.add_argument("--no-progress", action="store_true", help="no upload progress on stderr")
    _add_client_flags(p, "seconds to wait for the answer (default 900)", 900.0)
    p.set_defaults(func=cmd_submit)


# --------------------------------------------------------------------------- tasks, task, cancel


def _utc(ts: Any) -> str:
    from datetime import UTC, datetime

    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        return "-"
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _ms(value: Any) -> str:
    return "-" if isinstance(value, bool) or not isinstance(value, (int, float)) else f"{value:.1f}"


def _count(value: Any) -> str:
    return "?" if value is None else str(value)


TABLE_COLUMNS = ("id", "status", "created (UTC)", "train/queries", "backend", "run ms", "predictions")


def task_row(t: dict[str, Any]) -> tuple[str, ...]:
    sha = t.get("predictions_sha256")
    return (str(t.get("id", "?")), str(t.get("status", "?")), _utc(t.get("created_at")),
            f"{_count(t.get('train_count'))}/{_count(t.get('test_count'))}", str(t.get("backend") or "-"),
            _ms(t.get("run_ms")), f"{sha[:12]}…" if isinstance(sha, str) and sha else "-")


def format_table(tasks: list[dict[str, Any]]) -> str:
    rows = [TABLE_COLUMNS] + [task_row(t) for t in tasks]
    widths = [max(len(r[i]) for r in rows) for i in range(len(TABLE_COLUMNS))]
    right = {3, 5}  # numbers right-aligned
    lines = ["  ".join(cell.rjust(w) if i in right else cell.ljust(w)
                       for i, (cell, w) in enumerate(zip(r, widths))).rstrip() for r in rows]
    return "\n".join(lines)


def list_tasks(url: str, *, api_key: str | None = None, status: str | None = None, limit: int | None = None,
               cursor: str | None = None, every_page: bool = False, retries: int = 5, max_wait: float = 60.0,
               timeout: float = 60.0, stream: IO[str] | None = None) -> tuple[list[dict[str, Any]], str | None]:
    """GET /tasks, newest first: (summaries, the next page's cursor or None). ``every_page``
    follows next_cursor to the end."""
    stream = stream if stream is not None else sys.stderr
    target = tasks_url(url)
    found: list[dict[str, Any]] = []
    seen: set[str] = set()
    with _client(timeout) as client:
        while True:
            params = {k: v for k, v in (("status", status), ("limit", limit), ("cursor", cursor)) if v is not None}
            response = _send(client, "GET", target, retries=retries, max_wait=max_wait, stream=stream,
                             params=params, headers={"Accept": "application/json", **_auth(api_key)})
            if response.status_code != 200:
                raise _refused(response, "the task list", retries)
            page = _json_object(response)
            tasks, cursor = page.get("tasks"), page.get("next_cursor")
            if not isinstance(tasks, list):
                raise CliError("the server's task list has no 'tasks' list", 1)
            found.extend(tasks)
            if not every_page or cursor is None:
                return found, cursor
            if cursor in seen:  # a server that hands back a cursor twice would never end
                raise CliError(f"the server repeated the page cursor {cursor!r}; stopping", 1)
            seen.add(cursor)


def cmd_tasks(args: argparse.Namespace) -> int:
    if args.limit is not None and args.limit < 1:
        raise CliError(f"--limit must be >= 1, got {args.limit}")
    if args.retries < 0:
        raise CliError(f"--retries must be >= 0, got {args.retries}")
    tasks, cursor = list_tasks(args.url, api_key=args.api_key, status=args.status, limit=args.limit,
                               cursor=args.cursor, every_page=args.all, retries=args.retries,
                               max_wait=args.max_wait, timeout=args.timeout)
    if args.json:
        print(json.dumps(tasks, indent=2))
    elif tasks:
        print(format_table(tasks))
    else:
        print("no tasks" + (f" {args.status}" if args.status else ""))
    if cursor is not None:
        print(f"more tasks: --all, or --cursor {cursor}", file=sys.stderr)
    return 0


def add_tasks(sub) -> None:
    p = sub.add_parser("tasks", help="list a running service's tasks, newest first")
    p.add_argument("--status", choices=TASK_STATUSES, help="only tasks with this status")
    p.add_argument("--limit", type=int, help="tasks per page (server default 50, at most 500)")
    p.add_argument("--cursor", help="start at this page (from a previous listing's 'more tasks' line)")
    p.add_argument("--all", action="store_true", help="follow the pages to the last task")
    p.add_argument("--json", action="store_true", help="print the task summaries as a JSON list instead of a table")
    _add_client_flags(p, "seconds to wait for each page (default 60)")
    p.set_defaults(func=cmd_tasks)


def _error_text(doc: dict[str, Any]) -> str:
    err = doc.get("error")
    if isinstance(err, dict):
        code = err.get("status")
        return f"({code}) {err.get('error', 'no message')}" if code is not None else str(err.get("error"))
    return str(err) if err else "no error recorded"


def status_line(doc: dict[str, Any]) -> str:
    """One line about a task: its id, status and what is known of it."""
    status = doc.get("status", "?")
    meta = doc.get("metadata") if isinstance(doc.get("metadata"), dict) else {}
    train = doc.get("train_count", meta.get("train_count"))
    queries = doc.get("test_count", meta.get("test_count"))
    backend = doc.get("backend") or meta.get("backend")
    parts = [f"{doc.get('mode', '')} {doc.get('kind', '')}".strip() or None,
             f"{_count(train)} train / {_count(queries)} queries" if train is not None or queries is not None else None,
             f"backend {backend}" if backend else None,
             f"created {_utc(doc['created_at'])}" if doc.get("created_at") is not None else None]
    if status == "succeeded":
        run_ms = doc.get("run_ms", (doc.get("timing") or {}).get("run_ms"))
        sha = doc.get("predictions_sha256")
        parts += [f"run {_ms(run_ms)} ms" if run_ms is not None else None,
                  f"predictions_sha256 {sha[:16]}…" if isinstance(sha, str) else None]
    line = f"task {doc.get('id', '?')} {status}"
    details = ", ".join(p for p in parts if p)
    if details:
        line += f" ({details})"
    if status in ("failed", "cancelled"):
        line += f": {_error_text(doc)}"
    return line


def write_answer(output: Path, doc: dict[str, Any]) -> Path | None:
    """The JSON at ``output``; for a succeeded task its predictions (int64) beside it too, as
    ``rev88 run`` writes them, checked against the answer's predictions_sha256."""
    import numpy as np

    from learner.hashing import array_sha256

    from .common import predictions_path

    pred_file = None
    predictions = doc.get("predictions")
    if doc.get("status") == "succeeded" and isinstance(predictions, list):
        array = np.asarray(predictions, dtype=np.int64)
        expected = doc.get("predictions_sha256")
        if expected is not None and array_sha256(array) != expected:
            raise CliError(f"the predictions do not hash to the answer's predictions_sha256 {expected}", 1)
        pred_file = predictions_path(output)
        pred_file.parent.mkdir(parents=True, exist_ok=True)
        np.save(pred_file, array)
    write_json(output, doc)
    return pred_file


def cmd_task(args: argparse.Namespace) -> int:
    if args.retries < 0:
        raise CliError(f"--retries must be >= 0, got {args.retries}")
    if not args.timeout > 0:
        raise CliError(f"--timeout must be > 0 seconds, got {args.timeout}")
    if args.wait:
        doc = wait_task(args.url, args.task_id, api_key=args.api_key, timeout=args.timeout,
                        retries=args.retries, max_wait=args.max_wait)
    else:
        doc = get_task(args.url, args.task_id, api_key=args.api_key, retries=args.retries,
                       max_wait=args.max_wait, timeout=min(args.timeout, 60.0))
    line = status_line(doc)
    if args.output:
        output = Path(args.output)
        pred_file = write_answer(output, doc)
        line += f"; wrote {output}" + (f" and {pred_file}" if pred_file else "")
    print(line)
    if args.wait and doc.get("status") != "succeeded":
        return 1
    return 0


def add_task(sub) -> None:
    p = sub.add_parser("task", help="a task's status, or its answer once done (--wait: until it is)")
    p.add_argument("task_id", metavar="ID", help="the task id (rev88 submit --async prints it)")
    p.add_argument("--wait", action="store_true", help="poll until the task has finished (every 0.1 s at first, "
                   "growing to every 2 s), at most --timeout seconds; exit status 0 only if it succeeded")
    p.add_argument("--output", help="write the JSON (a succeeded task's answer, else its status document); a "
                   "succeeded task's predictions go beside it (result.json -> result.predictions.npy)")
    _add_client_flags(p, "with --wait: seconds to wait for the task to finish (default 900)", 900.0)
    p.set_defaults(func=cmd_task)


def cmd_cancel(args: argparse.Namespace) -> int:
    if args.retries < 0:
        raise CliError(f"--retries must be >= 0, got {args.retries}")
    target = task_url(args.url, args.task_id) + "/cancel"
    with _client(args.timeout) as client:
        response = _send(client, "POST", target, retries=args.retries, max_wait=args.max_wait, stream=sys.stderr,
                         headers={"Accept": "application/json", **_auth(args.api_key)})
    if response.status_code != 200:
        raise _refused(response, f"to cancel task {args.task_id}", args.retries)
    doc = _json_object(response)
    print(status_line(doc))
    status = doc.get("status")
    if status == "cancelled":
        return 0
    if status in FINISHED:  # it finished on its own before the cancel reached it
        raise CliError(f"task {args.task_id} finished ({status}) before the cancel took effect", 2)
    raise CliError(f"task {args.task_id} is still {status}: the cancel was asked for but not yet confirmed; "
                   f"see rev88 task {args.task_id} --wait", 1)


def add_cancel(sub) -> None:
    p = sub.add_parser("cancel", help="cancel a task: a queued one never runs, a running one is stopped")
    p.add_argument("task_id", metavar="ID", help="the task id")
    _add_client_flags(p, "seconds to wait for the server's answer (default 60)")
    p.set_defaults(func=cmd_cancel)
