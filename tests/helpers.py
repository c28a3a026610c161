"""Builders the tests share (imported as ``from .helpers import ...``; conftest.py keeps only fixtures)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from learner.data import DATA_DIR

ROOT = Path(__file__).resolve().parents[1]
MNIST_DIR = DATA_DIR / "mnist"  # the repository's own copy (data/README.md)
REFERENCE_DIR = DATA_DIR / "reference"
DRAW0_SEED = 2026091400
# The one factor for the few bounds a test must put on elapsed time (a notification "within a
# moment", a read that did not wait for a lock): REV88_TEST_TIME_SCALE=3 on a machine three times slower.
TIME_SCALE = float(__import__("os").environ.get("REV88_TEST_TIME_SCALE") or 1.0)


def npy_bytes(array) -> bytes:
    """``array`` as np.save writes it (a labels file, say)."""
    import io

    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def small_task(n: int = 19, m: int = 7, seed: int = 0):
    """A synthetic task with pixels in [0, 1] and labels 0..9."""
    from learner.taskio import validate_task

    rng = np.random.default_rng(seed)
    return validate_task(
        rng.random((n, 1, 9, 9), dtype=np.float32),
        rng.integers(0, 10, n).astype(np.int64),
        rng.random((m, 1, 9, 9), dtype=np.float32),
    )


# --------------------------------------------------------------------------- the tests that need a server or a browser

REQUIRE_ENV = "REV88_TEST_REQUIRE"  # comma-separated: postgres, browser (`make test` and .ci/run set both)


def required(kind: str) -> bool:
    """Whether tests of ``kind`` ("postgres", "browser") must run here: their missing parts fail
    the run instead of skipping it (REV88_TEST_REQUIRE; REV88_TEST_POSTGRES=required, the older
    switch, still counts for postgres)."""
    import os

    names = {n.strip() for n in os.environ.get(REQUIRE_ENV, "").split(",") if n.strip()}
    if kind == "postgres" and os.environ.get("REV88_TEST_POSTGRES") == "required":
        names.add("postgres")
    return kind in names or "all" in names


def unavailable(kind: str, reason: str):
    """Skip with ``reason``, or fail with it when tests of ``kind`` are required here."""
    import pytest

    if required(kind):
        pytest.fail(f"{REQUIRE_ENV} requires the {kind} tests, but {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def child_pythonpath(*first: str | Path) -> str:
    """PYTHONPATH for a child Python: ``first`` (the checkout, say), then the parent's own
    PYTHONPATH, so that a child finds what the parent found (on the GPU machine the service's
    packages come from a folder on PYTHONPATH, not from site-packages)."""
    import os

    parts = [str(p) for p in first] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys(parts))
