"""The hashes and the accuracy a faithful implementation reproduces exactly on CPU."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import torch

from learner.config import Config, make_config
from learner.hashing import array_sha256, named_sha256
from learner.train import epoch_permutations, initial_parameters, parameter_names

from .helpers import small_task


def test_initial_parameters_match_record(run_record):
    meta = run_record["metadata"]
    init = initial_parameters(Config())
    assert named_sha256(parameter_names(2), init) == meta["initial_parameter_sha256"]


def test_initialization_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    initial_parameters(Config())
    assert torch.equal(torch.rand(3), expected)


def test_epoch_permutations_match_record(run_record):
    perms = epoch_permutations(Config(), 10000)
    assert [p.dtype for p in perms] == [np.int64, np.int64]
    assert [array_sha256(p) for p in perms] == run_record["metadata"]["epoch_permutation_sha256"]


def test_small_task_permutations_match_api_cli_smoke(runtime_record):
    smoke = runtime_record["api_cli_smoke"]
    config = make_config(smoke["config"])
    perms = epoch_permutations(config, smoke["train_examples"])
    assert [array_sha256(p) for p in perms] == smoke["metadata"]["epoch_permutation_sha256"]
    # The initial parameters depend on the seed only, not on the task.
    assert named_sha256(parameter_names(2), initial_parameters(config)) == smoke["metadata"]["initial_parameter_sha256"]


def test_make_task_train_labels_match_record(draw0, run_record):
    task, query_labels = draw0
    assert array_sha256(task.train_labels) == run_record["metadata"]["input_hashes"]["train_labels"]
    assert task.train_images.shape == (10000, 1, 9, 9) and task.train_images.dtype == np.float32
    assert task.test_images.shape == (10000, 1, 9, 9)
    assert query_labels.shape == (10000,)


def test_draw0_cpu_scores_8887(draw0, draw0_cpu_result, run_record):
    _, query_labels = draw0
    result = draw0_cpu_result
    assert int((result.predictions == query_labels).sum()) == 8887
    meta = result.metadata
    ref = run_record["metadata"]
    assert meta["initial_parameter_sha256"] == ref["initial_parameter_sha256"]
    assert meta["epoch_permutation_sha256"] == ref["epoch_permutation_sha256"]
    assert meta["input_hashes"]["train_labels"] == ref["input_hashes"]["train_labels"]
    # Result metadata is a superset of the record's metadata keys.
    assert set(ref) <= set(meta)
    for key in ("backend", "device", "dtype", "versions", "training_prediction_seconds"):
        assert key in meta


def test_cli_make_task_run_score(mnist_dir, tmp_path):
    task = tmp_path / "task.npz"
    labels = tmp_path / "labels.npy"
    out = tmp_path / "result.json"

    def rev88(*args):
        return subprocess.run([sys.executable, "-m", "rev88", *args], capture_output=True, text=True)

    r = rev88("make-task", "--mnist-dir", str(mnist_dir), "--dataset-seed", "2026091400",
              "--output", str(task), "--labels-output", str(labels))
    assert r.returncode == 0, r.stderr
    r = rev88("run", "--input", str(task), "--backend", "cpu", "--output", str(out))
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    preds = np.load(tmp_path / "result.predictions.npy")
    assert preds.dtype == np.int64 and array_sha256(preds) == doc["predictions_sha256"]
    r = rev88("score", "--predictions", str(tmp_path / "result.predictions.npy"), "--labels", str(labels))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("8887 / 10000 correct")


def test_repeat_runs_byte_identical():
    from learner.result import run_task

    task = small_task(n=50, m=9, seed=3)
    config = make_config({"batch_size": 16})
    a = run_task(task, config, "cpu")
    b = run_task(task, config, "cpu")
    for key in ("final_parameter_sha256", "final_velocity_sha256", "state_vector_sha256",
                "predictions_sha256", "scores_sha256", "input_hashes"):
        assert a.metadata[key] == b.metadata[key], key
    assert a.scores.tobytes() == b.scores.tobytes()


def _literal_spec_init(config):
    """Issue 2's wording, literally: fork_rng, manual_seed, normal_ each weight, nn.Linear."""
    import math

    from torch import nn

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        weights = [torch.empty(41, 41) for _ in range(2 * config.depth)]
        for w in weights:
            nn.init.normal_(w, 0.0, 0.05 / math.sqrt(41))
        head = nn.Linear(82, 10)
    return weights + [head.weight.detach(), head.bias.detach()]


def test_private_generator_init_equals_the_literal_spec():
    for seed in (1, 11, 781, 2**31 + 5):
        for depth in (1, 2, 3):
            config = make_config({"seed": seed, "depth": depth})
            ours = initial_parameters(config)
            spec = _literal_spec_init(config)
            assert len(ours) == len(spec) == 2 * depth + 2
            for a, b in zip(ours, spec):
                assert a.dtype == b.dtype == torch.float32
                assert a.numpy().tobytes() == b.numpy().tobytes()
