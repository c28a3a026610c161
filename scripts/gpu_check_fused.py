"""GPU check of the fused backend (one prepared run; scripts/gpu_check.py calls ``run``).

    python scripts/gpu_check_fused.py --mnist-dir ../shared/data/mnist --out "$OUT"

1. correctness on the 10k/10k MNIST draw 0 (default config):
   fused vs the cuda backend: final parameters and velocity within (2e-5, 3e-3),
   predictions equal; also against the cpu backend and the known draw-0 facts (8,887
   correct, predictions_sha256 37724115...); a repeat run byte-identical.
2. a T-task launch (T = the SM count): its task 0 byte-identical to the single launch of
   draw 0, its last task byte-identical to that task's single launch and within tolerance
   of the cuda backend on it.
3. ``auto``'s self-check (learner.backends.fused.fused_ready) passes.
4. in one run (bench/bench_fused.py ``measure`` with short trials): median CUDA-event ms
   per task of cuda, fused and fused-T, idle-adjusted mJ per task of each by the
   paired-idle protocol, and the ratios (printed).

Fails loudly: any exception propagates (gpu_check.py records it as failed), and
``passed`` is false when a check fails or a figure could not be measured (no energy
counter, time budget spent) -- a missing figure is reported with its reason, never
invented. Budget: meant to finish well under 8 minutes on one H200 (estimate, not
measured: written on a machine without a GPU, so none of this has been run yet). If
the correctness part overruns its share the energy trials are skipped and said so.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import learner  # noqa: E402,F401  (sets CUBLAS_WORKSPACE_CONFIG before CUDA starts)

DRAW0_SEED = 2026091400
DRAW0_CORRECT = 8887
DRAW0_PREDICTIONS_SHA256 = "37724115cb2d3242eb4a4f76d3a879ac92d729939320e5f6f2bd046bd631f200"
BUDGET_S = 8 * 60
ENERGY_START_DEADLINE_S = 4 * 60  # energy trials need ~2-3 minutes; do not start them later


def _bench():
    path = ROOT / "bench" / "bench_fused.py"
    spec = importlib.util.spec_from_file_location("bench_fused", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _same_bytes(a, b) -> bool:
    arrays_a = list(a.final_parameters) + list(a.final_velocity) + [a.scores]
    arrays_b = list(b.final_parameters) + list(b.final_velocity) + [b.scores]
    return all(x.tobytes() == y.tobytes() for x, y in zip(arrays_a, arrays_b))


def _compare(name: str, out, ref) -> dict:
    from learner.reference_check import TOLERANCE, max_violation

    ok_p, err_p = max_violation(out.final_parameters, ref.final_parameters, **TOLERANCE)
    ok_v, err_v = max_violation(out.final_velocity, ref.final_velocity, **TOLERANCE)
    mismatches = int((out.scores.argmax(1) != ref.scores.argmax(1)).sum())
    return {
        f"parameters_within_tolerance_of_{name}": ok_p, f"parameter_max_abs_error_vs_{name}": err_p,
        f"velocity_within_tolerance_of_{name}": ok_v, f"velocity_max_abs_error_vs_{name}": err_v,
        f"prediction_mismatches_vs_{name}": mismatches,
        f"scores_max_abs_difference_vs_{name}": float(np.abs(out.scores - ref.scores).max()),
        f"passed_vs_{name}": ok_p and ok_v and mismatches == 0,
    }


def run(out_dir: Path, mnist_dir: Path | None = None, log=print) -> dict:
    t_start = time.perf_counter()
    bench = _bench()
    bench.require_gpu()  # raises with a clear message: never a made-up figure
    from learner.backends.cuda import GraphBackend
    from learner.backends.fused import FusedBackend, fused_ready, readiness
    from learner.config import Config
    from learner.result import run_task
    from learner.taskio import make_task
    from learner.train import prepare

    mnist_dir = mnist_dir or ROOT.parent / "shared" / "data" / "mnist"
    out_dir.mkdir(parents=True, exist_ok=True)
    config = Config()
    task, labels = make_task(mnist_dir, DRAW0_SEED)
    report: dict = {"gpu": torch.cuda.get_device_name(), "sm_count": bench.sm_count()}

    # 1. draw 0: fused vs cuda (and cpu)
    cuda, fused = GraphBackend("cuda"), FusedBackend("cuda")
    r_cuda = run_task(task, config, cuda)
    t = time.perf_counter()
    r_fused = run_task(task, config, fused)
    first_s = time.perf_counter() - t
    r_fused_again = run_task(task, config, fused)
    r_cpu = run_task(task, config, "cpu")
    draw0 = {
        "first_fused_task_seconds_including_compile": first_s,
        "fused_correct": int((r_fused.predictions == labels).sum()),
        "cuda_correct": int((r_cuda.predictions == labels).sum()),
        "fused_predictions_sha256": r_fused.predictions_sha256,
        "cuda_predictions_sha256": r_cuda.predictions_sha256,
        "fused_predictions_equal_known_draw0": r_fused.predictions_sha256 == DRAW0_PREDICTIONS_SHA256,
        "fused_repeat_byte_identical": _same_bytes(r_fused, r_fused_again),
        "fused_cuda_ms": r_fused.metadata.get("cuda_ms"),
        "backend_details": r_fused.metadata.get("backend_details"),
        **_compare("cuda", r_fused, r_cuda),
        **_compare("cpu", r_fused, r_cpu),
    }
    draw0["passed"] = (draw0["passed_vs_cuda"] and draw0["fused_repeat_byte_identical"]
                       and draw0["fused_correct"] == DRAW0_CORRECT)
    report["draw0"] = draw0
    log(f"draw0: fused {draw0['fused_correct']} correct, vs cuda max |dp| {draw0['parameter_max_abs_error_vs_cuda']:.3g}, "
        f"mismatches {draw0['prediction_mismatches_vs_cuda']}, passed {draw0['passed']}")

    # 2. a T-task launch against single launches
    count = bench.sm_count()
    tasks, prepareds = bench.batch_tasks(task, config, count)
    t = time.perf_counter()
    outs = fused.run_many(tasks, prepareds)
    launch_s = time.perf_counter() - t
    last_single = fused.run(tasks[-1], prepareds[-1])
    last_cuda = cuda.run(tasks[-1], prepareds[-1])
    batched = {
        "tasks_in_launch": count,
        "launch_wall_seconds_including_staging": launch_s,
        "launch_cuda_ms": outs[0].cuda_ms,
        "task0_equals_single_launch": _same_bytes(outs[0], fused.run(task, prepare(task, config))),
        "last_task_equals_single_launch": _same_bytes(outs[-1], last_single),
        **_compare("cuda", outs[-1], last_cuda),
    }
    batched["passed"] = (batched["task0_equals_single_launch"] and batched["last_task_equals_single_launch"]
                         and batched["passed_vs_cuda"])
    report["batched"] = batched
    log(f"batched: {count} tasks in {outs[0].cuda_ms:.3f} ms, equal to single launches "
        f"{batched['task0_equals_single_launch'] and batched['last_task_equals_single_launch']}, passed {batched['passed']}")

    # 3. auto's self-check
    report["auto_self_check"] = {"passed": bool(fused_ready()), "detail": (readiness() or (None, None))[1]}

    # 4. ms and mJ per task, in one run
    elapsed = time.perf_counter() - t_start
    do_energy = elapsed < ENERGY_START_DEADLINE_S
    perf = bench.measure(task, config, tasks_per_launch=count, timing_repeats=10, batched_repeats=5,
                         trials=2, target_seconds=2.0, settle_seconds=1.0, idle_seconds=1.0,
                         energy=do_energy, log=log)
    if not do_energy:
        perf["energy_skipped"] = f"correctness took {elapsed:.0f} s, past the {ENERGY_START_DEADLINE_S} s start deadline"
    report["performance"] = perf
    energy_ok = do_energy and all("error" not in (v.get("energy") or {"error": 1}) for v in perf["variants"].values())
    report["seconds"] = time.perf_counter() - t_start
    report["passed"] = bool(draw0["passed"] and batched["passed"] and report["auto_self_check"]["passed"] and energy_ok)
    if report["seconds"] > BUDGET_S:
        report["over_budget"] = f"took {report['seconds']:.0f} s, budget {BUDGET_S} s"
        report["passed"] = False
    (out_dir / "fused.json").write_text(json.dumps(report, indent=2, default=str))
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mnist-dir", type=Path, default=ROOT.parent / "shared" / "data" / "mnist")
    parser.add_argument("--out", type=Path, default=Path("gpu-check-out"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check_fused: no CUDA GPU here; nothing was checked", file=sys.stderr)
        return 2
    report = run(args.out, args.mnist_dir)
    print(json.dumps({k: report[k] for k in ("passed", "seconds")}, default=str))
    print(json.dumps(report["performance"]["ratios"], indent=2))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
