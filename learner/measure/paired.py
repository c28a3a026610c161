"""Joules and milliseconds per task, measured the way the reference record did.

The paired-idle protocol (the record's ``energy`` object, same field names):

0. With a meter: the cold idle -- one idle window before any work, its telemetry (power,
   clocks) before and after (``energy.cold_idle``; recorded beside the paired idle, never
   subtracted: learner/measure/idle.py).
1. Run the task once (prepare + first run; on CUDA this captures the graphs and
   is where the ``memory`` peak is taken), keeping its hashes as "before".
2. Calibrate: time one more complete fresh task (CUDA events on GPU, the clock
   elsewhere). repeats = clamp(ceil(target / calibration), 1, 1000).
3. Per trial: settle, idle window, telemetry, active window of ``repeats``
   complete fresh tasks, telemetry, settle, idle window. A settle ends when the power
   stops falling (idle.settle: a slope test), at most ``settle_seconds``.
   paired idle W  = mean of the two idle windows' average power
   idle-adjusted  = (active J - paired idle W x active s) / repeats, in mJ per task
                    (None, with ``idle_adjusted_reason``, where that is not above zero or the
                    active window's counter did not advance)
   unadjusted     = active J / repeats, in mJ per task (None where the counter did not advance)
   wall ms/task   = active s / repeats; cuda ms/task = summed CUDA-event time / repeats
4. Run the task again ("after"): predictions and state hashes must be identical.

Summary: mean and sample SD over the trials. The arithmetic is pure functions
over raw readings (``window``, ``trial_figures``, ``summarize``,
``repeats_for``), checked in tests/test_energy.py against the record's own
readings.

Without an energy meter (the cpu backend, or no NVML) the same runs give timing
statistics per task (median, mean, sample SD, min, max), ``energy: null`` and
the reason; settle and idle waits are skipped (there is nothing to measure in
them). Where RAPL is readable the CPU package energy is added, labelled as such.

The gated protocol (two meters, reference windows, a sham, a harness control and gates:
learner/measure/gated.py, docs/energy.md) builds on these functions and on the runs here
(``first_run``, ``Runner``, ``cuda_device``, ``energy_note``); ``rev88 measure``
(rev88/cli/measure.py) runs it.

Not verified on the development machine (no GPU): the CUDA paths (CUDA-event
calibration, memory peaks, NVML readings); scripts/gpu_check_energy.py runs them.
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .. import energy as energy_mod
from ..backends import Backend, get_backend
from ..config import Config
from ..errors import TaskError
from ..result import TaskResult, run_task
from ..taskio import TaskArrays
from ..train import prepare
from . import idle as idle_mod

MIN_REPEATS, MAX_REPEATS = 1, 1000
STATE_HASH_KEYS = (
    "input_hashes",
    "epoch_permutation_sha256",
    "initial_parameter_sha256",
    "final_parameter_sha256",
    "final_velocity_sha256",
    "state_vector_sha256",
    "predictions_sha256",
    "scores_sha256",
)
SCOPE = (
    "Every task resets weights and momentum, normalizes raw 9x9 inputs, trains from scratch and "
    "predicts all queries; every invocation is included. One invocation is backend.run(task, prepared) "
    "with the seed-derived initialization and permutations prepared once: on cuda it copies the task "
    "into the cached graph program's buffers, replays the graphs and copies scores and state back, "
    "so the active window (energy, wall ms) includes those transfers and synchronizations while "
    "cuda_ms covers the GPU-resident run only. Excludes graph capture and allocation (done by the "
    "first run), host preparation, verification, hashing and serialization."
)
MEMORY_SCOPE = (
    "PyTorch caching allocator on the backend's device, including CUDA graph pools and library "
    "workspaces; over prepare + the first run of this task on this backend, before any hashing or "
    "serialization. Excludes the driver and context. If this backend had already cached the "
    "task's program (program_reused), the peak covers a replay, not the capture."
)


class ProtocolError(TaskError):
    """A measurement argument out of range."""


def check_protocol(trials: int, target_seconds: float, settle_seconds: float, idle_seconds: float) -> None:
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise ProtocolError(f"trials must be an integer >= 1, got {trials!r}")
    for name, value, positive in (
        ("target_seconds", target_seconds, True),
        ("settle_seconds", settle_seconds, False),
        ("idle_seconds", idle_seconds, False),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ProtocolError(f"{name} must be a finite number, got {value!r}")
        if positive and value <= 0:
            raise ProtocolError(f"{name} must be > 0, got {value}")
        if value < 0:
            raise ProtocolError(f"{name} must be >= 0, got {value}")


# --------------------------------------------------------------------------- pure arithmetic


def repeats_for(calibration_ms: float, target_seconds: float) -> int:
    """clamp(ceil(target / calibration), 1, 1000)."""
    if calibration_ms <= 0:
        return MAX_REPEATS
    return max(MIN_REPEATS, min(MAX_REPEATS, math.ceil(target_seconds / (calibration_ms / 1000.0))))


def _reading(r: energy_mod.Reading | dict) -> dict:
    return r.as_dict() if isinstance(r, energy_mod.Reading) else dict(r)


def window(start: energy_mod.Reading | dict, end: energy_mod.Reading | dict, settle_seconds: float | None = None) -> dict:
    """Duration, joules and average power between two counter readings. A window whose counter
    did not advance (or went backwards) has no average power: 0 J there is below the counter's
    resolution, not a reading."""
    s, e = _reading(start), _reading(end)
    duration = e["time_s"] - s["time_s"]
    energy_j = (e["energy_mj"] - s["energy_mj"]) / 1000
    out = {
        "start": s,
        "end": e,
        "duration_s": duration,
        "energy_j": energy_j,
        "average_power_w": energy_j / duration if duration > 0 and energy_j > 0 else None,
    }
    if settle_seconds is not None:
        out["settle_seconds"] = settle_seconds
    return out


def trial_figures(idle_before: dict, active: dict, idle_after: dict, invocations: int, cuda_ms_total: float | None) -> dict:
    """Per-task figures of one trial from its three windows (as ``window`` returns them).

    Never a negative or a zero-by-quantization energy: an active window whose counter did not
    advance has no figure (and no idle is subtracted from it), and an idle-adjusted figure that
    would not be above zero is ``None``; ``idle_adjusted_reason`` says why."""
    p0, p1 = idle_before["average_power_w"], idle_after["average_power_w"]
    paired = None if p0 is None or p1 is None else (p0 + p1) / 2
    active_j, active_s = active["energy_j"], active["duration_s"]
    unadjusted = active_j * 1000 / invocations if active_j > 0 else None
    adjusted, reason = None, None
    if unadjusted is None:
        reason = (f"the active window's counter read {active_j} J: below its resolution (or the counter went back), "
                  "so no figure and no idle subtracted from it")
    elif paired is None:
        reason = "no paired idle power: an idle window's counter did not advance"
    else:
        above = (active_j - paired * active_s) * 1000 / invocations
        if above > 0:
            adjusted = above
        else:
            reason = (f"the active window's {active_j / active_s:.2f} W is not above the paired idle {paired:.2f} W: "
                      "the energy above idle is below what the windows resolve; no figure rather than a negative one")
    return {
        "paired_idle_w": paired,
        "idle_adjusted_mj_per_task": adjusted,
        "idle_adjusted_reason": reason,
        "unadjusted_mj_per_task": unadjusted,
        "cuda_ms_per_task": None if cuda_ms_total is None else cuda_ms_total / invocations,
        "wall_ms_per_task": active_s * 1000 / invocations,
    }


def summarize(values: list[float | None]) -> dict | None:
    """Mean and sample SD (None for a single value) over trials; None if no trial had a value."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    return {
        "mean": statistics.mean(present),
        "sample_sd": statistics.stdev(present) if len(present) > 1 else None,
        "values": list(values),
    }


def timing_stats(values_ms: list[float]) -> dict | None:
    if not values_ms:
        return None
    return {
        "count": len(values_ms),
        "median": statistics.median(values_ms),
        "mean": statistics.mean(values_ms),
        "sample_sd": statistics.stdev(values_ms) if len(values_ms) > 1 else None,
        "min": min(values_ms),
        "max": max(values_ms),
    }


SUMMARY_KEYS = ("idle_adjusted_mj_per_task", "unadjusted_mj_per_task", "cuda_ms_per_task", "wall_ms_per_task")


def summary(trials: list[dict]) -> dict:
    return {key: summarize([t[key] for t in trials]) for key in SUMMARY_KEYS}


def cold_idle_figures(cold: dict | None, trials: list[dict]) -> dict | None:
    """The cold idle window's power and clocks, and each trial's paired idle against it."""
    if cold is None:
        return None
    w = window(cold["start"], cold["end"])
    before, after = cold.get("telemetry_before") or {}, cold.get("telemetry_after") or {}
    cold_w = w["average_power_w"]
    return {
        "window": w,
        "counter_w": cold_w,
        "telemetry_before": before,
        "telemetry_after": after,
        "graphics_clock_mhz": [before.get("graphics_clock_mhz"), after.get("graphics_clock_mhz")],
        "paired_idle_minus_cold_w": [None if cold_w is None or t.get("paired_idle_w") is None
                                     else t["paired_idle_w"] - cold_w for t in trials],
        "note": "power and clocks in one idle window before the protocol's first work: cold only if nothing ran "
                "on the device just before (its clocks show it); recorded beside the paired idle, not subtracted",
    }


# --------------------------------------------------------------------------- facts


def software() -> dict:
    try:
        nvml_version = importlib.metadata.version("nvidia-ml-py")
    except importlib.metadata.PackageNotFoundError:
        nvml_version = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "cuda": torch.version.cuda,
        "nvidia_ml_py": nvml_version,
    }


def cpu_hardware() -> dict:
    return {
        "cpu": platform.processor() or platform.machine(),
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }


def cuda_device(engine: Backend) -> torch.device | None:
    """The CUDA device the backend runs on; None for one that does not run on CUDA."""
    device = torch.device(engine.device)
    return device if device.type == "cuda" else None


def compare_runs(before: TaskResult, after: TaskResult) -> dict:
    return {
        "repeat_predictions_equal": bool(np.array_equal(before.predictions, after.predictions))
        and before.predictions_sha256 == after.predictions_sha256,
        "repeat_state_hashes_equal": all(before.metadata[k] == after.metadata[k] for k in STATE_HASH_KEYS),
        "state_hash_keys_checked": list(STATE_HASH_KEYS),
    }


# --------------------------------------------------------------------------- running


def first_run(task: TaskArrays, config: Config, engine: Backend) -> tuple[TaskResult, dict | None, str | None]:
    """prepare + the first run, with the allocator's peak on CUDA."""
    device = cuda_device(engine)
    if device is None:
        return run_task(task, config, engine), None, f"backend {engine.name!r} does not run on CUDA"
    torch.cuda.synchronize(device)
    allocated_before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = run_task(task, config, engine)
    torch.cuda.synchronize(device)
    memory = {
        "allocated_before_prepare_bytes": int(allocated_before),
        "prepare_and_invoke_peak_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
        "allocated_after_invoke_bytes": int(torch.cuda.memory_allocated(device)),
        "reserved_after_invoke_bytes": int(torch.cuda.memory_reserved(device)),
        "program_reused": (result.metadata.get("backend_details") or {}).get("graph_reused"),
        "scope": MEMORY_SCOPE,
    }
    return result, memory, None


class Runner:
    """``repeats`` complete fresh tasks back to back, each timed by ``clock``."""

    def __init__(self, task: TaskArrays, config: Config, engine: Backend, clock: Callable[[], float]):
        self.task, self.engine, self.clock = task, engine, clock
        self.prepared = prepare(task, config)
        self.device = cuda_device(engine)

    def once(self) -> tuple[float, float | None]:
        """(wall ms, cuda ms or None) of one task."""
        t0 = self.clock()
        out = self.engine.run(self.task, self.prepared)
        if self.device is not None:
            torch.cuda.synchronize(self.device)
        return (self.clock() - t0) * 1000, out.cuda_ms

    def repeat(self, n: int) -> tuple[list[float], list[float] | None]:
        """Wall ms of each task, and CUDA ms of each (None if the backend gives none)."""
        walls, cudas = [], []
        for _ in range(n):
            wall, cuda = self.once()
            walls.append(wall)
            cudas.append(cuda)
        return walls, (None if any(c is None for c in cudas) else cudas)


def _idle_window(meter: energy_mod.Meter, settle: float, idle: float, sleep: Callable[[float], None]) -> dict:
    """A settle (until the power stops falling, at most ``settle`` s: idle.settle), then an idle window."""
    waited = idle_mod.settle(meter, settle, sleep)
    s = energy_mod.read(meter)
    sleep(idle)
    out = window(s, energy_mod.read(meter), waited["seconds"])
    out["settle"] = waited
    return out


def _energy_trial(i: int, runner: Runner, meter: energy_mod.Meter, repeats: int, settle: float, idle: float,
                  sleep: Callable[[float], None]) -> tuple[dict, list[float], list[float] | None]:
    read = energy_mod.read
    idle_before = _idle_window(meter, settle, idle, sleep)
    telemetry_before = meter.telemetry()
    a0 = read(meter)
    walls, cudas = runner.repeat(repeats)
    active = window(a0, read(meter))
    telemetry_after = meter.telemetry()
    idle_after = _idle_window(meter, settle, idle, sleep)
    trial = {
        "trial": i,
        "invocations": repeats,
        "idle_before": idle_before,
        "idle_after": idle_after,
        "active": active,
        "telemetry_before": telemetry_before,
        "telemetry_after": telemetry_after,
        **trial_figures(idle_before, active, idle_after, repeats, None if cudas is None else sum(cudas)),
    }
    return trial, walls, cudas


PAIRED_COUNTER_NOTE = (
    "NVML's total-energy counter (mJ) moves only at its updates (on the H200 less often than every 65.7 ms), so a "
    "window's edges err by up to one update's energy each; a window whose counter did not advance has no figure."
)


def energy_note(trials: list[dict], idle_seconds: float) -> str:
    """The counter's note of a record: its resolution, and a warning where windows are short."""
    note = PAIRED_COUNTER_NOTE
    shortest = min(t["active"]["duration_s"] for t in trials)
    if shortest < 1.0 or idle_seconds < 1.0:
        note += (
            f" Warning: the shortest active window is {shortest:.3f} s and idle windows are {idle_seconds} s;"
            " windows under about a second carry counter-step error of several percent."
        )
    return note


def measure_run(
    task: TaskArrays,
    config: Config | None = None,
    backend: str | Backend = "auto",
    trials: int = 3,
    target_seconds: float = 5.0,
    settle_seconds: float = 3.0,
    idle_seconds: float = 3.0,
    meter: energy_mod.Meter | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[TaskResult, dict]:
    """The protocol; returns the "before" run's result and the measurement document."""
    check_protocol(trials, target_seconds, settle_seconds, idle_seconds)
    config = config or Config()
    engine = get_backend(backend) if isinstance(backend, str) else backend
    device = cuda_device(engine)
    energy_reason = None
    if meter is None:
        if device is not None:
            meter, energy_reason = energy_mod.open_meter(device.index)
        else:
            energy_reason = (
                f"backend {engine.name!r} runs on the CPU; the GPU energy counter (NVML) measures GPUs only"
            )
    clock = meter.now if meter is not None else time.perf_counter

    cold = idle_mod.cold_idle(meter, idle_seconds, sleep) if meter is not None else None
    before, memory, memory_reason = first_run(task, config, engine)
    runner = Runner(task, config, engine, clock)
    calibration_wall_ms, calibration_cuda_ms = runner.once()
    calibration_ms = calibration_cuda_ms if calibration_cuda_ms is not None else calibration_wall_ms
    repeats = repeats_for(calibration_ms, target_seconds)

    trial_docs: list[dict] = []
    walls_all: list[float] = []
    cuda_all: list[float] = []
    rapl, rapl_reason = (None, None) if meter is not None else energy_mod.rapl_packages()
    rapl_j: list[float] = []
    for i in range(trials):
        if meter is not None:
            trial, walls, cudas = _energy_trial(i, runner, meter, repeats, settle_seconds, idle_seconds, sleep)
        else:
            r0 = energy_mod.rapl_read(rapl) if rapl else None
            walls, cudas = runner.repeat(repeats)
            if rapl:
                rapl_j.append(energy_mod.rapl_delta_j(rapl, r0, energy_mod.rapl_read(rapl)))
            trial = {
                "trial": i,
                "invocations": repeats,
                "wall_ms_per_task": sum(walls) / repeats,
                "cuda_ms_per_task": None if cudas is None else sum(cudas) / repeats,
            }
        trial_docs.append(trial)
        walls_all.extend(walls)
        if cudas is not None:
            cuda_all.extend(cudas)

    after = run_task(task, config, engine)
    checks = compare_runs(before, after)
    soft = software()
    hardware = meter.hardware() if meter is not None else cpu_hardware()

    energy = None
    if meter is not None:
        energy = {
            "calibration_ms": calibration_ms,
            "repeats_per_trial": repeats,
            "trials": trial_docs,
            "summary": summary(trial_docs),
            "hardware": hardware,
            "software": soft,
            **checks,
            "scope": SCOPE,
            "method": "nvml-total-energy-counter; baseline: paired idle (the mean of the idle windows before and "
                      "after each active window, each after a settle that ends when the power stops falling, at most "
                      f"{settle_seconds} s); cold idle (before any work) recorded beside it (cold_idle), not subtracted",
            "cold_idle": cold_idle_figures(cold, trial_docs),
            "settle": idle_mod.SETTLE_PLAN,
            "counter_note": energy_note(trial_docs, idle_seconds),
            "before_metadata": before.metadata,
            "after_metadata": after.metadata,
        }
    doc: dict[str, Any] = {
        "backend": engine.name,
        "device": engine.device,
        "protocol": {
            "trials": trials,
            "target_seconds": target_seconds,
            "settle_seconds": settle_seconds if meter is not None else None,
            "idle_seconds": idle_seconds if meter is not None else None,
            "repeat_limits": [MIN_REPEATS, MAX_REPEATS],
            "calibration": "CUDA events" if calibration_cuda_ms is not None else "wall clock",
        },
        "calibration_ms": calibration_ms,
        "repeats_per_trial": repeats,
        "energy": energy,
    }
    if energy is None:
        doc["energy_reason"] = energy_reason
        doc["trials"] = trial_docs
    doc["timing"] = {
        "wall_ms_per_task": timing_stats(walls_all),
        "cuda_ms_per_task": timing_stats(cuda_all),
        "scope": "each invocation timed on its own; " + SCOPE,
    }
    if energy is None:
        if rapl:
            doc["cpu_package_energy"] = {
                "label": energy_mod.RAPL_LABEL,
                "joules_by_trial": rapl_j,
                "mj_per_task": summarize([j * 1000 / repeats for j in rapl_j]),
            }
        else:
            doc["cpu_package_energy"] = None
            doc["cpu_package_energy_reason"] = rapl_reason or "RAPL is read only when no GPU meter is used"
    doc["memory"] = memory
    if memory is None:
        doc["memory_reason"] = memory_reason
    doc.update(
        {
            "predictions_sha256": before.predictions_sha256,
            "scores_sha256": before.scores_sha256,
            **checks,
            "hardware": hardware,
            "software": soft,
            "metadata": before.metadata,
        }
    )
    return before, doc


def measure_task(
    task: TaskArrays,
    config: Config | None = None,
    backend: str | Backend = "auto",
    trials: int = 3,
    target_seconds: float = 5.0,
    settle_seconds: float = 3.0,
    idle_seconds: float = 3.0,
    meter: energy_mod.Meter | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> dict:
    """The measurement document (see ``measure_run``)."""
    return measure_run(task, config, backend, trials, target_seconds, settle_seconds, idle_seconds, meter, sleep)[1]
