"""Every figure and gate of a gated energy record, from its raw readings alone.

``derive(raw, plan, thresholds)`` is the one function that turns readings into figures: the
protocol calls it to write a record, and ``analyze`` calls it again on a stored record and
compares the results exactly. Pure arithmetic over JSON values (no clock, no device), so the
same readings give the same bits.

Meters. *counter*: NVML's cumulative energy counter read at each window's edges (via
``paired.window``). *samples*: the separate sampler process's power readings, turned
into energy by the trapezoidal rule over the window, its ends interpolated linearly between the
neighbouring samples (``sampled_energy_j``).

Per phase (every phase is settle, idle window, window, settle, idle window): paired idle power
= mean of the two idle windows' average power; net energy = window energy - paired idle power x
window duration. Then:

- task trial: idle-adjusted mJ per task = net / invocations (``paired.trial_figures``);
  net mJ per task (the headline) = idle-adjusted - the harness control's net mJ per call.
  A per-task figure that would not be above zero is ``None`` (``net_reason``, ``idle_adjusted_reason``):
  never a negative energy; and no idle is subtracted from a window whose counter read no energy.
- harness control: net mJ per call = net / calls.
- sham: nominal calls = sham duration / mean task seconds per call of the trials; net mJ per
  nominal call = net / nominal calls.
- reference: TFLOP = calls x FLOP per call / 1e12; TFLOP/s = TFLOP / duration;
  J per 10^12 FLOP = net / TFLOP, on each meter.

The controls (sham, harness, reference) keep their sign: a residual below zero is a reading.
``idle``: the cold idle window (power on both meters, clocks) beside every phase's paired idle,
and every settle (seconds, whether the power stopped falling or the cap ended it).
"""

from __future__ import annotations

import hashlib
import json
import statistics
from bisect import bisect_left, bisect_right

from ..energy.reference import output_relative_error, tf32_settings_off
from . import gates as gates_mod
from . import paired as measure

RECORD_FORMAT = "rev88-gated-energy/2"


def canonical_sha256(value) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def normalized(value):
    """``value`` as it reads back from JSON (tuples become lists, keys strings)."""
    return json.loads(json.dumps(value, allow_nan=False))


# --------------------------------------------------------------------------- the sampled meter


def sampled_energy_j(times: list[float], watts: list[float], a: float, b: float) -> float | None:
    """Joules over [a, b] from power samples by the trapezoidal rule, the ends interpolated
    linearly; None when the samples do not cover [a, b] or the window is empty."""
    if not b > a or len(times) < 2 or a < times[0] or b > times[-1]:
        return None

    def at(k: int, t: float) -> float:  # between samples k-1 and k
        t0, t1 = times[k - 1], times[k]
        p0, p1 = watts[k - 1], watts[k]
        return p1 if t1 <= t0 else p0 + (p1 - p0) * (t - t0) / (t1 - t0)

    i = max(1, bisect_right(times, a))  # times[i-1] <= a < times[i]
    j = max(1, bisect_left(times, b))  # times[j-1] < b <= times[j]
    points = [(a, at(i, a))] + [(times[k], watts[k]) for k in range(i, j)] + [(b, at(j, b))]
    return sum((t1 - t0) * (p0 + p1) / 2 for (t0, p0), (t1, p1) in zip(points, points[1:]))


def sampled_power_w(times, watts, a: float, b: float) -> float | None:
    energy = sampled_energy_j(times, watts, a, b)
    return None if energy is None else energy / (b - a)


# --------------------------------------------------------------------------- per phase


def _windows(phase: dict) -> tuple[dict, dict, dict]:
    ib, w, ia = phase["idle_before"], phase["window"], phase["idle_after"]
    return (measure.window(ib["start"], ib["end"], ib.get("settle_seconds")),
            measure.window(w["start"], w["end"]),
            measure.window(ia["start"], ia["end"], ia.get("settle_seconds")))


def _mean2(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else (a + b) / 2


def _block(phase: dict, times: list[float], watts: list[float]) -> dict:
    ib, w, ia = _windows(phase)
    paired = _mean2(ib["average_power_w"], ia["average_power_w"])
    # never an idle subtracted from a window whose counter read no energy (window: no average power)
    counter = {"window_w": w["average_power_w"], "paired_idle_w": paired,
               "net_j": None if paired is None or w["average_power_w"] is None
               else w["energy_j"] - paired * w["duration_s"]}
    span = {name: (x["start"]["time_s"], x["end"]["time_s"]) for name, x in (("idle_before", ib), ("window", w),
                                                                             ("idle_after", ia))}
    power = {name: sampled_power_w(times, watts, *ab) for name, ab in span.items()}
    s_paired = _mean2(power["idle_before"], power["idle_after"])
    samples = {"idle_before_w": power["idle_before"], "window_w": power["window"], "idle_after_w": power["idle_after"],
               "paired_idle_w": s_paired,
               "net_j": None if s_paired is None or power["window"] is None
               else (power["window"] - s_paired) * w["duration_s"]}
    return {"windows": (ib, w, ia), "duration_s": w["duration_s"], "counter": counter, "samples": samples}


def _per(value: float | None, count: float | None, scale: float = 1000.0) -> float | None:
    return None if value is None or not count else value * scale / count


def _energy(value: float | None) -> float | None:
    """A per-task energy figure: never a negative or zero one (below what the readings resolve)."""
    return value if value is not None and value > 0 else None


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _relative_difference(counter_w: float | None, samples_w: float | None) -> float | None:
    if counter_w is None or samples_w is None or not counter_w > 0:
        return None
    return abs(counter_w - samples_w) / counter_w


# --------------------------------------------------------------------------- the idle baseline


def _idle_figures(raw: dict, blocks: list, times: list[float], watts: list[float]) -> dict:
    """The cold idle (power on both meters, clocks) beside each phase's paired idle, and every
    settle: how long it waited and whether the power had stopped falling or the cap ended it."""
    cold_raw = raw.get("cold_idle")
    cold = None
    if cold_raw is not None:
        w = measure.window(cold_raw["start"], cold_raw["end"])
        before, after = cold_raw.get("telemetry_before") or {}, cold_raw.get("telemetry_after") or {}
        cold = {"duration_s": w["duration_s"], "counter_w": w["average_power_w"],
                "samples_w": sampled_power_w(times, watts, w["start"]["time_s"], w["end"]["time_s"]),
                "graphics_clock_mhz": [before.get("graphics_clock_mhz"), after.get("graphics_clock_mhz")],
                "memory_clock_mhz": [before.get("memory_clock_mhz"), after.get("memory_clock_mhz")],
                "telemetry_power_w": [before.get("power_w"), after.get("power_w")]}
    paired, settles = {}, []
    for p, b in blocks:
        c, smp = b["counter"]["paired_idle_w"], b["samples"]["paired_idle_w"]
        paired[p["name"]] = {"counter_w": c, "samples_w": smp,
                             "counter_minus_cold_w": None if cold is None or c is None or cold["counter_w"] is None
                             else c - cold["counter_w"]}
        for which in ("idle_before", "idle_after"):
            st = p[which].get("settle")
            if st is not None:
                settles.append({"phase": p["name"], "before": which, "cap_s": st["cap_s"], "seconds": st["seconds"],
                                "ended_by": st["ended_by"], "slope_w_per_s": st["slope_w_per_s"],
                                "flat_limit_w_per_s": st["flat_limit_w_per_s"], "readings": len(st["readings"])})
    return {"baseline": "paired", "cold": cold, "paired": paired, "settles": settles,
            "settles_ended_by_cap": sum(1 for x in settles if x["ended_by"] == "cap")}


# --------------------------------------------------------------------------- telemetry and processes


def _telemetry(raw: dict, phases: list[dict]) -> dict:
    sampler = raw["sampler"]
    times = [s[0] for s in sampler["samples"]]
    edges = [p["idle_before"]["start"]["time_s"] for p in phases]
    if phases and raw.get("cold_idle") is not None:  # the cold idle window is watched too
        edges.append(raw["cold_idle"]["start"]["time_s"])
    start = min(edges) if phases else None
    end = max(p["idle_after"]["end"]["time_s"] for p in phases) if phases else None
    max_gap = at = None
    if start is not None:
        points = [start] + [t for t in times if start <= t <= end] + [end]
        gaps = [(b - a, a) for a, b in zip(points, points[1:])]
        max_gap, at = max(gaps) if gaps else (0.0, start)
    errors = [list(e) for e in sampler["errors"]]
    if sampler.get("exit_code") not in (0, None) and not any("exited with status" in str(e[1]) for e in errors):
        errors.append([None, f"the sampler exited with status {sampler['exit_code']}"])

    def shared(check: dict | None) -> bool:
        return bool(check) and check.get("sampler") is not None \
            and check["parent_before"] <= check["sampler"] <= check["parent_after"]

    return {
        "samples": len(times),
        "period_s": sampler.get("period_s"),
        "power_query": (sampler.get("description") or {}).get("power_query"),
        "covered_from_s": start,
        "covered_to_s": end,
        "max_gap_s": max_gap,
        "max_gap_at_s": at,
        "non_monotonic": sum(1 for a, b in zip(times, times[1:]) if b < a),
        "error_count": len(errors),
        "errors": errors[:20],
        "clock_shared": shared(sampler.get("clock")) and shared(sampler.get("clock_end")),
        "clock": sampler.get("clock"),
        "clock_end": sampler.get("clock_end"),
    }


def _process_check(check: dict, own_pid: int) -> dict:
    out = {"phase": check["phase"], "at": check["at"], "time_s": check["time_s"], "pids": check["pids"]}
    pids = check["pids"]
    if check.get("error") is not None or pids is None:
        out.update(others=None, how=f"the query failed: {check.get('error')}")
    elif own_pid in pids:
        out.update(others=len(set(pids) - {own_pid}), how="by pid")
    elif pids:
        # NVML lists host PIDs; in a container this process has another one. It holds a CUDA
        # context, so it is one of the entries: the others are the rest.
        out.update(others=len(pids) - 1, how="by count (this process's pid is not listed: another PID namespace)")
    else:
        out.update(others=None, how="NVML lists no compute process, not even this one: exclusivity not shown")
    return out


def task_repeat_check(raw_task: dict) -> dict:
    """Whether the repeat run gave the first run's hashes and predictions (the record's ``task``)."""
    before, after = raw_task["before"], raw_task["after"]
    differing = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    return {"hashes_identical": not differing, "predictions_equal": bool(raw_task["predictions_array_equal"]),
            "differing": differing, "keys_compared": sorted(set(before) | set(after))}


# --------------------------------------------------------------------------- the record's figures


def derive(raw: dict, plan: dict, thresholds: dict) -> dict:
    """Figures, gates, validity and the legacy-shaped trials and summary of a gated record."""
    samples = raw["sampler"]["samples"]
    times = [s[0] for s in samples]
    watts = [s[1] for s in samples]
    phases = raw["phases"]
    blocks = [(p, _block(p, times, watts)) for p in phases]

    harness = None
    for p, b in blocks:
        if p["kind"] == "harness":
            harness = {"calls": p["calls"], "duration_s": b["duration_s"],
                       "counter": {**b["counter"], "net_mj_per_call": _per(b["counter"]["net_j"], p["calls"])},
                       "samples": {**b["samples"], "net_mj_per_call": _per(b["samples"]["net_j"], p["calls"])}}
    h_counter = None if harness is None else harness["counter"]["net_mj_per_call"]
    h_samples = None if harness is None else harness["samples"]["net_mj_per_call"]

    trials, legacy_trials, walls, cudas = [], [], [], []
    for p, b in blocks:
        if p["kind"] != "task":
            continue
        ib, w, ia = b["windows"]
        cuda_total = None if p["cuda_ms"] is None else sum(p["cuda_ms"])
        legacy = {"trial": p["trial"], "invocations": p["invocations"], "idle_before": ib, "idle_after": ia,
                  "active": w, "telemetry_before": p["telemetry_before"], "telemetry_after": p["telemetry_after"],
                  **measure.trial_figures(ib, w, ia, p["invocations"], cuda_total)}
        legacy_trials.append(legacy)
        walls.extend(p["wall_ms"])
        if p["cuda_ms"] is not None:
            cudas.extend(p["cuda_ms"])
        s_adjusted = _energy(_per(b["samples"]["net_j"], p["invocations"]))
        net = _energy(_minus(legacy["idle_adjusted_mj_per_task"], h_counter))
        trials.append({
            "trial": p["trial"],
            "invocations": p["invocations"],
            "active_s": w["duration_s"],
            "counter": {"active_w": b["counter"]["window_w"], "paired_idle_w": b["counter"]["paired_idle_w"],
                        "idle_adjusted_mj_per_task": legacy["idle_adjusted_mj_per_task"]},
            "samples": {"active_w": b["samples"]["window_w"], "paired_idle_w": b["samples"]["paired_idle_w"],
                        "idle_adjusted_mj_per_task": s_adjusted,
                        "net_mj_per_task": _energy(_minus(s_adjusted, h_samples))},
            "meters_relative_difference": _relative_difference(b["counter"]["window_w"], b["samples"]["window_w"]),
            "net_mj_per_task": net,
            "net_reason": None if net is not None else (
                legacy["idle_adjusted_reason"] or ("no harness control figure" if h_counter is None else
                                                   f"idle-adjusted {legacy['idle_adjusted_mj_per_task']:.4g} mJ minus "
                                                   f"the harness control's {h_counter:.4g} mJ per call is not above "
                                                   "zero: no figure rather than a negative one")),
        })

    per_call_s = [t["active_s"] / t["invocations"] for t in trials if t["invocations"]]
    task_s = statistics.mean(per_call_s) if per_call_s else None
    sham = None
    for p, b in blocks:
        if p["kind"] == "sham":
            nominal = None if not task_s else b["duration_s"] / task_s
            sham = {"duration_s": b["duration_s"], "nominal_calls": nominal, "task_seconds_per_call": task_s,
                    "counter": {**b["counter"], "net_mj_per_nominal_call": _per(b["counter"]["net_j"], nominal)},
                    "samples": {**b["samples"], "net_mj_per_nominal_call": _per(b["samples"]["net_j"], nominal)}}

    reference = {}
    for p, b in blocks:
        if p["kind"] != "reference":
            continue
        tflop = p["calls"] * p["flops_per_call"] / 1e12
        duration = b["duration_s"]
        reference[p["name"]] = {
            "calls": p["calls"], "flops_per_call": p["flops_per_call"], "tflop": tflop, "duration_s": duration,
            "tflop_per_s": tflop / duration if duration > 0 else None,
            "counter": {**b["counter"], "j_per_tflop": None if b["counter"]["net_j"] is None
                        else b["counter"]["net_j"] / tflop},
            "samples": {**b["samples"], "j_per_tflop": None if b["samples"]["net_j"] is None
                        else b["samples"]["net_j"] / tflop},
            "output_relative_error": output_relative_error(p["check"]),
            "tf32_off": tf32_settings_off(p["check"].get("tf32_settings")),
        }

    checks = [_process_check(c, raw["own_pid"]) for p in phases for c in p["processes"]]
    present = [c["others"] for c in checks if c["others"] is not None]
    processes = {"checks": checks, "max_other_processes": max(present) if present else None}

    nets = [t["net_mj_per_task"] for t in trials]
    figures = {
        "headline": {
            "net_mj_per_task": measure.summarize(nets),
            "meter": "counter",
            "baseline": "paired idle (figures.idle: each after a settle until the power stopped falling; the cold "
                        "idle beside it, not subtracted)",
            "definition": "per trial: (active J - paired idle W x active s) / invocations - the harness control's "
                          "net mJ per call; mean and sample SD over the trials; a trial whose figure would not be "
                          "above zero has none (net_reason)",
        },
        "idle": _idle_figures(raw, blocks, times, watts),
        "repeats_per_trial": measure.repeats_for(raw["calibration_ms"], plan["options"]["target_seconds"]),
        "trials": trials,
        "harness": harness,
        "sham": sham,
        "reference": reference,
        "telemetry": _telemetry(raw, phases),
        "processes": processes,
        "task": task_repeat_check(raw["task"]),
    }
    gates = gates_mod.all_gates(figures, thresholds)
    failed = [name for name in gates_mod.GATE_NAMES if not gates[name]["passed"]]
    return normalized({
        "figures": figures,
        "gates": gates,
        "valid": not failed,
        "failed_gates": failed,
        "energy_trials": legacy_trials,
        "energy_summary": measure.summary(legacy_trials),
        "timing_wall_ms_per_task": measure.timing_stats(walls),
        "timing_cuda_ms_per_task": measure.timing_stats(cudas),
        "plan_sha256": canonical_sha256({"plan": plan, "thresholds": thresholds}),
        "raw_sha256": canonical_sha256(raw),
    })


# Where each derived part sits in a record (analyze compares them there).
DERIVED_PLACES = {
    "figures": ("figures",),
    "gates": ("gates",),
    "valid": ("valid",),
    "failed_gates": ("failed_gates",),
    "energy_trials": ("energy", "trials"),
    "energy_summary": ("energy", "summary"),
    "timing_wall_ms_per_task": ("timing", "wall_ms_per_task"),
    "timing_cuda_ms_per_task": ("timing", "cuda_ms_per_task"),
    "plan_sha256": ("plan_sha256",),
    "raw_sha256": ("raw_sha256",),
}
