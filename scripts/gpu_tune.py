"""Choose the GPU backends' settings on this GPU by measurement, in one run (issues #47, #53).

    python3 scripts/gpu_tune.py --out DIR [--write]     # on a CUDA GPU, alone: <= 6 minutes on one H200
    python3 scripts/gpu_tune.py --dry-run --out DIR     # here: Triton's interpreter, small tasks
    python3 scripts/gpu_tune.py --estimate              # the device projection, phase by phase, and exit

On a lent GPU it runs as the ``tune`` section of scripts/gpu_check.py, in the second call of
docs/gpu.md's plan (``SECTIONS=precheck,tune,tests ... bash scripts/gpu_device_run.sh``).

Every candidate:

  fused, one program per task (learner/kernels/fused_train.py): each (chunk, num_warps) of
         FUSED_ONE at each product precision (ieee, tf32x3)
  fused, split (fused_rows.py + fused_update.py + fused_predict.py: a lone task's minibatch over programs):
         each (chunk, num_warps) of FUSED_SPLIT at each precision
  cuda   each step of learner/backends/cuda.py (autograd, explicit, explicit-bmm) with this
         process's cuBLAS workspace (the table's, :16:8), then the fastest of them that passed with
         the other workspace (ALT_WORKSPACE, :4096:8) in a child process (CUBLAS_WORKSPACE_CONFIG is
         read once, before CUDA starts)

is checked on all eleven published draws (dataset seeds 2026091400 + k, the default config) against
the cpu backend, query by query: 110,000 predictions equal, and draw 0's parameters and velocity
within (2e-5, 3e-3) of it. The cpu backend's references are the carried ones
(scripts/gpu_reference.py, .device-reference/) where the draws built here are their tasks, else a
child process computes them on this host while the candidates compile; its per-draw counts are
compared with the published table. A candidate that changes one prediction (or fails to compile,
or runs out of tolerance, or past its own time limit) is reported with what it changed, and never
chosen.

Then timed: alone (draw 0, one task per launch: median CUDA-event ms of TIMING["single"] runs, and
its bytes alone) and, for the one-program kernel, in a launch of the SM count (draw 0 and SM count
- 1 reorderings with their own seeds, bench/bench_fused.batch_tasks: median ms per task of
TIMING["launch"] launches), whose every task's predictions are compared with the cpu backend's.
Bytes across candidates (``compare_bytes``): the eleven draws' launch (predictions, scores,
state), draw 0 alone and the SM-count launch (predictions, scores), each candidate against the
launch choice: the same bytes, other scores only, or other predictions.

The choice (``select``), per GPU name, written with ``--write`` into learner/kernels/tuned.py's
table (the block between its BEGIN and END lines; a copy goes to DIR/tuned.py either way):

  launch     the passing one-program candidate with the least ms per task in a launch of the SM
             count, among those whose SM-count launch changed no prediction and whose draw 0 alone
             gives its bytes in a launch
  lone       the passing candidate (either variant) with the least ms alone, of the launch choice's
             precision, whose results are the launch choice's bytes on every draw and alone (so a
             task's answer never depends on whether it shared a launch); None when that is the
             launch choice itself
  cuda_step  the passing cuda step with the least ms alone (this process's workspace)
  bytes      the candidates with the launch choice's bytes, with other scores, with other predictions
  workspace  learner/kernels/tuned.py CUBLAS_WORKSPACE, one value for every GPU: switched to the
             other only when its candidate passed the eleven draws query by query, was faster, and
             the chosen cuda step is the one it ran (``choose_workspace``)

Nothing passes: no row is written, and the report says why.

Budget: every device figure is scripts/gpu_budget.py's (TUNE: each phase and candidate, with its
source and its own limit). A candidate starts only when its seconds fit what is left of the budget
beside the later sections' reserve (``candidate_fits``), and runs under its own limit (StepLimit:
refused, saying so); the compile phase has its own limit (its projection + a margin: workers still
compiling are killed, their candidates refused), the cpu reference computed here its own (90 s).
``--budget-s`` (alone: default 360 s on a GPU) is the hard limit over all. The dry run decides on
the device clock projected for 360 s and prints the projection first; ``--estimate`` prints it.

Output, into DIR (``tune/`` of the device run's bundle), up to five files: tune.json (everything,
replaced whole after every phase and candidate, so a run stopped by its time limit keeps what it
measured), summary.txt (one screen, also printed last), tuned.py (the table module with this GPU's
row and the workspace), cuda_other_workspace.json (the other workspace's child) and
cpu_reference.npz (only when this host computed the reference).

The script finds the driver's libcuda for Triton (scripts/gpu_find_libcuda.sh) and Python.h for its
launcher itself, as scripts/gpu_device_run.sh does.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import glob
import hashlib
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import sysconfig
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
ROOT = SCRIPTS.parent
sys.path.insert(0, str(SCRIPTS))
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import gpu_budget  # noqa: E402
import gpu_check_common as common  # noqa: E402

DRAW_SEED_BASE = 2026091400
DRAWS = tuple(range(11))
# The cpu backend's correct counts on the eleven draws (docs/learner.md, 9ffba97; 98,208 in all).
PUBLISHED_COUNTS = (8887, 8916, 8947, 8904, 8992, 8979, 8911, 8922, 8950, 8877, 8923)
DRY_SLICE = (0, 48, 16)  # the dry run's tasks: rows 0..47 of each draw, 16 queries (one minibatch per epoch)
DRY_LAUNCH = 2  # the dry run's "SM count"
FUSED_ONE = ((128, 8), (64, 8), (64, 4), (128, 16), (128, 4), (32, 4))  # (chunk, num_warps)
FUSED_SPLIT = ((16, 4), (32, 4), (32, 8))
PRECISIONS = ("ieee", "tf32x3")
CUDA_STEPS = ("autograd", "explicit", "explicit-bmm")
ALT_WORKSPACE = ":4096:8"  # the other workspace, timed and checked in a child process (this process runs the table's)
TIMING = {"device": {"single": 5, "launch": 3}, "dry-run": {"single": 1, "launch": 1}}
# Every device figure (the phases, each candidate's expected seconds and own limit, the budget) is
# scripts/gpu_budget.py's, with its source; gpu_check.py reads the same table.
BUDGET_S = gpu_budget.TUNE_BUDGET_S
DEVICE_LIMIT_S = gpu_budget.TUNE_DEVICE_LIMIT_S


# --------------------------------------------------------------------------- candidates


@dataclasses.dataclass(frozen=True)
class Candidate:
    kind: str  # "fused" or "cuda"
    chunk: int | None = None
    num_warps: int | None = None
    precision: str = "ieee"
    variant: str = "one"
    step: str | None = None
    workspace: str | None = None  # cuda: None is this process's CUBLAS_WORKSPACE_CONFIG

    @property
    def name(self) -> str:
        if self.kind == "fused":
            return f"fused {self.variant} {self.chunk}x{self.num_warps} {self.precision}"
        return f"cuda {self.step}" + (f" {self.workspace}" if self.workspace else "")

    def choice(self) -> dict:
        return {"chunk": self.chunk, "num_warps": self.num_warps, "precision": self.precision, "variant": self.variant}


def candidates() -> list[Candidate]:
    out = [Candidate("fused", c, w, p, "one") for p in PRECISIONS for c, w in FUSED_ONE]
    out += [Candidate("fused", c, w, p, "split") for p in PRECISIONS for c, w in FUSED_SPLIT]
    out += [Candidate("cuda", step=s) for s in CUDA_STEPS]
    out.append(Candidate("cuda", step="autograd", workspace=ALT_WORKSPACE))
    return out


def kernels_to_compile(cands: list[Candidate]) -> int:
    return sum(3 if c.variant == "split" else 1 for c in cands if c.kind == "fused")


def estimate_device_s(cands: list[Candidate]) -> dict:
    """The device seconds of a full run of ``cands`` (scripts/gpu_budget.py's table), phase by phase."""
    phases = gpu_budget.tune_phases(cands)
    return {"phases": phases, "total_s": sum(phases.values()), "limit_s": DEVICE_LIMIT_S,
            "fits": sum(phases.values()) <= DEVICE_LIMIT_S,
            "basis": "scripts/gpu_budget.py TUNE: from the first H200 run's measured figures, beside each"}


def cost_of(c: Candidate) -> gpu_budget.Cost:
    return gpu_budget.candidate_cost(c.kind, c.variant, c.workspace)


def cost_key(c: Candidate) -> str:
    return ("cuda_other_workspace" if c.workspace else "cuda" if c.kind == "cuda"
            else "fused_split" if c.variant == "split" else "fused_one")


def candidate_fits(c: Candidate, clock, reserve_s: float) -> tuple[bool, str | None]:
    """The tuning run's budget decision per candidate (scripts/gpu_budget.py replays it): its
    expected seconds and the report's fit in what is left of the budget beside ``reserve_s`` (the
    sections after this one) and of the section's own limit."""
    need = cost_of(c).seconds + gpu_budget.TUNE["report"].seconds
    left, section_left = clock.budget_left(), clock.section_left()
    if left - reserve_s >= need and section_left >= need:
        return True, None
    return False, (f"not run: the time budget was spent ({left:.0f} s left, {reserve_s:.0f} s kept for later "
                   f"sections, {section_left:.0f} s of the section's limit; it needs {need:g} s)")


def compile_limit_s(kernels: int) -> float:
    return gpu_budget.compile_seconds(kernels) + gpu_budget.TUNE["compile_margin"].seconds


def replay_phases(clock, reserve_s: float) -> dict:
    """The tuning run's time structure on ``clock`` (scripts/gpu_budget.py's replay): its phases
    marked with the table's seconds and each candidate decided by ``candidate_fits``, as ``run``
    decides it; nothing runs."""
    cands = candidates()
    clock.mark("start")
    clock.mark("draws")
    clock.mark("compile", max(gpu_budget.compile_seconds(kernels_to_compile(cands)), gpu_budget.TUNE["reference"].seconds))
    not_run = []
    for c in cands:
        fits, _ = candidate_fits(c, clock, reserve_s)
        if fits:
            clock.mark(c.name, cost_of(c).seconds)
        else:
            not_run.append(c.name)
    clock.mark("report")
    out = {"passed": not not_run, "not_run": not_run, "candidates_run": len(cands) - len(not_run)}
    if not_run:
        out["budget_cut"] = f"{len(not_run)} of {len(cands)} candidates not run for the budget"
    return out


# --------------------------------------------------------------------------- the eleven draws and the reference


def build_draws(mnist_dir: Path, dry_run: bool):
    """(tasks, labels) of the eleven draws (the dry run: DRY_SLICE of each)."""
    from learner.taskio import make_task, validate_task

    tasks, labels = [], []
    for k in DRAWS:
        task, lab = make_task(mnist_dir, DRAW_SEED_BASE + k)
        if dry_run:
            start, n, m = DRY_SLICE
            task = validate_task(task.train_images[start:start + n].copy(), task.train_labels[start:start + n].copy(),
                                 task.test_images[start:start + m].copy())
            lab = lab[start:start + m]
        tasks.append(task)
        labels.append(lab)
    return tasks, labels


def shared_reference(mnist_dir: Path, dry_run: bool, out_dir: Path, tasks=None, log=None):
    """The cpu backend's references (scripts/gpu_reference.py): the carried ones where ``tasks`` are
    theirs, else a child process on this host; one per process and input."""
    import gpu_reference

    return gpu_reference.shared_reference(mnist_dir, dry_run, out_dir, tasks=tasks,
                                          limit_s=gpu_budget.TUNE["reference"].limit_s, log=log)


# --------------------------------------------------------------------------- checking a candidate


def digest(out) -> str:
    """SHA-256 of one task's final parameters, velocity and scores (bytes)."""
    h = hashlib.sha256()
    for a in list(out.final_parameters) + list(out.final_velocity) + [out.scores]:
        h.update(a.tobytes())
    return h.hexdigest()


def predictions_of(out):
    """A task's predictions: the backend's own (the fused kernel's argmax on the device), else the scores'."""
    return out.predictions if getattr(out, "predictions", None) is not None else out.scores.argmax(1)


def bytes_digests(outs) -> dict:
    """A launch's bytes, digested: its predictions and its scores (every task, in order)."""
    import numpy as np

    preds, scores = hashlib.sha256(), hashlib.sha256()
    for o in outs:
        preds.update(np.ascontiguousarray(predictions_of(o), dtype=np.int64).tobytes())
        scores.update(np.ascontiguousarray(o.scores).tobytes())
    return {"predictions_sha256": preds.hexdigest(), "scores_sha256": scores.hexdigest(), "tasks": len(outs)}


def check_outputs(outs, ref: dict, labels=None) -> dict:
    """A candidate's eleven outputs against the cpu backend's: every query's prediction, draw 0's
    parameters and velocity within (2e-5, 3e-3). ``passed`` needs both."""
    import numpy as np

    from learner.reference_check import TOLERANCE, max_violation

    mismatches, differing = [], {}
    for k, (out, ref_pred) in enumerate(zip(outs, ref["predictions"])):
        pred = predictions_of(out)
        bad = np.flatnonzero(pred != ref_pred)
        if out.scores is not None:  # the backend's argmax must be the scores' (numpy's first of the highest)
            bad = np.union1d(bad, np.flatnonzero(out.scores.argmax(1) != ref_pred))
        mismatches.append(int(bad.size))
        if bad.size:
            differing[str(k)] = [int(i) for i in bad[:20]]
    ok_p, err_p = max_violation(outs[0].final_parameters, ref["params0"], **TOLERANCE)
    ok_v, err_v = max_violation(outs[0].final_velocity, ref["velocity0"], **TOLERANCE)
    report = {
        "predictions_compared": int(sum(len(p) for p in ref["predictions"])),
        "predictions_differing": int(sum(mismatches)), "differing_by_draw": mismatches,
        "differing_queries": differing,  # the first 20 per draw
        "draw0_parameters_within_tolerance": bool(ok_p), "draw0_parameter_max_abs_error": err_p,
        "draw0_velocity_within_tolerance": bool(ok_v), "draw0_velocity_max_abs_error": err_v,
        "digests": [digest(o) for o in outs],
        "launch_bytes": bytes_digests(outs),
    }
    if labels is not None:
        report["correct_by_draw"] = [int((predictions_of(o) == lab).sum()) for o, lab in zip(outs, labels)]
    report["passed"] = bool(report["predictions_differing"] == 0 and ok_p and ok_v)
    if not report["passed"]:
        why = []
        if report["predictions_differing"]:
            why.append(f"{report['predictions_differing']} of {report['predictions_compared']} predictions differ "
                       f"from the cpu backend's (by draw: {mismatches})")
        if not ok_p or not ok_v:
            why.append(f"draw 0's state off the cpu backend's by up to {max(err_p, err_v):.3g} (tolerance 2e-5 + 3e-3 |x|)")
        report["refused"] = "; ".join(why)
    return report


def run_draws(engine, tasks, prepareds) -> list:
    """The eleven draws on ``engine``: one launch where it launches several tasks, else one by one."""
    if callable(getattr(engine, "run_many", None)):
        return engine.run_many(tasks, prepareds)
    return [engine.run(t, p) for t, p in zip(tasks, prepareds)]


def time_ms(out, wall_ms: float) -> float:
    return float(out.cuda_ms) if out.cuda_ms is not None else wall_ms


def time_single(engine, task, prepared, repeats: int) -> dict:
    """Median ms of ``repeats`` runs of one task alone, and that task's bytes alone (``digest``:
    the same task in a launch of several must give them)."""
    first = engine.run(task, prepared)  # compile (found in the cache), load, capture: outside the timing
    values = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = engine.run(task, prepared)
        values.append(time_ms(out, (time.perf_counter() - t) * 1000))
    return {"ms_values": values, "median_ms": statistics.median(values), "digest": digest(first),
            "repeat_byte_identical": digest(out) == digest(first) if repeats else None}


def launch_check(outs, ref_predictions: list) -> dict:
    """A launch's predictions against the cpu backend's, task by task, where the reference holds
    the task (``ref_predictions``: an array or None per task), and its bytes digested."""
    import numpy as np

    differing, checked, by_task = 0, 0, {}
    for t, (out, ref) in enumerate(zip(outs, ref_predictions)):
        if ref is None:
            continue
        bad = int(np.count_nonzero(predictions_of(out) != ref))
        checked += 1
        differing += bad
        if bad:
            by_task[str(t)] = bad
    return {"tasks": len(outs), "tasks_checked_against_cpu": checked,
            "predictions_compared": int(sum(len(r) for r in ref_predictions if r is not None)),
            "predictions_differing": differing, "differing_by_task": by_task, **bytes_digests(outs)}


def time_launch(engine, tasks, prepareds, repeats: int, ref_predictions: list | None = None) -> dict:
    """Median ms per task of ``repeats`` launches of ``tasks``; the first launch's predictions
    against the cpu backend's (``launch_check``)."""
    first = engine.run_many(tasks, prepareds)
    check = launch_check(first, ref_predictions or [None] * len(tasks))
    del first
    values = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = engine.run_many(tasks, prepareds)[0]
        values.append(time_ms(out, (time.perf_counter() - t) * 1000))
    med = statistics.median(values)
    return {"tasks_per_launch": len(tasks), "ms_values": values, "median_launch_ms": med,
            "median_ms_per_task": med / len(tasks), "check": check}


def make_engine(c: Candidate, device: str):
    if c.kind == "fused":
        from learner.backends.fused import FusedBackend

        return FusedBackend(device, chunk=c.chunk, num_warps=c.num_warps, precision=c.precision, variant=c.variant)
    from learner.backends.cuda import GraphBackend

    return GraphBackend(device, step=c.step)


# --------------------------------------------------------------------------- choosing


def compare_bytes(results: list[dict], against: dict | None) -> dict:
    """Every fused candidate's bytes beside ``against``'s (the launch choice): the eleven draws'
    launch (predictions, then scores and state), its draw 0 alone, the launch of the SM count.
    ``same`` -- every byte equal; ``other_scores`` -- the predictions equal, the scores (or state)
    not; ``other_predictions`` -- a prediction differs. The table records it beside the row."""
    out: dict = {"against": against and against["name"], "same": [], "other_scores": [], "other_predictions": [],
                 "not_compared": [], "by_candidate": {}}
    if against is None:
        return out
    base = against["check"]

    def relation(r: dict) -> str:
        c = r.get("check") or {}
        if not c.get("launch_bytes"):
            return "not_compared"
        if c["launch_bytes"]["predictions_sha256"] != base["launch_bytes"]["predictions_sha256"]:
            return "other_predictions"
        launch, base_launch = (r.get("launch") or {}).get("check"), (against.get("launch") or {}).get("check")
        if launch and base_launch and launch["predictions_sha256"] != base_launch["predictions_sha256"]:
            return "other_predictions"
        same = c["digests"] == base["digests"]
        single, base_single = (r.get("single") or {}).get("digest"), (against.get("single") or {}).get("digest")
        if single is not None and single != base_single:
            same = False
        if launch and base_launch and launch["scores_sha256"] != base_launch["scores_sha256"]:
            same = False
        return "same" if same else "other_scores"

    for r in results:
        if r.get("kind") != "fused" or r is against:
            continue
        rel = relation(r)
        out[rel].append(r["name"])
        out["by_candidate"][r["name"]] = rel
    return out


def launch_eligible(r: dict) -> tuple[bool, str | None]:
    """Whether a passing one-program candidate may be the launch choice: timed in a launch of the
    SM count whose predictions equal the cpu backend's wherever the reference holds the task, and
    whose draw 0 alone gives the bytes it gives in the eleven draws' launch (a task's answer must
    not depend on whether it shared a launch)."""
    launch = r.get("launch") or {}
    if launch.get("median_ms_per_task") is None:
        return False, "not timed in a launch"
    check = launch.get("check") or {}
    if check.get("predictions_differing"):
        return False, (f"its launch of {launch.get('tasks_per_launch')} changed {check['predictions_differing']} "
                       "predictions against the cpu backend")
    single = (r.get("single") or {}).get("digest")
    if single is not None and single != r["check"]["digests"][0]:
        return False, "draw 0 alone gives other bytes than draw 0 in a launch"
    return True, None


def select(results: list[dict], gpu: str | None, when: str, workspace: str | None = None) -> dict:
    """The winners among the candidates that passed (a refused one is never chosen), and the row.
    ``workspace``: this process's CUBLAS_WORKSPACE_CONFIG (the other one's candidate ran in a child)."""
    passed = [r for r in results if r.get("passed")]
    one, not_eligible = [], {}
    for r in passed:
        if r["kind"] == "fused" and r["variant"] == "one":
            ok, why = launch_eligible(r)
            if ok:
                one.append(r)
            else:
                not_eligible[r["name"]] = why
    launch = min(one, key=lambda r: r["launch"]["median_ms_per_task"]) if one else None
    lone = None
    if launch is not None:
        same = [r for r in passed if r["kind"] == "fused" and (r.get("single") or {}).get("median_ms") is not None
                and r["precision"] == launch["precision"] and r["check"]["digests"] == launch["check"]["digests"]
                and r["single"].get("digest", launch["check"]["digests"][0]) == launch["check"]["digests"][0]]
        lone = min(same, key=lambda r: r["single"]["median_ms"]) if same else launch
    steps = [r for r in passed if r["kind"] == "cuda" and not r.get("workspace")
             and (r.get("single") or {}).get("median_ms") is not None]
    cuda = min(steps, key=lambda r: r["single"]["median_ms"]) if steps else None
    out = {"launch": launch and launch["name"], "lone": lone and lone["name"], "cuda_step": cuda and cuda["name"],
           "refused": {r["name"]: r.get("refused") for r in results if not r.get("passed")}}
    if not_eligible:
        out["not_eligible_for_the_launch"] = not_eligible
    faster_but_other_bytes = [r["name"] for r in passed if r["kind"] == "fused" and lone is not None
                              and (r.get("single") or {}).get("median_ms") is not None
                              and r["single"]["median_ms"] < lone["single"]["median_ms"]
                              and r["check"]["digests"] != launch["check"]["digests"]]
    if faster_but_other_bytes:
        out["faster_alone_but_not_the_launch_choice_bytes"] = faster_but_other_bytes
    out["bytes"] = compare_bytes(results, launch)
    out.update(choose_workspace(results, cuda, workspace))
    if launch is None:
        out["row"] = None
        out["why_no_row"] = ("no one-program fused candidate passed the eleven-draw check and was timed in a launch "
                             "that changed no prediction")
        return out
    b = out["bytes"]
    row = {
        "launch": {k: v for k, v in launch["choice"].items() if k != "variant"},
        "lone": None if lone is launch else dict(lone["choice"]),
        "cuda_step": cuda["step"] if cuda else "autograd",
        "source": (f"scripts/gpu_tune.py on {gpu}, {when}: launch {launch['name']} "
                   f"{launch['launch']['median_ms_per_task']:.4f} ms per task in {launch['launch']['tasks_per_launch']}; "
                   f"lone {lone['name']} {lone['single']['median_ms']:.2f} ms"
                   + (f"; cuda {cuda['name']} {cuda['single']['median_ms']:.2f} ms" if cuda else "")
                   + "; each passed the eleven draws query by query"),
        # which candidates give the launch choice's bytes (a task's answer whatever the table picks)
        "bytes": {"same": b["same"], "other_scores": b["other_scores"], "other_predictions": b["other_predictions"]},
    }
    out["row"] = row
    return out


def choose_workspace(results: list[dict], cuda: dict | None, workspace: str | None) -> dict:
    """The cuBLAS workspace for every GPU (learner/kernels/tuned.py CUBLAS_WORKSPACE): the other one
    only when its candidate (in a child process, with the fastest step that passed here) passed the
    eleven draws query by query, was faster than this process's run of that step, and the chosen
    cuda step is that step."""
    other = next((r for r in results if r.get("workspace")), None)
    mine = next((r for r in results if r.get("kind") == "cuda" and not r.get("workspace")
                 and other is not None and r.get("step") == other.get("step")), None)
    keep = {"cublas_workspace": workspace, "cublas_workspace_switched": False}
    if other is None:
        return {**keep, "cublas_workspace_why": "no other workspace was run"}
    if not other.get("passed"):
        return {**keep, "cublas_workspace_why": f"{other['name']} was refused: {other.get('refused')}"}
    if mine is None or not mine.get("passed") or not (mine.get("single") or {}).get("median_ms"):
        return {**keep, "cublas_workspace_why": f"this process's {other.get('step')} step has no passing time"}
    if cuda is None or cuda.get("step") != other.get("step"):
        return {**keep, "cublas_workspace_why": (f"the chosen cuda step ({cuda and cuda.get('step')}) was not run "
                                                 f"with {other['workspace']}")}
    a, b = mine["single"]["median_ms"], other["single"]["median_ms"]
    if b >= a:
        return {**keep, "cublas_workspace_why": f"{other['workspace']} {b:.2f} ms is not faster than {workspace} {a:.2f} ms"}
    return {"cublas_workspace": other["workspace"], "cublas_workspace_switched": True,
            "cublas_workspace_why": (f"{other['workspace']} passed the eleven draws query by query and took {b:.2f} ms "
                                     f"against {a:.2f} ms with {workspace}")}


BEGIN = "# BEGIN TABLE (scripts/gpu_tune.py --write replaces this block)"
END = "# END TABLE"


def literal(obj, indent: int = 0, width: int = 104) -> str:
    """``obj`` (dicts, strings, numbers, None) as Python source in this repository's style: double
    quotes, a dict on one line when it fits, else one key a line; a long string split in pieces."""
    pad = " " * indent
    if isinstance(obj, dict):
        flat = "{" + ", ".join(f"{json.dumps(k)}: {literal(v, 0, 10**6)}" for k, v in obj.items()) + "}"
        if len(flat) + indent <= width and "\n" not in flat:
            return flat
        inner = " " * (indent + 4)
        items = [f"{inner}{json.dumps(k)}: {literal(v, indent + 4, width)}," for k, v in obj.items()]
        return "{\n" + "\n".join(items) + f"\n{pad}}}"
    if isinstance(obj, str):
        text = json.dumps(obj)
        if len(text) + indent + 30 <= width:
            return text
        words, pieces, line = obj.split(" "), [], ""
        for w in words:
            if line and len(json.dumps(line + " " + w)) + indent + 8 > width:
                pieces.append(line + " ")
                line = w
            else:
                line = f"{line} {w}" if line else w
        pieces.append(line)
        inner = " " * (indent + 4)
        return "(\n" + "\n".join(f"{inner}{json.dumps(x)}" for x in pieces) + f"\n{pad})"
    if isinstance(obj, (list, tuple)):
        flat = "[" + ", ".join(literal(v, 0, 10**6) for v in obj) + "]"
        if len(flat) + indent <= width and "\n" not in flat:
            return flat
        inner = " " * (indent + 4)
        return "[\n" + "\n".join(f"{inner}{literal(v, indent + 4, width)}," for v in obj) + f"\n{pad}]"
    return "None" if obj is None else repr(obj)


def render_table(default: dict, table: dict) -> str:
    return (f"{BEGIN}\nDEFAULT: dict[str, Any] = {literal(default)}\n"
            f"TABLE: dict[str, dict[str, Any]] = {literal(table)}\n{END}")


WORKSPACE_LINE = re.compile(r'^CUBLAS_WORKSPACE = "[^"]*"$', re.M)


def with_row(module_text: str, gpu: str, row: dict, workspace: str | None = None) -> str:
    """learner/kernels/tuned.py's text with ``gpu``'s row set to ``row`` (the block between BEGIN
    and END re-rendered) and, when ``workspace`` is given, its CUBLAS_WORKSPACE line set to it
    (``select`` switches it only after the other workspace passed query by query); nothing else."""
    start, end = module_text.index(BEGIN), module_text.index(END) + len(END)
    scope: dict = {"Any": object}
    exec(module_text[start:end], scope)  # noqa: S102 - our own file's literal table
    table = dict(scope["TABLE"])
    table[gpu] = row
    text = module_text[:start] + render_table(scope["DEFAULT"], table) + module_text[end:]
    if workspace is not None:
        if len(WORKSPACE_LINE.findall(text)) != 1:
            raise ValueError("learner/kernels/tuned.py has not exactly one CUBLAS_WORKSPACE line")
        text = WORKSPACE_LINE.sub(f'CUBLAS_WORKSPACE = "{workspace}"', text)
    return text


# --------------------------------------------------------------------------- the device's setup


def device_setup(log) -> dict:
    """What scripts/gpu_device_run.sh does before Triton runs: the driver's libcuda for Triton
    (TRITON_LIBCUDA_PATH), Python.h for its launcher (C_INCLUDE_PATH). Said in the report."""
    out: dict = {}
    if not os.environ.get("TRITON_LIBCUDA_PATH"):
        found = subprocess.run(["bash", str(SCRIPTS / "gpu_find_libcuda.sh")], capture_output=True, text=True)
        real = found.stdout.strip()
        if found.returncode == 0 and real:
            d = Path("/tmp/rev88-libcuda")
            d.mkdir(exist_ok=True)
            for name in ("libcuda.so.1", "libcuda.so"):
                link = d / name
                if link.is_symlink() or link.exists():
                    link.unlink()
                link.symlink_to(real)
            os.environ["TRITON_LIBCUDA_PATH"] = str(d)
            out["libcuda"] = real
        else:
            out["libcuda"] = f"not found ({found.stderr.strip()[-300:]}): Triton looks for itself"
    include = sysconfig.get_paths().get("include") or ""
    if not Path(include, "Python.h").exists():
        ver = f"{sys.version_info.major}.{sys.version_info.minor}"
        hits = sorted(glob.glob(f"/usr/include/python{ver}*/Python.h") + glob.glob(f"/usr/local/include/python{ver}*/Python.h")
                      + glob.glob(f"/opt/**/python{ver}*/Python.h", recursive=True))
        if hits:
            os.environ["C_INCLUDE_PATH"] = str(Path(hits[0]).parent) + (
                ":" + os.environ["C_INCLUDE_PATH"] if os.environ.get("C_INCLUDE_PATH") else "")
            out["python_h"] = hits[0]
        else:
            out["python_h"] = f"not found for Python {ver} (Triton's launcher build may fail)"
    log(f"setup: {out or 'nothing needed'}")
    return out


def _compile_one(c: Candidate, shapes: dict) -> dict:
    """In a worker process: compile ``c``'s kernel(s) for this GPU into Triton's cache (the same
    specialization as the real runs: aligned pointers, the draws' integers)."""
    t = time.perf_counter()
    try:
        import torch

        import learner  # noqa: F401
        from learner.kernels import fused_predict, fused_rows, fused_train, fused_update

        dev = dict(dtype=torch.float32, device="cuda")
        f, i = torch.empty(64, **dev), torch.empty(64, dtype=torch.int32, device="cuda")
        common = dict(n_train=shapes["n"], n_epochs=shapes["epochs"], batch_size=shapes["batch"], alpha=0.5,
                      learning_rate=0.1, momentum=0.9, weight_decay=0.0, depth=shapes["depth"], chunk=c.chunk,
                      num_warps=c.num_warps, precision=c.precision)
        train = torch.empty((1, 64), **dev)
        if c.variant == "split":
            bpad = fused_rows.programs_per_task(shapes["batch"], c.chunk) * c.chunk
            fused_rows.launch_rows(train, i, i, f, f, f, step=0, n_train=shapes["n"], n_epochs=shapes["epochs"],
                                   batch_size=shapes["batch"], alpha=0.5, depth=shapes["depth"], chunk=c.chunk,
                                   num_warps=c.num_warps, precision=c.precision, warmup=True)
            fused_update.launch_update(train, f, f, f, step=0, bpad=bpad, n_train=shapes["n"],
                                       batch_size=shapes["batch"], learning_rate=0.1, momentum=0.9, weight_decay=0.0,
                                       depth=shapes["depth"], num_warps=c.num_warps, precision=c.precision,
                                       warmup=True)
            fused_predict.launch_predict(train, f, f, f, param_stride=fused_train.state_size(shapes["depth"]),
                                         n_test=shapes["m"], alpha=0.5, depth=shapes["depth"], chunk=c.chunk,
                                         num_warps=c.num_warps, precision=c.precision, warmup=True)
        else:
            fused_train.launch(train, i, i, f, f, f, f, f, f, f, n_test=shapes["m"], warmup=True, **common)
        return {"compiled": True, "seconds": time.perf_counter() - t}
    except Exception as exc:  # noqa: BLE001 - reported; the candidate is refused
        return {"compiled": False, "seconds": time.perf_counter() - t, "error": f"{type(exc).__name__}: {exc}"}


def precompile(cands: list[Candidate], shapes: dict, workers: int, log, limit_s: float | None = None) -> dict:
    """Every fused candidate's kernels compiled into Triton's cache by ``workers`` processes, within
    ``limit_s`` (the compile phase's own limit): a kernel not compiled by then is reported as such
    (its candidate refused), the workers are killed, and the run goes on."""
    import concurrent.futures
    import multiprocessing

    fused = [c for c in cands if c.kind == "fused"]
    t = time.perf_counter()
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
    out: dict = {}
    try:
        futures = {pool.submit(_compile_one, c, shapes): c.name for c in fused}
        done, pending = concurrent.futures.wait(futures, timeout=limit_s)
        for f in done:
            try:
                out[futures[f]] = f.result()
            except Exception as exc:  # noqa: BLE001 - a broken worker: that candidate is refused
                out[futures[f]] = {"compiled": False, "seconds": None, "error": f"{type(exc).__name__}: {exc}"}
        for f in pending:
            out[futures[f]] = {"compiled": False, "seconds": None,
                               "error": f"not compiled within the compile phase's own limit of {limit_s:.0f} s"}
    finally:
        processes = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in processes:  # a worker still compiling when the limit came
            if proc.is_alive():
                proc.kill()
    log(f"compiled {sum(1 for v in out.values() if v['compiled'])} of {len(fused)} fused candidates in "
        f"{time.perf_counter() - t:.1f} s with {workers} workers" + (f" (limit {limit_s:.0f} s)" if limit_s else ""))
    return {name: out[name] for name in (c.name for c in fused)}


def compile_check_sm90(cands: list[Candidate], log) -> dict:
    """Dry run: every fused candidate compiled for sm_90 here (no GPU: triton.compile with a
    target), with its registers and stack from the cubin; not loaded, not run."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from learner.kernels import fused_predict, fused_rows, fused_train, fused_update

    ints = {"n_train", "n_test", "n_epochs", "batch_size", "step", "param_stride", "bpad"}

    def usage(kernel, constexprs, warps):
        sig = {}
        for n in kernel.arg_names:
            if n in constexprs:
                sig[n] = "constexpr"
            elif n in ("labels_ptr", "perm_ptr"):
                sig[n] = "*i32"
            elif n.endswith("_ptr"):
                sig[n] = "*fp32"
            else:
                sig[n] = "i32" if n in ints else "fp32"
        k = triton.compile(ASTSource(kernel, sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": warps, "num_stages": 1, "enable_fp_fusion": True})
        tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        path = Path("/tmp") / f"rev88-tune-{os.getpid()}.cubin"
        path.write_bytes(k.asm["cubin"])
        try:
            res = subprocess.run([str(tool), "--dump-resource-usage", str(path)], capture_output=True, text=True)
        finally:
            path.unlink(missing_ok=True)
        fields = dict(x.split(":", 1) for x in res.stdout.split() if x.startswith(("REG:", "STACK:")))
        return {"registers": int(fields.get("REG", -1)), "stack_bytes": int(fields.get("STACK", -1))}

    out = {}
    for c in (c for c in cands if c.kind == "fused"):
        t = time.perf_counter()
        base = {"DEPTH": 2, "CHUNK": c.chunk, "HAS_WD": False, "PRECISION": c.precision}
        try:
            if c.variant == "split":
                entry = {"rows": usage(fused_rows.fused_rows_kernel, {"DEPTH": 2, "CHUNK": c.chunk,
                                                                      "NPROG": 128 // c.chunk,
                                                                      "PRECISION": c.precision}, c.num_warps),
                         "update": usage(fused_update.fused_update_kernel, {"DEPTH": 2, "HAS_WD": False,
                                                                            "PRECISION": c.precision}, c.num_warps),
                         "predict": usage(fused_predict.fused_predict_kernel,
                                          {"DEPTH": 2, "CHUNK": c.chunk, "PRECISION": c.precision}, c.num_warps)}
            else:
                entry = usage(fused_train.fused_train_kernel, base, c.num_warps)
            entry["seconds"] = time.perf_counter() - t
        except Exception as exc:  # noqa: BLE001
            entry = {"error": f"{type(exc).__name__}: {exc}"}
        out[c.name] = entry
        log(f"  sm_90 {c.name:28s} {entry}")
    return out


# --------------------------------------------------------------------------- the run


def _refused_entry(c: Candidate, why: str) -> dict:
    return {"name": c.name, "kind": c.kind, "variant": c.variant, "precision": c.precision, "step": c.step,
            "workspace": c.workspace, "choice": c.choice() if c.kind == "fused" else None, "passed": False,
            "refused": why}


def run_candidate(c: Candidate, device: str, tasks, prepareds, labels, ref_job, launch_set, timing: dict,
                  compiled: dict | None, log, alarms=None, launch_ref: list | None = None) -> dict:
    """One candidate: the eleven draws against the cpu backend, timed alone and (the one-program
    kernel) in a launch of the SM count checked against the cpu backend too, under its own limit
    (scripts/gpu_budget.py; past it the candidate is refused with what it had measured)."""
    r = _refused_entry(c, None)
    r.pop("refused")
    limit = cost_of(c).limit_s
    r["limit_s"] = limit
    if compiled is not None and c.name in compiled:
        r["compile"] = compiled[c.name]
        if not compiled[c.name]["compiled"]:
            r["refused"] = f"does not compile: {compiled[c.name]['error']}"
            log(f"  {c.name:28s} REFUSED  ({r['refused']})")
            return r
    t = time.perf_counter()
    limited = alarms.step_limit(limit, c.name) if alarms is not None else contextlib.nullcontext(False)
    try:
        with limited as enforced:
            r["limit_enforced"] = bool(enforced)
            engine = make_engine(c, device)
            outs = run_draws(engine, tasks, prepareds)
            r["draws_seconds"] = time.perf_counter() - t
            r["check"] = check_outputs(outs, ref_job.result(), labels)
            del outs
            r["single"] = time_single(engine, tasks[0], prepareds[0], timing["single"])
            if c.kind == "fused" and c.variant == "one":
                r["launch"] = time_launch(engine, *launch_set, timing["launch"], ref_predictions=launch_ref)
        r["passed"] = r["check"]["passed"]
        if not r["passed"]:
            r["refused"] = r["check"]["refused"]
    except Exception as exc:  # noqa: BLE001 - reported (its own limit: common.StepLimit); the candidate is refused
        r["error"] = f"{type(exc).__name__}: {exc}"
        r["traceback"] = traceback.format_exc()[-3000:]
        r["refused"] = f"failed: {r['error']}"
        r["passed"] = False
    r["seconds"] = time.perf_counter() - t
    launch = (r.get("launch") or {}).get("median_ms_per_task")
    log(f"  {c.name:28s} {'passed' if r['passed'] else 'REFUSED'}"
        + (f"  alone {r['single']['median_ms']:9.3f} ms" if r.get("single") else "")
        + (f"  launch {launch:8.4f} ms/task" if launch is not None else "")
        + (f"  ({r['refused']})" if r.get("refused") else ""))
    return r


def other_workspace(c: Candidate, mnist_dir: Path, dry_run: bool, ref_path: Path, out_dir: Path, log) -> dict:
    """The cuda candidate with another CUBLAS_WORKSPACE_CONFIG: a child process (read before CUDA
    starts), killed past its own limit (scripts/gpu_budget.py)."""
    path = out_dir / "cuda_other_workspace.json"
    limit = cost_of(c).limit_s
    cmd = [sys.executable, str(Path(__file__).resolve()), "--cuda-child", c.step, "--reference-in", str(ref_path),
           "--mnist-dir", str(mnist_dir), "--child-out", str(path)] + (["--dry-run"] if dry_run else [])
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env={**os.environ, "CUBLAS_WORKSPACE_CONFIG": c.workspace}, capture_output=True,
                              text=True, timeout=limit)
        failed = None if proc.returncode == 0 and path.exists() else (
            f"child failed (exit {proc.returncode}): {(proc.stdout + proc.stderr)[-1500:]}")
    except subprocess.TimeoutExpired:
        failed = f"failed: the child ran past its own limit of {limit:.0f} s (killed)"
    r = _refused_entry(c, failed) if failed else json.loads(path.read_text())
    r["child_seconds"] = time.perf_counter() - t
    r["limit_s"] = limit
    log(f"  {c.name:28s} {'passed' if r.get('passed') else 'REFUSED'}"
        + (f"  alone {r['single']['median_ms']:9.3f} ms" if r.get("single") else "")
        + (f"  ({r['refused']})" if r.get("refused") else ""))
    return r


def cuda_child(step: str, mnist_dir: Path, dry_run: bool, ref_path: Path, out_path: Path) -> None:
    import gpu_reference

    from learner.config import Config
    from learner.train import prepare

    class Ref:  # the parent's reference, read from its file
        def result(self):
            return gpu_reference._load(ref_path)

    tasks, labels = build_draws(mnist_dir, dry_run)
    prepareds = [prepare(t, Config()) for t in tasks]
    c = Candidate("cuda", step=step, workspace=os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    r = run_candidate(c, "cpu" if dry_run else "cuda", tasks, prepareds, labels, Ref(), None,
                      TIMING["dry-run" if dry_run else "device"], None, lambda *_: None)
    common.write_json(out_path, r)


OUTPUTS = ("tune.json", "summary.txt", "tuned.py", "cpu_reference.npz", "cuda_other_workspace.json")


def run(out_dir: Path, mnist_dir: Path, dry_run: bool, budget_s: float, write: bool, sm90: bool, log=print,
        clock=None, reserve_s: float = 0.0, alarms=None, checkpoint=None, report: dict | None = None) -> dict:
    """The tuning run. ``report`` is filled as it goes and DIR/tune.json replaced whole after every
    phase and candidate (``checkpoint``, from gpu_check.py, publishes it too), so a run stopped at
    any point keeps what it measured. Its budget decisions read ``clock`` (gpu_check.py's; alone:
    the real clock, or in a dry run the device clock projected for a device budget of BUDGET_S)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    mode = "dry-run" if dry_run else "device"
    if clock is None:
        clock = common.Clock(BUDGET_S["device"], projected=True) if dry_run else common.Clock(budget_s)
    if clock.section is None:
        clock.start("tune", gpu_budget.section_limit("tune"))
    report = {} if report is None else report
    report.update({"mode": mode, "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                   "budget_decisions_by": ("the device clock projected by scripts/gpu_budget.py" if clock.projected
                                           else "the real clock"), "device_budget_s": clock.budget_s,
                   "reserve_s": reserve_s})
    cands = candidates()
    report["estimate"] = estimate_device_s(cands)

    def save(final: bool = False) -> None:
        report["seconds"] = time.monotonic() - t_start
        report["projected_device_seconds"] = clock.section_elapsed() if clock.projected else None
        common.write_json(out_dir / "tune.json", report)
        if final:
            common.write_text(out_dir / "summary.txt", summary(report))
        if checkpoint is not None:
            checkpoint()

    log(f"device estimate for a full run: {report['estimate']['total_s']:.0f} s of {DEVICE_LIMIT_S} "
        f"({'fits' if report['estimate']['fits'] else 'DOES NOT FIT'})")
    if not dry_run:
        report["setup"] = device_setup(log)
    import torch
    import triton

    import learner  # noqa: F401  (CUBLAS_WORKSPACE_CONFIG before CUDA starts)
    from learner.config import Config
    from learner.train import prepare

    bench = _bench()
    device = "cpu" if dry_run else "cuda"
    gpu = None if dry_run else torch.cuda.get_device_name()
    count = DRY_LAUNCH if dry_run else bench.sm_count()
    report.update({"gpu": gpu, "sm_count": None if dry_run else count, "torch": torch.__version__,
                   "triton": triton.__version__, "cublas_workspace": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
                   "tasks": "eleven draws" + (f", rows {DRY_SLICE}" if dry_run else ", 10k/10k each"),
                   "config": Config().as_dict(), "phases": {}})
    clock.mark("start")
    t = time.perf_counter()
    tasks, labels = build_draws(mnist_dir, dry_run)
    prepareds = [prepare(task, Config()) for task in tasks]
    ref_job = shared_reference(mnist_dir, dry_run, out_dir, tasks=tasks, log=log)
    report["reference_source"] = getattr(ref_job, "carried_reason", None) and (
        f"computed on this host (not carried: {ref_job.carried_reason})") or "carried"
    launch_set = bench.batch_tasks(tasks[0], Config(), count)
    report["draws_seconds"] = time.perf_counter() - t
    clock.mark("draws")
    save()
    compiled = None
    kernels = kernels_to_compile(cands)
    t = time.perf_counter()
    if not dry_run:
        n, m = tasks[0].train_count, tasks[0].test_count
        shapes = {"n": n, "m": m, "epochs": Config().epochs, "batch": Config().batch_size, "depth": Config().depth,
                  "steps": Config().epochs * -(-n // Config().batch_size)}
        limit = compile_limit_s(kernels)
        compiled = precompile(cands, shapes, gpu_budget.COMPILE_WORKERS, log, limit_s=min(limit, clock.section_left()))
        report["compile"] = compiled
        report["phases"]["compile"] = {"seconds": time.perf_counter() - t, "limit_s": limit}
    elif sm90:
        report["compile_sm90"] = compile_check_sm90(cands, log)
    try:
        ref = ref_job.result()
    except Exception as exc:  # noqa: BLE001 - no reference: nothing can be checked, so nothing is chosen
        report.update({"passed": False, "error": f"the cpu reference: {type(exc).__name__}: {exc}", "candidates": []})
        save(final=True)
        return report
    clock.mark("compile", max(gpu_budget.compile_seconds(kernels), gpu_budget.TUNE["reference"].seconds))
    report["reference"] = {
        "backend": "cpu", "source": ref.get("source"), "correct_by_draw": ref["correct"],
        "seconds_per_draw": ref["seconds_per_draw"], "torch_threads": ref["threads"],
        "wall_seconds": ref["wall_seconds"], "published_counts": list(PUBLISHED_COUNTS),
        "equals_published_counts": None if dry_run else ref["correct"] == list(PUBLISHED_COUNTS),
    }
    import gpu_reference

    launch_ref = gpu_reference.launch_reference(ref, launch_set[0])
    missing = [t for t, x in enumerate(launch_ref) if x is None]
    if missing:  # tasks of the launch the reference does not hold (another SM count, a dry run): computed here
        from learner.backends.cpu import CpuBackend

        cpu = CpuBackend()
        for t_ in missing:
            launch_ref[t_] = cpu.run(launch_set[0][t_], launch_set[1][t_]).scores.argmax(1)
        report["reference"]["launch_tasks_computed_here"] = len(missing)
    report["reference"]["launch_tasks"] = len(launch_ref)
    log(f"cpu reference ({ref.get('source')}): {sum(ref['correct'])} correct over the eleven draws; "
        f"{len(launch_ref)} tasks of the launch ({len(missing)} computed here)")
    ref_path = getattr(ref_job, "path", None)
    timing = TIMING[mode]
    results = report["candidates"] = []
    save()
    for c in cands:
        fits, why = candidate_fits(c, clock, reserve_s)
        if not fits:
            results.append(_refused_entry(c, why))
        elif c.workspace:
            # the other workspace with the step this process found fastest (of those that passed), so
            # that the workspace can be switched for the step the table will choose
            steps = [r for r in results if r.get("kind") == "cuda" and not r.get("workspace") and r.get("passed")
                     and (r.get("single") or {}).get("median_ms") is not None]
            if steps:
                c = dataclasses.replace(c, step=min(steps, key=lambda r: r["single"]["median_ms"])["step"])
            results.append(other_workspace(c, mnist_dir, dry_run, ref_path, out_dir, log))
            clock.mark(c.name, cost_of(c).seconds)
        else:
            results.append(run_candidate(c, device, tasks, prepareds, labels, ref_job, launch_set, timing, compiled,
                                         log, alarms=alarms, launch_ref=launch_ref))
            clock.mark(c.name, cost_of(c).seconds)
        save()
    not_run = [r["name"] for r in results if str(r.get("refused") or "").startswith("not run")]
    report["not_run"] = not_run
    when = datetime.date.today().isoformat()
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    report["choice"] = select(results, gpu or "the interpreter (dry run)", when, workspace)
    module = (ROOT / "learner" / "kernels" / "tuned.py").read_text()
    row = report["choice"]["row"]
    if row is not None:
        switch = report["choice"]["cublas_workspace"] if report["choice"]["cublas_workspace_switched"] else None
        text = with_row(module, gpu or "DRY RUN (interpreter)", row, workspace=switch)
        common.write_text(out_dir / "tuned.py", text)
        if write and not dry_run:
            (ROOT / "learner" / "kernels" / "tuned.py").write_text(text)
            report["written"] = str(ROOT / "learner" / "kernels" / "tuned.py")
    clock.mark("report")
    report["passed"] = row is not None and not not_run and (dry_run or bool(report["reference"]["equals_published_counts"]))
    if not_run:
        report["budget_cut"] = f"{len(not_run)} of {len(cands)} candidates not run for the budget: {', '.join(not_run)}"
    if dry_run:
        report["estimate_fits"] = report["estimate"]["fits"]
        report["passed"] = report["passed"] and report["estimate"]["fits"]
        report["not_checked_in_dry_run"] = [
            "compilation for and runs on a GPU (the interpreter ran every candidate)", "CUDA-event times",
            "tl.dot's precision (the interpreter computes in fp32 whatever it says)",
            "the byte equality of different chunks (numpy's matmul rounds a row differently with the row count)",
            "the 10k/10k draws (slices ran)", "a launch of the SM count (2 tasks ran)",
            "the carried cpu reference (the slices' reference was computed here)"]
    report["summary_lines"] = summary(report).splitlines()[1:]
    save(final=True)
    print(summary(report), end="", flush=True) if log is print else log(summary(report))
    return report


def summary(report: dict) -> str:
    """One screen: the run, every candidate (passed, ms alone and per task in a launch, predictions
    differing from the cpu backend's, its bytes beside the launch choice's), the choice."""
    projected = report.get("projected_device_seconds")
    lines = [f"gpu_tune {report['mode']}: {report.get('gpu') or 'interpreter'}, {report.get('seconds', 0):.0f} s; "
             f"device estimate {report['estimate']['total_s']:.0f} s of {DEVICE_LIMIT_S}"
             + (f"; projected {projected:.0f} s of a {report['device_budget_s']:g} s device budget"
                if projected is not None else "")]
    relation = ((report.get("choice") or {}).get("bytes") or {}).get("by_candidate") or {}
    short = {"same": "same bytes", "other_scores": "other scores", "other_predictions": "OTHER PREDICTIONS",
             "not_compared": "-"}
    for r in report.get("candidates", []):
        single = (r.get("single") or {}).get("median_ms")
        launch = (r.get("launch") or {}).get("median_ms_per_task")
        differ = (r.get("check") or {}).get("predictions_differing")
        ldiff = ((r.get("launch") or {}).get("check") or {}).get("predictions_differing")
        rel = "launch choice" if r["name"] == (report.get("choice") or {}).get("launch") else short.get(
            relation.get(r["name"]), "")
        lines.append(f"  {r['name']:27s} {'ok' if r.get('passed') else 'NO'}"
                     f" {'-' if single is None else f'{single:8.2f}'} ms"
                     f" {'-' if launch is None else f'{launch:7.4f}'} ms/t"
                     f" diff {'-' if differ is None else differ}/{'-' if ldiff is None else ldiff}"
                     f" {rel}" + (f" [{r['refused'][:60]}]" if r.get("refused") else ""))
    choice = report.get("choice") or {}
    lines.append(f"choice: launch {choice.get('launch')}, lone {choice.get('lone')}, cuda {choice.get('cuda_step')}; "
                 f"workspace {choice.get('cublas_workspace')} ({choice.get('cublas_workspace_why')})")
    if choice.get("row") is None and choice:
        lines.append(f"no row: {choice.get('why_no_row')}")
    if report.get("budget_cut"):
        lines.append(f"cut: {report['budget_cut'][:200]}")
    lines.append(f"passed: {report.get('passed')} (diff: predictions differing from the cpu backend's on the eleven "
                 "draws / in the launch)")
    return "\n".join(lines) + "\n"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_fused", ROOT / "bench" / "bench_fused.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def projection_text(budget_s: float | None = None, reserve_s: float = 0.0) -> str:
    """The device seconds a run would take, phase by phase and candidate by candidate, decided by
    ``candidate_fits`` on the projected clock (what ``--estimate`` and the dry run print)."""
    clock = common.Clock(budget_s or BUDGET_S["device"], projected=True)
    clock.start("tune", gpu_budget.section_limit("tune"))
    result = replay_phases(clock, reserve_s)
    lines = [f"gpu_tune device projection for a {clock.budget_s:g} s budget (scripts/gpu_budget.py):"]
    previous = 0.0
    for part, at in clock.parts():
        lines.append(f"  {part:30s} {at - previous:6.1f} s  (at {at:6.1f} s)")
        previous = at
    lines.append(f"  total {clock.section_elapsed():.0f} s; candidates run {result['candidates_run']}, "
                 f"not run {len(result['not_run'])}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu-tune-out"))
    parser.add_argument("--mnist-dir", type=Path, default=None)
    parser.add_argument("--dry-run", action="store_true", help="in Triton's interpreter on small tasks")
    parser.add_argument("--write", action="store_true", help="write the row into learner/kernels/tuned.py")
    parser.add_argument("--budget-s", type=float, default=None)
    parser.add_argument("--estimate", action="store_true", help="print the device estimate and exit")
    parser.add_argument("--sm90", action="store_true", help="dry run: also compile every candidate for sm_90")
    parser.add_argument("--cuda-child", help=argparse.SUPPRESS)  # child: a cuda candidate, another workspace
    parser.add_argument("--reference-in", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.estimate:
        print(json.dumps(estimate_device_s(candidates()), indent=2))
        print(projection_text(args.budget_s))
        return 0
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from learner.data import bundled_mnist_dir

    mnist_dir = args.mnist_dir or bundled_mnist_dir()
    if args.cuda_child:
        cuda_child(args.cuda_child, mnist_dir, args.dry_run, args.reference_in, args.child_out)
        return 0
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("gpu_tune: no CUDA GPU here; nothing was measured (try --dry-run)", file=sys.stderr)
            return 2
    print(projection_text(None if args.dry_run else args.budget_s), flush=True)
    budget = args.budget_s or BUDGET_S["dry-run" if args.dry_run else "device"]
    alarms = common.Alarms()
    alarms.arm(budget)
    try:
        report = run(args.out, mnist_dir, args.dry_run, budget, args.write, args.sm90, alarms=alarms,
                     log=lambda *a: print(*a, flush=True))
    except common.Interrupted as exc:  # the budget or SIGTERM: tune.json holds what was measured
        print(f"gpu_tune: stopped: {exc}; {args.out / 'tune.json'} holds what was measured", flush=True)
        return 3
    finally:
        alarms.quiet()
        alarms.disarm()
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
