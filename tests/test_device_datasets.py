"""A launch's data in and out on the fused backend (issue #46), on the host's side -- no kernel runs here
(tests/test_fused.py runs the kernels in triton's interpreter): datasets kept per device
(learner/backends/device_datasets.py, an LRU bounded by bytes), the per-task inputs packed into one
buffer and copied once, the outputs in one buffer brought back once, and the predictions taken on the
device as numpy's argmax takes them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from learner.backends import device_datasets
from learner.backends.device_datasets import DeviceDatasets, dataset_key, stage
from learner.taskio import validate_task

from .helpers import small_task

CPU = torch.device("cpu")


def _copy(task):
    """Another TaskArrays object with the same contents (a dataset uploaded twice)."""
    return validate_task(task.train_images.copy(), task.train_labels.copy(), task.test_images.copy())


def test_a_staged_dataset_is_the_kernels_layout_in_memory_of_its_own():
    task = small_task(30, 7, seed=1)
    r = stage(task, CPU)
    assert r.train.shape == (30, 81) and r.train.dtype == torch.float32
    assert r.labels.shape == (30,) and r.labels.dtype == torch.int32
    assert r.test.shape == (7, 81) and r.test.dtype == torch.float32
    assert r.train.numpy().tobytes() == task.train_images.tobytes()
    assert r.test.numpy().tobytes() == task.test_images.tobytes()
    np.testing.assert_array_equal(r.labels.numpy(), task.train_labels)
    assert not np.shares_memory(r.train.numpy(), task.train_images)
    assert not np.shares_memory(r.test.numpy(), task.test_images)
    assert r.nbytes == 30 * 81 * 4 + 30 * 4 + 7 * 81 * 4


def test_datasets_are_kept_by_content_and_bounded_by_bytes_per_device():
    a, b, c = (small_task(30, 7, seed=s) for s in (1, 2, 3))
    one = stage(a, CPU).nbytes
    kept = DeviceDatasets(max_bytes=2 * one)
    ra, staged = kept.get(a, CPU)
    assert staged
    again, staged = kept.get(_copy(a), CPU)  # equal contents, another object: the same kept copy
    assert again is ra and not staged
    kept.get(b, CPU)
    kept.get(a, CPU)  # a used last: b is the oldest
    kept.get(c, CPU)  # over the bound: b out
    snap = kept.snapshot(CPU)
    assert (snap["datasets"], snap["bytes"], snap["evictions"]) == (2, 2 * one, 1)
    assert kept.get(a, CPU) == (ra, False)
    rb, staged = kept.get(b, CPU)  # evicted: staged again, the same values
    assert staged and rb.train.numpy().tobytes() == b.train_images.tobytes()
    assert kept.snapshot(CPU)["stagings"] == 4 and kept.snapshot(CPU)["hits"] == 3
    assert kept.snapshot("meta")["datasets"] == 0  # the bound and the datasets are per device
    kept.resize(one)
    assert kept.snapshot(CPU)["datasets"] == 1
    kept.resize(one - 1)  # larger than the whole bound: staged for the launch, not kept
    r, staged = kept.get(a, CPU)
    assert staged and kept.snapshot(CPU)["datasets"] == 0 and kept.snapshot(CPU)["not_kept"] == 1
    assert r.train.numpy().tobytes() == a.train_images.tobytes()


def test_the_key_is_the_three_arrays_hashes():
    a = small_task(30, 7, seed=1)
    h = a.input_hashes()
    assert dataset_key(a) == (h["train_images"], h["train_labels"], h["test_images"])
    other_labels = validate_task(a.train_images.copy(), (a.train_labels + 1) % 10, a.test_images.copy())
    assert dataset_key(other_labels) != dataset_key(a)


def test_configure_bounds_the_process_datasets_and_refuses_a_negative_bound():
    before = device_datasets.datasets.max_bytes
    try:
        device_datasets.configure(1234)
        assert device_datasets.datasets.max_bytes == 1234
        with pytest.raises(ValueError, match=">= 0 bytes"):
            device_datasets.configure(-1)
    finally:
        device_datasets.configure(before)


def test_the_setting_reaches_the_learner(tmp_path):
    from app.service import Service
    from app.settings import Settings, SettingsError

    assert Settings().device_dataset_bytes == device_datasets.DEFAULT_BYTES == 2 << 30
    assert Settings.from_env({"REV88_DEVICE_DATASET_BYTES": "4096"}).device_dataset_bytes == 4096
    with pytest.raises(SettingsError, match="REV88_DEVICE_DATASET_BYTES must be >= 0 bytes"):
        Settings.from_env({"REV88_DEVICE_DATASET_BYTES": "-1"})
    before = device_datasets.datasets.max_bytes
    try:
        Service(Settings(backend="cpu", data_dir=str(tmp_path), device_dataset_bytes=4321))
        assert device_datasets.datasets.max_bytes == 4321
    finally:
        device_datasets.configure(before)


# --------------------------------------------------------------------------- a launch's data


@pytest.fixture
def fused_helpers():
    pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
    from learner.backends import fused

    return fused


@pytest.fixture
def fresh_datasets(monkeypatch):
    kept = DeviceDatasets()
    monkeypatch.setattr(device_datasets, "datasets", kept)
    return kept


def test_a_launch_of_one_dataset_reads_the_kept_copy_itself(fused_helpers, fresh_datasets):
    task = small_task(30, 7, seed=1)
    tasks = [task, _copy(task), task]
    data, rows, staged = fused_helpers.launch_datasets(tasks, CPU)
    kept, _ = fresh_datasets.get(task, CPU)
    assert rows == [0, 0, 0] and staged == 1
    assert data["train"].shape == (1, 30, 81) and data["train"].data_ptr() == kept.train.data_ptr()
    assert data["labels"].data_ptr() == kept.labels.data_ptr() and data["test"].data_ptr() == kept.test.data_ptr()
    _, _, staged = fused_helpers.launch_datasets(tasks, CPU)
    assert staged == 0


def test_a_launch_of_several_datasets_stacks_each_once(fused_helpers, fresh_datasets):
    a, b = small_task(30, 7, seed=1), small_task(30, 7, seed=2)
    data, rows, staged = fused_helpers.launch_datasets([a, b, _copy(a), b], CPU)
    assert rows == [0, 1, 0, 1] and staged == 2
    assert data["train"].shape == (2, 30, 81) and data["test"].shape == (2, 7, 81)
    assert data["train"][1].numpy().tobytes() == b.train_images.tobytes()
    np.testing.assert_array_equal(data["labels"][0].numpy(), a.train_labels)


def test_a_launch_inputs_are_one_buffer_copied_once(fused_helpers):
    from learner.config import make_config
    from learner.kernels.fused_parts import pack_state, state_size
    from learner.train import prepare

    task = small_task(30, 7, seed=1)
    prepareds = [prepare(task, make_config({"seed": s, "epochs": 3, "depth": 1})) for s in (5, 6)]
    calls = []
    real_to = torch.Tensor.to

    def counting_to(self, *args, **kwargs):
        calls.append((tuple(self.shape), args, kwargs))
        return real_to(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "to", counting_to)
        inputs = fused_helpers.launch_inputs(prepareds, [0, 0], 3, 30, 1, CPU)
    assert len(calls) == 1 and calls[0][2] == {"non_blocking": True}  # the one copy of the one buffer
    storage = {v.untyped_storage().data_ptr() for v in inputs.values()}
    assert len(storage) == 1
    base = inputs["index"].data_ptr()
    assert all((v.data_ptr() - base) % fused_helpers.ALIGN == 0 for v in inputs.values())
    assert inputs["index"].tolist() == [0, 0] and inputs["index"].dtype == torch.int32
    assert inputs["perms"].shape == (2, 3, 30) and inputs["perms"].dtype == torch.int32
    assert inputs["init"].shape == (2, state_size(1)) and inputs["init"].dtype == torch.float32
    for i, prep in enumerate(prepareds):
        np.testing.assert_array_equal(inputs["perms"][i].numpy(), np.stack(prep.permutations))
        assert inputs["init"][i].numpy().tobytes() == pack_state(prep.initial, 1).tobytes()


def test_a_launch_outputs_are_one_buffer_brought_back_once(fused_helpers):
    out = fused_helpers.LaunchOutputs(3, 5, 40, CPU)
    views = (out.predictions, out.params, out.velocity, out.scores)
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1
    assert all((v.data_ptr() - out.buffer.data_ptr()) % fused_helpers.ALIGN == 0 for v in views)
    rng = np.random.default_rng(7)
    scores = rng.integers(0, 3, (3, 5, 10)).astype(np.float32)  # many ties
    out.scores.copy_(torch.from_numpy(scores))
    out.params.copy_(torch.from_numpy(rng.random((3, 40), dtype=np.float32)))
    predictions, params, velocity, got = out.bring_back()
    assert predictions.dtype == np.int64 and predictions.shape == (3, 5)
    np.testing.assert_array_equal(predictions, scores.argmax(axis=2))
    assert got.tobytes() == scores.tobytes() and params.tobytes() == out.params.numpy().tobytes()
    raw = out.buffer.numpy()
    assert all(np.shares_memory(a, raw) for a in (predictions, params, velocity, got))


def test_the_device_argmax_takes_the_first_maximum_as_numpy_does(fused_helpers):
    rng = np.random.default_rng(46)
    scores = rng.integers(-2, 2, (50, 40, 10)).astype(np.float32)  # ties in most rows
    scores[0, 0] = [0.0, -0.0, 0.0, -1, -1, -1, -1, -1, -1, -1]  # -0.0 == 0.0: the first
    scores[0, 1] = [-0.0, 0.0, -1, -1, -1, -1, -1, -1, -1, -1]
    scores[0, 2] = [1, np.inf, 2, np.inf, 0, 0, 0, 0, 0, 0]
    scores[0, 3] = -np.inf
    scores[0, 4] = 3.0  # all ten equal
    got = fused_helpers.device_argmax(torch.from_numpy(scores))
    assert got.dtype == torch.int64
    np.testing.assert_array_equal(got.numpy(), scores.argmax(axis=2))
    assert got[0, :5].tolist() == [0, 0, 1, 0, 0]


def test_the_result_takes_the_backends_predictions_only_when_they_are_well_formed():
    from learner.backends import RunOutput
    from learner.result import device_predictions

    scores = np.zeros((4, 10), dtype=np.float32)
    scores[:, 3] = 1
    out = RunOutput([], [], scores, 0.0, 0.0, predictions=np.full(4, 3, dtype=np.int64))
    assert device_predictions(out) is out.predictions
    with pytest.raises(ValueError, match="int64 of shape"):
        device_predictions(RunOutput([], [], scores, 0.0, 0.0, predictions=np.full(4, 3, dtype=np.int32)))
