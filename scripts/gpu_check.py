"""Every GPU check of the project, as one prepared run (JSON under --out, a short summary last).

    python scripts/gpu_check.py --out "$OUT"              # on a CUDA GPU (scripts/gpu_device_run.sh)
    python scripts/gpu_check.py --dry-run --out DIR        # the same logic on the CPU, about 3 minutes

Sections, in this order (each records its own ``passed`` and never stops the others, except
the pre-check, which stops the run early when it fails):

  precheck  scripts/gpu_check_precheck.py: versions that actually ran (the device has its own
            image, not the pins), Python.h, the C compiler, libcuda for Triton's launcher, a
            16-element Triton kernel launched, the service's packages
  cuda      scripts/gpu_check_cuda.py: graphs vs independent eager SGD, byte-repeatable replay,
            graph reuse across draws 0 and 1, draw-0 accuracy and CUDA ms
  energy    scripts/gpu_check_energy.py: the gated energy protocol with rev88 measure's default
            windows (two meters, reference matmul windows, sham, harness control; every gate
            printed, the board's J per 10^12 FLOP, the sham residual, cold and paired idle), the
            counter's update period, /health telemetry, one per-request figure
  fused     scripts/gpu_check_fused.py: fused vs cuda on draw 0 (equality is the pass; a differing
            query's margins and both accuracies are reported), a T = SM-count launch, auto's
            self-check, ms and mJ per task of cuda / fused / fused-T and the ratios
  service   scripts/gpu_check_service.py: ``rev88 serve`` on the fused backend in a child process,
            over HTTP: draw 0, 8 concurrent tasks sharing launches, ?backend=cuda,
            ?measure=energy, /health's gpu object, /metrics' GPU gauges, SIGTERM drain
  tests     scripts/gpu_check_tests.py: pytest on every test file that needs a GPU, under a cap

``--dry-run`` rehearses every section on the CPU (the cuda program eagerly, fused in Triton's
interpreter on small slices, energy with a simulated meter, the service on cpu-fast) and writes
the same report, so a bug in these scripts is found before a GPU is lent. What a dry run cannot
check is listed in each section's ``not_checked_in_dry_run``.

Output under --out: gpu_check.json (everything: ``sections.<name>``), summary.txt (the table
printed last), and each section's own file (precheck.json, cuda.json, energy_check.json,
fused.json, service.json, service_server.log). gpu_check.json and summary.txt are rewritten
after every section; each section writes its own file however it ends, so an error or an
interrupt keeps the figures it had (``partial: true``). ``--publish DIR`` (scripts/gpu_device_run.sh
passes $OUT) copies gpu_check.json and summary.txt into DIR and tars --out into
DIR/gpu-check-bundle.tar.gz after every section: DIR never holds more than those and a file
being replaced (the device returns at most 8 files), and --out must lie outside it.

The budget (--budget-s) is a hard limit: a section is not started with fewer seconds left than
its minimum (MIN_START_S), and when the budget runs out inside a section, or SIGTERM arrives
(the device script's `timeout`), that section is interrupted (gpu_check.Interrupted), keeps its
partial figures, and the rest are marked not run.

Exit status: 0 every section passed; 1 a section that ran to its end failed (also when the
budget ran out later: more time would not fix it); 2 bad input (an MNIST folder without the
four files, or no CUDA GPU without --dry-run) -- the report says which, in both modes; 3 the
time budget ran out -- a section was interrupted (by the budget or SIGTERM), not started for
lack of time, or skipped a step for it (``budget_cut``: fused's energy trials), and nothing
failed on its own. scripts/gpu_device_run.sh adds 4 (killed), 5 (no final report) and 6
(refused to start: something the call carries is missing); docs/gpu.md has the table.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import shutil
import signal
import sys
import tarfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))
import gpu_check_common as common  # noqa: E402

ROOT = common.ROOT
SECTIONS = ("precheck", "cuda", "energy", "fused", "service", "tests")
MODULES = {"precheck": "gpu_check_precheck", "cuda": "gpu_check_cuda", "energy": "gpu_check_energy",
           "fused": "gpu_check_fused", "service": "gpu_check_service", "tests": "gpu_check_tests"}
# Estimated seconds of each section on one H200: the one table of them. The first GPU run
# (2026-12-04, an H200; ../shared/notes/gpu-h200.md) measured precheck 9.4, cuda 10.9, energy 40.4,
# fused 57.1, service 35.9 s (154 s of the 400); the figures below keep room over those for what
# the sections gained since. The summary's "est.GPU s" column, each section's estimated_device_seconds and the
# fused section's reserve for the sections after it come from it, and docs/gpu.md's table and
# total must equal it (tests/test_gpu_check.py checks). How:
# precheck  imports + one tiny Triton compile and launcher build (~5 s) + three cc runs
# cuda      4 captures of small programs + 1 of the 10k program (~1-2 s each), ~12 task runs of
#           ~40 ms, one cpu-backend draw-0 run (~0.5 s), two make_task (~0.5 s each)
# energy    the gated protocol with rev88 measure's default windows, 129 s (gpu_check_common.
#           gated_window_seconds of gpu_check_energy.GATED_LONG: settles are caps, so at most),
#           + the 3 s cold idle window + ~10 s (the first run: 40.4 s for 36 s of windows): the
#           sampler's start, the 4096^2 matrices and their checks, first, calibration, after, the
#           counter's 0.6 s watch and one per-request run with 1 s of idle sampling
#           (gpu_check_energy.LONG_NEED_S = 142 s; without room for it the 36 s short windows run)
# fused     two kernel compiles (draw 0's, the self-check's: ~9 s each for sm_90 measured here on the CPU),
#           the draw-0 runs, a 132-task launch (staging ~1 GB of inputs), timing repeats, then
#           three energy protocols of ~15-20 s each
# service   start (imports, learner validation, fused warm-up: one more compile, ~10 s), the
#           in-process references, the requests (~10 s), the sweep, the drain (~2 s), and the
#           measure step's 11 s of windows (gpu_check_service.MEASURE_PARAMS): 35.9 s in the first
#           run (ready in 13.9 s); 55 s left room over it, 59 s since issue #46's 1,320-cell sweep (the
#           sweep, ~0.5-6 s at 3,000-236 cells/s, its 1,320 rows read back, and in this process 132 seeds
#           prepared and 11 fused launches: ~1.5 s). fused: 57.1 s in the first run (its kernel compiles
#           and three energy protocols); 70 s. Both came down (from 120 and 86 s) so that the energy
#           section's long windows fit beside them (the estimates' total must stay under the 400 s budget).
# tests     gpu_check_tests.DEVICE_CAP_S caps it; the five files were run by hand in the first run
DEVICE_ESTIMATE_S = {"precheck": 15, "cuda": 20, "energy": 145, "fused": 70, "service": 59, "tests": 90}
# Fewer seconds left than this and a section is not started (it is then marked "skipped" for the
# budget): on a GPU from the estimates above; in a dry run from its own times here (2-core machine,
# quiet: precheck 1-3 s, cuda 2-13 s, energy 4-11 s, fused 17-75 s, service 7-46 s), low enough
# that a short budget (--budget-s 20) starts a section and interrupts it.
MIN_START_S = {
    "device": {"precheck": 0, "cuda": 15, "energy": 20, "fused": 60, "service": 45, "tests": 30},
    "dry-run": {"precheck": 0, "cuda": 3, "energy": 3, "fused": 5, "service": 5, "tests": 5},
}
DEFAULT_BUDGET_S = {"device": 400, "dry-run": 300}
EXIT_STATUS = {
    0: "every section passed",
    1: "a section failed",
    2: "bad input, or no CUDA GPU without --dry-run",
    3: "the time budget ran out: a section interrupted or not started, the figures partial",
}
BUNDLE = "gpu-check-bundle.tar.gz"
# keys of a section's report that are not figures (left out of an interrupted section's list)
BOOKKEEPING = ("interrupted", "passed", "partial", "mode", "error", "traceback", "seconds", "missing_steps",
               "not_checked_in_dry_run", "server_log_tail", "command")
PUBLISHED = ("gpu_check.json", "summary.txt")


class Interrupted(BaseException):
    """SIGTERM (``timeout`` on the device) or the run's own budget (SIGALRM): not an Exception,
    so no section swallows it; each section's cleanup (the service's child server) runs and
    its partial report is kept, and the report is still written."""


class _Signals:
    """SIGTERM and the budget's alarm raise Interrupted once, in the main thread; a second signal
    while the sections clean up is only recorded (``late``), so the cleanup and the report's
    writing are never cut short by it."""

    def __init__(self, budget_s: float):
        self.budget_s = budget_s
        self.fired: str | None = None
        self.late: list[str] = []
        self.previous: dict = {}

    def _raise(self, why: str):
        if self.fired is None:
            self.fired = why
            raise Interrupted(why)
        self.late.append(why)

    def _on_signal(self, signum, frame):
        if signum == signal.SIGALRM:
            self._raise(f"the time budget of {self.budget_s:g} s ran out")
        else:
            self._raise(f"received {signal.Signals(signum).name}")

    def arm(self, seconds: float) -> bool:
        if threading.current_thread() is not threading.main_thread():
            return False  # signals reach only the main thread: the budget is then checked between sections
        for sig in (signal.SIGTERM, signal.SIGALRM):
            self.previous[sig] = signal.signal(sig, self._on_signal)
        signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
        return True

    def quiet(self) -> None:
        """From here on no signal raises (the final report is being written)."""
        if self.fired is None:
            self.fired = "(the sections had ended)"

    def disarm(self) -> None:
        if self.previous:
            signal.setitimer(signal.ITIMER_REAL, 0)
            for sig, handler in self.previous.items():
                signal.signal(sig, handler)
            self.previous = {}


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
        tar.add(work, arcname="check")
    os.replace(part, dest / BUNDLE)


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
            return f"draw0 {d.get('correct')} correct, {d.get('vs_cpu', {}).get('differing')} differ from cpu, median {ms:.1f} ms"
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
                    f"{r.get('draw0', {}).get('prediction_mismatches_vs_cuda')} differ from cuda")
        if name == "tests":
            p = r.get("pytest") or {}
            c = p.get("counts") or {}
            bad = sorted(p.get("not_passed") or {})
            return (f"{c.get('passed', 0)} passed, {c.get('failed', 0)} failed, {c.get('error', 0)} errors, "
                    f"{c.get('skipped', 0)} skipped in {p.get('seconds', 0):.0f} s"
                    + (" (cap reached)" if p.get("timed_out") else "")
                    + (f"; not passed: {', '.join(n.split('::', 1)[1] for n in bad[:4])}" if bad else ""))
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
    inputs = report.get("inputs") or {}
    if not inputs.get("passed", False):
        lines.append(f"  inputs   FAIL {inputs.get('error')}")
    lines.append(f"  {'section':9s} {'result':6s} {'s':>6s} {'est.GPU s':>9s}  detail")
    for name, s in report["sections"].items():
        result = ("ok" if s.get("passed") is True else "skip" if "skipped" in s
                  else "STOP" if "interrupted" in s else "cut" if "budget_cut" in s else "FAIL")
        lines.append(f"  {name:9s} {result:6s} {s.get('seconds', 0.0):6.1f} {DEVICE_ESTIMATE_S.get(name, 0):9d}  "
                     f"{s.get('headline', '')}")
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
    if report.get("interrupted") or report.get("budget_ran_out") or any("budget_cut" in s for s in sections):
        return 3
    return 1


def run_check(out: Path, mnist_dir: Path, dry_run: bool, sections: list[str], budget_s: float,
              runners: dict[str, Callable[..., dict]] | None = None, keep_going: bool = False,
              log=print, argv: list[str] | None = None, publish_dir: Path | None = None) -> tuple[dict, int]:
    """Run ``sections`` (precheck first), write the report after each; return (report, exit status).
    ``runners`` replaces section functions (tests). The budget is enforced by an alarm when this
    runs in the main thread (else only between sections); SIGTERM interrupts the same way."""
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
    report: dict = {
        "tool": "scripts/gpu_check.py", "mode": mode, "argv": argv,
        "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "budget_s": budget_s, "mnist_dir": str(mnist_dir), "sections": {}, "finished": False,
        "device_estimate_s": dict(DEVICE_ESTIMATE_S), "min_start_s": dict(MIN_START_S[mode]),
    }
    ordered = [s for s in SECTIONS if s in sections]

    def write() -> None:
        report["seconds"] = time.monotonic() - t0
        common.write_json(out / "gpu_check.json", report)
        (out / "summary.txt").write_text(summary_text(report))
        if publish_dir is not None:
            try:
                publish(out, publish_dir)
            except Exception as exc:  # noqa: BLE001 - the report under --out is still there
                report.setdefault("publish_errors", []).append(f"{type(exc).__name__}: {exc}")
                log(f"publishing into {publish_dir} failed: {type(exc).__name__}: {exc}")

    def skip_rest(names, why: str) -> None:
        for name in names:
            report["sections"][name] = {"passed": False, "skipped": why, "seconds": 0.0, "headline": why}

    signals = _Signals(budget_s)
    report["budget_enforced_by"] = "alarm" if signals.arm(budget_s) else "checks between sections"
    status = None
    try:
        try:
            report["inputs"] = common.check_mnist(mnist_dir)
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
                if left < MIN_START_S[mode][name]:  # a later section with a smaller minimum may still fit
                    report["budget_ran_out"] = True
                    skip_rest([name], f"not started for the budget: {max(left, 0):.1f} s of the {budget_s:g} s left, "
                                      f"{name} needs {MIN_START_S[mode][name]} s to start")
                    continue
                log(f"== {name} ==")
                reserve = sum(DEVICE_ESTIMATE_S[s] for s in ordered[i + 1:]) if not dry_run else 0.0
                t = time.perf_counter()
                partial: dict = {}  # the section fills it as it goes: what survives an interrupt
                try:
                    run = (runners or {}).get(name) or load_section(name)
                    result = run(out, mnist_dir=mnist_dir, dry_run=dry_run, log=log, deadline=deadline,
                                 reserve_s=reserve, report=partial)
                    if not isinstance(result, dict):
                        result = {"passed": False, "error": f"section returned {type(result).__name__}, not a report"}
                except (Interrupted, KeyboardInterrupt) as exc:
                    why = str(exc) or type(exc).__name__
                    report["interrupted"] = why
                    result = partial
                    if "error" in result:
                        result["error_before_interrupt"] = result.pop("error")
                    result["interrupted"] = why
                    kept = sorted(k for k in result if k not in BOOKKEEPING)
                    result["error"] = (f"interrupted after {time.perf_counter() - t:.0f} s: {why}; partial figures kept: "
                                       f"{', '.join(kept) or 'none yet'}")
                except Exception as exc:  # noqa: BLE001 - recorded; the other sections still run
                    result = partial
                    result.update({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
                result["passed"] = section_passed(result)
                result["seconds"] = time.perf_counter() - t
                result["estimated_device_seconds"] = DEVICE_ESTIMATE_S[name]
                result["headline"] = headline(name, result)
                report["sections"][name] = result
                log(f"== {name}: {'ok' if result['passed'] else 'FAILED'} in {result['seconds']:.1f} s -- {result['headline']}")
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
        signals.quiet()
        signals.disarm()
    if signals.late:
        report["signals_while_stopping"] = signals.late
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
                        help=f"comma-separated subset of {','.join(SECTIONS)} (the pre-check always runs first)")
    parser.add_argument("--dry-run", action="store_true", help="rehearse every section on the CPU")
    parser.add_argument("--budget-s", type=float, default=None,
                        help=f"time budget of the whole run, a hard limit (default {DEFAULT_BUDGET_S['device']} on a GPU, "
                             f"{DEFAULT_BUDGET_S['dry-run']} dry)")
    parser.add_argument("--keep-going", action="store_true", help="run the other sections even if the pre-check fails")
    args = parser.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
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
    report, status = run_check(args.out, mnist_dir, args.dry_run, sections, budget, keep_going=args.keep_going,
                               argv=sys.argv[1:] if argv is None else argv, publish_dir=args.publish)
    print("\n" + (args.out / "summary.txt").read_text(), end="", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
