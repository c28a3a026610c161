"""The reference backend: PyTorch on the CPU, eager, the training loop as written.

It stops early, between minibatches, when the task's cancel token is cancelled
(TaskCancelled) or a minibatch's loss is not finite (TrainingDivergedError)."""

from __future__ import annotations

import time

import numpy as np
import torch

from ..taskio import TaskArrays
from ..train import train_predict
from .base import Prepared, RunOutput


class CpuBackend:
    name = "cpu"
    device = "cpu"

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads
        self.notes: dict = {}  # e.g. why ``auto`` fell back to this backend
        if threads:
            torch.set_num_threads(threads)

    def describe(self) -> dict:
        return {"backend": self.name, "device": self.device, "threads": torch.get_num_threads(), **self.notes}

    def run(self, task: TaskArrays, prepared: Prepared) -> RunOutput:
        t0 = time.perf_counter()
        tr = torch.from_numpy(task.train_images)
        labels = torch.from_numpy(task.train_labels)
        te = torch.from_numpy(task.test_images)
        initial = [torch.from_numpy(p) for p in prepared.initial]
        orders = [torch.from_numpy(p) for p in prepared.permutations]
        t1 = time.perf_counter()
        params, velocity, scores = train_predict(
            tr, labels, te, initial, orders, prepared.config, cancel=prepared.cancel
        )
        t2 = time.perf_counter()
        return RunOutput(
            final_parameters=[p.numpy() for p in params],
            final_velocity=[v.numpy() for v in velocity],
            scores=np.ascontiguousarray(scores.numpy(), dtype=np.float32),
            training_prediction_seconds=t2 - t1,
            preparation_seconds=t1 - t0,
            extra={"threads": torch.get_num_threads()},
        )
