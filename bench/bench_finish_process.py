"""Where a launch's finishing runs: on the server's threads (today) or in a process of its own --
the design question of issue #55, measured before it is chosen.

The host's ceiling with an instant device is its serial part (bench/bench_launches.py --cores
1,2): the work of every thread that holds the GIL. The largest piece of it that needs nothing of
the server but a launch's buffers is the finishing: each task's result checked, hashed and
assembled (``learner.result.finish_task`` through ``app.tasks.device.finish_launch``, with its hash
pool, as the finisher thread runs it), its answer built (``app.tasks.answers.task_answer``) and
encoded as the ledger stores it (``app.ledger.rows.encode_answer``). This bench runs exactly that
for launches of the sweep's kept outputs (bench/device_stand_in.py's cache, cpu-fast's real
outputs of draw 0), two ways:

    thread    in this process, as the service does today (its hash pool: two threads)
    process   in one child process (spawned once, as a finisher process would be): each launch's
              buffers copied into shared memory (one copy, as a device's outputs would be copied
              into buffers it keeps), the small per-task facts pickled to it; back come what the
              ledger writes (the encoded answer, its codec, its JSON length, the list columns)

and reports this process's CPU per cell (every thread of it: what would stay in the server's
serial part) and the child's, with the wall time per launch, pinned to one core and to two.
Every answer's predictions_sha256 is checked against the kept output's, both ways.

    python bench/bench_finish_process.py [--launches 10] [--cores 1,2,1,2]

Not a test; run it by hand at a quiet moment (after bench/bench_launches.py has kept the outputs:
--skip-evaluation --uploads 0 makes the 1,320 it reads).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from multiprocessing import shared_memory
from pathlib import Path
from types import SimpleNamespace

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

BATCH = 132
TIMING = {"receive_ms": 0.0, "parse_ms": 0.0, "queue_wait_ms": 0.0, "run_ms": 1.0, "run_clock": "launch",
          "device_ms": 1.0, "tasks_in_launch": BATCH, "total_ms": 1.0}


def answer_row(task_id: str, outcome) -> tuple:
    """What the ledger writes of one finished task: its answer built and encoded, and the list columns."""
    from app.ledger.rows import answer_columns, encode_answer
    from app.tasks.answers import task_answer

    answer = task_answer(task_id, None, outcome, TIMING, False)
    blob, json_bytes, codec = encode_answer(answer)
    return (blob, json_bytes, codec, *answer_columns(answer))


# ---------------------------------------------------------------------------- the child's side
def _child(conn, validation: dict) -> None:
    """The finisher process: for each launch, its buffers from shared memory and its tasks' facts
    from ``conn``; back, one ledger row per task. A None ends it."""
    import concurrent.futures

    import learner.result
    from app.tasks.device import DIGEST_GROUP, DeviceOutcome
    from learner.backends.base import RunOutput
    from learner.result import finish_task, run_digests

    learner.result.cached_validation = lambda: validation  # (the server's, computed once there)
    pool = concurrent.futures.ThreadPoolExecutor(2)

    while True:
        message = conn.recv()
        if message is None:
            return
        t0 = time.process_time()
        names, shapes, facts, engine = message
        blocks = [shared_memory.SharedMemory(name=n) for n in names]
        try:
            arrays = [np.ndarray(shape, dtype, buffer=b.buf) for b, (shape, dtype) in zip(blocks, shapes)]
            scores, params, velocity, predictions = arrays
            outs = []
            for i, f in enumerate(facts):
                cuts = np.cumsum([int(np.prod(s)) for s in f["shapes"]])[:-1]
                outs.append(RunOutput(
                    final_parameters=[p.reshape(s) for p, s in zip(np.split(params[i], cuts), f["shapes"])],
                    final_velocity=[v.reshape(s) for v, s in zip(np.split(velocity[i], cuts), f["shapes"])],
                    scores=scores[i], training_prediction_seconds=0.001, preparation_seconds=0.0,
                    predictions=predictions[i]))
            groups = [pool.submit(run_digests, outs[at:at + DIGEST_GROUP]) for at in range(0, len(outs), DIGEST_GROUP)]
            rows = []
            for i, f in enumerate(facts):
                task = SimpleNamespace(train_count=f["train_count"], test_count=f["test_count"],
                                       input_hashes=lambda f=f: dict(f["input_hashes"]))
                prepared = SimpleNamespace(cancel=None, permutation_sha256=f["permutation_sha256"],
                                           initial_sha256=f["initial_sha256"])
                result = finish_task(task, f["config"], engine, prepared, outs[i], f["host_prep"],
                                     tasks_in_launch=len(facts),
                                     digests=groups[i // DIGEST_GROUP].result()[i % DIGEST_GROUP])
                rows.append(answer_row(f["id"], DeviceOutcome(result, None, "stand-in: no meter")))
            del scores, params, velocity, predictions, arrays
        finally:
            for b in blocks:
                b.close()
        conn.send((rows, time.process_time() - t0))


# ---------------------------------------------------------------------------- this process's side
def load(folder: Path, cells: int):
    """The first ``cells`` of the sweep: tasks (draw 0), configs, preparations, and the stand-in
    device that replays their kept outputs."""
    from device_stand_in import stand_in_engines

    from learner.config import make_config
    from learner.data import bundled_mnist_dir
    from learner.evaluate import dataset_seed
    from learner.taskio import load_task, make_task, task_to_npz_bytes
    from learner.train import prepare

    task = load_task(task_to_npz_bytes(make_task(bundled_mnist_dir(), dataset_seed(0))[0]))
    lrs = [round(0.05 + 0.01 * i, 4) for i in range(10)]
    configs = [make_config({"learning_rate": lr, "seed": s}) for lr in lrs for s in range(132)][:cells]
    prepareds = [prepare(task, c) for c in configs]
    engine = stand_in_engines(folder, 0.0)("cpu-fast")
    return task, configs, prepareds, engine


def launch(task, configs, prepareds, engine, k: int):
    from app.tasks.device import Launch

    part = slice(k * BATCH, (k + 1) * BATCH)
    tasks, cs, ps = [task] * BATCH, configs[part], prepareds[part]
    outs = engine.run_many(tasks, ps)
    runs = [(task, c, p, o, 0.0) for c, p, o in zip(cs, ps, outs)]
    return Launch([(task, c, None) for c in cs], engine, runs, None, "stand-in: no meter", 0.001)


def by_thread(launches: list, pool) -> list:
    from app.tasks.device import finish_launch

    rows = []
    for k, one in enumerate(launches):
        outcomes = finish_launch(one, pool)
        rows.extend(answer_row(f"cell-{k}-{i}", o) for i, o in enumerate(outcomes))
    return rows


class Finisher:
    """The child process and its shared memory."""

    def __init__(self, validation: dict) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_child, args=(child, validation), daemon=True)
        self.proc.start()
        self.blocks: list[shared_memory.SharedMemory] = []
        self.child_cpu = 0.0

    def finish(self, launches: list) -> list:
        rows = []
        for k, one in enumerate(launches):
            outs = [run[3] for run in one.runs]
            first = outs[0]
            size = sum(p.size for p in first.final_parameters)
            shapes = [((len(outs), *first.scores.shape), np.float32), ((len(outs), size), np.float32),
                      ((len(outs), size), np.float32), ((len(outs), first.scores.shape[0]), np.int64)]
            if not self.blocks:
                self.blocks = [shared_memory.SharedMemory(create=True, size=int(np.prod(s)) * np.dtype(d).itemsize)
                               for s, d in shapes]
            arrays = [np.ndarray(s, d, buffer=b.buf) for b, (s, d) in zip(self.blocks, shapes)]
            for i, o in enumerate(outs):  # (one copy each: as a device's outputs would be copied in)
                arrays[0][i] = o.scores
                np.concatenate([p.ravel() for p in o.final_parameters], out=arrays[1][i])
                np.concatenate([v.ravel() for v in o.final_velocity], out=arrays[2][i])
                arrays[3][i] = o.predictions
            facts = [{"id": f"cell-{k}-{i}", "config": run[1], "train_count": run[0].train_count,
                      "test_count": run[0].test_count, "input_hashes": run[0].input_hashes(),
                      "permutation_sha256": run[2].permutation_sha256, "initial_sha256": run[2].initial_sha256,
                      "host_prep": run[4], "shapes": [p.shape for p in run[3].final_parameters]}
                     for i, run in enumerate(one.runs)]
            engine = SimpleNamespace(name=one.engine.name, device=one.engine.device)
            self.conn.send(([b.name for b in self.blocks], shapes, facts, engine))
            del arrays
            got, cpu = self.conn.recv()
            self.child_cpu += cpu
            rows.extend(got)
        return rows

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(10)
        for b in self.blocks:
            b.close()
            b.unlink()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=10)
    parser.add_argument("--cores", default="1,2,1,2")
    parser.add_argument("--cache", default="/tmp/rev88-stand-in/lrs10-seeds132-eval0")
    args = parser.parse_args(argv)
    import concurrent.futures

    from learner.hashing import array_sha256
    from learner.validate import cached_validation

    folder = Path(args.cache)
    if not (folder / "index.json").exists():
        parser.error(f"no kept outputs in {folder}: run bench/bench_launches.py --skip-evaluation --uploads 0 first")
    cells = args.launches * BATCH
    task, configs, prepareds, engine = load(folder, cells)
    kept = np.load(folder / "predictions.npy", mmap_mode="r")
    expected = [array_sha256(np.asarray(kept[i]).astype(np.int64)) for i in range(cells)]
    validation = cached_validation()
    available = sorted(os.sched_getaffinity(0))
    results = []
    for n in [int(c) for c in args.cores.split(",")]:
        os.sched_setaffinity(0, set(available[:n]))
        try:
            for way in ("thread", "process"):
                finisher = Finisher(validation) if way == "process" else None
                pool = concurrent.futures.ThreadPoolExecutor(2)
                if finisher is not None:  # (warm: the child's imports)
                    finisher.finish([launch(task, configs, prepareds, engine, 0)])
                    finisher.child_cpu = 0.0
                launches = [launch(task, configs, prepareds, engine, k) for k in range(args.launches)]
                c0, w0 = time.process_time(), time.perf_counter()
                rows = by_thread(launches, pool) if finisher is None else finisher.finish(launches)
                cpu, wall = time.process_time() - c0, time.perf_counter() - w0
                child = 0.0 if finisher is None else finisher.child_cpu
                if finisher is not None:
                    finisher.close()
                pool.shutdown()
                got = [r[3] for r in rows]
                assert got == expected, f"{way}: an answer's predictions differ from the kept output's"
                results.append({"cores": n, "way": way, "parent_cpu_ms_per_cell": round(cpu / cells * 1e3, 4),
                                "child_cpu_ms_per_cell": round(child / cells * 1e3, 4),
                                "wall_ms_per_launch": round(wall / args.launches * 1e3, 2)})
                print(json.dumps(results[-1]), file=sys.stderr)
        finally:
            os.sched_setaffinity(0, set(available))
    print(json.dumps({"cells_per_launch": BATCH, "launches": args.launches, "runs": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
