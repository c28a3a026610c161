"""The per-request energy figure of an ordinary answer: a short-window estimate, never a
negative or a zero-by-quantization one.

``request_energy`` reads the NVML counter and the clock around one run (or one launch) and the
power right after it; ``IdleBaseline`` holds the idle power samples whose median is subtracted,
and the cold idle (power and clocks before any work) recorded beside them.

Where the figure comes from (``gross_source``, and the first part of ``method``):

- ``counter`` (``nvml-total-energy-counter-delta``): the counter advanced and the window is at
  least one counter update long (``counter.counter_resolution``: the period the meter declares
  or was measured to have, else an assumed 100 ms). Fewer than ``MEASURED_UPDATES`` updates
  long: ``estimate: true``.
- ``power`` (``power-at-window-end-x-duration``): the counter did not advance (a window that
  read 0 J is below the counter's resolution, not a zero), went backwards (a driver reload), or
  the window is shorter than one update (then even an advance is one whole update of energy,
  most of it from outside the window). The power read at the window's end x its duration, as
  Zeus's ``approx_instant_energy`` does; always ``estimate: true``.
- neither (``gross_j: null``, ``gross_reason``): no usable counter delta and no power reading.

The idle-adjusted figure subtracts the baseline only from a gross figure that was read (never
from a window that read no energy), and is ``null`` with ``idle_adjusted_reason`` when there is
no baseline yet or when the result would not be above zero: a window whose readings do not
exceed the idle power is below what they resolve, not a negative energy. The gated protocol
(``rev88 measure``, ``POST /tasks?measure=energy``; docs/energy.md) is how to get a figure
worth comparing.
"""

from __future__ import annotations

import collections
import statistics
import threading
from collections.abc import Callable
from typing import TypeVar

from .counter import counter_resolution
from .meter import Meter, read

T = TypeVar("T")

# A counter window at least this many updates long is reported as measured (estimate: false):
# its two edges err by at most about one update's energy each.
MEASURED_UPDATES = 10
COUNTER_METHOD = "nvml-total-energy-counter-delta"
POWER_METHOD = "power-at-window-end-x-duration"
GATED_DOC = "docs/energy.md"
COUNTER_NOTE = (
    "NVML's total-energy counter (mJ) moves only at its updates (counter_update_s: the period this "
    "figure was judged by, and counter_update_source: where it comes from). A window shorter than "
    "one update is answered from the power read at its end x its duration (gross_source: power); a "
    f"counter window shorter than {MEASURED_UPDATES} updates is an estimate. Use `rev88 measure` "
    "(POST /tasks?measure=energy) for a gated figure: two meters, reference windows, a sham window "
    f"and pass/fail gates ({GATED_DOC})."
)
GATED_FIGURE = (f"not this figure: a gated one comes from POST /tasks?measure=energy or `rev88 measure` "
                f"({GATED_DOC}): two meters, reference windows, a sham window and seven gates")


class IdleBaseline:
    """Power samples taken while the device is idle; their median is the baseline subtracted
    from a request's energy. Bounded: the newest ``capacity`` samples. Beside them, the cold
    idle (``record_cold``: power and clocks read once, before the device did any work), which is
    never subtracted: after work a board keeps its clocks up for a while (the H200: 75-77 W at
    345 MHz cold, 115-119 W in the seconds after work), so the samples taken between tasks are
    warm-idle figures, and a reader needs both to see how much that matters."""

    def __init__(self, capacity: int = 60) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._samples: collections.deque[float] = collections.deque(maxlen=capacity)
        self._lock = threading.Lock()
        self.last_error: str | None = None
        self.cold: dict | None = None

    def sample(self, meter: Meter) -> float | None:
        """Record the meter's power now; the caller makes sure the device is idle.
        A failed read is remembered in ``last_error`` and skipped."""
        try:
            watts = float(meter.power_w())
        except Exception as exc:  # a telemetry hiccup must not stop the sampler
            self.last_error = f"{type(exc).__name__}: {exc}"
            return None
        with self._lock:
            self._samples.append(watts)
        return watts

    def record_cold(self, meter: Meter) -> dict:
        """The cold idle: the meter's power and clocks now, before any work (the caller's word).
        A failed read is recorded with its reason, never raised."""
        cold: dict = {"time_s": None, "power_w": None, "graphics_clock_mhz": None, "memory_clock_mhz": None,
                      "error": None}
        try:
            cold["time_s"] = meter.now()
            cold["power_w"] = float(meter.power_w())
            telemetry = meter.telemetry() or {}
            cold["graphics_clock_mhz"] = telemetry.get("graphics_clock_mhz")
            cold["memory_clock_mhz"] = telemetry.get("memory_clock_mhz")
        except Exception as exc:  # a telemetry hiccup must not stop the service
            cold["error"] = f"{type(exc).__name__}: {exc}"
        self.cold = cold
        return cold

    def __len__(self) -> int:
        with self._lock:
            return len(self._samples)

    def median_w(self) -> float | None:
        with self._lock:
            return statistics.median(self._samples) if self._samples else None

    def describe(self, samples: int) -> str:
        """Which baseline a figure used, in words (for ``method``)."""
        if samples == 0:
            return "idle baseline: none (no idle power sampled yet)"
        cold = self.cold or {}
        beside = (f"; cold idle {cold['power_w']:.1f} W before any work recorded beside (cold_idle_w), not subtracted"
                  if cold.get("power_w") is not None else "; no cold idle recorded")
        return (f"idle baseline: median of the last {samples} idle power sample(s) taken between tasks "
                f"(warm idle: after work the clocks may still be up){beside}")


def _power_end(meter: Meter) -> tuple[float | None, str | None]:
    try:
        watts = float(meter.power_w())
    except Exception as exc:  # noqa: BLE001 - a failed read leaves this source out, said so
        return None, f"{type(exc).__name__}: {exc}"
    if not watts > 0:  # a board draws power: 0 W (or less, or NaN) is a failed reading, not a figure
        return None, f"the power read {watts} W"
    return watts, None


def _gross(delta_mj: int, duration: float, period: float, power_end: float | None,
           power_error: str | None) -> tuple[float | None, str | None, str | None]:
    """(gross J, source "counter" | "power" | None, why the counter was not used)."""
    if duration <= 0:
        return None, None, f"the window's duration is {duration} s: no figure"
    why_not_counter = None
    if delta_mj < 0:
        why_not_counter = "the energy counter went backwards (a driver reload?)"
    elif delta_mj == 0:
        why_not_counter = (f"the energy counter did not advance in the {duration * 1000:.1f} ms window: below its "
                           "resolution, so 0 J is not a reading")
    elif duration < period * (1 - 1e-9):
        why_not_counter = (f"the {duration * 1000:.1f} ms window is shorter than one counter update "
                           f"({period * 1000:.1f} ms): its delta would be one whole update, mostly from outside "
                           "the window")
    if why_not_counter is None:
        return delta_mj / 1000.0, "counter", None
    if power_end is None:
        return None, None, f"{why_not_counter}; and the power could not be read ({power_error}): no figure"
    return power_end * duration, "power", why_not_counter


def request_energy(meter: Meter, run: Callable[[], T], idle: IdleBaseline) -> tuple[T, dict]:
    """Counter and clock read around ``run`` (which must return only after the device finished
    its work, as ``backend.run`` does), and the power right after it. Gross joules from the
    counter or, below its resolution, from power x duration; joules above the idle baseline
    where one has been sampled and the result is above zero (see the module docstring)."""
    start = read(meter)
    result = run()
    end = read(meter)
    power_end, power_error = _power_end(meter)
    duration = end.time_s - start.time_s
    delta = end.energy_mj - start.energy_mj
    period, period_source = counter_resolution(meter)
    gross, source, gross_reason = _gross(delta, duration, period, power_end, power_error)
    samples = len(idle)
    baseline = idle.median_w()
    adjusted, adjusted_reason = None, None
    if gross is None:
        adjusted_reason = "no gross figure to adjust"
    elif baseline is None:
        adjusted_reason = "no idle power sampled yet"
    else:
        above = gross - baseline * duration
        if above > 0:
            adjusted = above
        else:
            adjusted_reason = (f"the window's {source} reading ({gross:.4g} J, {gross / duration:.1f} W on average) "
                               f"is not above the idle baseline ({baseline:.1f} W x {duration * 1000:.1f} ms = "
                               f"{baseline * duration:.4g} J): the energy above idle is below what these readings "
                               "resolve; no figure rather than a negative one")
    estimate = source != "counter" or duration < MEASURED_UPDATES * period
    method = {"counter": COUNTER_METHOD, "power": POWER_METHOD}.get(source or "", "none")
    if source == "power":
        method += " (as Zeus's approx_instant_energy: the power read at the window's end x its duration)"
    cold = idle.cold
    notes = [n for n in (gross_reason, adjusted_reason and f"no idle-adjusted figure: {adjusted_reason}") if n]
    if estimate and gross is not None:
        notes.insert(0, f"estimate: a {duration * 1000:.1f} ms window, "
                        + ("answered from power" if source == "power"
                           else f"under {MEASURED_UPDATES} counter updates of {period * 1000:.1f} ms"))
    return result, {
        "gross_j": gross,
        "gross_source": source,
        "gross_reason": gross_reason,
        "idle_baseline_w": baseline,
        "idle_baseline_samples": samples,
        "idle_adjusted_j": adjusted,
        "idle_adjusted_reason": adjusted_reason,
        "cold_idle_w": None if cold is None else cold.get("power_w"),
        "cold_idle": cold,
        "duration_s": duration,
        "counter_start_mj": start.energy_mj,
        "counter_end_mj": end.energy_mj,
        "counter_delta_mj": delta,
        "counter_update_s": period,
        "counter_update_source": period_source,
        "power_end_w": power_end,
        "method": f"{method}; {idle.describe(samples)}",
        "estimate": estimate,
        "gated": False,
        "gated_figure": GATED_FIGURE,
        "note": " ".join(f"{n}." if not n.endswith(".") else n for n in notes + [COUNTER_NOTE]),
    }
