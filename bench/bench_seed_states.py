"""Seed-derived states per second: in this process against REV88_SEED_PROCESSES's children.

Computes ``--states`` states of distinct seeds (``--rows`` training rows, ``--epochs`` epochs; a
state is a seed's initial parameters and epoch permutations with their SHA-256s,
learner/seed_state.py) and keeps them, as the service's cache does, for each entry of
``--processes``:

    0   in this process, on one thread, 32 together (the service's prepare thread without children)
    N   N children (learner/seed_processes.py), one thread here per child sending batches of 32,
        as the service's prepare threads do

With ``--busy`` a thread spins in Python meanwhile, as a busy server's other threads hold the
GIL: a state computed in process then waits to take the GIL back after each of its numpy and
torch calls; a child's does not. Reported for each: states per second, this process's CPU per
state (the threads that compute or receive; the spinning thread excluded) and the children's.

Needs numpy and torch only (no service packages), so it runs wherever the learner does, the
device machine's image included, to size REV88_SEED_PROCESSES on a many-core host:

    python bench/bench_seed_states.py [--states 1320] [--processes 0,1,2,4] [--busy] [--out FILE]

(With ``--busy``, the in-process trial of 1,320 states takes minutes: docs/performance.md.)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from learner import train  # noqa: E402,F401 - (binds the cache's functions: compute_states uses them)
from learner.config import make_config  # noqa: E402
from learner.seed_processes import SeedProcesses  # noqa: E402
from learner.seed_state import compute_states  # noqa: E402

BATCH = 32  # as app/tasks/launches.py's STATES_PER_BATCH (a batch computed together, in process or by a child)


def children_cpu_s(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def trial(processes: SeedProcesses | None, wanted: list[tuple], pids: list[int]) -> dict:
    """Every state of ``wanted`` computed and kept: wall seconds, this process's CPU (the working
    threads'), the children's."""
    kept: list = []
    cpu = [0.0]
    lock = threading.Lock()
    c0 = children_cpu_s(pids)
    t0 = time.perf_counter()
    if processes is None:
        start = time.thread_time()
        for i in range(0, len(wanted), BATCH):  # (as the service's prepare thread: a batch together)
            kept.extend(compute_states(wanted[i:i + BATCH]))
        cpu[0] = time.thread_time() - start
    else:
        batches: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(0, len(wanted), BATCH):
            batches.put(wanted[i:i + BATCH])

        def drain() -> None:
            start = time.thread_time()
            process = processes.take()
            try:
                while True:
                    try:
                        batch = batches.get_nowait()
                    except queue.Empty:
                        break
                    got = process.states(batch)
                    with lock:
                        kept.extend(got)
            finally:
                processes.give(process)
                with lock:
                    cpu[0] += time.thread_time() - start

        threads = [threading.Thread(target=drain) for _ in range(processes.count)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    wall = time.perf_counter() - t0
    assert len(kept) == len(wanted)
    return {"states_per_s": round(len(wanted) / wall, 1), "wall_s": round(wall, 3),
            "cpu_ms_per_state": round(1000 * cpu[0] / len(wanted), 3),
            "children_cpu_ms_per_state": round(1000 * (children_cpu_s(pids) - c0) / len(wanted), 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--states", type=int, default=1320, help="distinct seeds per trial")
    parser.add_argument("--rows", type=int, default=10_000, help="training rows (the permutations' length)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--processes", default="0,1", help="comma-separated child counts (0: in this process)")
    parser.add_argument("--busy", action="store_true", help="a thread spinning in Python meanwhile")
    parser.add_argument("--out", default="", help="also write the JSON here")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.processes.split(",") if n.strip()]

    stop = threading.Event()
    if args.busy:
        def spin() -> None:
            n = 0
            while not stop.is_set():
                n += 1

        threading.Thread(target=spin, daemon=True).start()
    runs, seed = [], 1_000_000
    try:
        for count in counts:
            processes = None
            if count:
                processes = SeedProcesses(count)
                processes.start()
                if processes.wait_ready(120) < count:
                    raise SystemExit(f"only {processes.snapshot()['ready']} of {count} seed-state processes started")
            pids = [p.process.pid for p in processes.processes] if processes else []
            wanted = [(make_config({"seed": seed + k, "epochs": args.epochs}), args.rows) for k in range(args.states)]
            seed += args.states  # (fresh seeds each trial)
            try:
                result = trial(processes, wanted, pids)
            finally:
                if processes is not None:
                    processes.close()
            runs.append({"processes": count, **result})
            print(json.dumps(runs[-1]), file=sys.stderr)
    finally:
        stop.set()
    doc = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                       "python": platform.python_version()},
           "states": args.states, "rows": args.rows, "epochs": args.epochs, "busy": args.busy, "runs": runs}
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
