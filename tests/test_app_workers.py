"""Several device workers (issue #16): one thread per device over one bounded queue.

* N workers answer with the hashes one worker gives (real cpu / cpu-fast backends), and a
  real HTTP server runs K tasks at once on K distinct workers (held at a gate, seen in /health);
* a worker that fails loses none of the other workers' tasks, and every accepted job is
  answered exactly once;
* per-device dispatch with fake GPUs: there is one CPU-only machine here, so ``FakeGpus``
  stands in for the GPUs -- one backend object per ``cuda:i`` whose math is the real cpu
  backend's -- to show that each worker uses its own device's backend object, energy meter
  and idle baseline, that pinned jobs (the per-GPU warm-up) stay on their worker and that
  batches are gathered per worker;
* shutdown drains every worker; ``app.runtime.devices.plan`` and the cgroup CPU quota.

Nothing here assumes how fast the machine is: a task is "running" because a gate holds it,
and the tests wait for states (``wait_for``), never for durations.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import os
import threading

import numpy as np
import pytest

import app.runtime.devices as devices_mod
import app.service as service_mod
from app.errors import Unavailable
from app.main import create_app
from app.runtime.devices import PlanError, cgroup_cpu_limit, engine_device, plan, usable_cores
from app.runtime.energy import Energy
from app.runtime.executor import Batch, DeviceExecutor, current_worker
from app.service import Service, warmup_task
from app.settings import Settings, SettingsError
from app.tasks.device import run_on_device, worker_engine
from learner.backends import get_backend
from learner.backends.cpu import CpuBackend
from learner.cancel import CancelToken
from learner.config import Config, make_config
from learner.energy import IdleBaseline, SimulatedMeter, request_energy
from learner.result import run_task
from learner.taskio import task_to_npz_bytes

from .gates import Gate, gated_engines
from .helpers import small_task
from .server import inprocess_server, post_task, wait_for
from .test_app_batching import resolved

CONFIG = make_config({"batch_size": 16, "epochs": 2})
HASHES = ("predictions_sha256", "scores_sha256", "final_parameter_sha256", "final_velocity_sha256",
          "initial_parameter_sha256", "epoch_permutation_sha256", "state_vector_sha256", "input_hashes",
          "config")
GPUS = [132, 132, 108]  # SM counts of three fake GPUs


def tasks_and_configs(n: int, first_seed: int = 100):
    """n different tasks (two shapes), each with its own config seed."""
    return [(small_task(40 if i % 2 == 0 else 33, 9 if i % 2 == 0 else 5, seed=first_seed + i),
             CONFIG.replace(seed=first_seed + i)) for i in range(n)]


def assert_same_result(result, expected):
    assert np.array_equal(result.predictions, expected.predictions)
    assert result.scores.tobytes() == expected.scores.tobytes()
    for key in HASHES:
        assert result.metadata[key] == expected.metadata[key], key


def submit_task(service: Service, task, config, backend: str, pin: int | None = None, label: str = ""):
    """What the task runner (app/tasks/runner.py) does for a task job (optionally pinned to one worker)."""
    from app.tasks.runner import new_task_id
    from app.tasks.work import Work

    token = CancelToken()
    acc = Work(task_id=label or new_task_id(), task=task, config=config, backend=backend, cancel=token)
    return service.executor.submit(
        lambda: run_on_device(task, config, backend, service.energy, service.engines, cancel=token),
        kind="task", label=label, batch=service.runner.task_batch(acc), cancel=token, pin=pin,
    )


def count_answers(jobs) -> list[int]:
    """How many times each job's future is answered (a done callback runs once per answer)."""
    counts = [0] * len(jobs)
    lock = threading.Lock()

    def counter(i):
        def done(_future):
            with lock:
                counts[i] += 1
        return done

    for i, job in enumerate(jobs):
        job.future.add_done_callback(counter(i))
    return counts


def assert_stats_add_up(executor: DeviceExecutor) -> None:
    s = executor.stats
    assert s.accepted == s.completed + s.failed + s.expired + s.dropped + s.abandoned + s.cancelled, s
    assert executor.in_flight() == 0 and executor.depth == 0


def stop_service(service: Service) -> None:
    service.executor.abandon_all("test over")
    assert service.executor.stop(60)


def alive_workers(executor: DeviceExecutor) -> list[str]:
    return [w.device for w in executor.workers if w.thread.is_alive()]


# --------------------------------------------------------------------------- fake GPUs


@dataclasses.dataclass
class Call:
    kind: str  # "run" | "run_many"
    engine_device: str  # the device of the backend object that was called
    worker_device: str | None  # the device of the worker whose thread called it
    seeds: list[int]  # the config seed of each task in the call (each test task has its own)


class FakeGpus:
    """Test double for several GPUs: an ``engines`` hook that gives one backend object per
    device (name ``name``, device ``cuda:i``), made on first use. Each object delegates the
    math to its own real ``CpuBackend``, so its results are the cpu backend's byte for byte,
    and records every call as a ``Call``. Optional behaviour, all off by default:

    gate              a ``Gate``: while held, calls wait (a cancelled task stops waiting);
    fail_device       every ``run`` on this device raises (a lost device);
    fail_seed         the ``run`` of the task with this config seed raises (one bad task);
    fail_launch_device  every ``run_many`` on this device raises (a failed batched launch);
    meters, power_w   each call advances its own device's ``SimulatedMeter`` by 1 s at
                      ``power_w[device]`` watts (per task for ``run_many``)."""

    def __init__(self, name: str = "fused", gate: Gate | None = None, fail_device: str | None = None,
                 fail_seed: int | None = None, fail_launch_device: str | None = None,
                 meters: dict | None = None, power_w: dict | None = None) -> None:
        self.name, self.gate = name, gate
        self.fail_device, self.fail_seed, self.fail_launch_device = fail_device, fail_seed, fail_launch_device
        self.meters, self.power_w = meters or {}, power_w or {}
        self.objects: dict[str, FakeGpu] = {}
        self.calls: list[Call] = []
        self.waiting = 0  # calls now held at the gate
        self.lock = threading.Lock()

    def __call__(self, name: str, device: str | None = None):
        if name != self.name:
            return get_backend(name, device)
        with self.lock:
            if device not in self.objects:
                self.objects[device] = FakeGpu(self, device)
            return self.objects[device]

    def hold_here(self, cancels) -> None:
        with self.lock:
            self.waiting += 1
        try:
            while self.gate is not None and not self.gate.is_open():
                for token in cancels:
                    if token is not None:
                        token.check(epoch=0, step=0)
                threading.Event().wait(0.005)
        finally:
            with self.lock:
                self.waiting -= 1


class FakeGpu:
    def __init__(self, fleet: FakeGpus, device: str) -> None:
        self.fleet, self.name, self.device = fleet, fleet.name, device
        self.inner = CpuBackend()

    def describe(self) -> dict:
        return {"backend": self.name, "device": self.device, "test_double": "FakeGpu"}

    def _enter(self, kind: str, prepareds) -> None:
        fleet, worker = self.fleet, current_worker()
        with fleet.lock:
            fleet.calls.append(Call(kind, self.device, worker.device if worker else None,
                                    [p.config.seed for p in prepareds]))
        fleet.hold_here([p.cancel for p in prepareds])
        meter = fleet.meters.get(self.device)
        if meter is not None:
            meter.advance(1.0 * len(prepareds), power_w=fleet.power_w[self.device])

    def run(self, task, prepared):
        self._enter("run", [prepared])
        if self.device == self.fleet.fail_device:
            raise RuntimeError(f"{self.device}: device lost (test double)")
        if prepared.config.seed == self.fleet.fail_seed:
            raise RuntimeError(f"task with seed {prepared.config.seed} failed on {self.device} (test double)")
        return self.inner.run(task, prepared)

    def run_many(self, tasks, prepareds):
        self._enter("run_many", prepareds)
        if self.device == self.fleet.fail_launch_device:
            raise RuntimeError(f"{self.device}: launch failed (test double)")
        return [self.inner.run(t, p) for t, p in zip(tasks, prepareds)]


@pytest.fixture
def fake_gpus(monkeypatch):
    """This process sees three GPUs (SM counts GPUS) and the GPU backends pass their check:
    only the plan and the service's backend check are faked; the backends come from FakeGpus."""
    monkeypatch.setattr(devices_mod, "visible_gpus", lambda: list(GPUS))
    monkeypatch.setattr(service_mod, "check_backend", lambda name: name)


def gpu_service(fleet: FakeGpus, start: bool = True, **settings) -> Service:
    service = Service(Settings(backend="fused", **settings), engines=fleet)
    if start:
        service.executor.start()
    return service


def hold_workers(executor: DeviceExecutor) -> list[threading.Event]:
    """Occupy every worker with a pinned job that waits on its own event; returns the events."""
    events = [threading.Event() for _ in executor.workers]
    for i, event in enumerate(events):
        executor.submit(lambda e=event: e.wait(120), label=f"blocker {i}", pin=i)
    wait_for(lambda: executor.busy_workers() == len(events), 60, what="every worker held")
    return events


# --------------------------------------------------------------------------- N workers, same answers


@pytest.mark.parametrize("backend", ["cpu", "cpu-fast"])
def test_n_workers_answer_with_the_same_hashes_as_one_worker(backend):
    if backend == "cpu-fast":
        from learner.backends.cpu_fast import KERNEL_ERROR, kernel_available

        if not kernel_available():
            pytest.skip(f"cpu-fast kernel unavailable: {KERNEL_ERROR}")
    items = tasks_and_configs(6)

    def answers(workers: int):
        gate = Gate()
        engines = gated_engines(gate)
        service = Service(Settings(backend=backend, workers=workers, queue_size=16), engines=engines)
        service.executor.start()
        try:
            gate.hold()
            jobs = [submit_task(service, t, c, backend, label=str(i)) for i, (t, c) in enumerate(items)]
            counts = count_answers(jobs)
            # `workers` tasks are running at once, each held on its own worker; the rest wait
            wait_for(lambda: engines(backend).waiting == workers, 60, what=f"{workers} runs at the gate")
            ex = service.executor
            assert ex.busy_workers() == workers and ex.depth == len(items) - workers
            held = sorted(w.device for w in ex.workers if w.running)
            gate.release()
            results = [resolved(j, 120).result for j in jobs]
            assert counts == [1] * len(jobs)
            assert ex.stats.completed == len(items) and ex.stats.failed == 0
            assert_stats_add_up(ex)
            return results, held, {j.worker for j in jobs}
        finally:
            gate.release()
            stop_service(service)

    one, held1, ran1 = answers(1)
    three, held3, ran3 = answers(3)
    assert held1 == ["cpu:0"] and held3 == ["cpu:0", "cpu:1", "cpu:2"]
    assert ran1 == {"cpu:0"} and ran3 == {"cpu:0", "cpu:1", "cpu:2"}
    for (task, config), r1, r3 in zip(items, one, three):
        assert_same_result(r3, r1)
        assert_same_result(r1, run_task(task, config, backend))  # and both equal `rev88 run`'s path
        assert r1.metadata["backend"] == r3.metadata["backend"] == backend


def test_k_tasks_run_at_once_on_k_distinct_workers_over_http():
    k = 3
    gate = Gate()
    engines = gated_engines(gate)
    app = create_app(Settings(backend="cpu", workers=k), engines=engines)
    items = tasks_and_configs(k, first_seed=200)
    bodies = [task_to_npz_bytes(t) for t, _ in items]

    def send(i):
        with srv.client() as ci:
            return post_task(ci, bodies[i], params={"batch_size": "16", "epochs": "2", "seed": str(200 + i)})

    with inprocess_server(app) as srv, srv.client() as c:
        service = app.state.service
        before = c.get("/health").json()["queue"]
        assert [w["device"] for w in before["workers"]] == ["cpu:0", "cpu:1", "cpu:2"]
        gate.hold()
        try:
            with concurrent.futures.ThreadPoolExecutor(k) as pool:
                futures = [pool.submit(send, i) for i in range(k)]

                def all_busy():
                    queue = c.get("/health").json()["queue"]
                    return queue if sum(w["busy"] for w in queue["workers"]) == k else None

                queue = wait_for(all_busy, 60, what=f"{k} workers busy in /health")
                metrics = c.get("/metrics").text
                assert engines("cpu").waiting == k  # k runs held at the gate at the same time
                gate.release()
                responses = [f.result(120) for f in futures]
        finally:
            gate.release()
        after = c.get("/health").json()["queue"]

    running = {w["device"]: w["running"] for w in queue["workers"]}
    assert sorted(running) == ["cpu:0", "cpu:1", "cpu:2"]
    assert all(r["kind"] == "task" and r["jobs"] == 1 for r in running.values())
    ids = {r["id"] for r in running.values()}
    assert len(ids) == k  # k distinct tasks, one per worker
    assert queue["running_jobs"] == k and queue["depth"] == 0 and queue["in_flight"] == k
    for device in running:
        assert f'rev88_worker_busy{{device="{device}"}} 1.0' in metrics
    for i, r in enumerate(responses):
        assert r.status_code == 200, r.text
        answer = r.json()
        expected = run_task(*items[i], "cpu")
        assert answer["id"] in ids
        assert answer["predictions"] == expected.predictions.tolist()
        assert answer["predictions_sha256"] == expected.predictions_sha256
        assert answer["scores_sha256"] == expected.scores_sha256
        for key in HASHES:
            assert answer["metadata"][key] == expected.metadata[key], key
    # each worker ran exactly one of the k tasks (worker 0 also ran the warm-up)
    assert [w["tasks"] - b["tasks"] for w, b in zip(after["workers"], before["workers"])] == [1, 1, 1]
    assert not any(w["busy"] for w in after["workers"])
    assert after["accepted"] == after["completed"] == k + 1 and after["in_flight"] == 0
    assert service.executor.stats.failed == 0


# --------------------------------------------------------------------------- a worker that fails


def test_a_worker_whose_device_fails_loses_none_of_the_other_workers_tasks(fake_gpus):
    gate = Gate()
    fleet = FakeGpus(gate=gate, fail_device="cuda:1")
    service = gpu_service(fleet, batch_max=1, queue_size=16)
    ex = service.executor
    try:
        items = tasks_and_configs(9, first_seed=300)
        gate.hold()
        jobs = [submit_task(service, t, c, "fused", label=str(i)) for i, (t, c) in enumerate(items[:3])]
        wait_for(lambda: fleet.waiting == 3, 60, what="a task held on every worker")
        assert sorted(j.worker for j in jobs) == ["cuda:0", "cuda:1", "cuda:2"]
        jobs += [submit_task(service, t, c, "fused", label=str(i + 3)) for i, (t, c) in enumerate(items[3:])]
        counts = count_answers(jobs)
        gate.release()
        failed = ok = 0
        for job, (task, config) in zip(jobs, items):
            error = job.future.exception(120)
            if job.worker == "cuda:1":
                assert isinstance(error, RuntimeError) and "cuda:1: device lost" in str(error)
                failed += 1
            else:
                assert error is None, error
                result = resolved(job, 120).result
                assert result.metadata["device"] == job.worker  # run by that worker's backend object
                assert_same_result(result, run_task(task, config, "cpu"))
                ok += 1
        assert counts == [1] * len(jobs)
        assert failed >= 1 and ok >= 2 and failed + ok == len(items)
        s = ex.stats
        assert (s.accepted, s.completed, s.failed) == (len(items), ok, failed)
        assert_stats_add_up(ex)
        assert sum(w.tasks for w in ex.workers) == len(items)
        assert all(c.engine_device == c.worker_device for c in fleet.calls)
        # the failing worker is still there and takes work
        assert alive_workers(ex) == ["cuda:0", "cuda:1", "cuda:2"]
        assert ex.submit(lambda: current_worker().device, pin=1).future.result(60) == "cuda:1"
    finally:
        gate.release()
        stop_service(service)


def test_a_task_whose_run_raises_fails_alone_among_the_workers():
    gate = Gate()
    fleet = FakeGpus(name="cpu", gate=gate, fail_seed=402)  # the real CPU plan; cpu:i workers
    service = Service(Settings(backend="cpu", workers=3, queue_size=16), engines=fleet)
    ex = service.executor
    ex.start()
    try:
        items = tasks_and_configs(6, first_seed=400)
        gate.hold()
        jobs = [submit_task(service, t, c, "cpu", label=str(i)) for i, (t, c) in enumerate(items)]
        counts = count_answers(jobs)
        wait_for(lambda: fleet.waiting == 3, 60, what="three tasks held")
        gate.release()
        for job, (task, config) in zip(jobs, items):
            if config.seed == 402:
                with pytest.raises(RuntimeError, match="seed 402 failed"):
                    resolved(job, 120)
            else:
                assert_same_result(resolved(job, 120).result, run_task(task, config, "cpu"))
        assert counts == [1] * len(jobs)
        assert (ex.stats.completed, ex.stats.failed) == (5, 1)
        assert {j.worker for j in jobs} == {"cpu:0", "cpu:1", "cpu:2"}
        assert_stats_add_up(ex)
        assert len(alive_workers(ex)) == 3
    finally:
        gate.release()
        stop_service(service)


def test_a_batched_launch_that_raises_fails_only_its_own_workers_jobs(fake_gpus):
    fleet = FakeGpus(fail_launch_device="cuda:0")
    service = gpu_service(fleet, workers=2, batch_max=4, batch_wait_ms=0, queue_size=16)
    ex = service.executor
    try:
        release = hold_workers(ex)
        same_shape = [(small_task(40, 9, seed=500 + i), CONFIG.replace(seed=500 + i)) for i in range(6)]
        pins = [0, 1, 0, 1, 0, 1]
        jobs = [submit_task(service, t, c, "fused", pin=p, label=str(i))
                for i, ((t, c), p) in enumerate(zip(same_shape, pins))]
        counts = count_answers(jobs)
        assert ex.depth == 6
        for event in release:
            event.set()
        for job, (task, config), pin in zip(jobs, same_shape, pins):
            if pin == 0:
                with pytest.raises(RuntimeError, match="cuda:0: launch failed"):
                    resolved(job, 120)
            else:
                result = resolved(job, 120).result
                assert_same_result(result, run_task(task, config, "cpu"))
                assert result.metadata["device"] == "cuda:1" and result.metadata["tasks_in_launch"] == 3
            assert job.worker == f"cuda:{pin}" and job.launch_size == 3
        assert counts == [1] * len(jobs)
        launches = sorted((c.kind, c.engine_device, c.worker_device, c.seeds) for c in fleet.calls)
        assert launches == [("run_many", "cuda:0", "cuda:0", [500, 502, 504]),
                            ("run_many", "cuda:1", "cuda:1", [501, 503, 505])]
        assert [w.snapshot()["failed_launches"] for w in ex.workers] == [1, 0]
        s = ex.stats
        assert (s.failed, s.completed, s.batched, s.launches) == (3, 3 + 2, 6, 4)  # + the two blockers
        assert_stats_add_up(ex)
        assert len(alive_workers(ex)) == 2
    finally:
        stop_service(service)


# --------------------------------------------------------------------------- per-device dispatch


def test_each_worker_uses_its_own_devices_backend_object(fake_gpus):
    fleet = FakeGpus()
    service = gpu_service(fleet, queue_size=16)
    ex = service.executor
    try:
        assert [w.device for w in ex.workers] == ["cuda:0", "cuda:1", "cuda:2"]
        picked = [ex.submit(lambda: (current_worker().device, worker_engine("fused", service.engines),
                                     worker_engine("fused", fleet), worker_engine("cpu", service.engines)), pin=i).future.result(60)
                  for i in range(3)]
        for i, (device, engine, same, cpu) in enumerate(picked):
            assert device == f"cuda:{i}"
            assert engine is same is fleet.objects[f"cuda:{i}"] and engine.device == f"cuda:{i}"
            assert cpu is get_backend("cpu")  # a CPU backend on a GPU worker: the CPU's object
        assert len({id(engine) for _, engine, _, _ in picked}) == 3
        items = tasks_and_configs(3, first_seed=600)
        jobs = [submit_task(service, t, c, "fused", pin=i) for i, (t, c) in enumerate(items)]
        for i, (job, (task, config)) in enumerate(zip(jobs, items)):
            outcome = resolved(job, 120)
            assert outcome.result.metadata["device"] == f"cuda:{i}" == job.worker
            assert outcome.result.metadata["backend"] == "fused"
            assert_same_result(outcome.result, run_task(task, config, "cpu"))
            assert outcome.energy is None and outcome.energy_reason  # no meters opened
        assert sorted((c.engine_device, c.worker_device, c.seeds) for c in fleet.calls) == [
            (f"cuda:{i}", f"cuda:{i}", [600 + i]) for i in range(3)]
    finally:
        stop_service(service)


def test_engine_device_is_the_workers_gpu_for_gpu_backends_and_the_cpu_otherwise():
    assert engine_device("fused", "cuda:2") == "cuda:2"
    assert engine_device("cuda", "cuda:0") == "cuda:0"
    assert engine_device("cpu", "cpu:3") == "cpu"
    assert engine_device("cpu-fast", "cuda:1") == "cpu"
    assert engine_device("cuda", "cpu:0") == "cpu"  # a GPU backend asked for on a CPU worker


def test_a_pinned_job_runs_only_on_its_worker():
    ex = DeviceExecutor(capacity=8, devices=["cuda:0", "cuda:1"])
    ex.start()
    try:
        (first, second) = hold_workers(ex)
        second.set()  # worker 1 is free again; worker 0 is still held
        wait_for(lambda: ex.busy_workers() == 1, 60, what="worker 1 free")
        pinned = ex.submit(lambda: current_worker().device, label="pinned to 0", pin=0)
        free = ex.submit(lambda: current_worker().device, label="any worker")
        # the free worker passes over the older job pinned to the busy one
        assert free.future.result(60) == "cuda:1"
        assert not pinned.future.done() and pinned.state == "queued" and ex.depth == 1
        first.set()
        assert pinned.future.result(60) == "cuda:0" and pinned.worker == "cuda:0"
        with pytest.raises(ValueError, match="pin must name a worker 0..1"):
            ex.submit(lambda: None, pin=2)
        assert_stats_add_up(ex)
    finally:
        ex.abandon_all("test over")
        assert ex.stop(60)


def test_each_gpu_worker_warms_up_its_own_device(fake_gpus):
    fleet = FakeGpus()
    service = gpu_service(fleet, start=False, queue_size=16)
    service.energy.open = lambda devices=None: None  # no NVML, whatever this machine has

    async def lifecycle():
        await service.start()
        try:
            await asyncio.to_thread(wait_for, lambda: service.state != "starting", 120, 0.02, "the warm-ups")
            assert service.state == "ready", service.failure
        finally:
            await service.stop()

    asyncio.run(lifecycle())
    assert sorted(w["device"] for w in service.warmups) == ["cuda:0", "cuda:1", "cuda:2"]
    expected = run_task(warmup_task(), Config(), "cpu").predictions_sha256
    assert {w["predictions_sha256"] for w in service.warmups} == {expected}
    warm_calls = sorted((c.engine_device, c.worker_device) for c in fleet.calls)
    assert warm_calls == [(f"cuda:{i}", f"cuda:{i}") for i in range(3)]  # each on its own worker, once
    assert [w.tasks for w in service.executor.workers] == [1, 1, 1]
    assert alive_workers(service.executor) == []


def test_batches_are_gathered_per_worker_and_run_on_that_workers_backend(fake_gpus):
    fleet = FakeGpus()
    service = gpu_service(fleet, workers=2, batch_max=3, batch_wait_ms=0, queue_size=16)
    ex = service.executor
    try:
        release = hold_workers(ex)
        items = [(small_task(40, 9, seed=700 + i), CONFIG.replace(seed=700 + i)) for i in range(6)]
        jobs = [submit_task(service, t, c, "fused", label=str(i)) for i, (t, c) in enumerate(items)]
        assert ex.depth == 6
        for event in release:
            event.set()
        outcomes = [resolved(j, 120) for j in jobs]
        launches = {seed: c for c in fleet.calls for seed in c.seeds}
        assert sorted(launches) == [c.seed for _, c in items]  # each task ran once
        # 6 queued before either worker was free, batch_max 3: two launches of 3, one per gathering
        assert sorted((c.kind, len(c.seeds)) for c in fleet.calls) == [("run_many", 3), ("run_many", 3)]
        assert all(c.engine_device == c.worker_device for c in fleet.calls)
        for job, outcome, (task, config) in zip(jobs, outcomes, items):
            call = launches[config.seed]
            assert job.worker == call.worker_device == outcome.result.metadata["device"]
            assert job.launch_size == len(call.seeds) == outcome.result.metadata["tasks_in_launch"]
            assert_same_result(outcome.result, run_task(task, config, "cpu"))
        assert ex.stats.batched == sum(len(c.seeds) for c in fleet.calls if len(c.seeds) > 1)
        assert_stats_add_up(ex)
    finally:
        stop_service(service)


def test_an_idle_worker_runs_other_work_while_another_worker_gathers_a_batch():
    ready_calls = [0]
    lock = threading.Lock()

    def ready():
        with lock:
            ready_calls[0] += 1
        return True

    ex = DeviceExecutor(capacity=8, batch_max=2, batch_wait_s=600.0, devices=["cuda:0", "cuda:1"])
    ex.start()
    try:
        head = ex.submit(lambda: "alone", label="head", batch=Batch("k", "h", lambda items: list(items), ready))
        wait_for(lambda: ready_calls[0] >= 1, 60, what="a worker gathering the head")
        seen_at_start: list[int] = []
        other = ex.submit(lambda: seen_at_start.append(ready_calls[0]) or current_worker().device, label="other")
        # either the free worker takes `other`, or it starts gathering the same head (a 2nd ready())
        wait_for(lambda: other.started is not None or ready_calls[0] >= 2, 60, what="the free worker's choice")
        assert other.started is not None, "the free worker is gathering the other worker's head"
        other.future.result(60)
        assert seen_at_start == [1]
        assert not head.future.done()  # still gathering: no second matching job yet
    finally:
        ex.submit(lambda: "mate", batch=Batch("k", "m", lambda items: list(items), ready))  # fills the batch
        assert head.future.result(60) == "h"
        ex.abandon_all("test over")
        assert ex.stop(60)


# --------------------------------------------------------------------------- energy per device


def by_hand_energy(devices: list[str], idle_w: dict[str, float]) -> tuple[Energy, dict]:
    """An Energy with one SimulatedMeter and idle baseline per GPU, put in by hand (as open()
    would with NVML)."""
    energy = Energy()
    meters = {d: SimulatedMeter(idle_w=idle_w[d]) for d in devices}
    energy.meters = dict(meters)
    energy.idles = {d: IdleBaseline() for d in devices}
    energy._idle_baseline = IdleBaseline()  # as open() makes it
    energy.reason = None
    energy.request_energy = request_energy
    return energy, meters


@dataclasses.dataclass
class Engine:
    name: str
    device: str


def test_energy_meter_for_picks_the_meter_of_the_engines_device():
    energy, meters = by_hand_energy(["cuda:0", "cuda:1", "cuda:2"], {"cuda:0": 50.0, "cuda:1": 51.0, "cuda:2": 52.0})
    for device, meter in meters.items():
        energy.idles[device].sample(meter)  # (a GPU not yet sampled: see the test below)
        assert energy.meter_for(Engine("fused", device)) == (meter, None)
        assert energy.idle_for(Engine("fused", device)) is energy.idles[device]
    assert energy.meter_for(Engine("cuda", "cuda")) == (meters["cuda:0"], None)  # the bare current device
    assert energy.meter_for(Engine("fused", "cuda:3")) == (None, "no energy meter for cuda:3")
    meter, reason = energy.meter_for(Engine("cpu", "cpu"))
    assert meter is None and "runs on the CPU" in reason
    assert energy.meter is meters["cuda:0"]


def test_each_worker_meters_its_tasks_with_its_own_gpus_meter_and_idle_baseline():
    devices = ["cuda:0", "cuda:1"]
    energy, meters = by_hand_energy(devices, {"cuda:0": 50.0, "cuda:1": 51.0})
    power = {"cuda:0": 100.0, "cuda:1": 250.0}
    fleet = FakeGpus(meters=meters, power_w=power)
    ex = DeviceExecutor(capacity=8, devices=devices)  # no idle hook: the samples are the test's
    ex.start()
    try:
        for i in range(2):  # an idle sample taken on a worker is of that worker's GPU
            ex.submit(energy.sample_idle, pin=i).future.result(60)
        assert [energy.idles[d].median_w() for d in devices] == [50.0, 51.0]
        start = {d: m.energy_mj() for d, m in meters.items()}
        items = tasks_and_configs(2, first_seed=800)
        jobs = [ex.submit(lambda t=t, c=c: run_on_device(t, c, "fused", energy, fleet), pin=i)
                for i, (t, c) in enumerate(items)]
        for i, (job, (task, config)) in enumerate(zip(jobs, items)):
            device = devices[i]
            outcome = resolved(job, 120)
            assert outcome.result.metadata["device"] == device
            assert_same_result(outcome.result, run_task(task, config, "cpu"))
            reading = outcome.energy
            assert reading["gross_j"] == pytest.approx(power[device]) and reading["duration_s"] == pytest.approx(1.0)
            assert reading["idle_baseline_w"] == energy.idles[device].median_w()
            assert reading["idle_adjusted_j"] == pytest.approx(power[device] - energy.idles[device].median_w())
        # each meter moved once, by its own device's run
        assert {d: meters[d].energy_mj() - start[d] for d in devices} == {"cuda:0": 100_000, "cuda:1": 250_000}
    finally:
        ex.abandon_all("test over")
        assert ex.stop(60)


def test_a_gpu_without_idle_samples_is_not_adjusted_with_another_gpus_baseline():
    devices = ["cuda:0", "cuda:1"]
    energy, meters = by_hand_energy(devices, {"cuda:0": 50.0, "cuda:1": 51.0})
    fleet = FakeGpus(meters=meters, power_w={"cuda:0": 100.0, "cuda:1": 250.0})
    ex = DeviceExecutor(capacity=8, devices=devices)
    ex.start()
    try:
        ex.submit(energy.sample_idle, pin=0).future.result(60)  # only cuda:0 has been sampled idle
        assert (len(energy.idles["cuda:0"]), len(energy.idles["cuda:1"])) == (1, 0)
        task, config = tasks_and_configs(1, first_seed=850)[0]
        reading = ex.submit(lambda: run_on_device(task, config, "fused", energy, fleet), pin=1).future.result(120).energy
        assert reading["gross_j"] == pytest.approx(250.0)
        assert reading["idle_baseline_samples"] == 0 and reading["idle_baseline_w"] is None
        assert reading["idle_adjusted_j"] is None
    finally:
        ex.abandon_all("test over")
        assert ex.stop(60)


# --------------------------------------------------------------------------- shutdown drains every worker


def test_drain_lets_the_task_on_every_worker_finish_and_refuses_new_ones_over_http():
    gate = Gate()
    engines = gated_engines(gate)
    app = create_app(Settings(backend="cpu", workers=3, queue_size=8, drain_timeout_s=120), engines=engines)
    items = tasks_and_configs(5, first_seed=900)
    bodies = [task_to_npz_bytes(t) for t, _ in items]

    def send(i):
        with srv.client() as ci:
            return post_task(ci, bodies[i], params={"batch_size": "16", "epochs": "2", "seed": str(900 + i)})

    with inprocess_server(app) as srv, srv.client() as c:
        service = app.state.service
        ex = service.executor
        gate.hold()
        try:
            with concurrent.futures.ThreadPoolExecutor(5) as pool:
                running = [pool.submit(send, i) for i in range(3)]
                wait_for(lambda: engines("cpu").waiting == 3, 60, what="a task held on every worker")
                queued = [pool.submit(send, i) for i in (3, 4)]
                wait_for(lambda: ex.depth == 2, 60, what="two tasks queued")
                service.begin_drain("test: drain")
                refused = post_task(c, bodies[0])
                ready = c.get("/v2/health/ready")
                health = c.get("/health")
                assert not any(f.done() for f in running + queued)
                gate.release()
                responses = [f.result(120) for f in running + queued]
        finally:
            gate.release()
    assert refused.status_code == 503, refused.text
    assert "draining" in refused.json()["error"] and int(refused.headers["retry-after"]) >= 1
    assert ready.status_code == 503 and ready.json()["status"] == "draining"
    doc = health.json()
    assert health.status_code == 503 and doc["status"] == "draining" and doc["queue"]["accepting"] is False
    assert sorted(w["device"] for w in doc["queue"]["workers"] if w["busy"]) == ["cpu:0", "cpu:1", "cpu:2"]
    for r, (task, config) in zip(responses, items):
        assert r.status_code == 200, r.text
        assert r.json()["predictions_sha256"] == run_task(task, config, "cpu").predictions_sha256
    assert alive_workers(ex) == []  # the lifespan shutdown ended every worker
    s = ex.stats
    assert s.accepted == s.completed == 1 + 5  # the warm-up and the five; nothing abandoned
    assert s.abandoned == s.cancelled == 0
    assert_stats_add_up(ex)


def test_drain_deadline_answers_what_is_left_on_every_worker_with_503():
    gate = Gate()
    engines = gated_engines(gate)
    service = Service(Settings(backend="cpu", workers=3, queue_size=8, drain_timeout_s=0.2), engines=engines)
    ex = service.executor
    ex.start()
    try:
        items = tasks_and_configs(5, first_seed=950)
        gate.hold()
        running = [submit_task(service, t, c, "cpu", label=f"r{i}") for i, (t, c) in enumerate(items[:3])]
        wait_for(lambda: engines("cpu").waiting == 3, 60, what="a task held on every worker")
        queued = [submit_task(service, t, c, "cpu", label=f"q{i}") for i, (t, c) in enumerate(items[3:])]
        counts = count_answers(running + queued)
        service.begin_drain("test: deadline")
        with pytest.raises(Unavailable) as refused:
            submit_task(service, *items[0], "cpu")
        assert refused.value.status == 503
        # the deadline passes with the gate still held: every worker's task and the queue get 503
        for job in running + queued:
            assert isinstance(job.future.exception(60), Unavailable)
        assert sorted(j.worker for j in running) == ["cpu:0", "cpu:1", "cpu:2"]
        assert [j.future.exception().details["where"] for j in running] == ["running"] * 3
        assert [j.future.exception().details["where"] for j in queued] == ["queued"] * 2
        assert all(j.started is None for j in queued)
        # the held runs were told to stop; they end without the gate being opened
        wait_for(lambda: ex.stats.abandoned_finished == 3, 60, what="the abandoned runs to end")
        asyncio.run(service.stop())
        assert alive_workers(ex) == []
        assert counts == [1] * 5
        s = ex.stats
        assert (s.abandoned, s.cancelled, s.stopped, s.refused_closed, s.completed) == (3, 2, 3, 1, 0)
        assert_stats_add_up(ex)
    finally:
        gate.release()
        ex.abandon_all("test over")
        ex.stop(60)


def test_executor_stop_waits_for_the_job_on_every_worker():
    ex = DeviceExecutor(capacity=4, devices=["cpu:0", "cpu:1", "cpu:2"])
    ex.start()
    release = hold_workers(ex)
    jobs = [job for w in ex.workers for job in w.running]
    queued = ex.submit(lambda: current_worker().device, label="queued")
    ended: list[bool] = []
    stopper = threading.Thread(target=lambda: ended.append(ex.stop(120)))
    stopper.start()
    wait_for(lambda: ex.closed, 60, what="the executor closed")
    with pytest.raises(Unavailable):
        ex.submit(lambda: "refused")
    assert ended == [] and not any(j.future.done() for j in jobs) and not queued.future.done()
    for event in release:
        event.set()
    stopper.join(120)
    assert ended == [True] and alive_workers(ex) == []
    assert [j.future.result() for j in jobs] == [True, True, True]
    assert queued.future.result() in ("cpu:0", "cpu:1", "cpu:2")  # accepted before the stop: it ran
    assert (ex.stats.completed, ex.stats.refused_closed) == (4, 1)
    assert_stats_add_up(ex)


# --------------------------------------------------------------------------- the plan


@pytest.mark.parametrize("backend", ["fused", "cuda"])
def test_plan_for_gpus_one_worker_per_gpu_batch_is_the_smallest_sm_count(backend):
    p = plan(backend, gpus=GPUS)
    assert p.devices == ["cuda:0", "cuda:1", "cuda:2"]
    assert p.batch_max == 108 and p.queue_size == 2 * 108 * 3
    assert "one per GPU" in p.rule and "2 x batch_max x workers" in p.rule
    two = plan(backend, workers=2, gpus=GPUS)  # the first two GPUs: both 132 SMs
    assert (two.devices, two.batch_max, two.queue_size) == (["cuda:0", "cuda:1"], 132, 2 * 132 * 2)
    with pytest.raises(PlanError, match=r"REV88_WORKERS=4 but only 3 GPU\(s\) are visible \(one worker per GPU\)"):
        plan(backend, workers=4, gpus=GPUS)
    with pytest.raises(PlanError, match=f"backend '{backend}' needs a CUDA GPU and none is visible"):
        plan(backend, gpus=[])


def test_plan_honours_explicit_settings():
    p = plan("fused", workers=1, queue_size=5, batch_max=7, gpus=GPUS)
    assert (p.devices, p.queue_size, p.batch_max) == (["cuda:0"], 5, 7)
    assert "batch_max set" in p.rule and "queue set" in p.rule
    assert plan("cuda", queue_size=1, gpus=GPUS).queue_size == 1  # below the derived size: still honoured
    c = plan("cpu", workers=6, queue_size=2, batch_max=3, cores=2)  # more workers than cores: honoured
    assert (c.devices, c.queue_size, c.batch_max) == ([f"cpu:{i}" for i in range(6)], 2, 3)
    assert "REV88_WORKERS" in c.rule and "queue set" in c.rule and "batch_max set" in c.rule


def test_plan_for_cpu_one_worker_per_core_batch_1():
    p = plan("cpu", cores=4)
    assert (p.devices, p.batch_max, p.queue_size) == (["cpu:0", "cpu:1", "cpu:2", "cpu:3"], 1, max(8, 16))
    assert "one per usable core" in p.rule
    assert plan("cpu-fast", cores=1).queue_size == 8
    assert plan("cpu", cores=3, workers=3).queue_size == 12
    assert plan("cpu", workers=2).devices == ["cpu:0", "cpu:1"]


def test_the_service_applies_the_plan_and_refuses_more_workers_than_gpus(fake_gpus):
    fleet = FakeGpus()
    with pytest.raises(SettingsError, match=r"REV88_WORKERS=4 but only 3 GPU\(s\) are visible"):
        Service(Settings.from_env({"REV88_BACKEND": "fused", "REV88_WORKERS": "4"}), engines=fleet)
    derived = Service(Settings(backend="fused"), engines=fleet)
    assert [w.device for w in derived.executor.workers] == ["cuda:0", "cuda:1", "cuda:2"]
    assert (derived.executor.capacity, derived.executor.batch_max) == (648, 108)
    from app.api.health import health

    _, doc = health(derived)
    assert doc["workers"]["devices"] == ["cuda:0", "cuda:1", "cuda:2"] and doc["limits"]["workers"] == 3
    assert [w["device"] for w in doc["queue"]["workers"]] == ["cuda:0", "cuda:1", "cuda:2"]
    env = {"REV88_BACKEND": "fused", "REV88_WORKERS": "2", "REV88_QUEUE_SIZE": "3", "REV88_BATCH_MAX": "5"}
    explicit = Service(Settings.from_env(env), engines=fleet)
    assert [w.device for w in explicit.executor.workers] == ["cuda:0", "cuda:1"]
    assert (explicit.queue_size, explicit.executor.capacity, explicit.batch_max) == (3, 3, 5)
    cpu = Service(Settings(backend="cpu", workers=5), engines=fleet)  # CPU workers: any count is honoured
    assert [w.device for w in cpu.executor.workers] == [f"cpu:{i}" for i in range(5)]
    assert (cpu.queue_size, cpu.batch_max) == (20, 1)


def test_cgroup_cpu_limit_reads_cpu_max(tmp_path):
    path = tmp_path / "cpu.max"
    for text, limit in (("max 100000\n", None), ("150000 100000\n", 2), ("100000 100000\n", 1),
                        ("50000 100000\n", 1), ("400000 100000\n", 4), ("garbage\n", None),
                        ("lots 100000\n", None), ("100000 0\n", None)):
        path.write_text(text)
        assert cgroup_cpu_limit(str(path)) == limit, text
    assert cgroup_cpu_limit(str(tmp_path / "absent")) is None


def test_usable_cores_is_capped_by_the_cgroup_quota(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setattr(devices_mod, "cgroup_cpu_limit", lambda path="/sys/fs/cgroup/cpu.max": None)
    assert usable_cores() == cores
    monkeypatch.setattr(devices_mod, "cgroup_cpu_limit", lambda path="/sys/fs/cgroup/cpu.max": 1)
    assert usable_cores() == 1
    monkeypatch.setattr(devices_mod, "cgroup_cpu_limit", lambda path="/sys/fs/cgroup/cpu.max": cores + 8)
    assert usable_cores() == cores
    assert len(plan("cpu").devices) == cores


def test_each_gpu_worker_selects_its_own_device_on_its_own_thread(fake_gpus, monkeypatch):
    """Issue #37, 7: the CUDA runtime keeps a current device per host thread; each worker makes
    its GPU current on its own thread before it runs anything (so cuda:1 work is not run on GPU
    0). Through the fake-GPU harness: the service's three workers, the selection recorded."""
    from app.runtime import worker_loop

    selected: list[tuple[str, str]] = []
    monkeypatch.setattr(worker_loop, "select_cuda_device",
                        lambda device: selected.append((device, threading.current_thread().name)))
    fleet = FakeGpus()
    service = gpu_service(fleet, queue_size=16)
    try:
        ex = service.executor
        ran = [ex.submit(lambda: threading.current_thread().name, pin=i).future.result(60) for i in range(3)]
        assert sorted(selected) == sorted(zip(["cuda:0", "cuda:1", "cuda:2"], ran))  # each on its worker's thread
        assert ran == [f"rev88-worker-cuda:{i}" for i in range(3)]
    finally:
        stop_service(service)


def test_select_cuda_device_sets_the_threads_device_and_leaves_cpu_workers_alone(monkeypatch):
    import torch

    from app.runtime.executor import select_cuda_device

    calls: list[int] = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    select_cuda_device("cuda:1")  # no CUDA here: nothing to select (the GPU backends refuse themselves)
    assert calls == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for device in ("cuda:2", "cpu:0", "cpu:1", "cuda:0"):
        select_cuda_device(device)
    assert calls == [2, 0]
