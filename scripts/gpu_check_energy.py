"""GPU check of the energy interface and the gated energy protocol (needs a CUDA GPU and NVML).

Runs, on the cuda backend with MNIST draw 0:

1. the cold idle as this section finds the device (power and clocks, before its own work; the
   sections before it have worked the GPU, so its clocks say how cold it is) and the energy
   counter's update period, watched for at most 0.6 s (learner/energy/counter.py);
2. the gated protocol (learner/measure/gated.py, docs/energy.md) with ``rev88 measure``'s
   default windows (``GATED_LONG``: 3 trials, 5 s active and sham windows, 10 s reference
   windows, settles of at most 3 s, 3 s idle windows: 129 s of windows), because the sham
   residual's verdict is only worth having on those (the first H200 run read 5.7 % against a 5 %
   limit on 1-2 s windows). When the budget cannot hold them (``deadline`` minus ``reserve_s``
   for the sections after this one, ``LONG_NEED_S``), the short rehearsal ``GATED_DEVICE`` (2
   trials, 2 s windows, 1 s settle cap, 1 s idle: 36 s) runs instead and the report says
   ``budget_cut``;
3. the /health telemetry and one per-request figure (the service's path: the counter judged by
   the period watched in 1., never a negative or zero-by-quantization figure);

prints each gate with its reason, the board's reference figures (TFLOP/s, J per 10^12 FLOP on
both meters) with its band or, for a board without one, the band ``gates.band_from_run``
makes of them (so the next board's band comes from a run), the sham residual, the cold idle
beside every phase's paired idle and how each settle ended, and writes everything to
``out_dir/energy_check.json`` (the gated record under ``gated``). scripts/gpu_check.py calls
``run(out_dir, mnist_dir, deadline=, reserve_s=)``; alone: ``python3 scripts/gpu_check_energy.py
[out_dir] [--mnist-dir DIR] [--dry-run]``. The result has ``passed`` (and ``ok``, the same
value, for older callers).

What makes the section pass: the protocol ran end to end and wrote a record that ``rev88 measure
analyze`` reproduces exactly, every gate was evaluated, the sampler process ran without error,
the reference product checked within 1e-4 with TF32 off in both windows, ``task_verified``
passed, the counter's period was timed, the per-request figure obeys the rules (a figure from
the counter or from power, never 0 J or negative, the method naming its source and baseline),
and the paired-idle checks as before (figures sane, repeats equal, CUDA events, the memory peak,
the NVML handle). The record's own verdict (``valid``) and the other gates -- the sham residual
among them -- are reported, not required: whether they pass on real hardware is what this run
finds out.

``--dry-run``: the same steps on the CPU on the simulated board (learner/energy/simulated.py),
the cuda backend's program run eagerly on a 1,000/250 slice of draw 0: ``healthy`` with the long
windows must pass every gate and ``counter-drift`` (short windows, ``GATED_DRY_RUN``) must fail
``meters_agree`` (and only it); both records must re-analyze exactly. The counter's period is
watched on the simulated board (25 ms); the per-request figure uses
``gpu_check_common.DryRunMeter`` (made-up joules). What only a GPU can show is listed in
``not_checked_in_dry_run``.

Of the device path, only the first GPU run's version has run on a GPU (an H200, with the short
windows); the long windows, the cold idle, the settles and the counter's period have not. A
failed check is reported, never hidden.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a file: make the checkout importable
    sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_budget  # noqa: E402
import gpu_check_common as common  # noqa: E402

from learner.measure.gated import DEFAULTS  # noqa: E402

DRAW0_SEED = common.DRAW0_SEED
CPU_PREDICTIONS_SHA256 = common.DRAW0_PREDICTIONS_SHA256


def find_mnist(mnist_dir: Path | None = None) -> Path:
    """``mnist_dir``, else the repository's bundled data/mnist (learner.data.bundled_mnist_dir)."""
    from learner.data import bundled_mnist_dir

    candidate = Path(mnist_dir) if mnist_dir else bundled_mnist_dir()
    if not any(candidate.glob("train-images*idx3-ubyte*")):
        raise FileNotFoundError(f"MNIST not found in {candidate}; pass --mnist-dir")
    return candidate


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def per_request_rules(f: dict) -> dict[str, bool]:
    """What a per-request figure must obey (learner/energy/request.py): a gross figure above zero
    from the counter (which advanced) or from power, else none with the reason; never 0 J; an
    idle-adjusted figure above zero or none with the reason; the method names both."""
    gross, adjusted = f.get("gross_j"), f.get("idle_adjusted_j")
    source_method = {"counter": "nvml-total-energy-counter-delta", "power": "power-at-window-end-x-duration"}
    return {
        "gross_above_zero": _finite(gross) and gross > 0,
        "gross_source_named": f.get("gross_source") in source_method
        and str(f.get("method", "")).startswith(source_method[f["gross_source"]]),
        "counter_used_only_where_it_advanced": f.get("gross_source") != "counter"
        or (f.get("counter_delta_mj", 0) > 0 and f["duration_s"] >= f["counter_update_s"] * (1 - 1e-9)),
        "idle_adjusted_above_zero_or_none_with_a_reason": (_finite(adjusted) and adjusted > 0)
        or (adjusted is None and bool(f.get("idle_adjusted_reason"))),
        "baseline_named": "idle baseline" in str(f.get("method", "")),
    }


def per_request_check(task, meter, backend, idle) -> dict:
    """One per-request figure (the service's path) around one run of the task, ``idle`` holding
    the cold idle recorded at the section's start; five idle samples first (the device is idle)."""
    from learner.backends import get_backend
    from learner.config import Config
    from learner.energy import request_energy
    from learner.train import prepare

    for _ in range(5):
        idle.sample(meter)
        time.sleep(0.2)
    backend = get_backend(backend) if isinstance(backend, str) else backend
    prepared = prepare(task, Config())
    out, figures = request_energy(meter, lambda: backend.run(task, prepared), idle)
    figures["cuda_ms"] = out.cuda_ms
    figures["rules"] = per_request_rules(figures)
    figures["ok"] = all(figures["rules"].values()) and len(idle) >= 5
    return figures


def reference_report(record: dict) -> dict | None:
    """The board's reference figures (per window: TFLOP/s, J per 10^12 FLOP on both meters), its
    band and the gate's verdict, and the band ``gates.band_from_run`` makes of these figures."""
    from learner.measure.gates import band_from_run

    if record.get("record_format") is None:
        return None
    windows = {name: {"tflop_per_s": f["tflop_per_s"],
                      "j_per_tflop": {m: f[m]["j_per_tflop"] for m in ("counter", "samples")}}
               for name, f in record["figures"]["reference"].items()}
    tflops = [w["tflop_per_s"] for w in windows.values() if _finite(w["tflop_per_s"])]
    joules = [j for w in windows.values() for j in w["j_per_tflop"].values() if _finite(j)]
    gate = record["gates"]["reference"]
    return {"board": (record.get("hardware") or {}).get("gpu"), "windows": windows,
            "band": record["thresholds"]["reference"]["band"], "status": gate["status"], "reason": gate["reason"],
            "band_from_this_run": band_from_run(tflops, joules) if tflops and joules else None,
            "band_rule": "learner.measure.gates.band_from_run: the mean of these figures x the A100 band's relative "
                         "width, rounded outwards"}


def sham_report(record: dict, windows: str) -> dict | None:
    if record.get("record_format") is None:
        return None
    gate = record["gates"]["sham_residual"]
    return {"windows": windows, "status": gate["status"], "fraction": gate["measured"]["fraction"],
            "limit": gate["threshold"]["max_fraction_of_task_net"], "reason": gate["reason"],
            "sham_seconds": record["plan"]["options"]["sham_seconds"],
            "settle_seconds": record["plan"]["options"]["settle_seconds"]}


def idle_report(record: dict) -> dict | None:
    if record.get("record_format") is None:
        return None
    idle = record["figures"]["idle"]
    return {"baseline": idle["baseline"], "cold": idle["cold"], "paired": idle["paired"],
            "settles": len(idle["settles"]), "settles_ended_by_cap": idle["settles_ended_by_cap"],
            "settle_seconds": [round(x["seconds"], 2) for x in idle["settles"]]}


def run(out_dir: Path, mnist_dir: Path | None = None, dry_run: bool = False, log=print,
        report: dict | None = None, deadline: float | None = None, reserve_s: float = 0.0, clock=None,
        **_) -> dict:
    """``report``: gpu_check.py's dict, filled as the steps end, so an interrupt keeps their
    figures; energy_check.json is written however the section ends (partial then). ``deadline``
    (time.monotonic) and ``reserve_s`` (the sections after this one): whether the long windows fit."""
    import torch

    import learner  # noqa: F401  (sets CUBLAS_WORKSPACE_CONFIG before CUDA starts)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {} if report is None else report
    if not dry_run and not torch.cuda.is_available():
        result.update({"ok": False, "passed": False, "reason": "no CUDA GPU visible to torch"})
        return result
    saved: dict = {"mode": common.mode_name(dry_run)}  # energy_check.json
    with common.kept(saved, out_dir / "energy_check.json"):
        return _run(result, saved, mnist_dir, dry_run, log, common.clock_for(clock, deadline), reserve_s)


# The gated protocol's windows. GATED_LONG: rev88 measure's defaults (129 s of windows:
# gpu_check_common.gated_window_seconds), what the sham residual's verdict needs. GATED_DEVICE:
# the short rehearsal (36 s of windows), run only when the budget cannot hold the long one. Its
# settle cap stays at 1 s: each trial's idle-adjusted energy must be > 0, and an idle window that
# starts while board power is still raised from the window before would eat into it.
GATED_LONG = dict(DEFAULTS)
GATED_DEVICE = dict(trials=2, target_seconds=2.0, settle_seconds=1.0, idle_seconds=1.0, reference_seconds=2.0,
                    sham_seconds=2.0)
GATED_DRY_RUN = dict(trials=2, target_seconds=1.0, settle_seconds=0.5, idle_seconds=1.0, reference_seconds=2.0,
                     sham_seconds=1.0)
# Beyond the long windows and the cold idle window: the sampler's start, the reference matmul's
# preparation and checks, the task's single runs (the first H200 run: 40.4 s for 36 s of windows
# and the per-request step), the counter's watch (0.6 s) and the per-request step (~2 s).
LONG_OVERHEAD_S = 10.0
LONG_NEED_S = common.gated_window_seconds(GATED_LONG) + GATED_LONG["idle_seconds"] + LONG_OVERHEAD_S


def windows_for(clock, reserve_s: float) -> tuple[str, str | None]:
    """The section's budget decision (scripts/gpu_budget.py replays it): the long windows when
    their need (the table's expected seconds of this section, = LONG_NEED_S: a test checks) fits in
    what is left of the budget beside ``reserve_s`` (the later sections' expected seconds) and in
    the section's own limit; else the short rehearsal, and why."""
    need = max(LONG_NEED_S, gpu_budget.SECTIONS["energy"].seconds)
    left, section_left = clock.budget_left(), clock.section_left()
    if left - reserve_s >= need and section_left >= need:
        return "long", None
    return "short", (f"the long windows need {need:.0f} s + {reserve_s:.0f} s for the sections after this "
                     f"one, {left:.0f} s of the budget were left ({section_left:.0f} s of the section's own limit); "
                     "the short rehearsal ran instead (no sham verdict on long windows)")
DRY_RUN_SCENARIOS = {"healthy": [], "counter-drift": ["meters_agree"]}  # scenario: the gates it must fail


def gated_checks(record: dict, prefix: str = "gated") -> dict[str, bool]:
    """What a gated record must show whatever its verdict: it re-analyzes exactly, every gate was
    evaluated, the sampler process ran cleanly, the reference product was right with TF32 off in
    both windows, and the task's hashes held."""
    from learner.measure.analyze import analyze

    if record.get("record_format") is None:
        return {f"{prefix}_record": False}
    analysis = analyze(json.loads(json.dumps(record)))
    sampler = record["raw"]["sampler"]
    reference = record["figures"]["reference"]
    limit = record["thresholds"]["reference"]["max_output_relative_error"]
    return {
        f"{prefix}_record": True,
        f"{prefix}_reanalyzes_exactly": analysis["reproduced"] and analysis["thresholds_match_code"] is True,
        f"{prefix}_every_gate_evaluated": all(g["status"] in ("pass", "fail", "unchecked")
                                              for g in record["gates"].values()),
        f"{prefix}_sampler_process_ran": (sampler["exit_code"] == 0 and not sampler["errors"]
                                          and len(sampler["samples"]) > 10),
        f"{prefix}_reference_output_checked": all(
            reference.get(w, {}).get("output_relative_error") is not None
            and reference[w]["output_relative_error"] <= limit and reference[w]["tf32_off"]
            for w in ("reference_before", "reference_after")),
        f"{prefix}_task_verified": record["gates"]["task_verified"]["passed"],
    }


def gate_summary(record: dict) -> dict:
    """Each gate's status, reason and measured headline number, for the report and the summary."""
    if record.get("record_format") is None:
        return {}
    return {name: {"status": g["status"], "reason": g["reason"]} for name, g in record["gates"].items()}


def _watch_counter(meter, board=None) -> dict:
    """The energy counter's update period: NVML's on a device (NvmlMeter.measure_counter_update),
    the simulated board's (25 ms) in a dry run."""
    from learner.energy import measure_update_period

    if board is not None:
        return measure_update_period(board, board.sleep)
    if meter is None:
        return {"period_s": None, "reason": "no meter"}
    return meter.measure_counter_update()


def _run(result: dict, saved: dict, mnist_dir: Path | None, dry_run: bool, log, clock, reserve_s: float = 0.0) -> dict:
    from learner.backends.cuda import GraphBackend
    from learner.config import Config
    from learner.energy import IdleBaseline, gpu_telemetry, open_meter
    from learner.measure.gated import measure_energy, measure_gated
    from learner.taskio import make_task

    started = time.perf_counter()
    task, labels = make_task(find_mnist(mnist_dir), DRAW0_SEED)
    chosen, why = windows_for(clock, reserve_s)
    long_fits = chosen == "long"
    protocol = dict(GATED_LONG if long_fits else GATED_DEVICE)
    windows = "long (rev88 measure's defaults)" if long_fits else "short (the budget could not hold the long ones)"
    result.update({"mode": common.mode_name(dry_run), "protocol": protocol, "protocol_windows": windows,
                   "windows": chosen})
    if not long_fits:
        result["budget_cut"] = why
    idle = IdleBaseline()
    scenarios: dict[str, dict] = {}
    if dry_run:  # the cuda backend's program, eagerly on the CPU, on the simulated board
        from learner.energy.simulated import SimulatedBoard

        task, labels = common.small_task(task, labels, 0, 1000, 250)
        meter, meter_reason = common.dry_run_meter(), None
        # its counter moves every 100 ms, as slow as the H200's may be: the per-request figure of a
        # shorter run is answered from power, the path the device is expected to take
        meter.update_period_s = 0.1
        engine = common.BusyEngine(GraphBackend("cpu"), meter)  # for the per-request figure
        idle.record_cold(meter)
        result["counter_update"] = _watch_counter(None, SimulatedBoard("healthy"))
        result["meter_reason"] = meter_reason
        for name in DRY_RUN_SCENARIOS:
            windows_here = protocol if name == "healthy" else GATED_DRY_RUN
            scenarios[name] = measure_gated(task, Config(), GraphBackend("cpu"), SimulatedBoard(name), **windows_here)
            result.setdefault("scenarios", {})[name] = {"valid": scenarios[name]["valid"],
                                                        "failed_gates": scenarios[name]["failed_gates"]}
        doc = scenarios["healthy"]
        saved["gated_scenarios"] = {name: rec for name, rec in scenarios.items() if name != "healthy"}
    else:
        meter, meter_reason = open_meter()
        engine = "cuda"
        result["meter_reason"] = meter_reason
        if meter is not None:  # before this section's work (the sections before it have worked the GPU)
            idle.record_cold(meter)
            result["cold_idle_at_section_start"] = idle.cold
            result["counter_update"] = _watch_counter(meter)
    health, health_reason = gpu_telemetry()
    saved["gpu_telemetry"] = health
    result["gpu_telemetry_reason"] = health_reason
    if not dry_run:
        doc = measure_energy(task, Config(), engine, **protocol)
    saved["gated"] = doc
    result.update({"energy_reason": doc.get("energy_reason"), "calibration_ms": doc["calibration_ms"],
                   "summary": None if doc["energy"] is None else doc["energy"]["summary"],
                   "valid": doc.get("valid"), "failed_gates": doc.get("failed_gates"), "gates": gate_summary(doc),
                   "net_mj_per_task": ((doc.get("figures") or {}).get("headline") or {}).get("net_mj_per_task"),
                   "reference": reference_report(doc), "sham_residual": sham_report(doc, windows),
                   "idle": idle_report(doc)})
    if meter is not None:
        request = per_request_check(task, meter, engine, idle)
    else:
        request = {"ok": False, "reason": meter_reason}
    saved["per_request"] = request

    energy = doc["energy"]
    checks: dict[str, bool] = {
        "meter_opened": meter is not None,
        "energy_object": energy is not None,
        "repeat_predictions_equal": doc["repeat_predictions_equal"],
        "repeat_state_hashes_equal": doc["repeat_state_hashes_equal"],
        "per_request_figure": bool(request.get("ok")),
        "counter_update_timed": (result.get("counter_update") or {}).get("period_s") is not None,
        **gated_checks(doc),
    }
    for name, expected in DRY_RUN_SCENARIOS.items() if dry_run else ():
        rec = scenarios[name]
        key = "simulated_" + name.replace("-", "_")
        checks[f"{key}_{'fails_' + '_'.join(expected) if expected else 'valid'}"] = rec["failed_gates"] == expected
        if name != "healthy":  # healthy is ``doc``: its gated_* checks above
            checks[f"{key}_reanalyzes_exactly"] = gated_checks(rec, key)[f"{key}_reanalyzes_exactly"]
    if dry_run:  # no NVML here: telemetry must degrade to a reason, not fail
        checks["gpu_telemetry_degrades_to_a_reason"] = health is None and isinstance(health_reason, str)
    else:
        checks["gpu_telemetry"] = (health is not None and _finite(health.get("power_w"))
                                   and _finite(health.get("energy_counter_mj")))
        checks["memory_peak_recorded"] = (bool(doc["memory"])
                                          and doc["memory"]["prepare_and_invoke_peak_allocated_bytes"] > 0)
    per_task = []
    if energy is not None:
        hw = energy["hardware"]
        if not dry_run:
            # by PCI bus id, else by UUID (learner.energy's fallback); either names the CUDA device
            checks["nvml_handle_matches_the_cuda_device"] = hw.get("nvml_handle_selected_by") in ("pci_bus_id", "uuid")
            checks["calibrated_with_cuda_events"] = doc["protocol"]["calibration"] == "CUDA events"
        for t in energy["trials"]:
            adjusted, unadjusted = t["idle_adjusted_mj_per_task"], t["unadjusted_mj_per_task"]
            per_task.append(
                {
                    "trial": t["trial"],
                    "invocations": t["invocations"],
                    "idle_adjusted_mj_per_task": adjusted,
                    "unadjusted_mj_per_task": unadjusted,
                    "paired_idle_w": t["paired_idle_w"],
                    "cuda_ms_per_task": t["cuda_ms_per_task"],
                    "wall_ms_per_task": t["wall_ms_per_task"],
                    "active_s": t["active"]["duration_s"],
                }
            )
            time_ok = (_finite(t["wall_ms_per_task"]) and t["wall_ms_per_task"] > 0) if dry_run else (
                _finite(t["cuda_ms_per_task"]) and 0 < t["cuda_ms_per_task"] <= t["wall_ms_per_task"] * 1.01)
            checks[f"trial{t['trial']}_figures_sane"] = bool(
                _finite(adjusted) and _finite(unadjusted) and 0 < adjusted < unadjusted and time_ok
                and t["active"]["energy_j"] > 0 and t["idle_before"]["energy_j"] > 0
            )
    ok = all(checks.values())
    # the short windows are a measurement the budget cut (no sham verdict on long windows): not a
    # pass, exit status 3 when nothing else failed (gpu_check.exit_status)
    passed = ok and long_fits
    result.update({
        "mode": common.mode_name(dry_run),
        "ok": passed,
        "checks_passed": ok,
        "passed": passed,
        "checks": checks,
        "meter_reason": meter_reason,
        "gpu_telemetry_reason": health_reason,
        "energy_reason": doc.get("energy_reason"),
        "calibration_ms": doc["calibration_ms"],
        "repeats_per_trial": doc["repeats_per_trial"],
        "per_task": per_task,
        "summary": None if energy is None else energy["summary"],
        "hardware": doc["hardware"],
        "memory": doc["memory"],
        "per_request": {k: request.get(k) for k in ("gross_j", "gross_source", "gross_reason", "idle_adjusted_j",
                                                     "idle_adjusted_reason", "idle_baseline_w", "cold_idle_w",
                                                     "duration_s", "counter_delta_mj", "counter_update_s",
                                                     "counter_update_source", "power_end_w", "method", "estimate",
                                                     "cuda_ms", "rules", "reason")},
        # information, not a check: whether the cuda backend reproduces the cpu predictions
        "predictions_sha256": doc["predictions_sha256"],
        "predictions_match_cpu_reference": None if dry_run else doc["predictions_sha256"] == CPU_PREDICTIONS_SHA256,
        "seconds": time.perf_counter() - started,
    })
    if dry_run:
        result["not_checked_in_dry_run"] = [
            "NVML (the board is simulated: its joules and seconds are its model's)", "GPU telemetry",
            "CUDA-event calibration", "the CUDA memory peak", "the NVML handle's selection by PCI bus id or UUID",
            "the sampler's NVML source (the simulated board's source ran)", "the 4096 x 4096 reference matmul on "
            "a GPU (an n = 64 product was computed and checked)", "the compute-process check against NVML",
            "draw 0's predictions (a 1,000/250 slice ran)", "NVML's counter update period (the simulated "
            "board's 25 ms was timed)", "the cold idle and the settles on a real board (the simulated board's "
            "healthy model has no post-work curve)", "the H200's reference band against a real run"]
    _print(result, log)
    return result


def _n(x, spec: str = ".3f") -> str:
    return format(x, spec) if _finite(x) else "n/a"


def _print(r: dict, print=print) -> None:
    print(f"energy check: {'ok' if r['ok'] else 'FAILED'} in {r['seconds']:.1f} s")
    for name, passed in r["checks"].items():
        print(f"  {'ok  ' if passed else 'FAIL'} {name}")
    if r["energy_reason"]:
        print(f"  energy: none ({r['energy_reason']})")
    counter = r.get("counter_update") or {}
    print(f"  energy counter: updates every {_n(counter.get('period_s') and counter['period_s'] * 1000, '.1f')} ms "
          f"({counter.get('changes')} changes in {_n(counter.get('watched_s'))} s watched)"
          + (f": {counter['reason']}" if counter.get("reason") else ""))
    cold = r.get("cold_idle_at_section_start")
    if cold:
        print(f"  idle at this section's start: {_n(cold['power_w'], '.1f')} W, graphics clock "
              f"{cold['graphics_clock_mhz']} MHz, memory clock {cold['memory_clock_mhz']} MHz")
    print(f"  gated windows: {r.get('protocol_windows')} {r.get('protocol')}"
          + (f"; budget cut: {r['budget_cut']}" if r.get("budget_cut") else ""))
    print(f"  calibration {r['calibration_ms']:.3f} ms -> {r['repeats_per_trial']} tasks per trial")
    for t in r["per_task"]:
        print(
            f"  trial {t['trial']}: idle-adjusted {_n(t['idle_adjusted_mj_per_task'], '.1f')} mJ/task, "
            f"unadjusted {_n(t['unadjusted_mj_per_task'], '.1f')} mJ/task, paired idle {_n(t['paired_idle_w'], '.2f')} W, "
            f"cuda {_n(t['cuda_ms_per_task'])} ms/task, wall {t['wall_ms_per_task']:.3f} ms/task "
            f"({t['invocations']} tasks in {t['active_s']:.3f} s)"
        )
    if r["summary"]:
        for key, s in r["summary"].items():
            if s:
                sd = "n/a" if s["sample_sd"] is None else f"{s['sample_sd']:.3f}"
                print(f"  {key}: mean {s['mean']:.3f}, sample SD {sd}")
    if r.get("gates"):
        head = r.get("net_mj_per_task") or {}
        print(f"  gated record: valid {r.get('valid')}; net {_n(head.get('mean'), '.1f')} mJ/task "
              f"(the counter, harness control subtracted; {r.get('protocol_windows')} windows)")
        for name, g in r["gates"].items():
            print(f"    {g['status']:9s} {name:14s} {g['reason']}")
    ref = r.get("reference")
    if ref:
        for name, w in ref["windows"].items():
            print(f"  reference on {ref['board']}, {name}: {_n(w['tflop_per_s'], '.2f')} TFLOP/s, "
                  f"{_n(w['j_per_tflop']['counter'], '.2f')} J per 10^12 FLOP (counter), "
                  f"{_n(w['j_per_tflop']['samples'], '.2f')} (samples)")
        band = ref["band"]
        print("  reference band: " + (f"{band['j_per_tflop']} J per 10^12 FLOP, {band['tflop_per_s']} TFLOP/s "
                                      f"({band['device']}): {ref['status']}" if band else
                                      f"none for {ref['board']!r}: {ref['status']}"))
        print(f"  a band from this run (gates.band_from_run, for REFERENCE_BANDS[{ref['board']!r}]): "
              f"{json.dumps(ref['band_from_this_run'])}")
    sham = r.get("sham_residual")
    if sham:
        print(f"  sham residual on {sham['windows']} windows ({sham['sham_seconds']} s sham, settles of at most "
              f"{sham['settle_seconds']} s): {_n(sham['fraction'] and sham['fraction'] * 100, '.2f')} % of the task's "
              f"net, limit {sham['limit']:.0%}: {sham['status']}")
    idle = r.get("idle")
    if idle and idle["cold"]:
        c = idle["cold"]
        print(f"  cold idle (before the protocol's work): {_n(c['counter_w'], '.2f')} W counter, "
              f"{_n(c['samples_w'], '.2f')} W samples, graphics clock {c['graphics_clock_mhz']} MHz; baseline used: "
              f"{idle['baseline']} idle, {idle['settles_ended_by_cap']} of {idle['settles']} settles ended by their cap")
        for name, p in idle["paired"].items():
            print(f"    paired idle {name}: {_n(p['counter_w'], '.2f')} W counter ({_n(p['counter_minus_cold_w'], '+.2f')} W "
                  f"against the cold idle), {_n(p['samples_w'], '.2f')} W samples")
    for name, sc in (r.get("scenarios") or {}).items():
        print(f"  simulated {name}: valid {sc['valid']}, failed gates {sc['failed_gates'] or 'none'}")
    req = r["per_request"]
    if req.get("gross_j") is not None:
        adjusted = (f"{req['idle_adjusted_j']:.3f} J idle-adjusted" if req["idle_adjusted_j"] is not None
                    else f"no idle-adjusted figure ({req['idle_adjusted_reason']})")
        print(f"  one request: {req['gross_j']:.3f} J gross from {req['gross_source']}, {adjusted}, over "
              f"{req['duration_s'] * 1000:.1f} ms (estimate: {req['estimate']}; counter moved {req['counter_delta_mj']} mJ, "
              f"period {_n(req['counter_update_s'] * 1000, '.1f')} ms)")
    elif req:
        print(f"  one request: no figure ({req.get('gross_reason') or req.get('reason')})")
    print(f"  predictions_sha256 {r['predictions_sha256'][:16]}… matches the draw-0 reference: {r['predictions_match_cpu_reference']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default="gpu-check-out")
    parser.add_argument("--mnist-dir", type=Path)
    parser.add_argument("--dry-run", action="store_true", help="on the CPU with a simulated meter")
    args = parser.parse_args(argv)
    result = run(Path(args.out_dir), args.mnist_dir, dry_run=args.dry_run)
    if "checks" not in result:
        print(f"energy check: not run ({result['reason']})")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
