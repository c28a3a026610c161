"""``rev88 submit``, ``tasks``, ``task`` and ``cancel``: the service's client end on the command line,
over ``rev88.Client`` (rev88/client.py: the requests, the 503 retry policy, the typed errors).

``submit`` uploads a task npz to a running service, streaming the file with a progress bar on
stderr, retries a 503 (queue full, not ready, draining) as the server's Retry-After asks within a
bounded number of tries, and writes the JSON answer. Exit status: 0 answer written; 2 the server
refused the task (4xx, its message printed) or bad local input; 1 anything else (no connection,
5xx, still busy after the last retry). ``submit --async`` asks for ``Prefer: respond-async`` and
prints the task id (the last line of stdout) once the server has stored the task.

``tasks`` lists the ledger (GET /tasks, newest first, ``--all`` through every page), ``task ID``
shows one (GET /tasks/{id}; ``--wait`` polls until it has finished; ``--output`` writes its JSON
and a succeeded task's predictions .npy beside it) and ``cancel ID`` cancels one
(POST /tasks/{id}/cancel). Every request retries a 503 the same way. Exit status as above:
an unknown id (404) or a cancel of a finished task (409) is 2; ``task --wait`` is 0 only if
the task succeeded, 1 if it failed, was cancelled or is still unfinished at ``--timeout``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from rev88.client import (
    DEFAULT_RETRY_WAIT_S,
    FINISHED,
    TASK_STATUSES,
    Answer,
    BadInput,
    Client,
    ClientError,
    Dataset,
    NotFinished,
    Refused,
    TaskFailed,
    TaskStatus,
    TimedOut,
    Unavailable,
    task_error_text,
)
from rev88.client import retry_after_seconds as retry_after_seconds  # the one retry policy, also known here

from .common import CliError, predictions_path, write_json
from .progress import bar as progress_bar

_sleep = time.sleep  # the tests replace this to record the waits (retries and polls)


def _pause(seconds: float) -> None:
    _sleep(seconds)  # looked up at each call, so a replaced _sleep is the one used


def exit_status(exc: ClientError) -> int:
    """2: refused (4xx), bad local input, or a task that failed for a 4xx reason; 1 otherwise."""
    if isinstance(exc, (Refused, BadInput)):
        return 2
    if isinstance(exc, TaskFailed) and isinstance(exc.status, int) and 400 <= exc.status < 500:
        return 2
    return 1


def client_errors(cmd: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A command whose ClientError becomes a CliError: its message, its exit status."""

    @functools.wraps(cmd)
    def run(args: argparse.Namespace) -> int:
        try:
            return cmd(args)
        except ClientError as exc:
            raise CliError(str(exc), exit_status(exc)) from None

    return run


def open_client(args: argparse.Namespace, timeout: float) -> Client:
    """The Client for a command's --url, --api-key, --retries and --max-wait; busy notices on stderr."""
    url = args.url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise CliError(f"--url must start with http:// or https://, got {args.url!r}")
    if args.retries < 0:
        raise CliError(f"--retries must be >= 0, got {args.retries}")
    if not args.max_wait >= 0:
        raise CliError(f"--max-wait must be >= 0 seconds, got {args.max_wait}")

    def busy(exc: Unavailable, wait: float, retry: int) -> None:
        sys.stderr.write(f"server busy (503: {exc.message}); retrying in {wait:g} s (retry {retry} of {args.retries})\n")
        sys.stderr.flush()

    return Client(url, api_key=args.api_key, timeout=timeout, retries=args.retries, max_wait=args.max_wait,
                  on_retry=busy, sleep=_pause)


# --------------------------------------------------------------------------- submit


class Progress:
    """One try's upload bar: tqdm on stderr when it is a terminal (rev88/cli/progress.py); otherwise
    one summary line once the upload ends (logs stay readable). Then the line saying what it waits for."""

    def __init__(self, total: int, stream: IO[str] | None = None,
                 waiting: str = "waiting for the result (queue + training)..."):
        self.total, self.done = total, 0
        self.waiting = waiting
        self.stream = stream if stream is not None else sys.stderr
        self.bar = progress_bar(total, "upload", "B", self.stream, unit_scale=True, unit_divisor=1000)
        self.tty = not self.bar.disable
        self._t0 = time.monotonic()

    def update(self, n: int) -> None:
        self.done += n
        self.bar.update(n)

    def close(self) -> None:
        """End the bar where it stands (a try that did not finish: the next try draws its own)."""
        self.bar.close()

    def finish(self) -> None:
        secs = time.monotonic() - self._t0
        if self.tty:
            self.bar.close()
        else:
            self.stream.write(f"uploaded {_mb(self.done)} in {secs:.1f} s\n")
        self.stream.write(self.waiting + "\n")
        self.stream.flush()


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def upload_progress(waiting: str, stream: IO[str] | None = None) -> Callable[[int, int], None]:
    """The Client's progress callback drawing a ``Progress`` bar: a new bar for each try."""
    bars: list[Progress] = []

    def report(sent: int, total: int) -> None:
        if sent == 0:
            if bars:
                bars[-1].close()
            bars.append(Progress(total, stream=stream, waiting=waiting))
        bar = bars[-1]
        bar.update(sent - bar.done)
        if sent >= total:
            bar.finish()

    return report


def config_overrides(path: str) -> dict[str, Any]:
    """A JSON object of config overrides, each a number (the server validates them)."""
    from learner.config import read_config_json
    from learner.errors import ConfigError

    try:
        data = read_config_json(path)
    except ConfigError as exc:
        raise CliError(exc.message) from None
    for key, value in data.items():
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise CliError(f"config file {path}: {key} must be a number, got {value!r}")
    return {str(k): v for k, v in data.items()}


def _task_failed(exc: TaskFailed) -> CliError:
    return CliError(str(exc), exit_status(exc))


@client_errors
def cmd_submit(args: argparse.Namespace) -> int:
    if args.task.startswith("sha256:"):  # a dataset stored on the service (rev88 dataset put)
        path = Dataset(args.task)
    else:
        path = Path(args.task)
        if not path.is_file():
            raise CliError(f"task file not found: {path}")
    if not args.asynchronous and not args.output:
        raise CliError("--output is required (where to write the JSON answer) unless --async")
    config = config_overrides(args.config) if args.config else {}
    if args.webhook:  # (the client sends these as the request's webhook, not as config)
        config["webhook"] = args.webhook
        if args.webhook_events:
            config["webhook_events"] = args.webhook_events
    elif args.webhook_events:
        raise CliError("--webhook-events needs --webhook URL")
    waiting = ("waiting for the server to accept it..." if args.asynchronous
               else "waiting for the result (queue + training)...")
    with open_client(args, args.timeout) as client:
        try:
            got = client.send(path, respond_async=args.asynchronous, backend=args.backend or None,
                              include_scores=args.include_scores, idempotency_key=args.idempotency_key,
                              progress=None if args.no_progress else upload_progress(waiting), **config)
        except TimedOut as exc:
            raise CliError(f"{exc}; raise --timeout for long tasks", 1) from None
        output = Path(args.output) if args.output else None
        if args.asynchronous:
            doc = got.document
            task_id = str(doc.get("id", ""))
            if not task_id:
                raise CliError("the server accepted the task but named no task id", 1)
            if output is not None:
                write_json(output, doc)
            location = got.location if isinstance(got, TaskStatus) else None
            print(f"task {task_id} {doc.get('status', 'accepted')}; poll {location or client.task_url(task_id)}"
                  f" or: rev88 task {task_id} --url {args.url} --wait" + (f"; wrote {output}" if output else ""))
            print(task_id)
            return 0
        if isinstance(got, TaskStatus):  # an Idempotency-Key seen before whose task has not finished yet
            print(f"task {got.id} (this Idempotency-Key's) is {got.status or '?'}; waiting for it", file=sys.stderr)
            try:
                got = client.wait(got.id, timeout=args.timeout)
            except TaskFailed as exc:
                raise _task_failed(exc) from None
            except NotFinished as exc:
                raise CliError(f"{exc} (--timeout); it goes on: rev88 task {got.id} --wait", 1) from None
    answer = got.document
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


def add_client_flags(p, timeout_help: str, timeout: float = 60.0) -> None:
    p.add_argument("--url", required=True, help="the service, e.g. http://127.0.0.1:8000")
    p.add_argument("--api-key", default=os.environ.get("REV88_API_KEY") or None,
                   help="sent as 'Authorization: Bearer KEY' [default: $REV88_API_KEY]")
    p.add_argument("--retries", type=int, default=5,
                   help="how often to retry a 503 (default 5), after its Retry-After, else "
                   f"{DEFAULT_RETRY_WAIT_S:g} s doubling with each retry")
    p.add_argument("--max-wait", type=float, default=60.0,
                   help="longest wait between retries in seconds, whatever Retry-After says (default 60)")
    p.add_argument("--timeout", type=float, default=timeout, help=timeout_help)


def add_submit(sub) -> None:
    p = sub.add_parser("submit", help="upload a task npz to a running service and save its JSON answer "
                       "(--async: print its task id instead of waiting)")
    p.add_argument("task", help="task npz: train_images, train_labels, test_images; or sha256:<hex>, a dataset "
                   "stored on the service (rev88 dataset put), trained on without sending it")
    p.add_argument("--async", dest="asynchronous", action="store_true",
                   help="ask for 'Prefer: respond-async': print the task id (last line of stdout) once the "
                   "server has stored the task, without waiting; fetch it with 'rev88 task ID --wait'")
    p.add_argument("--idempotency-key", help="sent as Idempotency-Key: the same key and file give the same task "
                   "(a retry never trains twice); another file with the same key is refused (409)")
    p.add_argument("--backend", help="ask for a backend (e.g. cpu); default: the server's")
    p.add_argument("--config", help="JSON object of config overrides, e.g. {\"batch_size\": 64}")
    p.add_argument("--include-scores", action="store_true", help="ask for the (M, 10) scores too")
    p.add_argument("--webhook", metavar="URL", help="POST a signed message there when the task finishes "
                   "(docs/webhooks.md)")
    p.add_argument("--webhook-events", metavar="EVENTS", help="comma list of started, completed (default completed)")
    p.add_argument("--output", help="where to write the JSON answer (required without --async; with it, "
                   "the 202's task summary)")
    p.add_argument("--no-progress", action="store_true", help="no upload progress on stderr")
    add_client_flags(p, "seconds to wait for the answer (default 900)", 900.0)
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


@client_errors
def cmd_tasks(args: argparse.Namespace) -> int:
    if args.limit is not None and args.limit < 1:
        raise CliError(f"--limit must be >= 1, got {args.limit}")
    with open_client(args, args.timeout) as client:
        if args.all:  # every page from --cursor (or the first) to the last
            tasks, cursor = [t.document for t in client.tasks(args.status, args.limit, cursor=args.cursor)], None
        else:
            page = client.page(args.status, args.limit, args.cursor)
            tasks, cursor = [t.document for t in page.tasks], page.next_cursor
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
    add_client_flags(p, "seconds to wait for each page (default 60)")
    p.set_defaults(func=cmd_tasks)


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
        line += f": {task_error_text(doc)}"
    return line


def write_answer(output: Path, got: Answer | TaskStatus) -> Path | None:
    """The JSON at ``output``; for a succeeded task its predictions (int64) beside it too, as
    ``rev88 run`` writes them, checked against the answer's predictions_sha256 (BadAnswer if not)."""
    import numpy as np

    pred_file = None
    if isinstance(got, Answer):
        array = got.predictions  # decoded and checked against predictions_sha256
        pred_file = predictions_path(output)
        pred_file.parent.mkdir(parents=True, exist_ok=True)
        np.save(pred_file, array)
    write_json(output, got.document)
    return pred_file


@client_errors
def cmd_task(args: argparse.Namespace) -> int:
    if not args.timeout > 0:
        raise CliError(f"--timeout must be > 0 seconds, got {args.timeout}")
    with open_client(args, 60.0 if args.wait else min(args.timeout, 60.0)) as client:
        if not args.wait:
            got = client.get(args.task_id)
        else:
            try:
                got = client.wait(args.task_id, timeout=args.timeout)
            except TaskFailed as exc:  # failed or cancelled: its status document, and exit status 1
                got = TaskStatus(exc.document or {})
            except NotFinished as exc:
                raise CliError(f"{exc} (--timeout); it goes on: rev88 task {args.task_id} --wait", 1) from None
    line = status_line(got.document)
    if args.output:
        output = Path(args.output)
        pred_file = write_answer(output, got)
        line += f"; wrote {output}" + (f" and {pred_file}" if pred_file else "")
    print(line)
    if args.wait and not isinstance(got, Answer):
        return 1
    return 0


def add_task(sub) -> None:
    p = sub.add_parser("task", help="a task's status, or its answer once done (--wait: until it is)")
    p.add_argument("task_id", metavar="ID", help="the task id (rev88 submit --async prints it)")
    p.add_argument("--wait", action="store_true", help="poll until the task has finished (every 0.1 s at first, "
                   "growing to every 2 s), at most --timeout seconds; exit status 0 only if it succeeded")
    p.add_argument("--output", help="write the JSON (a succeeded task's answer, else its status document); a "
                   "succeeded task's predictions go beside it (result.json -> result.predictions.npy)")
    add_client_flags(p, "with --wait: seconds to wait for the task to finish (default 900)", 900.0)
    p.set_defaults(func=cmd_task)


@client_errors
def cmd_cancel(args: argparse.Namespace) -> int:
    with open_client(args, args.timeout) as client:
        doc = client.cancel(args.task_id).document
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
    add_client_flags(p, "seconds to wait for the server's answer (default 60)")
    p.set_defaults(func=cmd_cancel)
