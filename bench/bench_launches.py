"""The host's cost per cell when the device works in launches (issue #46), against a stand-in device.

A real ``rev88 serve`` (cpu-fast's name, ``--batch-max 132``, one worker, a fresh data dir) whose
device is bench/device_stand_in.py's replay: every task of a launch gets the real output of its
(dataset, config, seed), computed by cpu-fast before the run and kept, after a fixed device time
per launch (``--launch-ms``, a sleep: 132 tasks per 132 ms is 1,000 cells/s). So the server's CPU
is the host's work alone -- claims, preparation, answers, hashes, ledger writes, polls -- and the
replay's own CPU (reading the kept outputs) is subtracted. Two runs in one:

    sweep        PUT /datasets (draw 0), POST /sweeps of --lrs learning rates x --seeds seeds
                 (1,320 cells by default), polled every second until completed
    evaluation   one POST /evaluations of draws 0-10 x --eval-seeds seeds (132 cells by default)
    uploads      --uploads synchronous POST /tasks of the whole draw-0 npz (6.5 MB each; the sweep's
                 first learning rate, seeds 0..), from --clients keep-alive connections at once:
                 where an upload's host CPU goes, by thread group (the loop's share is what a
                 many-core host cannot spread; the io pool's, sized to the cores, it can)

Reported for each: host CPU per cell (from /proc: every thread of the server, by thread group,
and its child processes -- REV88_SEED_PROCESSES's (``--serve-args "--seed-processes N"``) -- the replay excluded; also without the bench's own polls, whose cost it measures), cells per
second as the client sees them (polling every POLL_S) and as the server's own span (acceptance
to the last answer), and those rates against the stand-in's (its launch rate at full launches). Every cell's predictions_sha256 is checked against the kept output's. CPU time,
not wall time, for the per-cell figure; the rate is wall time on whatever else the machine does.
Not a test; run it by hand at a quiet moment:

    python bench/bench_launches.py [--lrs 10] [--seeds 132] [--eval-seeds 12] [--uploads 132] [--clients 8]
                                   [--launch-ms 132] [--out bench/results]

The host's ceiling (issue #55): ``--cores 1,2,1,2`` runs the sweep alone on a fresh server for each
entry, the server's threads (and this bench's) pinned to that many cores, alternating, and prints
the table, the speed-up from one core to two (the best rate of each) and what Amdahl's law makes of
it for 16 cores of this speed (the serial share s from the speed-up S on two: s = 2/S - 1):

    python bench/bench_launches.py --skip-evaluation --uploads 0 --launch-ms 1 --cores 1,2,1,2

``--warm-sweep`` runs the same sweep once, unmeasured, before the measured one: its seeds'
initial parameters and permutations are then kept (learner/seed_state.py), as for a sweep over
seeds the server has run before, so the measured sweep's first launch waits for none of them.

The kept outputs (~600 MB for the defaults) go to --cache (default /tmp/rev88-stand-in); a
second run reuses them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from bench_load import machine, start_server, stop_server  # noqa: E402
from bench_shell import cpu_by_group  # noqa: E402
from bench_sweep import request  # noqa: E402
from device_stand_in import DIR_ENV, LAUNCH_ENV, STATS_ENV, precompute  # noqa: E402

POLL_S = 0.05  # how often the bench asks whether the cells have finished (each ask costs the server a little:
# the lists' rows are asked, not the documents with every cell, which are read once at the end; what an ask
# costs is measured after the run and reported, with the host's figure without them)
POLL_COST_ASKS = 20


def replay_cpu(stats: Path) -> float:
    """The stand-in's own CPU so far (its replay of the kept outputs), from its stats file."""
    return float(json.loads(stats.read_text())["replay_cpu_s"]) if stats.exists() else 0.0


def expected_hashes(folder: Path, count: int) -> list[str]:
    from learner.hashing import array_sha256

    scores = np.load(folder / "scores.npy", mmap_mode="r")
    return [array_sha256(np.asarray(scores[i]).argmax(axis=1).astype(np.int64)) for i in range(count)]


def children_cpu(pid: int) -> float:
    """Seconds of CPU so far of ``pid``'s child processes (REV88_SEED_PROCESSES's seed-state
    processes): host work too."""
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:  # (its parent)
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def measure(stats: Path, pid: int, cells: int, start, done, stand_in_rate: float) -> dict:
    """CPU and wall from ``start()`` until ``done()`` says every cell finished; then what one of
    those polls costs the server (POLL_COST_ASKS more of them, by CPU), so that the host's figure
    is also given without the client's polling (a sweep.completed webhook costs none)."""
    replay0, before, w0, u0 = replay_cpu(stats), cpu_by_group(pid), time.perf_counter(), time.time()
    before["children"] = children_cpu(pid)
    handle = start()
    accepted = time.perf_counter() - w0  # (the POST's round trip: the cells checked and recorded)
    at_acceptance = cpu_by_group(pid)  # (the acceptance's CPU: 10 ms ticks, so a large sweep says more)
    polls = 1
    while not done(handle):
        time.sleep(POLL_S)
        polls += 1
    wall = time.perf_counter() - w0
    device = timeline(stats, u0, time.time())
    after, replay1 = cpu_by_group(pid), replay_cpu(stats)
    after["children"] = children_cpu(pid)
    replay = replay1 - replay0
    groups = {k: round((after[k] - before[k]) / cells * 1000.0, 4) for k in after}
    host = (after["process"] - before["process"] + after["children"] - before["children"] - replay) / cells * 1000.0
    p0 = cpu_by_group(pid)["process"]
    for _ in range(POLL_COST_ASKS):
        done(handle)
    poll_ms = (cpu_by_group(pid)["process"] - p0) / POLL_COST_ASKS * 1000.0
    rate = cells / wall
    return {"cells": cells, "host_cpu_ms_per_cell": round(host, 4), "by_thread_ms_per_cell": groups,
            "replay_cpu_ms_per_cell": round(replay / cells * 1000.0, 4), "polls": polls,
            "poll_cpu_ms": round(poll_ms, 3),
            "host_cpu_ms_per_cell_without_polls": round(host - polls * poll_ms / cells, 4),
            "accepted_ms": round(accepted * 1000.0, 1),
            "accepted_cpu_ms": {k: round((at_acceptance[k] - before[k]) * 1000.0, 1) for k in ("process", "main")},
            "wall_s": round(wall, 3), "cells_per_s": round(rate, 2), "rate_vs_stand_in": round(rate / stand_in_rate, 3),
            "device": device, "handle": handle}


def timeline(stats: Path, start: float, end: float) -> dict | None:
    """When the stand-in device worked between ``start`` and ``end`` (unix seconds, the client's
    request and its seeing the last cell done): its launches and their sizes, and where it waited
    for the host -- before the first launch, between launches, after the last."""
    if not stats.exists():
        return None
    spans = [s for s in json.loads(stats.read_text())["spans"] if s[0] >= start and s[1] <= end]
    if not spans:
        return None
    gaps = [b[0] - a[1] for a, b in zip(spans, spans[1:])]
    return {"launches": len(spans), "tasks": [s[2] for s in spans], "buffers": json.loads(stats.read_text()).get("buffers"),
            "busy_s": round(sum(s[1] - s[0] for s in spans), 3),
            "before_first_ms": round((spans[0][0] - start) * 1000.0, 1),
            "between_ms": [round(g * 1000.0, 1) for g in gaps],
            "after_last_ms": round((end - spans[-1][1]) * 1000.0, 1),
            # the pace between the first launch's end and the last's: the host feeding the device,
            # without the head (the first launch's cells and states) and the tail (the last's finishing)
            "steady_cells_per_s": (round(sum(s[2] for s in spans[1:]) / (spans[-1][1] - spans[0][1]), 1)
                                   if len(spans) > 1 and spans[-1][1] > spans[0][1] else None)}


def makespan(rows: list[dict], cells: int, stand_in_rate: float) -> dict:
    """The server's own span: from the cells' acceptance to the last one's answer (the largest
    timing.total_ms; the request that made them and the last commit are outside it)."""
    span = max(row["timing"]["total_ms"] for row in rows) / 1000.0
    return {"server_span_s": round(span, 3), "server_cells_per_s": round(cells / span, 2),
            "server_rate_vs_stand_in": round(cells / span / stand_in_rate, 3)}


def one_launch_split(stats: Path, created_at: float, span_s: float) -> dict | None:
    """A job of one launch (the evaluation): the host's time before the launch (from the job's
    creation to the stand-in's start), the launch, and the host's after it (to the last answer),
    from the stand-in's record of its launches."""
    spans = [s for s in json.loads(stats.read_text()).get("spans", []) if s[0] >= created_at]
    if len(spans) != 1:
        return None
    start, end = spans[0][:2]
    return {"before_launch_ms": round((start - created_at) * 1000.0, 1), "launch_ms": round((end - start) * 1000.0, 1),
            "after_launch_ms": round((created_at + span_s - end) * 1000.0, 1)}


def uploads(port: int, pid: int, stats: Path, body: bytes, lr: float, count: int, clients: int,
            expected: list[str], seeds: int, stand_in_rate: float) -> dict:
    """``count`` synchronous uploads of the whole npz (seeds 0..count-1 at the sweep's first
    learning rate: the sweep's kept outputs) from ``clients`` connections at once; every answer's
    predictions_sha256 checked against the kept output's. CPU per upload by thread group."""
    import threading

    from bench_load import Connection, build_request

    lock, results = threading.Lock(), []

    def send(mine: list[int]) -> None:
        conn = Connection("127.0.0.1", port)
        try:
            for seed in mine:
                raw = build_request("127.0.0.1", port, "POST", f"/tasks?learning_rate={lr}&seed={seed}", body)
                status, _, data = conn.request(raw)
                answer = json.loads(data)
                with lock:
                    results.append((seed, status, answer.get("predictions_sha256"),
                                    answer.get("timing", {}).get("tasks_in_launch")))
        finally:
            conn.close()

    replay0, before, w0 = replay_cpu(stats), cpu_by_group(pid), time.perf_counter()
    threads = [threading.Thread(target=send, args=(list(range(count))[i::clients],)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - w0
    time.sleep(0.3)  # (what follows an answer: its log line, the ledger's write)
    after, replay = cpu_by_group(pid), replay_cpu(stats) - replay0
    bad = [(seed, st) for seed, st, sha, _ in results if st != 200 or sha != expected[seed]]
    assert not bad, f"uploads answered wrong: {bad[:3]}"
    launch_sizes = [n for *_, n in results if n]
    host = (after["process"] - before["process"] - replay) / count * 1000.0
    return {"uploads": count, "clients": clients, "body_bytes": len(body),
            "host_cpu_ms_per_upload": round(host, 3),
            "by_thread_ms_per_upload": {k: round((after[k] - before[k]) / count * 1000.0, 3) for k in after},
            "replay_cpu_ms_per_upload": round(replay / count * 1000.0, 3),
            "mean_tasks_in_launch": round(sum(launch_sizes) / max(1, len(launch_sizes)), 2),
            "wall_s": round(wall, 3), "uploads_per_s": round(count / wall, 2),
            "note": "the stand-in's launch takes launch_ms whatever its size: the rate is bounded by "
                    "clients / launch_ms (a GPU's lone task takes about a full launch's time too)"}


def pin(pid: int, cores: set[int]) -> None:
    """Every thread of ``pid`` (and so the threads they start later) on ``cores`` only."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:  # (a thread that ended meanwhile)
            pass


def ceiling(runs: list[dict]) -> dict:
    """The table of ``--cores`` runs, the speed-up from one core to two (best rate of each) and its
    projection by Amdahl's law to 16 cores of this speed."""
    rows = [{"cores": r["cores"], "host_cpu_ms_per_cell_without_polls": r["host_cpu_ms_per_cell_without_polls"],
             "server_cells_per_s": r["server_cells_per_s"],
             # (where the span's serial ends go: the device idle before its first launch and after its last)
             "before_first_launch_ms": (r.get("device") or {}).get("before_first_ms"),
             "after_last_launch_ms": (r.get("device") or {}).get("after_last_ms"),
             "steady_cells_per_s": (r.get("device") or {}).get("steady_cells_per_s")} for r in runs]
    best = {n: max(r["server_cells_per_s"] for r in runs if r["cores"] == n) for n in {r["cores"] for r in runs}}
    doc: dict = {"runs": rows, "best_cells_per_s": best}
    steady = {n: max((r["steady_cells_per_s"] or 0.0) for r in rows if r["cores"] == n) for n in best}
    if steady.get(1) and steady.get(2):  # (the same speed-up between launches alone: no head, no tail)
        doc["steady_speedup_1_to_2"] = round(steady[2] / steady[1], 3)
    if 1 in best and 2 in best:
        speedup = best[2] / best[1]
        serial = min(1.0, max(0.0, 2.0 / speedup - 1.0))
        doc.update({"speedup_1_to_2": round(speedup, 3), "serial_share": round(serial, 3),
                    "projected_cells_per_s_16_cores": round(best[1] / (serial + (1.0 - serial) / 16.0), 1),
                    "projected_cells_per_s_any_cores": None if serial == 0 else round(best[1] / serial, 1)})
    return doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lrs", type=int, default=10, help="learning rates in the sweep's grid")
    parser.add_argument("--seeds", type=int, default=132, help="seeds per learning rate")
    parser.add_argument("--eval-seeds", type=int, default=12, help="seeds of the evaluation of draws 0-10")
    parser.add_argument("--batch-max", type=int, default=132)
    parser.add_argument("--launch-ms", type=float, default=132.0, help="the stand-in's device time per launch")
    parser.add_argument("--cache", default="/tmp/rev88-stand-in")
    parser.add_argument("--serve-args", default="", help="more rev88 serve flags")
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--skip-evaluation", action="store_true")
    parser.add_argument("--uploads", type=int, default=132, help="synchronous uploads of draw 0 (0: none; at most --seeds)")
    parser.add_argument("--clients", type=int, default=8, help="connections the uploads are sent from at once")
    parser.add_argument("--warm-sweep", action="store_true", help="run the sweep once, unmeasured, before the "
                        "measured one (its seeds' states then kept: a sweep over seeds the server has run before)")
    parser.add_argument("--cores", default="", help="comma-separated core counts (1,2,1,2): the sweep alone, "
                        "once per entry on a fresh server pinned to that many cores, and the speed-up")
    args = parser.parse_args(argv)
    cores = [int(c) for c in args.cores.split(",") if c.strip()]
    available = sorted(os.sched_getaffinity(0))
    if any(n < 1 or n > len(available) for n in cores):
        parser.error(f"--cores: each entry between 1 and the {len(available)} cores this process may use")

    from learner.data import bundled_mnist_dir
    from learner.evaluate import dataset_seed
    from learner.taskio import make_task, task_to_npz_bytes

    lrs = [round(0.05 + 0.01 * i, 4) for i in range(args.lrs)]
    draws = {}
    for k in range(11 if not args.skip_evaluation else 1):
        task, _ = make_task(bundled_mnist_dir(), dataset_seed(k))
        draws[k] = task_to_npz_bytes(task)
    body = draws[0]
    digest = "sha256:" + hashlib.sha256(body).hexdigest()
    sweep_cells = [(body, {"learning_rate": lr, "seed": s}) for lr in lrs for s in range(args.seeds)]
    eval_cells = [] if args.skip_evaluation else [
        (draws[k], {"seed": s}) for s in range(args.eval_seeds) for k in range(11)]
    t0 = time.perf_counter()
    folder = Path(args.cache) / f"lrs{args.lrs}-seeds{args.seeds}-eval{0 if args.skip_evaluation else args.eval_seeds}"
    precompute(folder, sweep_cells + eval_cells)
    print(f"kept outputs ready in {time.perf_counter() - t0:.1f} s ({folder})", file=sys.stderr)
    expected = expected_hashes(folder, len(sweep_cells) + len(eval_cells))
    stand_in_rate = args.batch_max / (args.launch_ms / 1000.0)
    doc: dict = {"machine": machine(), "batch_max": args.batch_max, "launch_ms": args.launch_ms,
                 "stand_in_cells_per_s": stand_in_rate}
    queue = 2 * args.batch_max
    serve = ["--batch-max", str(args.batch_max), "--workers", "1", "--queue-size", str(queue),
             "--sweep-max-cells", str(len(sweep_cells)), *args.serve_args.split()]
    if cores:
        runs = []
        for n in cores:
            os.sched_setaffinity(0, set(available[:n]))
            try:
                runs.append({"cores": n, **one_server(args, folder, expected, serve, digest, body, lrs, sweep_cells,
                                                      eval_cells, stand_in_rate, set(available[:n]), sweep_only=True)["sweep"]})
            finally:
                os.sched_setaffinity(0, set(available))
            print(json.dumps(runs[-1]["cores"]), runs[-1]["host_cpu_ms_per_cell_without_polls"],
                  runs[-1]["server_cells_per_s"], (runs[-1].get("device") or {}).get("steady_cells_per_s"),
                  file=sys.stderr)
        doc["ceiling"] = ceiling(runs)
    else:
        doc.update(one_server(args, folder, expected, serve, digest, body, lrs, sweep_cells, eval_cells,
                              stand_in_rate, None))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "launches.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc, indent=2))
    return 0


def one_server(args, folder: Path, expected: list[str], serve: list[str], digest: str, body: bytes, lrs: list,
               sweep_cells: list, eval_cells: list, stand_in_rate: float, pinned: set[int] | None,
               sweep_only: bool = False) -> dict:
    """One fresh server: the sweep, then (unless ``sweep_only``) the evaluation and the uploads.
    ``pinned``: the cores its threads may use."""
    doc: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        stats = Path(tmp) / "stand-in.json"
        proc, port = start_server("cpu-fast", Path(tmp) / "server.log", Path(tmp) / "data",
                                  env={DIR_ENV: str(folder), LAUNCH_ENV: str(args.launch_ms), STATS_ENV: str(stats)},
                                  args=serve, launcher=[str(HERE / "device_stand_in.py")])
        try:
            # warm: a path no route has, so that FastAPI builds every included router's routes now
            # (once per process, lazily at a router's first request: ~56 ms of CPU here) and not
            # inside the measured window
            status, _, _ = request(port, "GET", "/bench-warm-no-such-path")
            assert status == 404, status
            status, _, data = request(port, "PUT", f"/datasets/{digest}", body)
            assert status in (200, 201), data
            status, _, data = request(port, "POST", f"/tasks?dataset={digest}&learning_rate={lrs[0]}&seed=0")
            assert status == 200, data  # warm: the dataset parsed, the worker warmed
            assert json.loads(data)["predictions_sha256"] == expected[0]

            def start_sweep():
                definition = json.dumps({"dataset": digest, "grid": {"learning_rate": lrs},
                                         "seeds": {"start": 0, "count": args.seeds}}).encode()
                status, _, data = request(port, "POST", "/sweeps", definition, "application/json")
                assert status == 202, data
                return json.loads(data)["id"]

            def sweep_done(sweep_id):  # (the list's row: its status and counts, not its 1,320 cells)
                status, _, data = request(port, "GET", "/sweeps?limit=1")
                row = json.loads(data)["sweeps"][0]
                return row["id"] == sweep_id and row["status"] in ("completed", "cancelled")

            if pinned is not None:
                pin(proc.pid, pinned)
            if args.warm_sweep:  # the same sweep once before: its seeds' states kept, as for a sweep run again
                measure(stats, proc.pid, len(sweep_cells), start_sweep, sweep_done, stand_in_rate)
            sweep = measure(stats, proc.pid, len(sweep_cells), start_sweep, sweep_done, stand_in_rate)
            status, _, data = request(port, "GET", f"/sweeps/{sweep.pop('handle')}")
            state = json.loads(data)
            got = [row.get("predictions_sha256") for row in state["cells"]]
            assert got == expected[:len(sweep_cells)], "a cell's predictions differ from the kept output's"
            sweep["succeeded"] = state["counts"]["succeeded"]
            sweep.update(makespan(state["cells"], len(sweep_cells), stand_in_rate))
            doc["sweep"] = sweep
            print(json.dumps({"sweep": sweep}, indent=2), file=sys.stderr)

            if not args.skip_evaluation and not sweep_only:
                # warm: the eleven draws built and stored (once per process), then measured
                definition = json.dumps({"draws": "0-10", "config": {"seed": 0}}).encode()
                status, _, data = request(port, "POST", "/evaluations", definition, "application/json")
                assert status == 202, data
                warm = json.loads(data)["id"]
                while json.loads(request(port, "GET", f"/evaluations/{warm}")[2])["status"] != "completed":
                    time.sleep(POLL_S)

                def start_evaluation():  # one evaluation: 11 draws x --eval-seeds seeds
                    definition = json.dumps({"draws": "0-10", "seeds": {"start": 0, "count": args.eval_seeds}})
                    status, _, data = request(port, "POST", "/evaluations", definition.encode(), "application/json")
                    assert status == 202, data
                    return json.loads(data)["id"]

                def evaluation_done(ev):  # (the list's row: its status and counts, not its rows)
                    status, _, data = request(port, "GET", "/evaluations?limit=1")
                    row = json.loads(data)["evaluations"][0]
                    return row["id"] == ev and row["status"] in ("completed", "failed", "cancelled")

                evaluation = measure(stats, proc.pid, len(eval_cells), start_evaluation, evaluation_done,
                                     stand_in_rate)
                ev = evaluation.pop("handle")
                status, _, data = request(port, "GET", f"/evaluations/{ev}")
                state = json.loads(data)
                assert state["status"] == "completed", state["status"]
                for row in state["draws"]:  # (kept seed-major: seed s, draw k at s * 11 + k)
                    want = expected[len(sweep_cells) + row["seed"] * 11 + row["draw"]]
                    assert row["predictions_sha256"] == want, f"evaluation seed {row['seed']} draw {row['draw']} differs"
                evaluation["rows"] = len(state["draws"])
                evaluation.update(makespan(state["draws"], len(eval_cells), stand_in_rate))
                evaluation["totals"] = state["totals"]["correct_over_total"]
                evaluation["one_launch_split"] = one_launch_split(stats, state["created_at"], evaluation["server_span_s"])
                doc["evaluation"] = evaluation
                print(json.dumps({"evaluation": evaluation}, indent=2), file=sys.stderr)

            if args.uploads and not sweep_only:
                doc["uploads"] = uploads(port, proc.pid, stats, body, lrs[0], min(args.uploads, args.seeds),
                                         args.clients, expected, args.seeds, stand_in_rate)
        finally:
            stop_server(proc)
    return doc


if __name__ == "__main__":
    sys.exit(main())
