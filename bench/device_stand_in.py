"""A stand-in device for the host's cost alone (issue #46), for the benchmarks only (never a backend).

On a GPU the fused kernel trains a launch of 132 draw-0 tasks in ~28 ms; here nothing trains that
fast, so the service's host path (claims, preparation, answers, hashes, ledger writes) cannot be
pushed to a GPU's rate with a real backend. ``ReplayDevice`` stands in for the device: for each
task of a launch it returns the real output of that (dataset, config, seed) -- computed earlier
by cpu-fast and kept in .npy files (``precompute``; the server reads them whole into memory), its predictions with it as a GPU
backend computes them beside its scores -- after a fixed device time per
launch (its replay included; the rest a sleep: it costs no CPU). Answers and hashes are therefore
real and checked, and the
server's CPU measures the host's work: the replay's own CPU (reading the kept outputs) is counted
apart (``replay_cpu_s``, written after every launch to the file $REV88_STAND_IN_STATS names) and
subtracted by the bench.

    python bench/device_stand_in.py serve --backend cpu-fast --batch-max 132 ...

is the real ``rev88 serve`` command line with every cpu-fast backend the service creates replaced
by the stand-in (its kept outputs: $REV88_STAND_IN_DIR; its device time per launch:
$REV88_STAND_IN_LAUNCH_MS, default 132). A launch's task whose output was not kept fails, naming
it; a single task whose output was not kept (the warm-up's) really runs on cpu-fast.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RING_ROWS = 132  # the output buffers' rows (the bench's --batch-max; a larger launch gets buffers of its own)
DIR_ENV, LAUNCH_ENV, STATS_ENV = "REV88_STAND_IN_DIR", "REV88_STAND_IN_LAUNCH_MS", "REV88_STAND_IN_STATS"


def key_of(task, config) -> str:
    """A task's output key: its training images' hash and its whole config."""
    return hashlib.sha256((task.input_hashes()["train_images"] + json.dumps(config.as_dict(), sort_keys=True))
                          .encode()).hexdigest()


def _compute(args) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """(row, scores, final parameters, final velocity) of one cell on cpu-fast (a worker process)."""
    row, body, config_dict = args
    from learner.backends import get_backend
    from learner.config import make_config
    from learner.taskio import load_task
    from learner.train import prepare

    task = _TASKS.get(body) or _TASKS.setdefault(body, load_task(body))
    config = make_config(config_dict)
    out = get_backend("cpu-fast").run(task, prepare(task, config))
    return row, out.scores, np.concatenate([p.ravel() for p in out.final_parameters]), \
        np.concatenate([v.ravel() for v in out.final_velocity])


_TASKS: dict = {}


def precompute(folder: Path, cells: list[tuple[bytes, dict]], processes: int = 2) -> dict:
    """Keep cpu-fast's output of each (npz body, config) in ``folder`` (skipped when an index of
    the same cells is there already). Returns the index."""
    from learner.config import make_config
    from learner.taskio import load_task

    folder.mkdir(parents=True, exist_ok=True)
    tasks = {}
    keys = []
    for body, config in cells:
        digest = hashlib.sha256(body).hexdigest()
        if digest not in tasks:
            tasks[digest] = load_task(body)
        keys.append(key_of(tasks[digest], make_config(config)))
    index_path = folder / "index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
        if index["keys"] == keys:
            _keep_predictions(folder)
            return index
    first = tasks[hashlib.sha256(cells[0][0]).hexdigest()]
    m = first.test_count
    size = sum(p.size for p in _shapes(make_config(cells[0][1])))
    scores = np.lib.format.open_memmap(folder / "scores.npy", "w+", np.float32, (len(cells), m, 10))
    params = np.lib.format.open_memmap(folder / "params.npy", "w+", np.float32, (len(cells), size))
    velocity = np.lib.format.open_memmap(folder / "velocity.npy", "w+", np.float32, (len(cells), size))
    import multiprocessing

    jobs = [(row, body, config) for row, (body, config) in enumerate(cells)]
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        for row, s, p, v in pool.imap_unordered(_compute, jobs, chunksize=8):
            scores[row], params[row], velocity[row] = s, p, v
    for mm in (scores, params, velocity):
        mm.flush()
    index = {"keys": keys, "shapes": [list(p.shape) for p in _shapes(make_config(cells[0][1]))]}
    _keep_predictions(folder)
    index_path.write_text(json.dumps(index))
    return index


def _keep_predictions(folder: Path) -> None:
    """Each kept output's predictions too (what a GPU backend computes beside its scores, on the
    device: the fused kernel's ``RunOutput.predictions``)."""
    path = folder / "predictions.npy"
    if path.exists():
        return
    scores = np.load(folder / "scores.npy", mmap_mode="r")
    predictions = np.lib.format.open_memmap(path, "w+", np.uint8, scores.shape[:2])
    for row in range(scores.shape[0]):
        predictions[row] = np.asarray(scores[row]).argmax(axis=1)
    predictions.flush()


def _shapes(config) -> list[np.ndarray]:
    from learner.train import initial_parameters

    return [p.numpy() for p in initial_parameters(config)]


class ReplayDevice:
    """cpu-fast's name and device; ``run`` and ``run_many`` replay the kept outputs after the
    launch's device time."""

    def __init__(self, inner, folder: Path, launch_s: float, stats: Path | None = None) -> None:
        self.inner, self.stats = inner, stats
        self.name, self.device = inner.name, inner.device
        self.launch_s = launch_s
        index = json.loads((folder / "index.json").read_text())
        self.rows = {k: i for i, k in enumerate(index["keys"])}
        self.shapes = [tuple(s) for s in index["shapes"]]
        ends = np.cumsum([int(np.prod(shape)) for shape in self.shapes]).tolist()
        self.cuts = list(zip([0, *ends[:-1]], ends))  # each array's columns in a flat state
        # read whole into memory once (~700 MB for the bench's defaults), as a device's outputs are there
        # when its launch ends: a launch's replay from a memory map could wait for the disk
        self.scores = np.load(folder / "scores.npy")
        self.params = np.load(folder / "params.npy")
        self.velocity = np.load(folder / "velocity.npy")
        self.predictions = np.load(folder / "predictions.npy")
        self.launches = self.tasks = 0
        self.replay_cpu_s = 0.0
        self.spans: list[tuple[float, float, int]] = []  # the last launches' (start, end: unix seconds; tasks)
        self._lock = threading.Lock()
        # a launch running, the one before it being finished, the one before that's answers perhaps still held
        self._ring: list[tuple[np.ndarray, ...]] = [self._new_buffers(RING_ROWS) for _ in range(3)]

    def describe(self) -> dict:
        return {**self.inner.describe(), "stand_in": "replay (bench/device_stand_in.py)",
                "launch_ms": self.launch_s * 1000.0, "launches": self.launches, "tasks": self.tasks,
                "replay_cpu_s": round(self.replay_cpu_s, 6)}

    def _buffers(self, n: int) -> tuple[np.ndarray, ...]:
        """Host buffers for a launch's ``n`` outputs, reused once nothing of an earlier launch's
        answers holds them (a GPU backend copies into buffers it keeps too; fresh ones would cost
        this VM's first touch of their pages, ~0.4 s for a launch's 53 MB of scores)."""
        with self._lock:
            for ring in self._ring:
                if len(ring[0]) >= n and all(sys.getrefcount(a) <= 3 for a in ring):  # (the ring's, the loop's, the call's)
                    return tuple(a[:n] for a in ring)
            ring = self._new_buffers(n)
            self._ring.append(ring)
            return tuple(a[:n] for a in ring)

    def _new_buffers(self, n: int) -> tuple[np.ndarray, ...]:
        rows = max(n, RING_ROWS)
        ring = (np.empty((rows, *self.scores.shape[1:]), np.float32), np.empty((rows, self.params.shape[1]), np.float32),
                np.empty((rows, self.velocity.shape[1]), np.float32), np.empty((rows, self.predictions.shape[1]), np.int64))
        for a in ring:
            a.fill(0)  # (its pages touched now, once)
        return ring

    def _row(self, task, prepared) -> int:
        row = self.rows.get(key_of(task, prepared.config))
        if row is None:
            raise RuntimeError(f"the stand-in device kept no output for config {prepared.config.as_dict()} "
                               "(bench/device_stand_in.py precompute)")
        return row

    def _split(self, flat: np.ndarray) -> list[list[np.ndarray]]:
        """(T, n) flat states -> each task's arrays, views of ``flat`` (each one C-contiguous), cut
        once per launch as a GPU backend unpacks its launch's states (learner/kernels/fused_parts.py)."""
        kinds = [flat[:, a:b].reshape(len(flat), *shape) for (a, b), shape in zip(self.cuts, self.shapes)]
        return [[kind[i] for kind in kinds] for i in range(len(flat))]

    def run(self, task, prepared):
        if key_of(task, prepared.config) not in self.rows:  # (the warm-up's tiny task, say: really run)
            return self.inner.run(task, prepared)
        return self.run_many([task], [prepared])[0]

    def run_many(self, tasks, prepareds):
        """The launch's outputs read as a GPU's come back, in one copy per array (numpy's ``take``
        leaves the GIL to the host's threads meanwhile, as a device copy does), each task's a view
        of them: the replay holds the GIL as little as it can, so the host's threads do not slow
        the stand-in's launch past its device time (they would not slow a GPU's)."""
        from learner.backends.base import RunOutput

        t0, w0, started = time.thread_time(), time.monotonic(), time.time()
        rows = np.array([self._row(t, p) for t, p in zip(tasks, prepareds)], dtype=np.intp)
        scores, params, velocity, predictions = self._buffers(len(rows))
        for kept, out in ((self.scores, scores), (self.params, params), (self.velocity, velocity)):
            np.take(kept, rows, axis=0, out=out, mode="clip")  # (not "raise": it buffers `out`)
        predictions[...] = np.take(self.predictions, rows, axis=0)
        outs = [RunOutput(final_parameters=p, final_velocity=v, scores=scores[i],
                          training_prediction_seconds=self.launch_s, preparation_seconds=0.0,
                          predictions=predictions[i])
                for i, (p, v) in enumerate(zip(self._split(params), self._split(velocity)))]
        with self._lock:
            self.launches += 1
            self.tasks += len(tasks)
            self.replay_cpu_s += time.thread_time() - t0  # (the replay)
        # the launch takes launch_s in all, its replay included: the rest of it asleep (no CPU)
        time.sleep(max(0.0, self.launch_s - (time.monotonic() - w0)))
        with self._lock:
            self.spans = [*self.spans[-255:], (started, time.time(), len(tasks))]
            self._write_stats()
        return outs

    def _write_stats(self) -> None:
        """The stats file, after every launch (its write's CPU counted as the replay's: not the host's)."""
        t1 = time.thread_time()
        if self.stats is not None:
            tmp = self.stats.with_suffix(".tmp")
            tmp.write_text(json.dumps({"launches": self.launches, "tasks": self.tasks,
                                       "replay_cpu_s": self.replay_cpu_s, "spans": self.spans,
                                       "buffers": len(self._ring)}))
            tmp.replace(self.stats)
        self.replay_cpu_s += time.thread_time() - t1


def stand_in_engines(folder: Path, launch_s: float, stats: Path | None = None):
    from learner.backends import get_backend

    cache: dict[tuple, ReplayDevice] = {}
    lock = threading.Lock()

    def engines(name: str, device: str | None = None):
        inner = get_backend(name, device)
        if inner.name != "cpu-fast":
            return inner
        with lock:
            key = (inner.name, inner.device)
            if key not in cache:
                cache[key] = ReplayDevice(inner, folder, launch_s, stats)
            return cache[key]

    return engines


def main(argv: list[str]) -> int:
    import app.service
    from rev88.cli import main as rev88_main

    folder = Path(os.environ[DIR_ENV])
    stats = Path(os.environ[STATS_ENV]) if os.environ.get(STATS_ENV) else None
    app.service.get_backend = stand_in_engines(folder, float(os.environ.get(LAUNCH_ENV, "132")) / 1000.0, stats)
    return rev88_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
