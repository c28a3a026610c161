"""The cpu-fast backend: the cpu backend's math in one compiled call per task.

``learner/backends/cpu_fast_train.h`` (with its glue ``cpu_fast_kernel.c``, built into
``learner.backends._cpu_fast`` by the package's own install) trains one task end to end: the same lift, initialization (from the
``Prepared`` object), minibatch order, mean cross-entropy, SGD-momentum update and reversible
backward (earlier states rebuilt from the core's endpoint by subtraction) as
``learner/train.py`` + ``learner/model.py``, written out by hand on buffers allocated once per
task. No autograd, no BLAS, no per-step allocation, no Python per step.

Why a C extension: the same algorithm in plain autograd, in NumPy with ``out=`` buffers and in
numba was measured an order of magnitude slower (overhead of many small calls per minibatch;
numba's loops not vectorized); the figures are in docs/performance.md and bench/bench_cpu.py.

The kernel is compiled twice, a generic variant and (GCC on x86-64) an AVX2 + FMA one; the
CPU at hand picks (``isa="auto"``), or the constructor names one (the tests run both).
It needs no dependency beyond a C compiler at install time (pyproject.toml builds it
as an optional extension; without one, cpu-fast reports itself unavailable and ``auto``
falls back to the cpu backend).

Results equal the cpu backend's to float32 rounding (summation order differs from MKL's);
the tests bound the difference on parameters and velocity and require identical draw-0
predictions. Repeat runs are byte-identical, and so are runs on different thread counts.

Stopping early: the kernel reads the task's cancel flag (``Prepared.cancel.flag``) once per
minibatch with the GIL released and, when it is set, stops before the next minibatch (or
before scoring): ``run`` raises TaskCancelled with that epoch and step. After each
minibatch's update it checks the ten head-bias values: a non-finite score anywhere in the
minibatch makes them non-finite, and ``run`` raises TrainingDivergedError with the epoch and
step (anything that check misses is caught by ``learner.result.check_finite`` afterwards).

Threads: the kernel runs on ``threads`` threads (rows of a minibatch and the update's weight
columns split across them, meeting at a barrier twice per minibatch); nothing else runs
in the hot path, so there is no BLAS or OpenMP pool to oversubscribe. The count comes from
the constructor, else REV88_THREADS, else 1: on a machine whose cores are shared, one thread
is the reliable choice (a second one waits at every barrier for a busy core).
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import torch

from ..errors import TaskCancelled, TrainingDivergedError
from ..model import CLASSES
from ..taskio import TaskArrays
from ..train import parameter_count
from .base import Prepared, RunOutput

try:
    from . import _cpu_fast as _kernel

    KERNEL_ERROR: str | None = None
except ImportError as exc:  # not built: the install had no C compiler, or it failed
    _kernel = None
    KERNEL_ERROR = (
        f"the compiled kernel learner.backends._cpu_fast is not built ({exc}); "
        "reinstall the package (pip install -e .) on a machine with a C compiler"
    )

THREADS_ENV = "REV88_THREADS"


def kernel_available() -> bool:
    return _kernel is not None


def configured_threads(threads: int | None = None) -> int:
    """The kernel's thread count: the argument, else REV88_THREADS, else 1."""
    if threads is None:
        text = os.environ.get(THREADS_ENV, "").strip()
        if not text:
            return 1
        try:
            threads = int(text)
        except ValueError:
            raise ValueError(f"{THREADS_ENV} must be a positive integer, got {text!r}") from None
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"cpu-fast threads must be a positive integer, got {threads!r}")
    return min(threads, 64)


class CpuFastBackend:
    name = "cpu-fast"
    device = "cpu"

    def __init__(self, threads: int | None = None, isa: str = "auto") -> None:
        if _kernel is None:
            raise RuntimeError(KERNEL_ERROR)
        self.threads = configured_threads(threads)
        if isa != "auto" and isa not in _kernel.variants():
            raise ValueError(f"cpu-fast isa must be 'auto' or one of {_kernel.variants()}, got {isa!r}")
        self.isa = _kernel.isa() if isa == "auto" else isa
        # No lock: the kernel keeps no state between calls (every buffer is the call's own), so
        # the service's CPU workers run it on their tasks at the same time.

    def describe(self) -> dict:
        return {
            "backend": self.name,
            "device": self.device,
            "threads": self.threads,
            "kernel": "learner.backends._cpu_fast (C)",
            "isa": self.isa,
        }

    def run(self, task: TaskArrays, prepared: Prepared) -> RunOutput:
        config = prepared.config
        t0 = time.perf_counter()
        n, m = task.train_count, task.test_count
        train_x = np.ascontiguousarray(task.train_images, dtype=np.float32).reshape(n, 81)
        test_x = np.ascontiguousarray(task.test_images, dtype=np.float32).reshape(m, 81)
        labels = np.ascontiguousarray(task.train_labels, dtype=np.int64)
        if len(prepared.permutations) != config.epochs:
            raise ValueError(
                f"prepared has {len(prepared.permutations)} permutations for {config.epochs} epochs"
            )
        perms = np.ascontiguousarray(np.stack(prepared.permutations), dtype=np.int64)
        shapes = [p.shape for p in prepared.initial]
        params = np.concatenate([np.asarray(p, dtype=np.float32).ravel() for p in prepared.initial])
        if params.size != parameter_count(config.depth):
            raise ValueError(
                f"prepared holds {params.size} initial parameters; depth {config.depth} needs "
                f"{parameter_count(config.depth)}"
            )
        velocity = np.empty_like(params)
        scores = np.empty((m, CLASSES), dtype=np.float32)
        prepared_at = time.perf_counter()
        cancel = prepared.cancel
        t1 = time.perf_counter()
        ran, outcome, epoch, step = _kernel.train_predict(
            train_x, labels, perms, test_x, params, velocity, scores,
            n, m, config.epochs, config.batch_size, config.depth,
            config.alpha, config.learning_rate, config.momentum, config.weight_decay,
            self.threads, self.isa,
            None if cancel is None else cancel.flag, None if cancel is None else cancel.progress,
        )
        t2 = time.perf_counter()
        if outcome == "cancelled":
            raise TaskCancelled(cancel.reason or "cancelled", epoch, step, config.epochs)
        if outcome == "diverged":
            raise TrainingDivergedError(
                f"training diverged at epoch {epoch}, step {step}: the minibatch left the head bias "
                "non-finite (a non-finite score or update); try a smaller learning_rate",
                non_finite=["head.bias"], epoch=epoch, step=step,
            )
        return RunOutput(
            final_parameters=_split(params, shapes),
            final_velocity=_split(velocity, shapes),
            scores=scores,
            training_prediction_seconds=t2 - t1,
            preparation_seconds=prepared_at - t0,
            extra={"threads": self.threads, "isa": ran},
        )


def _split(flat: np.ndarray, shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    out, offset = [], 0
    for shape in shapes:
        size = int(np.prod(shape))
        out.append(flat[offset : offset + size].reshape(shape).copy())
        offset += size
    return out


# ----------------------------------------------------------------------------- self-check

SELF_CHECK_TOLERANCE = {"atol": 2e-5, "rtol": 3e-3}
_check_lock = threading.Lock()
_check_result: tuple[bool, str] | None = None


def self_check_task() -> tuple[TaskArrays, object]:
    """A tiny synthetic task and config touching every path: two blocks, a short last batch,
    weight decay, two epochs."""
    from ..config import Config
    from ..taskio import validate_task

    rng = np.random.default_rng(20260914)
    task = validate_task(
        rng.random((200, 1, 9, 9), dtype=np.float32),
        rng.integers(0, 10, 200).astype(np.int64),
        rng.random((37, 1, 9, 9), dtype=np.float32),
    )
    return task, Config(depth=2, batch_size=48, epochs=2, weight_decay=1e-4)


def compare_outputs(fast: RunOutput, ref: RunOutput, tolerance: dict | None = None) -> list[str]:
    """Where ``fast`` leaves the tolerance around ``ref`` (empty when it agrees)."""
    tol = tolerance or SELF_CHECK_TOLERANCE
    problems = []
    for what, a, b in (
        ("parameters", fast.final_parameters, ref.final_parameters),
        ("velocity", fast.final_velocity, ref.final_velocity),
    ):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if x.shape != y.shape or not np.allclose(x, y, **tol):
                worst = float(np.max(np.abs(x - y))) if x.shape == y.shape else float("nan")
                problems.append(f"{what}[{i}] differs (max abs diff {worst:.3g})")
    if fast.scores.shape != ref.scores.shape or not np.allclose(fast.scores, ref.scores, atol=1e-4, rtol=3e-3):
        problems.append("scores differ")
    return problems


def cpu_fast_ready() -> tuple[bool, str]:
    """Once per process: is the kernel built, and does it agree with the cpu backend on a
    tiny synthetic task? Returns (ok, reason); the reason says what failed."""
    global _check_result
    with _check_lock:
        if _check_result is None:
            _check_result = _run_self_check()
        return _check_result


def _run_self_check() -> tuple[bool, str]:
    if _kernel is None:
        return False, KERNEL_ERROR or "kernel not built"
    from ..train import prepare
    from .cpu import CpuBackend

    try:
        task, config = self_check_task()
        prepared = prepare(task, config)
        fast = CpuFastBackend(threads=1).run(task, prepared)
        # The reference on one torch thread: a task this small gains nothing from threads, and
        # on a busy machine torch's pool made it take seconds instead of milliseconds (measured).
        previous = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            ref = CpuBackend().run(task, prepared)
        finally:
            torch.set_num_threads(previous)
    except Exception as exc:  # a broken kernel must not take the service down: fall back
        return False, f"cpu-fast self-check raised {type(exc).__name__}: {exc}"
    problems = compare_outputs(fast, ref)
    if problems:
        return False, "cpu-fast self-check disagrees with the cpu backend: " + "; ".join(problems)
    return True, "cpu-fast self-check passed (agrees with the cpu backend on a synthetic task)"
