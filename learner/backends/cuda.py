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

Two step functions, chosen per GPU by the tuned table (learner/kernels/tuned.py ``cuda_step``,
measured by scripts/gpu_tune.py) or by ``GraphBackend(step=...)``:

    autograd   train.train_step: the cpu backend's code (autograd through model.ReversibleCore)
    explicit   ``ExplicitStep``: the same reversible backward written out with in-place and fused
               products (``addmm`` adds the branch into its input; one flat gradient and one flat
               velocity buffer, so SGD is three elementwise kernels), about half the kernels per
               step; ``explicit-bmm`` takes each weight gradient as a batched product of one, which
               cuBLAS serves without the split-K kernel (and its memset and scaling kernels) that
               it picks for the 41x128 @ 128x41 product of ``mm`` -- which of them is faster is the
               GPU's to say

Both are checked against the cpu backend (tests/test_cuda.py on the CPU; on a GPU the tuning run's
eleven draws, query by query).

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
from ..kernels.tuned import CUBLAS_WORKSPACE, choice_for
from ..model import CLASSES, FEATURES, WIDTH, lift_into
from ..taskio import TaskArrays
from ..train import predict_scores, train_step
from .base import Prepared, RunOutput

WORKSPACE = CUBLAS_WORKSPACE  # learner/kernels/tuned.py: the seed's ":16:8" until a GPU run compared another


def ensure_workspace_config() -> None:
    """cuBLAS must see CUBLAS_WORKSPACE_CONFIG before CUDA starts, or replays may differ."""
    current = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if current is None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            raise RuntimeError(
                "CUDA was initialized before CUBLAS_WORKSPACE_CONFIG was set; import "
                f"learner before touching CUDA or set CUBLAS_WORKSPACE_CONFIG={WORKSPACE}"
            )
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = WORKSPACE


def workspace_bytes(config: str | None) -> int | None:
    """The bytes one CUBLAS_WORKSPACE_CONFIG asks for per (cuBLAS handle, stream): ``:SIZE:COUNT``
    pairs, SIZE in KiB (":4096:8" = 8 x 4 MiB = 32 MiB; ":16:8" = 128 KiB); None if unreadable."""
    if not config:
        return None
    parts = config.split(":")
    if parts[0] != "" or len(parts) < 3 or len(parts) % 2 == 0:
        return None
    try:
        pairs = [(int(parts[i]), int(parts[i + 1])) for i in range(1, len(parts), 2)]
    except ValueError:
        return None
    return sum(size * 1024 * count for size, count in pairs)


def memory_facts() -> dict:
    """What the cuBLAS workspace costs: for every answer's metadata (backend_details.memory)."""
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    return {"cublas_workspace_config": config, "cublas_workspace_bytes_per_stream": workspace_bytes(config),
            "scope": "torch allocates this workspace once per (cuBLAS handle, stream) from its caching allocator"}


class ExplicitStep:
    """One minibatch of SGD-momentum without autograd: model.ReversibleCore's backward written out.

    Forward keeps only the endpoint; the backward rebuilds each block's input by subtracting the
    branch it added (``addmm`` with alpha -1: the same rounding as a product then a subtraction),
    takes the branch's weight gradient (``mm``, or ``bmm`` of a batch of one: ``wgrad``) into a
    flat gradient buffer and its input gradient (``threshold_backward``: the relu's mask). The
    cross-entropy gradient is (softmax(s) - onehot(y)) / B, the update torch.optim.SGD's on the
    flat buffers. Allocates nothing outside the captured graph's pool; never synchronizes.
    """

    def __init__(self, params: list[torch.Tensor], config: Config, wgrad: str = "mm"):
        self.config, self.wgrad = config, wgrad
        numel = sum(p.numel() for p in params)
        device = params[0].device
        self.flat_p = torch.zeros(numel, dtype=torch.float32, device=device)
        self.flat_v = torch.zeros(numel, dtype=torch.float32, device=device)
        self.flat_g = torch.zeros(numel, dtype=torch.float32, device=device)
        self.params, self.velocity, self.grads, off = [], [], [], 0
        for p in params:
            n = p.numel()
            self.params.append(self.flat_p[off:off + n].view(p.shape))
            self.velocity.append(self.flat_v[off:off + n].view(p.shape))
            self.grads.append(self.flat_g[off:off + n].view(p.shape))
            off += n

    def _weight_grad(self, out: torch.Tensor, g: torch.Tensor, a: torch.Tensor) -> None:
        """out <- g.T @ a (41 x B @ B x 41)."""
        if self.wgrad == "bmm":
            torch.bmm(g.t().unsqueeze(0), a.unsqueeze(0), out=out.unsqueeze(0))
        else:
            torch.mm(g.t(), a, out=out)

    def __call__(self, h: torch.Tensor, onehot: torch.Tensor) -> None:
        cfg, alpha = self.config, self.config.alpha
        weights, hw, hb = self.params[:-2], self.params[-2], self.params[-1]
        gw, ghw, ghb = self.grads[:-2], self.grads[-2], self.grads[-1]
        left, right = h[:, :WIDTH], h[:, WIDTH:]
        for b in range(len(weights) // 2):
            left = torch.addmm(left, torch.relu(right).mul_(alpha), weights[2 * b].t())
            right = torch.addmm(right, torch.relu(left).mul_(alpha), weights[2 * b + 1].t())
        z = torch.cat([left, right], dim=1)
        g = torch.softmax(torch.addmm(hb, z, hw.t()), dim=1)
        g.sub_(onehot).div_(h.shape[0])  # d mean cross-entropy / d scores
        torch.mm(g.t(), z, out=ghw)
        torch.sum(g, dim=0, out=ghb)
        gz = torch.mm(g, hw)
        g_left, g_right = gz[:, :WIDTH], gz[:, WIDTH:]
        for b in reversed(range(len(weights) // 2)):
            w_l, w_r = weights[2 * b], weights[2 * b + 1]
            # right_out = right_in + branch(left_out, w_r)
            a = torch.relu(left).mul_(alpha)
            right = torch.addmm(right, a, w_r.t(), alpha=-1)
            self._weight_grad(gw[2 * b + 1], g_right, a)
            g_left = g_left + torch.ops.aten.threshold_backward(torch.mm(g_right, w_r).mul_(alpha), left, 0)
            # left_out = left_in + branch(right_in, w_l)
            a = torch.relu(right).mul_(alpha)
            self._weight_grad(gw[2 * b], g_left, a)
            if b > 0:  # block 0's input (the lifted batch) needs neither value nor gradient
                left = torch.addmm(left, a, w_l.t(), alpha=-1)
                g_right = g_right + torch.ops.aten.threshold_backward(torch.mm(g_left, w_l).mul_(alpha), right, 0)
        if cfg.weight_decay != 0.0:
            self.flat_g.add_(self.flat_p, alpha=cfg.weight_decay)
        self.flat_v.mul_(cfg.momentum).add_(self.flat_g)
        self.flat_p.add_(self.flat_v, alpha=-cfg.learning_rate)


class TaskProgram:
    """Static buffers and graph-capturable steps for one task shape and config."""

    def __init__(self, config: Config, n: int, m: int, device: torch.device, initial: list[np.ndarray],
                 step: str = "autograd"):
        self.config, self.n, self.m, self.device, self.step = config, n, m, device, step
        f32 = dict(dtype=torch.float32, device=device)
        self.raw_train = torch.zeros(n, 1, 9, 9, **f32)
        self.raw_test = torch.zeros(m, 1, 9, 9, **f32)
        self.labels = torch.zeros(n, dtype=torch.int64, device=device)
        self.train_h = torch.zeros(n, FEATURES, **f32)
        self.test_h = torch.zeros(m, FEATURES, **f32)
        self.initial = [torch.zeros(p.shape, **f32) for p in initial]
        self.explicit = None
        if step == "autograd":
            self.params = [torch.zeros(p.shape, **f32) for p in initial]
            self.velocity = [torch.zeros(p.shape, **f32) for p in initial]
        elif step in ("explicit", "explicit-bmm"):
            self.explicit = ExplicitStep([torch.zeros(p.shape, **f32) for p in initial], config,
                                         "bmm" if step == "explicit-bmm" else "mm")
            self.params, self.velocity = self.explicit.params, self.explicit.velocity
            self.onehot = torch.zeros(n, CLASSES, **f32)  # the train labels one-hot (load)
        else:
            raise ValueError(f"step must be one of {', '.join(STEPS)}, got {step!r}")
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
        if self.explicit is not None:
            self.onehot.zero_().scatter_(1, self.labels[:, None], 1.0)
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
            if self.explicit is not None:
                self.explicit(self.train_h[idx], self.onehot[idx])
            else:
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


STEPS = ("autograd", "explicit", "explicit-bmm")


def program_key(task: TaskArrays, config: Config) -> tuple:
    """What a captured program depends on: the two shapes and every config value the steps use
    (depth, alpha, epochs, batch size, learning rate, momentum, weight decay: the optimizer's
    scalars are baked into the captured kernels). Not the seed: it only decides the initial
    parameters and the epochs' permutations, which ``load`` copies into the static buffers."""
    return (task.train_count, task.test_count, tuple((k, v) for k, v in config.as_dict().items() if k != "seed"))


class GraphBackend:
    """Runs tasks through cached ``TaskProgram``s; graphs on CUDA, eager elsewhere."""

    name = "cuda"

    def __init__(self, device: str = "cuda", use_graphs: bool | None = None, cache_size: int = 8,
                 step: str | None = None):
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
        self.gpu_name = torch.cuda.get_device_name(self.torch_device) if self.torch_device.type == "cuda" else None
        self.tuned = choice_for(self.gpu_name)
        if step is not None and step not in STEPS:
            raise ValueError(f"step must be one of {', '.join(STEPS)}, got {step!r}")
        self.step = step or self.tuned.cuda_step
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
            "step": self.step,
            "precision": "ieee",
            "tuned_row": self.tuned.row,
        }
        if self.torch_device.type == "cuda":
            out["gpu_name"] = self.gpu_name
            out["memory"] = memory_facts()
        return out

    def with_precision(self, precision: str) -> GraphBackend:
        """A request's ``?precision=``: this backend's products are fp32 ("ieee", TF32 off) only."""
        if precision != "ieee":
            raise ValueError(f"backend 'cuda' computes its products in fp32 (precision 'ieee'), not {precision!r}")
        return self

    def _program(self, task: TaskArrays, prepared: Prepared) -> tuple[TaskProgram, bool]:
        key = program_key(task, prepared.config)
        program = self.programs.get(key)
        if program is not None:
            self.programs.move_to_end(key)
            self.cache_hits += 1
            program.load(task, prepared)
            return program, True
        program = TaskProgram(prepared.config, task.train_count, task.test_count, self.torch_device, prepared.initial,
                              self.step)
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
                extra=self._extra(reused),
            )
            return out

    def _extra(self, reused: bool) -> dict:
        extra = {"graph_reused": reused, "graphs": self.use_graphs, "step": self.step, "precision": "ieee",
                 "tuned_row": self.tuned.row}
        if self.torch_device.type == "cuda":
            extra["memory"] = memory_facts()
        return extra
