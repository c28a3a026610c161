"""Dynamic batching in the device executor: queued tasks of one launch key (backend, shape,
config but the seed) are gathered into one ``run_many`` launch of at most REV88_BATCH_MAX
tasks, and each is answered with its own result and hashes.

There is no GPU here, so the fused backend's launch on a GPU is not exercised here
(scripts/gpu_check*.py do that); one test runs the real fused ``run_many`` through the service's
batch path under triton's interpreter, in a child process. The other tests use
``LaunchRecorder``: a test double around the real cpu backend whose ``run_many`` is a plain loop
over ``CpuBackend.run`` -- real results, computed one by one -- that records the launches it was
given, so the gathering can be observed. Its name and device are the cpu backend's, so its
results must equal ``run_task(task, config, "cpu")`` byte for byte.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import numpy as np
import pytest

from app.errors import TaskTimeout, Unavailable
from app.main import create_app
from app.runtime.executor import Batch, DeviceExecutor
from app.service import Service
from app.settings import Settings, SettingsError
from app.tasks.device import BATCH_METHOD, launch_key, share_energy
from learner.backends import get_backend
from learner.backends.cpu import CpuBackend
from learner.config import FIELDS, make_config
from learner.energy import IdleBaseline, SimulatedMeter, request_energy
from learner.errors import TrainingDivergedError
from learner.result import run_task
from learner.taskio import task_to_npz_bytes

from .helpers import small_task
from .server import inprocess_server, post_task, wait_for

CONFIG = make_config({"batch_size": 16, "epochs": 2})
HASHES = ("predictions_sha256", "scores_sha256", "final_parameter_sha256", "final_velocity_sha256",
          "initial_parameter_sha256", "epoch_permutation_sha256", "input_hashes", "config")


class LaunchRecorder:
    """Test double: the real cpu backend plus a ``run_many`` that loops over its ``run``.
    Records every launch as (kind, [train_count of each task], [seed of each task]); ``hold``
    (when set) keeps the device busy inside the next launch until it is released."""

    name = "cpu"
    device = "cpu"

    def __init__(self) -> None:
        self.inner = CpuBackend()
        self.launches: list[tuple[str, list[int], list[int]]] = []
        self.hold: threading.Event | None = None
        self.holding = threading.Event()
        self._lock = threading.Lock()

    def describe(self) -> dict:
        return {**self.inner.describe(), "test_double": "LaunchRecorder"}

    def _record(self, kind, tasks, prepareds) -> None:
        with self._lock:
            self.launches.append((kind, [t.train_count for t in tasks], [p.config.seed for p in prepareds]))
        hold, self.hold = self.hold, None
        if hold is not None:
            self.holding.set()
            hold.wait(120)

    def run(self, task, prepared):
        self._record("run", [task], [prepared])
        return self.inner.run(task, prepared)

    def run_many(self, tasks, prepareds):
        self._record("run_many", tasks, prepareds)
        return [self.inner.run(t, p) for t, p in zip(tasks, prepareds)]

    def sizes(self) -> list[int]:
        return [len(counts) for _, counts, _ in self.launches]


def assert_same_result(result, task, config):
    """A batched answer equals the single run of its task on the cpu backend."""
    expected = run_task(task, config, "cpu")
    assert np.array_equal(result.predictions, expected.predictions)
    assert result.scores.tobytes() == expected.scores.tobytes()
    for key in HASHES:
        assert result.metadata[key] == expected.metadata[key], key
    assert set(expected.metadata) <= set(result.metadata)


@pytest.fixture
def recorder():
    return LaunchRecorder()


def make_service(recorder, **settings) -> Service:
    """A Service (not started: no warm-up, no signals) whose executor thread runs; its engines
    are the recorder for 'cpu'. One worker unless the test asks for more: the gathering is per worker."""
    settings.setdefault("workers", 1)
    service = Service(Settings(backend="cpu", **settings), engines=lambda name, device=None: recorder if name == "cpu" else get_backend(name, device))
    service.executor.start()
    return service


def submit_task(service: Service, task, config=CONFIG, label=""):
    """What the task runner (app/tasks/runner.py) does for a task job: a launch of one (run alone,
    or gathered with queued tasks of its key), finished by the finisher (``resolved``). A plain
    synchronous task: its record is written once it has finished."""
    from app.tasks.runner import new_task_id
    from app.tasks.work import Work

    work = Work(task_id=label or new_task_id(), task=task, config=config, backend="cpu", deferred=True)
    work.queue()
    return service.executor.submit(
        lambda: service.runner.launches.run_alone(work), kind="task", label=label,
        batch=service.runner.task_batch(work), on_start=lambda job: work.start())


class Failed(Exception):
    """A task's job answered with an error by the finisher: ``settled`` is that answer."""

    def __init__(self, settled) -> None:
        super().__init__(f"{settled.status}: {settled.body}")
        self.settled = settled


def resolved(job, timeout: float):
    """A job's outcome: a task's place in its launch's finishing (app/tasks/launches.py, the
    finisher), resolved here: its device outcome, or ``Failed`` with the error it was answered
    with; a plain executor job's value as it is."""
    from app.tasks.launches import Finishing

    value = job.future.result(timeout)
    if not isinstance(value, Finishing):
        return value
    ended = value.outcome(value.future.result(timeout))
    if ended.settled.outcome is None:
        raise Failed(ended.settled)
    return ended.settled.outcome


def block_device(service: Service, recorder: LaunchRecorder) -> threading.Event:
    """Occupy the device with a real task held inside its launch; returns the release event."""
    release = threading.Event()
    recorder.hold = release
    submit_task(service, small_task(19, 7, seed=999), label="blocker")
    assert recorder.holding.wait(60)
    return release


def stop(service: Service) -> None:
    service.executor.abandon_all("test over")
    assert service.executor.stop(60)


# --------------------------------------------------------------------------- gathering


def test_queued_matching_tasks_share_launches_of_at_most_batch_max(recorder):
    service = make_service(recorder, batch_max=4, batch_wait_ms=50, queue_size=16)
    try:
        release = block_device(service, recorder)
        # one shape and config, each its own data and seed
        tasks = [small_task(40, 9, seed=i) for i in range(10)]
        configs = [CONFIG.replace(seed=100 + i) for i in range(10)]
        jobs = [submit_task(service, t, c, label=str(i)) for i, (t, c) in enumerate(zip(tasks, configs))]
        assert service.executor.depth == 10
        release.set()
        outcomes = [resolved(j, 120) for j in jobs]
        assert recorder.sizes() == [1, 4, 4, 2]  # the blocker, then launches of <= batch_max in queue order
        assert [kind for kind, _, _ in recorder.launches[1:]] == ["run_many"] * 3
        assert [s for _, _, seeds in recorder.launches[1:] for s in seeds] == [c.seed for c in configs]
        for i, (outcome, task, config, job) in enumerate(zip(outcomes, tasks, configs, jobs)):
            assert_same_result(outcome.result, task, config)
            size = 4 if i < 8 else 2
            assert outcome.result.metadata["tasks_in_launch"] == size == job.launch_size
            assert outcome.energy is None and "runs on the CPU" in outcome.energy_reason
        s = service.executor.stats
        assert (s.launches, s.batched, s.largest_launch, s.completed) == (4, 10, 4, 11)
        assert service.executor.depth == 0 and service.executor.in_flight() == 0
    finally:
        stop(service)


def test_different_keys_never_share_a_launch_and_stay_fifo(recorder):
    service = make_service(recorder, batch_max=8, batch_wait_ms=0, queue_size=16)
    try:
        release = block_device(service, recorder)
        a = [small_task(30, 5, seed=i) for i in range(3)]  # shape (30, 5)
        b = [small_task(25, 5, seed=10 + i) for i in range(2)]  # another shape
        c_config = CONFIG.replace(epochs=3)  # shape of a, another config
        order = [("a", a[0], CONFIG), ("b", b[0], CONFIG), ("c", a[1], c_config), ("a", a[1], CONFIG.replace(seed=5)),
                 ("b", b[1], CONFIG), ("a", a[2], CONFIG)]
        jobs = [submit_task(service, t, cfg, label=name) for name, t, cfg in order]
        release.set()
        for job, (_, task, config) in zip(jobs, order):
            assert_same_result(resolved(job, 120).result, task, config)
        # heads in arrival order: a (gathers every a, whatever its seed), then b, then c (alone: a
        # launch of one, on a backend that batches)
        launched = [(kind, counts) for kind, counts, _ in recorder.launches[1:]]
        assert launched == [("run_many", [30, 30, 30]), ("run_many", [25, 25]), ("run_many", [30])]
        assert [j.launch_size for j in jobs] == [3, 2, 1, 3, 2, 3]
        assert launch_key(a[0], CONFIG, "cpu") == launch_key(a[1], CONFIG.replace(seed=5), "cpu")
        assert launch_key(a[0], CONFIG, "cpu") != launch_key(a[0], c_config, "cpu")
        assert launch_key(a[0], CONFIG, "cpu") != launch_key(a[0], CONFIG, "cpu-fast")
    finally:
        stop(service)


@pytest.mark.parametrize("field", [f for f in FIELDS if f != "seed"])
def test_every_config_field_but_the_seed_keeps_tasks_in_launches_of_their_own(field):
    """A launch trains every task with one set of hyperparameters (the fused backend passes one
    learning rate, one momentum, ... to its kernels): tasks that differ in any config field but the
    seed never share a launch key, or a sweep's learning rates would run at its first cell's."""
    task = small_task(30, 5, seed=1)
    value = CONFIG.as_dict()[field]
    other = value + 1 if isinstance(value, int) else (value / 2 if value else 0.25)
    changed = CONFIG.replace(**{field: other})
    assert changed.as_dict()[field] != value
    assert launch_key(task, CONFIG, "fused") != launch_key(task, changed, "fused")
    assert launch_key(task, CONFIG, "fused") == launch_key(task, CONFIG.replace(seed=CONFIG.seed + 1), "fused")


def test_batch_max_1_turns_batching_off(recorder):
    service = make_service(recorder, batch_max=1, batch_wait_ms=50, queue_size=16)
    try:
        release = block_device(service, recorder)
        tasks = [small_task(40, 9, seed=i) for i in range(4)]
        jobs = [submit_task(service, t) for t in tasks]
        assert all(j.batch is None for j in jobs)
        release.set()
        for job, task in zip(jobs, tasks):
            result = resolved(job, 120).result
            assert_same_result(result, task, CONFIG)
            assert "tasks_in_launch" not in result.metadata
        assert [kind for kind, _, _ in recorder.launches] == ["run"] * 5
        assert service.executor.stats.batched == 0
    finally:
        stop(service)


def test_a_backend_without_run_many_runs_tasks_one_by_one():
    service = Service(Settings(backend="cpu", batch_max=8, queue_size=16, workers=1), engines=lambda name, device=None: CpuBackend())
    service.executor.start()
    try:
        gate = threading.Event()
        service.executor.submit(gate.wait)
        wait_for(lambda: service.executor.busy, 10, what="gate running")
        tasks = [small_task(30, 5, seed=i) for i in range(3)]
        jobs = [submit_task(service, t) for t in tasks]
        gate.set()
        for job, task in zip(jobs, tasks):
            assert_same_result(resolved(job, 120).result, task, CONFIG)
            assert job.launch_size == 1
        assert service.executor.stats.batched == 0
    finally:
        stop(service)


def test_the_gathering_waits_for_a_late_match_within_batch_wait(recorder):
    service = make_service(recorder, batch_max=2, batch_wait_ms=1000, queue_size=16)
    try:
        first, late = small_task(30, 5, seed=1), small_task(30, 5, seed=2)
        j1 = submit_task(service, first)
        time.sleep(0.05)  # the device thread is idle: it took the first and waits for company
        j2 = submit_task(service, late)
        assert_same_result(resolved(j1, 120).result, first, CONFIG)
        assert_same_result(resolved(j2, 120).result, late, CONFIG)
        assert recorder.sizes() == [2]  # batch full: launched without waiting out the 1 s
    finally:
        stop(service)


# --------------------------------------------------------------------------- exactly once


def test_an_expired_queued_task_is_not_in_the_launch(recorder):
    service = make_service(recorder, batch_max=8, batch_wait_ms=0, queue_size=16)
    try:
        release = block_device(service, recorder)
        same_shape = [small_task(30, 5, seed=i) for i in range(3)]
        jobs = [submit_task(service, t) for t in same_shape]
        with pytest.raises(TaskTimeout):
            asyncio.run(service.executor.wait(jobs[1], 0.01))
        assert service.executor.depth == 2
        release.set()
        for i in (0, 2):
            assert_same_result(resolved(jobs[i], 120).result, same_shape[i], CONFIG)
        assert recorder.launches[1][0] == "run_many" and recorder.launches[1][2] == [CONFIG.seed] * 2
        assert recorder.sizes() == [1, 2]
        assert isinstance(jobs[1].future.exception(), TaskTimeout) and jobs[1].started is None
        s = service.executor.stats
        assert (s.expired, s.completed, s.batched) == (1, 3, 2)
        assert s.answered() == s.accepted
    finally:
        stop(service)


def test_a_head_that_expires_while_gathering_never_runs():
    seen = threading.Event()
    ran: list[str] = []

    def ready():
        seen.set()
        return True

    ex = DeviceExecutor(capacity=4, batch_max=4, batch_wait_s=5.0)
    ex.start()
    try:
        head = ex.submit(lambda: ran.append("fn"), batch=Batch("k", "head", lambda items: ran.extend(items) or items, ready))
        assert seen.wait(10)
        time.sleep(0.05)  # now waiting for company
        ex.expire(head, 0.0)
        assert isinstance(head.future.exception(5), TaskTimeout)
        follow = ex.submit(lambda: "alone")
        assert resolved(follow, 10) == "alone"  # the gathering ended as soon as its head left
        assert ran == [] and head.started is None
        assert (ex.stats.expired, ex.stats.launches) == (1, 1)
    finally:
        ex.stop(10)


def test_one_failing_task_of_a_launch_fails_alone(recorder):
    class PoisonSecond(LaunchRecorder):
        """Test double: the second task's real output gets a NaN score, as a diverged run has."""

        def run_many(self, tasks, prepareds):
            outs = super().run_many(tasks, prepareds)
            if len(outs) > 1:  # (the blocker before them is a launch of one)
                outs[1].scores[0, 0] = np.nan
            return outs

    poison = PoisonSecond()
    service = make_service(poison, batch_max=4, batch_wait_ms=0, queue_size=16)
    try:
        release = block_device(service, poison)
        tasks = [small_task(30, 5, seed=i) for i in range(3)]
        jobs = [submit_task(service, t) for t in tasks]
        release.set()
        assert_same_result(resolved(jobs[0], 120).result, tasks[0], CONFIG)
        with pytest.raises(Failed) as failed:  # found as its result is finished, off the device
            resolved(jobs[1], 120)
        assert failed.value.settled.status == 422
        assert failed.value.settled.body["type"] == TrainingDivergedError.__name__
        assert_same_result(resolved(jobs[2], 120).result, tasks[2], CONFIG)
        # the device ran the launch to its end: the divergence is the task's own outcome
        assert (service.executor.stats.completed, service.executor.stats.failed) == (4, 0)
    finally:
        stop(service)


def test_a_failed_launch_answers_each_of_its_jobs_once():
    ex = DeviceExecutor(capacity=8, batch_max=8, batch_wait_s=0.0)
    ex.start()
    try:
        gate = threading.Event()
        ex.submit(gate.wait)
        wait_for(lambda: ex.busy, 10, what="gate running")

        def boom(items):
            raise RuntimeError("launch failed")

        jobs = [ex.submit(lambda: "alone", batch=Batch("k", i, boom)) for i in range(3)]
        gate.set()
        for job in jobs:
            with pytest.raises(RuntimeError, match="launch failed"):
                resolved(job, 10)
        s = ex.stats
        assert (s.failed, s.completed, s.launches, s.batched) == (3, 1, 2, 3)
        assert s.answered() == s.accepted
    finally:
        ex.stop(10)


def test_drain_deadline_answers_a_running_launch_and_its_queue_once():
    ex = DeviceExecutor(capacity=8, batch_max=2, batch_wait_s=0.0)
    ex.start()
    first, gate = threading.Event(), threading.Event()
    entered = threading.Event()

    def held(items):
        entered.set()
        gate.wait(30)
        return [f"late {i}" for i in items]

    ex.submit(first.wait)
    wait_for(lambda: ex.busy, 10, what="first job running")
    jobs = [ex.submit(lambda: "alone", batch=Batch("k", i, held)) for i in range(3)]
    first.set()
    assert entered.wait(10)
    assert ex.snapshot()["running"]["jobs"] == 2 and ex.in_flight() == 3
    ex.close("draining")
    assert ex.abandon_all("shutting down") == 3
    wheres = [j.future.exception(1).details["where"] for j in jobs]
    assert all(isinstance(j.future.exception(), Unavailable) for j in jobs)
    assert wheres == ["running", "running", "queued"]
    gate.set()
    assert ex.stop(10)
    s = ex.stats
    assert (s.abandoned, s.abandoned_finished, s.cancelled, s.completed) == (2, 2, 1, 1)
    assert s.answered() == s.accepted and ex.in_flight() == 0


def test_tasks_prepared_in_several_threads_at_once_get_their_own_initial_parameters():
    """The device thread prepares tasks while other threads may do the same (a backend
    self-check, a test's reference run): seed-derived inputs must not share global RNG state."""
    from learner.config import Config
    from learner.train import initial_parameters

    def draw(seed):
        return b"".join(t.numpy().tobytes() for t in initial_parameters(Config(seed=seed)))

    serial = {seed: draw(seed) for seed in range(1, 41)}
    wrong: list[int] = []

    def work(seeds):
        for _ in range(5):
            wrong.extend(seed for seed in seeds if draw(seed) != serial[seed])

    threads = [threading.Thread(target=work, args=(range(1 + k, 41, 4),)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []
    assert len(set(serial.values())) == 40


FUSED_CHILD = """
import json, threading, time
from app.service import Service
from app.settings import Settings
from app.tasks.device import run_on_device
from learner.backends.fused import FusedBackend
from learner.config import make_config
from learner.result import run_task
from tests.conftest import small_task

fused = FusedBackend("cpu")  # triton's interpreter: TRITON_INTERPRET=1 in this process only
service = Service(Settings(backend="cpu", batch_max=4, batch_wait_ms=0, workers=1), engines=lambda name, device=None: fused)
ex = service.executor
ex.start()
gate = threading.Event()
ex.submit(gate.wait)
while not ex.busy:
    time.sleep(0.01)
config = make_config({"depth": 1, "batch_size": 16})
items = [(small_task(40, 8, seed=i), config.replace(seed=3 + i % 2)) for i in range(3)]
from app.tasks.work import Work
from tests.test_app_batching import resolved
jobs = [ex.submit(lambda t=t, c=c: run_on_device(t, c, "fused", service.energy, service.engines),
                  batch=service.runner.task_batch(Work(task_id=str(i), task=t, config=c, backend="fused")))
        for i, (t, c) in enumerate(items)]
gate.set()
keys = ("predictions_sha256", "scores_sha256", "final_parameter_sha256", "final_velocity_sha256")
out = []
for job, (task, cfg) in zip(jobs, items):
    batched = resolved(job, 600).result
    single = run_task(task, cfg, fused)
    out.append({"launch_size": job.launch_size, "tasks_in_launch": batched.metadata["tasks_in_launch"],
                "backend_tasks_in_launch": batched.metadata["backend_details"]["tasks_in_launch"],
                "same_as_single": all(batched.metadata[k] == single.metadata[k] for k in keys),
                "predictions_sha256": batched.predictions_sha256})
ex.stop(10)
print(json.dumps({"results": out, "launches": fused.launches}))
"""


def test_fused_run_many_through_the_service_equals_single_launches():
    """The real fused backend (under triton's interpreter, in a child process so that
    TRITON_INTERPRET=1 does not leak): three queued tasks (two seeds) share one run_many
    launch via the service's batch path, and each answer equals its task's single launch."""
    import json
    import os
    import subprocess
    import sys

    from .server import ROOT

    pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
    from .helpers import child_pythonpath

    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": child_pythonpath(ROOT)}
    proc = subprocess.run([sys.executable, "-c", FUSED_CHILD], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    results = doc["results"]
    assert [r["launch_size"] for r in results] == [3, 3, 3]
    assert all(r["tasks_in_launch"] == r["backend_tasks_in_launch"] == 3 for r in results)
    assert all(r["same_as_single"] for r in results)
    assert len({r["predictions_sha256"] for r in results}) == 3  # each its own task
    assert doc["launches"] == 1 + 3  # the batched launch, then the three single ones


# --------------------------------------------------------------------------- energy, settings


def test_a_launch_reading_is_divided_equally_by_task_count():
    meter, idle = SimulatedMeter(idle_w=60.0), IdleBaseline()
    idle.sample(meter)
    _, reading = request_energy(meter, lambda: meter.advance(0.5, power_w=260.0), idle)
    assert reading["gross_j"] == pytest.approx(130.0)
    share = share_energy(reading, 4)
    assert share["gross_j"] == pytest.approx(130.0 / 4) and share["launch_gross_j"] == reading["gross_j"]
    assert share["idle_adjusted_j"] == pytest.approx((130.0 - 30.0) / 4)
    assert share["launch_idle_adjusted_j"] == reading["idle_adjusted_j"]
    assert share["tasks_in_launch"] == 4 and share["duration_s"] == reading["duration_s"]
    assert BATCH_METHOD in share["method"] and share["note"].startswith(BATCH_METHOD)
    assert share_energy(reading, 1) is reading


def test_batch_settings_are_read_and_checked():
    assert (Settings().batch_max, Settings().batch_wait_ms) == (None, 5.0)  # None: derived (app/runtime/devices.py)
    s = Settings.from_env({"REV88_BATCH_MAX": "1", "REV88_BATCH_WAIT_MS": "0"})
    assert (s.batch_max, s.batch_wait_ms) == (1, 0.0)
    for env, words in (
        ({"REV88_BATCH_MAX": "0"}, "REV88_BATCH_MAX must be >= 1"),
        ({"REV88_BATCH_MAX": "many"}, "REV88_BATCH_MAX must be an integer"),
        ({"REV88_BATCH_WAIT_MS": "-1"}, "REV88_BATCH_WAIT_MS must be a number of milliseconds in"),
        ({"REV88_BATCH_WAIT_MS": "soon"}, "REV88_BATCH_WAIT_MS must be a number of milliseconds"),
        ({"REV88_BACKEND": "tpu"}, "auto, cpu, cuda, fused, cpu-fast"),
    ):
        with pytest.raises(SettingsError, match=words):
            Settings.from_env(env)
    for name in ("fused", "cpu-fast"):
        assert Settings.from_env({"REV88_BACKEND": name}).backend == name


def test_fused_without_a_gpu_stops_the_service_at_startup():
    import torch

    from learner.backends import BackendUnavailable

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(BackendUnavailable, match="backend 'fused' needs a CUDA GPU"):
        create_app(Settings(backend="fused"))


# --------------------------------------------------------------------------- a real server


def test_concurrent_requests_are_answered_from_shared_launches_over_http(recorder):
    settings = Settings(backend="cpu", batch_max=4, batch_wait_ms=50, queue_size=16, workers=1)
    app = create_app(settings, engines=lambda name, device=None: recorder if name == "cpu" else get_backend(name, device))
    n = 6
    tasks = [small_task(60, 11, seed=50 + i) for i in range(n)]
    bodies = [task_to_npz_bytes(t) for t in tasks]
    with inprocess_server(app) as srv, srv.client() as c:
        recorder.launches.clear()  # the warm-up ran through it
        release = threading.Event()
        recorder.hold = release
        blocked: list = []

        def send_blocker():
            with srv.client() as cb:
                blocked.append(post_task(cb, task_to_npz_bytes(small_task(19, 7, seed=3))))

        blocker = threading.Thread(target=send_blocker)
        blocker.start()
        assert recorder.holding.wait(60)

        def send(i):
            with srv.client() as ci:
                return post_task(ci, bodies[i], params={"batch_size": "16", "seed": str(7 + i)})

        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(send, i) for i in range(n)]
            wait_for(lambda: c.get("/health").json()["queue"]["depth"] == n, 60, what="all tasks queued")
            release.set()
            responses = [f.result(120) for f in futures]
        blocker.join(60)
        assert blocked[0].status_code == 200, blocked[0].text
        health = c.get("/health").json()["queue"]
        metrics = c.get("/metrics").text

    assert recorder.sizes() == [1, 4, 2]  # the blocker, then the six in launches of <= 4
    assert sorted(seed for _, _, seeds in recorder.launches[1:] for seed in seeds) == [7 + i for i in range(n)]
    sizes = []
    for i, r in enumerate(responses):
        assert r.status_code == 200, r.text
        answer = r.json()
        expected = run_task(tasks[i], make_config({"batch_size": 16, "seed": 7 + i}), "cpu")
        assert answer["predictions"] == expected.predictions.tolist()
        assert answer["predictions_sha256"] == expected.predictions_sha256
        assert answer["scores_sha256"] == expected.scores_sha256
        assert answer["metadata"]["final_parameter_sha256"] == expected.metadata["final_parameter_sha256"]
        assert answer["metadata"]["tasks_in_launch"] == answer["timing"]["tasks_in_launch"]
        sizes.append(answer["timing"]["tasks_in_launch"])
        assert answer["energy"] is None and "runs on the CPU" in answer["energy_reason"]
    assert sorted(sizes) == [2, 2, 4, 4, 4, 4]
    assert health["batch_max"] == 4 and health["batched"] == n and health["largest_launch"] == 4
    assert health["depth"] == 0 and health["in_flight"] == 0 and health["running"] is None
    assert health["accepted"] == health["completed"] == n + 2  # the warm-up, the blocker, the six
    assert "rev88_launch_tasks_count 4.0" in metrics  # warm-up, blocker, two batched launches
    assert "rev88_launch_tasks_sum 8.0" in metrics
