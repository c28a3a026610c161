"""Every GPU check of the project, as one prepared run (JSON under --out, a short summary last).

    python3 scripts/gpu_check.py --out "$OUT"                  # on a CUDA GPU (scripts/gpu_device_run.sh)
    python3 scripts/gpu_check.py --dry-run --out DIR            # the same logic on the CPU, about 2 minutes
    python3 scripts/gpu_check.py --sections tune,tests ...      # the second call of docs/gpu.md's plan

Sections, in this order (each records its own ``passed`` and never stops the others, except
the pre-check, which stops the run early when it fails); the default is the one-shot's six:

  precheck  scripts/gpu_check_precheck.py: versions that actually ran (the device has its own
            image, not the pins), Python.h, the C compiler, libcuda for Triton's launcher, a
            16-element Triton kernel launched, the service's packages
  cuda      scripts/gpu_check_cuda.py: graphs vs independent eager SGD, byte-repeatable replay,
            graph reuse across draws 0 and 1, draw-0 accuracy and CUDA ms, the eleven draws
            against the cpu backend query by query
  energy    scripts/gpu_check_energy.py: the gated energy protocol with rev88 measure's default
            windows (two meters, reference matmul windows, sham, harness control; every gate
            printed, the board's J per 10^12 FLOP, the sham residual, cold and paired idle), the
            counter's update period, /health telemetry, one per-request figure
  fused     scripts/gpu_check_fused.py: fused vs the cpu backend on draw 0 (equality is the pass;
            cuda's figures beside it), a T = SM-count launch against the cpu backend and single
            launches, the eleven draws against the cpu backend query by query, auto's
            self-check, ms and mJ per task of cuda / fused / fused-T and the ratios
  service   scripts/gpu_check_service.py: ``rev88 serve`` on the fused backend in a child process,
            over HTTP: draw 0, 8 concurrent tasks sharing launches, ?backend=cuda,
            ?measure=energy, /health's gpu object, /metrics' GPU gauges, SIGTERM drain
  tune      (only when named) scripts/gpu_check_tune.py: scripts/gpu_tune.py, the tuning run
  tests     scripts/gpu_check_tests.py: pytest on the tests marked ``gpu`` (they need one), under a cap

``--dry-run`` rehearses every section on the CPU (the cuda program eagerly, fused in Triton's
interpreter on small slices, energy with a simulated meter, the service on cpu-fast) and writes
the same report, so a bug in these scripts is found before a GPU is lent. What a dry run cannot
check is listed in each section's ``not_checked_in_dry_run``. Its budget decisions are the
device's: they read the device clock that scripts/gpu_budget.py's table projects (the device
seconds of each part the sections finish) for ``--device-budget-s``, so a plan that would cut a
section on the device cuts it in the dry run too (exit status 3), and the summary gives the device
seconds projected per section.

Output under --out: gpu_check.json (everything: ``sections.<name>``), summary.txt (the table
printed last), and each section's own file (precheck.json, cuda.json, energy_check.json,
fused.json, service.json, service_server.log, the service's ledger in service-data/, tune/,
tests.json). gpu_check.json and summary.txt are replaced whole (a file written beside them,
flushed, renamed) after every section, and the tuning section's after every candidate; each
section writes its own file however it ends, so an error or an interrupt keeps the figures it had
(``partial: true``). ``--publish DIR`` (scripts/gpu_device_run.sh passes $OUT) copies
gpu_check.json and summary.txt into DIR and tars --out into DIR/gpu-check-bundle.tar.gz each
time: DIR never holds more than those and a file being replaced (the device returns at most 8
files), and --out must lie outside it.

The budget (--budget-s) is a hard limit: a section is not started with fewer seconds left than
its minimum (gpu_budget.MIN_START_S), each section keeps the later sections' expected seconds in
reserve for its own optional steps, each runs under its own limit (gpu_budget.SECTIONS: past it
the section is stopped with its partial figures and the next one runs), and when the budget runs
out inside a section, or SIGTERM arrives (the device script's `timeout`), that section is
interrupted (gpu_check_common.Interrupted), keeps its partial figures, and the rest are marked
not run.

Exit status: 0 every section passed; 1 a section that ran to its end failed (also when the
budget ran out later: more time would not fix it); 2 bad input (an MNIST folder without the
four files, or no CUDA GPU without --dry-run) -- the report says which, in both modes; 3 the
time budget ran out -- a section was interrupted (by the budget, its own limit or SIGTERM), not
started for lack of time, or skipped a step for it (``budget_cut``: the energy section's long
windows, fused's energy trials, the tests' cap, a tuning candidate), and nothing failed on its
own. scripts/gpu_device_run.sh adds 4 (killed), 5 (no final report) and 6 (refused to start:
something the call carries is missing); docs/gpu.md has the table.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import shutil
import sys
import tarfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))
import gpu_budget  # noqa: E402
import gpu_check_common as common  # noqa: E402

ROOT = common.ROOT
SECTIONS = gpu_budget.ONE_SHOT  # the one-shot's sections: the default
# every section, in the order they run: ``tune`` (scripts/gpu_tune.py, the tuning run) only when named
ALL_SECTIONS = ("precheck", "cuda", "energy", "fused", "service", "tune", "tests")
MODULES = {"precheck": "gpu_check_precheck", "cuda": "gpu_check_cuda", "energy": "gpu_check_energy",
           "fused": "gpu_check_fused", "service": "gpu_check_service", "tune": "gpu_check_tune",
           "tests": "gpu_check_tests"}
# Expected device seconds of each section: scripts/gpu_budget.py's table (each figure with its
# source there: the first GPU run's measured times and what the sections gained since). The
# summary's "est.GPU s" column, each section's estimated_device_seconds, the reserve each section
# keeps for the ones after it, and docs/gpu.md's table come from it (tests/test_gpu_budget.py).
DEVICE_ESTIMATE_S = gpu_budget.expected_seconds()
MIN_START_S = gpu_budget.MIN_START_S
DEFAULT_BUDGET_S = {"device": gpu_budget.DEFAULT_BUDGET_S, "dry-run": 300}
EXIT_STATUS = {
    0: "every section passed",
    1: "a section failed",
    2: "bad input, or no CUDA GPU without --dry-run",
    3: "the time budget ran out: a section interrupted, cut or not started, the figures partial",
}
BUNDLE = "gpu-check-bundle.tar.gz"
# keys of a section's report that are not figures (left out of an interrupted section's list)
BOOKKEEPING = ("interrupted", "passed", "partial", "mode", "error", "traceback", "seconds", "missing_steps",
               "not_checked_in_dry_run", "server_log_tail", "command", "running")
PUBLISHED = ("gpu_check.json", "summary.txt")
Interrupted = common.Interrupted
SectionLimit = common.SectionLimit


def may_start(name: str, left_s: float, mode: str) -> bool:
    """A section starts only with its minimum left (MIN_START_S of the mode)."""
    return left_s >= MIN_START_S[mode][name]


def reserve_after(ordered: list[str], i: int) -> float:
    """The seconds the section ``ordered[i]`` leaves for the sections after it: their expected
    device seconds (gpu_budget's table, read now)."""
    expected = gpu_budget.expected_seconds()
    return float(sum(expected[s] for s in ordered[i + 1:]))


def section_limit_s(name: str, dry_run: bool) -> float | None:
    """A section's own limit: gpu_budget's on a GPU; a dry run's sections are bounded by its budget."""
    return gpu_budget.DRY_RUN_SECTION_LIMIT_S if dry_run else gpu_budget.section_limit(name)


def ordered_sections(sections) -> list[str]:
    return [s for s in ALL_SECTIONS if s in sections]


def publish(work: Path, dest: Path) -> None:
    """gpu_check.json, summary.txt and the tarred --out folder into ``dest``, each replaced
    whole (written beside its name, then renamed): ``dest`` holds at most one file more than
    these three and the device script's run.log."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in PUBLISHED:
        if (work / name).exists():
            part = dest / f".{name}.part"
            shutil.copyfile(work / name, part)
            os.replace(part, dest / name)
    part = dest / f".{BUNDLE}.part"
    with tarfile.open(part, "w:gz", compresslevel=6) as tar:
        tar.add(work, arcname="check", filter=_bundled)
    os.replace(part, dest / BUNDLE)


# Left out of the bundle: the service's ledger (SQLite, the 1,320-cell sweep's answers and its
# stored dataset: megabytes the reports already summarize; a file over the device's 16 MiB would
# not come back) and the files being replaced.
NOT_BUNDLED = ("service-data",)


def _bundled(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    parts = Path(info.name).parts
    if any(p in NOT_BUNDLED for p in parts[1:]) or parts[-1].endswith(".part"):
        return None
    return info


def load_section(name: str) -> Callable[..., dict]:
    path = SCRIPTS / f"{MODULES[name]}.py"
    spec = importlib.util.spec_from_file_location(MODULES[name], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.run


def section_passed(result: dict) -> bool:
    """A section passed only when it says so: ``passed`` (or ``ok``, gpu_check_energy's older
    name) must be True. A missing key is a failure, never a pass."""
    value = result.get("passed", result.get("ok"))
    return value is True


def headline(name: str, r: dict) -> str:
    """One short line per section for the summary (never raises)."""
    try:
        if "skipped" in r:
            return r["skipped"]
        if "error" in r and not r.get("passed"):
            return str(r["error"]).strip().splitlines()[-1][:150]
        if name == "precheck":
            v = r.get("versions", {})
            failed = r.get("failed_blocking") or []
            return (f"python {v.get('python')}, torch {v.get('torch')}, triton {v.get('triton')}"
                    + (f"; FAILED {', '.join(failed)}" if failed else "")
                    + ("" if (r.get("checks", {}).get("service_packages") or {}).get("passed") else "; service packages missing"))
        if name == "cuda":
            d = r.get("draw0", {})
            ms = d.get("cuda_ms_median_of_7", d.get("wall_ms_median"))
            e = r.get("eleven_draws") or {}
            return (f"draw0 {d.get('correct')} correct, {d.get('vs_cpu', {}).get('differing')} differ from cpu, median "
                    f"{ms:.1f} ms; eleven draws: {e.get('predictions_differing')} of {e.get('predictions_compared')} "
                    f"differ from cpu ({str(e.get('cpu_reference_source') or '')[:28]})")
        if name == "energy":
            s = (r.get("summary") or {}).get("idle_adjusted_mj_per_task") or {}
            net = (r.get("net_mj_per_task") or {}).get("mean")
            failed = [k for k, v in (r.get("checks") or {}).items() if not v]
            gates = ", ".join(f"{k} {v.get('status')}" for k, v in (r.get("gates") or {}).items())
            scenarios = "; ".join(f"simulated {k}: failed {', '.join(v['failed_gates']) or 'none'}"
                                  for k, v in (r.get("scenarios") or {}).items())
            ref = r.get("reference") or {}
            joules = [j for w in (ref.get("windows") or {}).values() for j in w["j_per_tflop"].values()
                      if j is not None]
            sham = r.get("sham_residual") or {}
            return ((f"net {net:.1f} mJ/task" if net is not None else
                     f"idle-adjusted {s.get('mean', float('nan')):.1f} mJ/task")
                    + (f"; {ref.get('board')} {min(joules):.2f}-{max(joules):.2f} J/TFLOP" if joules else "")
                    + (f"; sham {sham['fraction']:.1%} on {str(sham.get('windows')).split(' ')[0]} windows"
                       if sham.get("fraction") is not None else "")
                    + (f"; gated valid {r.get('valid')}: {gates}" if gates else "")
                    + (f"; {scenarios}" if scenarios else "")
                    + (f"; failed {', '.join(failed)}" if failed else ""))
        if name == "fused":
            p = r.get("performance", {})
            ms, mj, ra = p.get("ms_per_task", {}), p.get("idle_adjusted_mj_per_task", {}), p.get("ratios", {})

            def f(x, spec):
                return "n/a" if x is None else format(x, spec)

            return (f"ms/task cuda {f(ms.get('cuda'), '.3f')} fused {f(ms.get('fused'), '.3f')} fused-T {f(ms.get('fused-T'), '.4f')}; "
                    f"mJ/task {f(mj.get('cuda'), '.1f')} / {f(mj.get('fused'), '.1f')} / {f(mj.get('fused-T'), '.2f')}; "
                    f"speed-up {f(ra.get('speedup_fused_vs_cuda'), '.1f')}x / {f(ra.get('speedup_fused_T_vs_cuda'), '.1f')}x; "
                    f"draw0 {r.get('draw0', {}).get('fused_correct')} correct, "
                    f"{r.get('draw0', {}).get('prediction_mismatches_vs_cpu')} differ from cpu "
                    f"({r.get('draw0', {}).get('prediction_mismatches_vs_cuda')} from cuda); eleven draws: "
                    f"{(r.get('eleven_draws') or {}).get('launch', {}).get('predictions_differing')} of "
                    f"{(r.get('eleven_draws') or {}).get('launch', {}).get('predictions_compared')} differ from cpu")
        if name == "tests":
            p = r.get("pytest") or {}
            c = p.get("counts") or {}
            bad = sorted(p.get("not_passed") or {})
            return (f"{c.get('passed', 0)} passed, {c.get('failed', 0)} failed, {c.get('error', 0)} errors, "
                    f"{c.get('skipped', 0)} skipped of {p.get('selected')} marked gpu in {p.get('seconds', 0):.0f} s; "
                    f"gpu_ran {r.get('gpu_ran')}"
                    + (" (cap reached)" if p.get("timed_out") else "")
                    + (f"; not passed: {', '.join(n.split('::', 1)[1] for n in bad[:4])}" if bad else ""))
        if name == "tune":
            choice = r.get("choice") or {}
            cands = r.get("candidates") or []
            ran = [c for c in cands if not str(c.get("refused", "")).startswith("not run")]
            return (f"{sum(1 for c in cands if c.get('passed'))} of {len(cands)} candidates passed "
                    f"({len(cands) - len(ran)} not run); launch {choice.get('launch')}, lone {choice.get('lone')}, "
                    f"cuda {choice.get('cuda_step')}, workspace {choice.get('cublas_workspace')}")
        if name == "service":
            steps = r.get("steps", {})
            failed = [k for k, v in steps.items() if not v.get("passed")] + list(r.get("missing_steps") or [])
            ready = steps.get("start", {}).get("seconds_to_ready")
            return (f"{len(steps)} steps, ready in {ready:.1f} s" if ready is not None else f"{len(steps)} steps") + (
                f"; failed {', '.join(failed)}" if failed else "") + (
                f"; launch sizes {steps['batch'].get('tasks_in_launch')}" if "batch" in steps else "")
    except Exception as exc:  # noqa: BLE001 - a summary line must not break the report
        return f"(no summary: {type(exc).__name__}: {exc})"
    return ""


def summary_text(report: dict) -> str:
    finished = report.get("finished", False)
    verdict = ("PASSED" if report["passed"] else "FAILED") if finished else "UNFINISHED"
    status = report.get("exit_status")
    lines = [f"rev88 GPU check ({report['mode']}): {verdict} in {report['seconds']:.0f} s of a "
             f"{report['budget_s']:g} s budget" + (f", exit status {status} ({EXIT_STATUS.get(status, '?')})"
                                                   if finished else " (written after each section; the run goes on)")]
    projected = report.get("device_budget_s")
    if projected is not None:
        lines.append(f"  device seconds projected (scripts/gpu_budget.py): {report.get('projected_device_seconds', 0):.0f} "
                     f"of a {projected:g} s device budget; 'left' is what the device would have had at each start")
    inputs = report.get("inputs") or {}
    if not inputs.get("passed", False):
        lines.append(f"  inputs   FAIL {inputs.get('error')}")
    lines.append(f"  {'section':9s} {'result':6s} {'s':>6s} {'est.GPU s':>9s}"
                 + (f" {'proj.s':>6s} {'left':>5s}" if projected is not None else "") + "  detail")
    for name, s in report["sections"].items():
        result = ("run" if s.get("running") else "ok" if s.get("passed") is True else "skip" if "skipped" in s
                  else "STOP" if "interrupted" in s else "cut" if "budget_cut" in s else "FAIL")
        extra = ""
        if projected is not None:
            ps, pl = s.get("projected_seconds"), s.get("projected_left_s")
            extra = f" {'-' if ps is None else f'{ps:6.0f}':>6s} {'-' if pl is None else f'{pl:5.0f}':>5s}"
        lines.append(f"  {name:9s} {result:6s} {s.get('seconds', 0.0):6.1f} {DEVICE_ESTIMATE_S.get(name, 0):9.0f}{extra}  "
                     f"{s.get('headline', '')}")
        if s.get("budget_cut") and s.get("passed") is not True:
            lines.append(f"  {'':9s} cut: {str(s['budget_cut'])[:150]}")
        lines += [f"  {'':9s} {line}" for line in (s.get("summary_lines") or [])]
    if report.get("interrupted"):
        lines.append(f"  interrupted: {report['interrupted']}")
    return "\n".join(lines) + "\n"


def exit_status(report: dict) -> int:
    """0 passed; 1 a section that ran to its end failed; 3 the budget ran out (a section
    interrupted, not started, or cut short by its own budget check -- ``budget_cut``, set only
    when the rest of it passed) and nothing failed on its own. (2 is set by the caller.)"""
    sections = report["sections"].values()
    if report["passed"]:
        return 0
    cut = ("skipped", "interrupted", "budget_cut")  # what the budget did, not the code
    failed = [s for s in sections if s.get("passed") is not True and not any(k in s for k in cut)]
    if failed:
        return 1
    if report.get("interrupted") or report.get("budget_ran_out") or any(
            "budget_cut" in s or "interrupted" in s for s in sections):  # (a section past its own limit)
        return 3
    return 1


def run_check(out: Path, mnist_dir: Path, dry_run: bool, sections: list[str], budget_s: float,
              runners: dict[str, Callable[..., dict]] | None = None, keep_going: bool = False,
              log=print, argv: list[str] | None = None, publish_dir: Path | None = None,
              clock: common.Clock | None = None, device_budget_s: float | None = None,
              arm_alarms: bool = True, check_inputs: bool = True) -> tuple[dict, int]:
    """Run ``sections`` (precheck first), write the report after each; return (report, exit status).
    ``runners`` replaces section functions (tests, gpu_budget.replay). The budget is enforced by an
    alarm when this runs in the main thread (else only between sections); SIGTERM interrupts the
    same way; each section also runs under its own limit (gpu_budget's).

    The sections' budget decisions (whether a section starts, the reserve it keeps for the later
    ones, the energy windows, the fused energy trials, the tests' cap, each tuning candidate) read
    ``clock``: on a GPU the real one; in a dry run the device clock that gpu_budget's table
    projects for a device budget of ``device_budget_s`` (default: the device default), so the dry
    run decides and fails as the device would, and reports the device seconds it projects."""
    t0 = time.monotonic()
    deadline = t0 + budget_s
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    mode = common.mode_name(dry_run)
    if publish_dir is not None:
        publish_dir = Path(publish_dir)
        if out.resolve().is_relative_to(publish_dir.resolve()):
            raise ValueError(f"--out {out} lies inside --publish {publish_dir}: its files would count among "
                             "the 8 files that come back; give --out a folder outside it")
    if clock is None:
        clock = (common.Clock(device_budget_s or DEFAULT_BUDGET_S["device"], projected=True) if dry_run
                 else common.Clock(budget_s))
    projecting = clock.projected
    report: dict = {
        "tool": "scripts/gpu_check.py", "mode": mode, "argv": argv,
        "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "budget_s": budget_s, "mnist_dir": str(mnist_dir), "sections": {}, "finished": False,
        "device_estimate_s": dict(DEVICE_ESTIMATE_S), "min_start_s": dict(MIN_START_S[mode]),
        "decisions_by": ("the device clock projected by scripts/gpu_budget.py's table, for a device budget of "
                         f"{clock.budget_s:g} s" if projecting else "the real clock"),
    }
    if projecting:
        report["device_budget_s"] = clock.budget_s
    ordered = ordered_sections(sections)

    def write() -> None:
        report["seconds"] = time.monotonic() - t0
        if projecting:
            report["projected_device_seconds"] = clock.elapsed()
        common.write_json(out / "gpu_check.json", report)
        common.write_text(out / "summary.txt", summary_text(report))
        if publish_dir is not None:
            try:
                publish(out, publish_dir)
            except Exception as exc:  # noqa: BLE001 - the report under --out is still there
                report.setdefault("publish_errors", []).append(f"{type(exc).__name__}: {exc}")
                log(f"publishing into {publish_dir} failed: {type(exc).__name__}: {exc}")

    def skip_rest(names, why: str) -> None:
        for name in names:
            report["sections"][name] = {"passed": False, "skipped": why, "seconds": 0.0, "headline": why}

    alarms = common.Alarms()
    armed = alarms.arm(budget_s) if arm_alarms else False
    report["budget_enforced_by"] = "alarm" if armed else "checks between sections"
    status = None
    try:
        try:
            report["inputs"] = common.check_mnist(mnist_dir) if check_inputs else {"passed": True, "checked": False}
        except Interrupted as exc:
            report["interrupted"] = str(exc)
            report["inputs"] = {"passed": False, "error": f"interrupted while checking the inputs: {exc}"}
        if not report["inputs"]["passed"]:
            if report.get("interrupted"):
                skip_rest(ordered, f"not run: {report['interrupted']}")
            else:
                log(f"bad input: {report['inputs']['error']}")
                skip_rest(ordered, "not run: bad input (see inputs)")
                status = 2
        else:
            for i, name in enumerate(ordered):
                left = deadline - time.monotonic()
                # the real clock's check (on a GPU, and a dry run's own budget); the replay's budget is projected only
                if (dry_run or not projecting) and not may_start(name, left, mode):  # a later section may still fit
                    report["budget_ran_out"] = True
                    skip_rest([name], f"not started for the budget: {max(left, 0):.1f} s of the {budget_s:g} s left, "
                                      f"{name} needs {MIN_START_S[mode][name]} s to start")
                    continue
                projected_left = clock.budget_left()
                if projecting and not may_start(name, projected_left, "device"):
                    report["budget_ran_out"] = True
                    skip_rest([name], f"not started for the device budget (projected): {max(projected_left, 0):.1f} s of the "
                                      f"{clock.budget_s:g} s projected left, {name} needs "
                                      f"{MIN_START_S['device'][name]} s to start")
                    continue
                reserve = reserve_after(ordered, i)
                limit = section_limit_s(name, dry_run)
                clock.start(name, gpu_budget.section_limit(name))
                decided = {"projected_start_s": clock.elapsed(), "projected_left_s": projected_left,
                           "reserve_s": reserve}
                log(f"== {name} ==" + (f" (device clock: {projected_left:.0f} s of {clock.budget_s:g} left, "
                                        f"{reserve:.0f} s kept for the sections after it)" if projecting else ""))
                t = time.perf_counter()
                partial: dict = {}  # the section fills it as it goes: what survives an interrupt

                def checkpoint(name=name, partial=partial, t=t) -> None:
                    """A section's figures so far, published (the tuning run: after each candidate)."""
                    report["sections"][name] = {**partial, "running": True, "seconds": time.perf_counter() - t}
                    write()

                try:
                    run = (runners or {}).get(name) or load_section(name)
                    with alarms.section_limit(limit, name):
                        result = run(out, mnist_dir=mnist_dir, dry_run=dry_run, log=log,
                                     deadline=min(deadline, time.monotonic() + limit) if limit else deadline,
                                     reserve_s=reserve, report=partial, clock=clock, alarms=alarms,
                                     checkpoint=checkpoint)
                    if not isinstance(result, dict):
                        result = {"passed": False, "error": f"section returned {type(result).__name__}, not a report"}
                except (Interrupted, KeyboardInterrupt) as exc:
                    why = str(exc) or type(exc).__name__
                    if not isinstance(exc, SectionLimit):
                        report["interrupted"] = why
                    result = partial
                    if "error" in result:
                        result["error_before_interrupt"] = result.pop("error")
                    result["interrupted"] = why
                    result["partial"] = True  # (whatever it had kept: interrupted before its first figure too)
                    kept = sorted(k for k in result if k not in BOOKKEEPING)
                    result["error"] = (f"interrupted after {time.perf_counter() - t:.0f} s: {why}; partial figures kept: "
                                       f"{', '.join(kept) or 'none yet'}")
                except Exception as exc:  # noqa: BLE001 - recorded; the other sections still run
                    result = partial
                    result.update({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
                result.pop("running", None)
                result["passed"] = section_passed(result)
                result["seconds"] = time.perf_counter() - t
                result["estimated_device_seconds"] = DEVICE_ESTIMATE_S[name]
                result["limit_s"] = limit
                clock.end(gpu_budget.section_seconds(name, result))
                if projecting:
                    decided["projected_seconds"] = clock.elapsed() - decided["projected_start_s"]
                    over = [f"its own limit of {gpu_budget.section_limit(name):g} s"
                            for _ in [0] if gpu_budget.section_limit(name) is not None
                            and decided["projected_seconds"] > gpu_budget.section_limit(name)]
                    if clock.budget_left() < 0:
                        over.append(f"the device budget of {clock.budget_s:g} s")
                    if over:  # the device would have stopped it: what a dry run and the replay must show
                        report["budget_ran_out"] = True
                        result["passed"] = False
                        result.setdefault("budget_cut", f"on the device it would run past {' and '.join(over)} "
                                                        f"(projected {decided['projected_seconds']:.0f} s from "
                                                        f"{decided['projected_start_s']:.0f} s)")
                result.update(decided)
                result["headline"] = headline(name, result)
                report["sections"][name] = result
                log(f"== {name}: {'ok' if result['passed'] else 'FAILED'} in {result['seconds']:.1f} s -- {result['headline']}"
                    + (f" [device seconds projected: {decided['projected_seconds']:.0f}, "
                       f"{clock.budget_left():.0f} of {clock.budget_s:g} left]" if projecting else ""))
                if report.get("interrupted"):
                    skip_rest(ordered[i + 1:], f"not run: {report['interrupted']}")
                    break
                write()
                if name == "precheck" and not result["passed"] and not keep_going:
                    no_gpu = not dry_run and not (result.get("checks", {}).get("cuda") or {}).get("passed", True)
                    skip_rest(ordered[i + 1:], "not run: the toolchain pre-check failed (see sections.precheck)")
                    if no_gpu:
                        status = 2
                    break
    except Interrupted as exc:  # between sections (the budget's alarm while writing a report)
        report["interrupted"] = str(exc)
        skip_rest([n for n in ordered if n not in report["sections"]], f"not run: {exc}")
    finally:
        alarms.quiet()
        alarms.disarm()
    if alarms.late:
        report["signals_while_stopping"] = alarms.late
    report["passed"] = bool(report["inputs"]["passed"] and ordered
                            and all(report["sections"][s].get("passed") is True for s in ordered))
    if status is None:
        status = exit_status(report)
    report["exit_status"] = status
    report["exit_meaning"] = EXIT_STATUS[status]
    report["finished"] = True
    write()
    return report, status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mnist-dir", type=Path, default=None,
                        help="MNIST folder (default: the repository's data/mnist, or $REV88_MNIST_DIR)")
    parser.add_argument("--out", type=Path, default=Path("gpu-check-out"))
    parser.add_argument("--publish", type=Path, default=None,
                        help="after each section, copy gpu_check.json and summary.txt here and tar --out into "
                             f"{BUNDLE} (scripts/gpu_device_run.sh: $OUT)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated sections of {','.join(ALL_SECTIONS)} (default: the one-shot's, "
                             f"{','.join(SECTIONS)}; the pre-check always runs first)")
    parser.add_argument("--dry-run", action="store_true", help="rehearse every section on the CPU")
    parser.add_argument("--budget-s", type=float, default=None,
                        help=f"time budget of the whole run, a hard limit (default {DEFAULT_BUDGET_S['device']} on a GPU, "
                             f"{DEFAULT_BUDGET_S['dry-run']} dry)")
    parser.add_argument("--device-budget-s", type=float, default=None,
                        help="dry run: the device budget whose decisions it makes on the projected device clock "
                             f"(default {DEFAULT_BUDGET_S['device']}; gpu_device_run.sh passes its BUDGET_S)")
    parser.add_argument("--keep-going", action="store_true", help="run the other sections even if the pre-check fails")
    args = parser.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(ALL_SECTIONS))
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(ALL_SECTIONS)}")
    if args.budget_s is not None and not args.budget_s > 0:
        parser.error(f"--budget-s must be a positive number of seconds, not {args.budget_s:g}")
    if args.publish is not None and args.out.resolve().is_relative_to(args.publish.resolve()):
        parser.error(f"--out {args.out} lies inside --publish {args.publish}: its files would count among the "
                     "8 files that come back; give --out a folder outside it")
    if "precheck" not in sections:
        sections.insert(0, "precheck")
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton: the fused kernel runs in numpy
    from learner.data import bundled_mnist_dir

    mnist_dir = args.mnist_dir or bundled_mnist_dir()
    budget = args.budget_s or DEFAULT_BUDGET_S[common.mode_name(args.dry_run)]
    device_budget = args.device_budget_s or DEFAULT_BUDGET_S["device"]
    report, status = run_check(args.out, mnist_dir, args.dry_run, sections, budget, keep_going=args.keep_going,
                               argv=sys.argv[1:] if argv is None else argv, publish_dir=args.publish,
                               device_budget_s=device_budget)
    print("\n" + (args.out / "summary.txt").read_text(), end="", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
