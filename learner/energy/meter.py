"""What the measurement code needs from a power meter, and one stamped counter reading.

``Meter`` is the interface every meter implements: the cumulative energy counter
(millijoules), instantaneous power, a little telemetry, the hardware's identity and a
monotonic clock. ``NvmlMeter`` (nvml_device.py) reads a real GPU; ``SimulatedMeter`` and
``SimulatedBoard`` (simulated.py) are scripted ones for machines without a GPU.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol


class Meter(Protocol):
    def energy_mj(self) -> int: ...

    def power_w(self) -> float: ...

    def telemetry(self) -> dict: ...

    def hardware(self) -> dict: ...

    def now(self) -> float: ...


@dataclasses.dataclass(frozen=True)
class Reading:
    """One counter reading, stamped at the midpoint of the clock reads around it."""

    energy_mj: int
    time_s: float
    query_latency_s: float

    def as_dict(self) -> dict:
        return {"energy_mj": self.energy_mj, "time_s": self.time_s, "query_latency_s": self.query_latency_s}


def read(meter: Meter) -> Reading:
    before = meter.now()
    energy = int(meter.energy_mj())
    after = meter.now()
    return Reading(energy, (before + after) / 2, after - before)
