"""The gates of the gated energy protocol: thresholds, reference bands, and one pure function
per gate from the record's figures to ``{status, passed, threshold, measured, reason}``.

A record is valid only when every gate's status is ``pass``. ``unchecked`` (a board without a
known reference band) does not pass. The thresholds are the issue's table (issue 23); the one
number added here is the reference output check's relative error (1e-4, see
learner/energy/reference.py). Reference bands are known for the A100-SXM4-40GB (issue 23's
hosts) and the H200 (one run, widened by the A100 band's relative width: ``band_from_run``).
"""

from __future__ import annotations

import math
import statistics

# The protocol's windows and trials when not told otherwise (`rev88 measure`'s defaults; here, in
# a module without torch, so that the command line's --help needs none)
DEFAULTS = {"trials": 3, "target_seconds": 5.0, "settle_seconds": 3.0, "idle_seconds": 3.0,
            "reference_seconds": 10.0, "sham_seconds": 5.0}

GATE_NAMES = ("reference", "meters_agree", "sham_residual", "round_spread", "telemetry", "exclusive_gpu",
              "task_verified")
REFERENCE_WINDOWS = ("reference_before", "reference_after")
METERS = ("counter", "samples")

A100_SXM4_40GB = "NVIDIA A100-SXM4-40GB"
H200 = "NVIDIA H200"  # nvmlDeviceGetName of the H200 SXM (141 GB) of the first GPU run
# Healthy-board bands of the 4096 x 4096 fp32 matmul (TF32 off): net joules per 10^12 FLOP above
# the paired idle power, and TFLOP/s. Each band keeps the measurement it rests on beside it.
A100_BAND = {
    "j_per_tflop": [6.0, 11.0],
    "tflop_per_s": [15.0, 23.0],
    "source": "healthy A100-SXM4-40GB hosts of the public MNIST energy challenge (issue 23's table)",
}
# How wide a band is around a board's healthy figure: the A100 band's own width around its
# middle (6-11 J around 8.5: x0.706-1.294; 15-23 TFLOP/s around 19: x0.789-1.211). That band
# spans many hosts; a band from one run borrows that spread rather than the run's own (the
# H200's four J/TFLOP readings spread only 2.7 %, too little to stand for other hosts).
BAND_WIDTH = {name: [A100_BAND[name][0] / ((A100_BAND[name][0] + A100_BAND[name][1]) / 2),
                     A100_BAND[name][1] / ((A100_BAND[name][0] + A100_BAND[name][1]) / 2)]
              for name in ("j_per_tflop", "tflop_per_s")}
BAND_ROUNDING = {"j_per_tflop": 0.1, "tflop_per_s": 1.0}  # bands are rounded outwards to these steps
# The measurement the H200 band rests on: the first GPU run's gated record (main at 3004785,
# 2026-12-04, driver 580.159.04, torch 2.11.0+cu130; ../shared/notes/gpu-h200.md), its
# reference windows before and after the task windows (2 s each, 1 s settle, 1 s idle).
H200_MEASURED = {
    "tflop_per_s": [51.07],
    "j_per_tflop": {"counter": [9.40, 9.52], "samples": [9.66, 9.46]},
    "run": "the first GPU run (main at 3004785, 2026-12-04): scripts/gpu_check_energy.py's gated record, "
           "reference windows before and after the task windows; driver 580.159.04, torch 2.11.0+cu130",
}


def band_from_run(tflop_per_s: list[float], j_per_tflop: list[float]) -> dict:
    """A band around one board's measured reference figures: their mean times ``BAND_WIDTH``,
    rounded outwards to ``BAND_ROUNDING``. How the H200's band was made, and what the GPU check
    prints for a board without one (so that the next board's band comes from a run)."""
    if not tflop_per_s or not j_per_tflop:
        raise ValueError("a band needs at least one TFLOP/s and one J per 10^12 FLOP figure")
    out = {}
    for name, values in (("j_per_tflop", j_per_tflop), ("tflop_per_s", tflop_per_s)):
        mean, step = sum(values) / len(values), BAND_ROUNDING[name]
        low, high = mean * BAND_WIDTH[name][0], mean * BAND_WIDTH[name][1]
        out[name] = [round(math.floor(low / step + 1e-9) * step, 6), round(math.ceil(high / step - 1e-9) * step, 6)]
    return out


REFERENCE_BANDS: dict[str, dict] = {
    A100_SXM4_40GB: A100_BAND,
    H200: {
        **band_from_run(H200_MEASURED["tflop_per_s"],
                        H200_MEASURED["j_per_tflop"]["counter"] + H200_MEASURED["j_per_tflop"]["samples"]),
        "source": "one H200 run (measured beside: H200_MEASURED), widened by the A100 band's own relative width "
                  "(BAND_WIDTH); to be replaced by a band over several healthy H200 hosts when there are runs",
        "measured": H200_MEASURED,
    },
}
# The simulated board's own band: its model (simulated.BoardModel) runs the matmul at 19 TFLOP/s
# and 160 W above idle (8.42 J per 10^12 FLOP). It says nothing about any real board.
SIMULATED_BAND = {
    "j_per_tflop": [6.0, 11.0],
    "tflop_per_s": [15.0, 23.0],
    "source": "the simulator's own band, defined for its own board model only (not a hardware band)",
}


def reference_band(board_kind: str, gpu: str | None) -> dict | None:
    """The band for this board, or None (the gate is then ``unchecked``). The simulated band
    applies to the simulated board only, whatever a real board's name is."""
    if board_kind == "simulated":
        from ..energy.simulated import SIMULATED_GPU

        return {"device": SIMULATED_GPU, **SIMULATED_BAND}
    band = REFERENCE_BANDS.get(gpu or "")
    return None if band is None else {"device": gpu, **band}


def thresholds_for(board_kind: str, gpu: str | None) -> dict:
    return {
        "reference": {"band": reference_band(board_kind, gpu), "max_output_relative_error": 1e-4,
                      "tf32": False, "windows": list(REFERENCE_WINDOWS), "meters": list(METERS)},
        "meters_agree": {"max_relative_difference": 0.03},
        "sham_residual": {"max_fraction_of_task_net": 0.05},
        "round_spread": {"max_spread": 0.10, "min_trials": 2},
        "telemetry": {"max_sampler_errors": 0, "max_gap_s": 0.5, "clock_shared": True},
        "exclusive_gpu": {"max_other_processes": 0},
        "task_verified": {"hashes_identical": True},
    }


def _gate(status: str, threshold: dict, measured: dict, reason: str) -> dict:
    return {"status": status, "passed": status == "pass", "threshold": threshold, "measured": measured,
            "reason": reason}


def _within(value: float | None, band: list[float]) -> bool:
    return value is not None and band[0] <= value <= band[1]


def reference_gate(reference: dict, th: dict) -> dict:
    """Both reference windows, both meters: output checked with TF32 off, and (where a band is
    known) J per 10^12 FLOP and TFLOP/s inside it."""
    problems, outside = [], []
    band = th["band"]
    measured = {}
    for name in th["windows"]:
        f = reference.get(name)
        if f is None:
            problems.append(f"{name}: no window")
            continue
        measured[name] = {"tflop_per_s": f["tflop_per_s"],
                          "j_per_tflop": {m: f[m]["j_per_tflop"] for m in th["meters"]},
                          "output_relative_error": f["output_relative_error"], "tf32_off": f["tf32_off"]}
        error = f["output_relative_error"]
        if error is None or error > th["max_output_relative_error"]:
            problems.append(f"{name}: output check relative error {error} (limit {th['max_output_relative_error']})")
        if not f["tf32_off"]:
            problems.append(f"{name}: TF32 was not off")
        if f["tflop_per_s"] is None:
            problems.append(f"{name}: no TFLOP/s figure")
        for m in th["meters"]:
            if f[m]["j_per_tflop"] is None:
                problems.append(f"{name}: no {m} figure")
        if band is not None:
            if not _within(f["tflop_per_s"], band["tflop_per_s"]):
                outside.append(f"{name}: {f['tflop_per_s']:.3g} TFLOP/s outside {band['tflop_per_s']}")
            for m in th["meters"]:
                value = f[m]["j_per_tflop"]
                if value is not None and not _within(value, band["j_per_tflop"]):
                    outside.append(f"{name}: {m} {value:.3g} J per 10^12 FLOP outside {band['j_per_tflop']}")
    if problems or outside:
        return _gate("fail", th, measured, "; ".join(problems + outside))
    if band is None:
        return _gate("unchecked", th, measured,
                     "no reference band is known for this board (known: " + ", ".join(REFERENCE_BANDS)
                     + "); the figures are recorded, the gate is unchecked and does not pass")
    return _gate("pass", th, measured, f"both windows on both meters inside the {band['device']} band")


def meters_agree_gate(trials: list[dict], th: dict) -> dict:
    limit = th["max_relative_difference"]
    values = [t["meters_relative_difference"] for t in trials]
    measured = {"by_trial": values, "max_relative_difference": None}
    if not values:
        return _gate("fail", th, measured, "no task trial")
    if any(v is None for v in values):
        missing = [i for i, v in enumerate(values) if v is None]
        return _gate("fail", th, measured, f"trial(s) {missing}: an active window not covered by power samples")
    worst = max(values)
    measured["max_relative_difference"] = worst
    if worst > limit:
        i = values.index(worst)
        return _gate("fail", th, measured,
                     f"trial {i}: counter and sampled mean power differ by {worst:.2%} (limit {limit:.0%})")
    return _gate("pass", th, measured, f"every active window within {limit:.0%} (worst {worst:.2%})")


def sham_residual_gate(sham: dict | None, task_net_median_mj: float | None, th: dict) -> dict:
    limit = th["max_fraction_of_task_net"]
    residual = None if sham is None else sham["counter"]["net_mj_per_nominal_call"]
    measured = {"sham_net_mj_per_nominal_call": residual, "task_net_mj_per_task_median": task_net_median_mj,
                "fraction": None}
    if residual is None:
        return _gate("fail", th, measured, "no sham figure")
    if task_net_median_mj is None or not task_net_median_mj > 0:
        return _gate("fail", th, measured, f"the task's net energy ({task_net_median_mj}) is not positive")
    fraction = abs(residual) / task_net_median_mj
    measured["fraction"] = fraction
    if fraction > limit:
        return _gate("fail", th, measured, f"the idle-only sham reads {residual:.4g} mJ per nominal call, "
                     f"{fraction:.1%} of the task's {task_net_median_mj:.4g} mJ (limit {limit:.0%})")
    return _gate("pass", th, measured, f"sham residual {fraction:.2%} of the task's net energy")


def round_spread_gate(values: list[float | None], th: dict) -> dict:
    measured = {"values": values, "spread": None}
    if len(values) < th["min_trials"]:
        return _gate("fail", th, measured, f"{len(values)} trial(s): a spread needs at least {th['min_trials']}")
    if any(v is None for v in values):
        return _gate("fail", th, measured, "a trial has no net figure")
    median = statistics.median(values)
    measured.update({"min": min(values), "max": max(values), "median": median})
    if not median > 0:
        return _gate("fail", th, measured, f"median net energy {median} is not positive")
    spread = (max(values) - min(values)) / median
    measured["spread"] = spread
    if spread > th["max_spread"]:
        return _gate("fail", th, measured,
                     f"(max - min) / median over the trials is {spread:.1%} (limit {th['max_spread']:.0%})")
    return _gate("pass", th, measured, f"spread {spread:.2%}")


def telemetry_gate(telemetry: dict, th: dict) -> dict:
    problems = []
    if telemetry["error_count"] > th["max_sampler_errors"]:
        problems.append(f"{telemetry['error_count']} sampler error(s), first: {telemetry['errors'][0]}")
    gap = telemetry["max_gap_s"]
    if gap is None or gap > th["max_gap_s"]:
        problems.append(f"largest gap between samples {gap} s at t = {telemetry['max_gap_at_s']} (limit {th['max_gap_s']} s)")
    if telemetry["clock_shared"] is not th["clock_shared"]:
        problems.append("the sampler's clock readings do not fall between the parent's: clocks not shown shared")
    if telemetry["non_monotonic"]:
        problems.append(f"{telemetry['non_monotonic']} sample time(s) went backwards")
    if problems:
        return _gate("fail", th, telemetry, "; ".join(problems))
    return _gate("pass", th, telemetry, f"{telemetry['samples']} samples, largest gap {gap:.3f} s, no error")


def exclusive_gpu_gate(processes: dict, th: dict) -> dict:
    unverifiable = [c for c in processes["checks"] if c["others"] is None]
    crowded = [c for c in processes["checks"] if c["others"] is not None and c["others"] > th["max_other_processes"]]
    if not processes["checks"]:
        return _gate("fail", th, processes, "no process check was made")
    if crowded:
        c = crowded[0]
        return _gate("fail", th, processes, f"{len(crowded)} check(s) saw another compute process; first: "
                     f"{c['phase']} {c['at']}, pids {c['pids']}")
    if unverifiable:
        c = unverifiable[0]
        return _gate("fail", th, processes, f"{len(unverifiable)} check(s) could not be made; first: "
                     f"{c['phase']} {c['at']}: {c['how']}")
    return _gate("pass", th, processes, f"{len(processes['checks'])} checks, no other compute process")


def task_verified_gate(task: dict, th: dict) -> dict:
    if task["hashes_identical"] and task["predictions_equal"]:
        return _gate("pass", th, task, "predictions and every state hash identical before and after the windows")
    return _gate("fail", th, task, "the run after the windows differs from the run before them: "
                 + ", ".join(task["differing"] or ["predictions"]))


def all_gates(figures: dict, th: dict) -> dict:
    trials = figures["trials"]
    nets = [t["net_mj_per_task"] for t in trials]
    present = [v for v in nets if v is not None]
    median = statistics.median(present) if present and len(present) == len(nets) else None
    return {
        "reference": reference_gate(figures["reference"], th["reference"]),
        "meters_agree": meters_agree_gate(trials, th["meters_agree"]),
        "sham_residual": sham_residual_gate(figures["sham"], median, th["sham_residual"]),
        "round_spread": round_spread_gate(nets, th["round_spread"]),
        "telemetry": telemetry_gate(figures["telemetry"], th["telemetry"]),
        "exclusive_gpu": exclusive_gpu_gate(figures["processes"], th["exclusive_gpu"]),
        "task_verified": task_verified_gate(figures["task"], th["task_verified"]),
    }
