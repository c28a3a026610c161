"""The data bundled with the repository (``data/`` at the top of a checkout).

``data/mnist/`` holds the four official MNIST files (gzip IDX) and ``data/reference/`` the
two reference records of the original learner. Nothing here downloads anything: tests,
benchmarks, scripts and the CLI read these files, and every MNIST file read through
:func:`learner.taskio.read_idx` is checked against the SHA-256 of its official IDX payload.
"""

from __future__ import annotations

import os
from pathlib import Path

# A checkout: <root>/learner/data.py -> <root>/data
DATA_DIR = Path(__file__).resolve().parents[1] / "data"
MNIST_ENV = "REV88_MNIST_DIR"

# SHA-256 of the *uncompressed* official IDX payloads (the same bytes whether a file is
# stored gzipped or not). Keys are the official names; ``-idx`` spellings map onto them.
MNIST_SHA256 = {
    "train-images.idx3-ubyte": "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
    "train-labels.idx1-ubyte": "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
    "t10k-images.idx3-ubyte": "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
    "t10k-labels.idx1-ubyte": "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
}

RUN_RECORD = "rev88-run-record.json"
RUNTIME_RECORD = "rev88-runtime-validation.json"


def official_name(path: str | Path) -> str | None:
    """``train-images-idx3-ubyte.gz`` -> ``train-images.idx3-ubyte``; None if not an MNIST file name."""
    name = Path(path).name
    if name.endswith(".gz"):
        name = name[:-3]
    name = name.replace("-idx", ".idx")
    return name if name in MNIST_SHA256 else None


def bundled_mnist_dir() -> Path:
    """The MNIST folder to use when none is named: ``$REV88_MNIST_DIR``, else the checkout's ``data/mnist``."""
    env = os.environ.get(MNIST_ENV)
    return Path(env) if env else DATA_DIR / "mnist"


def reference_dir() -> Path:
    return DATA_DIR / "reference"
