"""Shared fixtures: the reference records, the real MNIST files, the draw-0 task."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from .helpers import DRAW0_SEED, MNIST_DIR, REFERENCE_DIR, ROOT, small_task  # noqa: F401 - ROOT, MNIST_DIR: re-exported


def gpu_tests_on_cpu() -> bool:
    """REV88_GPU_TESTS_ON_CPU=1 with TRITON_INTERPRET=1: the tests marked gpu that take the
    ``gpu_device`` fixture run their kernels in Triton's interpreter -- a rehearsal of those tests'
    own logic on a machine without a GPU (docs/gpu.md), not a GPU check."""
    import os

    return os.environ.get("REV88_GPU_TESTS_ON_CPU") == "1" and os.environ.get("TRITON_INTERPRET") == "1"


def pytest_collection_modifyitems(config, items):
    """A test marked ``gpu`` needs a CUDA GPU (pyproject.toml's markers): without one it skips,
    saying so. scripts/gpu_check_tests.py runs exactly these tests (``pytest -m gpu``) on the
    device, where none may skip."""
    marked = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not marked:
        return
    import torch

    if torch.cuda.is_available():
        return
    rehearsal = gpu_tests_on_cpu()
    skip = pytest.mark.skip(reason="marked gpu: needs a CUDA GPU, and this machine has none")
    for item in marked:
        if not (rehearsal and "gpu_device" in getattr(item, "fixturenames", ())):
            item.add_marker(skip)


@pytest.fixture
def gpu_device() -> str:
    """The device of a test marked gpu: "cuda", or "cpu" in the rehearsal (``gpu_tests_on_cpu``)."""
    return "cpu" if gpu_tests_on_cpu() else "cuda"


@pytest.fixture(scope="session", autouse=True)
def _session_data_home(tmp_path_factory):
    """Every service a test starts keeps its task ledger in a temporary folder, never in the
    user's ~/.local/share/rev88 (the default REV88_DATA_DIR is under XDG_DATA_HOME)."""
    import os

    previous = os.environ.get("XDG_DATA_HOME")
    os.environ["XDG_DATA_HOME"] = str(tmp_path_factory.mktemp("xdg-data"))
    yield
    if previous is None:
        os.environ.pop("XDG_DATA_HOME", None)
    else:
        os.environ["XDG_DATA_HOME"] = previous


@pytest.fixture(autouse=True)
def _test_data_home(tmp_path, monkeypatch):
    """... and each test's own services their own ledger."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg-data"))


def _need(path: Path, what: str) -> None:
    # The data is part of the repository: a missing file is a broken checkout, not a reason to skip.
    if not path.exists():
        pytest.fail(f"{what} not found at {path}: data/ is part of the repository (see data/README.md)")


@pytest.fixture(scope="session")
def run_record() -> dict:
    _need(REFERENCE_DIR / "rev88-run-record.json", "reference run record")
    return json.loads((REFERENCE_DIR / "rev88-run-record.json").read_text())


@pytest.fixture(scope="session")
def runtime_record() -> dict:
    _need(REFERENCE_DIR / "rev88-runtime-validation.json", "reference runtime validation record")
    return json.loads((REFERENCE_DIR / "rev88-runtime-validation.json").read_text())


@pytest.fixture(scope="session")
def mnist_dir() -> Path:
    _need(MNIST_DIR / "train-images.idx3-ubyte.gz", "MNIST training images")
    return MNIST_DIR


@pytest.fixture(scope="session")
def draw0(mnist_dir):
    """(task, held-back query labels) for dataset seed 2026091400."""
    from learner.taskio import make_task

    return make_task(mnist_dir, DRAW0_SEED)


@pytest.fixture(scope="session")
def draw0_npz(draw0, tmp_path_factory) -> Path:
    from learner.taskio import save_task

    path = tmp_path_factory.mktemp("draw0") / "task.npz"
    save_task(path, draw0[0])
    np.save(path.with_name("labels.npy"), draw0[1])
    return path


@pytest.fixture(scope="session")
def draw0_cpu_result(draw0):
    from learner.result import run_task

    return run_task(draw0[0], backend="cpu")


@pytest.fixture
def small():
    return small_task()


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    """The service's settings for each ledger: SQLite in the data dir, or a fresh PostgreSQL
    database (the module imports tests/pg.py's fixtures; short renewal and poll periods)."""
    if request.param == "sqlite":
        return {"data_dir": str(tmp_path / "data")}
    return {"data_dir": str(tmp_path / "data"), "database_url": request.getfixturevalue("pg_url"),
            "lease_renew_s": 0.2, "claim_poll_s": 0.1}
