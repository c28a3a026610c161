"""How finely the energy counter resolves a window: its update period, watched or declared.

NVML's total-energy counter (millijoules) is not updated continuously: its value moves at the
board's update ticks only. Read twice around a window shorter than one update, it can read 0
(no tick inside) or one whole update's energy (a tick inside, but the update covers time outside
the window): neither is the window's energy. ``request.request_energy`` therefore needs the
period; this module finds it.

``counter_resolution(meter)`` is the period a figure is judged by, and where it comes from:

- the meter's own ``counter_update_s`` where it declares one (a simulated meter knows its
  period; ``NvmlMeter`` once ``measure_update_period`` has watched its counter);
- else ``ASSUMED_UPDATE_S`` (100 ms), said to be assumed. The H200 of the first GPU run
  (../shared/notes/gpu-h200.md) read no advance in a 65.7 ms window, so its period is longer
  than that; "tens of ms", the figure this module replaced, was too short for that board.

``measure_update_period(meter, sleep)`` polls the counter for at most ``cap_s`` and takes the
median time between the changes it sees. At idle power every update moves the counter (60 W
for 20 ms is 1,200 mJ against a 1 mJ resolution), so the time between changes is the period.
Not verified on hardware here (no GPU): scripts/gpu_check_energy.py measures it on the device.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from .meter import Meter

ASSUMED_UPDATE_S = 0.1
POLL_S = 0.001
CAP_S = 0.6
CHANGES_WANTED = 5  # four intervals between changes


def counter_resolution(meter: Meter) -> tuple[float, str]:
    """(seconds between the counter's updates, where that figure comes from)."""
    declared = getattr(meter, "counter_update_s", None)
    if isinstance(declared, (int, float)) and not isinstance(declared, bool) and declared >= 0:
        how = getattr(meter, "counter_update_source", None) or "declared by the meter"
        return float(declared), how
    return ASSUMED_UPDATE_S, (f"assumed ({ASSUMED_UPDATE_S * 1000:.0f} ms): this meter's counter has not been "
                              "watched yet; the H200's did not advance in 65.7 ms")


def measure_update_period(meter: Meter, sleep: Callable[[float], None] = time.sleep, cap_s: float = CAP_S,
                          poll_s: float = POLL_S, changes_wanted: int = CHANGES_WANTED) -> dict:
    """Watch the counter for at most ``cap_s`` (``sleep`` between reads) and time its changes.

    Returns ``{"period_s", "intervals_s", "changes", "watched_s", "step_mj", "reason"}``:
    ``period_s`` is the median interval between consecutive changes, or None (with ``reason``)
    when fewer than two changes were seen -- then the period is longer than about half the
    watch. The device must be idle (or evenly busy) while it is watched."""
    start = meter.now()
    last = int(meter.energy_mj())
    changes: list[tuple[float, int]] = []
    now = start
    while now - start < cap_s and len(changes) < changes_wanted:
        sleep(poll_s)
        now = meter.now()
        value = int(meter.energy_mj())
        if value != last:
            changes.append((now, value - last))
            last = value
    intervals = [b[0] - a[0] for a, b in zip(changes, changes[1:])]
    out = {
        "period_s": statistics.median(intervals) if intervals else None,
        "intervals_s": intervals,
        "changes": len(changes),
        "watched_s": now - start,
        "poll_s": poll_s,
        "step_mj": statistics.median(d for _, d in changes) if changes else None,
        "reason": None,
    }
    if not intervals:
        out["reason"] = (f"the counter changed {len(changes)} time(s) in {now - start:.3f} s of watching: its "
                         "update period could not be timed (longer than the watch allows, or the counter is stuck)")
    return out
