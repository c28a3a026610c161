"""The published multi-draw MNIST-medium result, as a library (``rev88 evaluate`` is its command).

For each draw k (dataset seed 2026091400 + k) ``evaluate`` builds the task exactly as
``make-task`` does, hands it to a runner — ``InProcessRunner`` here, or one that sends it to a
service (rev88/cli/evaluate.py) — and scores the predictions against that draw's held-back query
labels. The labels never leave the evaluator: a runner only ever receives the three allowed arrays.

Report folder (``write_report``):
  summary.json               per-draw figures and hashes, totals, error bands, config, versions
  predictions/draw-NN.npy    int64 predictions, query order
  README.md                  the table
  accuracy.svg               per-draw accuracy, mean ± SD, the error-band thresholds

Draws are limited to the published ones, k = 0..10: ``correct / 110,000`` and
the error-band verdicts are statements about that set.

Arithmetic: per-draw accuracies, their mean, the mean error and the band
verdicts are computed with exact fractions of the integer counts, so "the
unrounded mean error is at most the band" is decided exactly (a float would
make 1 - 0.95 slightly larger than 0.05). Only the SD is a float (a square root).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Protocol

import numpy as np

DRAW_SEED_BASE = 2026091400
PUBLISHED_DRAWS = range(0, 11)
ERROR_BANDS_PERCENT = (2, 3, 5, 8, 12)
OUTPUT_FILES = ("summary.json", "README.md", "accuracy.svg")


# --------------------------------------------------------------------------- draws


def dataset_seed(draw: int) -> int:
    return DRAW_SEED_BASE + draw


def parse_draws(spec: str | Sequence[int], name: str = "--draws") -> list[int]:
    """``"0-10"``, ``"0,3,5"``, ``"2"``, a mix (``"0-2,7"``) or a list of ints -> sorted draws.

    Every draw must be one of the published draws 0..10; duplicates, empty items, reversed
    ranges and non-numbers are a ValueError that names ``name`` and the item that is wrong.
    """
    if not isinstance(spec, str):
        if not isinstance(spec, (list, tuple)) or not spec:
            raise ValueError(f"{name} must be a text like 0-10 or a non-empty list of draw numbers, got {spec!r}")
        bad = [v for v in spec if not isinstance(v, int) or isinstance(v, bool)]
        if bad:
            raise ValueError(f"{name}: {bad[0]!r} is not a draw number (0..10)")
        spec = ",".join(str(v) for v in spec)
    text = spec
    if not text.strip():
        raise ValueError(f"{name} is empty; give e.g. 0-10, 0,3,5 or 2")
    seen: list[int] = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            raise ValueError(f"{name} {text!r} has an empty item; give e.g. 0-10, 0,3,5 or 2")
        if "-" in item[1:]:
            a_text, b_text = item.split("-", 1)
            a, b = _draw_number(a_text, text, name), _draw_number(b_text, text, name)
            if b < a:
                raise ValueError(f"{name} range {item!r} runs backwards; write {b}-{a}")
            values = list(range(a, b + 1))
        else:
            values = [_draw_number(item, text, name)]
        for v in values:
            if v in seen:
                raise ValueError(f"{name} {text!r} names draw {v} more than once")
            seen.append(v)
    outside = [v for v in seen if v not in PUBLISHED_DRAWS]
    if outside:
        raise ValueError(
            f"{name}: draw(s) {', '.join(map(str, outside))} outside the published draws "
            f"{PUBLISHED_DRAWS.start}..{PUBLISHED_DRAWS.stop - 1} (dataset seeds "
            f"{dataset_seed(PUBLISHED_DRAWS.start)}..{dataset_seed(PUBLISHED_DRAWS.stop - 1)})"
        )
    return sorted(seen)


def _draw_number(item: str, whole: str, name: str) -> int:
    item = item.strip()
    if not (item.isascii() and item.isdigit()):
        raise ValueError(f"{name} {whole!r}: {item!r} is not a draw number (0..10) or a range like 0-10")
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


def wilson_interval(correct: int, total: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """The Wilson score interval (95 % by default) for a pooled accuracy ``correct / total``.

    It treats the ``total`` predictions as independent trials; the draws share images (each
    draws its 20,000 rows from the same 60,000), so it describes this learner on this pool of
    queries, not on unseen MNIST digits."""
    if total <= 0:
        raise ValueError("an interval needs at least one prediction")
    p = correct / total
    denominator = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denominator
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


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
        "pooled_accuracy_interval_95": list(wilson_interval(sum_c, sum_t)),
        "interval_rule": "Wilson score interval for the pooled count, the predictions taken as independent",
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


# --------------------------------------------------------------------------- evaluation


class DrawProgress(Protocol):
    """What ``evaluate`` tells of its progress (rev88/cli/evaluate.py draws it as a bar)."""

    def start(self, draw: int) -> None: ...

    def finish(self, draw: int, correct: int, total: int, seconds: float) -> None: ...


def score(predictions: np.ndarray, labels: np.ndarray) -> int:
    if predictions.shape != labels.shape:
        raise ValueError(f"predictions have shape {predictions.shape} but the query labels {labels.shape}")
    return int((predictions == labels).sum())


def evaluate(
    mnist_dir: Path,
    draws: Sequence[int],
    runner: Callable,
    output: Path,
    progress: DrawProgress | None = None,
) -> list[dict[str, Any]]:
    """Build, run and score each draw; write predictions/draw-NN.npy; return per-draw records.
    ``runner(task) -> RunAnswer`` gets the task's three arrays only."""
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
    """The Markdown table of a summary (``write_report`` writes it to README.md)."""
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
