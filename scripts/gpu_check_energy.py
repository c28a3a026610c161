"""GPU check of the energy interface and the paired-idle protocol (needs a CUDA GPU and NVML).

Runs the protocol briefly (2 trials, 2 s target, 1 s settle and idle windows) on the
cuda backend with MNIST draw 0, reads the /health telemetry and one per-request
figure, prints the per-task figures and writes the whole document to
``out_dir/energy_check.json``. scripts/gpu_check.py calls ``run(out_dir)``;
alone: ``python scripts/gpu_check_energy.py [out_dir] [--mnist-dir DIR]``.

Written without a GPU at hand: none of this has run yet. The checks below are what
must hold on real hardware; a failed one is reported, never hidden.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a file: make the checkout importable
    sys.path.insert(0, str(ROOT))

DRAW0_SEED = 2026091400
CPU_PREDICTIONS_SHA256 = "37724115cb2d3242eb4a4f76d3a879ac92d729939320e5f6f2bd046bd631f200"
MNIST_CANDIDATES = (ROOT / "shared" / "data" / "mnist", ROOT.parent / "shared" / "data" / "mnist")


def find_mnist(mnist_dir: Path | None = None) -> Path:
    for candidate in ([mnist_dir] if mnist_dir else list(MNIST_CANDIDATES)):
        if candidate and (candidate / "train-images.idx3-ubyte.gz").exists():
            return candidate
    raise FileNotFoundError(f"MNIST not found in {', '.join(str(c) for c in MNIST_CANDIDATES)}; pass --mnist-dir")


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def per_request_check(task) -> dict:
    """One per-request figure (the service's path) around one cuda run of the task."""
    from learner.backends import get_backend
    from learner.config import Config
    from learner.energy import IdleBaseline, open_meter, request_energy
    from learner.train import prepare

    meter, reason = open_meter()
    if meter is None:
        return {"ok": False, "reason": reason}
    idle = IdleBaseline()
    for _ in range(5):  # the device is idle here
        idle.sample(meter)
        time.sleep(0.2)
    backend = get_backend("cuda")
    prepared = prepare(task, Config())
    out, figures = request_energy(meter, lambda: backend.run(task, prepared), idle)
    figures["cuda_ms"] = out.cuda_ms
    figures["ok"] = _finite(figures["gross_j"]) and figures["gross_j"] >= 0 and len(idle) == 5
    return figures


def run(out_dir: Path, mnist_dir: Path | None = None) -> dict:
    import torch

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        return {"ok": False, "reason": "no CUDA GPU visible to torch"}

    from learner.config import Config
    from learner.energy import gpu_telemetry, open_meter
    from learner.measure import measure_task
    from learner.taskio import make_task

    started = time.perf_counter()
    task, _labels = make_task(find_mnist(mnist_dir), DRAW0_SEED)
    meter, meter_reason = open_meter()
    health, health_reason = gpu_telemetry()
    doc = measure_task(task, Config(), "cuda", trials=2, target_seconds=2.0, settle_seconds=1.0, idle_seconds=1.0)
    request = per_request_check(task)
    (out_dir / "energy_check.json").write_text(
        json.dumps({"measure": doc, "gpu_telemetry": health, "per_request": request}, indent=2) + "\n"
    )

    energy = doc["energy"]
    checks: dict[str, bool] = {
        "meter_opened": meter is not None,
        "gpu_telemetry": health is not None and _finite(health.get("power_w")) and _finite(health.get("energy_counter_mj")),
        "energy_object": energy is not None,
        "repeat_predictions_equal": doc["repeat_predictions_equal"],
        "repeat_state_hashes_equal": doc["repeat_state_hashes_equal"],
        "memory_peak_recorded": bool(doc["memory"]) and doc["memory"]["prepare_and_invoke_peak_allocated_bytes"] > 0,
        "per_request_figure": bool(request.get("ok")),
    }
    per_task = []
    if energy is not None:
        hw = energy["hardware"]
        checks["nvml_handle_selected_by_cuda_pci_bus_id"] = hw["nvml_handle_selected_by_cuda_pci_bus_id"] is True
        checks["calibrated_with_cuda_events"] = doc["protocol"]["calibration"] == "CUDA events"
        for t in energy["trials"]:
            adjusted, unadjusted = t["idle_adjusted_mj_per_task"], t["unadjusted_mj_per_task"]
            per_task.append(
                {
                    "trial": t["trial"],
                    "invocations": t["invocations"],
                    "idle_adjusted_mj_per_task": adjusted,
                    "unadjusted_mj_per_task": unadjusted,
                    "paired_idle_w": t["paired_idle_w"],
                    "cuda_ms_per_task": t["cuda_ms_per_task"],
                    "wall_ms_per_task": t["wall_ms_per_task"],
                    "active_s": t["active"]["duration_s"],
                }
            )
            checks[f"trial{t['trial']}_figures_sane"] = (
                _finite(adjusted) and _finite(unadjusted) and 0 < adjusted < unadjusted
                and _finite(t["cuda_ms_per_task"]) and 0 < t["cuda_ms_per_task"] <= t["wall_ms_per_task"] * 1.01
                and t["active"]["energy_j"] > 0 and t["idle_before"]["energy_j"] > 0
            )
    result = {
        "ok": all(checks.values()),
        "checks": checks,
        "meter_reason": meter_reason,
        "gpu_telemetry_reason": health_reason,
        "energy_reason": doc.get("energy_reason"),
        "calibration_ms": doc["calibration_ms"],
        "repeats_per_trial": doc["repeats_per_trial"],
        "per_task": per_task,
        "summary": None if energy is None else energy["summary"],
        "hardware": doc["hardware"],
        "memory": doc["memory"],
        "per_request": {k: request.get(k) for k in ("gross_j", "idle_adjusted_j", "idle_baseline_w", "duration_s",
                                                     "estimate", "cuda_ms", "reason")},
        # information, not a check: whether the cuda backend reproduces the cpu predictions
        "predictions_sha256": doc["predictions_sha256"],
        "predictions_match_cpu_reference": doc["predictions_sha256"] == CPU_PREDICTIONS_SHA256,
        "seconds": time.perf_counter() - started,
    }
    _print(result)
    return result


def _print(r: dict) -> None:
    print(f"energy check: {'ok' if r['ok'] else 'FAILED'} in {r['seconds']:.1f} s")
    for name, passed in r["checks"].items():
        print(f"  {'ok  ' if passed else 'FAIL'} {name}")
    if r["energy_reason"]:
        print(f"  energy: none ({r['energy_reason']})")
    print(f"  calibration {r['calibration_ms']:.3f} ms -> {r['repeats_per_trial']} tasks per trial")
    for t in r["per_task"]:
        print(
            f"  trial {t['trial']}: idle-adjusted {t['idle_adjusted_mj_per_task']:.1f} mJ/task, "
            f"unadjusted {t['unadjusted_mj_per_task']:.1f} mJ/task, paired idle {t['paired_idle_w']:.2f} W, "
            f"cuda {t['cuda_ms_per_task']:.3f} ms/task, wall {t['wall_ms_per_task']:.3f} ms/task "
            f"({t['invocations']} tasks in {t['active_s']:.3f} s)"
        )
    if r["summary"]:
        for key, s in r["summary"].items():
            if s:
                sd = "n/a" if s["sample_sd"] is None else f"{s['sample_sd']:.3f}"
                print(f"  {key}: mean {s['mean']:.3f}, sample SD {sd}")
    req = r["per_request"]
    if req.get("gross_j") is not None:
        print(
            f"  one request: {req['gross_j']:.3f} J gross, {req['idle_adjusted_j']} J idle-adjusted over "
            f"{req['duration_s'] * 1000:.1f} ms (estimate: {req['estimate']})"
        )
    print(f"  predictions_sha256 {r['predictions_sha256'][:16]}… matches cpu reference: {r['predictions_match_cpu_reference']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default="gpu-check-out")
    parser.add_argument("--mnist-dir", type=Path)
    args = parser.parse_args(argv)
    result = run(Path(args.out_dir), args.mnist_dir)
    if "checks" not in result:
        print(f"energy check: not run ({result['reason']})")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
