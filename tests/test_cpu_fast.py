"""The cpu-fast backend against the cpu backend: same predictions on MNIST draw 0, parameters
and velocity within float32-rounding tolerance on several configs, byte-identical repeats,
the same metadata, and the registry's ``auto`` choice with its self-check."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from learner import backends
from learner.backends import cpu_fast
from learner.backends.cpu import CpuBackend
from learner.backends.cpu_fast import CpuFastBackend, compare_outputs, configured_threads
from learner.config import Config
from learner.errors import TrainingDivergedError
from learner.result import run_task
from learner.train import prepare

from .helpers import small_task

TOLERANCE = {"atol": 2e-5, "rtol": 3e-3}

if not cpu_fast.kernel_available():  # the install must build it: a missing kernel is a defect
    pytest.fail(cpu_fast.KERNEL_ERROR or "cpu-fast kernel missing", pytrace=False)


def assert_close_to_cpu(fast, ref):
    for what, a, b in (
        ("parameters", fast.final_parameters, ref.final_parameters),
        ("velocity", fast.final_velocity, ref.final_velocity),
    ):
        assert len(a) == len(b)
        for i, (x, y) in enumerate(zip(a, b)):
            assert x.dtype == np.float32 and x.shape == y.shape, (what, i)
            np.testing.assert_allclose(x, y, **TOLERANCE, err_msg=f"{what}[{i}]")
    np.testing.assert_allclose(fast.scores, ref.scores, atol=1e-4, rtol=3e-3)


def run_both(task, config, threads=1, isa="auto"):
    prepared = prepare(task, config)
    return CpuFastBackend(threads=threads, isa=isa).run(task, prepared), CpuBackend().run(task, prepared)


# every compiled variant this CPU runs (generic, and x86-64-v3 where the CPU has AVX2 + FMA)
VARIANTS = cpu_fast._kernel.variants()


# ---------------------------------------------------------------------------- MNIST draw 0


@pytest.fixture(scope="module")
def draw0_fast_result(draw0):
    return run_task(draw0[0], backend="cpu-fast")


def test_draw0_predictions_equal_cpu(draw0, draw0_cpu_result, draw0_fast_result):
    _, query_labels = draw0
    fast = draw0_fast_result
    np.testing.assert_array_equal(fast.predictions, draw0_cpu_result.predictions)
    assert int((fast.predictions == query_labels).sum()) == 8887
    assert fast.predictions_sha256 == draw0_cpu_result.predictions_sha256


def test_draw0_generic_variant_predictions_equal_cpu(draw0, draw0_cpu_result):
    """The portable variant (what a CPU without AVX2 + FMA runs) on the whole task."""
    task = draw0[0]
    out = CpuFastBackend(isa="generic").run(task, prepare(task, Config()))
    np.testing.assert_array_equal(out.scores.argmax(axis=1), draw0_cpu_result.predictions)


def test_draw0_parameters_and_velocity_close_to_cpu(draw0_cpu_result, draw0_fast_result):
    assert_close_to_cpu(draw0_fast_result, draw0_cpu_result)


def test_same_metadata_keys_as_cpu(draw0_cpu_result, draw0_fast_result):
    fast, ref = draw0_fast_result.metadata, draw0_cpu_result.metadata
    assert set(fast) == set(ref)
    assert fast["backend"] == "cpu-fast" and fast["device"] == "cpu"
    assert set(fast["backend_details"]) >= {"threads"}
    # everything derived from the seed and the inputs alone is identical
    for key in ("config", "input_hashes", "epoch_permutation_sha256", "initial_parameter_sha256",
                "parameter_count", "train_count", "test_count"):
        assert fast[key] == ref[key], key


# ---------------------------------------------------------------------------- configs


CONFIGS = {
    "depth1": Config(depth=1, batch_size=32),
    "depth2_short_last_batch": Config(depth=2, batch_size=48),  # 150 = 3*48 + 6
    "weight_decay": Config(depth=2, batch_size=40, weight_decay=5e-3),
    "momentum0": Config(depth=2, batch_size=64, momentum=0.0),
    "alpha_lr_seed": Config(depth=3, alpha=0.3, learning_rate=0.05, seed=5, epochs=3, batch_size=50),
    "batch_over_n": Config(depth=2, batch_size=1000),
}


@pytest.mark.parametrize("isa", VARIANTS)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_parameters_and_velocity_close_to_cpu(name, isa):
    fast, ref = run_both(small_task(150, 23, seed=3), CONFIGS[name], isa=isa)
    assert fast.extra["isa"] == isa
    assert_close_to_cpu(fast, ref)


def test_tiny_task_close_to_cpu(small):
    fast, ref = run_both(small, Config())
    assert_close_to_cpu(fast, ref)


@pytest.mark.parametrize("isa", VARIANTS)
def test_repeat_runs_and_thread_counts_byte_identical(isa):
    task = small_task(300, 41, seed=8)
    prepared = prepare(task, Config(batch_size=32, weight_decay=1e-3))
    runs = [CpuFastBackend(threads=t, isa=isa).run(task, prepared) for t in (1, 1, 2, 3)]
    first = runs[0]
    for other in runs[1:]:
        assert other.scores.tobytes() == first.scores.tobytes()
        for a, b in zip(other.final_parameters + other.final_velocity, first.final_parameters + first.final_velocity):
            assert a.tobytes() == b.tobytes()


def test_run_task_repeat_hashes_identical():
    task = small_task(120, 30, seed=4)
    a = run_task(task, Config(batch_size=16), backend="cpu-fast").metadata
    b = run_task(task, Config(batch_size=16), backend="cpu-fast").metadata
    for key in ("final_parameter_sha256", "final_velocity_sha256", "scores_sha256", "predictions_sha256"):
        assert a[key] == b[key], key


def test_prepared_inputs_are_not_modified():
    task = small_task(64, 9, seed=2)
    prepared = prepare(task, Config(batch_size=16))
    before = [p.copy() for p in prepared.initial] + [p.copy() for p in prepared.permutations]
    CpuFastBackend().run(task, prepared)
    after = list(prepared.initial) + list(prepared.permutations)
    assert all(np.array_equal(x, y) for x, y in zip(before, after))


def test_divergence_reported_like_cpu():
    task = small_task(80, 10, seed=6)
    config = Config(learning_rate=1e4, batch_size=16)
    with pytest.raises(TrainingDivergedError) as ref:
        run_task(task, config, backend="cpu")
    with pytest.raises(TrainingDivergedError) as fast:
        run_task(task, config, backend="cpu-fast")
    # both stop early, at the same minibatch here (the cpu backend at its first non-finite loss,
    # cpu-fast when that minibatch leaves the head bias non-finite)
    assert (fast.value.details["epoch"], fast.value.details["step"]) == (
        ref.value.details["epoch"], ref.value.details["step"])
    assert fast.value.details["epoch"] == 0


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("overrides, latest_step", [({"alpha": 1e30}, 0), ({"learning_rate": 1e30}, 1)])
def test_divergence_stops_at_the_first_checkpoint(overrides, latest_step, threads):
    """A huge alpha overflows the first forward; a huge step size, the first update, so the
    second minibatch's scores: both stop there, in epoch 0 of 1000."""
    task = small_task(150, 23, seed=1)
    config = Config(epochs=1000, batch_size=16, **overrides)
    with pytest.raises(TrainingDivergedError, match="at epoch 0, step") as err:
        CpuFastBackend(threads=threads).run(task, prepare(task, config))
    assert err.value.details["epoch"] == 0 and err.value.details["step"] <= latest_step


@pytest.mark.parametrize("depth", [1, 3])
def test_diverging_runs_stay_memory_safe_and_thread_independent(depth):
    """Overflow to inf/NaN must neither crash the kernel nor depend on the thread count
    (padding lanes turn NaN once inf*0 appears; the kernel must never count them): every
    thread count stops at the same minibatch."""
    task = small_task(150, 23, seed=depth)
    for lr in (1e2, 1e8):
        prepared = prepare(task, Config(depth=depth, learning_rate=lr, batch_size=7, weight_decay=1e-3))
        stops = []
        for threads in (1, 2, 3):
            with pytest.raises(TrainingDivergedError) as err:
                CpuFastBackend(threads=threads).run(task, prepared)
            stops.append((err.value.details["epoch"], err.value.details["step"]))
        assert len(set(stops)) == 1, stops


def test_auto_variant_is_the_best_this_cpu_runs():
    assert VARIANTS[0] == "generic"
    assert cpu_fast._kernel.isa() == VARIANTS[-1]
    assert CpuFastBackend().describe()["isa"] == VARIANTS[-1]
    with pytest.raises(ValueError, match="isa must be 'auto' or one of"):
        CpuFastBackend(isa="avx512")


# ---------------------------------------------------------------------------- threads, errors


def test_threads_from_argument_and_environment(monkeypatch):
    monkeypatch.delenv("REV88_THREADS", raising=False)
    assert configured_threads() == 1
    assert configured_threads(2) == 2
    monkeypatch.setenv("REV88_THREADS", "2")
    assert configured_threads() == 2
    assert CpuFastBackend().describe()["threads"] == 2
    monkeypatch.setenv("REV88_THREADS", "many")
    with pytest.raises(ValueError, match="REV88_THREADS"):
        configured_threads()
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="threads"):
            configured_threads(bad)


def test_kernel_rejects_bad_buffers_by_name():
    from learner.backends import _cpu_fast as kernel

    n, m, depth = 4, 2, 1
    nparams = 2 * depth * 41 * 41 + 10 * 82 + 10
    good = dict(
        train_x=np.zeros((n, 81), np.float32), labels=np.zeros(n, np.int64), perms=np.zeros((1, n), np.int64),
        test_x=np.zeros((m, 81), np.float32), params=np.zeros(nparams, np.float32),
        velocity=np.zeros(nparams, np.float32), scores=np.zeros((m, 10), np.float32),
    )

    def call(isa="auto", cancel=None, progress=None, **changes):
        a = {**good, **changes}
        return kernel.train_predict(a["train_x"], a["labels"], a["perms"], a["test_x"], a["params"],
                                    a["velocity"], a["scores"], n, m, 1, 2, depth, 0.5, 0.1, 0.9, 0.0, 1, isa,
                                    cancel, progress)

    assert call() == (kernel.isa(), "completed", 1, 0)
    assert call("generic")[0] == "generic"
    progress = np.zeros(1, np.int64)
    assert call(cancel=np.zeros(1, np.int32), progress=progress)[1:] == ("completed", 1, 0)
    assert progress[0] == 2  # two minibatches of 2 rows
    assert call(cancel=np.ones(1, np.int32))[1:] == ("cancelled", 0, 0)
    with pytest.raises(ValueError, match="cancel must be int32"):
        call(cancel=np.zeros(1, np.int64))
    with pytest.raises(ValueError, match="cancel must hold 1 items"):
        call(cancel=np.zeros(2, np.int32))
    with pytest.raises(ValueError, match="progress must be a C-contiguous writable"):
        frozen_progress = np.zeros(1, np.int64)
        frozen_progress.setflags(write=False)
        call(progress=frozen_progress)
    with pytest.raises(ValueError, match="isa must be 'auto', 'generic'"):
        call("sse9")
    with pytest.raises(ValueError, match="labels must be int64"):
        call(labels=np.zeros(n, np.float64))
    with pytest.raises(ValueError, match="params must hold"):
        call(params=np.zeros(nparams - 1, np.float32))
    with pytest.raises(ValueError, match="labels\\[1\\] = 12"):
        call(labels=np.array([0, 12, 0, 0], np.int64))
    with pytest.raises(ValueError, match="permutation entry"):
        call(perms=np.array([[0, 1, 2, 4]], np.int64))
    with pytest.raises(ValueError, match="scores must be a C-contiguous writable"):
        call(scores=np.zeros((10, m), np.float32).T)
    frozen = np.zeros(nparams, np.float32)
    frozen.setflags(write=False)
    with pytest.raises(ValueError, match="velocity must be a C-contiguous writable"):
        call(velocity=frozen)


# ---------------------------------------------------------------------------- registry


def test_registry_lists_and_creates_cpu_fast():
    assert "cpu-fast" in backends.NAMES
    engine = backends.get_backend("cpu-fast")
    assert engine.name == "cpu-fast" and engine is backends.get_backend("cpu-fast")
    assert engine.describe()["isa"]


def test_self_check_passes_and_compare_flags_differences():
    ok, reason = cpu_fast.cpu_fast_ready()
    assert ok, reason
    task, config = cpu_fast.self_check_task()
    fast, ref = run_both(task, config)
    assert compare_outputs(fast, ref) == []
    fast.final_parameters[0][0, 0] += 1e-3
    assert compare_outputs(fast, ref) == ["parameters[0] differs (max abs diff 0.001)"]


def test_auto_picks_cpu_fast_without_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert backends.resolve("auto") == "cpu-fast"
    assert backends.get_backend("auto").name == "cpu-fast"


def test_auto_falls_back_to_cpu_and_says_why(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cpu_fast, "_check_result", (False, "cpu-fast self-check disagrees (test)"))
    assert backends.resolve("auto") == "cpu"
    engine = backends.get_backend("auto")
    assert engine.name == "cpu"
    assert engine.describe()["auto_fallback_reason"] == "cpu-fast self-check disagrees (test)"
    engine.notes.pop("auto_fallback_reason", None)
