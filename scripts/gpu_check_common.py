"""What the sections of scripts/gpu_check.py share: versions, MNIST input check, prediction
diagnostics, the dry run's simulated meter and small tasks.

Imported by the section scripts (``scripts/`` is put on sys.path by each of them); nothing here
needs a GPU.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import math
import os
import platform
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DRAW0_SEED = 2026091400
DRAW0_CORRECT = 8887
DRAW0_PREDICTIONS_SHA256 = "37724115cb2d3242eb4a4f76d3a879ac92d729939320e5f6f2bd046bd631f200"
# What the project pins (Makefile / README) -- recorded beside what actually ran, never assumed.
PINNED = {"torch": "2.13.0", "python": "3.11"}
# Distributions whose versions the report records (the service's too: they may travel as wheels).
DISTRIBUTIONS = (
    "torch", "triton", "numpy", "nvidia-ml-py", "httpx", "prometheus-client", "anyio", "h11", "click",
    "fastapi", "starlette", "pydantic", "pydantic-core", "uvicorn", "python-multipart", "annotated-types",
    "typing-inspection", "typing-extensions", "opentelemetry-api", "annotated-doc", "httptools", "orjson", "zlib-ng",
    "jinja2",
)
# Every distribution outside the standard library that the service imports when it starts
# (`rev88 serve`: app, rev88.cli.serve, rev88.client, learner), as dist name -> import name.
# tests/test_device_packages.py measures the set in a child process and fails when this differs;
# scripts/gpu_carried.py checks that each is on the GPU image (scripts/gpu_image_packages.txt) or
# carried (scripts/device_wheels.txt); the pre-check and gpu_device_run.sh check each is importable.
SERVICE_MODULES = {
    "numpy": "numpy", "torch": "torch", "triton": "triton", "nvidia-ml-py": "pynvml",
    "fastapi": "fastapi", "starlette": "starlette", "pydantic": "pydantic", "pydantic-core": "pydantic_core",
    "annotated-types": "annotated_types", "typing-inspection": "typing_inspection",
    "typing-extensions": "typing_extensions", "annotated-doc": "annotated_doc",
    "opentelemetry-api": "opentelemetry", "uvicorn": "uvicorn", "httptools": "httptools", "anyio": "anyio",
    "idna": "idna", "click": "click", "python-multipart": "python_multipart", "httpx": "httpx",
    "prometheus-client": "prometheus_client", "jinja2": "jinja2", "markupsafe": "markupsafe",
    "orjson": "orjson", "zlib-ng": "zlib_ng", "fastapi-offline": "fastapi_offline",
    "standardwebhooks": "standardwebhooks", "tqdm": "tqdm",  # tqdm: through torch.hub (the CLI's bars besides)
}
# After an interrupt, how long a child process (the service's server) gets between SIGTERM and
# SIGKILL: well inside the 10 s that scripts/gpu_device_run.sh's `timeout -k 10` leaves Python.
INTERRUPT_GRACE_S = 5.0


def mode_name(dry_run: bool) -> str:
    return "dry-run" if dry_run else "device"


def dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict:
    """What this process runs on (never the pins: the device has its own image)."""
    import torch

    import learner  # noqa: F401  (CUBLAS_WORKSPACE_CONFIG before the CUDA queries below start CUDA)

    out: dict = {
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "distributions": {name: dist_version(name) for name in DISTRIBUTIONS},
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "cuda_available": torch.cuda.is_available(),
        "pinned": dict(PINNED),
    }
    try:
        import triton

        out["triton"] = triton.__version__
    except Exception as exc:  # noqa: BLE001 - recorded, the precheck decides
        out["triton"] = None
        out["triton_error"] = f"{type(exc).__name__}: {exc}"
    out["matches_pins"] = {
        "torch": out["torch"].split("+")[0] == PINNED["torch"],
        "python": out["python"].startswith(PINNED["python"] + "."),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        out["gpu"] = {
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "sm_count": int(props.multi_processor_count),
            "total_memory_bytes": int(props.total_memory),
            "uuid": str(getattr(props, "uuid", None)),
        }
        try:
            from learner.energy import driver_version

            out["driver"] = driver_version()
        except Exception as exc:  # noqa: BLE001
            out["driver"] = f"unreadable: {exc}"
    return out


# --------------------------------------------------------------------------- inputs


def check_mnist(mnist_dir: Path) -> dict:
    """The four MNIST files are there and draw 0 can be built from them (checksums verified)."""
    from learner.data import MNIST_SHA256, official_name
    from learner.taskio import make_task

    mnist_dir = Path(mnist_dir)
    out: dict = {"mnist_dir": str(mnist_dir)}
    if not mnist_dir.is_dir():
        return {**out, "passed": False, "error": f"MNIST folder {mnist_dir} does not exist"}
    found = {official_name(p) for p in mnist_dir.iterdir()} - {None}
    missing = sorted(set(MNIST_SHA256) - found)
    out["files_found"] = sorted(found)
    if missing:
        return {**out, "passed": False, "error": f"MNIST folder {mnist_dir} lacks {', '.join(missing)}"}
    t = time.perf_counter()
    try:
        task, labels = make_task(mnist_dir, DRAW0_SEED)
    except Exception as exc:  # noqa: BLE001 - a bad input, reported
        return {**out, "passed": False, "error": f"draw 0 could not be built: {type(exc).__name__}: {exc}"}
    out.update({"draw0_train_count": task.train_count, "draw0_test_count": task.test_count,
                "draw0_seconds": time.perf_counter() - t, "passed": True})
    return out


def small_task(task, labels, start: int, train_count: int, test_count: int):
    """Train rows start..start+train_count and query rows start..start+test_count of a task."""
    from learner.taskio import validate_task

    tr = slice(start, start + train_count)
    te = slice(start, start + test_count)
    small = validate_task(task.train_images[tr], task.train_labels[tr], task.test_images[te])
    return small, labels[te]


# --------------------------------------------------------------------------- prediction diagnostics


def _margin(row) -> float:
    """Top score minus the runner-up: how near a query is to a tie."""
    top2 = sorted((float(x) for x in row), reverse=True)[:2]
    return top2[0] - top2[1]


def prediction_diff(name_a: str, scores_a, name_b: str, scores_b, labels=None, limit: int = 50) -> dict:
    """Where two backends' predictions differ: the count, each differing query's score margin
    (top-1 minus top-2) on both sides, and each side's accuracy -- so one flipped near-tie is
    diagnosed, not guessed. Equality stays the pass; this only explains a failure."""
    import numpy as np

    pa, pb = scores_a.argmax(1), scores_b.argmax(1)
    differ = np.flatnonzero(pa != pb)
    out: dict = {"compared": f"{name_a} vs {name_b}", "queries": int(pa.size), "differing": int(differ.size)}
    if labels is not None:
        out[f"{name_a}_correct"] = int((pa == labels).sum())
        out[f"{name_b}_correct"] = int((pb == labels).sum())
        out[f"{name_a}_accuracy"] = float((pa == labels).mean())
        out[f"{name_b}_accuracy"] = float((pb == labels).mean())
    rows = []
    for i in differ[:limit]:
        row = {"query": int(i), f"{name_a}_prediction": int(pa[i]), f"{name_b}_prediction": int(pb[i]),
               f"{name_a}_margin": _margin(scores_a[i]), f"{name_b}_margin": _margin(scores_b[i]),
               "max_abs_score_difference": float(np.abs(scores_a[i] - scores_b[i]).max())}
        if labels is not None:
            row["label"] = int(labels[i])
        rows.append(row)
    out["differing_queries"] = rows
    if differ.size > limit:
        out["differing_queries_left_out"] = int(differ.size - limit)
    if differ.size:
        out["largest_margin_among_differing"] = max(max(r[f"{name_a}_margin"], r[f"{name_b}_margin"]) for r in rows)
    out["median_margin_all_queries"] = float(np.median(np.sort(scores_a, axis=1)[:, -1] - np.sort(scores_a, axis=1)[:, -2]))
    return out


def finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# --------------------------------------------------------------------------- the dry run's meter


def _simulated_meter_class():
    from learner.energy import SimulatedMeter

    class DryRunMeter(SimulatedMeter):
        """learner.energy.SimulatedMeter on the real clock, for --dry-run: power is ``idle_w``,
        plus ``busy_extra_w`` while an engine wrapped by ``BusyEngine`` runs. It stands in for
        NVML so that the energy protocol's code paths (windows, repeats, figures) run on the CPU;
        its joules are made up and say so in ``hardware()``."""

        def __init__(self, idle_w: float = 60.0, busy_extra_w: float = 140.0):
            super().__init__(idle_w=idle_w, start_s=time.perf_counter(), hardware={
                "gpu": "dry-run simulated meter (not a GPU: the joules are made up)",
                "uuid": None, "total_memory_bytes": None, "power_limit_w": None, "driver": None,
                "cuda_pci_bus_id": None, "nvml_pci_bus_id": None,
                "nvml_handle_selected_by_cuda_pci_bus_id": False, "nvml_handle_selected_by": "simulated",
            })
            self.busy_extra_w = busy_extra_w
            self._busy = 0
            self._guard = threading.RLock()

        def _catch_up(self) -> None:
            with self._guard:
                dt = time.perf_counter() - self._t
                if dt > 0:
                    self.advance(dt, self.idle_w + (self.busy_extra_w if self._busy else 0.0))
                    if len(self._updates) > 10_000:  # only the last update matters without a period
                        self._updates = self._updates[-2:]

        def energy_mj(self) -> int:
            self._catch_up()
            return super().energy_mj()

        def now(self) -> float:
            self._catch_up()
            return self._t

        def power_w(self) -> float:
            self._catch_up()
            return self.idle_w + (self.busy_extra_w if self._busy else 0.0)

        def telemetry(self) -> dict:
            return {**super().telemetry(), "power_w": self.power_w()}

        @contextlib.contextmanager
        def busy(self):
            with self._guard:
                self._catch_up()
                self._busy += 1
            try:
                yield
            finally:
                with self._guard:
                    self._catch_up()
                    self._busy -= 1

    return DryRunMeter


def dry_run_meter(**kw):
    return _simulated_meter_class()(**kw)


class BusyEngine:
    """A backend whose runs count as device work on a DryRunMeter (``run`` and ``run_many``)."""

    def __init__(self, inner, meter):
        self.inner, self.meter = inner, meter
        self.name, self.device = inner.name, inner.device
        if hasattr(inner, "tasks_per_launch"):
            self.tasks_per_launch = inner.tasks_per_launch

    def describe(self) -> dict:
        return self.inner.describe()

    def run(self, task, prepared):
        with self.meter.busy():
            return self.inner.run(task, prepared)

    def run_many(self, tasks, prepareds):
        with self.meter.busy():
            return self.inner.run_many(tasks, prepareds)


def gated_window_seconds(protocol: dict) -> float:
    """The seconds the gated protocol (learner.measure.gated) spends in its windows: two reference
    windows, the sham, the harness control (a target-length window) and the trials, each framed
    by two settles and two idle windows (app/tasks/options.measure_timeout_s counts them the same
    way). ``protocol`` names all six windows' arguments (learner.measure.gated.DEFAULTS has
    them). Sampler start, the reference matmul's preparation and the task runs outside the
    windows come on top."""
    p = protocol
    frame = 2 * (p["settle_seconds"] + p["idle_seconds"])
    return (2 * (p["reference_seconds"] + frame) + (p["sham_seconds"] + frame)
            + (p["trials"] + 1) * (p["target_seconds"] + frame))


def seconds_left(deadline: float | None, cap: float) -> float:
    """How long a wait may last: ``cap`` seconds, or fewer when the run's budget (``deadline``,
    time.monotonic) ends sooner -- never below 0.1 s, so a wait still looks once."""
    if deadline is None:
        return cap
    return max(0.1, min(cap, deadline - time.monotonic()))


def write_text(path: Path, text: str) -> None:
    """``text`` into ``path`` whole: written beside it, flushed to disk, then renamed over it, so a
    run killed at any moment leaves the last complete file (never half of one)."""
    path = Path(path)
    part = path.with_name(f".{path.name}.part")
    with open(part, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(part, path)


def write_json(path: Path, doc: dict) -> None:
    write_text(path, json.dumps(doc, indent=2, default=str) + "\n")


# --------------------------------------------------------------------------- the budget's clock and alarms


class Clock:
    """How much of the device budget is left, as the sections' budget decisions read it
    (gpu_check_energy.windows_for, gpu_check_fused.energy_trials_fit, gpu_check_tests.cap_for,
    gpu_tune.candidate_fits; the rules are scripts/gpu_budget.py's).

    On a GPU it is the real clock: ``budget_s`` from its creation. ``projected=True`` (a dry run,
    and gpu_budget.replay) it is the device clock the table projects: it stands still while the
    CPU works and advances by the table's device seconds as a section marks its parts done
    (``mark``) and as sections end (``end``). So a dry run decides what the device would decide at
    the same point, from the same figures, and can be cut the same way."""

    def __init__(self, budget_s: float, projected: bool = False, now: Callable[[], float] = time.monotonic):
        self.budget_s = float(budget_s)
        self.projected = projected
        self._now = now
        self._t0 = now()
        self._projected_s = 0.0
        self.section: str | None = None
        self._section_t0 = 0.0
        self._section_limit: float | None = None
        self._parts: list[tuple[str, float]] = []

    @classmethod
    def unbounded(cls) -> Clock:
        return cls(math.inf)

    def elapsed(self) -> float:
        return self._projected_s if self.projected else self._now() - self._t0

    def budget_left(self) -> float:
        return self.budget_s - self.elapsed()

    def start(self, section: str, limit_s: float | None) -> None:
        self.section, self._section_t0, self._section_limit, self._parts = section, self.elapsed(), limit_s, []

    def section_elapsed(self) -> float:
        return self.elapsed() - self._section_t0

    def section_left(self) -> float:
        """What is left of this section's own limit, and of the budget (the smaller)."""
        left = self.budget_left()
        if self._section_limit is not None:
            left = min(left, self._section_limit - self.section_elapsed())
        return left

    def mark(self, part: str, seconds: float | None = None) -> None:
        """The section's ``part`` is done. Projected: the clock advances by its device seconds
        (``seconds``, else gpu_budget's figure for this section's part); real: only recorded."""
        if self.projected:
            import gpu_budget

            self._projected_s += gpu_budget.part_seconds(self.section, part) if seconds is None else seconds
        self._parts.append((part, self.section_elapsed()))

    def end(self, seconds: float | None) -> None:
        """The section ended. Projected: the clock stands at its start plus ``seconds`` (what the
        table expects of what it did), or where its marks took it when that is more."""
        if self.projected and seconds is not None:
            self._projected_s = max(self._projected_s, self._section_t0 + seconds)
        self.section = None

    def parts(self) -> list[tuple[str, float]]:
        return list(self._parts)


def clock_for(clock: Clock | None, deadline: float | None) -> Clock:
    """The clock a section decides by: gpu_check.py's, else one from ``deadline`` (a section run
    alone, or by a test), else one without a budget."""
    if clock is not None:
        return clock
    if deadline is None:
        return Clock.unbounded()
    return Clock(deadline - time.monotonic())


class Interrupted(BaseException):
    """SIGTERM (``timeout`` on the device) or the run's own budget (SIGALRM): not an Exception,
    so no section swallows it; each section's cleanup (the service's child server) runs and its
    partial report is kept, and the report is still written. The run stops."""


class SectionLimit(Interrupted):
    """A section ran past its own limit (scripts/gpu_budget.py): it is stopped like an interrupt,
    keeps its partial figures, and the run goes on with the next section."""


class StepLimit(Exception):  # noqa: N818 - it is a limit, raised in the step's place
    """A step inside a section (a tuning candidate) ran past its own limit: an Exception, so the
    step's own error handling records it (the candidate is refused) and the section goes on."""


class Alarms:
    """The run's budget, a section's limit and a step's limit on one timer (SIGALRM, in the main
    thread only). SIGTERM and the budget raise Interrupted once: a second signal while the
    sections clean up is only recorded (``late``), so the cleanup and the report's writing are
    never cut short by it. A section's limit raises SectionLimit, a step's StepLimit, each once."""

    def __init__(self):
        self.run_deadline: float | None = None
        self.budget_s: float | None = None
        self.fired: str | None = None
        self.late: list[str] = []
        self.previous: dict = {}
        self._section: tuple[float, str] | None = None
        self._step: tuple[float, str] | None = None

    @property
    def armed(self) -> bool:
        return bool(self.previous)

    def arm(self, budget_s: float) -> bool:
        if threading.current_thread() is not threading.main_thread():
            return False  # signals reach only the main thread: the budget is then checked between sections
        self.budget_s = budget_s
        self.run_deadline = time.monotonic() + budget_s
        for sig in (signal.SIGTERM, signal.SIGALRM):
            self.previous[sig] = signal.signal(sig, self._on_signal)
        self._reset()
        return True

    def _reset(self) -> None:
        if not self.armed:
            return
        deadlines = [d for d in (self.run_deadline, self._section and self._section[0], self._step and self._step[0])
                     if d is not None]
        if self.fired is not None:
            deadlines = [d for d in deadlines if d != self.run_deadline]
        if not deadlines:
            signal.setitimer(signal.ITIMER_REAL, 0)
            return
        signal.setitimer(signal.ITIMER_REAL, max(min(deadlines) - time.monotonic(), 0.001))

    def _raise_run(self, why: str):
        if self.fired is None:
            self.fired = why
            self._reset()
            raise Interrupted(why)
        self.late.append(why)

    def _on_signal(self, signum, frame):
        if signum != signal.SIGALRM:
            self._raise_run(f"received {signal.Signals(signum).name}")
            return
        now = time.monotonic() + 0.002
        if self.fired is None and self.run_deadline is not None and now >= self.run_deadline:
            self._raise_run(f"the time budget of {self.budget_s:g} s ran out")
        elif self._section is not None and now >= self._section[0]:
            why = self._section[1]
            self._section = None
            self._reset()
            raise SectionLimit(why)
        elif self._step is not None and now >= self._step[0]:
            why = self._step[1]
            self._step = None
            self._reset()
            raise StepLimit(why)
        else:
            self._reset()

    @contextlib.contextmanager
    def section_limit(self, seconds: float | None, what: str):
        """The section's own limit; a no-op when the alarms are not armed or ``seconds`` is None."""
        if not self.armed or seconds is None:
            yield False
            return
        self._section = (time.monotonic() + seconds, f"{what} ran past its own limit of {seconds:.0f} s")
        self._reset()
        try:
            yield True
        finally:
            self._section = None
            self._reset()

    @contextlib.contextmanager
    def step_limit(self, seconds: float | None, what: str):
        """A step's own limit (StepLimit, an Exception, in the step's place); a no-op unarmed."""
        if not self.armed or seconds is None:
            yield False
            return
        self._step = (time.monotonic() + seconds, f"{what} ran past its own limit of {seconds:.0f} s")
        self._reset()
        try:
            yield True
        finally:
            self._step = None
            self._reset()

    def quiet(self) -> None:
        """From here on no signal raises (the final report is being written)."""
        if self.fired is None:
            self.fired = "(the sections had ended)"
        self._section = self._step = None
        self._reset()

    def disarm(self) -> None:
        if self.previous:
            signal.setitimer(signal.ITIMER_REAL, 0)
            for sig, handler in self.previous.items():
                signal.signal(sig, handler)
            self.previous = {}


@contextlib.contextmanager
def kept(report: dict, path: Path, finish=None):
    """The section's report, written to ``path`` however the block ends. On an error or an
    interrupt (gpu_check.Interrupted is a BaseException) the figures gathered so far stay in
    ``report`` -- the dict gpu_check.py passed in and keeps -- with ``passed`` false, ``partial``
    true and why it stopped; the exception goes on. ``finish(report)`` runs first in every case
    (a section's verdict and totals); it cannot turn a stopped section into a pass."""
    stopped = None
    try:
        yield report
    except BaseException as exc:
        stopped = exc
        raise
    finally:
        try:
            if finish is not None:
                finish(report)
        except BaseException as exc:  # (an interrupt that comes while the verdict is made stops it too)
            stopped = stopped or exc
            raise
        finally:
            if stopped is not None:
                report["passed"] = False
                report["partial"] = True
                key = "error" if isinstance(stopped, Exception) else "interrupted"
                report.setdefault(key, f"{type(stopped).__name__}: {stopped}")
            write_json(path, report)
