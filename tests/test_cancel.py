"""Cooperative cancellation (learner.cancel): the token, and a running task stopped on the
cpu, cpu-fast and (eager, on the CPU) cuda backends. No timing is asserted: a run is
cancelled once its progress counter shows it under way, and must report a stop before
its last minibatch."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from learner.backends import cpu_fast
from learner.backends.cpu import CpuBackend
from learner.backends.cuda import GraphBackend
from learner.cancel import CancelToken
from learner.config import Config
from learner.errors import TaskCancelled, TaskError
from learner.result import run_task
from learner.train import prepare

from .helpers import small_task

SAFETY_S = 600  # only so that a broken cancel fails instead of hanging; never a speed assertion


def backends():
    out = [("cpu", CpuBackend), ("cuda-eager", lambda: GraphBackend("cpu"))]
    if cpu_fast.kernel_available():
        out += [("cpu-fast", lambda: cpu_fast.CpuFastBackend(threads=1)),
                ("cpu-fast-2-threads", lambda: cpu_fast.CpuFastBackend(threads=2))]
    return out


BACKENDS = dict(backends())


# ---------------------------------------------------------------------------- the token


def test_token_cancels_once_and_keeps_the_first_reason():
    token = CancelToken()
    assert not token.cancelled and token.reason is None
    assert token.flag.dtype == np.int32 and token.flag.shape == (1,) and token.flag[0] == 0
    token.check(0, 0)  # not cancelled: nothing happens
    assert token.cancel("timed out") is True
    assert token.cancel("shutting down") is False
    assert token.cancelled and token.reason == "timed out" and token.flag[0] == 1
    with pytest.raises(TaskCancelled) as err:
        token.check(3, 7)
    exc = err.value
    assert (exc.reason, exc.epoch, exc.step) == ("timed out", 3, 7)
    assert str(exc) == "task cancelled (timed out): stopped before minibatch 7 of epoch 3 (both counted from 0)"
    assert not isinstance(exc, TaskError)


def test_token_is_thread_safe():
    token, start = CancelToken(), threading.Barrier(8)
    wins = []

    def racer(i):
        start.wait()
        wins.append((token.cancel(f"thread {i}"), i))

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for won, i in wins if won]
    assert len(winners) == 1 and token.reason == f"thread {winners[0]}"


def test_messages_say_where():
    assert str(TaskCancelled("x", 0, 0)) == "task cancelled (x): stopped before the first minibatch"
    assert str(TaskCancelled("x", 2, 0, epochs=2)) == "task cancelled (x): stopped after all 2 epochs, before its result"


# ---------------------------------------------------------------------------- before the run


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_cancelled_before_the_run_stops_at_the_first_check(name):
    task = small_task(64, 9, seed=1)
    prepared = prepare(task, Config(batch_size=16))
    prepared.cancel = CancelToken()
    prepared.cancel.cancel("not wanted")
    with pytest.raises(TaskCancelled) as err:
        BACKENDS[name]().run(task, prepared)
    assert (err.value.epoch, err.value.step, err.value.reason) == (0, 0, "not wanted")
    assert prepared.cancel.progress[0] == 0  # no minibatch ran


def test_run_task_with_a_cancelled_token_never_trains():
    token = CancelToken()
    token.cancel("gone")
    with pytest.raises(TaskCancelled, match="before the first minibatch"):
        run_task(small_task(), Config(batch_size=8), "cpu", cancel=token)


def test_a_token_that_is_never_cancelled_changes_nothing():
    task, config = small_task(60, 9, seed=2), Config(batch_size=16)
    for name in ("cpu", "cpu-fast") if cpu_fast.kernel_available() else ("cpu",):
        token = CancelToken()
        with_token = run_task(task, config, name, cancel=token).metadata
        without = run_task(task, config, name).metadata
        for key in ("final_parameter_sha256", "final_velocity_sha256", "scores_sha256", "predictions_sha256"):
            assert with_token[key] == without[key], (name, key)
        assert token.progress[0] == 2 * 4  # every minibatch was counted


# ---------------------------------------------------------------------------- while it runs


def run_and_cancel(engine, task, config, after_steps=3):
    """Start the run in a thread, cancel once `after_steps` minibatches are done, and return
    (the exception it raised, its progress when cancelled)."""
    prepared = prepare(task, config)
    token = prepared.cancel = CancelToken()
    outcome = {}

    def target():
        try:
            outcome["result"] = engine.run(task, prepared)
        except BaseException as exc:  # noqa: BLE001 - examined below
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    deadline = time.monotonic() + SAFETY_S
    while token.progress[0] < after_steps and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.001)
    seen = int(token.progress[0])
    assert token.cancel("test") is True
    thread.join(SAFETY_S)
    assert not thread.is_alive(), "the run did not stop after cancel()"
    return outcome.get("error"), seen


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_a_running_task_stops_after_cancel(name):
    # 2000 rows in minibatches of 8: 250 steps per epoch, 250,000 in all: a run that ignored
    # the token would take minutes on any backend here, and is bound to be under way when
    # the progress counter moves
    task = small_task(2000, 50, seed=4)
    config = Config(epochs=1000, batch_size=8, learning_rate=0.01)
    steps_per_epoch, total = 250, 250 * 1000
    error, seen = run_and_cancel(BACKENDS[name](), task, config)
    assert isinstance(error, TaskCancelled), error
    stopped_at = error.epoch * steps_per_epoch + error.step
    assert seen <= stopped_at < total
    if name.startswith("cuda"):
        assert error.step == 0  # it checks between epochs
    assert error.reason == "test"


@pytest.mark.skipif(not cpu_fast.kernel_available(), reason="cpu-fast kernel not built")
def test_cpu_fast_threads_stop_together_and_the_backend_stays_usable():
    """Two kernel threads must agree on where to stop (else one would wait forever at the
    next barrier); afterwards the same backend object runs a task normally."""
    engine = cpu_fast.CpuFastBackend(threads=2)
    task = small_task(2000, 50, seed=5)
    for _ in range(3):
        error, _ = run_and_cancel(engine, task, Config(epochs=1000, batch_size=8, learning_rate=0.01))
        assert isinstance(error, TaskCancelled)
    small = small_task(64, 9, seed=1)
    prepared = prepare(small, Config(batch_size=16))
    ref = cpu_fast.CpuFastBackend(threads=1).run(small, prepared)
    assert engine.run(small, prepared).scores.tobytes() == ref.scores.tobytes()


# ---------------------------------------------------------------------------- fused (interpreter)

FUSED_CHILD = """
import json
from learner.backends.fused import FusedBackend
from learner.cancel import CancelToken
from learner.config import Config
from learner.errors import TaskCancelled
from learner.result import finish_task
from learner.train import prepare
from tests.conftest import small_task

engine, task, config = FusedBackend("cpu"), small_task(16, 4, seed=1), Config(depth=1, batch_size=16, epochs=1)
out = {}
cancelled = prepare(task, config, CancelToken())
cancelled.cancel.cancel("early")
launches = engine.launches
try:
    engine.run(task, cancelled)
except TaskCancelled as exc:
    out["before"] = [exc.epoch, exc.step, engine.launches - launches]

during = prepare(task, config, CancelToken())
launch = engine.kernel.launch
def cancel_then_launch(*args, **kwargs):  # the token is cancelled while the launch runs
    during.cancel.cancel("late")
    return launch(*args, **kwargs)
engine.kernel.launch = cancel_then_launch
try:
    engine.run(task, during)
except TaskCancelled as exc:
    out["during"] = [exc.epoch, exc.step, exc.reason]
engine.kernel.launch = launch

live = prepare(task, config, CancelToken())
mixed = engine.run_many([task, task], [cancelled, live])  # one task still wanted: launched
try:
    finish_task(task, config, engine, cancelled, mixed[0], 0.0)
except TaskCancelled as exc:
    out["dropped"] = [exc.epoch, exc.step]
out["kept"] = finish_task(task, config, engine, live, mixed[1], 0.0).predictions.tolist()
print(json.dumps(out))
"""


def test_fused_drops_tasks_cancelled_before_or_during_a_launch():
    pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", FUSED_CHILD], capture_output=True, text=True, env=env,
                         cwd=Path(__file__).resolve().parents[1], timeout=SAFETY_S)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["before"] == [0, 0, 0]  # refused before launching anything
    assert result["during"] == [1, 0, "late"]  # the launch ran; its result was discarded
    assert result["dropped"] == [1, 0] and len(result["kept"]) == 4
