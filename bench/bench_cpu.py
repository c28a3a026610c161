"""Seconds per 10k/10k task on the CPU: plain autograd, the cpu backend, and cpu-fast.

For the MNIST-medium draw-0 task (10,000 train / 10,000 queries; a synthetic task of the same
shape when the MNIST files are absent) and the default config, this times in one process:

    plain autograd eager   learner.train.train_predict(..., reversible=False): the loop as
                           written, autograd keeping every activation
    cpu backend            the reference backend (reversible core, autograd per branch)
    cpu-fast               the compiled kernel (learner/backends/cpu_fast_train.h)

each on 1 and on 2 threads (torch intra-op threads for the first two, kernel threads for
cpu-fast), interleaved round by round so that load from other processes falls on all of
them alike, and prints a markdown table of medians with speed-ups against plain autograd at
the same thread count. cpu-fast's predictions are checked against the cpu backend's.
The span timed is the call that trains and predicts (lift, every epoch, scoring the queries).

Speed goals live here, never in tests. Not a test: run it by hand, at a quiet moment (the
load average is printed before and after; a busy machine inflates every number),

    python bench/bench_cpu.py [--repeats 7] [--threads 1,2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from learner.backends.cpu import CpuBackend  # noqa: E402
from learner.backends.cpu_fast import CpuFastBackend  # noqa: E402
from learner.config import Config  # noqa: E402
from learner.data import bundled_mnist_dir  # noqa: E402
from learner.taskio import TaskArrays, make_task, validate_task  # noqa: E402
from learner.train import prepare, train_predict  # noqa: E402

MNIST = bundled_mnist_dir()
DRAW0_SEED = 2026091400
METHODS = ("plain autograd eager", "cpu backend", "cpu-fast")


def the_task() -> tuple[TaskArrays, np.ndarray | None, str]:
    if (MNIST / "train-images.idx3-ubyte.gz").exists() or (MNIST / "train-images.idx3-ubyte").exists():
        task, labels = make_task(MNIST, DRAW0_SEED)
        return task, labels, "MNIST-medium draw 0"
    rng = np.random.default_rng(0)
    task = validate_task(
        rng.random((10_000, 1, 9, 9), dtype=np.float32),
        rng.integers(0, 10, 10_000).astype(np.int64),
        rng.random((10_000, 1, 9, 9), dtype=np.float32),
    )
    return task, None, "synthetic 10k/10k (MNIST files not found)"


def plain_autograd(task: TaskArrays, prepared) -> tuple[float, np.ndarray]:
    tr, te = torch.from_numpy(task.train_images), torch.from_numpy(task.test_images)
    labels = torch.from_numpy(task.train_labels)
    initial = [torch.from_numpy(p) for p in prepared.initial]
    orders = [torch.from_numpy(p) for p in prepared.permutations]
    t0 = time.perf_counter()
    _, _, scores = train_predict(tr, labels, te, initial, orders, prepared.config, reversible=False)
    return time.perf_counter() - t0, scores.numpy()


def backend_run(engine, task: TaskArrays, prepared) -> tuple[float, np.ndarray]:
    t0 = time.perf_counter()
    out = engine.run(task, prepared)
    return time.perf_counter() - t0, out.scores


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7, help="timed rounds per method (>= 5)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--json", type=Path, help="also write the raw timings here")
    args = ap.parse_args(argv)
    if args.repeats < 5:
        ap.error("--repeats must be >= 5 (the table reports medians)")
    thread_counts = [int(x) for x in args.threads.split(",") if x.strip()]

    task, query_labels, what = the_task()
    config = Config()
    prepared = prepare(task, config)
    fast = {t: CpuFastBackend(threads=t) for t in thread_counts}
    cpu = CpuBackend()
    reference = cpu.run(task, prepared).scores.argmax(axis=1)  # also warms torch up
    plain_predictions = None
    load_before = os.getloadavg()
    times: dict[tuple[str, int], list[float]] = {(m, t): [] for m in METHODS for t in thread_counts}
    for rnd in range(args.repeats + 1):  # round 0 warms up (first-call costs), not timed
        for t in thread_counts:
            torch.set_num_threads(t)
            for method in METHODS:
                if method == "plain autograd eager":
                    seconds, scores = plain_autograd(task, prepared)
                elif method == "cpu backend":
                    seconds, scores = backend_run(cpu, task, prepared)
                else:
                    seconds, scores = backend_run(fast[t], task, prepared)
                predictions = scores.argmax(axis=1)
                if method == "plain autograd eager":
                    plain_predictions = predictions
                elif not np.array_equal(predictions, reference):
                    raise SystemExit(f"{method} on {t} thread(s): predictions differ from the cpu backend's")
                if rnd:
                    times[(method, t)].append(seconds)
    load_after = os.getloadavg()

    print(f"task: {what}; config: {config.as_dict()}")
    if query_labels is not None:
        print(f"correct: cpu backend and cpu-fast {int((reference == query_labels).sum())} / {len(query_labels)}"
              f" (identical predictions); plain autograd {int((plain_predictions == query_labels).sum())}")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs; "
          f"torch {torch.__version__}; load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    print(f"median of {args.repeats} rounds, seconds per task (train + predict)\n")
    print("| method | threads | median s | min s | speed-up vs plain autograd |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for t in thread_counts:
        base = statistics.median(times[("plain autograd eager", t)])
        for method in METHODS:
            series = times[(method, t)]
            med = statistics.median(series)
            print(f"| {method} | {t} | {med:.4f} | {min(series):.4f} | {base / med:.1f}x |")
    if args.json:
        args.json.write_text(json.dumps({
            "task": what,
            "config": config.as_dict(),
            "load_average": {"before": load_before, "after": load_after},
            "seconds": {f"{m} / {t} thread(s)": times[(m, t)] for m, t in times},
        }, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
