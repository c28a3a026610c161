"""The per-request energy figure of an ordinary answer: a short-window estimate.

``request_energy`` reads the NVML counter and the clock around one run; ``IdleBaseline`` is the
median of idle power samples subtracted from it. A request's window is often only a few
counter updates long, so the figure is labelled an estimate; the gated protocol
(``rev88 measure``, ``POST /tasks?measure=energy``; docs/energy.md) is how to get a figure worth
comparing.
"""

from __future__ import annotations

import collections
import statistics
import threading
from collections.abc import Callable
from typing import TypeVar

from .meter import Meter, read

T = TypeVar("T")

# Windows shorter than this span only a few updates of the NVML energy counter.
SHORT_WINDOW_S = 0.1
GATED_DOC = "docs/energy.md"
COUNTER_NOTE = (
    "NVML's total-energy counter (mJ) advances in steps of tens of ms; a window shorter than "
    f"{SHORT_WINDOW_S * 1000:.0f} ms covers only a few steps, so its energy is an estimate that can "
    "read 0 or include neighbouring work. Use `rev88 measure` (POST /tasks?measure=energy) for a "
    f"gated figure: two meters, reference windows, a sham window and pass/fail gates ({GATED_DOC})."
)
GATED_FIGURE = (f"not this figure: a gated one comes from POST /tasks?measure=energy or `rev88 measure` "
                f"({GATED_DOC}): two meters, reference windows, a sham window and seven gates")


class IdleBaseline:
    """Power samples taken while the device is idle; their median is the baseline
    subtracted from a request's energy. Bounded: the newest ``capacity`` samples."""

    def __init__(self, capacity: int = 60) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._samples: collections.deque[float] = collections.deque(maxlen=capacity)
        self._lock = threading.Lock()
        self.last_error: str | None = None

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

    def __len__(self) -> int:
        with self._lock:
            return len(self._samples)

    def median_w(self) -> float | None:
        with self._lock:
            return statistics.median(self._samples) if self._samples else None


def request_energy(meter: Meter, run: Callable[[], T], idle: IdleBaseline) -> tuple[T, dict]:
    """Counter and clock read around ``run`` (which must return only after the device
    finished its work, as ``backend.run`` does). Gross joules, and joules above the idle
    baseline where one has been sampled."""
    start = read(meter)
    result = run()
    end = read(meter)
    duration = end.time_s - start.time_s
    delta = end.energy_mj - start.energy_mj
    baseline = idle.median_w()
    note = COUNTER_NOTE
    if delta < 0:  # the counter restarted (driver reload): no figure
        gross = adjusted = None
        note = "the energy counter went backwards (driver reloaded?); no figure. " + note
    else:
        gross = delta / 1000.0
        adjusted = None if baseline is None else gross - baseline * duration
    if baseline is None:
        note = "no idle power sampled yet, so no idle-adjusted figure. " + note
    estimate = duration < SHORT_WINDOW_S
    if estimate:
        note = f"estimate: the {duration * 1000:.1f} ms window is shorter than {SHORT_WINDOW_S * 1000:.0f} ms. " + note
    return result, {
        "gross_j": gross,
        "idle_baseline_w": baseline,
        "idle_baseline_samples": len(idle),
        "idle_adjusted_j": adjusted,
        "duration_s": duration,
        "counter_start_mj": start.energy_mj,
        "counter_end_mj": end.energy_mj,
        "method": "nvml-total-energy-counter-delta",
        "estimate": estimate,
        "gated": False,
        "gated_figure": GATED_FIGURE,
        "note": note,
    }


