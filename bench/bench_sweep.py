"""What a sweep costs the service per cell, against the learner in process and against uploads.

In one run, against a real ``rev88 serve`` (defaults but ``--backend``, cpu-fast by default, a
fresh data dir):

    in process   the draw-0 task parsed once (``load_task``), then ``run_task`` for each of N
                 cells (seeds 0..N-1) on the same parsed task: CPU per cell (time.process_time)
    sweep        PUT /datasets (once), then POST /sweeps with the same N seeds, polled until
                 completed: the server's CPU (/proc/PID/stat) from the POST to the end, per cell,
                 and cells per second (wall)
    uploads      the same N cells as N POST /tasks of the whole npz (seed=i), from ``--clients``
                 keep-alive connections at once: server CPU per task and tasks per second

From these: the sweep's server CPU per cell ÷ the in-process CPU per cell (issue #31: at most
1.15, goal 1.05: the dataset is parsed, validated and hashed once per process), and the sweep's
rate against the uploads'. Every cell's predictions_sha256 is checked against the in-process
run's. CPU time, not wall time, for the ratio. Not a test; run it by hand at a quiet moment:

    python bench/bench_sweep.py [--cells 24] [--backend cpu-fast] [--clients 2] [--out bench/results]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from bench_load import Connection, build_request, machine, start_server, stop_server, task_bytes  # noqa: E402
from bench_shell import cpu_by_group  # noqa: E402


def request(port: int, method: str, path: str, body: bytes = b"", content_type: str = "application/octet-stream"):
    conn = Connection("127.0.0.1", port)
    try:
        raw = build_request("127.0.0.1", port, method, path, body)
        if content_type != "application/octet-stream":
            raw = raw.replace(b"application/octet-stream", content_type.encode(), 1)
        status, headers, data = conn.request(raw)
    finally:
        conn.close()
    return status, headers, data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", type=int, default=24)
    parser.add_argument("--backend", default="cpu-fast")
    parser.add_argument("--clients", type=int, default=2, help="connections the uploads are sent from at once")
    parser.add_argument("--out", default=str(HERE / "results"))
    args = parser.parse_args(argv)

    from learner.config import make_config
    from learner.result import run_task
    from learner.taskio import load_task

    body, what = task_bytes()
    digest = "sha256:" + hashlib.sha256(body).hexdigest()
    task = load_task(body)
    run_task(task, make_config({"seed": 0}), args.backend)  # warm
    t0 = time.process_time()
    expected = [run_task(task, make_config({"seed": s}), args.backend).predictions_sha256 for s in range(args.cells)]
    in_process_ms = (time.process_time() - t0) / args.cells * 1000.0

    doc: dict = {"draw": what, "backend": args.backend, "cells": args.cells, "machine": machine(),
                 "in_process_ms_per_cell": round(in_process_ms, 3)}
    with tempfile.TemporaryDirectory() as tmp:
        proc, port = start_server(args.backend, Path(tmp) / "server.log", Path(tmp) / "data")
        try:
            status, _, _ = request(port, "PUT", f"/datasets/{digest}", body)
            assert status in (200, 201), status
            # warm: one cell, so that the dataset is parsed and the workers warmed before measuring
            status, _, data = request(port, "POST", f"/tasks?dataset={digest}&seed=0")
            assert status == 200, data
            definition = json.dumps({"dataset": digest, "seeds": {"start": 0, "count": args.cells}}).encode()
            before, w0 = cpu_by_group(proc.pid), time.perf_counter()
            status, _, data = request(port, "POST", "/sweeps", definition, "application/json")
            assert status == 202, data
            sweep_id = json.loads(data)["id"]
            while True:
                status, _, data = request(port, "GET", f"/sweeps/{sweep_id}")
                state = json.loads(data)
                if state["status"] in ("completed", "cancelled"):
                    break
                time.sleep(0.5)  # (each poll reads every cell's record: not too often)
            sweep_wall = time.perf_counter() - w0
            after = cpu_by_group(proc.pid)
            got = [row.get("predictions_sha256") for row in state["cells"]]
            assert got == expected, "a cell's predictions differ from the in-process run's"
            sweep_ms = (after["process"] - before["process"]) / args.cells * 1000.0
            sweep_groups = {k: round((after[k] - before[k]) / args.cells * 1000.0, 3) for k in after}

            lock, results = threading.Lock(), []

            def send(seeds: list[int]) -> None:
                conn = Connection("127.0.0.1", port)
                for seed in seeds:
                    raw = build_request("127.0.0.1", port, "POST", f"/tasks?seed={seed}", body)
                    status, _, data = conn.request(raw)
                    with lock:
                        results.append((seed, status, json.loads(data).get("predictions_sha256")))
                conn.close()

            before, w0 = cpu_by_group(proc.pid), time.perf_counter()
            threads = [threading.Thread(target=send, args=(list(range(args.cells))[i::args.clients],))
                       for i in range(args.clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            uploads_wall = time.perf_counter() - w0
            time.sleep(0.3)
            after = cpu_by_group(proc.pid)
            assert all(st == 200 and sha == expected[seed] for seed, st, sha in results), results[:3]
            uploads_ms = (after["process"] - before["process"]) / args.cells * 1000.0
        finally:
            stop_server(proc)
    doc.update({
        "sweep": {"server_cpu_ms_per_cell": round(sweep_ms, 3), "by_thread_ms_per_cell": sweep_groups,
                  "wall_s": round(sweep_wall, 3),
                  "cells_per_s": round(args.cells / sweep_wall, 2)},
        "uploads": {"clients": args.clients, "server_cpu_ms_per_task": round(uploads_ms, 3),
                    "wall_s": round(uploads_wall, 3), "tasks_per_s": round(args.cells / uploads_wall, 2)},
        "ratio_sweep_cpu_to_in_process": round(sweep_ms / in_process_ms, 3),
        "ratio_upload_cpu_to_sweep": round(uploads_ms / sweep_ms, 3),
        "ratio_sweep_rate_to_uploads": round((args.cells / sweep_wall) / (args.cells / uploads_wall), 3),
    })
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
