"""The HTTP service on the GPU backend, end to end over HTTP only (scripts/gpu_check.py calls ``run``).

Starts ``python -m rev88 serve --backend fused --batch-wait-ms 300 --batch-max <the SM count>
--queue-size <2 launches> --sweep-max-cells 1320`` in a child process on a free loopback port, waits
for /v2/health/ready (the learner's checks and the backend's warm-up), then:

  health       GET /health: ready, the backend, the ``gpu`` object (name, power, energy counter)
               and per-request energy on
  draw0        POST draw 0 (10k/10k): 8,887 correct, predictions equal to the reference backend's
               (the cpu backend, run in this process: the fused section's rule), a per-request
               ``energy`` object; the cpu hash 37724115... is reported on a GPU, required in a dry
               run. Where predictions differ from the reference: each differing query's margin on
               both sides and both accuracies (gpu_check_common.prediction_diff), so a flipped
               near-tie is diagnosed from the run
  batch        8 concurrent POSTs of 1,024/256 tasks (seeds 11..18): every answer equals the
               cpu backend's predictions for its task (differences explained the same way),
               and some shared a launch (``tasks_in_launch`` > 1, energy divided equally:
               ``launch_gross_j``, method "batched launch ...")
  alt_backend  POST draw 0 with ?backend=cuda: it ran there, 8,887 correct, and its predictions
               equal this process's cuda run of draw 0 (same backend, same device)
  measure      POST ?measure=energy with one short trial and short reference and sham windows
               (MEASURE_PARAMS: 11 s of windows, not the 33 s of the service's defaults): an
               ``energy`` document with an idle-adjusted mJ per task, measured with those windows
  metrics      GET /metrics: task counters, launch sizes, the GPU gauges (power, energy counter,
               summed task energy)
  sweep        draw 0 stored once (PUT /datasets), a sweep of 8 seeds on it: completed, every cell's
               predictions equal to its single POST /tasks?dataset=&seed=, and on the GPU all 8 in
               one launch (``tasks_in_launch`` 8); cells/s against the single POSTs'
  big_sweep    issue #46's figure: a sweep of 1,320 cells of draw 0 (10 learning rates x 132 seeds;
               a dry run: 2 x 12), its cells/s (POST /sweeps until GET /sweeps?limit=1 says
               completed, polled every BIG_SWEEP_POLL_S) and the server's CPU per cell (/proc of the
               child server, every thread, and by thread group as bench/bench_shell.py's
               cpu_by_group groups them), printed beside the kernel's tasks/s: the fused section's
               SM-count launch in this run (from gpu_check.json beside service.json, when that
               section ran) and a launch of the first learning rate's 132 cells in this process on
               the same backend (twice: the dataset staged, then resident). Every cell succeeded
               with a predictions_sha256; those of that launch's cells and of two seeds of every other
               learning rate (launches of 2) equal this process's. The issue's >= 3,000 cells/s on an
               H200's host is reported (``issue_46_goal``), not checked
  drain        a long task in flight, then SIGTERM: it is answered 200, new work is refused
               (``Unavailable`` 503 or ``ConnectionFailed``), readiness is no longer 200, and the
               process exits 0

Tasks are sent and /health is read with ``rev88.Client`` (predictions and scores checked against
their hashes; no 503 retries: a 503 is a finding here); the readiness probe, /metrics and the
``?measure=energy`` document over plain httpx. The answers are read tolerantly (extra fields are
fine; only the fields named above are used).
Every wait (readiness, the batch's threads, the drain, the server's exit) and every request's
time-out is capped by what is left of the run's budget (``deadline``); after an interrupt the
server gets SIGTERM and, 5 s later, SIGKILL. ``report`` (gpu_check.py's dict) holds each step as
it ends; service.json is written however the section ends.
``--dry-run``: the same steps against a CPU backend (cpu-fast, else cpu; ``?backend=cpu`` as the
alternative and the reference); there every GPU-only expectation is inverted to what a CPU server must answer
(``gpu`` null with a reason, no GPU gauges, ``energy`` null with ``energy_reason``), and
launches are not shared (the CPU backends have no ``run_many``): that is listed in
``not_checked_in_dry_run``.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check_common as common  # noqa: E402

ROOT = common.ROOT
BATCH_TASKS = 8
# The big_sweep step (issue #46): learning rates x seeds of draw 0, on the GPU and in a dry run
BIG_SWEEP = {"device": (10, 132), "dry-run": (2, 12)}
BIG_SWEEP_MAX_CELLS = 1320  # --sweep-max-cells: the GPU's sweep fits
BIG_SWEEP_POLL_S = 0.02  # how often GET /sweeps?limit=1 asks whether it has finished (its CPU is the server's)
CELLS_PER_S_GOAL = 3000  # issue #46 on an H200's 16-core host: reported, not checked
BATCH_SHAPE = (1024, 256)  # both multiples of 16, like draw 0: the fused kernel variant compiled already
BATCH_WAIT_MS = 300
DRAIN_TARGET_S = 1.5  # how long the task in flight at SIGTERM should run
NPZ = {"Content-Type": "application/octet-stream"}
# The measure step's ?measure=energy arguments: every window short (11 s of windows in all,
# gpu_check_common.gated_window_seconds). Without reference_seconds and sham_seconds the gated
# protocol's 10 s reference windows and 5 s sham would apply: 33 s, for a check of the plumbing.
MEASURE_PARAMS = {"trials": 1, "target_seconds": 0.5, "settle_seconds": 0.2, "idle_seconds": 0.5,
                  "reference_seconds": 1.0, "sham_seconds": 1.0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def npz_bytes(task) -> bytes:
    import numpy as np

    buf = io.BytesIO()
    np.savez(buf, **task.as_dict())
    return buf.getvalue()


def _tail(path: Path, n: int = 4000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text[-n:]


def metric_samples(text: str) -> dict[str, list[tuple[dict, float]]]:
    """Prometheus text -> {sample name: [(labels, value)]} (tolerant of any other metric)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return out


def big_sweep_lrs(count: int) -> list[float]:
    """The big sweep's learning rates (bench/bench_launches.py's grid: 0.05, 0.06, ...)."""
    return [round(0.05 + 0.01 * i, 4) for i in range(count)]


def server_cpu(pid: int) -> dict[str, float]:
    """The server's CPU seconds so far: ``process`` (every thread, /proc/<pid>/stat) and per thread group
    (bench/bench_shell.py's cpu_by_group: main, workers, ledger, io, recv, finish, hash, to_thread, other)."""
    spec = importlib.util.spec_from_file_location("bench_shell", ROOT / "bench" / "bench_shell.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.cpu_by_group(pid)


def fused_section_kernel(out_dir: Path, max_age_s: float = 3600.0) -> dict | None:
    """The kernel's tasks/s from this run's fused section, read from gpu_check.json (which gpu_check.py
    rewrites after every section, ``finished`` false until the run ends): its SM-count launch
    (``batched``) and its fused-T timing (``performance``). None when that section did not run in this run."""
    import datetime

    try:
        doc = json.loads((Path(out_dir) / "gpu_check.json").read_text())
        started = datetime.datetime.fromisoformat(doc["started_at"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    age = (datetime.datetime.now(datetime.UTC) - started).total_seconds()
    fused = (doc.get("sections") or {}).get("fused")
    if doc.get("finished") is not False or age > max_age_s or not isinstance(fused, dict):
        return None
    batched = fused.get("batched") or {}
    count, ms = batched.get("tasks_in_launch"), batched.get("launch_cuda_ms")
    per_task = ((fused.get("performance") or {}).get("ms_per_task") or {}).get("fused-T")
    return {"source": "this run's fused section (gpu_check.json)", "tasks_in_launch": count,
            "launch_cuda_ms": ms,
            "tasks_per_s": count / (ms / 1000.0) if common.finite(ms) and ms > 0 and count else None,
            "fused_T_ms_per_task": per_task,
            "fused_T_tasks_per_s": 1000.0 / per_task if common.finite(per_task) and per_task > 0 else None}


def in_process_reference(task, lrs: list[float], seeds: int, backend: str, engine=None) -> dict:
    """The big sweep's cells computed in this process: ``hashes`` {(learning rate, seed): predictions_sha256}
    and ``kernel``, the launch figures. With ``engine`` (on the GPU: the fused backend object): the first
    learning rate's ``seeds`` cells in one ``run_many`` launch, twice (its CUDA-event ms is the kernel's
    tasks/s in this step; the walls hold the host's part: packing, the copies in and out, unpacking),
    then two seeds (the first and the last) of every other learning rate, a launch of 2 each. Without
    (a dry run: no batching backend) the same cells one ``run_task`` on ``backend`` at a time."""
    from learner.config import Config
    from learner.hashing import array_sha256
    from learner.result import device_predictions, run_task
    from learner.train import prepare

    first = [(lrs[0], seed) for seed in range(seeds)]
    others = [(lr, seed) for lr in lrs[1:] for seed in (0, seeds - 1)]
    hashes: dict[tuple[float, int], str] = {}
    if engine is None:
        t = time.perf_counter()
        for lr, seed in first + others:
            hashes[(lr, seed)] = run_task(task, Config(learning_rate=lr, seed=seed), backend).predictions_sha256
        wall = time.perf_counter() - t
        return {"hashes": hashes, "kernel": {"backend": backend, "tasks": len(hashes), "wall_s": wall,
                                             "tasks_per_s": len(hashes) / wall if wall > 0 else None,
                                             "clock": "wall, one task at a time (dry run)"}}

    def launch(cells):
        prepareds = [prepare(task, Config(learning_rate=lr, seed=seed)) for lr, seed in cells]
        t = time.perf_counter()
        outs = engine.run_many([task] * len(cells), prepareds)
        wall_ms = (time.perf_counter() - t) * 1000.0
        for cell, out in zip(cells, outs):
            hashes[cell] = array_sha256(device_predictions(out))
        return outs[0], wall_ms

    t = time.perf_counter()
    for cell in first:  # the seeds' state computed and kept before the timed launches
        prepare(task, Config(learning_rate=cell[0], seed=cell[1]))
    prepare_s = time.perf_counter() - t
    runs = [launch(first) for _ in range(2)]
    for lr in lrs[1:]:
        launch([cell for cell in others if cell[0] == lr])
    out = runs[-1][0]
    cuda_ms = out.cuda_ms
    return {"hashes": hashes, "kernel": {
        "backend": backend, "tasks_in_launch": len(first), "launch_cuda_ms": cuda_ms,
        "tasks_per_s": len(first) / (cuda_ms / 1000.0) if common.finite(cuda_ms) and cuda_ms > 0 else None,
        "launch_wall_ms": [wall for _, wall in runs],
        "host_ms_per_launch": [wall - o.cuda_ms for o, wall in runs if common.finite(o.cuda_ms)],
        "datasets_staged": [(o.extra or {}).get("datasets_staged") for o, _ in runs],
        "prepare_seconds_first_time": prepare_s, "choice": {k: (out.extra or {}).get(k) for k in
                                                             ("chunk", "num_warps", "precision", "variant")},
        "clock": "CUDA events (the kernel), wall (the launch call)"}}


def drain_epochs(run_ms: float | None) -> int:
    """Epochs for a draw-0 task that runs about DRAIN_TARGET_S, from one 2-epoch run's ms;
    never a multiple of 16 (the fused kernel specializes integer arguments divisible by 16)."""
    per_epoch_ms = max(0.05, (run_ms or 100.0) / 2)
    epochs = int(min(400, max(4, round(DRAIN_TARGET_S * 1000 / per_epoch_ms))))
    return epochs + 1 if epochs % 16 == 0 else epochs


class Step:
    """One step's record: named checks, facts, and any exception (the step then fails)."""

    def __init__(self, steps: dict, name: str, log):
        self.steps, self.name, self.log = steps, name, log
        self.doc: dict = {"checks": {}}

    def check(self, name: str, ok) -> bool:
        self.doc["checks"][name] = bool(ok)
        return bool(ok)

    def __enter__(self):
        self.t = time.perf_counter()
        return self

    def __exit__(self, kind, exc, tb):
        if exc is not None:
            import traceback

            self.doc["error"] = f"{kind.__name__}: {exc}"
            self.doc["traceback"] = "".join(traceback.format_exception(kind, exc, tb))[-3000:]
        self.doc["seconds"] = time.perf_counter() - self.t
        self.doc["passed"] = exc is None and bool(self.doc["checks"]) and all(self.doc["checks"].values())
        self.steps[self.name] = self.doc
        failed = [k for k, v in self.doc["checks"].items() if not v]
        self.log(f"  service {'ok  ' if self.doc['passed'] else 'FAIL'} {self.name} ({self.doc['seconds']:.2f} s)"
                 + (f": failed {', '.join(failed)}" if failed else "") + (f": {self.doc['error']}" if exc else ""))
        return isinstance(exc, Exception)  # record a step's error and go on; never swallow an interrupt


def _energy_ok(energy, on_gpu: bool, answer: dict) -> bool:
    if on_gpu:
        return isinstance(energy, dict) and common.finite(energy.get("gross_j")) and energy["gross_j"] >= 0 \
            and isinstance(energy.get("method"), str)
    return energy is None and isinstance(answer.get("energy_reason"), str)


def _tasks_in_launch(answer: dict) -> int:
    for where in (answer.get("metadata") or {}, answer.get("timing") or {}, answer.get("energy") or {}):
        value = where.get("tasks_in_launch")
        if isinstance(value, int):
            return value
    return 1


def stop_server(proc: subprocess.Popen, grace_s: float, record: dict) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``; how it ended goes into ``record`` (server_stopped,
    server_exit_code). An interrupt arriving during the wait kills the server at once and is then
    raised again: the server never outlives the section."""
    pending = None
    try:
        if proc.poll() is not None:
            record["server_stopped"] = "had exited"
            return
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
            record["server_stopped"] = f"exited within {grace_s:.1f} s of SIGTERM"
            return
        except subprocess.TimeoutExpired:
            record["server_stopped"] = f"killed (SIGKILL) {grace_s:.1f} s after SIGTERM"
    except BaseException as exc:  # noqa: BLE001 - re-raised below, once the server is gone
        pending = exc
        record["server_stopped"] = f"killed (SIGKILL) at once: {type(exc).__name__}: {exc} during the wait"
    finally:
        if proc.poll() is None:
            proc.kill()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                record["server_stopped"] += "; still not reaped 5 s after SIGKILL"
        record["server_exit_code"] = proc.returncode
    if pending is not None:
        raise pending


def compare_predictions(doc: dict, name: str, predictions, scores, ref_name: str, ref, labels) -> bool:
    """The fused section's rule: an answer's ``predictions`` equal the reference's (the pass); where
    they differ, ``doc`` gets the count and, from the answer's ``scores`` (None when not sent),
    each differing query's margins on both sides and both accuracies -- a flipped near-tie is
    explained, not guessed."""
    import numpy as np

    predictions = np.asarray(predictions)
    equal = predictions.shape == ref.predictions.shape and bool(np.array_equal(predictions, ref.predictions))
    if not equal:
        if predictions.shape == ref.predictions.shape:
            doc[f"differing_from_{ref_name}"] = int((predictions != ref.predictions).sum())
        if scores is not None and np.shape(scores) == ref.scores.shape:
            doc[f"vs_{ref_name}"] = common.prediction_diff(name, np.asarray(scores, dtype=np.float32),
                                                           ref_name, ref.scores, labels)
    return equal


def run(out_dir: Path, mnist_dir: Path, dry_run: bool = False, log=print, deadline: float | None = None,
        report: dict | None = None, **_) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    report = {} if report is None else report  # gpu_check.py's: each step lands here as it ends
    report.update({"mode": common.mode_name(dry_run), "steps": {}})
    steps = report["steps"]

    def finish(report: dict) -> None:
        expected = ("start", "health", "draw0", "batch", "alt_backend", "measure", "metrics", "sweep", "big_sweep",
                    "drain")
        report["missing_steps"] = [name for name in expected if name not in steps]
        report["passed"] = (not report["missing_steps"] and "error" not in report
                            and all(steps[n]["passed"] for n in expected))
        if dry_run:
            report["not_checked_in_dry_run"] = [
                "the fused and cuda backends' warm-up",
                "/health's gpu object and /metrics' GPU gauges (their absence was checked)",
                "per-request and ?measure=energy joules (their null with a reason was checked)",
                "launch sharing (the CPU backends have no run_many; one task per launch was checked), also a sweep's",
                "the big sweep's size (2 x 12 cells, not 10 x 132) and its rates: cpu-fast runs each cell alone",
                "the kernel's launch time beside the big sweep (no fused backend; cpu-fast in this process instead)"]
        report["seconds"] = time.perf_counter() - t_start

    with common.kept(report, out_dir / "service.json", finish):
        missing = [d for d, m in common.SERVICE_MODULES.items() if importlib.util.find_spec(m) is None]
        if missing:
            report["error"] = (f"the service's packages are missing here: {', '.join(missing)} (on the GPU "
                               "machine they travel as wheels: scripts/gpu_prepare.sh, carry .device-wheels)")
            return report
        _run(report, out_dir, mnist_dir, dry_run, log, deadline)
    return report


def _run(report: dict, out_dir: Path, mnist_dir: Path, dry_run: bool, log, deadline: float | None) -> None:
    import httpx

    from learner.backends import get_backend
    from learner.config import Config
    from learner.result import run_task
    from learner.taskio import make_task
    from rev88 import Client, ClientError, ConnectionFailed

    def left(cap: float) -> float:
        return common.seconds_left(deadline, cap)

    def service(cap: float) -> Client:
        """rev88.Client for tasks and /health, its time-out capped by the budget; no 503 retries
        (a 503 here is a finding, and a retry's wait would spend the budget)."""
        return Client(url, timeout=left(cap), retries=0)

    steps = report["steps"]
    on_gpu = not dry_run
    if on_gpu:
        main_backend, alt_backend = "fused", "cuda"
    else:
        from learner.backends.cpu_fast import kernel_available

        main_backend, alt_backend = ("cpu-fast" if kernel_available() else "cpu"), "cpu"
    # the reference of the main backend's answers: the cpu backend, run in this process (the
    # fused section's rule); the alternative backend's answer is compared with its own run here
    reference_backend = "cpu"
    report.update({"backend": main_backend, "alt_backend": alt_backend, "reference_backend": reference_backend})

    t = time.perf_counter()
    draw0, labels0 = make_task(mnist_dir, common.DRAW0_SEED)
    draw0_body = npz_bytes(draw0)
    small = [common.small_task(draw0, labels0, k * BATCH_SHAPE[0], *BATCH_SHAPE) for k in range(BATCH_TASKS)]
    small_bodies = [npz_bytes(t) for t, _ in small]
    report["tasks_seconds"] = time.perf_counter() - t
    t = time.perf_counter()
    ref0 = run_task(draw0, Config(), reference_backend)
    references = [run_task(t, Config(seed=11 + k), reference_backend) for k, (t, _) in enumerate(small)]
    alt0 = ref0 if alt_backend == reference_backend else run_task(draw0, Config(), alt_backend)
    report["reference"] = {"backend": reference_backend, "seconds": time.perf_counter() - t,
                           "draw0_predictions_sha256": ref0.predictions_sha256,
                           "draw0_correct": int((ref0.predictions == labels0).sum()),
                           "draw0_is_cpu_hash": ref0.predictions_sha256 == common.DRAW0_PREDICTIONS_SHA256,
                           "alt_backend_draw0_predictions_sha256": alt0.predictions_sha256}
    cpu0 = ref0

    def cpu_draw0():
        nonlocal cpu0
        if cpu0 is None:
            cpu0 = run_task(draw0, Config(), "cpu")
        return cpu0

    def explain_vs_cpu(s: Step, name: str, answer) -> None:
        """Information, not a check: the cpu hash, and where it differs, the margins against cpu."""
        is_cpu = answer.predictions_sha256 == common.DRAW0_PREDICTIONS_SHA256
        s.doc["predictions_sha256_is_cpu_hash"] = is_cpu
        if not is_cpu and answer.scores is not None:
            s.doc["vs_cpu"] = common.prediction_diff(name, answer.scores, "cpu", cpu_draw0().scores, labels0)

    if on_gpu:
        import torch

        batch_max = int(torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count)
    else:
        batch_max = BATCH_TASKS
    report["batch_max"] = batch_max
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server_log = out_dir / "service_server.log"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    # the task ledger (SQLite) in this run's folder, not the user's ~/.local/share/rev88: every file
    # the run writes stays inside --out (and comes back in the bundle)
    data_dir = out_dir / "service-data"
    report["data_dir"] = str(data_dir)
    env.pop("REV88_DATABASE_URL", None)
    env["REV88_DATA_DIR"] = str(data_dir)
    cmd = [sys.executable, "-m", "rev88", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--data-dir", str(data_dir), "--backend", main_backend, "--batch-wait-ms", str(BATCH_WAIT_MS), "--batch-max", str(batch_max),
           "--queue-size", str(2 * batch_max), "--sweep-max-cells", str(BIG_SWEEP_MAX_CELLS),
           "--drain-timeout", "60", "--log-level", "info"]
    report["command"] = " ".join(cmd)
    client = httpx.Client(base_url=url, timeout=left(300))
    with open(server_log, "wb") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
    interrupted = False
    try:
        with Step(steps, "start", log) as s:
            t = time.perf_counter()
            limit = left(120 if dry_run else 300)
            s.doc["ready_wait_limit_s"] = limit
            ready = False
            while time.perf_counter() - t < limit and proc.poll() is None:
                try:
                    ready = client.get("/v2/health/ready", timeout=left(5)).status_code == 200
                except httpx.HTTPError:
                    ready = False
                if ready:
                    break
                time.sleep(0.2)
            s.doc["seconds_to_ready"] = time.perf_counter() - t
            s.doc["exit_code_if_exited"] = proc.poll()
            s.check("ready", ready)
        if not steps["start"]["passed"]:
            raise RuntimeError(f"the server did not become ready: {_tail(server_log, 2000)}")

        with Step(steps, "health", log) as s, service(30) as c:
            doc = c.health()  # its 200, or its 503 (not ready) with the document saying why
            s.doc.update({"gpu": doc.get("gpu"), "gpu_reason": doc.get("gpu_reason"),
                          "energy": doc.get("energy"), "backend": doc.get("backend"),
                          "warmup": (doc.get("learner") or {}).get("warmup"), "versions": doc.get("versions"),
                          # a launch's hashes side by side on this host (gpu_device_run.sh builds the lanes)
                          "sha256_lanes": (doc.get("learner") or {}).get("sha256_lanes")})
            s.check("ready", doc.get("ready") is True)
            s.check("backend", doc.get("backend") == main_backend)
            gpu = doc.get("gpu")
            if on_gpu:
                s.check("gpu_object", isinstance(gpu, dict) and bool(gpu.get("name"))
                        and common.finite(gpu.get("power_w")) and isinstance(gpu.get("energy_counter_mj"), int))
                s.check("per_request_energy_on", (doc.get("energy") or {}).get("per_request") is True)
            else:
                s.check("gpu_null_with_reason", gpu is None and isinstance(doc.get("gpu_reason"), str))
                s.check("per_request_energy_off", (doc.get("energy") or {}).get("per_request") is False)

        run_ms = None
        with Step(steps, "draw0", log) as s, service(300) as c:
            answer = c.run(draw0_body, include_scores=True)  # a 200; predictions and scores hash-checked
            s.check("answered", True)
            predictions = answer.predictions
            run_ms = answer.timing.get("run_ms")
            correct = int((predictions == labels0).sum()) if predictions.size == labels0.size else None
            s.doc.update({"correct": correct,
                          "predictions_sha256": answer.predictions_sha256, "timing": answer.timing,
                          "energy": answer.energy, "energy_reason": answer.document.get("energy_reason"),
                          "backend": answer.metadata.get("backend"), "reference": reference_backend})
            s.check("correct_8887", correct == common.DRAW0_CORRECT)
            s.check(f"predictions_equal_{reference_backend}",
                    compare_predictions(s.doc, main_backend, predictions, answer.scores, reference_backend, ref0,
                                        labels0))
            if not on_gpu:  # here the reference runs in the pinned environment: its hash is known
                s.check("reference_is_the_cpu_hash", report["reference"]["draw0_is_cpu_hash"])
            s.check("energy_object" if on_gpu else "energy_null_with_reason",
                    _energy_ok(answer.energy, on_gpu, answer.document))
            explain_vs_cpu(s, main_backend, answer)

        with Step(steps, "batch", log) as s:
            answers: list = [None] * BATCH_TASKS
            barrier = threading.Barrier(BATCH_TASKS)
            request_s = left(300)

            def post(k: int) -> None:
                try:
                    with Client(url, timeout=request_s, retries=0) as c:
                        barrier.wait(timeout=min(30, request_s))
                        answers[k] = c.run(small_bodies[k], include_scores=True, seed=11 + k).verify()
                except (ClientError, threading.BrokenBarrierError) as exc:
                    answers[k] = exc

            # daemon threads: an interrupt must not leave the interpreter waiting for their requests
            threads = [threading.Thread(target=post, args=(k,), daemon=True) for k in range(BATCH_TASKS)]
            for th in threads:
                th.start()
            for th in threads:
                th.join(timeout=left(request_s))
            rows = []
            for k, a in enumerate(answers):
                row: dict = {"task": k, "seed": 11 + k}
                if isinstance(a, ClientError):
                    row.update({"error": f"{type(a).__name__}: {a}", "status_code": a.status})
                elif a is None or isinstance(a, BaseException):
                    row["error"] = repr(a) if a is not None else "no answer within the budget"
                else:  # an Answer: a 200
                    row.update({"status_code": 200, "tasks_in_launch": _tasks_in_launch(a.document),
                                "queue_wait_ms": a.timing.get("queue_wait_ms"),
                                "energy": a.energy, "energy_reason": a.document.get("energy_reason")})
                    row[f"predictions_equal_{reference_backend}"] = compare_predictions(
                        row, main_backend, a.predictions, a.scores, reference_backend, references[k], small[k][1])
                rows.append(row)
            s.doc["answers"] = rows
            ok_rows = [row for row in rows if row.get("status_code") == 200]
            s.check("all_200", len(ok_rows) == BATCH_TASKS)
            s.check(f"predictions_equal_{reference_backend}_backend",
                    all(row.get(f"predictions_equal_{reference_backend}") for row in ok_rows) and ok_rows)
            sizes = [row.get("tasks_in_launch", 1) for row in ok_rows]
            s.doc["tasks_in_launch"] = sizes
            s.doc["sharing_expected"] = on_gpu
            if on_gpu:
                s.check("some_shared_a_launch", max(sizes, default=1) > 1)
                shared = [row for row in ok_rows if row.get("tasks_in_launch", 1) > 1]
                s.check("shared_energy_divided", all(
                    isinstance(row.get("energy"), dict) and "launch_gross_j" in row["energy"]
                    and "batched launch" in str(row["energy"].get("method")) for row in shared))
                s.check("every_answer_has_energy", all(_energy_ok(row.get("energy"), True, row) for row in ok_rows))
            else:
                s.check("one_task_per_launch_on_a_cpu_backend", all(n == 1 for n in sizes))
                s.check("energy_null_with_reason", all(_energy_ok(row.get("energy"), False, row) for row in ok_rows))

        with Step(steps, "alt_backend", log) as s, service(300) as c:
            answer = c.run(draw0_body, backend=alt_backend, include_scores=True)
            s.check("answered", True)
            predictions = answer.predictions
            correct = int((predictions == labels0).sum()) if predictions.size == labels0.size else None
            s.doc.update({"backend_asked": alt_backend, "backend": answer.metadata.get("backend"),
                          "correct": correct, "predictions_sha256": answer.predictions_sha256,
                          "timing": answer.timing, "energy": answer.energy})
            s.check("ran_on_the_asked_backend", s.doc["backend"] == alt_backend)
            s.check("correct_8887", correct == common.DRAW0_CORRECT)
            s.check(f"predictions_equal_in_process_{alt_backend}",
                    compare_predictions(s.doc, alt_backend, predictions, answer.scores, f"in_process_{alt_backend}",
                                        alt0, labels0))
            s.check("energy_object" if on_gpu else "energy_null_with_reason",
                    _energy_ok(answer.energy, on_gpu, answer.document))
            explain_vs_cpu(s, alt_backend, answer)

        with Step(steps, "measure", log) as s:
            # raw HTTP: rev88.Client sends tasks for answers, not ?measure= documents
            params = {"measure": "energy", **MEASURE_PARAMS}
            r = client.post("/tasks", content=small_bodies[0], headers=NPZ, params=params, timeout=left(300))
            s.check("status_200", r.status_code == 200)
            answer = r.json()
            m = answer.get("measurement") or {}
            energy = m.get("energy")
            summary = (energy or {}).get("summary") or {}
            adjusted = (summary.get("idle_adjusted_mj_per_task") or {}).get("mean")
            protocol = m.get("protocol") or {}
            s.doc.update({"params": params, "window_seconds": common.gated_window_seconds(MEASURE_PARAMS),
                          "protocol": protocol, "repeats_per_trial": m.get("repeats_per_trial"),
                          "calibration": protocol.get("calibration"),
                          "idle_adjusted_mj_per_task": adjusted, "energy_reason": m.get("energy_reason"),
                          "timing": m.get("timing")})
            s.check("measurement_document", bool(m) and "timing" in m)
            accepted = answer.get("protocol") or {}  # the arguments as the service parsed them
            s.check("short_windows_accepted", all(accepted.get(k) == v for k, v in MEASURE_PARAMS.items()))
            if on_gpu:
                s.check("energy_figure", energy is not None and common.finite(adjusted))
                s.check("repeat_equal", m.get("repeat_predictions_equal") is True and m.get("repeat_state_hashes_equal") is True)
                s.check("measured_with_short_windows", all(protocol.get(k) == v for k, v in MEASURE_PARAMS.items()))
            else:
                s.check("energy_null_with_reason", energy is None and isinstance(m.get("energy_reason"), str))

        with Step(steps, "metrics", log) as s:
            r = client.get("/metrics", timeout=left(30))
            s.check("status_200", r.status_code == 200)
            samples = metric_samples(r.text)
            ok_total = sum(v for labels, v in samples.get("rev88_tasks_total", []) if labels.get("outcome") == "ok")
            s.doc["tasks_ok_total"] = ok_total
            s.doc["gpu_samples"] = {k: v for k, v in samples.items() if k.startswith(("rev88_gpu_", "rev88_task_energy"))}
            s.doc["launch_tasks_count"] = sum(v for _, v in samples.get("rev88_launch_tasks_count", []))
            s.check("tasks_ok_counted", ok_total >= 2 + BATCH_TASKS)
            s.check("queue_gauges", "rev88_queue_depth" in samples and "rev88_tasks_in_flight" in samples)
            s.check("launch_histogram", "rev88_launch_tasks_count" in samples)
            gpu_names = ("rev88_gpu_power_watts", "rev88_gpu_energy_joules_total")
            if on_gpu:
                s.check("gpu_gauges", all(name in samples for name in gpu_names))
                # present; it can still read 0 if every metered run was shorter than the counter's update step
                s.check("task_energy_counter", "rev88_task_energy_joules_total" in samples)
            else:
                s.check("no_gpu_gauges_without_nvml", not any(k.startswith("rev88_gpu_") for k in samples))

        with Step(steps, "sweep", log) as s, service(600) as c:
            # draw 0 stored once, a sweep of batch_max seeds on it: on the GPU one fused launch
            dataset = c.put_dataset(draw0_body)
            t = time.perf_counter()
            sweep_id = c.sweep(dataset, seeds={"start": 0, "count": BATCH_TASKS})
            result = c.wait_sweep(sweep_id, left(300))
            sweep_s = time.perf_counter() - t
            rows = result.rows
            sizes = [int((row.get("timing") or {}).get("tasks_in_launch") or 1) for row in rows]
            t = time.perf_counter()
            singles = [c.run(dataset, seed=row["config"]["seed"]) for row in rows]
            singles_s = time.perf_counter() - t
            s.doc.update({"sweep_id": sweep_id, "status": result.status, "counts": result.counts,
                          "tasks_in_launch": sizes, "sweep_seconds": sweep_s, "singles_seconds": singles_s,
                          "cells_per_s": len(rows) / sweep_s if sweep_s else None,
                          "single_posts_per_s": len(rows) / singles_s if singles_s else None})
            s.check("completed", result.status == "completed" and result.counts["succeeded"] == BATCH_TASKS)
            s.check("each_cell_equals_its_single_task", [row.get("predictions_sha256") for row in rows]
                    == [a.predictions_sha256 for a in singles])
            if on_gpu:
                s.check("one_launch_of_all_8", all(n == BATCH_TASKS for n in sizes))
            else:
                s.check("one_task_per_launch_on_a_cpu_backend", all(n == 1 for n in sizes))

        with Step(steps, "big_sweep", log) as s, service(600) as c:
            # issue #46: a sweep of 1,320 cells through the server (cells/s, its CPU per cell), beside
            # the kernel's tasks/s; the cells' hashes against this process's
            n_lrs, n_seeds = BIG_SWEEP[common.mode_name(dry_run)]
            lrs, cells = big_sweep_lrs(n_lrs), n_lrs * n_seeds
            dataset = c.put_dataset(draw0_body)  # stored already (the sweep step): found by its digest
            s.doc.update({"cells": cells, "learning_rates": lrs, "seeds": n_seeds, "batch_max": batch_max,
                          "queue_size": 2 * batch_max, "poll_s": BIG_SWEEP_POLL_S, "server_pid": proc.pid})
            before, t = server_cpu(proc.pid), time.perf_counter()
            sweep_id = c.sweep(dataset, grid={"learning_rate": lrs}, seeds={"start": 0, "count": n_seeds})
            status, wait = None, left(300)
            while time.perf_counter() - t < wait:  # the list's row: its status, not its 1,320 cells
                row = (client.get("/sweeps", params={"limit": 1}, timeout=left(10)).json().get("sweeps") or [{}])[0]
                if row.get("id") == sweep_id and row.get("status") in ("completed", "cancelled"):
                    status = row["status"]
                    break
                time.sleep(BIG_SWEEP_POLL_S)
            wall = time.perf_counter() - t
            after = server_cpu(proc.pid)
            result = c.sweep_status(sweep_id)
            rows = result.rows
            by_cell = {(row["config"]["learning_rate"], row["config"]["seed"]): row for row in rows}
            used = {k: after[k] - before[k] for k in after}
            rate = cells / wall if status is not None and wall > 0 else None
            sizes = [int((row.get("timing") or {}).get("tasks_in_launch") or 1) for row in rows]
            s.doc.update({
                "sweep_id": sweep_id, "status": result.status, "counts": result.counts, "wall_s": wall,
                "cells_per_s": rate, "server_cpu_s": used["process"],
                "server_cpu_ms_per_cell": used["process"] / cells * 1000.0,
                "server_cpu_ms_per_cell_by_thread": {k: v / cells * 1000.0 for k, v in used.items() if k != "process"},
                "launch_sizes": {str(n): sizes.count(n) for n in sorted(set(sizes))}})
            s.check("completed", status == "completed" and result.counts.get("succeeded") == cells)
            s.check("every_cell_has_a_predictions_hash", len(by_cell) == cells and all(
                isinstance(row.get("predictions_sha256"), str) and len(row["predictions_sha256"]) == 64 for row in rows))
            ref = in_process_reference(draw0, lrs, n_seeds, main_backend, get_backend(main_backend) if on_gpu else None)
            section = fused_section_kernel(out_dir) if on_gpu else None
            s.doc["kernel"] = {"fused_section": section, "in_process": ref["kernel"]}
            differing = [f"lr {lr} seed {seed}" for (lr, seed), h in ref["hashes"].items()
                         if (by_cell.get((lr, seed)) or {}).get("predictions_sha256") != h]
            s.doc.update({"cells_checked_in_process": len(ref["hashes"]), "cells_differing": differing[:20],
                          "cells_differing_count": len(differing)})
            s.check(f"checked_cells_equal_in_process_{main_backend}", bool(ref["hashes"]) and not differing)
            s.doc["issue_46_goal"] = {"cells_per_s_at_least": CELLS_PER_S_GOAL, "on": "an H200's 16-core host",
                                      "met": (rate >= CELLS_PER_S_GOAL) if on_gpu and rate is not None else None,
                                      "note": "reported, not checked"}
            kernel_rates = [f"{k['tasks_per_s']:.0f} tasks/s ({where})" for k, where in
                            ((section, "the fused section's launch"), (ref["kernel"], "this process"))
                            if k and k.get("tasks_per_s") is not None]
            log(f"  service big_sweep: {cells} cells in {wall:.2f} s = " + (f"{rate:.0f}" if rate else "n/a")
                + f" cells/s, server CPU {s.doc['server_cpu_ms_per_cell']:.3f} ms per cell ("
                + ", ".join(f"{k} {v:.3f}" for k, v in s.doc["server_cpu_ms_per_cell_by_thread"].items())
                + f"); kernel: {', '.join(kernel_rates) or 'n/a'}; launch sizes {s.doc['launch_sizes']}"
                + (f"; issue 46's >= {CELLS_PER_S_GOAL} cells/s: {s.doc['issue_46_goal']['met']}" if on_gpu else ""))

        with Step(steps, "drain", log) as s:
            epochs = drain_epochs(run_ms)
            s.doc["task"] = f"draw 0 with epochs={epochs} (about {DRAIN_TARGET_S} s from the draw-0 run's {run_ms} ms)"
            held: dict = {}
            request_s = left(300)

            def long_post() -> None:
                try:
                    with Client(url, timeout=request_s, retries=0) as c:
                        held["answer"] = c.run(draw0_body, epochs=epochs).verify()
                except ClientError as exc:
                    held["error"] = f"{type(exc).__name__}: {exc}"

            th = threading.Thread(target=long_post, daemon=True)
            th.start()
            seen, t = False, time.perf_counter()
            in_flight_wait = left(20)
            while time.perf_counter() - t < in_flight_wait and th.is_alive():
                try:
                    busy = metric_samples(client.get("/metrics", timeout=left(5)).text)
                    seen = any(v >= 1 for _, v in busy.get("rev88_device_busy", []))
                except httpx.HTTPError:
                    pass
                if seen:
                    break
                time.sleep(0.02)
            s.check("task_in_flight_at_sigterm", seen and th.is_alive())
            t_signal = time.perf_counter()
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.2)

            try:  # the readiness probe, as an orchestrator reads it
                ready_after: int | str = httpx.get(url + "/v2/health/ready", timeout=left(5)).status_code
            except httpx.HTTPError as exc:
                ready_after = type(exc).__name__
            try:
                with service(30) as c:
                    c.run(small_bodies[1])
                new_task: dict = {"answered": 200}
            except ClientError as exc:
                new_task = {"error": type(exc).__name__, "status": exc.status, "message": exc.message}
            refused = new_task.get("status") == 503 or new_task.get("error") == ConnectionFailed.__name__
            th.join(timeout=left(request_s))
            exit_wait = left(120)
            try:
                code = proc.wait(timeout=exit_wait)
            except subprocess.TimeoutExpired:
                code = None
            held_answer = held.get("answer")
            s.doc.update({"ready_after_sigterm": ready_after, "new_task_after_sigterm": new_task,
                          "in_flight_status": 200 if held_answer is not None
                          else held.get("error", "no answer within the budget"),
                          "exit_code": code, "exit_wait_limit_s": exit_wait,
                          "seconds_signal_to_exit": time.perf_counter() - t_signal})
            s.check("in_flight_answered_200", held_answer is not None and held_answer.predictions.size == labels0.size)
            s.check("not_ready_after_sigterm", ready_after != 200)
            s.check("new_work_refused", refused)
            s.check("exited_cleanly", code in (0, -signal.SIGTERM))
    except Exception as exc:  # noqa: BLE001 - the steps that ran are kept
        report["error"] = f"{type(exc).__name__}: {exc}"
    except BaseException:  # an interrupt: the server goes at once (SIGKILL after the grace), the steps stay
        interrupted = True
        raise
    finally:
        try:
            client.close()
            stop_server(proc, common.INTERRUPT_GRACE_S if interrupted else left(20), report)
        finally:
            report["server_log_tail"] = _tail(server_log)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mnist-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path("gpu-check-out"))
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    from learner.data import bundled_mnist_dir

    result = run(args.out, args.mnist_dir or bundled_mnist_dir(), dry_run=args.dry_run)
    print(json.dumps({k: result.get(k) for k in ("passed", "seconds", "error", "missing_steps")}))
    sys.exit(0 if result["passed"] else 1)
