"""The CUDA backend: GPU-resident data, the whole task replayed from CUDA graphs.

A ``TaskProgram`` owns static buffers for one (train shape, query shape,
config) and three step functions that allocate nothing outside autograd and
never synchronize with the host:

    reset()    parameters <- initial, velocity <- 0, lift raw train and query pixels
    epoch()    every minibatch of one epoch, in the order held by the resident ``order`` buffer
    predict()  query scores into the static ``scores`` buffer

On CUDA each step is captured once into a ``torch.cuda.CUDAGraph`` and replayed;
programs are cached per shape and config but the seed (``program_key``), so a later
task of the same shape -- another seed included -- only copies its data into the
static buffers and replays (no recapture).
Between epochs the runner copies that epoch's permutation (resident on the
device) into ``order``.

Without a GPU the same program runs its steps eagerly (``use_graphs=False``);
the tests use that on the CPU to check the buffer logic against the cpu
backend. Capture and replay themselves can only be checked on a GPU
(``scripts/gpu_check.py``).

Stopping early, between epoch replays: the host checks the task's cancel token
(TaskCancelled) and whether the parameters are still finite (TrainingDivergedError
naming the epoch). Reading that answer waits for the epoch's replay to finish: one
host synchronization per epoch, small next to an epoch's work, and it paces the host
so that a cancel is seen within about one epoch. Written and run eagerly on the CPU
only; unverified on a GPU (the synchronizations' cost included).
"""

from __future__ import annotations

import collections
import os
import threading
import time

import numpy as np
import torch

from ..cancel import CancelToken, check
from ..config import Config
from ..errors import TrainingDivergedError
from ..model import CLASSES, FEATURES, lift_into
from ..taskio import TaskArrays
from ..train import predict_scores, train_step
from .base import Prepared, RunOutput

WORKSPACE = ":16:8"


def ensure_workspace_config() -> None:
    """cuBLAS must see CUBLAS_WORKSPACE_CONFIG before CUDA starts, or replays may differ."""
    current = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if current is None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            raise RuntimeError(
                "CUDA was initialized before CUBLAS_WORKSPACE_CONFIG was set; import "
                "learner before touching CUDA or set CUBLAS_WORKSPACE_CONFIG=:16:8"
            )
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = WORKSPACE


class TaskProgram:
    """Static buffers and graph-capturable steps for one task shape and config."""

    def __init__(self, config: Config, n: int, m: int, device: torch.device, initial: list[np.ndarray]):
        self.config, self.n, self.m, self.device = config, n, m, device
        f32 = dict(dtype=torch.float32, device=device)
        self.raw_train = torch.zeros(n, 1, 9, 9, **f32)
        self.raw_test = torch.zeros(m, 1, 9, 9, **f32)
        self.labels = torch.zeros(n, dtype=torch.int64, device=device)
        self.train_h = torch.zeros(n, FEATURES, **f32)
        self.test_h = torch.zeros(m, FEATURES, **f32)
        self.initial = [torch.zeros(p.shape, **f32) for p in initial]
        self.params = [torch.zeros(p.shape, **f32) for p in initial]
        self.velocity = [torch.zeros(p.shape, **f32) for p in initial]
        self.permutations = torch.zeros(config.epochs, n, dtype=torch.int64, device=device)
        self.order = torch.zeros(n, dtype=torch.int64, device=device)
        self.scores = torch.zeros(m, CLASSES, **f32)
        self.graphs: dict[str, torch.cuda.CUDAGraph] = {}
        self.replays = 0

    # -- data in (outside any graph) ---------------------------------------------------
    def load(self, task: TaskArrays, prepared: Prepared) -> None:
        self.raw_train.copy_(torch.from_numpy(task.train_images))
        self.raw_test.copy_(torch.from_numpy(task.test_images))
        self.labels.copy_(torch.from_numpy(task.train_labels))
        for dst, src in zip(self.initial, prepared.initial):
            dst.copy_(torch.from_numpy(src))
        self.permutations.copy_(torch.from_numpy(np.stack(prepared.permutations)))

    # -- the three steps ---------------------------------------------------------------
    def reset(self) -> None:
        with torch.no_grad():
            for p, p0, v in zip(self.params, self.initial, self.velocity):
                p.copy_(p0)
                v.zero_()
            lift_into(self.train_h, self.raw_train)
            lift_into(self.test_h, self.raw_test)

    def epoch(self) -> None:
        bs = self.config.batch_size
        for start in range(0, self.n, bs):
            idx = self.order[start : start + bs]
            train_step(self.params, self.velocity, self.train_h[idx], self.labels[idx], self.config)

    def predict(self) -> None:
        self.scores.copy_(predict_scores(self.params, self.test_h, self.config))

    # -- running -----------------------------------------------------------------------
    def capture(self) -> None:
        """Warm up on a side stream, then capture reset, epoch and predict."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.reset()
                self.order.copy_(self.permutations[0])
                self.epoch()
                self.predict()
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        for name in ("reset", "epoch", "predict"):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                getattr(self, name)()
            self.graphs[name] = graph
        torch.cuda.synchronize(self.device)

    def _step(self, name: str) -> None:
        if self.graphs:
            self.graphs[name].replay()
        else:
            getattr(self, name)()

    def parameters_finite(self) -> bool:
        """Whether every parameter is finite (one host synchronization)."""
        return bool(torch.stack([torch.isfinite(p).all() for p in self.params]).all())

    def run(self, cancel: CancelToken | None = None) -> None:
        """reset, each epoch in its order, predict; between epochs, stop on ``cancel`` or on
        non-finite parameters (unverified on a GPU: see the module docstring)."""
        epochs = self.config.epochs
        self._step("reset")
        for e in range(epochs):
            check(cancel, e, 0)
            self.order.copy_(self.permutations[e])
            self._step("epoch")
            if not self.parameters_finite():
                raise TrainingDivergedError(
                    f"training diverged in epoch {e}: non-finite parameters after it; try a smaller learning_rate",
                    non_finite=["parameters"], epoch=e, step=None,
                )
            if cancel is not None:
                cancel.progress[0] = (e + 1) * -(-self.n // self.config.batch_size)
        check(cancel, epochs, 0, epochs)
        self._step("predict")
        self.replays += 1


def program_key(task: TaskArrays, config: Config) -> tuple:
    """What a captured program depends on: the two shapes and every config value the steps use
    (depth, alpha, epochs, batch size, learning rate, momentum, weight decay: the optimizer's
    scalars are baked into the captured kernels). Not the seed: it only decides the initial
    parameters and the epochs' permutations, which ``load`` copies into the static buffers."""
    return (task.train_count, task.test_count, tuple((k, v) for k, v in config.as_dict().items() if k != "seed"))


class GraphBackend:
    """Runs tasks through cached ``TaskProgram``s; graphs on CUDA, eager elsewhere."""

    name = "cuda"

    def __init__(self, device: str = "cuda", use_graphs: bool | None = None, cache_size: int = 8):
        self.torch_device = torch.device(device)
        if self.torch_device.type == "cuda":
            ensure_workspace_config()
            if not torch.cuda.is_available():
                raise RuntimeError("the cuda backend needs a CUDA GPU; none is available")
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
            if self.torch_device.index is None:
                self.torch_device = torch.device("cuda", torch.cuda.current_device())
        self.device = str(self.torch_device)
        self.use_graphs = self.torch_device.type == "cuda" if use_graphs is None else use_graphs
        self.cache_size = cache_size
        self.programs: collections.OrderedDict[tuple, TaskProgram] = collections.OrderedDict()
        self.captures = 0
        self.cache_hits = 0
        self.lock = threading.Lock()

    def describe(self) -> dict:
        out = {
            "backend": self.name,
            "device": self.device,
            "graphs": self.use_graphs,
            "cached_programs": [
                {"train_count": k[0], "test_count": k[1], "config": dict(k[2])} for k in self.programs
            ],
            "captures": self.captures,
            "cache_hits": self.cache_hits,
        }
        if self.torch_device.type == "cuda":
            out["gpu_name"] = torch.cuda.get_device_name(self.torch_device)
        return out

    def _program(self, task: TaskArrays, prepared: Prepared) -> tuple[TaskProgram, bool]:
        key = program_key(task, prepared.config)
        program = self.programs.get(key)
        if program is not None:
            self.programs.move_to_end(key)
            self.cache_hits += 1
            program.load(task, prepared)
            return program, True
        program = TaskProgram(prepared.config, task.train_count, task.test_count, self.torch_device, prepared.initial)
        program.load(task, prepared)
        if self.use_graphs:
            program.capture()
            self.captures += 1
        self.programs[key] = program
        while len(self.programs) > self.cache_size:
            self.programs.popitem(last=False)
        return program, False

    def run(self, task: TaskArrays, prepared: Prepared) -> RunOutput:
        with self.lock:
            t0 = time.perf_counter()
            program, reused = self._program(task, prepared)
            cuda = self.torch_device.type == "cuda"
            if cuda:
                torch.cuda.synchronize(self.torch_device)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t1 = time.perf_counter()
            if cuda:
                start.record()
            program.run(prepared.cancel)
            if cuda:
                end.record()
                end.synchronize()
            t2 = time.perf_counter()
            out = RunOutput(
                final_parameters=[p.detach().cpu().numpy().copy() for p in program.params],
                final_velocity=[v.detach().cpu().numpy().copy() for v in program.velocity],
                scores=program.scores.detach().cpu().numpy().copy(),
                training_prediction_seconds=t2 - t1,
                preparation_seconds=t1 - t0,
                cuda_ms=float(start.elapsed_time(end)) if cuda else None,
                extra={"graph_reused": reused, "graphs": self.use_graphs},
            )
            return out
