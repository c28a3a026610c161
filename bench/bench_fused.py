"""Fused kernel vs the cuda-graph backend on one GPU: ms and mJ per task, and their ratios.

    python bench/bench_fused.py [--tasks-per-launch N]
                                [--trials 3 --target-seconds 5 --settle-seconds 3 --idle-seconds 3]
                                [--sweep] [--json out.json]

Variants, all in one process on the 10k/10k MNIST draw 0 (dataset seed 2026091400) with
the default config:

  cuda      backend "cuda" (CUDA graphs, cached per shape), one task per run
  fused     backend "fused", one task per launch (the tuned table's lone choice for this GPU)
  fused-T   backend "fused", T tasks per launch (default T = the GPU's SM count; the table's
            launch choice: learner/kernels/tuned.py, chosen by scripts/gpu_tune.py). Task 0 is
            draw 0; task t > 0 is draw 0's rows in a task-specific order with seed 11 + t,
            so every program has its own data and its own initialization. Per-task figures
            are the launch's divided by T.

Per variant: the median CUDA-event ms per task (events bracket the GPU work of one run or
launch: reset, lift, every epoch, predict; no host transfers) and the idle-adjusted mJ per
task by the paired-idle protocol (learner.measure.measure_task: its active windows repeat
complete runs, transfers included). Ratios are cuda / fused. Bench goals (not tests):
fused >= 20x faster and >= 20x less energy per task than cuda; fused-T <= 10 mJ per task.

``--sweep`` also times the fused kernel for several (chunk, num_warps) choices at each product
precision, and the split variant alone (scripts/gpu_tune.py does the same with the eleven-draw
check and picks).

Needs a CUDA GPU (exits with status 2 and says so without one) and triton. Written on a
machine without a GPU: it has not been run; scripts/gpu_check_fused.py uses these
functions with short trials.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import learner  # noqa: E402,F401  (sets CUBLAS_WORKSPACE_CONFIG before CUDA starts)
from learner.data import bundled_mnist_dir  # noqa: E402

DRAW0_SEED = 2026091400
GOAL_SPEEDUP = 20.0
GOAL_ENERGY_RATIO = 20.0
GOAL_BATCHED_MJ = 10.0
SWEEP = [(64, 8), (64, 4), (128, 8), (128, 16), (32, 4)]
SWEEP_SPLIT = [(16, 4), (32, 4)]  # the split variant: timed alone only
PRECISIONS = ("ieee", "tf32x3")


def require_gpu() -> None:
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA GPU here: the fused benchmark measures GPU kernels only")
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(f"triton is not installed (pip install 'rev88[gpu]'): {exc}") from None


def sm_count() -> int:
    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count)


def batch_tasks(task, config, count: int):
    """``count`` tasks of draw 0's shape: task 0 is ``task`` itself, the others its rows reordered."""
    from learner.taskio import validate_task
    from learner.train import prepare

    tasks, prepareds = [task], [prepare(task, config)]
    for t in range(1, count):
        rng = np.random.default_rng(1000 + t)
        tr, te = rng.permutation(task.train_count), rng.permutation(task.test_count)
        other = validate_task(task.train_images[tr], task.train_labels[tr], task.test_images[te])
        tasks.append(other)
        prepareds.append(prepare(other, config.replace(seed=config.seed + t)))
    return tasks, prepareds


class BatchedLaunch:
    """A backend-shaped view of one T-task launch, for learner.measure: ``run(task, prepared)``
    launches ``task`` together with the T-1 fixed others and returns ``task``'s output, whose
    ``cuda_ms`` is the whole launch. Per-task figures are per invocation divided by T."""

    def __init__(self, fused, others, other_prepareds):
        self.fused, self.others, self.other_prepareds = fused, list(others), list(other_prepareds)
        self.name, self.device = fused.name, fused.device
        self.tasks_per_launch = 1 + len(self.others)

    def describe(self) -> dict:
        return {**self.fused.describe(), "tasks_per_launch": self.tasks_per_launch}

    def run(self, task, prepared):
        return self.fused.run_many([task, *self.others], [prepared, *self.other_prepareds])[0]


def median_cuda_ms(engine, task, prepared, repeats: int, walls: list[float] | None = None) -> tuple[float, list[float]]:
    """Median CUDA-event ms of ``repeats`` runs (and, into ``walls``, each run's wall ms)."""
    values = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = engine.run(task, prepared)
        if walls is not None:
            walls.append((time.perf_counter() - t) * 1000)
        if out.cuda_ms is None:
            raise RuntimeError(f"backend {engine.name!r} returned no CUDA-event time")
        values.append(float(out.cuda_ms))
    return statistics.median(values), values


def energy_per_task(engine, task, config, per_invocation: int, trials: int, target_seconds: float,
                    settle_seconds: float, idle_seconds: float) -> dict:
    """Idle-adjusted mJ per task by learner.measure (per invocation / tasks per invocation)."""
    from learner.measure import measure_task

    doc = measure_task(task, config, engine, trials=trials, target_seconds=target_seconds,
                       settle_seconds=settle_seconds, idle_seconds=idle_seconds)
    out = {
        "tasks_per_invocation": per_invocation,
        "repeats_per_trial": doc["repeats_per_trial"],
        "repeat_predictions_equal": doc.get("repeat_predictions_equal"),
        "repeat_state_hashes_equal": doc.get("repeat_state_hashes_equal"),
    }
    if doc["energy"] is None:
        out["error"] = f"no energy reading: {doc.get('energy_reason')}"
        return out
    summary = doc["energy"]["summary"]
    adjusted, unadjusted = summary["idle_adjusted_mj_per_task"], summary["unadjusted_mj_per_task"]
    if adjusted is None:
        out["error"] = "the protocol gave no idle-adjusted figure (an idle window had no duration)"
        return out
    out.update({
        "idle_adjusted_mj_per_task": adjusted["mean"] / per_invocation,
        "idle_adjusted_mj_per_task_sample_sd": None if adjusted["sample_sd"] is None else adjusted["sample_sd"] / per_invocation,
        "idle_adjusted_mj_per_invocation_by_trial": adjusted["values"],
        "unadjusted_mj_per_task": unadjusted["mean"] / per_invocation,
        "paired_idle_w_by_trial": [t["paired_idle_w"] for t in doc["energy"]["trials"]],
        "counter_note": doc["energy"]["counter_note"],
    })
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def measure(task, config, tasks_per_launch: int | None = None, timing_repeats: int = 10,
            batched_repeats: int = 5, trials: int = 3, target_seconds: float = 5.0, settle_seconds: float = 3.0,
            idle_seconds: float = 3.0, chunk: int | None = None, num_warps: int | None = None,
            energy: bool = True, log=print) -> dict:
    """ms and mJ per task of cuda, fused and fused-T on ``task``; raises on any failure."""
    from learner.backends.cuda import GraphBackend
    from learner.backends.fused import FusedBackend
    from learner.train import prepare

    count = tasks_per_launch or sm_count()
    cuda, fused = GraphBackend("cuda"), FusedBackend("cuda", chunk=chunk, num_warps=num_warps)
    prepared = prepare(task, config)
    tasks, prepareds = batch_tasks(task, config, count)
    batched = BatchedLaunch(fused, tasks[1:], prepareds[1:])
    variants = {"cuda": (cuda, 1), "fused": (fused, 1), "fused-T": (batched, count)}
    report: dict = {"gpu": torch.cuda.get_device_name(), "sm_count": sm_count(), "tasks_per_launch": count,
                    "config": config.as_dict(), "variants": {}}
    for name, (engine, per) in variants.items():
        t = time.perf_counter()
        first = engine.run(task, prepared)  # capture / compile outside every measurement
        entry = {"tasks_per_invocation": per, "first_run_seconds": time.perf_counter() - t,
                 "backend_details": first.extra}
        reps = batched_repeats if per > 1 else timing_repeats
        walls: list[float] = []
        med, values = median_cuda_ms(engine, task, prepared, reps, walls)
        entry.update({"median_cuda_ms_per_invocation": med, "cuda_ms_values": values,
                      "median_cuda_ms_per_task": med / per,
                      "median_wall_ms_per_invocation": statistics.median(walls)})
        log(f"{name:8s} median {med:9.3f} ms per invocation, {med / per:9.4f} ms per task ({reps} runs)")
        report["variants"][name] = entry
    if energy:
        for name, (engine, per) in variants.items():
            # The protocol sizes its active window in CUDA time (repeats = target / calibration
            # CUDA ms); a run's wall time also holds host staging and copies, which for a T-task
            # launch can be many times its CUDA time. Scale the target so the window lasts about
            # ``target_seconds`` of wall time (recorded as energy_target_seconds).
            entry = report["variants"][name]
            target = target_seconds * min(1.0, entry["median_cuda_ms_per_invocation"] / entry["median_wall_ms_per_invocation"])
            e = energy_per_task(engine, task, config, per, trials, target, settle_seconds, idle_seconds)
            e["energy_target_seconds"] = target
            report["variants"][name]["energy"] = e
            log(f"{name:8s} " + (e["error"] if "error" in e else f"{e['idle_adjusted_mj_per_task']:.3f} mJ per task (idle-adjusted)"))
    v = report["variants"]
    ms = {k: v[k]["median_cuda_ms_per_task"] for k in v}
    mj = {k: (v[k].get("energy") or {}).get("idle_adjusted_mj_per_task") for k in v}
    report["ratios"] = {
        "speedup_fused_vs_cuda": ratio(ms["cuda"], ms["fused"]),
        "speedup_fused_T_vs_cuda": ratio(ms["cuda"], ms["fused-T"]),
        "energy_ratio_fused_vs_cuda": ratio(mj["cuda"], mj["fused"]),
        "energy_ratio_fused_T_vs_cuda": ratio(mj["cuda"], mj["fused-T"]),
    }
    r = report["ratios"]
    report["goals"] = {
        "fused_20x_faster": None if r["speedup_fused_vs_cuda"] is None else r["speedup_fused_vs_cuda"] >= GOAL_SPEEDUP,
        "fused_T_20x_faster": None if r["speedup_fused_T_vs_cuda"] is None else r["speedup_fused_T_vs_cuda"] >= GOAL_SPEEDUP,
        "fused_20x_less_energy": None if r["energy_ratio_fused_vs_cuda"] is None else r["energy_ratio_fused_vs_cuda"] >= GOAL_ENERGY_RATIO,
        "fused_T_20x_less_energy": None if r["energy_ratio_fused_T_vs_cuda"] is None else r["energy_ratio_fused_T_vs_cuda"] >= GOAL_ENERGY_RATIO,
        "fused_T_at_most_10_mJ": None if mj["fused-T"] is None else mj["fused-T"] <= GOAL_BATCHED_MJ,
    }
    for key, value in r.items():
        log(f"{key:32s} " + ("n/a" if value is None else f"{value:8.2f}x"))
    return report


def sweep(task, config, tasks_per_launch: int, repeats: int = 5, log=print) -> list[dict]:
    """CUDA ms of the fused kernels for several (chunk, num_warps) at each precision, single and
    T-task launches (the split variant single only)."""
    from learner.backends.fused import FusedBackend
    from learner.train import prepare

    prepared = prepare(task, config)
    tasks, prepareds = batch_tasks(task, config, tasks_per_launch)
    rows = []
    for precision in PRECISIONS:
        for variant, grid in (("one", SWEEP), ("split", SWEEP_SPLIT)):
            for chunk, warps in grid:
                fused = FusedBackend("cuda", chunk=chunk, num_warps=warps, precision=precision, variant=variant)
                fused.run(task, prepared)
                single, _ = median_cuda_ms(fused, task, prepared, repeats)
                row = {"variant": variant, "chunk": chunk, "num_warps": warps, "precision": precision,
                       "single_ms": single}
                if variant == "one":
                    batched, _ = median_cuda_ms(BatchedLaunch(fused, tasks[1:], prepareds[1:]), task, prepared, repeats)
                    row.update({"launch_ms": batched, "per_task_ms_batched": batched / tasks_per_launch})
                rows.append(row)
                log(f"{variant:5s} chunk {chunk:4d} warps {warps:2d} {precision:6s}: single {single:9.3f} ms"
                    + (f", {tasks_per_launch}-task launch {row['launch_ms']:9.3f} ms "
                       f"({row['per_task_ms_batched']:.4f} ms per task)" if variant == "one" else ""))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mnist-dir", type=Path, default=bundled_mnist_dir())
    parser.add_argument("--tasks-per-launch", type=int, default=None, help="T (default: the SM count)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--target-seconds", type=float, default=5.0)
    parser.add_argument("--settle-seconds", type=float, default=3.0)
    parser.add_argument("--idle-seconds", type=float, default=3.0)
    parser.add_argument("--no-energy", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="also time several (chunk, num_warps)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    try:
        require_gpu()
    except RuntimeError as exc:
        print(f"bench_fused: {exc}", file=sys.stderr)
        return 2
    from learner.config import Config
    from learner.taskio import make_task

    task, _ = make_task(args.mnist_dir, DRAW0_SEED)
    report = measure(task, Config(), args.tasks_per_launch, args.repeats, max(3, args.repeats // 2), args.trials,
                     args.target_seconds, args.settle_seconds, args.idle_seconds, energy=not args.no_energy)
    if args.sweep:
        report["sweep"] = sweep(task, Config(), report["tasks_per_launch"])
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
