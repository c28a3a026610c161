"""The idle baseline of the protocols: the settle before each idle window, and the cold idle.

A board keeps its clocks up for a while after work: the H200 of the first GPU run drew 75-77 W
at 345 MHz before any work and 115-119 W in every "paired idle" window that followed a task
after 1-3 s of settle (../shared/notes/gpu-h200.md). A fixed settle therefore makes the
idle-adjusted figures depend on its length. Here:

- ``settle(meter, cap_s, sleep)`` waits until the power stops falling: it reads the meter's
  power every ``POLL_S`` and, once ``FIT_S`` of readings are in, fits a least-squares line to
  the last ``FIT_S`` of them; it ends when the slope is no steeper than ``flat_limit_w_per_s``
  (a fall of ``FLAT_FRACTION_PER_S`` of the power per second, at least ``FLAT_MIN_W_PER_S``), or
  at the cap (``settle_seconds``), whichever comes first. What it saw is recorded: its readings,
  its seconds, its last slope and whether the slope or the cap ended it. A cap shorter than
  ``FIT_S`` is a fixed wait of the cap (no slope can be fitted).
- ``cold_idle(meter, seconds, sleep)``: one idle window before the protocol's first work, with
  the telemetry (power, clocks) before and after it. It is recorded beside the paired idle,
  never subtracted: the paired idle stays the protocols' baseline (the reference record's
  arithmetic), and a reader sees how far it is from the board's cold idle. It is cold only if
  nothing ran on the device just before (its clocks show it).

Pure functions of a meter and a sleep: the simulated board (learner/energy/simulated.py, with
a decaying post-work power curve) exercises both in tests/test_energy_gated.py.
"""

from __future__ import annotations

from collections.abc import Callable

from ..energy.meter import Meter, read

POLL_S = 0.1
FIT_S = 1.0
FLAT_FRACTION_PER_S = 0.005
FLAT_MIN_W_PER_S = 0.25
_EPS = 1e-9


def slope_w_per_s(points: list[list[float]]) -> float | None:
    """Least-squares slope of [time, watts] points; None with fewer than two distinct times."""
    if len(points) < 2:
        return None
    n = len(points)
    mt = sum(p[0] for p in points) / n
    mw = sum(p[1] for p in points) / n
    var = sum((p[0] - mt) ** 2 for p in points)
    if var <= 0:
        return None
    return sum((p[0] - mt) * (p[1] - mw) for p in points) / var


def flat_limit_w_per_s(mean_w: float) -> float:
    return max(FLAT_MIN_W_PER_S, FLAT_FRACTION_PER_S * abs(mean_w))


def settle(meter: Meter, cap_s: float, sleep: Callable[[float], None]) -> dict:
    """Wait until the meter's power stops falling, at most ``cap_s`` (see the module docstring)."""
    t0 = meter.now()
    readings: list[list[float]] = []
    errors: list[str] = []
    ended_by, slope, limit = "cap", None, None
    while True:
        t = meter.now()
        try:
            readings.append([t, float(meter.power_w())])
        except Exception as exc:  # noqa: BLE001 - a failed read is recorded; the cap still ends the wait
            errors.append(f"{type(exc).__name__}: {exc}")
        elapsed = t - t0
        if elapsed >= FIT_S - _EPS:
            fit = [r for r in readings if r[0] >= t - FIT_S - _EPS]
            slope = slope_w_per_s(fit)
            if slope is not None:
                limit = flat_limit_w_per_s(sum(r[1] for r in fit) / len(fit))
                if slope >= -limit:
                    ended_by = "flat"
                    break
        if elapsed >= cap_s - _EPS:
            break
        sleep(min(POLL_S, cap_s - elapsed))
    return {"cap_s": cap_s, "seconds": meter.now() - t0, "ended_by": ended_by, "slope_w_per_s": slope,
            "flat_limit_w_per_s": limit, "readings": readings, "errors": errors[:10]}


def cold_idle(meter: Meter, seconds: float, sleep: Callable[[float], None]) -> dict:
    """One idle window before any work: counter readings at its edges, telemetry around it."""
    telemetry_before = meter.telemetry()
    start = read(meter)
    sleep(seconds)
    end = read(meter)
    return {"start": start.as_dict(), "end": end.as_dict(), "telemetry_before": telemetry_before,
            "telemetry_after": meter.telemetry()}


SETTLE_PLAN = {
    "settle": "each settle reads the power every poll_s and ends when the least-squares slope of the last fit_s "
              "of readings is no steeper than -max(flat_min_w_per_s, flat_fraction_per_s x their mean power), "
              "or at settle_seconds (a cap shorter than fit_s is a fixed wait)",
    "poll_s": POLL_S, "fit_s": FIT_S, "flat_fraction_per_s": FLAT_FRACTION_PER_S,
    "flat_min_w_per_s": FLAT_MIN_W_PER_S,
    "baseline": "paired idle: the mean power of a phase's two idle windows, each after such a settle; the cold "
                "idle (one idle window before any work, with its clocks) is recorded beside it, not subtracted",
}
