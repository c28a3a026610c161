"""The tests section of scripts/gpu_check.py: the tests that need a GPU, run by pytest on the device.

The suite runs in CI on machines without a GPU; there the tests marked ``gpu`` (pyproject.toml:
"needs a CUDA GPU") skip, by tests/conftest.py's hook. This section runs exactly those tests on
the device -- ``pytest -m gpu`` on the files that hold them (``gpu_test_files``: every
tests/test_*.py with a ``pytest.mark.gpu``) -- in a child pytest under a cap, and reports each
test's outcome as pytest printed it (``-v``: one line per test, read as it streams, so a cap
that stops the run still leaves the outcomes so far). The interpreter tests (Triton's CPU
interpreter, the CPU's eager runs) are not marked: they run on the CPU machines, not here.

    cap   ``cap_for``: gpu_budget.SECTIONS["tests"]'s limit less 10 s on a GPU, lowered to what the
          budget leaves beside the later sections' reserve; DRY_RUN_CAP_S in a dry run, which runs
          the same command on the CPU (the marked tests skip there: a rehearsal of the command and
          the parsing, not of the GPU), and reports whether the device's cap (on the projected
          device clock) would hold the tests' expected seconds

Passed on a GPU when pytest ran to its end within the cap, selected at least one test, and every
selected test passed: none failed, none errored, none skipped (``gpu_ran``: the marked tests that
passed, which must be all of them).
"""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))
import gpu_budget  # noqa: E402
import gpu_check_common as common  # noqa: E402

ROOT = common.ROOT
MARKER = "gpu"
DEVICE_CAP_S = gpu_budget.SECTIONS["tests"].limit_s - 10.0  # 10 s of the section's limit left to stop and read
DRY_RUN_CAP_S = 60.0
OUTCOME = re.compile(r"^(?P<node>\S+\.py::\S+)\s+(?P<outcome>PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
SUMMARY = re.compile(r"=+ .*\bin [0-9.]+s\b.* =+$")
COLLECTED = re.compile(r"\bcollected (?P<n>\d+) items?(?: / (?P<deselected>\d+) deselected)?")


def _marks_gpu(node: ast.AST) -> bool:
    """``pytest.mark.gpu`` (or ``mark.gpu``) among a function's or class's decorators, or a
    module's ``pytestmark``."""
    def is_gpu(expr: ast.AST) -> bool:
        if isinstance(expr, ast.Call):
            expr = expr.func
        return isinstance(expr, ast.Attribute) and expr.attr == MARKER and (
            isinstance(expr.value, ast.Attribute) and expr.value.attr == "mark")

    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return any(is_gpu(d) for d in node.decorator_list)
    if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
        values = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
        return any(is_gpu(v) for v in values)
    return False


def gpu_tests(tests_dir: Path = ROOT / "tests") -> dict[str, list[str]]:
    """Every test file's tests (functions and classes) marked ``gpu``, read from the source."""
    out: dict[str, list[str]] = {}
    for path in sorted(Path(tests_dir).glob("test_*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        module_marked = any(_marks_gpu(n) for n in tree.body if isinstance(n, ast.Assign))
        names = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                 and n.name.startswith(("test", "Test")) and (module_marked or _marks_gpu(n))]
        if names:
            out[str(path.relative_to(ROOT))] = names
    return out


def gpu_test_files() -> tuple[str, ...]:
    return tuple(gpu_tests())


def command(files=None) -> list[str]:
    files = gpu_test_files() if files is None else files
    return [sys.executable, "-m", "pytest", "-v", "-rfEs", "-p", "no:cacheprovider", "--color=no", "-m", MARKER,
            *files]


def cap_for(clock, reserve_s: float, dry_run: bool = False) -> float:
    """The cap on pytest (scripts/gpu_budget.py replays it): the section's own on a GPU (its limit
    less 10 s), the dry run's on the CPU, lowered to what the budget leaves beside ``reserve_s``
    (the later sections' expected seconds) and to what is left of the section's own limit."""
    cap = DRY_RUN_CAP_S if dry_run else DEVICE_CAP_S
    return min(cap, clock.budget_left() - reserve_s, clock.section_left())


def run_pytest(cmd: list[str], cap_s: float, log=print) -> dict:
    """Run ``cmd`` in its own process group for at most ``cap_s``; outcomes read as they stream."""
    outcomes: dict[str, str] = {}
    tail: list[str] = []
    selected: list[int] = []
    finished = threading.Event()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)

    def read() -> None:
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            del tail[:-400]
            match = OUTCOME.match(line)
            if match:
                outcomes[match["node"]] = match["outcome"]
            match = COLLECTED.search(line)
            if match:
                selected.append(int(match["n"]) - int(match["deselected"] or 0))
            if SUMMARY.match(line):
                finished.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    t0 = time.perf_counter()
    timed_out = False
    try:
        proc.wait(timeout=max(cap_s, 1.0))
    except subprocess.TimeoutExpired:
        timed_out = True
        log(f"[tests] the cap of {cap_s:.0f} s ran out: stopping pytest")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=common.INTERRUPT_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        reader.join(timeout=5)
    counts = {kind.lower(): sum(1 for o in outcomes.values() if o == kind)
              for kind in ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")}
    return {"returncode": proc.returncode, "timed_out": timed_out, "finished": finished.is_set(),
            "seconds": round(time.perf_counter() - t0, 2), "counts": counts, "outcomes": outcomes,
            "selected": selected[-1] if selected else None,
            "not_passed": {node: o for node, o in outcomes.items() if o in ("FAILED", "ERROR")},
            "output_tail": "\n".join(tail[-120:])}


def verdict(got: dict, dry_run: bool) -> tuple[bool, int, str | None]:
    """(passed, gpu_ran, why not). ``gpu_ran``: the marked tests that passed -- run, not skipped,
    on this machine (every outcome is a marked test's: pytest ran ``-m gpu``)."""
    counts = got.get("counts") or {}
    gpu_ran = int(counts.get("passed", 0))
    ran_clean = bool(got) and got.get("finished") and not got.get("timed_out") and got.get("returncode") == 0
    if dry_run:
        # the CPU cannot run them: the rehearsal passes when the command ran and its outcomes were
        # read, and nothing it ran failed (here every marked test skips)
        ok = bool(got) and sum(counts.values()) > 0 and not got.get("not_passed")
        return ok, gpu_ran, None if ok else "the rehearsal read no outcome, or a test failed"
    selected = got.get("selected")
    if got.get("timed_out"):
        return False, gpu_ran, f"the GPU tests ran past the cap of {got.get('cap_s')} s"
    if got.get("not_passed"):
        return False, gpu_ran, f"the GPU tests did not pass: {', '.join(sorted(got['not_passed']))}"
    if not ran_clean:
        return False, gpu_ran, f"pytest ended with exit status {got.get('returncode')}"
    if not selected or gpu_ran != selected:
        return False, gpu_ran, (f"{gpu_ran} of {selected} marked tests ran on the GPU: "
                                f"{counts.get('skipped', 0)} skipped (no CUDA?)")
    return True, gpu_ran, None


def run(out_dir: Path, mnist_dir: Path | None = None, dry_run: bool = False, log=print,
        deadline: float | None = None, reserve_s: float = 0.0, report: dict | None = None, clock=None,
        **_) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {} if report is None else report
    clock = common.clock_for(clock, deadline)
    files = gpu_test_files()
    report.update({"mode": common.mode_name(dry_run), "files": list(files), "marker": MARKER,
                   "tests": gpu_tests()})

    def finish(r: dict) -> None:
        got = r.get("pytest") or {}
        if not got:
            return
        got["cap_s"] = r.get("cap_s")
        passed, gpu_ran, why = verdict(got, dry_run)
        r["gpu_ran"] = gpu_ran
        r["passed"] = passed and not r.get("budget_cut")
        if why and not passed:
            r.setdefault("error", why)

    with common.kept(report, out_dir / "tests.json", finish):
        if dry_run:  # the CPU's own cap; the device's, on the projected clock, is reported and judged
            cap = DRY_RUN_CAP_S if deadline is None else min(DRY_RUN_CAP_S, deadline - time.monotonic())
            device_cap = cap_for(clock, reserve_s)
            report["device_cap_s"] = round(device_cap, 1)
            need = gpu_budget.SECTIONS["tests"].seconds
            if device_cap < need:
                report["budget_cut"] = (f"on the device the cap would be {device_cap:.0f} s, under the tests' "
                                        f"expected {need:g} s")
        else:
            cap = cap_for(clock, reserve_s)
        report["cap_s"] = round(cap, 1)
        if cap < 10:
            report["skipped"] = f"not run: {cap:.0f} s left for the tests (the budget)"
            report["budget_cut"] = report["skipped"]
            report["passed"] = False
            return report
        cmd = command(files)
        report["command"] = " ".join(cmd[1:])
        log(f"[tests] {' '.join(cmd[2:])} (cap {cap:.0f} s)")
        report["pytest"] = run_pytest(cmd, cap, log)
        c = report["pytest"]["counts"]
        log(f"[tests] {c['passed']} passed, {c['failed']} failed, {c['error']} errors, {c['skipped']} skipped "
            f"of {report['pytest']['selected']} marked in {report['pytest']['seconds']:.1f} s"
            + (" (stopped by the cap)" if report["pytest"]["timed_out"] else ""))
        if dry_run:
            report["not_checked_in_dry_run"] = ["the marked tests themselves (they skip without a GPU)"]
    return report
