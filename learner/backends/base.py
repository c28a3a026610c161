"""What every backend hands back, and the interface the runner calls."""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from ..prepared import Prepared
from ..taskio import TaskArrays

__all__ = ["Backend", "Prepared", "RunOutput"]


@dataclasses.dataclass
class RunOutput:
    final_parameters: list[np.ndarray]
    final_velocity: list[np.ndarray]
    scores: np.ndarray  # (M, 10) float32
    training_prediction_seconds: float  # reset + train + predict, wall clock
    preparation_seconds: float  # backend-side setup: transfers, allocation, capture
    cuda_ms: float | None = None  # CUDA-event time of the same span, on GPU
    extra: dict | None = None  # backend facts for metadata (graph cache hits, threads, ...)
    # each query's class (int64), when the backend computed it beside the scores (the fused kernel's
    # device: the first of the highest scores, as numpy's argmax); None: learner.result computes it
    predictions: np.ndarray | None = None


class Backend(Protocol):
    name: str
    device: str  # "cpu" or "cuda:0"

    def run(self, task: TaskArrays, prepared: Prepared) -> RunOutput: ...

    def describe(self) -> dict: ...
