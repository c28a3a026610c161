"""Simulated meters for machines without a GPU.

``SimulatedMeter``: a scripted counter and clock (power piecewise constant, the clock moves only
when told), for the paired-idle arithmetic's tests.

``SimulatedBoard``: a whole simulated device for rehearsing the gated protocol
(``rev88 measure --simulate SCENARIO``). Its clock is simulated (a rehearsal of minutes of
windows takes seconds), its power follows what runs on it (idle power that wanders a little,
learner runs, harness calls, reference matmuls, an intruding process), its energy counter
integrates that power in whole millijoules updated every 25 ms, and its power sensor is read by
the real sampler process (sampler.py, ``simulated`` source) in lockstep with the simulated
clock. It can keep its clocks up after work (``BoardModel.post_work_w``: a decaying post-work
power curve, integrated exactly; off in the default model, on in the ``warm-clocks`` scenario),
which is what the protocol's cold idle and slope-tested settles are rehearsed against. A scenario injects one fault where it would act on real hardware -- in the sensor, the
counter, the sampler's reads, the process list or the board's clocks -- and nowhere else: the
protocol and the gates run unchanged and have to find it.

The board's model is A100-like on purpose (60 W idle, the reference matmul at 19 TFLOP/s and
160 W above idle = 8.42 J per 10^12 FLOP), and its reference band (learner.measure.gates.SIMULATED_BAND) is the
simulator's own, defined for this model only; a real board other than the A100-SXM4-40GB and the
H200 has no band and its ``reference`` gate is ``unchecked``.

Nothing here is a measurement of hardware.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
from typing import Any

from .reference import N_DEVICE, TorchMatmulReference, matmul_flops
from .sampler import SAMPLE_PERIOD_S, SamplerProcess

SIMULATED_GPU = "rev88 simulated board"


class SimulatedMeter:
    """A scripted GPU: power is piecewise constant, the clock moves only when told.

    ``advance(seconds, power_w)`` lets ``seconds`` pass at ``power_w`` (default: the
    idle power); the counter integrates exactly and reads as whole millijoules,
    optionally only at multiples of ``update_period_s`` (as NVML's counter does).
    ``sleep`` is ``advance`` at idle power, for the protocol's settle/idle waits.
    """

    def __init__(
        self,
        idle_w: float = 60.0,
        start_mj: int = 1_000_000,
        start_s: float = 100.0,
        update_period_s: float = 0.0,
        hardware: dict | None = None,
    ) -> None:
        self.idle_w = idle_w
        self._t = float(start_s)
        self._energy_j = start_mj / 1000.0
        self._power_w = idle_w
        self.update_period_s = update_period_s
        self._updates: list[tuple[float, float]] = [(self._t, self._energy_j)]
        self._hardware = hardware or {
            "gpu": "simulated",
            "uuid": None,
            "total_memory_bytes": None,
            "power_limit_w": None,
            "driver": None,
            "cuda_pci_bus_id": None,
            "nvml_pci_bus_id": None,
            "nvml_handle_selected_by_cuda_pci_bus_id": False,
            "nvml_handle_selected_by": None,
        }

    def advance(self, seconds: float, power_w: float | None = None) -> None:
        if seconds < 0:
            raise ValueError("time cannot go backwards")
        self._power_w = self.idle_w if power_w is None else power_w
        self._energy_j += self._power_w * seconds
        self._t += seconds
        self._updates.append((self._t, self._energy_j))

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    @property
    def counter_update_s(self) -> float:
        """The counter's update period as the meter declares it (0: it follows every advance)."""
        return self.update_period_s

    counter_update_source = "declared by the simulated meter"

    def energy_mj(self) -> int:
        energy = self._energy_j
        if self.update_period_s > 0:  # the value at the last update tick at or before now
            # (the 1e-9 keeps a time that is a whole number of periods on its tick despite float division)
            tick = math.floor(self._t / self.update_period_s + 1e-9) * self.update_period_s
            energy = self._energy_at(tick)
        return int(round(energy * 1000.0))

    def _energy_at(self, t: float) -> float:
        prev_t, prev_e = self._updates[0]
        for ut, ue in self._updates[1:]:
            if ut > t:
                rate = (ue - prev_e) / (ut - prev_t) if ut > prev_t else 0.0
                return prev_e + rate * (t - prev_t)
            prev_t, prev_e = ut, ue
        return prev_e

    def power_w(self) -> float:
        return self._power_w

    def telemetry(self) -> dict:
        return {"temperature_c": None, "power_w": self._power_w, "graphics_clock_mhz": None, "memory_clock_mhz": None}

    def hardware(self) -> dict:
        return dict(self._hardware)

    def now(self) -> float:
        return self._t



# --------------------------------------------------------------------------- the simulated board


@dataclasses.dataclass(frozen=True)
class BoardModel:
    """What the simulated board does when nothing is wrong with it."""

    idle_w: float = 60.0
    idle_noise_w: float = 0.5  # idle power is idle_w + a uniform draw in +-this, redrawn every step
    idle_noise_step_s: float = 0.25
    counter_period_s: float = 0.025  # the energy counter's value moves at these ticks only
    task_s: float = 0.2  # one learner run (charged after the real run on the CPU)
    task_extra_w: float = 30.0
    harness_s: float = 0.002  # one harness call without the learner
    harness_extra_w: float = 1.0
    matmul_flops_per_s: float = 19.0e12
    matmul_extra_w: float = 160.0
    matmul_computed_n: int = 64  # the product actually computed (on the CPU) and checked per call
    graphics_clock_mhz: int = 1410
    # After work the clocks stay up: the board then draws up to post_work_w above idle (never more
    # than the work itself drew above idle), decaying with time constant post_work_tau_s, its
    # graphics clock coming down from graphics_clock_mhz to idle_graphics_clock_mhz with it.
    # Off (0 W) in the default model; tests and the warm-clocks scenario turn it on.
    post_work_w: float = 0.0
    post_work_tau_s: float = 1.0
    idle_graphics_clock_mhz: int = 210


@dataclasses.dataclass(frozen=True)
class Faults:
    """One scenario's fault. Phase-triggered faults start when the protocol enters that phase."""

    sensor_scale: float = 1.0  # the power sensor (counter and samples alike) reads this fraction
    counter_drift_w: float = 0.0  # the counter gains this many watts that the sensor does not see
    idle_noise_w: float | None = None  # replaces BoardModel.idle_noise_w
    sampler_stall: tuple[str, float, float] | None = None  # (phase, after s, for s): sensor reads block
    intruder: tuple[str, int, float] | None = None  # (phase, pid, extra W): another compute process
    throttle: tuple[str, float, float] | None = None  # (phase, speed factor, power-above-idle factor)
    post_work: tuple[float, float] | None = None  # (W, tau s): replaces the model's post-work curve


@dataclasses.dataclass(frozen=True)
class Scenario:
    faults: Faults
    what: str
    gate: str | None  # the gate meant to catch it


SCENARIOS: dict[str, Scenario] = {
    "healthy": Scenario(Faults(), "nothing wrong: small idle wander only", None),
    "half-scale": Scenario(Faults(sensor_scale=0.5), "the power sensor reads half (counter and samples alike)",
                           "reference"),
    "counter-drift": Scenario(Faults(counter_drift_w=8.0),
                              "the energy counter gains 8 W the power samples do not show", "meters_agree"),
    "gaps": Scenario(Faults(sampler_stall=("trial 0", 0.3, 0.8)),
                     "the sampler's power reads stall for 0.8 s in the first trial", "telemetry"),
    "intruder": Scenario(Faults(intruder=("trial 0", 424242, 20.0)),
                         "another compute process (pid 424242, +20 W) appears in the first trial and stays",
                         "exclusive_gpu"),
    "noisy-idle": Scenario(Faults(idle_noise_w=25.0),
                           "idle power wanders by +-25 W every 0.25 s, so the baseline is uncertain", "sham_residual"),
    "throttle": Scenario(Faults(throttle=("reference_after", 0.6, 0.75)),
                         "the board's clocks drop to 60 % for the second reference window", "reference"),
    "warm-clocks": Scenario(Faults(post_work=(40.0, 1.5)),
                            "after work the clocks stay up: up to 40 W above idle, decaying with a 1.5 s time "
                            "constant, so an idle window that starts too soon reads warm", "sham_residual"),
}


class _NullOutput:
    cuda_ms = None


class SimulatedTaskEngine:
    """A real CPU backend whose every run is also charged to the board (time and power)."""

    def __init__(self, inner: Any, board: SimulatedBoard) -> None:
        self.inner, self.board = inner, board
        self.name = f"simulated({inner.name})"
        self.device = "cpu"

    def describe(self) -> dict:
        return {**self.inner.describe(), "simulated_board": True}

    def run(self, task, prepared):
        out = self.inner.run(task, prepared)
        self.board.work(self.board.model.task_s, self.board.model.task_extra_w)
        return out


class SimulatedHarnessEngine:
    """The harness's per-call work without the learner, charged to the board."""

    name = "harness-null"
    device = "cpu"

    def __init__(self, board: SimulatedBoard) -> None:
        self.board = board

    def describe(self) -> dict:
        return {"backend": self.name}

    def run(self, task, prepared):
        self.board.work(self.board.model.harness_s, self.board.model.harness_extra_w)
        return _NullOutput()


class SimulatedReference:
    """The reference matmul on the simulated board: a real n = 64 fp32 product on the CPU (checked
    as on a device), charged to the board as the 4096 x 4096 one at the board's speed and power."""

    def __init__(self, board: SimulatedBoard) -> None:
        self.board = board
        self.inner = TorchMatmulReference("cpu", n=board.model.matmul_computed_n)
        self.flops_per_call = matmul_flops(N_DEVICE)

    def prepare(self) -> None:
        self.inner.prepare()

    def run(self, calls: int) -> None:
        self.inner.run(calls)
        board = self.board
        seconds = calls * self.flops_per_call / (board.model.matmul_flops_per_s * board.speed)
        board.work(seconds, board.model.matmul_extra_w * board.matmul_power)

    def check(self) -> dict:
        return self.inner.check()

    def describe(self) -> dict:
        return {**self.inner.describe(), "modeled_n": N_DEVICE, "flops_per_call": self.flops_per_call,
                "computed_n": self.inner.n, "note": "simulated: the product checked is the n = 64 one computed on "
                "the CPU; time and energy are the board's model of the 4096 x 4096 one"}


class SimulatedBoard:
    """A simulated GPU: the Meter interface plus what the gated protocol needs of a board
    (sleep, a sampler process, a reference kernel, task and harness engines, process checks,
    phase marks). See the module docstring."""

    kind = "simulated"

    def __init__(self, scenario: str = "healthy", seed: int = 0, model: BoardModel | None = None,
                 start_s: float = 1000.0, start_mj: int = 5_000_000_000) -> None:
        if scenario not in SCENARIOS:
            raise ValueError(f"unknown scenario {scenario!r}; choose one of {', '.join(SCENARIOS)}")
        self.scenario = scenario
        self.faults = SCENARIOS[scenario].faults
        self.model = model or BoardModel()
        self.seed = seed
        self._t = float(start_s)
        self._counter_j = start_mj / 1000.0
        self._counter_shown_j = self._counter_j
        self._tick = math.floor(self._t / self.model.counter_period_s) + 1  # index of the next counter tick
        self._noise_step = math.floor(self._t / self.model.idle_noise_step_s)
        self._noise_amplitude = self.model.idle_noise_w if self.faults.idle_noise_w is None else self.faults.idle_noise_w
        self._noise_w = self._draw_noise(self._noise_step)
        self._extra_w = 0.0
        tail = self.faults.post_work or (self.model.post_work_w, self.model.post_work_tau_s)
        self._tail_w, self._tail_tau_s = float(tail[0]), float(tail[1])
        if self._tail_w > 0 and not self._tail_tau_s > 0:
            raise ValueError(f"the post-work time constant must be > 0 s, got {self._tail_tau_s!r}")
        self._warm_w = 0.0  # the post-work power above idle when the last work ended (0: cold)
        self._warm_since = self._t
        self.speed = 1.0  # matmul speed factor (throttle)
        self.matmul_power = 1.0  # matmul power-above-idle factor (throttle)
        self._intruder: tuple[int, float] | None = None
        self._stall = (math.inf, math.inf)
        self._sampler: SamplerProcess | None = None
        self.phases: list[tuple[str, float]] = []
        self._own_pid = os.getpid()

    # ---------------------------------------------------------------- physics

    def _draw_noise(self, step: int) -> float:
        if self._noise_amplitude == 0:
            return 0.0
        return random.Random(self.seed * 1_000_003 + step).uniform(-self._noise_amplitude, self._noise_amplitude)

    def _warm_at(self, t: float) -> float:
        """The post-work power above idle at ``t`` (while idle; during work the work's own draw counts)."""
        if self._warm_w == 0.0 or self._extra_w > 0:
            return 0.0
        return self._warm_w * math.exp(-(t - self._warm_since) / self._tail_tau_s)

    def _warm_j(self, t0: float, t1: float) -> float:
        """The post-work curve's joules over [t0, t1] while idle (its exact integral)."""
        if self._warm_w == 0.0 or self._extra_w > 0:
            return 0.0
        tau = self._tail_tau_s
        return self._warm_w * tau * (math.exp(-(t0 - self._warm_since) / tau) - math.exp(-(t1 - self._warm_since) / tau))

    def true_power_w(self) -> float:
        intruder = self._intruder[1] if self._intruder else 0.0
        return self.model.idle_w + self._noise_w + self._extra_w + intruder + self._warm_at(self._t)

    def _advance(self, seconds: float, extra_w: float) -> None:
        if seconds < 0 or not math.isfinite(seconds):
            raise ValueError(f"time cannot go backwards or jump to infinity ({seconds!r} s)")
        if extra_w > 0 and self._tail_w > 0:  # work: the clocks go up; the curve restarts when it ends
            warm_now = 0.0 if self._extra_w > 0 else self._warm_at(self._t)
            self._extra_w = extra_w
            self._warm_w = max(warm_now, min(self._tail_w, extra_w))
        self._extra_w = extra_w
        end = self._t + seconds
        period, step = self.model.counter_period_s, self.model.idle_noise_step_s
        while True:
            sampler = self._sampler
            if sampler is not None and sampler.wake <= self._t:
                sampler.serve(f"G {self._t!r} {self.power_w()!r} {self._stall[0]!r} {self._stall[1]!r}")
                continue
            if self._t >= end:
                break
            wake = sampler.wake if sampler is not None else math.inf
            until = min(end, wake, self._tick * period, (self._noise_step + 1) * step)
            rate = (self.true_power_w() - self._warm_at(self._t)) * self.faults.sensor_scale + self.faults.counter_drift_w
            self._counter_j += rate * (until - self._t) + self._warm_j(self._t, until) * self.faults.sensor_scale
            self._t = until
            while self._t >= self._tick * period:
                self._counter_shown_j = self._counter_j
                self._tick += 1
            while self._t >= (self._noise_step + 1) * step:
                self._noise_step += 1
                self._noise_w = self._draw_noise(self._noise_step)
        if extra_w > 0 and self._tail_w > 0:
            self._warm_since = self._t  # the work ended now: the post-work curve starts here

    def work(self, seconds: float, extra_w: float) -> None:
        """``seconds`` of work drawing ``extra_w`` above idle."""
        self._advance(seconds, extra_w)

    def sleep(self, seconds: float) -> None:
        self._advance(seconds, 0.0)

    # ---------------------------------------------------------------- the Meter interface

    @property
    def meter(self) -> SimulatedBoard:
        """The board is its own meter."""
        return self

    def now(self) -> float:
        return self._t

    def energy_mj(self) -> int:
        return int(round(self._counter_shown_j * 1000.0))

    def power_w(self) -> float:
        return self.true_power_w() * self.faults.sensor_scale

    def telemetry(self) -> dict:
        clock = self.model.graphics_clock_mhz
        if self._extra_w == 0 and self._tail_w > 0:  # idle: the clock comes down with the post-work curve
            low = self.model.idle_graphics_clock_mhz
            clock = low + (clock - low) * (self._warm_at(self._t) / self._tail_w)
        return {"temperature_c": None, "power_w": self.power_w(),
                "graphics_clock_mhz": round(clock * self.speed), "memory_clock_mhz": None}

    def hardware(self) -> dict:
        return {
            "gpu": SIMULATED_GPU, "uuid": None, "total_memory_bytes": None, "power_limit_w": None, "driver": None,
            "cuda_pci_bus_id": None, "nvml_pci_bus_id": None, "nvml_handle_selected_by_cuda_pci_bus_id": False,
            "nvml_handle_selected_by": "simulated", "simulated": True, "scenario": self.scenario,
        }

    def compute_processes(self) -> list[int]:
        return [self._own_pid] + ([self._intruder[0]] if self._intruder else [])

    # ---------------------------------------------------------------- what the protocol needs of a board

    def own_pid(self) -> int:
        return self._own_pid

    def phase(self, name: str) -> None:
        """The protocol enters phase ``name``: phase-triggered faults start here."""
        self.phases.append((name, self._t))
        f = self.faults
        if f.sampler_stall and f.sampler_stall[0] == name:
            start = self._t + f.sampler_stall[1]
            self._stall = (start, start + f.sampler_stall[2])
        if f.intruder and f.intruder[0] == name:
            self._intruder = (f.intruder[1], f.intruder[2])
        if f.throttle and f.throttle[0] == name:
            self.speed, self.matmul_power = f.throttle[1], f.throttle[2]

    def task_engine(self, engine: Any) -> SimulatedTaskEngine:
        return SimulatedTaskEngine(engine, self)

    def harness_engine(self, engine: Any) -> SimulatedHarnessEngine:
        return SimulatedHarnessEngine(self)

    def reference_kernel(self) -> SimulatedReference:
        return SimulatedReference(self)

    def start_sampler(self, period_s: float = SAMPLE_PERIOD_S) -> SamplerProcess:
        sampler = SamplerProcess({"source": "simulated", "period_s": period_s}, self.now)
        sampler.start(f"G {self._t!r} {self.power_w()!r} {self._stall[0]!r} {self._stall[1]!r}")
        sampler.wait_answer()
        self._sampler = sampler
        return sampler

    def stop_sampler(self, sampler: SamplerProcess) -> dict:
        self._sampler = None
        return sampler.stop(f"Q {self._t!r}")

    def describe(self) -> dict:
        s = SCENARIOS[self.scenario]
        return {"kind": self.kind, "gpu": SIMULATED_GPU, "scenario": self.scenario, "scenario_fault": s.what,
                "gate_meant_to_catch_it": s.gate, "seed": self.seed, "model": dataclasses.asdict(self.model),
                "faults": dataclasses.asdict(s.faults),
                "note": "a simulated board on the CPU: its joules and seconds are the model's, not hardware's"}
