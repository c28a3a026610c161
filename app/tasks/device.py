"""What runs on a device worker: one task, a measurement, or a batched launch of tasks.

The task path is the CLI's: ``learner.taskio.load_task`` (safe reader + validation),
``learner.config.make_config`` and ``learner.result.run_task``; the service adds only HTTP
concerns, so the same npz and backend give the same predictions and hashes as ``rev88 run``.

Batched launches: on a backend with ``run_many`` (fused), queued tasks of one shape and config
(seeds may differ) can share one launch (app/runtime/executor.py gathers them);
``run_many_on_device`` then prepares each task as ``run_task`` does and builds each task's
result with ``learner.result.finish_task``, the same code that ``run_task`` uses, so each answer
has its own predictions, hashes and metadata.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from learner.backends import Backend, Prepared, RunOutput, get_backend
from learner.cancel import CancelToken
from learner.config import Config
from learner.errors import TaskCancelled
from learner.result import TaskResult, finish_task, run_digests, run_task
from learner.taskio import TaskArrays
from learner.train import prepare
from learner.validate import cached_validation

from ..runtime.devices import engine_device
from ..runtime.executor import current_worker

Engines = Callable[[str, str], Backend]  # (backend name, device) -> backend object (learner.backends.get_backend)


# --------------------------------------------------------------------------- the device side


class MeteredBackend:
    """A backend whose ``run`` (and only that: the synchronized device work) is bracketed
    by NVML energy-counter readings; the reading of the last run is kept in ``energy``."""

    def __init__(self, inner: Backend, meter: Any, idle: Any, request_energy: Any) -> None:
        self.inner, self.meter, self.idle, self._request_energy = inner, meter, idle, request_energy
        self.name, self.device = inner.name, inner.device
        self.energy: dict | None = None

    def describe(self) -> dict:
        return self.inner.describe()

    def run(self, task, prepared: Prepared) -> RunOutput:
        out, self.energy = self._request_energy(self.meter, lambda: self.inner.run(task, prepared), self.idle)
        return out


@dataclasses.dataclass
class DeviceOutcome:
    result: TaskResult
    energy: dict | None
    energy_reason: str | None


def worker_engine(backend: str, engines: Engines = get_backend, precision: str | None = None) -> Backend:
    """On a worker: the backend object for ``backend`` on that worker's device, at ``precision``
    (a request's ?precision=: the backend's ``with_precision``; None: the backend's own)."""
    worker = current_worker()
    return at_precision(engines(backend, engine_device(backend, worker.device if worker is not None else "cpu:0")),
                        precision)


def at_precision(engine: Backend, precision: str | None) -> Backend:
    """``engine`` running its products at ``precision``: fused and cuda say how (``with_precision``);
    the CPU backends compute in fp32, "ieee", which app/tasks/options.py allows them alone."""
    if precision is None:
        return engine
    with_precision = getattr(engine, "with_precision", None)
    if with_precision is not None:
        return with_precision(precision)
    if precision != "ieee":
        raise ValueError(f"backend {engine.name!r} computes its products in fp32 (precision 'ieee'), not {precision!r}")
    return engine


def run_on_device(task, config: Config, backend: str, energy: Any, engines: Engines = get_backend,
                  cancel: CancelToken | None = None, precision: str | None = None) -> DeviceOutcome:
    """The executor's job for one task: the learner's run, metered where a GPU meter exists,
    stopped at the backend's next safe point once ``cancel`` is set."""
    engine = worker_engine(backend, engines, precision)
    meter, reason = energy.meter_for(engine)
    if meter is None:
        return DeviceOutcome(run_task(task, config, engine, cancel=cancel), None, reason)
    metered = MeteredBackend(engine, meter, energy.idle_for(engine), energy.request_energy)
    result = run_task(task, config, metered, cancel=cancel)
    return DeviceOutcome(result, metered.energy, None)


def measure_on_device(task, config: Config, backend: str, arguments: dict[str, Any], energy: Any,
                      engines: Engines = get_backend, precision: str | None = None) -> dict:
    """The executor's job for ?measure=energy: the gated protocol (learner.measure.gated,
    docs/energy.md) on the worker's GPU through its meter, device held throughout (it is not
    stopped by a timeout or a disconnect once it runs; a queued one is dropped). Without a
    meter (a CPU worker, no NVML) the timing-only document, ``valid: null``."""
    from learner.measure.gated import measure_energy

    engine = worker_engine(backend, engines, precision)
    meter, _ = energy.meter_for(engine)
    return measure_energy(task, config, engine, meter=meter, **arguments)


# --------------------------------------------------------------------------- batched launches

BATCH_METHOD = "batched launch, divided equally by task count"
# runs whose digests one call of the hash pool makes: sixteen runs' scores fill the lanes' sixteen
# places exactly (learner/sha256_lanes.c), and the finisher starts on a launch's first tasks as
# soon as their group is hashed
DIGEST_GROUP = 16


def launch_key(task: TaskArrays, config: Config, backend: str, precision: str | None = None) -> tuple:
    """Tasks with equal keys may share one ``run_many`` launch: one backend, one product precision
    (a request's ?precision=, None: the backend's own -- tasks of different precisions never share
    a launch), one (train_count, test_count) shape, one config except the seed (each task's
    seed-derived initial parameters and permutations are its own)."""
    shared = tuple((k, v) for k, v in config.as_dict().items() if k != "seed")
    return (backend, precision, task.train_count, task.test_count, shared)


def has_run_many(engine: Any) -> bool:
    """Whether the backend object can train several tasks in one launch."""
    return callable(getattr(engine, "run_many", None))


def share_energy(reading: dict, tasks: int) -> dict:
    """One launch's energy reading, divided equally among the ``tasks`` it trained.

    The NVML counter sees the launch as a whole; an equal share is the honest split
    for tasks of one shape and config (the same work each). The launch's own figures
    stay beside the shares (``launch_gross_j``, ``launch_idle_adjusted_j``)."""
    if tasks == 1:
        return reading
    out = dict(reading)
    for name in ("gross_j", "idle_adjusted_j"):
        value = reading.get(name)
        out[name] = None if value is None else value / tasks
        out[f"launch_{name}"] = value
    out["tasks_in_launch"] = tasks
    out["method"] = f"{reading.get('method')}; {BATCH_METHOD}"
    out["note"] = (
        f"{BATCH_METHOD}: this task shared one launch with {tasks - 1} other task(s); gross_j and "
        f"idle_adjusted_j are the launch's figures / {tasks} (launch_gross_j, launch_idle_adjusted_j: the "
        "whole launch); duration_s and the counter readings are the launch's. " + str(reading.get("note", ""))
    )
    return out


@dataclasses.dataclass
class Launch:
    """A launch run on the device, its results not yet finished: per item, the task's run (or the
    exception that is its answer), and the launch's energy share and device time."""

    items: list[tuple]
    engine: Any
    runs: list[tuple | BaseException | None]  # (task, config, prepared, out, host_prep) per item
    share: dict | None
    reason: str | None
    device_s: float


def launch_on_device(
    items: list[tuple], backend: str, energy: Any, engines: Engines = get_backend, precision: str | None = None,
    refuse: Callable[[tuple], BaseException | None] | None = None,
) -> Launch:
    """The device's part of a launch of gathered tasks of one launch key: each task prepared (its
    seed-derived state from learner/seed_state.py), one ``run_many``, metered as a whole where a
    GPU meter exists. An item is ``(task, config)`` or ``(task, config, cancel_token, ...)``.

    A task whose preparation fails is answered with its own error; a task cancelled before the
    launch, or one ``refuse`` answers an error for (its tenant's key revoked), is left out of it. An error of the launch itself is raised (the executor answers every
    task of the launch with it). Its results are finished apart (``finish_launch``), off the
    device worker."""
    engine = worker_engine(backend, engines, precision)
    cached_validation()  # as run_task: computed once per process, before the first run
    runs: list[tuple | BaseException | None] = [None] * len(items)
    slots, tasks, prepareds, host_prep = [], [], [], []
    for i, item in enumerate(items):
        task, config = item[0], item[1]
        cancel = item[2] if len(item) > 2 else None
        if cancel is not None and cancel.cancelled:
            runs[i] = TaskCancelled(cancel.reason or "cancelled", 0, 0, config.epochs)
            continue
        refused = refuse(item) if refuse is not None else None
        if refused is not None:
            runs[i] = refused
            continue
        t0 = time.perf_counter()
        try:
            prepared = prepare(task, config)
        except Exception as exc:  # noqa: BLE001 - this task's answer
            runs[i] = exc
            continue
        slots.append(i)
        tasks.append(task)
        prepareds.append(prepared)
        host_prep.append(time.perf_counter() - t0)
    if not tasks:
        return Launch(items, engine, runs, None, None, 0.0)
    meter, reason = energy.meter_for(engine)
    reading = None
    t0 = time.monotonic()
    if meter is None:
        outs = engine.run_many(tasks, prepareds)
    else:
        outs, reading = energy.request_energy(meter, lambda: engine.run_many(tasks, prepareds), energy.idle_for(engine))
    device_s = time.monotonic() - t0
    if len(outs) != len(tasks):
        raise RuntimeError(f"backend {engine.name!r} returned {len(outs)} outputs for a launch of {len(tasks)} tasks")
    for k, i in enumerate(slots):
        runs[i] = (tasks[k], items[i][1], prepareds[k], outs[k], host_prep[k])
    share = None if reading is None else share_energy(reading, len(tasks))
    return Launch(items, engine, runs, share, None if share is not None else reason, device_s)


def finish_launch(launch: Launch, pool: Any = None) -> list[DeviceOutcome | BaseException]:
    """The host's part after a launch, off the device: each task's result checked, hashed and
    assembled (``learner.result.finish_task``, the same code as a single task's). With ``pool``,
    every SHA-256 of the runs' outputs (``run_digests``: 15 buffers a task, 575 KB for 10,000
    queries) is computed on its threads, ``DIGEST_GROUP`` runs to a call -- hashlib and the
    lanes let go of the GIL for them, and a group's buffers of one kind are hashed side by side
    (``learner.hashing.sha256_many``) -- while this thread finishes the tasks in order, each with
    its digests once its group's are there; the rest of a task's finishing is Python, which
    threads would only pass the GIL back and forth for (docs/performance.md, "Small costs inside
    a request"). One outcome per item, in order. A task cancelled while the launch ran has its
    result discarded (TaskCancelled)."""
    ran = [i for i, run in enumerate(launch.runs) if isinstance(run, tuple)]
    count = len(ran)
    digests: dict[int, tuple[Any, int]] = {}  # run's index -> (its group's future, its place in the group)
    if pool is not None and count >= 2:
        for at in range(0, count, DIGEST_GROUP):
            group = ran[at:at + DIGEST_GROUP]
            future = pool.submit(run_digests, [launch.runs[i][3] for i in group])
            digests.update((i, (future, k)) for k, i in enumerate(group))

    def one(i: int) -> DeviceOutcome | BaseException:
        run = launch.runs[i]
        if not isinstance(run, tuple):
            return run  # (its error, or a cancel before the launch)
        task, config, prepared, out, host_prep = run
        item = launch.items[i]
        cancel = item[2] if len(item) > 2 else None
        if cancel is not None and cancel.cancelled:
            return TaskCancelled(cancel.reason or "cancelled", config.epochs, 0, config.epochs)
        hashed = None
        if i in digests:
            future, k = digests[i]
            try:
                hashed = future.result()[k]
            except Exception:  # noqa: BLE001 - (finish_task meets the same trouble and answers it)
                hashed = None
        try:
            result = finish_task(task, config, launch.engine, prepared, out, host_prep, tasks_in_launch=count,
                                 digests=hashed)
        except Exception as exc:  # noqa: BLE001 - e.g. TrainingDivergedError: this task's answer
            return exc
        return DeviceOutcome(result, launch.share, launch.reason)

    return [one(i) for i in range(len(launch.runs))]


def run_many_on_device(
    items: list[tuple], backend: str, energy: Any, engines: Engines = get_backend, precision: str | None = None
) -> list[DeviceOutcome | BaseException]:
    """A launch and its results, in one call (``launch_on_device`` then ``finish_launch``): one
    outcome per item, in order. A task whose preparation or result fails (say, its training
    diverged) is answered with its own error; the others are unaffected. An error of the launch
    itself is raised. A launch cannot be interrupted: a task cancelled before it starts is left
    out of it; one cancelled while it runs has its result discarded (TaskCancelled)."""
    return finish_launch(launch_on_device(items, backend, energy, engines, precision))
