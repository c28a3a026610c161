"""Choose the GPU backends' settings on this GPU by measurement, in one run (issue #47).

    python scripts/gpu_tune.py --out DIR [--write]     # on a CUDA GPU: <= 6 minutes on one H200
    python scripts/gpu_tune.py --dry-run --out DIR     # here: Triton's interpreter, small tasks
    python scripts/gpu_tune.py --estimate              # the device time it would take, and exit

Every candidate:

  fused, one program per task (learner/kernels/fused_train.py): each (chunk, num_warps) of
         FUSED_ONE at each product precision (ieee, tf32x3)
  fused, split (fused_rows.py + fused_update.py + fused_predict.py: a lone task's minibatch over programs):
         each (chunk, num_warps) of FUSED_SPLIT at each precision
  cuda   each step of learner/backends/cuda.py (autograd, explicit, explicit-bmm) with this
         process's cuBLAS workspace, and the autograd step with the other workspace (ALT_WORKSPACE)
         in a child process (CUBLAS_WORKSPACE_CONFIG is read once, before CUDA starts)

is checked on all eleven published draws (dataset seeds 2026091400 + k, the default config) against
the cpu backend on this host, query by query: 110,000 predictions equal, and draw 0's parameters and
velocity within (2e-5, 3e-3) of it. The cpu backend's references are computed by a child process
while the candidates compile (on the GPU host's cores), and its per-draw counts are compared with
the published table. A candidate that changes one prediction (or fails to compile, or runs out of
tolerance) is reported with what it changed, and never chosen.

Then timed: alone (draw 0, one task per launch: median CUDA-event ms of TIMING["single"] runs) and,
for the one-program kernel, in a launch of the SM count (draw 0 and SM count - 1 reorderings with
their own seeds, bench/bench_fused.batch_tasks: median ms per task of TIMING["launch"] launches).

The choice (``select``), per GPU name, written with ``--write`` into learner/kernels/tuned.py's
table (the block between its BEGIN and END lines; a copy goes to DIR/tuned.py either way):

  launch     the passing one-program candidate with the least ms per task in a launch of the SM count
  lone       the passing candidate (either variant) with the least ms alone, of the launch choice's
             precision, whose results are the launch choice's bytes on every draw (so a task's answer
             never depends on whether it shared a launch); None when that is the launch choice itself
  cuda_step  the passing cuda step with the least ms alone (this process's workspace)

Nothing passes: no row is written, and the report says why. The workspace is one value for every
GPU (learner/kernels/tuned.py CUBLAS_WORKSPACE); both are timed and reported.

Budget: ``--budget-s`` (default 360 s on a GPU) is a hard limit: a candidate is not started when
the time left is less than its estimate, and the report marks it not run. ``--estimate`` prints the
device estimate of a full run (DEVICE_COST_S, reasoned from the first H200 run's figures); the
dry run prints it too and fails when it does not fit 6 minutes.

Output: DIR/tune.json (everything), DIR/summary.txt, DIR/tuned.py (the table module with this
GPU's row). On the GPU machine (nothing but the repository travels):

    run(command="python scripts/gpu_tune.py --out $OUT --write", timeout_s=420)

The script finds the driver's libcuda for Triton (scripts/gpu_find_libcuda.sh) and Python.h for its
launcher itself, as scripts/gpu_device_run.sh does.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import glob
import hashlib
import importlib.util
import json
import math
import os
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
BUDGET_S = {"device": 360, "dry-run": 1800}
DEVICE_LIMIT_S = 360  # what a device run must fit: 6 minutes on one H200
# Seconds on one H200, reasoned from the first run (../shared/notes/gpu-h200.md: a first fused
# task 5.6 s with its compile, draw-0 cuda replays 60 ms (44 with this workspace), 528 tasks
# staged in 2.4 s, the one-shot's imports and CUDA start) -- an estimate, not a measurement:
DEVICE_COST_S = {
    "start": 12,  # imports, CUDA start, the libcuda lookup
    "draws": 6,  # the eleven draws from MNIST, and SM count - 1 reorderings of draw 0 for the launches
    "compile_kernel": 6,  # one kernel for sm_90 (the split variant has three), in a worker process
    "compile_workers": 6,  # worker processes compiling at once (16 host cores)
    "compile_worker_start": 15,  # a worker's imports and CUDA context
    "fused_one": 5,  # the eleven draws in one launch, 1 + 5 single runs, 1 + 3 launches of 132 (staging ~0.7 s each)
    "fused_split": 3,  # the eleven draws (two launches per step: ~320 launches each), 1 + 5 single runs
    "cuda": 4,  # capture, the eleven draws one after another, 1 + 5 timed runs
    "cuda_other_workspace": 15,  # a child process: imports, CUDA, capture, the draws, timing
    "reference": 12,  # the cpu backend on the eleven draws (child process, beside the compiles)
    "report": 3,
}


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
    """The device seconds of a full run of ``cands`` (DEVICE_COST_S), phase by phase."""
    c = DEVICE_COST_S
    rounds = math.ceil(kernels_to_compile(cands) / c["compile_workers"])
    compile_s = c["compile_worker_start"] + rounds * c["compile_kernel"]
    phases = {
        "start": c["start"],
        "draws": c["draws"],
        "compile (and the cpu reference beside it)": max(compile_s, c["reference"]),
        "fused one-program candidates": c["fused_one"] * sum(1 for x in cands if x.kind == "fused" and x.variant == "one"),
        "fused split candidates": c["fused_split"] * sum(1 for x in cands if x.variant == "split"),
        "cuda candidates": c["cuda"] * sum(1 for x in cands if x.kind == "cuda" and not x.workspace),
        "cuda, the other workspace": c["cuda_other_workspace"] * sum(1 for x in cands if x.workspace),
        "report": c["report"],
    }
    return {"phases": phases, "total_s": sum(phases.values()), "limit_s": DEVICE_LIMIT_S,
            "fits": sum(phases.values()) <= DEVICE_LIMIT_S,
            "basis": "DEVICE_COST_S in scripts/gpu_tune.py: reasoned from the first H200 run, not measured"}


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


def compute_reference(mnist_dir: Path, dry_run: bool, out_path: Path) -> None:
    """The cpu backend on the eleven draws -> ``out_path`` (npz): predictions, draw 0's state, times."""
    import numpy as np

    from learner.backends.cpu import CpuBackend
    from learner.config import Config
    from learner.train import prepare

    tasks, labels = build_draws(mnist_dir, dry_run)
    cpu, arrays, seconds = CpuBackend(), {}, []
    for k, task in enumerate(tasks):
        t = time.perf_counter()
        out = cpu.run(task, prepare(task, Config()))
        seconds.append(time.perf_counter() - t)
        arrays[f"pred{k}"] = out.scores.argmax(1).astype(np.uint8)  # classes 0..9: a byte each
        arrays[f"correct{k}"] = np.array((arrays[f"pred{k}"] == labels[k]).sum())
        if k == 0:
            for i, (p, v) in enumerate(zip(out.final_parameters, out.final_velocity)):
                arrays[f"p{i}"], arrays[f"v{i}"] = p, v
    arrays["seconds"] = np.array(seconds)
    import torch

    arrays["threads"] = np.array(torch.get_num_threads())
    tmp = out_path.with_suffix(".tmp.npz")
    np.savez(tmp, **arrays)
    tmp.replace(out_path)


class ReferenceJob:
    """The cpu backend's references, computed by a child process (started at once, read when needed)."""

    def __init__(self, mnist_dir: Path, dry_run: bool, out_dir: Path, threads: int | None = None):
        self.path = Path(out_dir) / "cpu_reference.npz"
        self.t0 = time.perf_counter()
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the cpu backend: nothing on the GPU
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--reference-out", str(self.path),
               "--mnist-dir", str(mnist_dir)] + (["--dry-run"] if dry_run else [])
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._result = None

    def result(self, timeout: float | None = None) -> dict:
        if self._result is None:
            import numpy as np

            output, _ = self.proc.communicate(timeout=timeout)
            if self.proc.returncode != 0 or not self.path.exists():
                raise RuntimeError(f"the cpu reference failed (exit {self.proc.returncode}): {output[-2000:]}")
            z = np.load(self.path)
            n = sum(1 for key in z.files if key.startswith("p") and key[1:].isdigit())
            self._result = {
                "predictions": [z[f"pred{k}"] for k in DRAWS],
                "correct": [int(z[f"correct{k}"]) for k in DRAWS],
                "params0": [z[f"p{i}"] for i in range(n)], "velocity0": [z[f"v{i}"] for i in range(n)],
                "seconds_per_draw": [float(s) for s in z["seconds"]], "threads": int(z["threads"]),
                "wall_seconds": time.perf_counter() - self.t0,
            }
        return self._result


_shared: dict = {}


def shared_reference(mnist_dir: Path, dry_run: bool, out_dir: Path) -> ReferenceJob:
    """One reference job per process and input (the one-shot's cuda and fused sections share it)."""
    key = (str(mnist_dir), dry_run)
    if key not in _shared:
        _shared[key] = ReferenceJob(mnist_dir, dry_run, out_dir, threads=max(1, (os.cpu_count() or 2) // 2))
    return _shared[key]


# --------------------------------------------------------------------------- checking a candidate


def digest(out) -> str:
    """SHA-256 of one task's final parameters, velocity and scores (bytes)."""
    h = hashlib.sha256()
    for a in list(out.final_parameters) + list(out.final_velocity) + [out.scores]:
        h.update(a.tobytes())
    return h.hexdigest()


def check_outputs(outs, ref: dict, labels=None) -> dict:
    """A candidate's eleven outputs against the cpu backend's: every query's prediction, draw 0's
    parameters and velocity within (2e-5, 3e-3). ``passed`` needs both."""
    import numpy as np

    from learner.reference_check import TOLERANCE, max_violation

    mismatches, differing = [], {}
    for k, (out, ref_pred) in enumerate(zip(outs, ref["predictions"])):
        pred = out.scores.argmax(1)
        bad = np.flatnonzero(pred != ref_pred)
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
    }
    if labels is not None:
        report["correct_by_draw"] = [int((o.scores.argmax(1) == lab).sum()) for o, lab in zip(outs, labels)]
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
    engine.run(task, prepared)  # compile (found in the cache), load, capture: outside the timing
    values = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = engine.run(task, prepared)
        values.append(time_ms(out, (time.perf_counter() - t) * 1000))
    return {"ms_values": values, "median_ms": statistics.median(values)}


def time_launch(engine, tasks, prepareds, repeats: int) -> dict:
    engine.run_many(tasks, prepareds)
    values = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = engine.run_many(tasks, prepareds)[0]
        values.append(time_ms(out, (time.perf_counter() - t) * 1000))
    med = statistics.median(values)
    return {"tasks_per_launch": len(tasks), "ms_values": values, "median_launch_ms": med,
            "median_ms_per_task": med / len(tasks)}


def make_engine(c: Candidate, device: str):
    if c.kind == "fused":
        from learner.backends.fused import FusedBackend

        return FusedBackend(device, chunk=c.chunk, num_warps=c.num_warps, precision=c.precision, variant=c.variant)
    from learner.backends.cuda import GraphBackend

    return GraphBackend(device, step=c.step)


# --------------------------------------------------------------------------- choosing


def select(results: list[dict], gpu: str | None, when: str) -> dict:
    """The winners among the candidates that passed (a refused one is never chosen), and the row."""
    passed = [r for r in results if r.get("passed")]
    one = [r for r in passed if r["kind"] == "fused" and r["variant"] == "one"
           and (r.get("launch") or {}).get("median_ms_per_task") is not None]
    launch = min(one, key=lambda r: r["launch"]["median_ms_per_task"]) if one else None
    lone = None
    if launch is not None:
        same = [r for r in passed if r["kind"] == "fused" and (r.get("single") or {}).get("median_ms") is not None
                and r["precision"] == launch["precision"] and r["check"]["digests"] == launch["check"]["digests"]]
        lone = min(same, key=lambda r: r["single"]["median_ms"]) if same else launch
    steps = [r for r in passed if r["kind"] == "cuda" and not r.get("workspace")
             and (r.get("single") or {}).get("median_ms") is not None]
    cuda = min(steps, key=lambda r: r["single"]["median_ms"]) if steps else None
    out = {"launch": launch and launch["name"], "lone": lone and lone["name"], "cuda_step": cuda and cuda["name"],
           "refused": {r["name"]: r.get("refused") for r in results if not r.get("passed")}}
    faster_but_other_bytes = [r["name"] for r in passed if r["kind"] == "fused" and lone is not None
                              and (r.get("single") or {}).get("median_ms") is not None
                              and r["single"]["median_ms"] < lone["single"]["median_ms"]
                              and r["check"]["digests"] != launch["check"]["digests"]]
    if faster_but_other_bytes:
        out["faster_alone_but_not_the_launch_choice_bytes"] = faster_but_other_bytes
    if launch is None:
        out["row"] = None
        out["why_no_row"] = "no one-program fused candidate passed the eleven-draw check and was timed in a launch"
        return out
    row = {
        "launch": {k: v for k, v in launch["choice"].items() if k != "variant"},
        "lone": None if lone is launch else dict(lone["choice"]),
        "cuda_step": cuda["step"] if cuda else "autograd",
        "source": (f"scripts/gpu_tune.py on {gpu}, {when}: launch {launch['name']} "
                   f"{launch['launch']['median_ms_per_task']:.4f} ms per task in {launch['launch']['tasks_per_launch']}; "
                   f"lone {lone['name']} {lone['single']['median_ms']:.2f} ms"
                   + (f"; cuda {cuda['name']} {cuda['single']['median_ms']:.2f} ms" if cuda else "")
                   + "; each passed the eleven draws query by query"),
    }
    out["row"] = row
    return out


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
    return "None" if obj is None else repr(obj)


def render_table(default: dict, table: dict) -> str:
    return (f"{BEGIN}\nDEFAULT: dict[str, Any] = {literal(default)}\n"
            f"TABLE: dict[str, dict[str, Any]] = {literal(table)}\n{END}")


def with_row(module_text: str, gpu: str, row: dict) -> str:
    """learner/kernels/tuned.py's text with ``gpu``'s row set to ``row`` (the block between BEGIN
    and END re-rendered; nothing else touched)."""
    start, end = module_text.index(BEGIN), module_text.index(END) + len(END)
    scope: dict = {"Any": object}
    exec(module_text[start:end], scope)  # noqa: S102 - our own file's literal table
    table = dict(scope["TABLE"])
    table[gpu] = row
    return module_text[:start] + render_table(scope["DEFAULT"], table) + module_text[end:]


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


def precompile(cands: list[Candidate], shapes: dict, workers: int, log) -> dict:
    import multiprocessing

    fused = [c for c in cands if c.kind == "fused"]
    t = time.perf_counter()
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {c.name: pool.submit(_compile_one, c, shapes) for c in fused}
        out = {name: f.result() for name, f in futures.items()}
    log(f"compiled {len(fused)} fused candidates in {time.perf_counter() - t:.1f} s with {workers} workers")
    return out


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


def run_candidate(c: Candidate, device: str, tasks, prepareds, labels, ref_job, launch_set, timing: dict,
                  compiled: dict | None, log) -> dict:
    r = {"name": c.name, "kind": c.kind, "variant": c.variant, "precision": c.precision, "step": c.step,
         "workspace": c.workspace, "choice": c.choice() if c.kind == "fused" else None, "passed": False}
    if compiled is not None and c.name in compiled:
        r["compile"] = compiled[c.name]
        if not compiled[c.name]["compiled"]:
            r["refused"] = f"does not compile: {compiled[c.name]['error']}"
            return r
    t = time.perf_counter()
    try:
        engine = make_engine(c, device)
        outs = run_draws(engine, tasks, prepareds)
        r["draws_seconds"] = time.perf_counter() - t
        r["check"] = check_outputs(outs, ref_job.result(), labels)
        r["single"] = time_single(engine, tasks[0], prepareds[0], timing["single"])
        if c.kind == "fused" and c.variant == "one":
            r["launch"] = time_launch(engine, *launch_set, timing["launch"])
        r["passed"] = r["check"]["passed"]
        if not r["passed"]:
            r["refused"] = r["check"]["refused"]
    except Exception as exc:  # noqa: BLE001 - reported; the candidate is refused
        r["error"] = f"{type(exc).__name__}: {exc}"
        r["traceback"] = traceback.format_exc()[-3000:]
        r["refused"] = f"failed: {r['error']}"
    r["seconds"] = time.perf_counter() - t
    launch = (r.get("launch") or {}).get("median_ms_per_task")
    log(f"  {c.name:28s} {'passed' if r['passed'] else 'REFUSED'}"
        + (f"  alone {r['single']['median_ms']:9.3f} ms" if r.get("single") else "")
        + (f"  launch {launch:8.4f} ms/task" if launch is not None else "")
        + (f"  ({r['refused']})" if r.get("refused") else ""))
    return r


def other_workspace(c: Candidate, mnist_dir: Path, dry_run: bool, ref_path: Path, out_dir: Path, log) -> dict:
    """The cuda candidate with another CUBLAS_WORKSPACE_CONFIG: a child process (read before CUDA starts)."""
    path = out_dir / "cuda_other_workspace.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--cuda-child", c.step, "--reference-in", str(ref_path),
           "--mnist-dir", str(mnist_dir), "--child-out", str(path)] + (["--dry-run"] if dry_run else [])
    t = time.perf_counter()
    proc = subprocess.run(cmd, env={**os.environ, "CUBLAS_WORKSPACE_CONFIG": c.workspace}, capture_output=True,
                          text=True)
    if proc.returncode != 0 or not path.exists():
        r = {"name": c.name, "kind": "cuda", "variant": "one", "precision": "ieee", "step": c.step,
             "workspace": c.workspace, "passed": False,
             "refused": f"child failed (exit {proc.returncode}): {(proc.stdout + proc.stderr)[-1500:]}"}
    else:
        r = json.loads(path.read_text())
    r["child_seconds"] = time.perf_counter() - t
    log(f"  {c.name:28s} {'passed' if r.get('passed') else 'REFUSED'}"
        + (f"  alone {r['single']['median_ms']:9.3f} ms" if r.get("single") else "")
        + (f"  ({r['refused']})" if r.get("refused") else ""))
    return r


def cuda_child(step: str, mnist_dir: Path, dry_run: bool, ref_path: Path, out_path: Path) -> None:
    import numpy as np

    from learner.config import Config
    from learner.train import prepare

    class Ref:  # the parent's reference, read from its file
        def result(self):
            z = np.load(ref_path)
            n = sum(1 for key in z.files if key.startswith("p") and key[1:].isdigit())
            return {"predictions": [z[f"pred{k}"] for k in DRAWS], "params0": [z[f"p{i}"] for i in range(n)],
                    "velocity0": [z[f"v{i}"] for i in range(n)]}

    tasks, labels = build_draws(mnist_dir, dry_run)
    prepareds = [prepare(t, Config()) for t in tasks]
    c = Candidate("cuda", step=step, workspace=os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    r = run_candidate(c, "cpu" if dry_run else "cuda", tasks, prepareds, labels, Ref(), None,
                      TIMING["dry-run" if dry_run else "device"], None, lambda *_: None)
    out_path.write_text(json.dumps(r, default=str))


def run(out_dir: Path, mnist_dir: Path, dry_run: bool, budget_s: float, write: bool, sm90: bool, log=print) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    deadline = t_start + budget_s
    mode = "dry-run" if dry_run else "device"
    report: dict = {"mode": mode, "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    cands = candidates()
    report["estimate"] = estimate_device_s(cands)
    log(f"device estimate for a full run: {report['estimate']['total_s']} s of {DEVICE_LIMIT_S} "
        f"({'fits' if report['estimate']['fits'] else 'DOES NOT FIT'})")
    if not dry_run:
        report["setup"] = device_setup(log)
    ref_job = ReferenceJob(mnist_dir, dry_run, out_dir, threads=max(1, (os.cpu_count() or 2) // 2))
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
                   "config": Config().as_dict()})
    t = time.perf_counter()
    tasks, labels = build_draws(mnist_dir, dry_run)
    prepareds = [prepare(task, Config()) for task in tasks]
    launch_set = bench.batch_tasks(tasks[0], Config(), count)
    report["draws_seconds"] = time.perf_counter() - t
    compiled = None
    if not dry_run:
        n, m = tasks[0].train_count, tasks[0].test_count
        shapes = {"n": n, "m": m, "epochs": Config().epochs, "batch": Config().batch_size, "depth": Config().depth,
                  "steps": Config().epochs * -(-n // Config().batch_size)}
        compiled = precompile(cands, shapes, DEVICE_COST_S["compile_workers"], log)
        report["compile"] = compiled
    elif sm90:
        report["compile_sm90"] = compile_check_sm90(cands, log)
    ref = ref_job.result()
    report["reference"] = {
        "backend": "cpu", "correct_by_draw": ref["correct"], "seconds_per_draw": ref["seconds_per_draw"],
        "torch_threads": ref["threads"], "wall_seconds": ref["wall_seconds"],
        "published_counts": list(PUBLISHED_COUNTS),
        "equals_published_counts": None if dry_run else ref["correct"] == list(PUBLISHED_COUNTS),
    }
    log(f"cpu reference: {sum(ref['correct'])} correct over the eleven draws in {ref['wall_seconds']:.1f} s "
        f"({statistics.median(ref['seconds_per_draw']):.2f} s per draw, {ref['threads']} threads)")
    timing = TIMING[mode]
    results = []
    cost = {"fused one": DEVICE_COST_S["fused_one"], "fused split": DEVICE_COST_S["fused_split"],
            "cuda": DEVICE_COST_S["cuda"], "cuda other": DEVICE_COST_S["cuda_other_workspace"]}
    for c in cands:
        need = cost["cuda other" if c.workspace else "cuda" if c.kind == "cuda" else f"fused {c.variant}"]
        if not dry_run and deadline - time.monotonic() < need + DEVICE_COST_S["report"]:
            results.append({"name": c.name, "kind": c.kind, "variant": c.variant, "precision": c.precision,
                            "step": c.step, "workspace": c.workspace, "passed": False,
                            "refused": "not run: the time budget was spent"})
            continue
        if c.workspace:
            results.append(other_workspace(c, mnist_dir, dry_run, ref_job.path, out_dir, log))
        else:
            results.append(run_candidate(c, device, tasks, prepareds, labels, ref_job, launch_set, timing, compiled,
                                         log))
    report["candidates"] = results
    when = datetime.date.today().isoformat()
    report["choice"] = select(results, gpu or "the interpreter (dry run)", when)
    module = (ROOT / "learner" / "kernels" / "tuned.py").read_text()
    row = report["choice"]["row"]
    if row is not None:
        text = with_row(module, gpu or "DRY RUN (interpreter)", row)
        (out_dir / "tuned.py").write_text(text)
        if write and not dry_run:
            (ROOT / "learner" / "kernels" / "tuned.py").write_text(text)
            report["written"] = str(ROOT / "learner" / "kernels" / "tuned.py")
    report["seconds"] = time.monotonic() - t_start
    report["passed"] = row is not None and (dry_run or bool(report["reference"]["equals_published_counts"]))
    if dry_run:
        report["estimate_fits"] = report["estimate"]["fits"]
        report["passed"] = report["passed"] and report["estimate"]["fits"]
        report["not_checked_in_dry_run"] = [
            "compilation for and runs on a GPU (the interpreter ran every candidate)", "CUDA-event times",
            "tl.dot's precision (the interpreter computes in fp32 whatever it says)",
            "the byte equality of different chunks (numpy's matmul rounds a row differently with the row count)",
            "the 10k/10k draws (slices ran)", "a launch of the SM count (2 tasks ran)"]
    (out_dir / "tune.json").write_text(json.dumps(report, indent=2, default=str))
    (out_dir / "summary.txt").write_text(summary(report))
    log(summary(report))
    return report


def summary(report: dict) -> str:
    lines = [f"gpu_tune {report['mode']}: {report.get('gpu') or 'interpreter'}, {report.get('seconds', 0):.0f} s; "
             f"device estimate {report['estimate']['total_s']} s of {DEVICE_LIMIT_S}"]
    for r in report.get("candidates", []):
        single = (r.get("single") or {}).get("median_ms")
        launch = (r.get("launch") or {}).get("median_ms_per_task")
        differ = (r.get("check") or {}).get("predictions_differing")
        lines.append(f"  {r['name']:28s} {'ok ' if r.get('passed') else 'NO '}"
                     f" alone {'-' if single is None else f'{single:9.3f}'} ms"
                     f" launch {'-' if launch is None else f'{launch:8.4f}'} ms/task"
                     f" differing {'-' if differ is None else differ}"
                     + (f"  [{r['refused'][:120]}]" if r.get("refused") else ""))
    choice = report.get("choice") or {}
    lines.append(f"choice: launch {choice.get('launch')}, lone {choice.get('lone')}, cuda {choice.get('cuda_step')}")
    if choice.get("row") is None:
        lines.append(f"no row: {choice.get('why_no_row')}")
    lines.append(f"passed: {report.get('passed')}")
    return "\n".join(lines) + "\n"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_fused", ROOT / "bench" / "bench_fused.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu-tune-out"))
    parser.add_argument("--mnist-dir", type=Path, default=None)
    parser.add_argument("--dry-run", action="store_true", help="in Triton's interpreter on small tasks")
    parser.add_argument("--write", action="store_true", help="write the row into learner/kernels/tuned.py")
    parser.add_argument("--budget-s", type=float, default=None)
    parser.add_argument("--estimate", action="store_true", help="print the device estimate and exit")
    parser.add_argument("--sm90", action="store_true", help="dry run: also compile every candidate for sm_90")
    parser.add_argument("--reference-out", type=Path, help=argparse.SUPPRESS)  # child: the cpu reference
    parser.add_argument("--cuda-child", help=argparse.SUPPRESS)  # child: a cuda candidate, another workspace
    parser.add_argument("--reference-in", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.estimate:
        print(json.dumps(estimate_device_s(candidates()), indent=2))
        return 0
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from learner.data import bundled_mnist_dir

    mnist_dir = args.mnist_dir or bundled_mnist_dir()
    if args.reference_out:
        compute_reference(mnist_dir, args.dry_run, args.reference_out)
        return 0
    if args.cuda_child:
        cuda_child(args.cuda_child, mnist_dir, args.dry_run, args.reference_in, args.child_out)
        return 0
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("gpu_tune: no CUDA GPU here; nothing was measured (try --dry-run)", file=sys.stderr)
            return 2
    report = run(args.out, mnist_dir, args.dry_run, args.budget_s or BUDGET_S["dry-run" if args.dry_run else "device"],
                 args.write, args.sm90)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
