"""One task, start to finish: prepare the seed-derived inputs, run a backend,
check the outcome, and assemble the result metadata (a superset of the
reference records' ``metadata`` object)."""

from __future__ import annotations

import dataclasses
import functools
import platform
import threading
import time
from typing import Any

import numpy as np
import torch

from . import __version__
from .backends import Backend, Prepared, RunOutput, get_backend
from .cancel import CancelToken
from .cancel import check as check_cancel
from .config import Config
from .energy import driver_version
from .errors import TrainingDivergedError
from .hashing import array_sha256, named_sha256, sha256_many, state_vector
from .model import FEATURES
from .taskio import TaskArrays
from .train import parameter_count, parameter_names, prepare
from .validate import cached_validation

DESCRIPTION = {
    "fresh_initialization_per_run": True,
    "checkpoint_loaded": False,
    "normalization": "4*x-0.5 then append one zero coordinate",
    "initialization": "branch normal(0,0.05/sqrt(41)); standard torch Linear head; seed-only",
    "optimizer": "SGD momentum; zero initial velocity; gradient mean cross entropy",
    "shuffle": "independent PCG64 permutation each epoch, seed-only",
    "augmentation": "none",
}
TIMING_SCOPE = (
    "training_prediction_seconds (and cuda_ms on GPU) covers resetting parameters and velocity, "
    "normalizing raw train and query pixels, every epoch of SGD in its permutation order, and "
    "scoring all queries. preparation_seconds covers seed-derived initialization and "
    "permutations, host-to-device copies, buffer allocation and (cuda) graph capture. Neither "
    "includes reading the archive, validation, hashing or serialization."
)

_run_counts: dict[str, int] = {}
_count_lock = threading.Lock()


@dataclasses.dataclass
class TaskResult:
    predictions: np.ndarray  # (M,) int64
    scores: np.ndarray  # (M, 10) float32
    final_parameters: list[np.ndarray]
    final_velocity: list[np.ndarray]
    metadata: dict[str, Any]

    @property
    def predictions_sha256(self) -> str:
        return self.metadata["predictions_sha256"]

    @property
    def scores_sha256(self) -> str:
        return self.metadata["scores_sha256"]

    def document(self) -> dict[str, Any]:
        """The JSON document ``rev88 run`` writes (predictions go to a .npy beside it)."""
        return {
            "predictions_sha256": self.predictions_sha256,
            "scores_sha256": self.scores_sha256,
            "metadata": self.metadata,
        }


@functools.lru_cache(maxsize=1)
def _static_versions() -> dict[str, Any]:
    out: dict[str, Any] = {
        "rev88": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "cuda": torch.version.cuda,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        out["gpu_name"] = props.name
        out["gpu_uuid"] = _gpu_uuid(props)
        out["driver"] = driver_version()
    return out


def _gpu_uuid(props) -> str | None:
    uuid = getattr(props, "uuid", None)
    if uuid is None:
        return None
    text = str(uuid)
    return text if text.startswith("GPU-") else f"GPU-{text}"


def versions() -> dict[str, Any]:
    return dict(_static_versions())


def device_predictions(out: RunOutput) -> np.ndarray:
    """Each query's class: the first of its highest scores. A backend may have computed them
    where the scores were (``RunOutput.predictions``: the fused kernel's device, torch's argmax,
    which takes the first maximum as numpy's does); they must be that, of the right shape."""
    predictions = getattr(out, "predictions", None)
    if predictions is None:
        return out.scores.argmax(axis=1).astype(np.int64)
    predictions = np.asarray(predictions)
    if predictions.shape != (out.scores.shape[0],) or predictions.dtype != np.int64:
        raise ValueError(f"a backend's predictions must be int64 of shape ({out.scores.shape[0]},), got "
                         f"{predictions.dtype} {predictions.shape}")
    return predictions


def run_digests(outs: list[RunOutput]) -> list[dict[str, Any]]:
    """Every SHA-256 of each run's output that its result names -- the predictions, the scores,
    each final parameter and velocity array (in model order), the state vector -- for many runs
    in one call (``sha256_many``: a launch's buffers hashed side by side), for ``finish_task``;
    and what of each run is not finite (``non_finite``), read while its buffers are at hand."""
    items: list = []
    for out in outs:
        items += [device_predictions(out), out.scores, *out.final_parameters, *out.final_velocity,
                  list(out.final_parameters)]
    hexes = sha256_many(items)
    digests, at = [], 0
    for out in outs:
        n, m = len(out.final_parameters), len(out.final_velocity)
        digests.append({"predictions_sha256": hexes[at], "scores_sha256": hexes[at + 1],
                        "final_parameters": hexes[at + 2:at + 2 + n], "final_velocity": hexes[at + 2 + n:at + 2 + n + m],
                        "state_vector_sha256": hexes[at + 2 + n + m], "non_finite": non_finite(out)})
        at += 3 + n + m
    return digests


def non_finite(out: RunOutput) -> list[str]:
    """What of a run's output has a non-finite entry: "scores", "parameters", "velocity"."""
    return [name for name, values in (("scores", out.scores), ("parameters", state_vector(out.final_parameters)),
                                      ("velocity", state_vector(out.final_velocity)))
            if not np.isfinite(values).all()]


def check_finite(out: RunOutput, problems: list[str] | None = None) -> None:
    """After training: every score, parameter and velocity entry finite. (Backends stop at
    the first non-finite loss they see, with the epoch and step; this catches the rest, and
    everything on the fused backend, which checks only here.) ``problems``: ``non_finite(out)``,
    when the caller has it already (``run_digests`` finds it)."""
    problems = non_finite(out) if problems is None else problems
    if problems:
        raise TrainingDivergedError(
            f"training diverged: non-finite {', '.join(problems)} after training "
            "(try a smaller learning_rate)",
            non_finite=problems,
            epoch=None,
            step=None,
        )


def run_task(
    task: TaskArrays,
    config: Config | None = None,
    backend: str | Backend = "auto",
    cancel: CancelToken | None = None,
) -> TaskResult:
    """Train fresh on ``task`` and predict its queries; every path (CLI, service) calls this.

    ``cancel``: a ``learner.cancel.CancelToken`` another thread may cancel; the run then
    raises ``learner.errors.TaskCancelled`` at the backend's next check.
    """
    config = config or Config()
    engine = get_backend(backend) if isinstance(backend, str) else backend
    cached_validation()  # computed once per process, before the first run
    t0 = time.perf_counter()
    prepared = prepare(task, config, cancel)
    host_prep = time.perf_counter() - t0
    check_cancel(cancel, 0, 0)
    out = engine.run(task, prepared)
    return finish_task(task, config, engine, prepared, out, host_prep)


def finish_task(
    task: TaskArrays,
    config: Config,
    engine: Backend,
    prepared: Prepared,
    out: RunOutput,
    host_prep: float,
    tasks_in_launch: int | None = None,
    digests: dict[str, Any] | None = None,
) -> TaskResult:
    """Check one task's run output and assemble its result and metadata.

    Shared by ``run_task`` (one task, ``engine.run``) and batched launches
    (``engine.run_many``: one ``out`` per task; ``tasks_in_launch`` then says how many
    tasks shared the launch and is recorded in the metadata). ``host_prep`` is this
    task's own host-side preparation time (``prepare``). ``digests``: the run's SHA-256s
    (``run_digests``; made here when not given), computed elsewhere beforehand -- a launch hashes its runs' buffers side by
    side on a pool of threads (GIL-free) and finishes its tasks on one (the rest is Python, which
    threads would only pass the GIL back and forth for).
    """
    validation = cached_validation()
    # a cancelled task gets no result, even when its run had just finished (on the fused
    # backend this is where a task cancelled during its launch is dropped)
    check_cancel(prepared.cancel, config.epochs, 0, config.epochs)
    if digests is None:  # (a lone run: hashed here, one buffer at a time -- sha256_many's choice)
        digests = run_digests([out])[0]
    check_finite(out, digests["non_finite"])
    predictions = device_predictions(out)
    with _count_lock:
        _run_counts[engine.name] = _run_counts.get(engine.name, 0) + 1
        run_count = _run_counts[engine.name]
    names = parameter_names(config.depth)
    metadata: dict[str, Any] = {
        "config": config.as_dict(),
        "parameter_count": parameter_count(config.depth),
        "train_count": task.train_count,
        "test_count": task.test_count,
        **DESCRIPTION,
        "input_hashes": task.input_hashes(),  # computed once per task, by load_task where it came from an npz
        "epoch_permutation_sha256": (list(prepared.permutation_sha256) if prepared.permutation_sha256 is not None
                                     else [array_sha256(p) for p in prepared.permutations]),
        "initial_parameter_sha256": (dict(prepared.initial_sha256) if prepared.initial_sha256 is not None
                                     else named_sha256(names, prepared.initial)),
        "final_parameter_sha256": dict(zip(names, digests["final_parameters"], strict=True)),
        "final_velocity_sha256": dict(zip(names, digests["final_velocity"], strict=True)),
        "state_vector_sha256": digests["state_vector_sha256"],
        "predictions_sha256": digests["predictions_sha256"],
        "scores_sha256": digests["scores_sha256"],
        "preparation_seconds": host_prep + out.preparation_seconds,
        "training_prediction_seconds": out.training_prediction_seconds,
        "run_count": run_count,
        "validation": validation,
        "reversible_core": True,
        "retained_core_states": 1,
        "core_saved_bytes_per_example": FEATURES * 4,
        "head_reversible": False,
        "input_lift_injective": True,
        "timing_scope": TIMING_SCOPE,
        "backend": engine.name,
        "device": engine.device,
        "dtype": "float32",
        # the products' precision: "ieee" (fp32) unless the backend says otherwise (fused: tf32x3)
        "precision": (out.extra or {}).get("precision", "ieee"),
        "versions": versions(),
    }
    if tasks_in_launch is not None:
        metadata["tasks_in_launch"] = tasks_in_launch
    if out.cuda_ms is not None:
        metadata["cuda_ms"] = out.cuda_ms
    if out.extra:
        metadata["backend_details"] = out.extra
    return TaskResult(predictions, out.scores, out.final_parameters, out.final_velocity, metadata)
