"""GPU check of the cuda backend (CUDA graphs); scripts/gpu_check.py calls ``run``.

  cases       depths 1 and 2 on a small random task: reversible-core gradients on the device vs
              ordinary autograd on the CPU, then graph replay vs independent eager SGD
              (parameters and velocity within (2e-5, 3e-3), predictions equal), a byte-repeatable
              second replay and the second run reusing the captured graphs
  draw0       the 10k/10k draw 0: accuracy, against the cpu backend (predictions, parameters;
              where predictions differ: each differing query's margin and both accuracies), a
              byte-identical repeat, the first task's seconds including capture, median CUDA ms
  graph_reuse draw 1 (same shape) replays draw 0's graphs without recapture and equals a fresh backend
  eleven      the eleven published draws on the backend as the tuned table sets it for this GPU (its
              step: learner/kernels/tuned.py ``cuda_step``) against the cpu backend, query by query
              (110,000 predictions equal, draw 0's state within tolerance); the cpu references are the
              carried ones (scripts/gpu_reference.py) where the draws built here are their tasks, else a
              child process's started when the section starts (the fused section reads the same)
  workspace   CUBLAS_WORKSPACE_CONFIG as it ran and the bytes it costs per stream (also in every
              answer's backend_details.memory)

``--dry-run`` (scripts/gpu_check.py --dry-run) runs the same program eagerly on the CPU
(``GraphBackend("cpu")``: static buffers, no graphs), on 1,000/500 slices of draws 0 and 1 (the
eager program takes seconds per 10k task there); what needs a GPU (capture, CUDA events) is
listed in ``not_checked_in_dry_run``.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check_common as common  # noqa: E402

DRY_SLICE = (0, 1000, 500)  # first row, train count, query count of each draw in the dry run


def eleven_draws(draws, dry_run: bool, device: str, ref_job, log) -> dict:
    """The eleven draws (scripts/gpu_tune.py's tasks) on the tuned cuda backend against the cpu backend."""
    import gpu_tune  # scripts/ is on sys.path

    from learner.backends.cuda import GraphBackend
    from learner.config import Config
    from learner.train import prepare

    t = time.perf_counter()
    backend = GraphBackend(device)
    tasks, labels = draws
    outs = [backend.run(task, prepare(task, Config())) for task in tasks]
    ref = ref_job.result()
    out = {"what": "eleven draws" + (f", rows {gpu_tune.DRY_SLICE}" if dry_run else ""), "step": backend.step,
           "tuned": backend.tuned.as_dict(), "cpu_correct_by_draw": ref["correct"],
           "cpu_reference_seconds": ref["wall_seconds"], "cpu_reference_source": ref.get("source"),
           **gpu_tune.check_outputs(outs, ref, labels), "seconds": time.perf_counter() - t}
    log(f"  cuda eleven draws ({backend.step}): {out['predictions_differing']} of {out['predictions_compared']} "
        f"predictions differ from cpu, correct {sum(out['correct_by_draw'])}, passed {out['passed']}")
    return out


def run(out_dir: Path, mnist_dir: Path, dry_run: bool = False, log=print, report: dict | None = None, **_) -> dict:
    """The section; its report (``report``: gpu_check.py's dict, filled as it goes) is written to
    cuda.json however it ends, partial on an error or an interrupt."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {} if report is None else report
    with common.kept(report, out_dir / "cuda.json"):
        return _run(report, mnist_dir, dry_run, log, out_dir)


def _run(report: dict, mnist_dir: Path, dry_run: bool, log, out_dir: Path) -> dict:
    import gpu_reference
    import gpu_tune  # scripts/ is on sys.path

    draws = gpu_tune.build_draws(mnist_dir, dry_run)
    # the cpu references: carried where these draws are their tasks, else a child beside the GPU work
    ref_job = gpu_tune.shared_reference(mnist_dir, dry_run, out_dir, tasks=draws[0], log=log)
    if dry_run:  # the carried reference is for the whole draws: checked against them as the device will
        full, _ = gpu_tune.build_draws(mnist_dir, False)
        held = gpu_reference.Carried(gpu_reference.DEFAULT_PATH, full, False)
        report["carried_reference"] = {"path": str(held.path), "usable_on_the_device": held.usable,
                                       "reason": held.reason}
        log(f"  cuda: the carried cpu reference {'matches the eleven draws built here' if held.usable else held.reason}")
    import numpy as np
    import torch
    import torch.nn.functional as F

    import learner  # noqa: F401  (sets CUBLAS_WORKSPACE_CONFIG before CUDA starts)
    from learner.backends.cuda import GraphBackend
    from learner.config import Config, make_config
    from learner.model import core_forward, head, lift, reversible_core
    from learner.reference_check import TOLERANCE, max_violation, ordinary_sgd
    from learner.result import run_task
    from learner.taskio import make_task, validate_task
    from learner.train import initial_parameters, prepare

    device = "cpu" if dry_run else "cuda"
    report.update({"mode": common.mode_name(dry_run), "device": device,
                   "gpu": None if dry_run else torch.cuda.get_device_name(0), "cases": []})
    rng = np.random.default_rng(781)
    small = validate_task(rng.random((19, 1, 9, 9), dtype=np.float32), rng.integers(0, 10, 19),
                          rng.random((7, 1, 9, 9), dtype=np.float32))
    for depth in (1, 2):
        config = make_config({"depth": depth, "seed": 781, "batch_size": 8})
        # gradients of one minibatch: reversible on the device vs ordinary autograd on the CPU
        params_dev = [p.to(device).requires_grad_() for p in initial_parameters(config)]
        params_cpu = [p.clone().requires_grad_() for p in initial_parameters(config)]
        h = lift(torch.from_numpy(small.train_images[:8]))
        y = torch.from_numpy(small.train_labels[:8])
        loss_d = F.cross_entropy(head(reversible_core(h.to(device), params_dev[:-2], config.alpha), *params_dev[-2:]), y.to(device))
        loss_c = F.cross_entropy(head(core_forward(h, params_cpu[:-2], config.alpha), *params_cpu[-2:]), y)
        g_dev = [g.cpu().numpy() for g in torch.autograd.grad(loss_d, params_dev)]
        g_cpu = [g.numpy() for g in torch.autograd.grad(loss_c, params_cpu)]
        grads_ok, grads_err = max_violation(g_dev, g_cpu, **TOLERANCE)

        backend = GraphBackend(device)
        out = backend.run(small, prepare(small, config))
        again = backend.run(small, prepare(small, config))
        ref_p, ref_v, ref_s = ordinary_sgd(small, config)
        p_ok, p_err = max_violation(out.final_parameters, ref_p, **TOLERANCE)
        v_ok, v_err = max_violation(out.final_velocity, ref_v, **TOLERANCE)
        repeat = (again.scores.tobytes() == out.scores.tobytes()
                  and all(a.tobytes() == b.tobytes() for a, b in zip(again.final_parameters, out.final_parameters))
                  and all(a.tobytes() == b.tobytes() for a, b in zip(again.final_velocity, out.final_velocity)))
        preds_equal = bool((out.scores.argmax(1) == ref_s.argmax(1)).all())
        case = {
            "depth": depth, "config": config.as_dict(),
            "gradients_within_tolerance": grads_ok, "gradient_max_abs_error": grads_err,
            "parameters_within_tolerance": p_ok, "parameter_max_abs_error": p_err,
            "velocity_within_tolerance": v_ok, "velocity_max_abs_error": v_err,
            "predictions_match_independent_eager": preds_equal,
            "complete_replay_byte_repeatable": repeat,
            "second_run_reused_program": bool(again.extra["graph_reused"]),
            "graphs": bool(again.extra["graphs"]),
        }
        case["passed"] = bool(grads_ok and p_ok and v_ok and preds_equal and repeat and again.extra["graph_reused"]
                              and (dry_run or again.extra["graphs"]))
        report["cases"].append(case)
    log(f"  cuda cases: {', '.join(('ok' if c['passed'] else 'FAILED') + ' depth ' + str(c['depth']) for c in report['cases'])}")

    # 10k/10k: draw 0 and draw 1 share a shape; the second must replay without recapture.
    draw0, labels0 = make_task(mnist_dir, common.DRAW0_SEED)
    draw1, labels1 = make_task(mnist_dir, common.DRAW0_SEED + 1)
    if dry_run:  # the eager program is slow on a CPU: slices of one shape of both draws
        draw0, labels0 = common.small_task(draw0, labels0, *DRY_SLICE)
        draw1, labels1 = common.small_task(draw1, labels1, *DRY_SLICE)
        report["draws"] = f"dry run: rows {DRY_SLICE} of draws 0 and 1"
    backend = GraphBackend(device)
    t = time.perf_counter()
    r0 = run_task(draw0, Config(), backend)
    first_s = time.perf_counter() - t
    captures_after_first = backend.captures
    r1 = run_task(draw1, Config(), backend)
    r0_again = run_task(draw0, Config(), backend)
    fresh1 = run_task(draw1, Config(), GraphBackend(device))
    cpu0 = run_task(draw0, Config(), "cpu")
    p_ok, p_err = max_violation(r0.final_parameters, cpu0.final_parameters, **TOLERANCE)
    times = []  # CUDA-event ms on the device, wall ms in the dry run
    for _ in range(2 if dry_run else 7):
        r = run_task(draw0, Config(), backend)
        times.append(r.metadata["cuda_ms"] if not dry_run else r.metadata["training_prediction_seconds"] * 1000)
    correct = int((r0.predictions == labels0).sum())
    report["draw0"] = {
        "correct": correct,
        "correct_is_known_8887": None if dry_run else correct == common.DRAW0_CORRECT,
        "cpu_correct": int((cpu0.predictions == labels0).sum()),
        "predictions_equal_cpu": bool((r0.predictions == cpu0.predictions).all()),
        "predictions_sha256": r0.predictions_sha256, "scores_sha256": r0.scores_sha256,
        "predictions_sha256_is_known_draw0": None if dry_run else r0.predictions_sha256 == common.DRAW0_PREDICTIONS_SHA256,
        "vs_cpu": common.prediction_diff("cuda", r0.scores, "cpu", cpu0.scores, labels0),
        "parameters_within_tolerance_of_cpu": p_ok, "parameter_max_abs_error_vs_cpu": p_err,
        "repeat_byte_identical": r0_again.metadata["state_vector_sha256"] == r0.metadata["state_vector_sha256"]
        and r0_again.scores_sha256 == r0.scores_sha256,
        "first_task_seconds_including_capture": first_s,
        ("wall_ms_median" if dry_run else "cuda_ms_median_of_7"): statistics.median(times),
        ("wall_ms_values" if dry_run else "cuda_ms_values"): times,
    }
    # another seed is data, not program (issue #37): the same program replays, no capture
    other_seed = Config(seed=Config().seed + 1)
    r_seed = run_task(draw0, other_seed, backend)
    cpu_seed = run_task(draw0, other_seed, "cpu")
    report["graph_reuse"] = {
        "captures_after_first_task": captures_after_first,
        "captures_after_second_task": backend.captures,
        "cached_programs": len(backend.programs),
        "second_task_reused": bool(r1.metadata["backend_details"]["graph_reused"]),
        "second_task_equals_fresh_backend": r1.metadata["state_vector_sha256"] == fresh1.metadata["state_vector_sha256"]
        and r1.scores_sha256 == fresh1.scores_sha256,
        "draw1_correct": int((r1.predictions == labels1).sum()),
        "other_seed_reused": bool(r_seed.metadata["backend_details"]["graph_reused"]),
        "other_seed_predictions_equal_cpu": bool((r_seed.predictions == cpu_seed.predictions).all()),
        "captures_after_other_seed": backend.captures,
    }
    reuse = report["graph_reuse"]
    captures_ok = (reuse["captures_after_second_task"] == reuse["captures_after_other_seed"] == (0 if dry_run else 1)
                   and reuse["cached_programs"] == 1 and reuse["other_seed_reused"])
    report["eleven_draws"] = eleven_draws(draws, dry_run, device, ref_job, log)
    from learner.backends.cuda import memory_facts

    report["workspace"] = memory_facts()
    report["passed"] = bool(all(c["passed"] for c in report["cases"]) and report["eleven_draws"]["passed"]
                            and report["draw0"]["repeat_byte_identical"]
                            and report["draw0"]["parameters_within_tolerance_of_cpu"]
                            and captures_ok and reuse["second_task_reused"]
                            and reuse["second_task_equals_fresh_backend"])
    if dry_run:
        report["not_checked_in_dry_run"] = ["CUDA graph capture and replay", "CUDA-event timing",
                                            "reversible gradients on a GPU (both sides ran on the CPU)",
                                            "the 10k/10k draws (slices ran)",
                                            "the cuBLAS workspace (no cuBLAS on the CPU)"]
    d = report["draw0"]
    log(f"  cuda draw0: {d['correct']} correct (cpu {d['cpu_correct']}, {d['vs_cpu']['differing']} differ), "
        f"median {statistics.median(times):.3f} {'wall' if dry_run else 'CUDA'} ms, first task {first_s:.2f} s")
    return report
