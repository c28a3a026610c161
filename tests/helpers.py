"""Builders the tests share (imported as ``from .helpers import ...``; conftest.py keeps only fixtures)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from learner.data import DATA_DIR

ROOT = Path(__file__).resolve().parents[1]
MNIST_DIR = DATA_DIR / "mnist"  # the repository's own copy (data/README.md)
REFERENCE_DIR = DATA_DIR / "reference"
DRAW0_SEED = 2026091400


def small_task(n: int = 19, m: int = 7, seed: int = 0):
    """A synthetic task with pixels in [0, 1] and labels 0..9."""
    from learner.taskio import validate_task

    rng = np.random.default_rng(seed)
    return validate_task(
        rng.random((n, 1, 9, 9), dtype=np.float32),
        rng.integers(0, 10, n).astype(np.int64),
        rng.random((m, 1, 9, 9), dtype=np.float32),
    )
