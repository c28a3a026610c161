"""The seed-derived inputs of one task (``learner.train.prepare`` makes them; every backend takes them)."""

from __future__ import annotations

import dataclasses

import numpy as np

from .cancel import CancelToken
from .config import Config


@dataclasses.dataclass
class Prepared:
    """Seed-derived inputs every backend shares (computed once per task by the runner)."""

    config: Config
    initial: list[np.ndarray]  # float32, in parameter order (shared: a backend copies, never writes them)
    permutations: list[np.ndarray]  # int64, one per epoch (shared, likewise)
    cancel: CancelToken | None = None  # checked by the backend while it runs (learner.cancel)
    # their SHA-256s when known (kept with them by learner.seed_state): the result's metadata takes them
    initial_sha256: dict[str, str] | None = None
    permutation_sha256: list[str] | None = None
