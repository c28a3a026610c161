"""Every GPU check of the project, as one prepared run (writes JSON under --out).

    python scripts/gpu_check.py --mnist-dir ../shared/data/mnist --out "$OUT"

Sections (each records its own pass/fail and never stops the others):
  cuda      graph vs independent eager (params, gradients, velocity within (2e-5, 3e-3),
            predictions equal) on the record's small cases, byte-repeatable replay, graph
            reuse across two 10k/10k tasks of one shape, the draw-0 accuracy and CUDA ms
  energy    scripts/gpu_check_energy.py (the paired-idle protocol, briefly)
  fused     scripts/gpu_check_fused.py (fused kernel vs cuda backend, ms and mJ per task)
Budget: the cuda section takes well under a minute on an H200; see the others' docstrings.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import learner  # noqa: E402,F401  (sets CUBLAS_WORKSPACE_CONFIG before CUDA starts)


def cuda_section(mnist_dir: Path) -> dict:
    import torch.nn.functional as F

    from learner.backends.cuda import GraphBackend
    from learner.config import Config, make_config
    from learner.model import core_forward, head, lift, reversible_core
    from learner.reference_check import TOLERANCE, max_violation, ordinary_sgd
    from learner.result import run_task
    from learner.taskio import make_task, validate_task
    from learner.train import initial_parameters, prepare

    report: dict = {"device": torch.cuda.get_device_name(0), "cases": []}
    rng = np.random.default_rng(781)
    small = validate_task(rng.random((19, 1, 9, 9), dtype=np.float32), rng.integers(0, 10, 19),
                          rng.random((7, 1, 9, 9), dtype=np.float32))
    for depth in (1, 2):
        config = make_config({"depth": depth, "seed": 781, "batch_size": 8})
        # gradients of one minibatch: reversible on the GPU vs ordinary autograd on the CPU
        params_gpu = [p.cuda().requires_grad_() for p in initial_parameters(config)]
        params_cpu = [p.clone().requires_grad_() for p in initial_parameters(config)]
        h = lift(torch.from_numpy(small.train_images[:8]))
        y = torch.from_numpy(small.train_labels[:8])
        loss_g = F.cross_entropy(head(reversible_core(h.cuda(), params_gpu[:-2], config.alpha), *params_gpu[-2:]), y.cuda())
        loss_c = F.cross_entropy(head(core_forward(h, params_cpu[:-2], config.alpha), *params_cpu[-2:]), y)
        g_gpu = [g.cpu().numpy() for g in torch.autograd.grad(loss_g, params_gpu)]
        g_cpu = [g.numpy() for g in torch.autograd.grad(loss_c, params_cpu)]
        grads_ok, grads_err = max_violation(g_gpu, g_cpu, **TOLERANCE)

        backend = GraphBackend("cuda")
        out = backend.run(small, prepare(small, config))
        again = backend.run(small, prepare(small, config))
        ref_p, ref_v, ref_s = ordinary_sgd(small, config)
        p_ok, p_err = max_violation(out.final_parameters, ref_p, **TOLERANCE)
        v_ok, v_err = max_violation(out.final_velocity, ref_v, **TOLERANCE)
        repeat = (again.scores.tobytes() == out.scores.tobytes()
                  and all(a.tobytes() == b.tobytes() for a, b in zip(again.final_parameters, out.final_parameters))
                  and all(a.tobytes() == b.tobytes() for a, b in zip(again.final_velocity, out.final_velocity)))
        preds_equal = bool((out.scores.argmax(1) == ref_s.argmax(1)).all())
        report["cases"].append({
            "depth": depth, "config": config.as_dict(),
            "gradients_within_tolerance": grads_ok, "gradient_max_abs_error": grads_err,
            "parameters_within_tolerance": p_ok, "parameter_max_abs_error": p_err,
            "velocity_within_tolerance": v_ok, "velocity_max_abs_error": v_err,
            "predictions_match_independent_eager": preds_equal,
            "complete_replay_byte_repeatable": repeat,
            "second_run_reused_graphs": bool(again.extra["graph_reused"]),
            "passed": grads_ok and p_ok and v_ok and preds_equal and repeat and again.extra["graph_reused"],
        })

    # 10k/10k: draw 0 and draw 1 share a shape; the second must replay without recapture.
    draw0, labels0 = make_task(mnist_dir, 2026091400)
    draw1, labels1 = make_task(mnist_dir, 2026091401)
    backend = GraphBackend("cuda")
    t = time.perf_counter()
    r0 = run_task(draw0, Config(), backend)
    first_s = time.perf_counter() - t
    captures_after_first = backend.captures
    r1 = run_task(draw1, Config(), backend)
    r0_again = run_task(draw0, Config(), backend)
    fresh1 = run_task(draw1, Config(), GraphBackend("cuda"))
    cpu0 = run_task(draw0, Config(), "cpu")
    p_ok, p_err = max_violation(r0.final_parameters, cpu0.final_parameters, **TOLERANCE)
    ms = []
    for _ in range(7):
        ms.append(run_task(draw0, Config(), backend).metadata["cuda_ms"])
    report["draw0"] = {
        "correct": int((r0.predictions == labels0).sum()),
        "cpu_correct": int((cpu0.predictions == labels0).sum()),
        "predictions_equal_cpu": bool((r0.predictions == cpu0.predictions).all()),
        "prediction_mismatches_vs_cpu": int((r0.predictions != cpu0.predictions).sum()),
        "parameters_within_tolerance_of_cpu": p_ok, "parameter_max_abs_error_vs_cpu": p_err,
        "predictions_sha256": r0.predictions_sha256, "scores_sha256": r0.scores_sha256,
        "repeat_byte_identical": r0_again.metadata["state_vector_sha256"] == r0.metadata["state_vector_sha256"]
        and r0_again.scores_sha256 == r0.scores_sha256,
        "first_task_seconds_including_capture": first_s,
        "cuda_ms_median_of_7": statistics.median(ms), "cuda_ms_values": ms,
    }
    report["graph_reuse"] = {
        "captures_after_first_task": captures_after_first,
        "captures_after_second_task": backend.captures,
        "second_task_reused": bool(r1.metadata["backend_details"]["graph_reused"]),
        "second_task_equals_fresh_backend": r1.metadata["state_vector_sha256"] == fresh1.metadata["state_vector_sha256"]
        and r1.scores_sha256 == fresh1.scores_sha256,
        "draw1_correct": int((r1.predictions == labels1).sum()),
    }
    report["passed"] = (all(c["passed"] for c in report["cases"])
                        and report["draw0"]["repeat_byte_identical"]
                        and report["draw0"]["parameters_within_tolerance_of_cpu"]
                        and report["graph_reuse"]["captures_after_second_task"] == 1
                        and report["graph_reuse"]["second_task_equals_fresh_backend"])
    return report


def external_section(name: str, out_dir: Path, mnist_dir: Path) -> dict:
    path = ROOT / "scripts" / f"gpu_check_{name}.py"
    if not path.exists():
        return {"skipped": f"{path.name} not present"}
    spec = importlib.util.spec_from_file_location(f"gpu_check_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.run(out_dir, mnist_dir=mnist_dir)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mnist-dir", type=Path, default=ROOT.parent / "shared" / "data" / "mnist")
    parser.add_argument("--out", type=Path, default=Path("gpu-check-out"))
    parser.add_argument("--sections", default="cuda,energy,fused")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU here: nothing to check", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    for section in args.sections.split(","):
        t = time.perf_counter()
        try:
            results[section] = cuda_section(args.mnist_dir) if section == "cuda" else external_section(section, args.out, args.mnist_dir)
        except Exception:
            results[section] = {"passed": False, "error": traceback.format_exc()}
        results[section]["seconds"] = time.perf_counter() - t
        print(f"== {section} ==\n{json.dumps(results[section], indent=2, default=str)}", flush=True)
        (args.out / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str))
    return 0 if all(results[s].get("passed", True) for s in args.sections.split(",")) else 1


if __name__ == "__main__":
    sys.exit(main())
