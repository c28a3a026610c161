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
    initial: list[np.ndarray]  # float32, in parameter order
    permutations: list[np.ndarray]  # int64, one per epoch
    cancel: CancelToken | None = None  # checked by the backend while it runs (learner.cancel)
