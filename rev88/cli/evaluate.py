"""``rev88 evaluate``: reproduce the published multi-draw MNIST-medium result.

For each draw k (dataset seed 2026091400 + k) it builds the task exactly as ``make-task`` does,
runs it — in this process (``learner.evaluate.InProcessRunner``), or through a running service
when ``--url`` is given — scores it against that draw's held-back query labels and writes a
report folder (``learner.evaluate``: summary.json, predictions/draw-NN.npy, README.md,
accuracy.svg). The labels never leave the evaluator: the learner only ever receives the three
allowed arrays.

With ``--url`` the service grades the draws itself in one request (``ServerEvaluation``: POST
/evaluations; it builds the draws from its own MNIST files and keeps its own copy of the labels),
and this side checks every figure against the draws it builds; a service without /evaluations,
or ``--uploads``, gets one upload per draw (``ServiceRunner``, over ``rev88.Client``).

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
    dataset_seed,
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
from .progress import bar as progress_bar

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
            raise self.error(exc) from None
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

    def error(self, exc: ClientError) -> CliError:
        """The CliError (message, exit status) of a client error from this service."""
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


# --------------------------------------------------------------------------- graded on the server


@dataclass
class ServerEvaluation:
    """One ``POST /evaluations`` (``rev88.Client.evaluate``): the server builds and runs the draws
    and counts them against labels it keeps. This side then checks what it was given, as it
    would for its own uploads: each draw's predictions (fetched, hashed as claimed), its input
    hashes and query-label hash against the draw built here, its count against this side's own
    scoring of those predictions, and the config against the one asked for. ``run`` returns the
    per-draw records ``learner.evaluate.evaluate`` would, or None when the server offers no
    /evaluations (an older one): then each draw is uploaded as before."""

    url: str
    config: Any
    backend: str | None
    api_key: str | None = None
    retries: int = DEFAULT_RETRIES
    timeout_s: float = DEFAULT_TIMEOUT_S
    transport: Any = None
    evaluation_id: str | None = None

    def describe(self) -> str:
        return f"graded by the service {self.url}" + (f", backend {self.backend}" if self.backend else "")

    def run(self, mnist_dir: Path, draws: list[int], output: Path, progress: Progress | None) -> list[dict] | None:
        import numpy as np

        from learner.evaluate import score
        from learner.hashing import array_sha256
        from learner.taskio import make_task

        shown: set[int] = set()

        def report(got) -> None:
            for row in got.draws:
                if progress is not None and row["status"] == "succeeded" and row["draw"] not in shown:
                    shown.add(row["draw"])
                    progress.finish(row["draw"], row["correct"], row["total"], (row.get("run_ms") or 0) / 1000)

        try:
            with Client(self.url, api_key=self.api_key, timeout=self.timeout_s, retries=self.retries,
                        transport=self.transport) as client:
                try:
                    self.evaluation_id = client.submit_evaluation(draws, backend=self.backend, **self.config.as_dict())
                except Refused as exc:
                    if exc.status in (404, 405):
                        return None
                    raise
                got = client.wait_evaluation(self.evaluation_id, timeout=max(self.timeout_s, 3600.0), progress=report)
                if got.status != "completed":
                    failed = [f"draw {r['draw']}: {r.get('error') or r['status']}" for r in got.draws
                              if r["status"] != "succeeded"]
                    raise CliError(f"the service's evaluation {got.id} {got.status}: {'; '.join(failed)}", 1)
                if got.document.get("config") != self.config.as_dict():
                    raise CliError(f"the service graded config {got.document.get('config')} instead of "
                                   f"{self.config.as_dict()}", 1)
                rows = {r["draw"]: r for r in got.draws}
                predictions = {k: client.predictions(rows[k]["task_id"]) for k in draws}  # checked against their hash
                versions = got.document.get("versions")
        except ClientError as exc:
            raise ServiceRunner(self.url, self.config, self.backend, retries=self.retries,
                                timeout_s=self.timeout_s).error(exc) from None
        pred_dir = output / "predictions"
        pred_dir.mkdir(parents=True, exist_ok=True)
        records = []
        for k in draws:
            row, preds = rows[k], np.ascontiguousarray(predictions[k], dtype=np.int64)
            t0 = time.perf_counter()
            task, query_labels = make_task(mnist_dir, dataset_seed(k))
            build = time.perf_counter() - t0
            sent = {name: array_sha256(arr) for name, arr in task.as_dict().items()}
            if row.get("input_hashes") != sent:
                raise CliError(f"draw {k}: the service built other arrays than this side does (input hashes "
                               f"{row.get('input_hashes')} instead of {sent})", 1)
            if row.get("query_labels_sha256") != array_sha256(query_labels):
                raise CliError(f"draw {k}: the service holds other query labels than this side builds", 1)
            correct = score(preds, query_labels)
            if correct != row["correct"] or array_sha256(preds) != row["predictions_sha256"]:
                raise CliError(f"draw {k}: the service counts {row['correct']} correct, this side {correct} from the "
                               "same predictions", 1)
            pred_file = pred_dir / f"draw-{k:02d}.npy"
            np.save(pred_file, preds)
            timing = row.get("timing") or {}
            records.append({
                "draw": k, "dataset_seed": dataset_seed(k), "correct": correct, "total": int(query_labels.size),
                "accuracy": correct / int(query_labels.size), "input_hashes": sent,
                "query_labels_sha256": array_sha256(query_labels), "predictions_sha256": array_sha256(preds),
                "predictions_file": str(pred_file.relative_to(output)),
                "training_prediction_seconds": row.get("training_prediction_seconds"),
                "preparation_seconds": row.get("preparation_seconds"),
                "wall_seconds": (timing.get("total_ms") or 0.0) / 1000, "build_seconds": build,
                "backend": row.get("backend"), "device": row.get("device"),
                "service": {"id": row["task_id"], "evaluation": self.evaluation_id, "timing": timing,
                            "device": row.get("device"), "energy": row.get("energy")},
                "service_versions": versions,
            })
        return records


# --------------------------------------------------------------------------- progress


class Progress:
    """The draws' bar: tqdm on stderr when it is a terminal (rev88/cli/progress.py), the last
    draw's figures beside it; otherwise one line per draw (logs stay readable)."""

    def __init__(self, count: int, stream: TextIO | None = None) -> None:
        self.count, self.done = count, 0
        self.stream = stream if stream is not None else sys.stderr
        self.bar = progress_bar(count, "evaluate", "draw", self.stream)
        self.tty = not self.bar.disable

    def start(self, draw: int) -> None:
        self.bar.set_postfix_str(f"running draw {draw}")

    def finish(self, draw: int, correct: int, total: int, seconds: float) -> None:
        self.done += 1
        note = f"draw {draw}: {correct:,} / {total:,} ({100 * correct / total:.2f} %) in {seconds:.2f} s"
        if self.tty:
            self.bar.set_postfix_str(note, refresh=False)
            self.bar.update(1)
            if self.done == self.count:
                self.bar.close()
        else:
            self.stream.write(f"evaluate {self.done}/{self.count} {note}\n")
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
    if args.uploads and not args.url:
        raise CliError("--uploads only applies with --url (the service)")
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
    t0 = time.perf_counter()
    records = graded = None
    if url and not args.uploads:
        graded = ServerEvaluation(url, config, args.backend, api_key, retries=args.retries)
        print(f"evaluating draw(s) {args.draws} ({len(draws)} task(s)), {graded.describe()}", file=sys.stderr)
        records = graded.run(mnist_dir, draws, output, Progress(len(draws)))
        if records is None:
            print("the service has no /evaluations: uploading each draw instead", file=sys.stderr)
    if records is None:
        print(f"evaluating draw(s) {args.draws} ({len(draws)} task(s)), {runner.describe()}", file=sys.stderr)
        try:
            records = evaluate(mnist_dir, draws, runner, output, Progress(len(draws)))
        except ValueError as exc:  # e.g. predictions that do not match the query labels' shape
            raise CliError(str(exc), 1) from None
    summary = build_summary(records, config, args.backend, url, time.perf_counter() - t0)
    if graded is not None and graded.evaluation_id is not None:
        summary["evaluation"] = {"id": graded.evaluation_id, "location": f"{url}/evaluations/{graded.evaluation_id}",
                                 "report": f"{url}/evaluations/{graded.evaluation_id}/report"}
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
    p.add_argument("--url", help="run through the service at this base URL instead of in process: one "
                   "POST /evaluations (graded on the server, checked here), or one upload per draw where the "
                   "service has no /evaluations")
    p.add_argument("--uploads", action="store_true",
                   help="with --url: upload each draw as its own task instead of one server-side evaluation")
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
