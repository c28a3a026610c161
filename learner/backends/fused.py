"""The fused backend: Triton kernels that train whole tasks (learner/kernels/).

    run(task, prepared[, precision])             one task
    run_many(tasks, prepareds[, precision])      T tasks of one shape and one config (their seeds
                                                 may differ; each has its own data) in one launch
    with_precision(p)                            the backend at one product precision (a request's
                                                 ?precision=: "ieee" or "tf32x3")

Two variants (the tuned table, learner/kernels/tuned.py, picks per GPU and per launch size):

    one     fused_train.py: one program per task, one launch: reset of parameters and velocity,
            the lift of raw pixels, every epoch of SGD-momentum in the seed's permutation order,
            scoring all queries
    split   fused_rows.py and fused_update.py once per step (the minibatch's chunks over several
            programs, then each weight's gradient and update by a program of its own; the launch
            boundaries are the barriers), then fused_predict.py over the queries: more of the GPU
            for a lone task

Both give a task the same bytes (learner/kernels/fused_parts.py: one arithmetic for every chunk,
number of warps and variant): only the product precision changes them, and it is said in every
answer (``backend_details.precision``) and kept apart in launches (app/tasks/device.py's key).
A launch's data: each task's dataset (train images, labels, query images) is on the device once,
kept between launches by learner/backends/device_datasets.py (an LRU by bytes per device; a sweep's
launches stage draw 0 once), and the kernels read task t's data at row ``data_index[t]`` of the
launch's datasets; the per-task inputs (that row, the epoch permutations, the initial parameters)
go in one copy from one pinned host buffer (``launch_inputs``); the outputs (predictions -- the
argmax of the scores taken on the device, ``RunOutput.predictions`` -- final parameters, velocity
and scores) come back in one copy (``LaunchOutputs``). None of this changes what a task computes:
the kernels' arithmetic is the same, only where they read a task's data (tests/test_fused.py
compares a launch that shares a resident dataset with single launches, byte for byte).

``cuda_ms`` is the CUDA-event time of all the launches of one call. For a batched launch each
task's ``cuda_ms`` and ``training_prediction_seconds`` are the whole launch's (what the task
waited for); ``extra`` says how many tasks shared it and the per-task share.

On CUDA the backend needs triton (the ``gpu`` extra). On the CPU it runs only under
``TRITON_INTERPRET=1`` (triton's numpy simulator, used by tests/test_fused.py); the registry
never offers that. ``auto`` picks this backend on a CUDA machine once ``fused_ready()``
(a small training run checked against the cpu backend) has passed in the process.

Verified on an H200 (../shared/notes/gpu-h200.md) for the one-program kernel before the split
variant, the precision choice and the fixed-order sums existed; those are verified here in the
interpreter (tests/test_fused.py) and on a GPU only by scripts/gpu_tune.py and
scripts/gpu_check_fused.py.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Any

import numpy as np
import torch

from ..cancel import check as check_cancel
from ..config import Config
from ..errors import ConfigError
from ..taskio import TaskArrays
from . import BackendUnavailable, device_datasets
from .base import Prepared, RunOutput

log = logging.getLogger(__name__)

# The kernel unrolls the core (depth is a compile-time constant): bound the code size.
MAX_DEPTH = 32
# Rows per forward/backward pass when nothing (the tuned table, the constructor) says otherwise;
# a larger minibatch runs in several passes. See default_warps for why.
MAX_CHUNK = 64


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def default_chunk(batch_size: int, max_chunk: int = MAX_CHUNK) -> int:
    """A power of two in [16, max_chunk]: the whole minibatch in one pass when it fits."""
    chunk = 16
    while chunk < min(batch_size, max_chunk):
        chunk *= 2
    return chunk


def default_warps(chunk: int) -> int:
    # From compiling the depth-2 kernel for sm_90a here (ptxas -v; no GPU to time it):
    # chunk 64 / 8 warps spills 20 bytes per thread, chunk 128 / 8 warps 400 bytes,
    # chunk 128 / 16 warps 352 bytes, chunk 64 / 4 warps 752 bytes, chunk 16 / 4 warps 8.
    # The run-time choice is for bench/bench_fused.py --sweep on a GPU to confirm.
    return 8 if chunk >= 64 else 4


SPLIT_MAX_BATCH = 4096  # = learner.kernels.fused_rows.SPLIT_MAX_BATCH (no triton import here)


def choose(tuned: Any, config: Config, tasks: int, chunk: int | None = None, num_warps: int | None = None,
           precision: str | None = None, variant: str | None = None):
    """What a launch of ``tasks`` tasks of ``config`` runs: each value given here (the backend's
    fixed one, a request's precision) first, else the tuned row's (``tuned.for_launch(tasks)``), its
    chunk the largest one: a smaller minibatch gets the smallest power of two >= 16 that holds it.
    The split variant only for minibatches of at most SPLIT_MAX_BATCH rows (it keeps every row's
    operands of the weight gradients: fused_parts.rows_size floats per task)."""
    from ..kernels.tuned import Choice

    base = tuned.for_launch(tasks)
    chunk = chunk or default_chunk(config.batch_size, base.chunk)
    warps = num_warps or (base.num_warps if chunk == base.chunk else default_warps(chunk))
    variant = variant or base.variant
    if variant == "split" and config.batch_size > SPLIT_MAX_BATCH:
        variant = "one"
    return Choice(chunk=chunk, num_warps=warps, precision=precision or base.precision, variant=variant)


def touch_launcher(compiled: Any) -> None:
    """Load a compiled kernel onto the GPU and build its launcher now. Triton's warm-up only
    compiles; the module load (cuModuleLoadData) and the launcher are made at the first real
    launch, which would put them inside that task's ``cuda_ms``. Triton 3.x's
    ``CompiledKernel.run`` is a property that does both (``_init_handles``) and returns the
    launcher: reading it here is the whole touch. Another Triton without it is refused loudly
    (the fused backend's self-check then keeps ``auto`` off it) rather than timed wrongly."""
    if not isinstance(getattr(type(compiled), "run", None), property):
        raise RuntimeError(f"the fused backend needs Triton 3.x's CompiledKernel.run property to load its kernel "
                           f"before the timed launch; {type(compiled).__module__}.{type(compiled).__name__} has none")
    compiled.run  # noqa: B018 - the property's side effect is the point


def _launch_config(config: Config) -> Config:
    """The part of a config that must be shared by the tasks of one launch (all but the seed)."""
    return dataclasses.replace(config, seed=1)


def check_launch(tasks: list[TaskArrays], prepareds: list[Prepared]) -> Config:
    """The shared config of a launch; a clear error if the tasks cannot share one."""
    if not tasks:
        raise ValueError("run_many needs at least one task")
    if len(tasks) != len(prepareds):
        raise ValueError(f"run_many got {len(tasks)} tasks but {len(prepareds)} prepared inputs")
    shape, config = tasks[0].shape_key, prepareds[0].config
    for i, (task, prep) in enumerate(zip(tasks, prepareds)):
        if task.shape_key != shape:
            raise ValueError(
                f"task {i} has (train, query) counts {task.shape_key}, task 0 has {shape}: "
                "one launch trains tasks of one shape"
            )
        if _launch_config(prep.config) != _launch_config(config):
            raise ValueError(
                f"task {i} has config {prep.config.as_dict()}, task 0 has {config.as_dict()}: "
                "one launch trains tasks of one config (only the seed may differ)"
            )
        if len(prep.permutations) != config.epochs or any(p.shape != (task.train_count,) for p in prep.permutations):
            raise ValueError(f"task {i}: expected {config.epochs} permutations of length {task.train_count}")
        if len(prep.initial) != 2 * config.depth + 2:
            raise ValueError(f"task {i}: expected {2 * config.depth + 2} initial parameter arrays")
    if config.depth > MAX_DEPTH:
        raise ConfigError(
            f"config.depth={config.depth} is above the fused backend's limit of {MAX_DEPTH} "
            "(the kernel unrolls the core); use backend=cuda or backend=cpu",
            field="depth",
        )
    if config.epochs * tasks[0].train_count >= 2**31:
        raise ConfigError(
            f"epochs x train_count = {config.epochs * tasks[0].train_count} is too large for the "
            "fused kernel's 32-bit permutation offsets; use backend=cuda or backend=cpu",
            field="epochs",
        )
    return config


# --------------------------------------------------------------------------- a launch's data in and out

ALIGN = 256  # bytes: each part of a packed buffer starts on a boundary the kernels' pointers assume (16)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def launch_datasets(tasks: list[TaskArrays], device: torch.device) -> tuple[dict, list[int], int]:
    """The datasets of a launch's tasks on ``device``, each once (device_datasets: kept there between
    launches, staged when missing), as the kernels read them: ``train`` (D, N, 81), ``labels`` (D, N),
    ``test`` (D, M, 81) for the launch's D distinct datasets; with each task's row in them and how many
    of the D this launch staged. One dataset (a sweep's launch): the kept tensors themselves, no copy;
    several (uploads, an evaluation's draws): stacked on the device."""
    slots: dict[tuple, int] = {}
    residents, rows, staged = [], [], 0
    for task in tasks:
        key = device_datasets.dataset_key(task)
        slot = slots.get(key)
        if slot is None:
            slot = slots[key] = len(residents)
            resident, new = device_datasets.datasets.get(task, device, key)
            residents.append(resident)
            staged += new
        rows.append(slot)
    if len(residents) == 1:
        r = residents[0]
        data = {"train": r.train.unsqueeze(0), "labels": r.labels.unsqueeze(0), "test": r.test.unsqueeze(0)}
    else:
        data = {name: torch.stack([getattr(r, name) for r in residents]) for name in ("train", "labels", "test")}
    return data, rows, staged


def launch_inputs(prepareds: list[Prepared], rows: list[int], epochs: int, n: int, depth: int,
                  device: torch.device) -> dict:
    """A launch's per-task inputs -- each task's dataset row, epoch permutations and padded initial
    parameters -- packed on the host into one int32 buffer (pinned where CUDA is: a copy from it need
    not be staged by the driver) and copied to ``device`` in one non-blocking copy; views of the copy:
    ``index`` (T,) int32, ``perms`` (T, E, N) int32, ``init`` (T, S) float32 (its bits in the buffer)."""
    from ..kernels.fused_parts import pack_state, state_size

    count, size = len(prepareds), state_size(depth)
    o_perm = _aligned(count * 4) // 4
    o_init = o_perm + _aligned(count * epochs * n * 4) // 4
    host = torch.empty(o_init + count * size, dtype=torch.int32, pin_memory=device.type == "cuda")
    a = host.numpy()
    a[:count] = rows
    perms = a[o_perm:o_perm + count * epochs * n].reshape(count, epochs, n)
    init = a[o_init:].view(np.float32).reshape(count, size)
    for i, prep in enumerate(prepareds):
        for e, order in enumerate(prep.permutations):
            perms[i, e] = order  # int64 -> int32 (check_launch: epochs x N < 2**31)
        init[i] = pack_state(prep.initial, depth)
    dev = host.to(device, non_blocking=True)  # the one copy (on the CPU: the buffer itself)
    return {"index": dev[:count], "perms": dev[o_perm:o_perm + count * epochs * n].view(count, epochs, n),
            "init": dev[o_init:].view(torch.float32).view(count, size)}


def device_argmax(scores: torch.Tensor) -> torch.Tensor:
    """Each query's class from (T, M, 10) scores where they are: int64, the first of the highest scores
    (torch.argmax takes the first maximum, as numpy's argmax does: tests/test_device_datasets.py)."""
    return torch.argmax(scores, dim=-1)


class LaunchOutputs:
    """A launch's outputs in one buffer on the device -- predictions (T, M) int64, final parameters and
    velocity (T, S) float32, scores (T, M, 10) float32 -- which the kernels write into (views), and
    ``bring_back`` returns to the host in one copy (into pinned memory where CUDA is, from torch's
    caching host allocator: the arrays handed back are views of it, returned to that cache once the
    launch's last output is dropped)."""

    def __init__(self, count: int, m: int, size: int, device: torch.device):
        self.count, self.device = count, device
        parts = (("predictions", torch.int64, (count, m)), ("params", torch.float32, (count, size)),
                 ("velocity", torch.float32, (count, size)), ("scores", torch.float32, (count, m, 10)))
        self.layout, offset = [], 0
        for name, dtype, shape in parts:
            nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
            self.layout.append((name, offset, nbytes, dtype, shape))
            offset += _aligned(nbytes)
        self.buffer = torch.empty(offset, dtype=torch.uint8, device=device)
        views = {name: self.buffer[o:o + nb].view(dtype).view(shape) for name, o, nb, dtype, shape in self.layout}
        self.predictions, self.params, self.velocity, self.scores = (
            views["predictions"], views["params"], views["velocity"], views["scores"])

    def bring_back(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The predictions computed on the device (``device_argmax`` of the scores), then the whole
        buffer in one copy: (predictions, params, velocity, scores) as numpy views of the host copy."""
        self.predictions.copy_(device_argmax(self.scores))
        if self.device.type == "cuda":
            host = torch.empty(self.buffer.shape, dtype=torch.uint8, pin_memory=True)
            host.copy_(self.buffer, non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()
        else:
            host = self.buffer  # the kernels ran in the interpreter on this very memory
        raw = host.numpy()
        np_dtype = {torch.int64: np.int64, torch.float32: np.float32}
        out = [raw[o:o + nb].view(np_dtype[dtype]).reshape(shape) for _, o, nb, dtype, shape in self.layout]
        return out[0], out[1], out[2], out[3]


class FusedBackend:
    """Runs tasks through the fused kernels: one program (one SM) per task, or for the split
    variant two launches per step with a task's minibatch over several programs.

    ``chunk``, ``num_warps``, ``precision`` and ``variant`` fix a choice for every launch; each
    one left None comes from the tuned table's row for this GPU (learner/kernels/tuned.py: the
    ``lone`` choice for a launch of one task, the ``launch`` choice for more). A task's bytes
    depend on its product precision only (learner/kernels/fused_parts.py: one arithmetic for
    every chunk, number of warps and variant); ``run``/``run_many`` take a per-call precision (a
    request's ``?precision=``, through ``with_precision``)."""

    name = "fused"

    def __init__(self, device: str = "cuda", chunk: int | None = None, num_warps: int | None = None,
                 precision: str | None = None, variant: str | None = None, tuned: Any = None):
        self.torch_device = torch.device(device)
        self.interpret = interpreting()
        if self.torch_device.type == "cuda":
            if not torch.cuda.is_available():
                raise BackendUnavailable("backend 'fused' needs a CUDA GPU and none is available here")
            if self.torch_device.index is None:
                self.torch_device = torch.device("cuda", torch.cuda.current_device())
        elif not self.interpret:
            raise BackendUnavailable(
                "backend 'fused' runs on a CUDA GPU; on the CPU only under TRITON_INTERPRET=1 "
                "(triton's simulator, for tests)"
            )
        try:
            from ..kernels import fused_predict, fused_rows, fused_train, fused_update
        except ImportError as exc:
            raise BackendUnavailable(
                f"backend 'fused' needs triton (pip install 'rev88[gpu]'): {exc}"
            ) from None
        from ..kernels.tuned import PRECISIONS, VARIANTS, choice_for

        if chunk is not None and (chunk < 16 or chunk > 256 or chunk & (chunk - 1)):
            raise ValueError(f"chunk must be a power of two in [16, 256], got {chunk}")
        if num_warps is not None and num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {num_warps}")
        if precision is not None and precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        if variant is not None and variant not in VARIANTS:
            raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
        self.kernel, self.predict_kernel = fused_train, fused_predict
        self.rows_kernel, self.update_kernel = fused_rows, fused_update
        self.chunk, self.num_warps, self.precision, self.variant = chunk, num_warps, precision, variant
        self.device = str(self.torch_device)
        self.gpu_name = torch.cuda.get_device_name(self.torch_device) if self.torch_device.type == "cuda" else None
        self.tuned = tuned if tuned is not None else choice_for(self.gpu_name)
        self.launches = 0
        self.tasks_run = 0
        self.lock = threading.Lock()

    def describe(self) -> dict:
        import triton

        out = {
            "backend": self.name,
            "device": self.device,
            "interpreted": self.interpret,
            "triton": triton.__version__,
            "chunk": self.chunk or "tuned",
            "num_warps": self.num_warps or "tuned",
            "precision": self.precision or self.tuned.launch.precision,
            "variant": self.variant or "tuned",
            "tuned": self.tuned.as_dict(),
            "launches": self.launches,
            "tasks_run": self.tasks_run,
            "device_datasets": device_datasets.datasets.snapshot(self.torch_device),
        }
        if self.gpu_name is not None:
            out["gpu_name"] = self.gpu_name
        return out

    def choice(self, config: Config, tasks: int, precision: str | None = None):
        """What a launch of ``tasks`` tasks of ``config`` runs (``choose``)."""
        return choose(self.tuned, config, tasks, chunk=self.chunk, num_warps=self.num_warps,
                      precision=precision or self.precision, variant=self.variant)

    def with_precision(self, precision: str) -> PrecisionView:
        """This backend with ``precision`` for every task it runs (a request's ``?precision=``)."""
        from ..kernels.tuned import PRECISIONS

        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        return PrecisionView(self, precision)

    def run(self, task: TaskArrays, prepared: Prepared, precision: str | None = None) -> RunOutput:
        """One task, one launch (the split variant: two launches per step). Cancellation: only a
        task not yet launched can be dropped; a running launch is not interrupted, but if the
        task's token was cancelled while it ran, its result is discarded (TaskCancelled) once the
        launch returns."""
        out = self.run_many([task], [prepared], precision)[0]
        epochs = prepared.config.epochs
        check_cancel(prepared.cancel, epochs, 0, epochs)
        return out

    def run_many(self, tasks: list[TaskArrays], prepareds: list[Prepared],
                 precision: str | None = None) -> list[RunOutput]:
        """T tasks in one launch. A launch whose tasks were all cancelled before it started is
        not made (TaskCancelled); otherwise every task runs, and ``learner.result.finish_task``
        discards the result of each task cancelled meanwhile. Divergence is found only after
        the launch (``learner.result.check_finite``): the kernel has no early stop."""
        config = check_launch(tasks, prepareds)
        with self.lock:
            tokens = [p.cancel for p in prepareds]
            if tokens and all(t is not None and t.cancelled for t in tokens):
                check_cancel(tokens[0], 0, 0)
            return self._run_many(tasks, prepareds, config, self.choice(config, len(tasks), precision))

    def _run_many(self, tasks: list[TaskArrays], prepareds: list[Prepared], config: Config, choice) -> list[RunOutput]:
        k = self.kernel
        t0 = time.perf_counter()
        n, m, depth, count = tasks[0].train_count, tasks[0].test_count, config.depth, len(tasks)
        size = k.state_size(depth)
        cuda = self.torch_device.type == "cuda"
        data, rows, staged = launch_datasets(tasks, self.torch_device)  # each dataset once, kept on the device
        data.update(launch_inputs(prepareds, rows, config.epochs, n, depth, self.torch_device))  # one copy
        out = LaunchOutputs(count, m, size, self.torch_device)
        out.scores.fill_(float("nan"))  # NaN shows any row left unwritten
        common = dict(n_train=n, n_epochs=config.epochs, batch_size=config.batch_size, alpha=config.alpha,
                      learning_rate=config.learning_rate, momentum=config.momentum,
                      weight_decay=config.weight_decay, depth=depth, chunk=choice.chunk,
                      num_warps=choice.num_warps, precision=choice.precision)
        if choice.variant == "split":
            run, extra = self._split(data, out, size, m, common)
        else:
            run, extra = self._one(data, out, size, m, common)
        if cuda:
            run(warmup=True)  # compile (or find) the kernels and load them onto the GPU, outside the timing
            torch.cuda.synchronize(self.torch_device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t1 = time.perf_counter()
        if cuda:
            start.record()
        run(warmup=False)
        if cuda:
            end.record()
            end.synchronize()
        t2 = time.perf_counter()
        launch_ms = float(start.elapsed_time(end)) if cuda else None
        predictions, params, velocity, scores = out.bring_back()  # argmax on the device, then one copy
        final_parameters = k.unpack_states(params, depth, "final parameters")  # padding checked at once
        final_velocity = k.unpack_states(velocity, depth, "final velocity")
        self.launches += 1
        self.tasks_run += count
        extra.update({
            "tasks_in_launch": count,
            "datasets_in_launch": int(data["train"].shape[0]),
            "datasets_staged": staged,
            "chunk": choice.chunk,
            "num_warps": choice.num_warps,
            "precision": choice.precision,
            "variant": choice.variant,
            "tuned_row": self.tuned.row,
            "interpreted": self.interpret,
        })
        if launch_ms is not None:
            extra["launch_cuda_ms"] = launch_ms
            extra["cuda_ms_share_per_task"] = launch_ms / count
        return [
            RunOutput(
                final_parameters=final_parameters[i],
                final_velocity=final_velocity[i],
                scores=np.ascontiguousarray(scores[i]),
                training_prediction_seconds=t2 - t1,
                preparation_seconds=t1 - t0,
                cuda_ms=launch_ms,
                extra=dict(extra),
                predictions=predictions[i],
            )
            for i in range(count)
        ]

    def _one(self, data: dict, out: LaunchOutputs, size: int, m: int, common: dict):
        """fused_train.py: one program per task, one launch (reset, every step, predict)."""
        k, count = self.kernel, out.count
        f32 = dict(dtype=torch.float32, device=self.torch_device)
        grads = torch.empty((count, size), **f32)  # scratch, written before it is read
        scratch = torch.empty((count, k.scratch_size(common["chunk"])), **f32)  # staged operands
        common = {**common, "n_test": m, "data_index": data["index"]}

        def run(warmup: bool):
            # the parameters and velocity are written by the kernel's reset
            args = (data["train"], data["labels"], data["perms"], data["test"], data["init"], out.params, out.velocity,
                    grads, scratch, out.scores)
            if warmup:
                touch_launcher(k.launch(*args, **common, warmup=True))
                return
            k.launch(*args, **common)

        return run, {"launches_per_task_run": 1}

    def _split(self, data: dict, out: LaunchOutputs, size: int, m: int, common: dict):
        """fused_rows.py then fused_update.py once per step (grids: the minibatch's chunks x tasks,
        the weights x tasks), then fused_predict.py over the queries; the reset (parameters <-
        initial, velocity <- 0) is inside the timing too, as in the one-program kernel."""
        rk, uk, pk, count = self.rows_kernel, self.update_kernel, self.predict_kernel, out.count
        f32 = dict(dtype=torch.float32, device=self.torch_device)
        n, bs, chunk, depth = common["n_train"], common["batch_size"], common["chunk"], common["depth"]
        n_steps = common["n_epochs"] * -(-n // bs)
        nprog = rk.programs_per_task(bs, chunk)
        bpad = nprog * chunk
        params, velocity, scores, index = out.params, out.velocity, out.scores, data["index"]
        grads = torch.empty((count, size), **f32)  # scratch, written before it is read
        rows = torch.empty((count, self.kernel.rows_size(depth, bpad)), **f32)
        scratch = torch.empty((count, nprog, self.kernel.scratch_size(chunk)), **f32)
        qscratch = torch.empty((count, pk.query_programs(m, chunk), self.kernel.scratch_size(chunk)), **f32)
        row_args = (data["train"], data["labels"], data["perms"], params, rows, scratch)
        row_meta = dict(n_train=n, n_epochs=common["n_epochs"], batch_size=bs, alpha=common["alpha"], depth=depth,
                        chunk=chunk, num_warps=common["num_warps"], precision=common["precision"])
        update_meta = dict(bpad=bpad, n_train=n, batch_size=bs, learning_rate=common["learning_rate"],
                           momentum=common["momentum"], weight_decay=common["weight_decay"], depth=depth,
                           num_warps=common["num_warps"], precision=common["precision"])
        predict = dict(param_stride=size, n_test=m, alpha=common["alpha"], depth=depth, chunk=chunk,
                       num_warps=common["num_warps"], precision=common["precision"])

        def run(warmup: bool):
            if warmup:
                touch_launcher(rk.launch_rows(*row_args, step=0, warmup=True, data_index=index, **row_meta))
                touch_launcher(uk.launch_update(params, velocity, grads, rows, step=0, warmup=True, **update_meta))
                touch_launcher(pk.launch_predict(data["test"], params, qscratch, scores, warmup=True, data_index=index,
                                                 **predict))
                return
            params.copy_(data["init"])
            velocity.zero_()
            for step in range(n_steps):
                rk.launch_rows(*row_args, step=step, data_index=index, **row_meta)
                uk.launch_update(params, velocity, grads, rows, step=step, **update_meta)
            pk.launch_predict(data["test"], params, qscratch, scores, data_index=index, **predict)

        return run, {"launches_per_task_run": 2 * n_steps + 1, "programs_per_task": nprog}


class PrecisionView:
    """A fused backend that runs every task at one product precision (a request's ``?precision=``):
    what the service's device worker hands ``run_task`` and ``run_many``."""

    def __init__(self, backend: FusedBackend, precision: str):
        self.backend, self.precision = backend, precision
        self.name, self.device = backend.name, backend.device

    def describe(self) -> dict:
        return {**self.backend.describe(), "precision": self.precision}

    def run(self, task: TaskArrays, prepared: Prepared) -> RunOutput:
        return self.backend.run(task, prepared, self.precision)

    def run_many(self, tasks: list[TaskArrays], prepareds: list[Prepared]) -> list[RunOutput]:
        return self.backend.run_many(tasks, prepareds, self.precision)


# --------------------------------------------------------------------------- self-check for ``auto``

_ready: tuple[bool, str] | None = None
_ready_lock = threading.Lock()


def self_check(device: str = "cuda") -> tuple[bool, str]:
    """Train two small synthetic tasks on the fused kernel and compare with the cpu backend.

    Passes when final parameters and velocity are within (2e-5, 3e-3) of the cpu backend,
    predictions are equal, and a 2-task launch is byte-identical to the two single launches.
    The tasks use the default config on 300 training rows (minibatches 128, 128, 44: the
    kernel variant the service runs most), so it also compiles that variant.
    """
    from ..reference_check import TOLERANCE, max_violation
    from ..taskio import validate_task
    from ..train import prepare
    from .cpu import CpuBackend

    try:
        backend = FusedBackend(device)
        rng = np.random.default_rng(20260914)
        tasks = [
            validate_task(rng.random((300, 1, 9, 9), dtype=np.float32), rng.integers(0, 10, 300).astype(np.int64),
                          rng.random((50, 1, 9, 9), dtype=np.float32))
            for _ in range(2)
        ]
        configs = [Config(), Config(seed=12)]
        prepareds = [prepare(t, c) for t, c in zip(tasks, configs)]
        singles = [backend.run(t, p) for t, p in zip(tasks, prepareds)]
        batched = backend.run_many(tasks, prepareds)
        cpu = CpuBackend()
        for i, (task, prep, out, both) in enumerate(zip(tasks, prepareds, singles, batched)):
            ref = cpu.run(task, prep)
            ok_p, err_p = max_violation(out.final_parameters, ref.final_parameters, **TOLERANCE)
            ok_v, err_v = max_violation(out.final_velocity, ref.final_velocity, **TOLERANCE)
            if not (ok_p and ok_v):
                return False, f"task {i}: state differs from the cpu backend (max abs error {max(err_p, err_v):.3g})"
            if not np.array_equal(out.scores.argmax(1), ref.scores.argmax(1)):
                return False, f"task {i}: predictions differ from the cpu backend"
            same = out.scores.tobytes() == both.scores.tobytes() and all(
                a.tobytes() == b.tobytes()
                for a, b in zip(out.final_parameters + out.final_velocity, both.final_parameters + both.final_velocity)
            )
            if not same:
                return False, f"task {i}: the 2-task launch differs from its single launch"
        return True, f"fused kernel agrees with the cpu backend on {device}"
    except Exception as exc:  # any failure (no triton, compile error, ...) means: do not pick fused
        return False, f"{type(exc).__name__}: {exc}"


def fused_ready() -> bool:
    """Whether ``auto`` may pick the fused backend: CUDA, triton, and a passed self-check (once)."""
    global _ready
    with _ready_lock:
        if _ready is None:
            if not torch.cuda.is_available():
                _ready = (False, "no CUDA GPU")
            else:
                _ready = self_check("cuda")
                (log.info if _ready[0] else log.warning)("fused backend self-check: %s", _ready[1])
        return _ready[0]


def readiness() -> tuple[bool, str] | None:
    """The self-check's outcome, or None if it has not run in this process."""
    return _ready
