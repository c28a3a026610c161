"""The cpu backend's predictions the GPU runs compare with, query by query.

    python3 scripts/gpu_reference.py --out .device-reference/cpu_reference.npz   # here (scripts/gpu_prepare.sh)

What it holds: the cpu backend (the reference learner: learner/backends/cpu.py, torch's autograd
on the CPU) on

  draws   the eleven published draws (dataset seeds 2026091400 + k, the default config): every
          query's prediction (110,000, a byte each), the correct counts, draw 0's final parameters
          and velocity (the state check's reference)
  launch  the tasks a launch of the SM count holds beside draw 0 (bench/bench_fused.batch_tasks:
          draw 0's rows reordered, seed + t, t = 1..LAUNCH_TASKS - 1): every query's prediction

and, for every task, the SHA-256 of its arrays (``task_digest``), the versions it ran on and its
times. The GPU runs (the cuda and fused sections of scripts/gpu_check.py, scripts/gpu_tune.py)
build the same tasks on the device host and use a carried prediction only where that task's
digest is the one it was computed from: a task built differently there (MNIST's box resize is a
float32 product whose last bit follows the BLAS kernel, data/README.md) is compared with the cpu
backend run on the device host instead, by a child process beside the GPU work
(``ReferenceJob``) -- never with a reference of other bytes.

Carrying it saves the device host that work (1.9 s of cpu backend for the eleven draws on this
2-core machine, ~25 s with the 131 launch tasks) and makes the reference the pinned
environment's (torch here, not the GPU image's); scripts/gpu_prepare.sh makes it, with the
wheels, and gpu_carried.py refuses a call that needs it and lacks it. The dry runs use small
slices of the draws, computed by the child here.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
ROOT = SCRIPTS.parent
for path in (str(SCRIPTS), str(ROOT)):
    if path not in sys.path:
        sys.path.insert(0, path)

DEFAULT_DIR = ROOT / ".device-reference"
DEFAULT_PATH = DEFAULT_DIR / "cpu_reference.npz"
LAUNCH_TASKS = 132  # the SM count of the H200 and the H100 SXM: draw 0 and 131 reorderings
FORMAT = 1


def task_digest(task) -> str:
    """SHA-256 over the task's three arrays' own SHA-256s (learner.taskio.TaskArrays.input_hashes)."""
    hashes = task.input_hashes()
    return hashlib.sha256("|".join(f"{k}={hashes[k]}" for k in sorted(hashes)).encode()).hexdigest()


def _bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_fused", ROOT / "bench" / "bench_fused.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compute(mnist_dir: Path, dry_run: bool, out_path: Path, launch_tasks: int | None = None, log=None) -> None:
    """The cpu backend on the eleven draws (and the launch's other tasks) -> ``out_path`` (npz)."""
    import gpu_tune
    import numpy as np
    import torch

    from learner.backends.cpu import CpuBackend
    from learner.config import Config
    from learner.train import prepare

    t_all = time.perf_counter()
    tasks, labels = gpu_tune.build_draws(mnist_dir, dry_run)
    cpu, arrays, seconds = CpuBackend(), {}, []
    for k, task in enumerate(tasks):
        t = time.perf_counter()
        out = cpu.run(task, prepare(task, Config()))
        seconds.append(time.perf_counter() - t)
        arrays[f"pred{k}"] = out.scores.argmax(1).astype(np.uint8)  # classes 0..9: a byte each
        arrays[f"correct{k}"] = np.array((arrays[f"pred{k}"] == labels[k]).sum())
        arrays[f"task_sha{k}"] = np.array(task_digest(task))
        if k == 0:
            for i, (p, v) in enumerate(zip(out.final_parameters, out.final_velocity)):
                arrays[f"p{i}"], arrays[f"v{i}"] = p, v
        if log:
            log(f"cpu reference: draw {k}: {int(arrays[f'correct{k}'])} correct in {seconds[-1]:.2f} s")
    arrays["seconds"] = np.array(seconds)
    count = (gpu_tune.DRY_LAUNCH if dry_run else LAUNCH_TASKS) if launch_tasks is None else launch_tasks
    launch_seconds = 0.0
    if count > 1:
        t = time.perf_counter()
        others, prepareds = _bench().batch_tasks(tasks[0], Config(), count)
        preds, digests = [], []
        for task, prep in zip(others[1:], prepareds[1:]):
            preds.append(cpu.run(task, prep).scores.argmax(1).astype(np.uint8))
            digests.append(task_digest(task))
        arrays["launch_pred"] = np.stack(preds)
        arrays["launch_sha"] = np.array(digests)
        launch_seconds = time.perf_counter() - t
        if log:
            log(f"cpu reference: the launch's {count - 1} other tasks in {launch_seconds:.1f} s")
    arrays["launch_seconds"] = np.array(launch_seconds)
    arrays["threads"] = np.array(torch.get_num_threads())
    arrays["format"] = np.array(FORMAT)
    arrays["dry_run"] = np.array(bool(dry_run))
    arrays["provenance"] = np.array(
        f"cpu backend, torch {torch.__version__}, numpy {np.__version__}, python {platform.python_version()} on "
        f"{platform.machine()}, {torch.get_num_threads()} threads, {time.perf_counter() - t_all:.1f} s in all")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.stem}.part.npz")
    np.savez_compressed(tmp, **arrays)
    os.replace(tmp, out_path)


def _load(path: Path) -> dict:
    import numpy as np

    with np.load(path) as z:
        if "format" not in z.files or int(z["format"]) != FORMAT:
            raise ValueError(f"{path} is not a cpu reference of format {FORMAT} (make it again: scripts/gpu_prepare.sh)")
        n = sum(1 for key in z.files if key.startswith("p") and key[1:].isdigit())
        draws = sum(1 for key in z.files if key.startswith("pred") and key[4:].isdigit())
        doc = {
            "predictions": [z[f"pred{k}"] for k in range(draws)],
            "correct": [int(z[f"correct{k}"]) for k in range(draws)],
            "task_digests": [str(z[f"task_sha{k}"]) for k in range(draws)],
            "params0": [z[f"p{i}"] for i in range(n)], "velocity0": [z[f"v{i}"] for i in range(n)],
            "seconds_per_draw": [float(s) for s in z["seconds"]], "threads": int(z["threads"]),
            "launch_predictions": list(z["launch_pred"]) if "launch_pred" in z.files else [],
            "launch_digests": [str(s) for s in z["launch_sha"]] if "launch_sha" in z.files else [],
            "dry_run": bool(z["dry_run"]), "provenance": str(z["provenance"]),
        }
    return doc


class Carried:
    """The carried reference for ``tasks`` (the eleven draws as built here), when every draw's
    digest is the one it was computed from (``reason`` says why not, and ``usable`` is False)."""

    def __init__(self, path: Path, tasks, dry_run: bool):
        self.path = Path(path)
        self.t0 = time.perf_counter()
        self.usable, self.reason, self.doc = False, None, None
        if not self.path.exists():
            self.reason = f"{self.path} is not there (scripts/gpu_prepare.sh makes it)"
            return
        try:
            doc = _load(self.path)
        except Exception as exc:  # noqa: BLE001 - said, and the device host computes it instead
            self.reason = f"{self.path} could not be read: {type(exc).__name__}: {exc}"
            return
        if doc["dry_run"] != dry_run:
            self.reason = f"{self.path} was computed for {'a dry run' if doc['dry_run'] else 'the device'}'s tasks"
            return
        digests = [task_digest(t) for t in tasks]
        differ = [k for k, (a, b) in enumerate(zip(digests, doc["task_digests"])) if a != b]
        if len(digests) != len(doc["task_digests"]) or differ:
            self.reason = (f"the draws built here differ from those {self.path.name} was computed from "
                           f"(draws {differ or 'count'}): the device host computes the reference instead")
            return
        self.usable, self.doc = True, doc

    def result(self, timeout: float | None = None) -> dict:
        return {**self.doc, "source": f"carried: {self.path.name} ({self.doc['provenance']})",
                "wall_seconds": time.perf_counter() - self.t0}


class ReferenceJob:
    """The cpu backend's references, computed on this host by a child process (started at once,
    read when needed), with its own time limit (``limit_s``: past it the child is killed and the
    reference fails, naming the limit)."""

    def __init__(self, mnist_dir: Path, dry_run: bool, out_dir: Path, threads: int | None = None,
                 limit_s: float | None = None, launch_tasks: int | None = None):
        self.path = Path(out_dir) / "cpu_reference.npz"
        self.t0 = time.perf_counter()
        self.limit_s = limit_s
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the cpu backend: nothing on the GPU
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--out", str(self.path), "--mnist-dir", str(mnist_dir)]
        cmd += (["--dry-run"] if dry_run else []) + ([f"--launch-tasks={launch_tasks}"] if launch_tasks is not None
                                                    else [])
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._result = None

    def result(self, timeout: float | None = None) -> dict:
        if self._result is None:
            limit = self.limit_s if timeout is None else timeout
            left = None if limit is None else max(0.1, limit - (time.perf_counter() - self.t0))
            try:
                output, _ = self.proc.communicate(timeout=left)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.communicate()
                raise RuntimeError(f"the cpu reference ran past its own limit of {limit:.0f} s (killed)") from None
            if self.proc.returncode != 0 or not self.path.exists():
                raise RuntimeError(f"the cpu reference failed (exit {self.proc.returncode}): {output[-2000:]}")
            doc = _load(self.path)
            self._result = {**doc, "source": "computed on this host by a child process (the cpu backend)",
                            "wall_seconds": time.perf_counter() - self.t0}
        return self._result

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


_shared: dict = {}


def shared_reference(mnist_dir: Path, dry_run: bool, out_dir: Path, tasks=None, carried: Path | None = None,
                     limit_s: float | None = None, log=None):
    """One reference per process and input (the one-shot's cuda and fused sections share it): the
    carried one when it is there and ``tasks`` (the eleven draws built here) are its tasks, else a
    child computing it on this host. ``.result()`` gives predictions, params0, velocity0, ..."""
    key = (str(mnist_dir), dry_run)
    if key not in _shared:
        job = None
        if tasks is not None:
            held = Carried(carried or Path(os.environ.get("REV88_CPU_REFERENCE", DEFAULT_PATH)), tasks, dry_run)
            if held.usable:
                job = held
            elif log:
                log(f"cpu reference: not the carried one: {held.reason}")
            why_not = held.reason
        else:
            why_not = "no tasks given to check a carried reference against"
        if job is None:
            job = ReferenceJob(mnist_dir, dry_run, out_dir, threads=max(1, (os.cpu_count() or 2) // 2),
                               limit_s=limit_s)
            job.carried_reason = why_not
        _shared[key] = job
    return _shared[key]


def launch_reference(ref: dict, tasks) -> list:
    """For a launch's tasks (bench_fused.batch_tasks: task 0 is draw 0, task t its reordering t):
    each task's cpu predictions where the reference holds that task (its digest the same), else None."""
    out = []
    for t, task in enumerate(tasks):
        if t == 0:
            ok = ref.get("task_digests") and task_digest(task) == ref["task_digests"][0]
            out.append(ref["predictions"][0] if ok else None)
        elif t - 1 < len(ref.get("launch_digests") or []) and task_digest(task) == ref["launch_digests"][t - 1]:
            out.append(ref["launch_predictions"][t - 1])
        else:
            out.append(None)
    return out


def check(path: Path, mnist_dir: Path) -> list[str]:
    """Why ``path`` is not the cpu reference of the tasks built here ([] when it is): every draw's
    and every launch task's digest, and the launch's size (scripts/gpu_prepare.sh keeps it then)."""
    import gpu_tune

    from learner.config import Config

    tasks, _ = gpu_tune.build_draws(mnist_dir, False)
    held = Carried(path, tasks, False)
    if not held.usable:
        return [held.reason]
    doc = held.doc
    if len(doc["launch_digests"]) < LAUNCH_TASKS - 1:
        return [f"{path} holds {len(doc['launch_digests'])} launch tasks, not {LAUNCH_TASKS - 1}"]
    others, _ = _bench().batch_tasks(tasks[0], Config(), LAUNCH_TASKS)
    differ = [t for t, task in enumerate(others[1:], 1) if task_digest(task) != doc["launch_digests"][t - 1]]
    return [f"{path}: launch tasks {differ[:5]} are not the ones built here"] if differ else []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_PATH)
    parser.add_argument("--mnist-dir", type=Path, default=None)
    parser.add_argument("--dry-run", action="store_true", help="the dry runs' slices of the draws")
    parser.add_argument("--launch-tasks", type=int, default=None,
                        help=f"tasks of the launch (draw 0 and its reorderings; default {LAUNCH_TASKS}, 2 in a dry run)")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--check", action="store_true",
                        help="exit 0 when --out is already the reference of the tasks built here, else 1")
    args = parser.parse_args(argv)
    from learner.data import bundled_mnist_dir

    if args.check:
        problems = check(args.out, args.mnist_dir or bundled_mnist_dir())
        for problem in problems:
            print(f"gpu_reference: {problem}")
        return 1 if problems else 0
    compute(args.mnist_dir or bundled_mnist_dir(), args.dry_run, args.out, args.launch_tasks,
            log=None if args.quiet else print)
    if not args.quiet:
        print(f"cpu reference: {args.out} ({args.out.stat().st_size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
