"""A CPU stand-in for a backend that batches, for the benchmarks only (never a product backend).

On a GPU the service's tasks take the batching path: the executor gathers queued tasks of one
launch key into one ``run_many`` launch of up to REV88_BATCH_MAX tasks (the fused backend), and
each task's answer is built from its share of the launch (app/tasks/device.py). No CPU backend
batches, so on this machine that path never runs under ``rev88 serve``. ``BatchingStandIn`` is
the cpu-fast backend plus a ``run_many`` that runs each task of a launch in turn: real results,
computed one by one, through the service's batching path, so that what the shell costs on that
path (the gathering, the launch's hand-overs, the answers of a launch) can be measured here.

    python bench/batching_stand_in.py serve --backend cpu-fast --batch-max 32 ...

is the real ``rev88 serve`` command line with every cpu-fast backend the service creates wrapped
(bench/bench_shell.py --batch-max starts it this way).
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class BatchingStandIn:
    """cpu-fast's ``run``, and a ``run_many`` over it (one task after another)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name, self.device = inner.name, inner.device
        self.launches = 0

    def describe(self) -> dict:
        return {**self.inner.describe(), "stand_in": "batching (bench/batching_stand_in.py)"}

    def run(self, task, prepared):
        return self.inner.run(task, prepared)

    def run_many(self, tasks, prepareds):
        self.launches += 1
        return [self.inner.run(t, p) for t, p in zip(tasks, prepareds)]


def stand_in_engines():
    from learner.backends import get_backend

    cache: dict[tuple, BatchingStandIn] = {}
    lock = threading.Lock()

    def engines(name: str, device: str | None = None):
        inner = get_backend(name, device)
        if inner.name != "cpu-fast":
            return inner
        with lock:
            key = (inner.name, inner.device)
            if key not in cache:
                cache[key] = BatchingStandIn(inner)
            return cache[key]

    return engines


def main(argv: list[str]) -> int:
    import app.service
    from rev88.cli import main as rev88_main

    app.service.get_backend = stand_in_engines()
    return rev88_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
