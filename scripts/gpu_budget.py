"""The device seconds of every part of the GPU runs: the one table scripts/gpu_check.py and
scripts/gpu_tune.py read, the documented plans (docs/gpu.md), and the replay of a plan against
the table with the scripts' own budget rules.

    python3 scripts/gpu_budget.py               # every plan replayed: each section's projected seconds
    python3 scripts/gpu_budget.py --plan two-call

Each figure says where it comes from. "Measured" figures are the first GPU run's
(../shared/notes/gpu-h200.md: one NVIDIA H200, 2026-12-04, the one-shot of main at 3004785);
what the sections gained since is added with its own basis, and a figure nobody has measured
says so. A projection is only as good as these figures: the next GPU run's report
(``gpu_check.json``: each section's ``seconds`` beside ``estimated_device_seconds``) is what to
correct them from.

The rules are the scripts': a section starts only with its minimum left (``gpu_check.may_start``),
keeps the later sections' expected seconds in reserve (``gpu_check.reserve_after``), runs under its
own limit (``gpu_check.section_limit_s``); the energy section runs rev88 measure's long windows only
when they fit beside that reserve (``gpu_check_energy.windows_for``), the fused section its energy
trials (``gpu_check_fused.energy_trials_fit``), the tests section its pytest under a cap
(``gpu_check_tests.cap_for``), the tuning run each candidate (``gpu_tune.candidate_fits``). ``replay``
drives ``gpu_check.run_check`` itself -- its loop, its reserve, its exit status -- with a clock that
advances by this table's seconds and stand-in sections that call those rules where the real
sections call them. tests/test_gpu_budget.py replays every plan and fails when a section would be
cut or a measurement skipped; ``gpu_check.py --dry-run`` and ``gpu_tune.py --dry-run`` make the same
decisions on the same projected clock while they run every section on the CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

H200 = "the first GPU run (../shared/notes/gpu-h200.md, an H200, 2026-12-04)"
# what a call carries: the service's wheels and the carried cpu reference (scripts/gpu_prepare.sh)
CARRY_DEFAULTS = (".device-wheels", ".device-reference/cpu_reference.npz")
CARRY = (".device-wheels", ".device-reference")


@dataclasses.dataclass(frozen=True)
class Cost:
    """Expected device seconds of a part, its own time limit (a section or a step is stopped past
    it; None: only the run's budget), and where the figure comes from."""

    seconds: float
    limit_s: float | None
    source: str


# --------------------------------------------------------------------------- the sections

# The energy section's windows (gpu_check_common.gated_window_seconds of gpu_check_energy's
# protocols; tests/test_gpu_budget.py checks these against the protocols themselves).
ENERGY_LONG_WINDOWS_S = 129.0  # GATED_LONG: rev88 measure's defaults, settles counted at their caps
ENERGY_SHORT_WINDOWS_S = 36.0  # GATED_DEVICE
ENERGY_OVERHEAD_S = 10.0  # gpu_check_energy.LONG_OVERHEAD_S
# The fused section's energy trials: learner.measure.paired per variant (cuda, fused, fused-T) with
# gpu_check_fused.PERF_DEVICE's arguments: a cold idle window (1 s) + 2 trials x (settle <= 1 + idle
# 1 + active 2 + settle <= 1 + idle 1) = 13 s of windows, + ~1 s of runs (first run, calibration,
# the run after); tests/test_gpu_budget.py checks the 13 s against PERF_DEVICE.
FUSED_ENERGY_WINDOWS_PER_VARIANT_S = 13.0

SECTIONS: dict[str, Cost] = {
    "precheck": Cost(12, 45, f"measured 9.4 s in {H200} (imports, a Triton compile and launch, three cc runs); "
                             "+2.6 s: its checks are the same since"),
    "cuda": Cost(18, 60, "measured 10.9 s (graphs, draw 0 against cpu, CUDA ms) in the first run; since: the eleven "
                         "draws built from MNIST (2.6 s on this 2-core machine), 11 replays of ~60 ms, the carried cpu "
                         "reference read and its task digests checked (~1 s): ~15 s; 18"),
    # energy: long windows; the short fallback is ENERGY_PARTS["short"]
    "energy": Cost(ENERGY_LONG_WINDOWS_S + 3 + ENERGY_OVERHEAD_S, 200,
                   "rev88 measure's default windows, 129 s at most (settles are caps), + the 3 s cold idle + 10 s "
                   "(LONG_OVERHEAD_S: the first run spent 40.4 s on 36 s of windows and a 1 s cold idle, 3.4 s "
                   "beyond them): 142 = gpu_check_energy.LONG_NEED_S; never run on a GPU with these windows"),
    "fused": Cost(67, 130, "measured 57.1 s in the first run (compiles, draw 0, a 132-task launch, self-check, "
                           "timing, three energy protocols of 13 s of windows each); since: draw 0 and the launch "
                           "checked against the cpu backend, the eleven draws alone and in one launch (~5 s): "
                           "checks 20 + timing 5 + energy trials 42 (FUSED_PARTS)"),
    "service": Cost(59, 150, "measured 35.9 s in the first run (ready in 13.9 s); since: issue #46's 1,320-cell "
                             "sweep (5.6 s at the 236 cells/s measured by bench_sweep on the H200, its rows read "
                             "back, 132 seeds prepared and 11 fused launches in process: ~10 s), margin 13 s; "
                             "not yet measured with the sweep"),
    "tune": Cost(0, 260, "scripts/gpu_tune.py as a section: TUNE below, phase by phase (filled in below)"),
    "tests": Cost(40, 100, "not measured: only the tests marked gpu run now (tests/test_cuda.py's graph replays, "
                           "tests/test_fused.py's compiled kernel on two small cases); pytest and torch start and "
                           "CUDA ~9 s (the precheck's 9.4 s holds the same), ~4 Triton compiles of ~5.6 s (the "
                           "first run's first fused task), the runs themselves ~2 s: ~34 s; 40"),
}
# Where a section's own budget decision falls: the parts before it and after it (the fused energy
# trials are decided after its checks; the energy section's windows at its start).
# energy: the long windows are SECTIONS["energy"]; the short fallback measured 40.4 s (the first run)
ENERGY_PARTS = {"short": ENERGY_SHORT_WINDOWS_S + 1 + 4}
# fused: its expected seconds are these parts' sum (SECTIONS["fused"] says the same, a test checks)
FUSED_PARTS = {"checks": 20.0, "timing": 5.0, "energy_trials": 3 * (FUSED_ENERGY_WINDOWS_PER_VARIANT_S + 1)}

# gpu_device_run.sh around gpu_check.py: before it (gpu_carried.py, nvidia-smi, 15 wheels installed,
# libcuda, Python.h) and after it (the last tar, the summary). The first run's call was held 188 s
# for a 154 s one-shot: 34 s for these, the transfers and the tool's own start of the command.
SETUP_S = Cost(10, None, "the first run: 188 s held for 154 s of gpu_check.py, 34 s with the transfers")
TAIL_S = Cost(3, None, "a tar of the run's folder and the summary (the first run: ~1 s)")
TRANSFER_S = 20  # the tool's copies before and after a call (the first run: 30-40 s for start and transfers)
START_S = 120  # a machine's start: 30 s to 2 minutes (the device tool's notes); the worst is planned for

# Fewer seconds left than this and a section is not started (skipped for the budget). On a GPU: a
# section's smallest useful run; in a dry run from its own times here (2-core machine, quiet:
# precheck 1-3 s, cuda 2-13 s, energy 4-11 s, fused 17-75 s, service 7-46 s, tune 60-200 s, tests
# 5-15 s), low enough that a short budget (--budget-s 20) starts a section and interrupts it.
MIN_START_S = {
    "device": {"precheck": 0, "cuda": 15, "energy": 20, "fused": 60, "service": 45, "tune": 60, "tests": 30},
    "dry-run": {"precheck": 0, "cuda": 3, "energy": 3, "fused": 5, "service": 5, "tune": 5, "tests": 5},
}
# A dry run's own limit per section (the CPU's seconds, not the device's): its budget is the bound.
DRY_RUN_SECTION_LIMIT_S = 600.0

# --------------------------------------------------------------------------- the tuning run

TUNE: dict[str, Cost] = {
    "start": Cost(12, None, "imports, CUDA start, the libcuda lookup (the first run's precheck: 9.4 s with a compile)"),
    "draws": Cost(6, 60, "the eleven draws from MNIST (2.6 s here) and 131 reorderings of draw 0 for the launches "
                         "(528 in 2.4 s on the H200 host): 3.2 s; the carried reference's task digests ~1 s"),
    "compile_kernel": Cost(6, None, "one kernel for sm_90: the first run's first fused task took 5.6 s with its compile"),
    "compile_worker_start": Cost(15, None, "a worker process's imports and CUDA context (the precheck: 9.4 s)"),
    # the compile phase's limit: its expected seconds (compile_seconds) plus this
    "compile_margin": Cost(60, None, "room over the compile phase's estimate before it is stopped"),
    "reference": Cost(1, 90, "the carried cpu reference (.device-reference, scripts/gpu_prepare.sh) read: ~1 s; "
                             "without it a child computes it beside the compiles (1.9 s of cpu backend for the "
                             "eleven draws here, ~30 s with the 131 launch tasks), limited to 90 s"),
    "fused_one": Cost(5, 25, "the eleven draws in one launch, 1 + 5 single runs (24-39 ms each on the H200), "
                             "1 + 3 launches of 132 (0.7 s of staging each: 528 tasks prepared in 2.4 s), the "
                             "launch's bytes digested"),
    "fused_split": Cost(3, 20, "the eleven draws (~320 launches per task: ~1.5 s), 1 + 5 single runs"),
    "cuda": Cost(4, 20, "a capture, the eleven draws one after another (60 ms each on the H200), 1 + 5 timed runs"),
    "cuda_other_workspace": Cost(15, 60, "a child process: imports and CUDA (~9 s: the precheck), the draws "
                                         "built (2.6 s), a capture, 11 draws and 6 timed runs (~2 s)"),
    "report": Cost(3, None, "the choice, tuned.py, tune.json and the summary"),
}
COMPILE_WORKERS = 6  # worker processes compiling at once (16 host cores)
TUNE_BUDGET_S = {"device": 360, "dry-run": 1800}  # gpu_tune.py alone: its --budget-s defaults
TUNE_DEVICE_LIMIT_S = 360  # what a run of gpu_tune.py alone must fit on one H200


def compile_seconds(kernels: int) -> float:
    """The compile phase: ``kernels`` compiled by COMPILE_WORKERS processes (after their start)."""
    rounds = math.ceil(kernels / COMPILE_WORKERS) if kernels else 0
    return TUNE["compile_worker_start"].seconds + rounds * TUNE["compile_kernel"].seconds


def candidate_cost(kind: str, variant: str | None, workspace: str | None) -> Cost:
    """The cost row of one tuning candidate."""
    if workspace:
        return TUNE["cuda_other_workspace"]
    if kind == "cuda":
        return TUNE["cuda"]
    return TUNE["fused_split" if variant == "split" else "fused_one"]


def tune_phases(cands) -> dict[str, float]:
    """The expected device seconds of a tuning run of ``cands`` (gpu_tune.Candidate), phase by phase."""
    kernels = sum(3 if c.variant == "split" else 1 for c in cands if c.kind == "fused")
    phases = {
        "start": TUNE["start"].seconds,
        "draws": TUNE["draws"].seconds,
        "compile (and the cpu reference beside it)": max(compile_seconds(kernels), TUNE["reference"].seconds),
        "fused one-program candidates": TUNE["fused_one"].seconds * sum(1 for c in cands if c.kind == "fused"
                                                                        and c.variant == "one"),
        "fused split candidates": TUNE["fused_split"].seconds * sum(1 for c in cands if c.variant == "split"),
        "cuda candidates": TUNE["cuda"].seconds * sum(1 for c in cands if c.kind == "cuda" and not c.workspace),
        "cuda, the other workspace": TUNE["cuda_other_workspace"].seconds * sum(1 for c in cands if c.workspace),
        "report": TUNE["report"].seconds,
    }
    return phases


def tune_seconds() -> float:
    import gpu_tune

    return float(sum(tune_phases(gpu_tune.candidates()).values()))


def expected_seconds() -> dict[str, float]:
    """Each section's expected device seconds, read from the table now (the fused section's from
    its parts, the tuning section's from its phases)."""
    out = {name: float(cost.seconds) for name, cost in SECTIONS.items()}
    out["fused"] = float(sum(FUSED_PARTS.values()))
    out["tune"] = tune_seconds()
    return out


def fused_energy_need_s() -> float:
    """What the fused section's timing and energy trials take (its decision's need)."""
    return FUSED_PARTS["timing"] + FUSED_PARTS["energy_trials"]


def section_limit(name: str) -> float | None:
    return SECTIONS[name].limit_s


def part_seconds(section: str | None, part: str) -> float:
    """The device seconds of a part a section marks done (gpu_check_common.Clock.mark)."""
    if section == "fused":
        return FUSED_PARTS[part]
    if section == "tune" and part in TUNE:
        return TUNE[part].seconds
    raise KeyError(f"no device seconds for part {part!r} of section {section!r} in scripts/gpu_budget.py")


def section_seconds(name: str, result: dict) -> float | None:
    """The device seconds the table expects of a section that did what ``result`` says (the short
    energy windows, the fused energy trials or not); None where its marks already count them (tune)."""
    if name == "energy":
        return ENERGY_PARTS["short"] if result.get("windows") == "short" else SECTIONS["energy"].seconds
    if name == "fused":
        return FUSED_PARTS["checks"] + FUSED_PARTS["timing"] + (
            FUSED_PARTS["energy_trials"] if result.get("energy_attempted", True) else 0.0)
    if name == "tune":
        return None
    return expected_seconds()[name]


# --------------------------------------------------------------------------- the plans


@dataclasses.dataclass(frozen=True)
class Call:
    """One `run` call of scripts/gpu_device_run.sh: its sections, budget and timeout."""

    sections: tuple[str, ...]
    budget_s: int
    timeout_s: int
    limit_s: int  # the most device seconds the issue allows this call's projection

    def command(self, wheels: str = CARRY_DEFAULTS[0], reference: str = CARRY_DEFAULTS[1]) -> str:
        """The device tool's call, verbatim (docs/gpu.md gives these; a test checks they are equal)."""
        env = "" if self.sections == ONE_SHOT else f"SECTIONS={','.join(self.sections)} "
        if (self.budget_s, self.timeout_s) != (DEFAULT_BUDGET_S, DEFAULT_TIMEOUT_S):
            env += f"BUDGET_S={self.budget_s} DEVICE_TIMEOUT_S={self.timeout_s} "
        if wheels != CARRY_DEFAULTS[0]:
            env = f"WHEELS={wheels} " + env
        if reference != CARRY_DEFAULTS[1]:
            env = f"REFERENCE={reference} " + env
        carry = ", ".join(f'"{c}"' for c in (wheels, str(Path(reference).parent)))
        return f'run(command="{env}bash scripts/gpu_device_run.sh", carry=[{carry}], timeout_s={self.timeout_s})'


@dataclasses.dataclass(frozen=True)
class Plan:
    name: str
    calls: tuple[Call, ...]
    session_left_s: int  # the device time the session has when the plan starts (a machine to start)
    what: str


ONE_SHOT = ("precheck", "cuda", "energy", "fused", "service", "tests")  # gpu_check.py's default sections
DEFAULT_BUDGET_S, DEFAULT_TIMEOUT_S = 400, 480  # gpu_device_run.sh's defaults
# gpu_device_run.sh: the backstop is the budget + GRACE_S, then KILL_AFTER_S, then TAIL_S for the tar
GRACE_S, KILL_AFTER_S, SCRIPT_TAIL_S = 40, 10, 15

PLANS: dict[str, Plan] = {
    "two-call": Plan("two-call", (
        Call(("precheck", "cuda", "energy", "fused", "service"), 330, 405, 330),
        Call(("precheck", "tune", "tests"), 255, 330, 300),
    ), 900, "the standing order: call 1 the one-shot without its tests, call 2 the tuning run and the GPU tests"),
    "one-shot": Plan("one-shot", (Call(ONE_SHOT, DEFAULT_BUDGET_S, DEFAULT_TIMEOUT_S, 400),), 900,
                     "gpu_device_run.sh with its defaults: every section of the one-shot in one call, no tuning"),
    "600-s-left": Plan("600-s-left", (Call(ONE_SHOT, 375, 450, 400),), 600,
                       "600 s left before a machine is started: one call, the one-shot with its tests (the tuning "
                       "run waits for another session)"),
}


def call_projection(call: Call) -> float:
    """The device seconds a call is expected to take: the script's setup and tail, and its sections."""
    expected = expected_seconds()
    return SETUP_S.seconds + TAIL_S.seconds + sum(expected[s] for s in ordered(call.sections))


def ordered(sections) -> list[str]:
    import gpu_check

    names = list(sections)
    if "precheck" not in names:
        names.insert(0, "precheck")
    return [s for s in gpu_check.ALL_SECTIONS if s in names]


def plan_problems(plan: Plan) -> list[str]:
    """What does not fit in a plan's arithmetic (not the replay's): each call's timeout holds its
    budget, the backstop, the kill and the tail; each projection is within its limit; the calls,
    the machine's start and the transfers fit the session's time (every call at its timeout)."""
    problems = []
    for i, call in enumerate(plan.calls, 1):
        need = call.budget_s + GRACE_S + KILL_AFTER_S + SCRIPT_TAIL_S + SETUP_S.seconds
        if need > call.timeout_s:
            problems.append(f"call {i}: budget {call.budget_s} + backstop {GRACE_S} + kill {KILL_AFTER_S} + tail "
                            f"{SCRIPT_TAIL_S} + setup {SETUP_S.seconds:g} = {need:g} s > timeout_s {call.timeout_s}")
        projected = call_projection(call)
        if projected > call.limit_s:
            problems.append(f"call {i}: projected {projected:g} s > its {call.limit_s} s")
        if call.timeout_s > 600:
            problems.append(f"call {i}: timeout_s {call.timeout_s} > the tool's 600 s per command")
    worst = START_S + sum(c.timeout_s + TRANSFER_S for c in plan.calls)
    if worst > plan.session_left_s:
        problems.append(f"start {START_S} + the calls at their timeouts and transfers = {worst} s > "
                        f"the {plan.session_left_s} s left")
    return problems


# --------------------------------------------------------------------------- the replay


def _stand_ins(log):
    """Stand-in sections: the real sections' time structure from this table, and their budget
    decisions by the real sections' functions, at the points where the real sections make them."""
    import gpu_check_energy
    import gpu_check_fused
    import gpu_check_tests
    import gpu_tune

    def plain(name):
        def run(out, clock, report, **kw):
            report.update({"passed": True, "replayed": name})
            return report
        return run

    def energy(out, clock, reserve_s, report, **kw):
        windows, why = gpu_check_energy.windows_for(clock, reserve_s)
        report.update({"passed": windows == "long", "protocol_windows": windows})
        if why:
            report["budget_cut"] = why
        return report

    def fused(out, clock, reserve_s, report, **kw):
        clock.mark("checks")
        fits, why = gpu_check_fused.energy_trials_fit(clock, reserve_s)
        clock.mark("timing")
        report["energy_attempted"] = fits
        if fits:
            clock.mark("energy_trials")
            report["passed"] = True
        else:
            report.update({"passed": False, "budget_cut": why})
        return report

    def tests(out, clock, reserve_s, report, **kw):
        cap = gpu_check_tests.cap_for(clock, reserve_s, dry_run=False)
        report["cap_s"] = cap
        need = SECTIONS["tests"].seconds
        if cap < need:
            report.update({"passed": False, "budget_cut": f"the cap {cap:.0f} s is under the tests' expected {need:g} s"})
        else:
            report["passed"] = True
        return report

    def tune(out, clock, reserve_s, report, **kw):
        result = gpu_tune.replay_phases(clock, reserve_s)
        report.update(result)
        return report

    return {"precheck": plain("precheck"), "cuda": plain("cuda"), "energy": energy, "fused": fused,
            "service": plain("service"), "tune": tune, "tests": tests}


def replay(call: Call, out_dir: Path, mnist_dir: Path | None = None) -> dict:
    """``gpu_check.run_check`` with stand-in sections on a clock that advances by this table's
    seconds: which sections start, with how much left, what each decides. Returns the run's report
    with ``problems``: every section not started, cut, interrupted or with a skipped measurement."""
    import gpu_check
    import gpu_check_common as common

    clock = common.Clock(call.budget_s, projected=True)
    report, status = gpu_check.run_check(out_dir, mnist_dir or common.ROOT / "data" / "mnist", False,
                                         list(ordered(call.sections)), call.budget_s, runners=_stand_ins(print),
                                         log=lambda *a: None, clock=clock, arm_alarms=False, check_inputs=False)
    problems = []
    for name, s in report["sections"].items():
        for key in ("skipped", "interrupted", "budget_cut"):
            if s.get(key):
                problems.append(f"{name}: {key}: {s[key]}")
        for c in s.get("not_run") or []:
            problems.append(f"{name}: candidate {c} not run")
        if not s.get("passed") and not any(s.get(k) for k in ("skipped", "interrupted", "budget_cut")):
            problems.append(f"{name}: did not pass")
    if status != 0:
        problems.append(f"exit status {status}")
    report["problems"] = problems
    report["projected_seconds"] = clock.elapsed()
    return report


def replay_plan(plan: Plan, out_dir: Path) -> dict:
    calls = []
    for i, call in enumerate(plan.calls, 1):
        r = replay(call, Path(out_dir) / f"call{i}")
        calls.append({"call": i, "command": call.command(), "budget_s": call.budget_s, "timeout_s": call.timeout_s,
                      "projected_s": call_projection(call), "limit_s": call.limit_s,
                      "sections": {n: {"start_s": s.get("projected_start_s"), "left_s": s.get("projected_left_s"),
                                       "seconds": s.get("projected_seconds"), "reserve_s": s.get("reserve_s")}
                                   for n, s in r["sections"].items()},
                      "problems": r["problems"]})
    return {"plan": plan.name, "what": plan.what, "calls": calls, "arithmetic": plan_problems(plan),
            "fits": not plan_problems(plan) and not any(c["problems"] for c in calls)}


def describe(result: dict) -> str:
    lines = [f"plan {result['plan']}: {result['what']}"]
    for c in result["calls"]:
        lines.append(f"  call {c['call']}: projected {c['projected_s']:.0f} s of {c['limit_s']} (budget {c['budget_s']}, "
                     f"timeout_s {c['timeout_s']})")
        lines.append(f"    {c['command']}")
        for name, s in c["sections"].items():
            if s["seconds"] is None:
                continue
            lines.append(f"    {name:9s} at {s['start_s']:5.0f} s, {s['left_s']:5.0f} s left, reserve {s['reserve_s'] or 0:4.0f}, "
                         f"{s['seconds']:5.0f} s")
        lines += [f"    PROBLEM {p}" for p in c["problems"]]
    lines += [f"  PROBLEM {p}" for p in result["arithmetic"]]
    lines.append(f"  fits: {result['fits']}")
    return "\n".join(lines)


def calls_text(wheels: str = CARRY_DEFAULTS[0], reference: str = CARRY_DEFAULTS[1]) -> str:
    plan = PLANS["two-call"]
    lines = []
    for i, call in enumerate(plan.calls, 1):
        lines.append(f"    {call.command(wheels, reference)}   # call {i}: projected {call_projection(call):.0f} s")
    lines.append("  (docs/gpu.md: send call 2 at once after call 1, while the machine is warm; then give_back)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import os
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", choices=sorted(PLANS), action="append")
    parser.add_argument("--calls", action="store_true", help="print the two calls to make (scripts/gpu_prepare.sh)")
    args = parser.parse_args(argv)
    if args.calls:
        print(calls_text(os.environ.get("WHEELS") or CARRY_DEFAULTS[0], os.environ.get("REFERENCE") or CARRY_DEFAULTS[1]))
        return 0
    ok = True
    with tempfile.TemporaryDirectory(prefix="rev88-budget-") as tmp:
        for name in args.plan or list(PLANS):
            result = replay_plan(PLANS[name], Path(tmp) / name)
            print(describe(result))
            ok = ok and result["fits"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
