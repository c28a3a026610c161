"""A launch's results checked, hashed and assembled in a process of its own (REV88_FINISH_PROCESS).

The finishing of a launch (``app.tasks.device.finish_launch``: each task's non-finite checks, its
predictions and every SHA-256 the metadata names, ~575 KB hashed a cell, and its metadata) is
work that needs nothing of the server but the launch's buffers, and most of it is Python that
holds the server's GIL -- with the loop, the ledger's writes and the claims, the host's serial
part (docs/performance.md, "The host's ceiling"). Here it runs in one child process, spawned once:

    the server (the finisher thread)         the child
    the launch's buffers copied once into    each task's result finished by the same code
    shared memory; the small facts pickled   (``learner.result.finish_task``, its large hashes on
                                             a pool of threads); its predictions written back
    each task's result rebuilt around its    into the shared memory; its metadata returned
    own buffers, its run_count counted here

The answers are the same, byte for byte, as the in-thread finishing's (tests/test_finish_process.py):
the child adopts the server's validation and versions and touches no device. A task whose
finishing fails in the child (a diverged run, a backend's bad predictions) is finished again here,
in the thread, where it meets its own error as it would have; a child that dies is said loudly
and the finishing goes on in the thread. Off by default: it costs a process and a copy of every
launch's outputs, and pays where a launch's cells outrun the host (many cores, a GPU).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import threading
from multiprocessing import shared_memory
from typing import Any

import numpy as np

log = logging.getLogger("rev88." + __name__)

SPAWN_TIMEOUT_S = 120.0  # the child's first answer (its imports: torch) at the latest


@dataclasses.dataclass(frozen=True)
class Facts:
    """What the child needs of one task besides its buffers."""

    config: Any
    train_count: int
    test_count: int
    input_hashes: dict
    permutation_sha256: list
    initial_sha256: dict
    host_prep: float
    shapes: list[tuple[int, ...]]  # its parameters'
    training_prediction_seconds: float
    preparation_seconds: float
    cuda_ms: float | None
    extra: dict | None


def _child(conn: Any, validation: dict, versions: dict) -> None:
    """The child's loop: a launch's buffers and facts in, one metadata dict (or None: finish it
    where you are) per task out; None ends it."""
    import concurrent.futures
    import types

    from learner import result
    from learner.backends.base import RunOutput

    result.adopt(validation, versions)
    hashers = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="rev88-finish-hash")
    conn.send("ready")
    while True:
        message = conn.recv()
        if message is None:
            return
        names, layout, facts, engine, count = message
        blocks = [shared_memory.SharedMemory(name=name) for name in names]
        try:
            scores, params, velocity, predictions, known = (
                np.ndarray(shape, dtype, buffer=block.buf) for block, (shape, dtype) in zip(blocks, layout))
            outs = []
            for i, f in enumerate(facts):
                cuts = np.cumsum([int(np.prod(s)) for s in f.shapes])[:-1]
                outs.append(RunOutput(
                    final_parameters=[p.reshape(s) for p, s in zip(np.split(params[i], cuts), f.shapes)],
                    final_velocity=[v.reshape(s) for v, s in zip(np.split(velocity[i], cuts), f.shapes)],
                    scores=scores[i], training_prediction_seconds=f.training_prediction_seconds,
                    preparation_seconds=f.preparation_seconds, cuda_ms=f.cuda_ms, extra=f.extra,
                    predictions=predictions[i] if known[i] else None))
            digests = [hashers.submit(result.large_digests, out) for out in outs]
            metadata: list[dict | None] = []
            for i, (f, out) in enumerate(zip(facts, outs)):
                task = types.SimpleNamespace(train_count=f.train_count, test_count=f.test_count,
                                             input_hashes=lambda f=f: dict(f.input_hashes))
                prepared = types.SimpleNamespace(cancel=None, permutation_sha256=f.permutation_sha256,
                                                 initial_sha256=f.initial_sha256)
                try:
                    done = result.finish_task(task, f.config, engine, prepared, out, f.host_prep,
                                              tasks_in_launch=count, large_sha256=digests[i].result())
                except Exception:  # noqa: BLE001 - finished again in the server, which meets its error
                    metadata.append(None)
                    continue
                predictions[i] = done.predictions
                metadata.append(done.metadata)
            del scores, params, velocity, predictions, known, outs
        finally:
            for block in blocks:
                block.close()
        conn.send(metadata)


class FinishProcess:
    """The child process and the shared memory a launch's buffers go through. ``finish`` is
    ``finish_launch``'s equal; called from one thread at a time (the finisher's)."""

    def __init__(self, validation: dict, versions: dict) -> None:
        ctx = multiprocessing.get_context("spawn")  # (never fork a process with threads and a device)
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_child, args=(child, validation, versions), name="rev88-finish",
                                 daemon=True)
        self._proc.start()
        child.close()
        self._blocks: list[shared_memory.SharedMemory] = []
        self._lock = threading.Lock()
        self.broken: str | None = None  # why the child is no longer used
        self.counters = {"launches": 0, "tasks": 0, "finished_here": 0}
        if not self._conn.poll(SPAWN_TIMEOUT_S) or self._conn.recv() != "ready":
            self.close()
            raise RuntimeError(f"the finishing process did not start within {SPAWN_TIMEOUT_S:g} s")

    def finish(self, launch: Any, pool: Any = None) -> list:
        """A launch's outcomes, as ``app.tasks.device.finish_launch`` gives them."""
        from .device import finish_launch

        runs = [(i, run) for i, run in enumerate(launch.runs) if isinstance(run, tuple)]
        if self.broken is not None or len(runs) < 2 or not _alike(runs):
            return finish_launch(launch, pool)
        with self._lock:
            try:
                metadata = self._send(launch, runs)
            except Exception as exc:  # noqa: BLE001 - the child died or answered nonsense: not used again
                self.broken = f"{type(exc).__name__}: {exc}"
                log.error("the finishing process failed; launches are finished in the server from now on",
                          extra={"error": self.broken})
                return finish_launch(launch, pool)
            predictions = self._arrays(len(runs), self._layout(runs))[3]
            done = {i: (metadata[k], predictions[k].copy()) for k, (i, _) in enumerate(runs)}
        self.counters["launches"] += 1
        self.counters["tasks"] += len(runs)
        return self._outcomes(launch, done, pool)

    # ------------------------------------------------------------------ this side
    @staticmethod
    def _layout(runs: list) -> list[tuple[tuple[int, ...], str]]:
        out = runs[0][1][3]
        size = sum(int(np.prod(p.shape)) for p in out.final_parameters)
        n, m = len(runs), out.scores.shape[0]
        return [((n, *out.scores.shape), "float32"), ((n, size), "float32"), ((n, size), "float32"),
                ((n, m), "int64"), ((n,), "bool")]

    def _arrays(self, n: int, layout: list) -> list[np.ndarray]:
        return [np.ndarray(shape, dtype, buffer=block.buf) for block, (shape, dtype) in zip(self._blocks, layout)]

    def _send(self, launch: Any, runs: list) -> list[dict | None]:
        from learner.hashing import array_sha256, named_sha256
        from learner.train import parameter_names

        layout = self._layout(runs)
        sizes = [int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in layout]
        if len(self._blocks) != len(sizes) or any(b.size < s for b, s in zip(self._blocks, sizes)):
            self._free()
            self._blocks = [shared_memory.SharedMemory(create=True, size=max(s, 1)) for s in sizes]
        scores, params, velocity, predictions, known = self._arrays(len(runs), layout)
        facts = []
        for k, (_, (task, config, prepared, out, host_prep)) in enumerate(runs):
            scores[k] = out.scores  # (one copy each: as a device's outputs are copied into buffers it keeps)
            np.concatenate([p.ravel() for p in out.final_parameters], out=params[k])
            np.concatenate([v.ravel() for v in out.final_velocity], out=velocity[k])
            known[k] = out.predictions is not None
            if known[k]:
                predictions[k] = out.predictions
            names = parameter_names(config.depth)
            facts.append(Facts(
                config=config, train_count=task.train_count, test_count=task.test_count,
                input_hashes=task.input_hashes(),
                permutation_sha256=(list(prepared.permutation_sha256) if prepared.permutation_sha256 is not None
                                    else [array_sha256(p) for p in prepared.permutations]),
                initial_sha256=(dict(prepared.initial_sha256) if prepared.initial_sha256 is not None
                                else named_sha256(names, prepared.initial)),
                host_prep=host_prep, shapes=[tuple(p.shape) for p in out.final_parameters],
                training_prediction_seconds=out.training_prediction_seconds,
                preparation_seconds=out.preparation_seconds, cuda_ms=out.cuda_ms, extra=out.extra))
        del scores, params, velocity, predictions, known
        engine = _Engine(launch.engine.name, launch.engine.device)
        self._conn.send(([b.name for b in self._blocks], layout, facts, engine, len(runs)))
        if not self._conn.poll(SPAWN_TIMEOUT_S):
            raise OSError(f"no answer from the finishing process within {SPAWN_TIMEOUT_S:g} s")
        metadata = self._conn.recv()
        if not isinstance(metadata, list) or len(metadata) != len(runs):
            raise ValueError("the finishing process answered another launch")
        return metadata

    def _outcomes(self, launch: Any, done: dict, pool: Any) -> list:
        """One outcome per item, in order, as finish_launch's: a cancelled task's TaskCancelled,
        a finished one's DeviceOutcome (its run_count counted here), one the child could not
        finish finished here (its error, or its result)."""
        from learner.cancel import check as check_cancel
        from learner.errors import TaskCancelled
        from learner.result import TaskResult, finish_task, next_run_count

        from .device import DeviceOutcome

        count = len(done)
        outcomes: list = []
        for i, run in enumerate(launch.runs):
            if not isinstance(run, tuple):
                outcomes.append(run)
                continue
            task, config, prepared, out, host_prep = run
            item = launch.items[i]
            cancel = item[2] if len(item) > 2 else None
            if cancel is not None and cancel.cancelled:
                outcomes.append(TaskCancelled(cancel.reason or "cancelled", config.epochs, 0, config.epochs))
                continue
            metadata, predictions = done[i]
            try:
                if metadata is None:
                    self.counters["finished_here"] += 1
                    result = finish_task(task, config, launch.engine, prepared, out, host_prep,
                                         tasks_in_launch=count)
                else:
                    check_cancel(prepared.cancel, config.epochs, 0, config.epochs)
                    metadata["run_count"] = next_run_count(launch.engine.name)
                    result = TaskResult(predictions, out.scores, out.final_parameters, out.final_velocity, metadata)
            except Exception as exc:  # noqa: BLE001 - this task's answer
                outcomes.append(exc)
                continue
            outcomes.append(DeviceOutcome(result, launch.share, launch.reason))
        return outcomes

    def _free(self) -> None:
        for block in self._blocks:
            block.close()
            block.unlink()
        self._blocks = []

    def close(self) -> None:
        """The child ended and the shared memory freed (the service's stop)."""
        with self._lock:
            try:
                self._conn.send(None)
            except (OSError, ValueError):
                pass
            self._proc.join(5)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(5)
            self._conn.close()
            self._free()


def _alike(runs: list) -> bool:
    """Whether a launch's outputs share one layout (its tasks one shape and depth), as a launch's do."""
    first = runs[0][1][3]
    shapes = [p.shape for p in first.final_parameters]
    return all(run[3].scores.shape == first.scores.shape and [p.shape for p in run[3].final_parameters] == shapes
               and len(run[3].final_velocity) == len(shapes) for _, run in runs)


@dataclasses.dataclass(frozen=True)
class _Engine:
    """The engine as a result's metadata names it (the child runs none)."""

    name: str
    device: str
