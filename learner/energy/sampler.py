"""The power sampler: a separate process that polls the device's power every ``period_s``
(50 ms in the protocol) and stamps each reading with the clock its parent uses.

Why a process and not a thread: a sampler thread inside the measuring Python process waits for
the GIL while the process is busy, so its readings bunch up and miss the busy stretches (the
public MNIST energy challenge's duty-cycle simulation read 0.63x the true energy that way while
the counter read 1.00x). A process is scheduled on its own. Its clock is shared with the
parent's: on a real device both read ``time.perf_counter`` (on Linux CLOCK_MONOTONIC, one clock
for the whole machine); the parent checks this instead of assuming it, by bracketing the
child's first and last clock readings with its own (``clock`` and ``clock_end`` in
``SamplerProcess.record()``).

The child is ``python -m learner.energy.sampler '<json spec>'``; it is an internal helper of
``SamplerProcess`` (its lines are a machine protocol, not output for a user):

  child -> parent (stdout)               parent -> child (stdin)
  H <clock> <pid> <json description>    Q [<t>]                    stop (simulated: at time t)
  S <t> <watts> <query seconds>         G <t> <watts> <from> <to>  simulated board only: its
  E <t> <json message>                                             time, sensor reading and a
  W <t>   (simulated: wake me at t)                                sensor stall from..to
  B <clock> <count>   (last)

Sources: ``nvml`` opens the device by its NVML PCI bus id and checks its UUID, and reads power
with ``nvml_device.power_reader`` (the instantaneous field where the driver has it); it sleeps
in ``select`` on stdin, so a stop is seen at once. ``simulated`` reads the simulated board
(simulated.py) that lives in the parent: the board hands over its time and sensor state in
``G`` messages, and the child waits for them in lockstep with the board's simulated clock, so
a rehearsal takes no real time per simulated second. Faults of the sensor (a stall) act in
the child's read, where a real driver's stall would.

Not verified on hardware: the ``nvml`` source has not run against a real driver here (no GPU).
"""

from __future__ import annotations

import json
import math
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

SAMPLE_PERIOD_S = 0.05
START_TIMEOUT_S = 60.0  # the child imports numpy and opens NVML before its first line
ANSWER_TIMEOUT_S = 30.0  # a lockstep answer (simulated board) slower than this: the sampler is stuck
STOP_TIMEOUT_S = 15.0


def _num(x: float) -> str:
    return repr(float(x))  # repr round-trips a float exactly


# --------------------------------------------------------------------------- the child


class Stopped(Exception):
    """The parent asked the sampler to stop (or went away)."""


class _Lines:
    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def send(self, *parts: str) -> None:
        self.stream.write(" ".join(parts) + "\n")
        self.stream.flush()


class NvmlSource:
    """The real device, opened by the child itself (NVML handles do not cross processes)."""

    def __init__(self, spec: dict, control: TextIO) -> None:
        import pynvml as nv

        from .nvml_device import normalize_uuid, power_reader

        self.control = control
        nv.nvmlInit()
        self._nv = nv
        handle = nv.nvmlDeviceGetHandleByPciBusId(spec["nvml_pci_bus_id"])
        uuid = nv.nvmlDeviceGetUUID(handle)
        uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
        if spec.get("uuid") and normalize_uuid(uuid) != normalize_uuid(spec["uuid"]):
            raise RuntimeError(f"NVML device at {spec['nvml_pci_bus_id']} has UUID {uuid}, the parent's has {spec['uuid']}")
        self._read, how = power_reader(nv, handle)
        self.description = {"source": "nvml", "power_query": how, "uuid": uuid,
                            "nvml_pci_bus_id": spec["nvml_pci_bus_id"], "clock": "time.perf_counter"}

    def now(self) -> float:
        return time.perf_counter()

    def power_w(self) -> float:
        return self._read()

    def wait_until(self, t: float) -> bool:
        """Sleep until ``t`` on the clock; False as soon as the parent says stop (or closes stdin)."""
        while True:
            left = t - time.perf_counter()
            if left <= 0:
                return True
            ready, _, _ = select.select([self.control], [], [], left)
            if ready:
                line = self.control.readline()
                if not line or line.startswith("Q"):
                    return False

    def close(self) -> None:
        try:
            nv = self._nv
            nv.nvmlShutdown()
        except Exception:  # noqa: BLE001 - the process ends anyway
            pass


class SimulatedSource:
    """The simulated board's sensor, read through the board's messages (the board is in the parent)."""

    description = {"source": "simulated", "power_query": "the simulated board's power sensor",
                   "clock": "the simulated board's clock (every message from the board carries it)"}

    def __init__(self, spec: dict, control: TextIO, lines: _Lines) -> None:
        self.control, self.lines = control, lines
        self.t = math.nan
        self.sensor_w = math.nan
        self.stall = (math.inf, math.inf)
        if not self._receive():
            raise Stopped

    def _receive(self) -> bool:
        line = self.control.readline()
        if not line:
            return False
        parts = line.split()
        if parts[0] == "Q":
            if len(parts) > 1:
                self.t = float(parts[1])
            return False
        if parts[0] != "G" or len(parts) != 5:
            raise RuntimeError(f"unexpected message from the board: {line!r}")
        self.t, self.sensor_w = float(parts[1]), float(parts[2])
        self.stall = (float(parts[3]), float(parts[4]))
        return True

    def now(self) -> float:
        return self.t

    def wait_until(self, t: float) -> bool:
        self.lines.send("W", _num(t))
        return self._receive()

    def power_w(self) -> float:
        start, end = self.stall
        if start <= self.t < end:  # the sensor does not answer until the stall ends
            if not self.wait_until(end):
                raise Stopped
        return self.sensor_w

    def close(self) -> None:
        pass


def sample_loop(source: Any, period_s: float, lines: _Lines) -> int:
    """Read power every ``period_s`` on the source's clock until told to stop; returns the count."""
    lines.send("H", _num(source.now()), str(os.getpid()), json.dumps(source.description))
    count = 0
    due = source.now()
    while True:
        before = source.now()
        try:
            watts = source.power_w()
            t = source.now()
            lines.send("S", _num(t), _num(watts), _num(t - before))
            count += 1
        except Stopped:
            break
        except Exception as exc:  # noqa: BLE001 - one failed reading is recorded, the loop goes on
            lines.send("E", _num(source.now()), json.dumps(f"{type(exc).__name__}: {exc}"))
        due += period_s
        now = source.now()
        while due <= now:  # a slow read: keep the grid, skip the readings it missed
            due += period_s
        if not source.wait_until(due):
            break
    lines.send("B", _num(source.now()), str(count))
    return count


def _child(argv: list[str]) -> int:
    lines = _Lines(sys.stdout)
    spec = json.loads(argv[0])
    control = sys.stdin
    try:
        if spec["source"] == "nvml":
            source: Any = NvmlSource(spec, control)
        elif spec["source"] == "simulated":
            source = SimulatedSource(spec, control, lines)
        else:
            raise ValueError(f"unknown sampler source {spec['source']!r}")
    except Stopped:
        return 0
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which records it
        lines.send("E", _num(time.perf_counter()), json.dumps(f"sampler could not start: {type(exc).__name__}: {exc}"))
        return 3
    try:
        sample_loop(source, float(spec["period_s"]), lines)
    finally:
        source.close()
    return 0


# --------------------------------------------------------------------------- the parent's handle


def _package_root() -> str:
    return str(Path(__file__).resolve().parents[2])


class SamplerProcess:
    """Starts the sampler child, collects its lines on a reader thread, and (``lockstep``, the
    simulated board) answers its wake-up requests through ``serve``."""

    def __init__(self, spec: dict, clock: Callable[[], float]) -> None:
        self.spec = dict(spec)
        self.clock = clock
        self.samples: list[list[float]] = []
        self.errors: list[list[Any]] = []
        self.hello: dict | None = None
        self.bye: dict | None = None
        self.wake = math.inf  # the simulated time the child waits for (lockstep only)
        self.proc: subprocess.Popen | None = None
        self._answered = threading.Event()
        self._hello = threading.Event()
        self._closed = False
        self._clock_start: dict | None = None
        self._clock_end: dict | None = None
        self._stderr = tempfile.TemporaryFile(mode="w+")

    # ---------------------------------------------------------------- start and lines

    def start(self, first_message: str | None = None) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = _package_root() + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        before = self.clock()
        self._answered.clear()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "learner.energy.sampler", json.dumps(self.spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True, bufsize=1, env=env,
        )
        self._reader = threading.Thread(target=self._read, name="power-sampler-reader", daemon=True)
        self._reader.start()
        if first_message is not None:
            self.send(first_message)
        if not self._hello.wait(START_TIMEOUT_S):
            self._error(f"the sampler sent no first line within {START_TIMEOUT_S:.0f} s")
        after = self.clock()
        self._clock_start = {"parent_before": before, "sampler": None if self.hello is None else self.hello["clock"],
                             "parent_after": after}

    def send(self, message: str) -> bool:
        if self.proc is None or self.proc.stdin is None or self.proc.stdin.closed:
            return False
        try:
            self.proc.stdin.write(message + "\n")
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError, ValueError):
            return False

    def _error(self, message: str) -> None:
        self.errors.append([self.clock(), f"parent: {message}"])

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            kind, _, rest = line.rstrip("\n").partition(" ")
            try:
                if kind == "S":
                    t, w, q = (float(x) for x in rest.split(" "))
                    if not all(math.isfinite(x) for x in (t, w, q)):
                        raise ValueError("a reading that is not a finite number")
                    self.samples.append([t, w, q])
                elif kind == "W":
                    self.wake = float(rest)
                    self._answered.set()
                elif kind == "E":
                    t, message = rest.split(" ", 1)
                    self.errors.append([float(t), json.loads(message)])
                elif kind == "H":
                    clock, pid, description = rest.split(" ", 2)
                    self.hello = {"clock": float(clock), "pid": int(pid), "description": json.loads(description)}
                    self._hello.set()
                elif kind == "B":
                    clock, count = rest.split(" ")
                    self.bye = {"clock": float(clock), "count": int(count)}
                else:
                    raise ValueError("unknown line kind")
            except ValueError as exc:
                self._error(f"unreadable sampler line {line!r}: {exc}")
        self._closed = True
        self.wake = math.inf
        self._answered.set()
        self._hello.set()

    # ---------------------------------------------------------------- lockstep (simulated board)

    def wait_answer(self) -> None:
        """Block until the child has said when it wants to be woken next (or has ended)."""
        if not self._answered.wait(ANSWER_TIMEOUT_S):
            self._error(f"the sampler did not answer within {ANSWER_TIMEOUT_S:.0f} s; lockstep abandoned")
            self.wake = math.inf

    def serve(self, message: str) -> None:
        """Hand the child the board's state at its wake-up time and wait for its next request."""
        self._answered.clear()
        self.wake = math.nan  # unknown until the child answers
        if not self.send(message):
            self.wake = math.inf
            return
        self.wait_answer()
        if math.isnan(self.wake):
            self.wake = math.inf

    # ---------------------------------------------------------------- stop and record

    def stop(self, message: str = "Q") -> dict:
        before = self.clock()
        exit_code = None
        if self.proc is not None:
            self.send(message)
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                exit_code = self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._error(f"the sampler did not stop within {STOP_TIMEOUT_S:.0f} s; killed")
                self.proc.kill()
                exit_code = self.proc.wait()
            self._reader.join(STOP_TIMEOUT_S)
        after = self.clock()
        self._clock_end = {"parent_before": before, "sampler": None if self.bye is None else self.bye["clock"],
                           "parent_after": after}
        self._stderr.seek(0)
        stderr = self._stderr.read()[-4000:]
        self._stderr.close()
        if exit_code not in (0, None):
            self._error(f"the sampler exited with status {exit_code}")
        return self.record(exit_code, stderr)

    def record(self, exit_code: int | None = None, stderr: str = "") -> dict:
        return {
            "period_s": self.spec.get("period_s"),
            "spec": self.spec,
            "pid": None if self.proc is None else self.proc.pid,
            "description": None if self.hello is None else self.hello["description"],
            "clock": self._clock_start,
            "clock_end": self._clock_end,
            "samples": self.samples,
            "errors": self.errors,
            "bye": self.bye,
            "exit_code": exit_code,
            "stderr_tail": stderr,
        }


if __name__ == "__main__":  # the child: see the module docstring
    raise SystemExit(_child(sys.argv[1:]))
