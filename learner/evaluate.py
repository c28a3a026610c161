"""``rev88 evaluate``: reproduce the published multi-draw MNIST-medium result.

For each draw k (dataset seed 2026091400 + k) the evaluator builds the task
exactly as ``make-task`` does, runs it — in this process, or through a running
service when ``--url`` is given — and scores the predictions against that
draw's held-back query labels. The labels never leave the evaluator: the
learner (or the service) only ever receives the three allowed arrays.

Output folder:
  summary.json               per-draw figures and hashes, totals, error bands, config, versions
  predictions/draw-NN.npy    int64 predictions, query order
  README.md                  the table printed at the end
  accuracy.svg               per-draw accuracy, mean ± SD, the error-band thresholds

Draws are limited to the published ones, k = 0..10: ``correct / 110,000`` and
the error-band verdicts are statements about that set.

Arithmetic: per-draw accuracies, their mean, the mean error and the band
verdicts are computed with exact fractions of the integer counts, so "the
unrounded mean error is at most the band" is decided exactly (a float would
make 1 - 0.95 slightly larger than 0.05). Only the SD is a float (a square root).
"""

from __future__ import annotations

import argparse
import email.utils
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from rev88.cli.common import CliError  # moves with the evaluate command (rev88/cli)

from .data import bundled_mnist_dir

DRAW_SEED_BASE = 2026091400
PUBLISHED_DRAWS = range(0, 11)
ERROR_BANDS_PERCENT = (2, 3, 5, 8, 12)
DEFAULT_RETRIES = 5
MAX_RETRY_WAIT_S = 120.0
OUTPUT_FILES = ("summary.json", "README.md", "accuracy.svg")


# --------------------------------------------------------------------------- draws


def dataset_seed(draw: int) -> int:
    return DRAW_SEED_BASE + draw


def parse_draws(text: str) -> list[int]:
    """``"0-10"``, ``"0,3,5"``, ``"2"`` or a mix (``"0-2,7"``) -> sorted draw numbers.

    Every draw must be one of the published draws 0..10; duplicates, empty
    items, reversed ranges and non-numbers are errors that say which item is wrong.
    """
    if not text or not text.strip():
        raise CliError("--draws is empty; give e.g. 0-10, 0,3,5 or 2")
    seen: list[int] = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            raise CliError(f"--draws {text!r} has an empty item; give e.g. 0-10, 0,3,5 or 2")
        if "-" in item[1:]:
            a_text, b_text = item.split("-", 1)
            a, b = _draw_number(a_text, text), _draw_number(b_text, text)
            if b < a:
                raise CliError(f"--draws range {item!r} runs backwards; write {b}-{a}")
            values = list(range(a, b + 1))
        else:
            values = [_draw_number(item, text)]
        for v in values:
            if v in seen:
                raise CliError(f"--draws {text!r} names draw {v} more than once")
            seen.append(v)
    outside = [v for v in seen if v not in PUBLISHED_DRAWS]
    if outside:
        raise CliError(
            f"draw(s) {', '.join(map(str, outside))} outside the published draws "
            f"{PUBLISHED_DRAWS.start}..{PUBLISHED_DRAWS.stop - 1} (dataset seeds "
            f"{dataset_seed(PUBLISHED_DRAWS.start)}..{dataset_seed(PUBLISHED_DRAWS.stop - 1)})"
        )
    return sorted(seen)


def _draw_number(item: str, whole: str) -> int:
    item = item.strip()
    if not item.isdigit():
        raise CliError(f"--draws {whole!r}: {item!r} is not a draw number (0..10) or a range like 0-10")
    return int(item)


# --------------------------------------------------------------------------- figures (pure)


def mean_fraction(values: Sequence[Fraction]) -> Fraction:
    if not values:
        raise ValueError("mean of no values")
    return sum(values, Fraction(0)) / len(values)


def sample_sd_pp(accuracies: Sequence[Fraction | int | float]) -> float | None:
    """Sample SD (n - 1) of accuracies given as fractions of 1, in percentage points.

    The variance is exact (fractions); only its square root is rounded.
    None for fewer than two draws, where a sample SD is undefined.
    """
    if len(accuracies) < 2:
        return None
    xs = [Fraction(a) for a in accuracies]
    m = mean_fraction(xs)
    variance = sum(((x - m) ** 2 for x in xs), Fraction(0)) / (len(xs) - 1)
    return math.sqrt(variance * 10000)


def bands_met(mean_error: Fraction, bands: Sequence[int] = ERROR_BANDS_PERCENT) -> dict[int, bool]:
    """Band b (percent) is met when the unrounded mean error is at most b/100, decided exactly.

    ``mean_error`` must be exact (a Fraction or int); a float is refused, since
    floats cannot hold most decimal boundaries (0.05 as a float is above 1/20).
    """
    if isinstance(mean_error, float):
        raise TypeError("bands_met needs an exact mean error (Fraction), not a float")
    e = Fraction(mean_error)
    return {b: e <= Fraction(b, 100) for b in bands}


def totals(correct: Sequence[int], total: Sequence[int]) -> dict[str, Any]:
    """Totals over draws: pooled count, mean accuracy, sample SD, mean error, bands met."""
    if not correct or len(correct) != len(total):
        raise ValueError("totals needs one correct/total pair per draw")
    accs = [Fraction(c, t) for c, t in zip(correct, total)]
    mean_acc = mean_fraction(accs)
    mean_err = 1 - mean_acc
    met = bands_met(mean_err)
    sum_c, sum_t = sum(correct), sum(total)
    return {
        "draws": len(correct),
        "correct": sum_c,
        "total": sum_t,
        "correct_over_total": f"{sum_c:,} / {sum_t:,}",
        "pooled_accuracy": sum_c / sum_t,
        "mean_accuracy": float(mean_acc),
        "mean_accuracy_percent": float(mean_acc * 100),
        "sd_accuracy_pp": sample_sd_pp(accs),
        "mean_error": float(mean_err),
        "mean_error_percent": float(mean_err * 100),
        "mean_error_exact": f"{mean_err.numerator}/{mean_err.denominator}",
        "error_bands": [
            {"band_percent": b, "min_mean_accuracy_percent": 100 - b, "met": ok} for b, ok in met.items()
        ],
        "error_band_rule": "a band b is met when the unrounded mean error (1 - mean of per-draw "
        "accuracies, exact) is at most b %",
    }


# --------------------------------------------------------------------------- runners


@dataclass
class RunAnswer:
    """What a runner hands back for one draw: predictions plus evidence."""

    predictions: np.ndarray
    metadata: dict[str, Any]
    wall_seconds: float
    service: dict[str, Any] | None = None
    versions: dict[str, Any] | None = None


class InProcessRunner:
    """Runs each task with ``learner.result.run_task`` in this process."""

    def __init__(self, config, backend: str) -> None:
        from .backends import get_backend

        self.config = config
        self.backend = get_backend(backend)  # raises BackendUnavailable with a clear message

    def describe(self) -> str:
        return f"in process, backend {self.backend.name}"

    def __call__(self, task) -> RunAnswer:
        from .result import run_task

        t0 = time.perf_counter()
        result = run_task(task, self.config, self.backend)
        wall = time.perf_counter() - t0
        return RunAnswer(result.predictions, result.metadata, wall)


@dataclass
class ServiceRunner:
    """Posts each task to ``{url}/tasks`` and checks the answer against local hashes."""

    url: str
    config: Any
    backend: str | None
    api_key: str | None = None
    retries: int = DEFAULT_RETRIES
    timeout_s: float = 900.0
    sleep: Callable[[float], None] = time.sleep
    transport: Any = None  # an httpx transport; None = the network
    log: TextIO = field(default_factory=lambda: sys.stderr)

    def describe(self) -> str:
        return f"service {self.url}" + (f", backend {self.backend}" if self.backend else "")

    def params(self) -> dict[str, str]:
        # Every config field, sent explicitly, so the service cannot silently use other defaults.
        out = {k: (repr(v) if isinstance(v, float) else str(v)) for k, v in self.config.as_dict().items()}
        if self.backend:
            out["backend"] = self.backend
        return out

    def headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/octet-stream", "Accept": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def __call__(self, task) -> RunAnswer:
        import httpx

        from .taskio import task_to_npz_bytes

        body = task_to_npz_bytes(task)  # exactly train_images, train_labels, test_images
        t0 = time.perf_counter()
        with httpx.Client(
            timeout=httpx.Timeout(self.timeout_s, connect=10.0), transport=self.transport
        ) as client:
            response = self._post(client, body)
        wall = time.perf_counter() - t0
        return self._answer(response, task, wall)

    def _post(self, client, body: bytes):
        import httpx

        endpoint = self.url + "/tasks"
        for attempt in range(self.retries + 1):
            try:
                r = client.post(endpoint, content=body, params=self.params(), headers=self.headers())
            except httpx.TimeoutException as exc:
                raise CliError(
                    f"the service at {self.url} did not answer within {self.timeout_s:.0f} s: {exc}", 1
                ) from None
            except httpx.HTTPError as exc:
                raise CliError(f"cannot reach the service at {self.url}: {exc}", 1) from None
            if r.status_code == 503 and attempt < self.retries:
                wait = retry_after_seconds(r.headers.get("Retry-After"), attempt)
                print(
                    f"service busy (503: {_error_text(r)}); retry {attempt + 1}/{self.retries} in {wait:.1f} s",
                    file=self.log,
                    flush=True,
                )
                self.sleep(wait)
                continue
            if r.status_code == 200:
                return r
            raise _http_error(r, self.url, attempt)
        raise AssertionError("unreachable")  # pragma: no cover

    def _answer(self, r, task, wall: float) -> RunAnswer:
        from .hashing import array_sha256

        try:
            doc = r.json()
            raw, meta = doc["predictions"], doc["metadata"]
            if not isinstance(raw, list) or not isinstance(meta, dict):
                raise TypeError("predictions must be a list and metadata an object")
        except (ValueError, KeyError, TypeError) as exc:
            raise CliError(
                f"the service's answer is not the documented JSON (id, predictions, metadata): {exc}", 1
            ) from None
        if len(raw) != task.test_count:
            raise CliError(f"the service returned {len(raw)} predictions for {task.test_count} queries", 1)
        if not all(type(p) is int and 0 <= p <= 9 for p in raw):
            raise CliError("the service's predictions are not all class numbers 0..9", 1)
        preds = np.asarray(raw, dtype=np.int64)
        digest = array_sha256(preds)
        if digest != doc.get("predictions_sha256") or digest != meta.get("predictions_sha256"):
            raise CliError("the service's predictions do not hash to the predictions_sha256 it reported", 1)
        sent = {name: array_sha256(arr) for name, arr in task.as_dict().items()}
        if meta.get("input_hashes") != sent:
            raise CliError("the service reports input hashes that differ from the arrays sent", 1)
        if meta.get("config") != self.config.as_dict():
            raise CliError(
                f"the service ran config {meta.get('config')} instead of {self.config.as_dict()}", 1
            )
        service = {key: doc.get(key) for key in ("id", "timing", "device", "energy", "energy_reason")}
        return RunAnswer(preds, meta, wall, service=service, versions=doc.get("versions"))


def retry_after_seconds(value: str | None, attempt: int) -> float:
    """Seconds to wait from a Retry-After header (seconds or HTTP date), else 1, 2, 4 ... s; capped."""
    wait: float | None = None
    if value:
        value = value.strip()
        if value.isdigit():
            wait = float(value)
        else:
            try:
                when = email.utils.parsedate_to_datetime(value)
                wait = when.timestamp() - time.time()
            except (TypeError, ValueError):
                wait = None
    if wait is None:
        wait = float(2**attempt)
    return min(max(wait, 0.0), MAX_RETRY_WAIT_S)


def _error_text(r) -> str:
    try:
        doc = r.json()
    except ValueError:
        return r.text[:300] or r.reason_phrase
    if isinstance(doc, dict):
        msg = doc.get("error") or doc.get("detail") or doc
        return msg if isinstance(msg, str) else json.dumps(msg)[:300]
    return str(doc)[:300]


def _http_error(r, url: str, attempt: int) -> CliError:
    status, text = r.status_code, _error_text(r)
    if status == 503:
        return CliError(f"the service at {url} stayed busy (503) after {attempt} retries: {text}", 1)
    if status == 401:
        return CliError(f"the service refused the request (401 unauthorized: {text}); pass --api-key", 2)
    if 400 <= status < 500:
        return CliError(f"the service rejected the task ({status}): {text}", 2)
    return CliError(f"the service failed ({status}): {text}", 1)


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


# --------------------------------------------------------------------------- evaluation


def score(predictions: np.ndarray, labels: np.ndarray) -> int:
    if predictions.shape != labels.shape:
        raise CliError(f"predictions have shape {predictions.shape} but the query labels {labels.shape}", 1)
    return int((predictions == labels).sum())


def evaluate(
    mnist_dir: Path,
    draws: Sequence[int],
    runner: Callable,
    output: Path,
    progress: Progress | None = None,
) -> list[dict[str, Any]]:
    """Build, run and score each draw; write predictions/draw-NN.npy; return per-draw records."""
    from .hashing import array_sha256
    from .taskio import make_task

    pred_dir = output / "predictions"
    pred_dir.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    for k in draws:
        if progress:
            progress.start(k)
        t0 = time.perf_counter()
        task, query_labels = make_task(mnist_dir, dataset_seed(k))
        build = time.perf_counter() - t0
        answer: RunAnswer = runner(task)  # the labels stay here
        preds = np.ascontiguousarray(answer.predictions, dtype=np.int64)
        correct, total = score(preds, query_labels), int(query_labels.size)
        pred_file = pred_dir / f"draw-{k:02d}.npy"
        np.save(pred_file, preds)
        meta = answer.metadata
        record: dict[str, Any] = {
            "draw": k,
            "dataset_seed": dataset_seed(k),
            "correct": correct,
            "total": total,
            "accuracy": correct / total,
            "input_hashes": {name: array_sha256(arr) for name, arr in task.as_dict().items()},
            "query_labels_sha256": array_sha256(query_labels),
            "predictions_sha256": array_sha256(preds),
            "predictions_file": str(pred_file.relative_to(output)),
            "training_prediction_seconds": meta.get("training_prediction_seconds"),
            "preparation_seconds": meta.get("preparation_seconds"),
            "wall_seconds": answer.wall_seconds,
            "build_seconds": build,
            "backend": meta.get("backend"),
            "device": meta.get("device"),
        }
        if answer.service is not None:
            record["service"] = answer.service
            record["service_versions"] = answer.versions
        records.append(record)
        if progress:
            progress.finish(k, correct, total, answer.wall_seconds)
    return records


def build_summary(
    records: list[dict[str, Any]], config, backend: str | None, url: str | None, elapsed: float
) -> dict[str, Any]:
    from .result import versions

    backends = sorted({r["backend"] for r in records if r["backend"]})
    service_versions = next((r["service_versions"] for r in records if r.get("service_versions")), None)
    return {
        "protocol": {
            "dataset_seed": f"{DRAW_SEED_BASE} + k",
            "data": "MNIST training split; rows order[:10000] train, order[10000:20000] queries; 9x9 box-area",
            "labels": "query labels stay with the evaluator; the learner sees only the three task arrays",
        },
        "draws": [{k: v for k, v in r.items() if k != "service_versions"} for r in records],
        "totals": totals([r["correct"] for r in records], [r["total"] for r in records]),
        "config": config.as_dict(),
        "backend": {"requested": backend if url else (backend or "auto"), "used": backends},
        "mode": "service" if url else "in-process",
        "url": url,
        "versions": {"evaluator": versions(), "service": service_versions},
        "elapsed_seconds": elapsed,
    }


def format_table(summary: dict[str, Any]) -> str:
    """The Markdown table ``evaluate`` prints and writes to README.md."""
    lines = [
        "| draw | dataset seed | correct / total | accuracy | train+predict (s) | wall (s) | predictions sha256 |",
        "|---:|---:|---:|---:|---:|---:|:---|",
    ]
    tp_sum = wall_sum = 0.0
    for r in summary["draws"]:
        tp = r["training_prediction_seconds"]
        tp_sum += tp or 0.0
        wall_sum += r["wall_seconds"]
        lines.append(
            f"| {r['draw']} | {r['dataset_seed']} | {r['correct']:,} / {r['total']:,} | "
            f"{100 * r['accuracy']:.2f} % | {_secs(tp)} | {r['wall_seconds']:.2f} | "
            f"`{r['predictions_sha256'][:16]}…` |"
        )
    t = summary["totals"]
    lines.append(
        f"| **all** | | **{t['correct_over_total']}** | **{100 * t['pooled_accuracy']:.3f} %** | "
        f"{tp_sum:.2f} | {wall_sum:.2f} | |"
    )
    sd = t["sd_accuracy_pp"]
    sd_text = f" ± {sd:.2f} pp (sample SD, {t['draws']} draws)" if sd is not None else " (one draw: no SD)"
    bands = " · ".join(f"{b['band_percent']} % {'met' if b['met'] else 'not met'}" for b in t["error_bands"])
    used = ", ".join(summary["backend"]["used"]) or "?"
    where = f"through {summary['url']}" if summary["url"] else "in process"
    lines += [
        "",
        f"Mean accuracy {t['mean_accuracy_percent']:.3f} %{sd_text}; mean error "
        f"{t['mean_error_percent']:.3f} % (exact {t['mean_error_exact']}).",
        f"Error bands (met when the unrounded mean error is at most the band): {bands}.",
        f"Backend {used}, {where}; config {json.dumps(summary['config'], separators=(',', ':'))}; "
        f"{summary['elapsed_seconds']:.1f} s in all.",
    ]
    return "\n".join(lines)


def _secs(v: float | None) -> str:
    return "?" if v is None else f"{v:.2f}"


def write_report(output: Path, summary: dict[str, Any]) -> str:
    from .report_plot import accuracy_svg

    table = format_table(summary)
    (output / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (output / "README.md").write_text(
        "# rev88 evaluation\n\n"
        "Per-draw predictions are in `predictions/`, every figure and hash in `summary.json`, "
        "the chart in `accuracy.svg`.\n\n" + table + "\n\n![per-draw accuracy](accuracy.svg)\n"
    )
    t = summary["totals"]
    draws = summary["draws"]
    (output / "accuracy.svg").write_text(
        accuracy_svg(
            [r["draw"] for r in draws],
            [r["correct"] for r in draws],
            [r["total"] for r in draws],
            t["mean_accuracy_percent"],
            t["sd_accuracy_pp"],
            [b["band_percent"] for b in t["error_bands"]],
            [b["met"] for b in t["error_bands"]],
            title=f"rev88 accuracy per draw ({t['correct_over_total']} correct)",
        )
    )
    return table


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
    from .config import Config, load_config_file

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
    records = evaluate(mnist_dir, draws, runner, output, Progress(len(draws)))
    summary = build_summary(records, config, args.backend, url, time.perf_counter() - t0)
    table = write_report(output, summary)
    print(table)
    print(
        f"\nwrote {output}/summary.json, README.md, accuracy.svg and predictions/draw-NN.npy", file=sys.stderr
    )
    return 0


def add_evaluate(sub) -> None:
    from .backends import NAMES

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
