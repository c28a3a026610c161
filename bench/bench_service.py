"""What the HTTP service costs on top of the learner, for one 10k/10k task on the CPU.

Starts the service (a real uvicorn process on loopback, cpu backend), sends the same
MNIST-medium draw-0 task (10,000 train / 10,000 queries; a synthetic task of the same
shape when the MNIST files are absent) ``--repeats`` times one after another, and
compares, per request and as medians:

    client end-to-end   POST to parsed JSON answer, measured by this script
    server total        the service's timing.total_ms (arrival to answer built)
    receive body        the upload streaming in (timing.receive_ms)
    parse               npz read + validation (timing.parse_ms)
    queue wait          accepted -> device start (timing.queue_wait_ms)
    device job          the executor job: prepare + learner run + hashing (timing.device_ms)
    learner run         the learner's own run time (timing.run_ms, from the same request)

Ratios are against the learner run of the same requests, so they hold on any machine;
nothing here is a pass/fail threshold. Not a test: run it by hand,

    python bench/bench_service.py [--repeats 10] [--threads N] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from learner.data import bundled_mnist_dir  # noqa: E402
from learner.taskio import TaskArrays, make_task, task_to_npz_bytes, validate_task  # noqa: E402
from tests.server import post_task, running_server  # noqa: E402

MNIST = bundled_mnist_dir()
DRAW0_SEED = 2026091400
ROWS = (
    ("client end-to-end", "client_ms"),
    ("server total", "total_ms"),
    ("receive body", "receive_ms"),
    ("parse (npz + validation)", "parse_ms"),
    ("queue wait", "queue_wait_ms"),
    ("device job (prepare+run+hash)", "device_ms"),
    ("learner run", "run_ms"),
)


def the_task() -> tuple[TaskArrays, str]:
    if (MNIST / "train-images.idx3-ubyte.gz").exists() or (MNIST / "train-images.idx3-ubyte").exists():
        return make_task(MNIST, DRAW0_SEED)[0], "MNIST-medium draw 0"
    rng = np.random.default_rng(0)
    task = validate_task(
        rng.random((10_000, 1, 9, 9), dtype=np.float32),
        rng.integers(0, 10, 10_000).astype(np.int64),
        rng.random((10_000, 1, 9, 9), dtype=np.float32),
    )
    return task, "synthetic 10k/10k (MNIST files not found)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=10, help="timed requests (default 10; at least 10)")
    parser.add_argument("--threads", type=int, help="REV88_THREADS for the server (default: torch's default)")
    parser.add_argument("--json", help="also write the per-request figures here")
    args = parser.parse_args(argv)
    if args.repeats < 10:
        parser.error("--repeats must be at least 10 (the medians need them)")

    task, what = the_task()
    body = task_to_npz_bytes(task)
    env = {"REV88_BACKEND": "cpu", "REV88_LOG_LEVEL": "warning"}
    if args.threads:
        env["REV88_THREADS"] = str(args.threads)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp, running_server(Path(tmp), env=env) as server, server.client(timeout=600) as c:
        warm = post_task(c, body)  # first request of the shape: not timed
        warm.raise_for_status()
        expected = warm.json()["predictions_sha256"]
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            r = post_task(c, body)
            answer = r.json()
            client_ms = (time.perf_counter() - t0) * 1000.0
            r.raise_for_status()
            if answer["predictions_sha256"] != expected:
                raise SystemExit("predictions changed between identical requests")
            rows.append({"client_ms": client_ms, **{k: answer["timing"][k] for _, k in ROWS[1:]}})
        threads = c.get("/health").json()["learner"]["backends"]["cpu"]["threads"]

    med = {key: statistics.median(r[key] for r in rows) for _, key in ROWS}
    run = med["run_ms"]
    print(f"rev88 service overhead: {what}, {task.train_count:,} train / {task.test_count:,} queries, "
          f"cpu backend, {threads} torch thread(s), {len(body) / 1e6:.1f} MB npz, {args.repeats} requests")
    print(f"{'':32}{'median ms':>11}{'min ms':>10}{'max ms':>10}{'x learner run':>15}")
    for label, key in ROWS:
        values = [r[key] for r in rows]
        print(f"{label:32}{med[key]:11.1f}{min(values):10.1f}{max(values):10.1f}{med[key] / run:15.3f}")
    overhead = statistics.median(r["client_ms"] - r["run_ms"] for r in rows)
    print(f"{'median per-request overhead':32}{overhead:11.1f} ms  (client end-to-end minus learner run, "
          f"{overhead / run * 100:.1f}% of the run)")
    if args.json:
        Path(args.json).write_text(json.dumps({"task": what, "threads": threads, "requests": rows,
                                               "medians": med}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
