"""``rev88 serve`` and ``rev88 submit``: the service's two ends on the command line.

``serve`` turns its flags into the ``REV88_*`` environment variables that
:mod:`app.settings` reads (a flag overrides the environment), checks them the
way the service will, and runs uvicorn on the ``app.main:create_app`` factory.

``submit`` uploads a task npz to a running service with httpx, streaming the file
with a progress bar on stderr, retries a 503 (queue full, not ready, draining) as
the server's Retry-After asks within a bounded number of tries, and writes the
JSON answer. Exit status: 0 answer written; 2 the server refused the task (4xx,
its message printed) or bad local input; 1 anything else (no connection, 5xx,
still busy after the last retry).
"""

from __future__ import annotations

import argparse
import email.utils
import math
import os
import signal
import sys
import time
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import IO, Any

from learner.cli import CliError, write_json

# --------------------------------------------------------------------------- serve

# flag destination -> the environment variable app.settings reads
SERVE_ENV = {
    "host": "REV88_HOST",
    "port": "REV88_PORT",
    "backend": "REV88_BACKEND",
    "queue_size": "REV88_QUEUE_SIZE",
    "max_body_bytes": "REV88_MAX_BODY_BYTES",
    "task_timeout": "REV88_TASK_TIMEOUT_S",
    "drain_timeout": "REV88_DRAIN_TIMEOUT_S",
    "api_key": "REV88_API_KEY",
    "log_level": "REV88_LOG_LEVEL",
    "threads": "REV88_THREADS",
    "batch_max": "REV88_BATCH_MAX",
    "batch_wait_ms": "REV88_BATCH_WAIT_MS",
    "workers": "REV88_WORKERS",
    "max_task_work": "REV88_MAX_TASK_WORK",
    "max_task_bytes": "REV88_MAX_TASK_BYTES",
}


def apply_serve_flags(args: argparse.Namespace, environ: MutableMapping[str, str] = os.environ) -> None:
    """Copy every flag given on the command line into its REV88_* variable."""
    for dest, var in SERVE_ENV.items():
        value = getattr(args, dest, None)
        if value is not None:
            environ[var] = str(value)


def graceful_shutdown_s(drain_timeout_s: float, force_exit_grace_s: float) -> int:
    """Whole seconds uvicorn waits for open requests after SIGTERM."""
    return max(1, math.ceil(drain_timeout_s + force_exit_grace_s))


def cmd_serve(args: argparse.Namespace) -> int:
    apply_serve_flags(args)
    from .settings import Settings, SettingsError

    try:
        settings = Settings.from_env()
    except SettingsError as exc:
        raise CliError(str(exc)) from None

    import uvicorn

    from learner.backends import BackendUnavailable

    from .devices import PlanError, plan
    from .service import FORCE_EXIT_GRACE_S
    from .tasks import check_backend

    try:
        backend = check_backend(settings.backend)  # e.g. "cuda" without a GPU: say so before uvicorn starts
    except BackendUnavailable as exc:
        raise CliError(f"{exc} (REV88_BACKEND / --backend)") from None
    try:
        workers = plan(backend, settings.workers, settings.queue_size, settings.batch_max)
    except PlanError as exc:
        raise CliError(f"{exc} (REV88_WORKERS / --workers)") from None

    shown = "[::1]" if settings.host == "::1" else settings.host
    print(
        f"rev88 serve: http://{shown}:{settings.port} (backend {settings.backend}, {len(workers.devices)} "
        f"worker(s), queue {workers.queue_size}, drain {settings.drain_timeout_s:g} s, auth "
        f"{'on' if settings.auth_enabled else 'off'}); API docs at /docs",
        file=sys.stderr,
    )
    # On SIGTERM the app starts draining (ready -> 503, no new tasks) and uvicorn stops
    # accepting and waits for open requests: a task waiting or running holds its request
    # open. At the drain timeout the app answers what is left with 503 and, if a client
    # still holds uvicorn FORCE_EXIT_GRACE_S later, tells it to exit. uvicorn's own
    # graceful-shutdown timeout is the same total, a backstop that never cuts earlier.
    # (Kubernetes: terminationGracePeriodSeconds must exceed preStop + this.)
    previous = {sig: signal.signal(sig, _stopped) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        uvicorn.run(
            "app.main:create_app",
            factory=True,
            host=settings.host,
            port=settings.port,
            workers=1,
            log_level=settings.log_level,
            access_log=False,  # the app logs each request itself (JSON, with its request id)
            timeout_graceful_shutdown=graceful_shutdown_s(settings.drain_timeout_s, FORCE_EXIT_GRACE_S),
            proxy_headers=False,
        )
    except _Stopped:
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


class _Stopped(Exception):
    pass


def _stopped(signum, frame) -> None:
    # uvicorn handles SIGTERM/SIGINT while it runs (the app drains), and once it has shut
    # down it raises the same signal again under the handlers it found: this one, so a
    # drained shutdown ends with status 0 (and Ctrl-C without a KeyboardInterrupt trace).
    raise _Stopped()


def add_serve(sub) -> None:
    from .settings import BACKENDS, LOG_LEVELS

    p = sub.add_parser(
        "serve",
        help="run the HTTP service (uvicorn); flags override the REV88_* environment variables",
        description="Run the rev88 HTTP service. Each flag sets the REV88_* variable named in its help "
        "and overrides it; unset flags keep the environment's value or the default.",
    )
    p.add_argument("--host", help="bind address [REV88_HOST, default 127.0.0.1; the container uses 0.0.0.0]")
    p.add_argument("--port", type=int, help="bind port [REV88_PORT, default 8000]")
    p.add_argument("--backend", help=f"{' | '.join(BACKENDS)} [REV88_BACKEND, default auto: the GPU when one is usable]")
    p.add_argument("--queue-size", type=int, help="tasks that may wait for a device [REV88_QUEUE_SIZE, default: "
                   "max(8, 4 x workers) on the CPU, 2 x batch_max x workers on GPUs]")
    p.add_argument("--max-body-bytes", type=int, help="largest request body [REV88_MAX_BODY_BYTES, default 64 MiB]")
    p.add_argument("--task-timeout", type=float, help="seconds of queue wait + run per task [REV88_TASK_TIMEOUT_S, default 300]")
    p.add_argument("--drain-timeout", type=float,
                   help="seconds to finish accepted work after SIGTERM [REV88_DRAIN_TIMEOUT_S, default 30]")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route but health "
                   "[REV88_API_KEY; prefer the variable: a flag shows in the process list]")
    p.add_argument("--log-level", help=f"{' | '.join(LOG_LEVELS)} [REV88_LOG_LEVEL, default info]")
    p.add_argument("--threads", type=int, help="torch/BLAS threads [REV88_THREADS, default: library default]")
    p.add_argument("--batch-max", type=int,
                   help="most tasks of one shape and config in one launch on a backend with batched launches "
                   "(fused); 1 turns batching off [REV88_BATCH_MAX, default: the GPU's SM count; 1 on the CPU]")
    p.add_argument("--batch-wait-ms", type=float,
                   help="milliseconds a launch waits for more matching tasks [REV88_BATCH_WAIT_MS, default 5]")
    p.add_argument("--workers", type=int, help="device workers [REV88_WORKERS, default: one per usable core "
                   "for the CPU backends, one per visible GPU for cuda/fused]")
    p.add_argument("--max-task-work", type=int, help="a task's estimated work limit [REV88_MAX_TASK_WORK, "
                   "default 50,000,000; see learner/budget.py]")
    p.add_argument("--max-task-bytes", type=int, help="a task's estimated memory limit in bytes "
                   "[REV88_MAX_TASK_BYTES, default 1 GiB]")
    p.set_defaults(func=cmd_serve)


# --------------------------------------------------------------------------- submit

CHUNK = 256 * 1024
DEFAULT_RETRY_WAIT_S = 2.0  # when a 503 names no Retry-After
_sleep = time.sleep  # the tests replace this to record the waits


class Progress:
    """An upload progress bar on a stream: redrawn in place on a terminal,
    one summary line otherwise (logs stay readable)."""

    def __init__(self, total: int, stream: IO[str] | None = None, enabled: bool = True, width: int = 30):
        self.total, self.done, self.width = total, 0, width
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
        self.stream.write("waiting for the result (queue + training)...\n")
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


def submit(
    path: Path,
    url: str,
    *,
    api_key: str | None = None,
    params: dict[str, str] | None = None,
    retries: int = 5,
    max_wait: float = 60.0,
    timeout: float = 900.0,
    progress: bool = True,
    stream: IO[str] | None = None,
) -> dict[str, Any]:
    """Upload ``path`` to ``url`` (…/tasks) and return the JSON answer; raise CliError otherwise."""
    import httpx

    stream = stream if stream is not None else sys.stderr
    size = path.stat().st_size
    headers = {"Content-Type": "application/octet-stream", "Content-Length": str(size)}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    target = tasks_url(url)
    limits = httpx.Timeout(connect=10.0, read=timeout, write=timeout, pool=10.0)
    with httpx.Client(timeout=limits) as client:
        for attempt in range(retries + 1):
            bar = Progress(size, stream=stream, enabled=progress)
            try:
                response = client.post(target, params=params or {}, headers=headers, content=file_chunks(path, bar))
            except httpx.ConnectError as exc:
                raise CliError(f"cannot connect to {target}: {exc} (is the service running?)", 1) from None
            except httpx.TimeoutException as exc:
                raise CliError(f"no answer from {target} within the timeout ({type(exc).__name__}); "
                               "raise --timeout for long tasks", 1) from None
            except httpx.HTTPError as exc:
                raise CliError(f"request to {target} failed: {type(exc).__name__}: {exc}", 1) from None
            status = response.status_code
            if status == 503 and attempt < retries:
                asked = retry_after_seconds(response.headers.get("Retry-After"))
                wait = min(asked, max_wait)
                stream.write(
                    f"server busy (503: {error_message(response)}); retrying in {wait:g} s "
                    f"(retry {attempt + 1} of {retries})\n"
                )
                stream.flush()
                _sleep(wait)
                continue
            break
    if status == 200:
        try:
            answer = response.json()
        except ValueError:
            raise CliError(f"the server answered 200 but not with JSON: {response.text[:200]!r}", 1) from None
        if not isinstance(answer, dict):
            raise CliError("the server answered 200 with JSON that is not an object", 1)
        return answer
    message = error_message(response)
    if status == 503:
        raise CliError(f"server still busy after {retries} retries (503): {message}", 1)
    if 400 <= status < 500:
        raise CliError(f"the server refused the task ({status}): {message}", 2)
    raise CliError(f"the server failed ({status}): {message}", 1)


def cmd_submit(args: argparse.Namespace) -> int:
    path = Path(args.task)
    if not path.is_file():
        raise CliError(f"task file not found: {path}")
    if args.retries < 0:
        raise CliError(f"--retries must be >= 0, got {args.retries}")
    if not args.max_wait >= 0:
        raise CliError(f"--max-wait must be >= 0 seconds, got {args.max_wait}")
    params: dict[str, str] = {}
    if args.config:
        params.update(config_params(args.config))
    if args.backend:
        params["backend"] = args.backend
    if args.include_scores:
        params["include"] = "scores"
    answer = submit(
        path,
        args.url,
        api_key=args.api_key,
        params=params,
        retries=args.retries,
        max_wait=args.max_wait,
        timeout=args.timeout,
        progress=not args.no_progress,
    )
    output = Path(args.output)
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


def add_submit(sub) -> None:
    p = sub.add_parser("submit", help="upload a task npz to a running service and save its JSON answer")
    p.add_argument("task", help="task npz: train_images, train_labels, test_images")
    p.add_argument("--url", required=True, help="the service, e.g. http://127.0.0.1:8000")
    p.add_argument("--api-key", default=os.environ.get("REV88_API_KEY") or None,
                   help="sent as 'Authorization: Bearer KEY' [default: $REV88_API_KEY]")
    p.add_argument("--backend", help="ask for a backend (e.g. cpu); default: the server's")
    p.add_argument("--config", help="JSON object of config overrides, e.g. {\"batch_size\": 64}")
    p.add_argument("--include-scores", action="store_true", help="ask for the (M, 10) scores too")
    p.add_argument("--output", required=True, help="where to write the JSON answer")
    p.add_argument("--retries", type=int, default=5, help="how often to retry a 503 (default 5)")
    p.add_argument("--max-wait", type=float, default=60.0,
                   help="longest wait between retries in seconds, whatever Retry-After says (default 60)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the answer (default 900)")
    p.add_argument("--no-progress", action="store_true", help="no upload progress on stderr")
    p.set_defaults(func=cmd_submit)
