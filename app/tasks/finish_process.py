"""What reads a launch's buffers done in a process of its own (REV88_FINISH_PROCESS).

Finishing a launch (``app.tasks.device.finish_launch``) reads each task's buffers -- the checks
for non-finite entries, its predictions and every SHA-256 the metadata names, ~575 KB hashed a
cell -- then assembles its metadata. The reading needs nothing of the server but the buffers, and
part of it is Python that holds the server's GIL with the loop, the ledger's writes and the claims:
the host's serial part (docs/performance.md, "The host's ceiling"). Here it runs in one child
process, spawned once:

    the server (the finisher thread)             the child
    the launch's buffers copied once into        each task's ``learner.result.run_digests`` (on two
    shared memory                                threads); its predictions written back into the
                                                 shared memory; its digests returned
    each task finished by the same
    ``finish_task``, given those digests: its cancel, divergence, run count and metadata decided here

So the answers are the same, byte for byte, as the in-thread finishing's
(tests/test_finish_process.py), and the child touches no device. A task the child cannot read (a
backend's bad predictions) is finished here entirely, where it meets its own error; a child that
dies is said loudly and the finishing goes on in the server. Off by default: it costs a process
and a copy of every launch's outputs (measured: docs/performance.md).
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
from multiprocessing import shared_memory
from typing import Any

import numpy as np

log = logging.getLogger("rev88." + __name__)

SPAWN_TIMEOUT_S = 120.0  # the child's first answer (its imports: torch) at the latest


def _child(conn: Any) -> None:
    """The child's loop: a launch's buffers in; for each task its digests (``run_digests``: its
    non-finite buffers and SHA-256s; its predictions written back into the shared memory) or
    None (finish it where you are); None ends it."""
    import concurrent.futures
    import functools

    import learner.backends.base  # noqa: F401 - (imported now, before "ready": torch's import is not a launch's)
    import learner.result  # noqa: F401

    readers = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="rev88-finish-read")
    conn.send("ready")
    while True:
        message = conn.recv()
        if message is None:
            return
        names, layout, depth, shapes = message
        blocks = [shared_memory.SharedMemory(name=name) for name in names]
        try:
            arrays = [np.ndarray(shape, dtype, buffer=block.buf) for block, (shape, dtype) in zip(blocks, layout)]
            answers = list(readers.map(functools.partial(_read, arrays, depth, shapes), range(len(arrays[4]))))
            del arrays
        finally:
            for block in blocks:
                block.close()
        conn.send(answers)


def _read(arrays: list[np.ndarray], depth: int, shapes: list[tuple[int, ...]], i: int) -> tuple | None:
    """(the child) Task ``i``'s digests from the launch's buffers."""
    from learner.backends.base import RunOutput
    from learner.result import run_digests

    scores, params, velocity, predictions, known = arrays
    cuts = np.cumsum([int(np.prod(s)) for s in shapes])[:-1]
    out = RunOutput(final_parameters=[p.reshape(s) for p, s in zip(np.split(params[i], cuts), shapes)],
                    final_velocity=[v.reshape(s) for v, s in zip(np.split(velocity[i], cuts), shapes)],
                    scores=scores[i], training_prediction_seconds=0.0, preparation_seconds=0.0,
                    predictions=predictions[i] if known[i] else None)
    try:
        made = run_digests(out, depth)
    except Exception:  # noqa: BLE001 - finished again in the server, which meets its error
        return None
    if made.predictions is not None and not known[i]:
        predictions[i] = made.predictions
    return made.non_finite, made.hashes


class FinishProcess:
    """The child process and the shared memory a launch's buffers go through. ``finish`` is
    ``finish_launch``'s equal; called from one thread at a time (the finisher's)."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # (never fork a process with threads and a device)
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_child, args=(child,), name="rev88-finish",
                                 daemon=True)
        self._proc.start()
        child.close()
        self._blocks: list[shared_memory.SharedMemory] = []
        self._lock = threading.Lock()
        self.broken: str | None = None  # why the child is no longer used
        self.counters = {"launches": 0, "tasks": 0, "finished_here": 0}
        try:
            started = self._conn.poll(SPAWN_TIMEOUT_S) and self._conn.recv() == "ready"
        except (EOFError, OSError):  # it ended at its start (its error is on stderr)
            started = False
        if not started:
            self.close()
            raise RuntimeError(f"the finishing process did not start within {SPAWN_TIMEOUT_S:g} s (a main "
                               "module that runs its work on import, without `if __name__ == \"__main__\"`, stops it)")

    def finish(self, launch: Any, pool: Any = None) -> list:
        """A launch's outcomes, as ``app.tasks.device.finish_launch`` gives them."""
        from .device import finish_launch

        runs = [(i, run) for i, run in enumerate(launch.runs) if isinstance(run, tuple)]
        if self.broken is not None or len(runs) < 2 or not _alike(runs):
            return finish_launch(launch, pool)
        with self._lock:
            try:
                made = self._send(launch, runs)
            except Exception as exc:  # noqa: BLE001 - the child died or answered nonsense: not used again
                self.broken = f"{type(exc).__name__}: {exc}"
                log.error("the finishing process failed; launches are finished in the server from now on",
                          extra={"error": self.broken})
                return finish_launch(launch, pool)
            predictions = self._arrays(len(runs), self._layout(runs))[3]
            done = {i: (made[k], predictions[k].copy()) for k, (i, _) in enumerate(runs)}
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

    def _send(self, launch: Any, runs: list) -> list[tuple | None]:
        layout = self._layout(runs)
        sizes = [int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in layout]
        if len(self._blocks) != len(sizes) or any(b.size < s for b, s in zip(self._blocks, sizes)):
            self._free()
            self._blocks = [shared_memory.SharedMemory(create=True, size=max(s, 1)) for s in sizes]
        scores, params, velocity, predictions, known = self._arrays(len(runs), layout)
        here = set()  # tasks whose backend's predictions are not what they must be: finished here, to meet that
        for k, (_, run) in enumerate(runs):
            out = run[3]
            scores[k] = out.scores  # (one copy each: as a device's outputs are copied into buffers it keeps)
            np.concatenate([p.ravel() for p in out.final_parameters], out=params[k])
            np.concatenate([v.ravel() for v in out.final_velocity], out=velocity[k])
            given = None if out.predictions is None else np.asarray(out.predictions)
            known[k] = given is not None
            if given is not None and (given.dtype != np.int64 or given.shape != predictions[k].shape):
                here.add(k)
            elif given is not None:
                predictions[k] = given
        del scores, params, velocity, predictions, known
        first = runs[0][1]
        self._conn.send(([b.name for b in self._blocks], layout, first[1].depth,
                         [tuple(p.shape) for p in first[3].final_parameters]))
        if not self._conn.poll(SPAWN_TIMEOUT_S):
            raise OSError(f"no answer from the finishing process within {SPAWN_TIMEOUT_S:g} s")
        made = self._conn.recv()
        if not isinstance(made, list) or len(made) != len(runs):
            raise ValueError("the finishing process answered another launch")
        return [None if k in here else m for k, m in enumerate(made)]

    def _outcomes(self, launch: Any, done: dict, pool: Any) -> list:
        """One outcome per item, in order, as finish_launch's: each task finished by the same
        ``finish_task``, with the digests the child made (its cancel, its divergence, its run count
        and metadata all decided here); one the child could not read finished here entirely."""
        from learner.errors import TaskCancelled
        from learner.result import Digests, finish_task

        from .device import DeviceOutcome

        count = len(done)
        outcomes: list = []
        for i, run in enumerate(launch.runs):
            if not isinstance(run, tuple):
                outcomes.append(run)  # (its error, or a cancel before the launch)
                continue
            task, config, prepared, out, host_prep = run
            item = launch.items[i]
            cancel = item[2] if len(item) > 2 else None
            if cancel is not None and cancel.cancelled:
                outcomes.append(TaskCancelled(cancel.reason or "cancelled", config.epochs, 0, config.epochs))
                continue
            made, predictions = done[i]
            if made is None:
                self.counters["finished_here"] += 1
            digests = None if made is None else Digests(None if made[0] else predictions, made[0], made[1])
            try:
                result = finish_task(task, config, launch.engine, prepared, out, host_prep, tasks_in_launch=count,
                                     digests=digests)
            except Exception as exc:  # noqa: BLE001 - this task's answer (a diverged run, say)
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


