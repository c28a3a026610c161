"""``rev88 evaluate``: reproduce the published multi-draw MNIST-medium result.

For each draw k (dataset seed 2026091400 + k) it builds the task exactly as ``make-task`` does,
runs it — in this process (``learner.evaluate.InProcessRunner``), or through a running service
when ``--url`` is given (``ServiceRunner``, over ``rev88.Client``) — scores it against that draw's
held-back query labels and writes a report folder (``learner.evaluate``: summary.json,
predictions/draw-NN.npy, README.md, accuracy.svg). The labels never leave the evaluator: the
learner (or the service) only ever receives the three allowed arrays.

Exit status: 0 report written; 2 bad input (draws, flags, a refused task); 1 anything else.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from learner.evaluate import (
    OUTPUT_FILES,
    InProcessRunner,
    RunAnswer,
    build_summary,
    evaluate,
    write_report,
)
from learner.evaluate import parse_draws as parse_learner_draws
from rev88.client import (
    DEFAULT_RETRIES,
    DEFAULT_TIMEOUT_S,
    BadAnswer,
    Client,
    ClientError,
    Refused,
    TimedOut,
    Unavailable,
)

from .common import CliError

# --------------------------------------------------------------------------- --draws


def parse_draws(text: str) -> list[int]:
    """``learner.evaluate.parse_draws`` with its message as a CliError (exit status 2)."""
    try:
        return parse_learner_draws(text, "--draws")
    except ValueError as exc:
        raise CliError(str(exc)) from None


# --------------------------------------------------------------------------- through a service


@dataclass
class ServiceRunner:
    """Sends each task to the service at ``url`` (``rev88.Client.run``, every config field given
    explicitly, so the service cannot silently use other defaults) and checks the answer: its
    predictions against their hash (the Client does), its input hashes against the arrays sent,
    its config against the one asked for. Errors become CliError (2 refused, 1 otherwise)."""

    url: str
    config: Any
    backend: str | None
    api_key: str | None = None
    retries: int = DEFAULT_RETRIES
    timeout_s: float = DEFAULT_TIMEOUT_S
    sleep: Callable[[float], None] = time.sleep
    transport: Any = None  # an httpx transport; None = the network
    log: TextIO = field(default_factory=lambda: sys.stderr)

    def describe(self) -> str:
        return f"service {self.url}" + (f", backend {self.backend}" if self.backend else "")

    def _busy(self, exc: Unavailable, wait: float, retry: int) -> None:
        print(f"service busy (503: {exc.message}); retry {retry}/{self.retries} in {wait:.1f} s",
              file=self.log, flush=True)

    def __call__(self, task) -> RunAnswer:
        from learner.hashing import array_sha256
        from learner.taskio import task_to_npz_bytes

        body = task_to_npz_bytes(task)  # exactly train_images, train_labels, test_images
        t0 = time.perf_counter()
        try:
            with Client(self.url, api_key=self.api_key, timeout=self.timeout_s, retries=self.retries,
                        on_retry=self._busy, sleep=self.sleep, transport=self.transport) as client:
                answer = client.run(body, backend=self.backend, **self.config.as_dict())
            predictions = answer.predictions  # decoded, checked against predictions_sha256
        except ClientError as exc:
            raise self._error(exc) from None
        wall = time.perf_counter() - t0
        meta = answer.metadata
        if len(predictions) != task.test_count:
            raise CliError(f"the service returned {len(predictions)} predictions for {task.test_count} queries", 1)
        sent = {name: array_sha256(arr) for name, arr in task.as_dict().items()}
        if meta.get("input_hashes") != sent:
            raise CliError("the service reports input hashes that differ from the arrays sent", 1)
        if meta.get("config") != self.config.as_dict():
            raise CliError(f"the service ran config {meta.get('config')} instead of {self.config.as_dict()}", 1)
        doc = answer.document
        service = {key: doc.get(key) for key in ("id", "timing", "device", "energy", "energy_reason")}
        return RunAnswer(predictions, meta, wall, service=service, versions=doc.get("versions"))

    def _error(self, exc: ClientError) -> CliError:
        if isinstance(exc, Unavailable):
            return CliError(f"the service at {self.url} stayed busy (503) after {self.retries} retries: "
                            f"{exc.message}", 1)
        if isinstance(exc, Refused) and exc.status == 401:
            return CliError(f"the service refused the request (401 unauthorized: {exc.message}); pass --api-key", 2)
        if isinstance(exc, Refused):
            return CliError(f"the service rejected the task ({exc.status}): {exc.message}", 2)
        if isinstance(exc, TimedOut):
            return CliError(f"the service at {self.url} did not answer within {self.timeout_s:.0f} s: {exc}", 1)
        if isinstance(exc, BadAnswer) or exc.status is None:
            return CliError(str(exc), 1)
        return CliError(f"the service failed ({exc.status}): {exc.message}", 1)


# --------------------------------------------------------------------------- progress


class Progress:
    """A dependency-free progress bar over draws on stderr (one line per draw when not a TTY)."""

    def __init__(self, count: int, stream: TextIO | None = None, width: int = 24) -> None:
        self.count, self.done, self.width = count, 0, width
        self.stream = stream if stream is not None else sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()

    def _bar(self) -> str:
        filled = round(self.width * self.done / self.count)
        return "[" + "#" * filled + "-" * (self.width - filled) + f"] {self.done}/{self.count}"

    def start(self, draw: int) -> None:
        if self.tty:
            self.stream.write(f"\r\033[Kevaluate {self._bar()} running draw {draw} …")
            self.stream.flush()

    def finish(self, draw: int, correct: int, total: int, seconds: float) -> None:
        self.done += 1
        note = f"draw {draw}: {correct:,} / {total:,} ({100 * correct / total:.2f} %) in {seconds:.2f} s"
        elapsed = time.perf_counter() - self.t0
        if self.tty:
            self.stream.write(f"\r\033[Kevaluate {self._bar()} {note}; {elapsed:.0f} s elapsed")
            if self.done == self.count:
                self.stream.write("\n")
        else:
            self.stream.write(f"evaluate {self._bar()} {note}\n")
        self.stream.flush()


# --------------------------------------------------------------------------- command


def prepare_output(output: Path, overwrite: bool) -> None:
    if output.exists() and not output.is_dir():
        raise CliError(f"--output {output} exists and is not a folder")
    if output.is_dir() and any(output.iterdir()):
        if not overwrite:
            raise CliError(f"--output {output} is not empty; choose a new folder or pass --overwrite")
        for name in OUTPUT_FILES:
            (output / name).unlink(missing_ok=True)
        for old in (output / "predictions").glob("draw-*.npy"):
            old.unlink()  # stale draws from an earlier run would mislead
    output.mkdir(parents=True, exist_ok=True)


def cmd_evaluate(args: argparse.Namespace) -> int:
    from learner.config import Config, load_config_file
    from learner.data import bundled_mnist_dir

    draws = parse_draws(args.draws)
    mnist_dir = Path(args.mnist_dir) if args.mnist_dir else bundled_mnist_dir()
    if not mnist_dir.is_dir():
        raise CliError(
            f"--mnist-dir {mnist_dir} is not a folder (it needs train-images/train-labels idx[.gz])"
        )
    if args.retries < 0:
        raise CliError(f"--retries must be >= 0, got {args.retries}")
    api_key = (args.api_key or os.environ.get("REV88_API_KEY")) if args.url else None
    if args.api_key and not args.url:
        raise CliError("--api-key only applies with --url (the service); in-process runs need no key")
    config = load_config_file(args.config) if args.config else Config()
    if args.url:
        url = args.url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise CliError(f"--url must start with http:// or https://, got {args.url!r}")
        runner: Any = ServiceRunner(url, config, args.backend, api_key, retries=args.retries)
    else:
        url = None
        runner = InProcessRunner(config, args.backend or "auto")
    output = Path(args.output)
    prepare_output(output, args.overwrite)
    print(f"evaluating draw(s) {args.draws} ({len(draws)} task(s)), {runner.describe()}", file=sys.stderr)
    t0 = time.perf_counter()
    try:
        records = evaluate(mnist_dir, draws, runner, output, Progress(len(draws)))
    except ValueError as exc:  # e.g. predictions that do not match the query labels' shape
        raise CliError(str(exc), 1) from None
    summary = build_summary(records, config, args.backend, url, time.perf_counter() - t0)
    table = write_report(output, summary)
    print(table)
    print(
        f"\nwrote {output}/summary.json, README.md, accuracy.svg and predictions/draw-NN.npy", file=sys.stderr
    )
    return 0


def add_evaluate(sub) -> None:
    from learner.backends import NAMES

    p = sub.add_parser(
        "evaluate",
        help="run the published MNIST-medium draws and report accuracy, SD and error bands",
        description="Build each draw (dataset seed 2026091400 + k), run it in process or through a "
        "service, score it against the held-back query labels and write a report folder.",
    )
    p.add_argument("--mnist-dir", help="folder with train-images/train-labels idx[.gz] "
                   "[default: $REV88_MNIST_DIR, else the checkout's data/mnist]")
    p.add_argument(
        "--draws",
        default="0-10",
        help="published draws k in 0..10: a range 0-10, a list 0,3,5, a single 2 or a mix (default 0-10)",
    )
    p.add_argument("--config", help="JSON object of config overrides (unknown keys are an error)")
    p.add_argument(
        "--backend",
        choices=NAMES,
        default=None,
        help="learner backend (default auto in process; the service's default with --url)",
    )
    p.add_argument("--url", help="run through the service at this base URL instead of in process")
    p.add_argument("--api-key", help="service API key (Authorization: Bearer); default $REV88_API_KEY")
    p.add_argument(
        "--retries",
        type=int,
        default=DEFAULT_RETRIES,
        help=f"retries of a 503 (busy) answer, honoring Retry-After (default {DEFAULT_RETRIES})",
    )
    p.add_argument(
        "--output", required=True, help="report folder (created; must be empty unless --overwrite)"
    )
    p.add_argument("--overwrite", action="store_true", help="reuse a non-empty report folder")
    p.set_defaults(func=cmd_evaluate)
