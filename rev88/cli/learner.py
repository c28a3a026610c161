"""The learner's own commands: ``rev88 run``, ``make-task`` and ``score``.

The parser, ``main`` and exit statuses are in ``rev88/cli/__init__.py``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from .common import CliError, predictions_path, write_json

# --------------------------------------------------------------------------- run


def cmd_run(args: argparse.Namespace) -> int:
    from learner.budget import check_budget, estimate, limits_from_env
    from learner.config import Config, load_config_file
    from learner.result import run_task
    from learner.taskio import load_task

    max_work, max_bytes = limits_from_env()  # REV88_MAX_TASK_WORK, REV88_MAX_TASK_BYTES
    config = load_config_file(args.config) if args.config else Config()
    task = load_task(args.input)
    check_budget(estimate(task.train_count, task.test_count, config), max_work, max_bytes)
    result = run_task(task, config, args.backend)
    output = Path(args.output)
    doc = result.document()
    pred_file = predictions_path(output)
    doc["predictions_file"] = pred_file.name
    write_json(output, doc)
    np.save(pred_file, result.predictions)
    meta = result.metadata
    print(
        f"trained on {meta['train_count']} examples, predicted {meta['test_count']} queries "
        f"with backend {meta['backend']} in {meta['training_prediction_seconds']:.3f} s; "
        f"predictions_sha256 {result.predictions_sha256[:16]}…; wrote {output} and {pred_file}"
    )
    return 0


def add_run(sub) -> None:
    from learner.backends import NAMES

    p = sub.add_parser(
        "run",
        help="train fresh on a task npz and predict its queries",
        description="Train fresh on a task npz and predict its queries. A task over the budget "
        "(learner.budget: REV88_MAX_TASK_WORK work units, REV88_MAX_TASK_BYTES bytes) is refused "
        "with exit status 2 before it trains.",
    )
    p.add_argument("--input", required=True, help="task npz: train_images, train_labels, test_images")
    p.add_argument("--config", help="JSON object of config overrides (unknown keys are an error)")
    p.add_argument("--backend", default="auto", choices=NAMES)
    p.add_argument("--output", required=True, help="result JSON path; predictions .npy goes beside it")
    p.set_defaults(func=cmd_run)


# --------------------------------------------------------------------------- make-task


def cmd_make_task(args: argparse.Namespace) -> int:
    from learner.hashing import array_sha256
    from learner.taskio import make_task, save_task

    task, query_labels = make_task(args.mnist_dir, args.dataset_seed)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_task(out, task)
    msg = f"wrote {out}: {task.train_count} train / {task.test_count} queries (dataset seed {args.dataset_seed})"
    if args.labels_output:
        lp = Path(args.labels_output)
        lp.parent.mkdir(parents=True, exist_ok=True)
        np.save(lp, query_labels)
        msg += f"; query labels -> {lp} (keep them away from the learner)"
    print(msg)
    print(f"train_labels sha256 {array_sha256(task.train_labels)}")
    return 0


def add_make_task(sub) -> None:
    p = sub.add_parser("make-task", help="build an MNIST-medium draw from raw MNIST idx files")
    p.add_argument("--mnist-dir", help="folder with train-images/train-labels idx[.gz] "
                   "[default: $REV88_MNIST_DIR, else the checkout's data/mnist]")
    p.add_argument("--dataset-seed", required=True, type=int, help="e.g. 2026091400 for draw 0")
    p.add_argument("--output", required=True, help="task npz to write")
    p.add_argument("--labels-output", help="where to write the held-back query labels (.npy)")
    p.set_defaults(func=cmd_make_task)


# --------------------------------------------------------------------------- score


def load_label_like(path: str, what: str) -> np.ndarray:
    try:
        arr = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise CliError(f"{what} file not found: {path}") from None
    except ValueError as exc:
        raise CliError(f"{what} file {path} is not a plain .npy array: {exc}") from None
    if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise CliError(f"{what} must be a 1-D integer array, got {getattr(arr, 'shape', '?')} {getattr(arr, 'dtype', '?')}")
    return arr


def score(predictions: np.ndarray, labels: np.ndarray) -> tuple[int, int]:
    if predictions.shape != labels.shape:
        raise CliError(f"predictions have shape {predictions.shape} but labels {labels.shape}")
    return int((predictions == labels).sum()), int(labels.size)


def cmd_score(args: argparse.Namespace) -> int:
    correct, total = score(load_label_like(args.predictions, "predictions"), load_label_like(args.labels, "labels"))
    print(f"{correct} / {total} correct, accuracy {correct / total:.4f}")
    return 0


def add_score(sub) -> None:
    p = sub.add_parser("score", help="compare predictions with held-back labels")
    p.add_argument("--predictions", required=True)
    p.add_argument("--labels", required=True)
    p.set_defaults(func=cmd_score)
