"""CUDA backend: captured graphs against independent eager autograd (needs a GPU), and its
explicit step (learner/backends/cuda.py ``ExplicitStep``) against the cpu backend, run eagerly on
the CPU (``GraphBackend("cpu")``: the same program without graphs).

The graph tests are marked ``gpu``: without a GPU they skip (tests/conftest.py); the device's
tests section (scripts/gpu_check_tests.py) runs them, scripts/gpu_check.py's cuda section the
10k/10k draws, and scripts/gpu_tune.py times the steps there.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from learner.config import make_config
from learner.reference_check import TOLERANCE, max_violation, ordinary_sgd
from learner.train import prepare

from .helpers import small_task


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.gpu  # needs a CUDA GPU: skipped without one (tests/conftest.py), run on the device's tests section
def test_graph_replay_matches_independent_eager(depth):
    import os

    from learner.backends.cuda import GraphBackend, workspace_bytes

    config = make_config({"depth": depth, "seed": 781, "batch_size": 8})
    task = small_task(n=19, m=7, seed=depth)
    backend = GraphBackend("cuda")
    out = backend.run(task, prepare(task, config))
    ref_p, ref_v, ref_scores = ordinary_sgd(task, config)
    ok_p, _ = max_violation(out.final_parameters, ref_p, **TOLERANCE)
    ok_v, _ = max_violation(out.final_velocity, ref_v, **TOLERANCE)
    assert ok_p and ok_v
    assert (out.scores.argmax(1) == ref_scores.argmax(1)).all()
    again = backend.run(task, prepare(task, config))
    assert again.extra["graph_reused"] and again.scores.tobytes() == out.scores.tobytes()
    assert all(a.tobytes() == b.tobytes() for a, b in zip(again.final_parameters, out.final_parameters))
    assert out.cuda_ms is not None and out.cuda_ms > 0
    memory = out.extra["memory"]  # what the cuBLAS workspace costs, in every answer
    assert memory["cublas_workspace_bytes_per_stream"] == workspace_bytes(os.environ["CUBLAS_WORKSPACE_CONFIG"])


def _mnist_slice(draw0, start, n, m):
    from learner.taskio import validate_task

    full = draw0[0]
    return validate_task(full.train_images[start:start + n].copy(), full.train_labels[start:start + n].copy(),
                         full.test_images[start:start + m].copy())


@pytest.mark.parametrize("step", ["explicit", "explicit-bmm"])
@pytest.mark.parametrize("overrides", [
    {"depth": 2, "batch_size": 32, "seed": 5, "epochs": 2},
    {"depth": 1, "batch_size": 40, "seed": 6, "epochs": 3, "weight_decay": 1e-3, "momentum": 0.8, "alpha": 0.7,
     "learning_rate": 0.05},
])
def test_explicit_step_matches_the_cpu_backend(draw0, step, overrides):
    """The explicit step, eagerly on the CPU: parameters and velocity within (2e-5, 3e-3) of the cpu
    backend, predictions equal, a second run of the cached program byte-identical."""
    from learner.backends.cpu import CpuBackend
    from learner.backends.cuda import GraphBackend

    task = _mnist_slice(draw0, 0, 300, 60)  # minibatches of 32 (or 40) with a short last one
    config = make_config(overrides)
    backend = GraphBackend("cpu", step=step)
    out = backend.run(task, prepare(task, config))
    ref = CpuBackend().run(task, prepare(task, config))
    ok_p, err_p = max_violation(out.final_parameters, ref.final_parameters, **TOLERANCE)
    ok_v, err_v = max_violation(out.final_velocity, ref.final_velocity, **TOLERANCE)
    assert ok_p, f"parameters off the cpu backend by up to {err_p:.3g}"
    assert ok_v, f"velocity off the cpu backend by up to {err_v:.3g}"
    np.testing.assert_array_equal(out.scores.argmax(1), ref.scores.argmax(1))
    assert out.extra["step"] == step and out.extra["precision"] == "ieee"
    again = backend.run(task, prepare(task, config))
    assert again.extra["graph_reused"]
    for a, b in zip(again.final_parameters + again.final_velocity + [again.scores],
                    out.final_parameters + out.final_velocity + [out.scores]):
        assert a.tobytes() == b.tobytes()


def test_unknown_step_is_refused():
    from learner.backends.cuda import GraphBackend

    with pytest.raises(ValueError, match="step must be one of autograd, explicit, explicit-bmm"):
        GraphBackend("cpu", step="fast")


def test_cuda_backend_computes_in_ieee_only():
    from learner.backends.cuda import GraphBackend

    backend = GraphBackend("cpu")
    assert backend.with_precision("ieee") is backend
    with pytest.raises(ValueError, match="precision 'ieee'"):
        backend.with_precision("tf32x3")


def test_workspace_bytes_and_the_one_default():
    """CUBLAS_WORKSPACE_CONFIG's cost, and the one value: learner/__init__.py sets the tuned table's."""
    from pathlib import Path

    from learner.backends.cuda import workspace_bytes
    from learner.kernels.tuned import CUBLAS_WORKSPACE

    assert workspace_bytes(":4096:8") == 32 * 1024 * 1024
    assert workspace_bytes(":16:8") == 128 * 1024
    assert workspace_bytes(":4096:2:16:8") == 2 * 4096 * 1024 + 8 * 16 * 1024
    assert workspace_bytes("4096:8") is None and workspace_bytes(":x:8") is None and workspace_bytes(None) is None
    init = (Path(__file__).resolve().parents[1] / "learner" / "__init__.py").read_text()
    assert f'os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", "{CUBLAS_WORKSPACE}")' in init


def test_the_tuned_table_knows_every_step():
    from learner.backends.cuda import STEPS
    from learner.kernels.tuned import CUDA_STEPS

    assert STEPS == CUDA_STEPS


def test_the_explicit_step_runs_about_half_the_operations(draw0):
    """Fewer kernels per step (issue #47): every non-view ATen operation a step dispatches (each a
    kernel on a GPU, cuBLAS's own around a product aside), counted on the CPU: autograd 94 per
    minibatch at depth 2, the explicit step 52."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    from learner.backends.cuda import TaskProgram
    from learner.config import Config

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view and func.overloadpacket.__name__ not in ("empty", "empty_strided", "detach", "alias"):
                self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    task = _mnist_slice(draw0, 0, 1280, 10)  # ten minibatches of 128
    config = Config(epochs=1)
    prepared = prepare(task, config)
    per_step = {}
    for step in ("autograd", "explicit", "explicit-bmm"):
        program = TaskProgram(config, task.train_count, task.test_count, torch.device("cpu"), prepared.initial, step)
        program.load(task, prepared)
        program.reset()
        program.order.copy_(program.permutations[0])
        with Count() as count:
            program.epoch()
        per_step[step] = sum(count.ops.values()) / 10
    assert per_step["explicit"] == per_step["explicit-bmm"] <= 0.6 * per_step["autograd"], per_step
