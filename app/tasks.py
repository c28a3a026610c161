"""POST /tasks as plain functions: options from the query, the device job, the answers.

The task path is the CLI's: ``learner.taskio.load_task`` (safe reader +
validation), ``learner.config.make_config`` and ``learner.result.run_task``;
the service adds only HTTP concerns, so the same npz and backend give the same
predictions and hashes as ``rev88 run``.

Batched launches: on a backend with ``run_many`` (fused), queued tasks of one
shape and config (seeds may differ) can share one launch (app/executor.py gathers
them); ``run_many_on_device`` then prepares each task as ``run_task`` does and
builds each task's result with ``learner.result.finish_task``, the same code that
``run_task`` uses, so each answer has its own predictions, hashes and metadata.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from learner.backends import Backend, BackendUnavailable, Prepared, RunOutput, get_backend, resolve
from learner.cancel import CancelToken
from learner.config import Config, coerce_config_strings, make_config
from learner.errors import (
    ArchiveError,
    ArchiveTooLargeError,
    BudgetExceeded,
    TaskCancelled,
    TaskError,
    TrainingDivergedError,
)
from learner.result import TaskResult, finish_task, run_task
from learner.taskio import TaskArrays
from learner.train import prepare
from learner.validate import cached_validation

from .devices import engine_device
from .errors import InvalidRequest, ServiceError
from .executor import current_worker

Engines = Callable[[str, str], Backend]  # (backend name, device) -> backend object (learner.backends.get_backend)

SERVICE_PARAMS = ("backend", "include", "measure")
MEASURE_PARAMS = {  # name: (type, lowest, highest, default) — keep one measurement well under an hour
    "trials": (int, 1, 10, 3),
    "target_seconds": (float, 0.1, 60.0, 5.0),
    "settle_seconds": (float, 0.0, 30.0, 3.0),
    "idle_seconds": (float, 0.0, 30.0, 3.0),
}
INCLUDES = ("scores",)
NPZ_TYPE = "application/x-npz"


@dataclasses.dataclass(frozen=True)
class TaskOptions:
    config_overrides: dict[str, Any]  # from the query, already type-coerced and checked
    backend: str  # concrete: a name from learner.backends.NAMES other than "auto"
    include_scores: bool = False
    measure: dict[str, Any] | None = None  # protocol arguments for ?measure=energy

    def config(self, form_config: dict[str, Any] | None = None) -> Config:
        """Query overrides merged with a multipart ``config`` field; a key in both is an error."""
        if not form_config:
            return make_config(self.config_overrides)
        both = sorted(set(form_config) & set(self.config_overrides))
        if both:
            raise InvalidRequest(f"config key(s) given both as query parameter and in the 'config' field: {', '.join(both)}")
        return make_config({**form_config, **self.config_overrides})


def parse_options(items: list[tuple[str, str]], default_backend: str) -> TaskOptions:
    """Query parameters -> options. Anything not a service parameter is a config key (unknown -> 422)."""
    keys = [k for k, _ in items]
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:
        raise InvalidRequest(f"query parameter(s) given more than once: {', '.join(repeated)}")
    query = dict(items)
    backend = check_backend(query.pop("backend", default_backend))
    include = [p.strip() for p in query.pop("include", "").split(",") if p.strip()]
    unknown = [p for p in include if p not in INCLUDES]
    if unknown:
        raise InvalidRequest(f"include={','.join(unknown)} is not known; allowed: {', '.join(INCLUDES)}")
    measure = query.pop("measure", None)
    protocol = {name: query.pop(name) for name in list(query) if name in MEASURE_PARAMS}
    if measure is None and protocol:
        raise InvalidRequest(f"{', '.join(sorted(protocol))} only apply with measure=energy")
    if measure is not None and measure != "energy":
        raise InvalidRequest(f"measure={measure!r} is not known; the one measurement is measure=energy")
    overrides = coerce_config_strings(query)
    make_config(overrides)  # fail fast, before the upload is read
    return TaskOptions(
        config_overrides=overrides,
        backend=backend,
        include_scores="scores" in include,
        measure=None if measure is None else measure_arguments(protocol),
    )


def measure_arguments(raw: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (kind, low, high, default) in MEASURE_PARAMS.items():
        if name not in raw:
            out[name] = default
            continue
        try:
            value = kind(raw[name])
        except ValueError:
            raise InvalidRequest(f"{name} must be {'an integer' if kind is int else 'a number'}, got {raw[name]!r}") from None
        if not low <= value <= high:  # also rejects nan
            raise InvalidRequest(f"{name} must be in [{low:g}, {high:g}], got {raw[name]}")
        out[name] = value
    return out


def measure_timeout_s(arguments: dict[str, Any], task_timeout_s: float) -> float:
    """A measurement's timeout: its windows, plus the task timeout for each single run the
    protocol makes outside them (first, calibration, after) and for each trial's last repeat."""
    windows = arguments["trials"] * (arguments["target_seconds"] + 2 * (arguments["settle_seconds"] + arguments["idle_seconds"]))
    return windows + (3 + arguments["trials"]) * task_timeout_s


def check_backend(name: str) -> str:
    """A name from learner.backends.NAMES -> a concrete backend this machine can run,
    else BackendUnavailable (422 for a request; at startup it stops the service)."""
    concrete = resolve(name)
    if concrete in ("cuda", "fused") and not torch.cuda.is_available():
        raise BackendUnavailable(
            f"backend {concrete!r} needs a CUDA GPU and none is available on this server; use backend=cpu"
        )
    if concrete == "fused" and importlib.util.find_spec("triton") is None:
        raise BackendUnavailable(
            "backend 'fused' needs triton, which is not installed on this server (pip install 'rev88[gpu]'); "
            "use backend=cuda"
        )
    if concrete == "cpu-fast":
        from learner.backends.cpu_fast import KERNEL_ERROR, kernel_available

        if not kernel_available():
            raise BackendUnavailable(f"backend 'cpu-fast' is unavailable on this server: {KERNEL_ERROR}; use backend=cpu")
    return concrete


def wants_npz(accept: str | None) -> bool:
    """True when Accept asks for application/x-npz at least as much as for JSON."""
    best: dict[str, float] = {}
    for part in (accept or "").split(","):
        fields = [f.strip() for f in part.split(";")]
        kind = fields[0].lower()
        q = 1.0
        for f in fields[1:]:
            if f.lower().startswith("q="):
                try:
                    q = float(f[2:])
                except ValueError:
                    q = 0.0
        if kind:
            best[kind] = max(q, best.get(kind, 0.0))
    npz = best.get(NPZ_TYPE, 0.0)
    return npz > 0 and npz >= best.get("application/json", 0.0)


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


def worker_engine(backend: str, engines: Engines = get_backend) -> Backend:
    """On a worker: the backend object for ``backend`` on that worker's device."""
    worker = current_worker()
    return engines(backend, engine_device(backend, worker.device if worker is not None else "cpu:0"))


def run_on_device(task, config: Config, backend: str, energy: Any, engines: Engines = get_backend,
                  cancel: CancelToken | None = None) -> DeviceOutcome:
    """The executor's job for one task: the learner's run, metered where a GPU meter exists,
    stopped at the backend's next safe point once ``cancel`` is set."""
    engine = worker_engine(backend, engines)
    meter, reason = energy.meter_for(engine)
    if meter is None:
        return DeviceOutcome(run_task(task, config, engine, cancel=cancel), None, reason)
    metered = MeteredBackend(engine, meter, energy.idle_for(engine), energy.request_energy)
    result = run_task(task, config, metered, cancel=cancel)
    return DeviceOutcome(result, metered.energy, None)


def measure_on_device(task, config: Config, backend: str, arguments: dict[str, Any], energy: Any,
                      engines: Engines = get_backend) -> dict:
    """The executor's job for ?measure=energy: learner.measure's protocol, device held throughout
    (it is not stopped by a timeout or a disconnect once it runs; a queued one is dropped)."""
    from learner.measure import measure_task

    engine = worker_engine(backend, engines)
    meter, _ = energy.meter_for(engine)
    return measure_task(task, config, engine, meter=meter, **arguments)


# --------------------------------------------------------------------------- batched launches

BATCH_METHOD = "batched launch, divided equally by task count"


def launch_key(task: TaskArrays, config: Config, backend: str) -> tuple:
    """Tasks with equal keys may share one ``run_many`` launch: one backend, one
    (train_count, test_count) shape, one config except the seed (each task's
    seed-derived initial parameters and permutations are its own)."""
    shared = tuple((k, v) for k, v in config.as_dict().items() if k != "seed")
    return (backend, task.train_count, task.test_count, shared)


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


def run_many_on_device(
    items: list[tuple], backend: str, energy: Any, engines: Engines = get_backend
) -> list[DeviceOutcome | BaseException]:
    """The executor's call for gathered tasks of one launch key: one ``run_many`` launch,
    metered as a whole where a GPU meter exists; one outcome per item, in order. An item is
    ``(task, config)`` or ``(task, config, cancel_token)``.

    A task whose preparation or result fails (say, its training diverged) is answered
    with its own error; the others are unaffected. An error of the launch itself is
    raised, and the executor answers every task of the launch with it. A launch cannot be
    interrupted: a task cancelled before it starts is left out of it; one cancelled while it
    runs has its result discarded (TaskCancelled)."""
    engine = worker_engine(backend, engines)
    cached_validation()  # as run_task: computed once per process, before the first run
    outcomes: list[DeviceOutcome | BaseException | None] = [None] * len(items)
    slots, tasks, prepareds, host_prep = [], [], [], []
    for i, item in enumerate(items):
        task, config = item[0], item[1]
        cancel = item[2] if len(item) > 2 else None
        if cancel is not None and cancel.cancelled:
            outcomes[i] = TaskCancelled(cancel.reason or "cancelled", 0, 0, config.epochs)
            continue
        t0 = time.perf_counter()
        try:
            prepared = prepare(task, config)
        except Exception as exc:  # noqa: BLE001 - this task's answer
            outcomes[i] = exc
            continue
        slots.append(i)
        tasks.append(task)
        prepareds.append(prepared)
        host_prep.append(time.perf_counter() - t0)
    if not tasks:
        return outcomes
    meter, reason = energy.meter_for(engine)
    reading = None
    if meter is None:
        outs = engine.run_many(tasks, prepareds)
    else:
        outs, reading = energy.request_energy(meter, lambda: engine.run_many(tasks, prepareds), energy.idle_for(engine))
    if len(outs) != len(tasks):
        raise RuntimeError(f"backend {engine.name!r} returned {len(outs)} outputs for a launch of {len(tasks)} tasks")
    share = None if reading is None else share_energy(reading, len(tasks))
    for k, i in enumerate(slots):
        config = items[i][1]
        cancel = items[i][2] if len(items[i]) > 2 else None
        if cancel is not None and cancel.cancelled:  # stopped while the launch ran: discard its result
            outcomes[i] = TaskCancelled(cancel.reason or "cancelled", config.epochs, 0, config.epochs)
            continue
        try:
            result = finish_task(tasks[k], config, engine, prepareds[k], outs[k], host_prep[k],
                                 tasks_in_launch=len(tasks))
        except Exception as exc:  # noqa: BLE001 - e.g. TrainingDivergedError: this task's answer
            outcomes[i] = exc
            continue
        outcomes[i] = DeviceOutcome(result, share, None if share is not None else reason)
    return outcomes


# --------------------------------------------------------------------------- answers


def task_answer(task_id: str, request_id: str | None, outcome: DeviceOutcome, timing: dict, include_scores: bool) -> dict:
    result = outcome.result
    answer: dict[str, Any] = {
        "id": task_id,
        "request_id": request_id,
        "predictions": result.predictions.tolist(),
        "predictions_sha256": result.predictions_sha256,
        "scores_sha256": result.scores_sha256,
    }
    if include_scores:
        answer["scores"] = result.scores.tolist()  # float32 -> float is exact; float32(x) recovers the bits
    answer.update(
        {
            "metadata": result.metadata,
            "timing": timing,
            "energy": outcome.energy,
        }
    )
    if outcome.energy is None:
        answer["energy_reason"] = outcome.energy_reason
    answer["device"] = result.metadata["device"]
    answer["versions"] = result.metadata["versions"]
    return answer


def task_npz(result: TaskResult) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, predictions=result.predictions.astype(np.int64), scores=result.scores.astype(np.float32))
    return buf.getvalue()


def run_timing(result: TaskResult) -> tuple[float, str]:
    """(ms, clock) of the learner's own run: CUDA events where present, else the host clock."""
    meta = result.metadata
    if meta.get("cuda_ms") is not None:
        return float(meta["cuda_ms"]), "cuda_events"
    return float(meta["training_prediction_seconds"]) * 1000.0, "perf_counter"


def outcome_of(exc: BaseException) -> str:
    """The /metrics outcome label of a failed request."""
    if isinstance(exc, ServiceError):
        return exc.outcome
    if isinstance(exc, ArchiveTooLargeError):
        return "too_large"
    if isinstance(exc, ArchiveError):
        return "bad_archive"
    if isinstance(exc, TrainingDivergedError):
        return "diverged"
    if isinstance(exc, BudgetExceeded):
        return "over_budget"
    if isinstance(exc, (TaskError, BackendUnavailable)):
        return "invalid"
    return "error"


def answer_npz(answer: dict) -> bytes:
    """A stored answer as npz: predictions (int64), and scores (float32) when the task kept them."""
    buf = io.BytesIO()
    arrays = {"predictions": np.asarray(answer["predictions"], dtype=np.int64)}
    if answer.get("scores") is not None:
        arrays["scores"] = np.asarray(answer["scores"], dtype=np.float32)
    np.savez(buf, **arrays)
    return buf.getvalue()


def predictions_npy(predictions: list[int]) -> bytes:
    """The .npy bytes ``np.save`` writes for the predictions (int64): its SHA-256 of the array
    equals the answer's predictions_sha256."""
    buf = io.BytesIO()
    np.save(buf, np.asarray(predictions, dtype=np.int64))
    return buf.getvalue()
