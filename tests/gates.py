"""A real backend the test can hold: slowness made controllable instead of assumed.

``GatedBackend`` wraps a real backend; while its gate is held, every ``run`` waits before
it starts (and a cancelled task stops waiting: its token raises at this first check, as a
real backend's run loop does between minibatches). Release the gate and the run goes on
with the real backend, so answers and hashes are the real ones.

In this process the gate is an event (``Gate``). For a server in a child process the gate is
a file (``FileGate``): runs wait while the file exists. ``tests.gates:create_app`` is the
factory for such a server: ``running_server(..., gate=path)`` starts uvicorn with it.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from learner.backends import get_backend

GATE_ENV = "REV88_TEST_GATE_FILE"
BATCHING_ENV = "REV88_TEST_BATCHING"  # "1": the gated backends batch (a run_many over their run)


class Gate:
    """Held: runs wait. Open (the default): runs go straight through."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()

    def hold(self) -> None:
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def is_open(self) -> bool:
        return self._open.is_set()


class FileGate:
    """Held while ``path`` exists (another process holds and releases it)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def hold(self) -> None:
        self.path.touch()

    def release(self) -> None:
        self.path.unlink(missing_ok=True)

    def is_open(self) -> bool:
        return not self.path.exists()


class GatedBackend:
    def __init__(self, inner, gate) -> None:
        self.inner, self.gate = inner, gate
        self.name, self.device = inner.name, inner.device
        self.waiting = 0  # runs now held at the gate
        self.entered = 0  # runs that reached the gate
        self._lock = threading.Lock()

    def describe(self) -> dict:
        return {**self.inner.describe(), "gated": True}

    def run(self, task, prepared):
        with self._lock:
            self.entered += 1
            self.waiting += 1
        try:
            while not self.gate.is_open():
                cancel = getattr(prepared, "cancel", None)
                if cancel is not None:
                    cancel.check(epoch=0, step=0)
                time.sleep(0.005)
        finally:
            with self._lock:
                self.waiting -= 1
        return self.inner.run(task, prepared)


class GatedBatchingBackend(GatedBackend):
    """A gated backend that batches: ``run_many`` runs each task in turn (the gate held first), so
    the service's launch path runs on the CPU with real answers."""

    def run_many(self, tasks, prepareds):
        return [self.run(t, p) for t, p in zip(tasks, prepareds)]


def gated_engines(gate, batching: bool | None = None):
    """An ``engines`` hook for ``create_app``: every backend name -> its real backend, gated
    (``batching``, default $REV88_TEST_BATCHING == "1": with a ``run_many``)."""
    cache: dict[str, GatedBackend] = {}
    lock = threading.Lock()
    if batching is None:
        batching = os.environ.get(BATCHING_ENV) == "1"
    kind = GatedBatchingBackend if batching else GatedBackend

    def engines(name: str, device: str | None = None) -> GatedBackend:
        inner = get_backend(name, device)
        with lock:
            if inner.name not in cache:
                cache[inner.name] = kind(inner, gate)
            return cache[inner.name]

    return engines


def create_app():
    """uvicorn factory for a child-process server whose backends wait on ``$REV88_TEST_GATE_FILE``."""
    from app.main import create_app as real_create_app

    return real_create_app(engines=gated_engines(FileGate(os.environ[GATE_ENV])))


def main(argv: list[str]) -> int:
    """``python -m tests.gates GATE_FILE serve ...``: the real ``rev88`` command line, with every
    backend the service creates gated on GATE_FILE (a process-level stand-in for ``engines``)."""
    import app.service
    from rev88.cli import main as rev88_main

    app.service.get_backend = gated_engines(FileGate(argv[0]))
    return rev88_main(argv[1:])


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
