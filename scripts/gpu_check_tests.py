"""The one-shot's tests section: every test file that needs a GPU, run by pytest on the device.

The suite runs in CI on machines without a GPU, where the CUDA tests skip; on the first GPU run
(2026-12-04, an H200) these files were run by hand and gave 72 passed, 3 errors, 1 failure (the
Triton interpreter on numpy 2.5, and a child process without the carried wheels on PYTHONPATH).
This section runs them in every one-shot, in a child pytest under a time cap, and reports each
test's outcome as pytest printed it (``-v``: one line per test, read as it streams, so a cap that
stops the run still leaves the outcomes so far).

    GPU_TEST_FILES   the files: the ones with CUDA-only tests (``@pytest.mark.gpu`` or a branch on
                     torch.cuda.is_available()) and the fused kernel's interpreter tests
    cap              DEVICE_CAP_S on a GPU (lowered to what the run's budget leaves), DRY_RUN_CAP_S
                     in a dry run, which runs the same command on the CPU: the CUDA tests skip there,
                     and the cap stops it (a rehearsal of the cap and the parsing, not of the GPU)

Passed when pytest ran to its end within the cap, collected at least one test, and reported no
failure and no error. On a GPU the CUDA tests must also have run, not skipped (``gpu_ran``).
"""

from __future__ import annotations

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
import gpu_check_common as common  # noqa: E402

ROOT = common.ROOT
GPU_TEST_FILES = ("tests/test_cuda.py", "tests/test_fused.py", "tests/test_app_batching.py",
                  "tests/test_app_health.py", "tests/test_measure.py")
DEVICE_CAP_S = 90.0  # = gpu_check.DEVICE_ESTIMATE_S["tests"] (a test checks); the first run did not time these files
DRY_RUN_CAP_S = 40.0
OUTCOME = re.compile(r"^(?P<node>\S+\.py::\S+)\s+(?P<outcome>PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
SUMMARY = re.compile(r"=+ .*\bin [0-9.]+s\b.* =+$")


def command(files=None) -> list[str]:
    files = GPU_TEST_FILES if files is None else files
    return [sys.executable, "-m", "pytest", "-v", "-rfEs", "-p", "no:cacheprovider", "--color=no", *files]


def run_pytest(cmd: list[str], cap_s: float, log=print) -> dict:
    """Run ``cmd`` in its own process group for at most ``cap_s``; outcomes read as they stream."""
    outcomes: dict[str, str] = {}
    tail: list[str] = []
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
            "not_passed": {node: o for node, o in outcomes.items() if o in ("FAILED", "ERROR")},
            "output_tail": "\n".join(tail[-120:])}


def run(out_dir: Path, mnist_dir: Path | None = None, dry_run: bool = False, log=print,
        deadline: float | None = None, reserve_s: float = 0.0, report: dict | None = None, **_) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {} if report is None else report
    report.update({"mode": common.mode_name(dry_run), "files": list(GPU_TEST_FILES)})
    cuda_file = GPU_TEST_FILES[0]  # tests/test_cuda.py: its tests run only on a GPU

    def finish(r: dict) -> None:
        got = r.get("pytest") or {}
        counts = got.get("counts") or {}
        gpu_ran = any(node.split("::")[0].endswith(Path(cuda_file).name) and o == "PASSED"
                      for node, o in (got.get("outcomes") or {}).items())
        r["gpu_ran"] = gpu_ran
        ran_clean = bool(got) and got.get("finished") and not got.get("timed_out") and got.get("returncode") == 0
        if dry_run:
            # the CPU cannot run them: the rehearsal passes when the command ran and its outcomes were
            # read (the cap may stop it), and nothing it ran failed
            r["passed"] = bool(got) and sum(counts.values()) > 0 and not got.get("not_passed")
        else:
            r["passed"] = bool(ran_clean) and sum(counts.values()) > 0 and not got.get("not_passed") and gpu_ran
            if not r["passed"]:
                r.setdefault("error", "the GPU tests " + (
                    f"ran past the cap of {r.get('cap_s')} s" if got.get("timed_out") else
                    f"did not pass: {', '.join(sorted(got.get('not_passed') or {})) or 'no outcome'}"
                    if got.get("not_passed") or not counts else
                    "ran, but tests/test_cuda.py's tests skipped (no CUDA?)" if not gpu_ran else
                    f"ended with pytest's exit status {got.get('returncode')}"))

    with common.kept(report, out_dir / "tests.json", finish):
        cap = DRY_RUN_CAP_S if dry_run else DEVICE_CAP_S
        if deadline is not None:
            cap = min(cap, deadline - time.monotonic() - reserve_s)
        report["cap_s"] = round(cap, 1)
        if cap < 10:
            report["skipped"] = f"not run: {cap:.0f} s left for the tests (the budget)"
            report["budget_cut"] = True
            return report
        cmd = command()
        report["command"] = " ".join(cmd[1:])
        log(f"[tests] {' '.join(cmd[2:])} (cap {cap:.0f} s)")
        report["pytest"] = run_pytest(cmd, cap, log)
        c = report["pytest"]["counts"]
        log(f"[tests] {c['passed']} passed, {c['failed']} failed, {c['error']} errors, {c['skipped']} skipped "
            f"in {report['pytest']['seconds']:.1f} s" + (" (stopped by the cap)" if report["pytest"]["timed_out"] else ""))
        if dry_run:
            report["not_checked_in_dry_run"] = ["the CUDA tests (they skip without a GPU)",
                                                "the whole files: the dry run's cap stops them"]
    return report
