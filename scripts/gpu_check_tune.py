"""The tuning run (scripts/gpu_tune.py) as a section of scripts/gpu_check.py: the second call of
docs/gpu.md's plan (``SECTIONS=tune,tests``), so that it runs under the device script's setup,
budget, interrupts, publishing and exit statuses.

Every candidate is checked on the eleven draws against the cpu backend query by query and timed;
the choice never takes a candidate that changed a prediction (gpu_tune.select). Its files go to
``out_dir/tune/`` (tune.json, replaced after every phase and candidate; summary.txt; tuned.py, the
table module with this GPU's row, to copy over learner/kernels/tuned.py here; cpu_reference.npz
when the device host computed it; cuda_other_workspace.json), and its report is the section's,
published after every candidate (gpu_check.py's ``checkpoint``): a call ended by its time limit
still returns what it measured. ``passed``: a row was chosen, every candidate ran (none cut for
the budget), and (on a GPU) the cpu reference's counts are the published ones.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check_common as common  # noqa: E402
import gpu_tune  # noqa: E402


def run(out_dir: Path, mnist_dir: Path, dry_run: bool = False, log=print, report: dict | None = None,
        clock=None, reserve_s: float = 0.0, alarms=None, checkpoint=None, deadline: float | None = None, **_) -> dict:
    out_dir = Path(out_dir)
    report = {} if report is None else report
    tune_dir = out_dir / "tune"
    clock = common.clock_for(clock, deadline)
    budget = clock.budget_left() if not clock.projected else gpu_tune.BUDGET_S["dry-run"]
    with common.kept(report, tune_dir / "tune.json"):
        gpu_tune.run(tune_dir, mnist_dir, dry_run, budget, write=False, sm90=False, log=log, clock=clock,
                     reserve_s=reserve_s, alarms=alarms, checkpoint=checkpoint, report=report)
        report["files"] = sorted(p.name for p in tune_dir.iterdir() if not p.name.startswith("."))
        report["passed"] = bool(report.get("passed"))
    return report
