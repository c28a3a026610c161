"""The training loop against torch.optim.SGD on ordinary autograd, the graph program's
buffer logic on the CPU, and the reconstruction validation object."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from learner.backends.cpu import CpuBackend
from learner.backends.cuda import GraphBackend
from learner.config import make_config
from learner.model import lift
from learner.reference_check import ordinary_sgd
from learner.result import run_task
from learner.train import batch_sizes, epoch_permutations, initial_arrays, initial_parameters, prepare, train
from learner.validate import run_validation

from .helpers import small_task

TOL = dict(atol=2e-5, rtol=3e-3)


def reference_sgd(task, config):
    params, velocity, _ = ordinary_sgd(task, config)
    to_t = lambda xs: [None if x is None else torch.from_numpy(x) for x in xs]  # noqa: E731
    return to_t(params), to_t(velocity)


@pytest.mark.parametrize(
    "overrides",
    [
        {"batch_size": 8},
        {"batch_size": 16, "depth": 1},
        {"batch_size": 8, "weight_decay": 1e-3},
        {"batch_size": 7, "depth": 3, "momentum": 0.0},
    ],
)
def test_sgd_matches_torch_optim_on_ordinary_autograd(overrides):
    config = make_config({**overrides, "epochs": 2})
    task = small_task(n=19, m=7, seed=5)
    ref_params, ref_velocity = reference_sgd(task, config)
    params = [p.clone() for p in initial_parameters(config)]
    h = lift(torch.from_numpy(task.train_images))
    orders = [torch.from_numpy(p) for p in epoch_permutations(config, task.train_count)]
    velocity = train(params, h, torch.from_numpy(task.train_labels), orders, config)
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a, b, **TOL)
    for a, b in zip(velocity, ref_velocity):
        if config.momentum > 0:
            torch.testing.assert_close(a, b, **TOL)
    # and training moved the parameters (the comparison is not vacuous)
    assert any(not torch.equal(a, b) for a, b in zip(params, initial_parameters(config)))


def test_short_last_batch_included():
    assert batch_sizes(19, 8) == [8, 8, 3]
    assert batch_sizes(10000, 128)[-1] == 10000 - 78 * 128
    assert sum(batch_sizes(10000, 128)) == 10000


def test_graph_program_steps_equal_cpu_backend_bitwise():
    """The cuda backend's static-buffer program, run eagerly on the CPU, is the cpu backend."""
    config = make_config({"batch_size": 16, "depth": 2})
    task = small_task(n=45, m=11, seed=9)
    prepared = prepare(task, config)
    cpu = CpuBackend().run(task, prepared)
    graphless = GraphBackend("cpu")
    out = graphless.run(task, prepared)
    assert out.scores.tobytes() == cpu.scores.tobytes()
    for a, b in zip(out.final_parameters + out.final_velocity, cpu.final_parameters + cpu.final_velocity):
        assert a.tobytes() == b.tobytes()
    # A second task of the same shape reuses the program: only data is copied in.
    other = small_task(n=45, m=11, seed=10)
    out2 = graphless.run(other, prepare(other, config))
    cpu2 = CpuBackend().run(other, prepare(other, config))
    assert out2.extra["graph_reused"] is True and graphless.cache_hits == 1
    assert out2.scores.tobytes() == cpu2.scores.tobytes()
    # ...and the first task again gives the first answer (reset really resets).
    again = graphless.run(task, prepared)
    assert again.scores.tobytes() == cpu.scores.tobytes()


def test_one_graph_program_serves_every_seed():
    """Issue #37, 6: the seed only decides the initial parameters and the permutations (data
    copied into the static buffers), so tasks that differ in the seed reuse one program -- on a
    GPU, one capture instead of one per seed -- and each still equals the cpu backend bit for bit.
    Another learning rate is another program (its scalar is baked into the captured kernels)."""
    task = small_task(n=40, m=9, seed=4)
    backend = GraphBackend("cpu")
    for i, seed in enumerate((5, 6, 2**40 + 1)):
        config = make_config({"batch_size": 8, "seed": seed})
        out = backend.run(task, prepare(task, config))
        cpu = CpuBackend().run(task, prepare(task, config))
        assert out.extra["graph_reused"] is (i > 0)
        assert out.scores.tobytes() == cpu.scores.tobytes()
        for a, b in zip(out.final_parameters + out.final_velocity, cpu.final_parameters + cpu.final_velocity):
            assert a.tobytes() == b.tobytes()
    assert len(backend.programs) == 1 and backend.cache_hits == 2
    other = make_config({"batch_size": 8, "seed": 5, "learning_rate": 0.05})
    assert backend.run(task, prepare(task, other)).extra["graph_reused"] is False and len(backend.programs) == 2


def test_run_task_through_graph_program_metadata():
    task = small_task(n=19, m=7)
    config = make_config({"batch_size": 8})
    a = run_task(task, config, GraphBackend("cpu"))
    b = run_task(task, config, "cpu")
    assert a.metadata["final_parameter_sha256"] == b.metadata["final_parameter_sha256"]
    assert a.metadata["predictions_sha256"] == b.metadata["predictions_sha256"]


def test_divergence_is_reported():
    from learner.errors import TrainingDivergedError

    with pytest.raises(TrainingDivergedError, match="non-finite") as err:
        run_task(small_task(n=64, m=5), make_config({"learning_rate": 1e9, "batch_size": 8}), "cpu")
    assert err.value.status == 422 and err.value.details["non_finite"] == ["loss"]


@pytest.mark.parametrize("overrides, latest_step", [({"alpha": 1e30}, 0), ({"learning_rate": 1e30}, 1)])
def test_divergence_stops_at_the_first_checkpoint(overrides, latest_step):
    """The cpu backend checks every minibatch's loss: a huge alpha overflows the first forward,
    a huge step size the first update (so the second loss); either way the run of 1000 epochs
    stops in epoch 0."""
    from learner.errors import TrainingDivergedError

    task = small_task(n=64, m=5)
    config = make_config({"epochs": 1000, "batch_size": 8, **overrides})
    with pytest.raises(TrainingDivergedError, match="training diverged at epoch 0, step") as err:
        CpuBackend().run(task, prepare(task, config))
    assert err.value.details["epoch"] == 0 and err.value.details["step"] <= latest_step
    # the cuda backend's program (eager here) checks after each epoch: it stops after epoch 0
    with pytest.raises(TrainingDivergedError, match="training diverged in epoch 0") as err:
        GraphBackend("cpu").run(task, prepare(task, config))
    assert (err.value.details["epoch"], err.value.details["step"]) == (0, None)


def test_divergence_found_only_after_training_names_no_minibatch():
    from learner.backends.base import RunOutput
    from learner.errors import TrainingDivergedError
    from learner.result import check_finite

    finite = [np.zeros(3, np.float32)]
    out = RunOutput(finite, finite, np.full((2, 10), np.nan, np.float32), 0.0, 0.0)
    with pytest.raises(TrainingDivergedError, match="non-finite scores after training") as err:
        check_finite(out)
    assert err.value.details == {"non_finite": ["scores"], "epoch": None, "step": None}


def test_validation_object_matches_record_fields(run_record):
    ours = run_validation()
    ref = run_record["metadata"]["validation"]
    assert ours["passed"] is True
    assert set(ours) == set(ref) and ours["scope"] == ref["scope"]
    assert [(c["dtype"], c["depth"]) for c in ours["checks"]] == [(c["dtype"], c["depth"]) for c in ref["checks"]]
    for mine, theirs in zip(ours["checks"], ref["checks"]):
        assert set(mine) == set(theirs)
        for key in ("forward_bitwise_equal", "saved_activation_storages", "saved_activation_bytes",
                    "saved_parameter_references"):
            assert mine[key] == theirs[key], key


def test_validation_catches_a_broken_backward(monkeypatch):
    """The check can fail: break the reconstruction and it must say so."""
    import learner.model as model

    original = model.ReversibleCore.backward

    def broken(ctx, grad_z):
        grads = list(original(ctx, grad_z))
        grads[2] = grads[2] * 1.01
        return tuple(grads)

    monkeypatch.setattr(model.ReversibleCore, "backward", staticmethod(broken))
    assert run_validation()["passed"] is False


def test_validation_is_cached_once_per_process():
    from learner.validate import cached_validation

    assert cached_validation() is cached_validation()


def test_saved_bytes_per_example_is_the_endpoint():
    from learner.validate import _count_saved

    h = torch.randn(5, 82)
    weights = [torch.randn(41, 41, requires_grad=True) for _ in range(4)]
    _, storages, nbytes, refs = _count_saved(h, weights, 0.5)
    assert (storages, nbytes, refs) == (1, 5 * 328, 4)


def test_input_permutation_independent_of_task_content():
    config = make_config({})
    a = epoch_permutations(config, 19)
    b = epoch_permutations(config, 19)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("depth", [1, 2, 3, 7])
def test_the_initial_parameters_in_one_buffer_are_the_draws_of_tensors_of_their_own(depth):
    """``initial_arrays`` fills views of one buffer; the definition is tensors of their own, each
    filled in turn from one generator (nn.Linear's reset_parameters for the head): the same bytes."""
    import math

    from torch import nn

    from learner.model import CLASSES, FEATURES, WIDTH

    for seed in (0, 1, 88, 4601, 2**40 + 3, 2**63 - 1):
        gen = torch.Generator().manual_seed(seed)
        weights = [torch.empty(WIDTH, WIDTH) for _ in range(2 * depth)]
        for w in weights:
            nn.init.normal_(w, 0.0, 0.05 / math.sqrt(WIDTH), generator=gen)
        head_weight, head_bias = torch.empty(CLASSES, FEATURES), torch.empty(CLASSES)
        nn.init.kaiming_uniform_(head_weight, a=math.sqrt(5), generator=gen)
        nn.init.uniform_(head_bias, -1.0 / math.sqrt(FEATURES), 1.0 / math.sqrt(FEATURES), generator=gen)
        want = [t.numpy() for t in [*weights, head_weight, head_bias]]
        config = make_config({"seed": seed, "depth": depth})
        got = initial_arrays(config)
        assert [a.shape for a in got] == [a.shape for a in want] and all(a.dtype == np.float32 for a in got)
        assert all(a.tobytes() == b.tobytes() for a, b in zip(got, want)), seed
        assert all(t.numpy().tobytes() == b.tobytes() for t, b in zip(initial_parameters(config), want))

