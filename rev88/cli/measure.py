"""``rev88 measure``: joules and milliseconds per task, and ``rev88 measure analyze RECORD.json``.

On a GPU (an NVML meter) ``rev88 measure`` runs the gated protocol (learner/measure/gated.py,
docs/energy.md) and writes its record; ``--simulate SCENARIO`` runs the same protocol on the
simulated board on the CPU. The record is valid only when every gate passes; an invalid record
is still written, its failed gates are printed with why, and the exit status is 1 unless
``--allow-invalid``. On a CPU backend there is no energy meter: timing per task only (exit 0).

``rev88 measure analyze RECORD.json`` recomputes every figure and gate from the record's raw
readings, prints them, and compares them with the record exactly: exit 0 when everything
matches and the record is valid, 1 when anything differs (or the record is invalid, unless
``--allow-invalid``), 2 when the file is not a record it can read.

The parser, ``main`` and the exit statuses of every command are in ``rev88/cli/__init__.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .common import CliError, write_json

REHEARSAL_TASK = {"train": 64, "queries": 16, "seed": 0}


def _rehearsal_task():
    """A small synthetic task for ``--simulate`` without ``--input`` (pixels in [0, 1], labels 0..9)."""
    import numpy as np

    from learner.taskio import validate_task

    rng = np.random.default_rng(REHEARSAL_TASK["seed"])
    n, m = REHEARSAL_TASK["train"], REHEARSAL_TASK["queries"]
    return validate_task(rng.random((n, 1, 9, 9), dtype=np.float32), rng.integers(0, 10, n).astype(np.int64),
                         rng.random((m, 1, 9, 9), dtype=np.float32))


def _fmt(stat: dict | None, unit: str) -> str:
    if stat is None:
        return "n/a"
    sd = stat.get("sample_sd")
    return f"{stat['mean']:.3f} {unit}" + ("" if sd is None else f" (sample SD {sd:.3f})")


def _num(x, spec: str = ".4g") -> str:
    return "n/a" if x is None else format(x, spec)


# --------------------------------------------------------------------------- printing


def figure_lines(figures: dict) -> list[str]:
    """Every figure of a gated record, one line per window."""
    lines = []
    for name, r in figures["reference"].items():
        c, s = r["counter"], r["samples"]
        lines.append(f"{name}: {r['calls']} matmuls, {r['tflop']:.4g} TFLOP in {r['duration_s']:.3f} s = "
                     f"{_num(r['tflop_per_s'])} TFLOP/s; J per 10^12 FLOP counter {_num(c['j_per_tflop'])}, samples "
                     f"{_num(s['j_per_tflop'])} (paired idle {_num(c['paired_idle_w'])} / {_num(s['paired_idle_w'])} W); "
                     f"output relative error {_num(r['output_relative_error'], '.3g')}, TF32 off {r['tf32_off']}")
    sham = figures["sham"]
    if sham:
        lines.append(f"sham: {sham['duration_s']:.3f} s idle = {_num(sham['nominal_calls'])} nominal calls; net "
                     f"{_num(sham['counter']['net_mj_per_nominal_call'])} mJ per nominal call (samples "
                     f"{_num(sham['samples']['net_mj_per_nominal_call'])})")
    h = figures["harness"]
    if h:
        lines.append(f"harness control: {h['calls']} calls in {h['duration_s']:.3f} s; net "
                     f"{_num(h['counter']['net_mj_per_call'])} mJ per call (samples {_num(h['samples']['net_mj_per_call'])})")
    for t in figures["trials"]:
        c, s = t["counter"], t["samples"]
        lines.append(f"trial {t['trial']}: {t['invocations']} tasks in {t['active_s']:.3f} s; active "
                     f"{_num(c['active_w'])} W counter, {_num(s['active_w'])} W samples (differ "
                     f"{_num(t['meters_relative_difference'], '.2%') if t['meters_relative_difference'] is not None else 'n/a'}); "
                     f"paired idle {_num(c['paired_idle_w'])} W; idle-adjusted {_num(c['idle_adjusted_mj_per_task'])} "
                     f"mJ/task (samples {_num(s['idle_adjusted_mj_per_task'])}); net {_num(t['net_mj_per_task'])} mJ/task")
    tel = figures["telemetry"]
    lines.append(f"telemetry: {tel['samples']} samples every {tel['period_s']} s ({tel['power_query']}); largest gap "
                 f"{_num(tel['max_gap_s'], '.3f')} s; {tel['error_count']} error(s); clock shared {tel['clock_shared']}")
    p = figures["processes"]
    lines.append(f"processes: {len(p['checks'])} checks, most other compute processes at one check: "
                 f"{p['max_other_processes']}")
    task = figures["task"]
    lines.append(f"task: hashes identical before/after {task['hashes_identical']}, predictions equal "
                 f"{task['predictions_equal']}")
    idle = figures.get("idle")
    if idle:
        cold = idle["cold"] or {}
        lines.append(f"idle: baseline {idle['baseline']}; cold idle {_num(cold.get('counter_w'))} W counter, "
                     f"{_num(cold.get('samples_w'))} W samples, graphics clock {cold.get('graphics_clock_mhz')} MHz; "
                     f"{idle['settles_ended_by_cap']} of {len(idle['settles'])} settles ended by their cap")
        lines.append("paired idle against the cold idle: " + ", ".join(
            f"{name} {_num(p['counter_minus_cold_w'], '+.3g')} W" for name, p in idle["paired"].items()))
    lines.append(f"net energy per task (the gated figure, counter): {_fmt(figures['headline']['net_mj_per_task'], 'mJ')}")
    return lines


def gate_lines(gates: dict) -> list[str]:
    return [f"  {g['status'].upper() if not g['passed'] else 'pass':9s} {name:14s} {g['reason']}"
            for name, g in gates.items()]


def failure_lines(command: str, gates: dict) -> list[str]:
    out = []
    for name, g in gates.items():
        if not g["passed"]:
            out.append(f"rev88 {command}: gate {name} {g['status']}: {g['reason']}")
    return out


# --------------------------------------------------------------------------- rev88 measure


def cmd_measure(args: argparse.Namespace) -> int:
    from learner.config import Config, load_config_file
    from learner.measure.gated import check_gated_protocol, measure_energy, measure_gated
    from learner.taskio import load_task

    if not args.output:
        raise CliError("--output is required")
    if not args.input and args.simulate is None:
        raise CliError("--input is required (without it, --simulate SCENARIO uses a small synthetic task)")
    options = {"trials": args.trials, "target_seconds": args.target_seconds, "settle_seconds": args.settle_seconds,
               "idle_seconds": args.idle_seconds, "reference_seconds": args.reference_seconds,
               "sham_seconds": args.sham_seconds}
    check_gated_protocol(**options)
    config = load_config_file(args.config) if args.config else Config()
    task = load_task(args.input) if args.input else _rehearsal_task()
    if args.simulate is not None:
        from learner.backends import get_backend, resolve
        from learner.energy.simulated import SimulatedBoard

        name = resolve(args.backend)
        if name not in ("cpu", "cpu-fast"):
            raise CliError(f"--simulate runs the learner on the CPU: choose --backend cpu or cpu-fast ({args.backend!r} "
                           f"is {name!r} here)")
        doc = measure_gated(task, config, get_backend(name), SimulatedBoard(args.simulate, seed=args.simulate_seed),
                            **options)
    else:
        doc = measure_energy(task, config, args.backend, **options)
    output = Path(args.output)
    write_json(output, doc)
    print(f"backend {doc['backend']} on {doc['device']}: calibration {doc['calibration_ms']:.3f} ms, "
          f"{doc['repeats_per_trial']} tasks per trial x {args.trials} trials")
    wall = doc["timing"]["wall_ms_per_task"]
    print(f"wall ms per task: median {wall['median']:.3f}, mean {wall['mean']:.3f}, min {wall['min']:.3f}, "
          f"max {wall['max']:.3f}" + ("" if wall["sample_sd"] is None else f", sample SD {wall['sample_sd']:.3f}"))
    if doc.get("record_format") is None:  # no energy meter: the timing-only document
        print(f"energy: none ({doc['energy_reason']})")
        print(f"repeat predictions equal: {doc['repeat_predictions_equal']}, "
              f"state hashes equal: {doc['repeat_state_hashes_equal']}; wrote {output}")
        if not (doc["repeat_predictions_equal"] and doc["repeat_state_hashes_equal"]):
            print("rev88 measure: error: the run after the trials differs from the run before them", file=sys.stderr)
            return 1
        return 0
    board = doc["board"]
    print(f"board: {board['kind']} {board.get('gpu')}" + (f", scenario {board['scenario']} ({board['scenario_fault']})"
                                                          if board["kind"] == "simulated" else ""))
    for line in figure_lines(doc["figures"]):
        print(line)
    print("gates:")
    for line in gate_lines(doc["gates"]):
        print(line)
    print(f"valid: {str(doc['valid']).lower()}; wrote {output} (plan_sha256 {doc['plan_sha256'][:16]}…, "
          f"raw_sha256 {doc['raw_sha256'][:16]}…)")
    if doc["valid"]:
        return 0
    for line in failure_lines("measure", doc["gates"]):
        print(line, file=sys.stderr)
    if args.allow_invalid:
        print("rev88 measure: the record is invalid; kept and exit status 0 because of --allow-invalid", file=sys.stderr)
        return 0
    print("rev88 measure: error: the record is invalid (the figures are not a gated result); "
          "--allow-invalid keeps exit status 0", file=sys.stderr)
    return 1


# --------------------------------------------------------------------------- rev88 measure analyze


def cmd_analyze(args: argparse.Namespace) -> int:
    from learner.measure.analyze import AnalyzeError, analyze

    path = Path(args.record)
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise CliError(f"record not found: {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CliError(f"{path} is not a JSON record: {exc}") from None
    try:
        result = analyze(record)
    except AnalyzeError as exc:
        raise CliError(f"{path}: {exc}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise CliError(f"{path}: a record field is missing or malformed ({type(exc).__name__}: {exc})") from None
    print(f"record {path}: {result['format']}; board {result['board'].get('kind')} {result['board'].get('gpu')}"
          + (f", scenario {result['board']['scenario']}" if result["board"].get("scenario") else ""))
    figures = result["figures"]
    if result["format"].startswith("rev88-gated"):
        for line in figure_lines(figures):
            print(line)
    else:
        for t in figures["trials"]:
            print(f"trial {t['trial']}: {t['invocations']} tasks; paired idle {_num(t['paired_idle_w'])} W; idle-adjusted "
                  f"{_num(t['idle_adjusted_mj_per_task'])} mJ/task; unadjusted {_num(t['unadjusted_mj_per_task'])} mJ/task; "
                  f"wall {_num(t['wall_ms_per_task'])} ms/task")
        for key, stat in figures["summary"].items():
            print(f"{key}: {_fmt(stat, 'mJ' if key.endswith('_mj_per_task') else 'ms')}")
        for note in result["not_recomputable"]:
            print(f"note: {note}")
    print("gates:")
    for line in gate_lines(result["gates"]):
        print(line)
    if args.output:
        write_json(Path(args.output), result)
    status = 0
    if result["reproduced"]:
        print(f"reproduced: all {result['values_compared']} recomputed values equal the record's exactly")
    else:
        print(f"NOT reproduced: {len(result['differences'])} value(s) differ from the record", file=sys.stderr)
        for d in result["differences"][:20]:
            print(f"  {d['path']}: recorded {d['recorded']!r}, recomputed {d['recomputed']!r}", file=sys.stderr)
        status = 1
    if result["thresholds_match_code"] is False:
        print("rev88 measure analyze: the record's thresholds differ from the ones this code sets for its board",
              file=sys.stderr)
        status = 1
    print(f"valid: {str(result['valid']).lower()}")
    if not result["valid"]:
        for line in failure_lines("measure analyze", result["gates"]):
            print(line, file=sys.stderr)
        if not args.allow_invalid:
            status = 1
    return status


# --------------------------------------------------------------------------- parser


def add_measure(sub) -> None:
    from learner.backends import NAMES
    from learner.energy.simulated import SCENARIOS
    from learner.measure.gates import DEFAULTS

    d = DEFAULTS
    p = sub.add_parser(
        "measure",
        help="joules and milliseconds per task: the gated energy protocol on a GPU or a simulated board "
             "(timing only on CPU); 'rev88 measure analyze RECORD.json' re-analyzes a record",
        description="The gated energy protocol (docs/energy.md): two meters, reference matmul windows before and "
                    "after the task windows, an idle-only sham, a harness control and seven gates. Exit status: 0 "
                    "a valid record (or timing only on a CPU backend), 1 an invalid record (unless --allow-invalid), "
                    "2 bad input.",
    )
    p.add_argument("--input", help="task npz: train_images, train_labels, test_images (optional with --simulate)")
    p.add_argument("--config", help="JSON object of config overrides (unknown keys are an error)")
    p.add_argument("--backend", default="auto", choices=NAMES)
    p.add_argument("--trials", type=int, default=d["trials"], help=f"task trials (>= 1; default {d['trials']})")
    p.add_argument("--target-seconds", type=float, default=d["target_seconds"],
                   help=f"active window per trial, and the harness control's (> 0; default {d['target_seconds']:g})")
    p.add_argument("--settle-seconds", type=float, default=d["settle_seconds"],
                   help="the most a settle before an idle window lasts; it ends sooner once the power stops falling "
                        f"(>= 0; default {d['settle_seconds']:g})")
    p.add_argument("--idle-seconds", type=float, default=d["idle_seconds"],
                   help=f"each idle window (>= 0; default {d['idle_seconds']:g})")
    p.add_argument("--reference-seconds", type=float, default=d["reference_seconds"],
                   help=f"each reference matmul window (> 0; default {d['reference_seconds']:g})")
    p.add_argument("--sham-seconds", type=float, default=d["sham_seconds"],
                   help=f"the idle-only sham window (> 0; default {d['sham_seconds']:g})")
    p.add_argument("--simulate", choices=list(SCENARIOS), metavar="SCENARIO",
                   help="run on the simulated board on the CPU: " + ", ".join(SCENARIOS))
    p.add_argument("--simulate-seed", type=int, default=0, help="the simulated board's noise seed (default 0)")
    p.add_argument("--allow-invalid", action="store_true", help="exit 0 even when a gate fails (the record says so)")
    p.add_argument("--output", help="record JSON to write (required when measuring)")
    p.set_defaults(func=cmd_measure)
    actions = p.add_subparsers(dest="measure_action", metavar="analyze")
    a = actions.add_parser("analyze", help="recompute every figure and gate of a record from its raw readings",
                           description="Recompute every figure and gate of RECORD.json from its raw readings, print "
                                       "them and compare them with the record exactly. Exit status: 0 reproduced "
                                       "and valid, 1 a difference (or an invalid record unless --allow-invalid), "
                                       "2 not a readable record.")
    a.add_argument("record", help="a record written by rev88 measure (or the reference record's paired-idle energy)")
    a.add_argument("--allow-invalid", action="store_true", help="exit 0 for an invalid record that reproduces")
    a.add_argument("--output", help="write the analysis as JSON here")
    a.set_defaults(func=cmd_analyze)
