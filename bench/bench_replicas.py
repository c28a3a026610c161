"""The host's ceiling by processes: replicas sharing one PostgreSQL ledger, one core each (issue #55).

bench/bench_launches.py ``--cores`` measures one server on one core against the same server on
two: its threads share one GIL, so only the GIL-free hashing overlaps. Here the second core gets a
second process instead: ``--replicas 1,2,1,2`` starts, for each entry, a fresh PostgreSQL database
on one local server (``fsync=on``) and that many ``rev88 serve`` replicas on it (cpu-fast's name,
``--batch-max 132``, one worker; each with bench/device_stand_in.py's replay as its device), replica
i pinned to core i, and the PostgreSQL server's processes pinned to the same cores (its CPU is the
host's too, and counted). Replica 0 takes the dataset and the sweep (1,320 cells of draw 0 by
default); every replica claims its cells from the shared ledger under leases (a NOTIFY wakes them)
and runs them against its instant stand-in (``--launch-ms``); the client polls replica 0 until the
sweep is completed and checks every cell's predictions_sha256 against the kept output's.

Reported per entry: the cells per second from the sweep's request to the client seeing it
completed, the host CPU per cell (every replica's threads, their child processes and the
PostgreSQL server's processes, the stand-ins' replay subtracted; the polls' cost measured and
taken out as bench_launches.py does), how many cells each replica ran; then the speed-up from one
replica (one core) to two (two cores), best rate of each, and its projection by Amdahl's law.

    python bench/bench_replicas.py [--replicas 1,2,1,2] [--lrs 10] [--seeds 132] [--launch-ms 1]

Not a test: run it by hand at a quiet moment, nothing else running. It needs PostgreSQL's server
binaries (apt-get install postgresql; tests/pg.py finds them). The stand-in shares no device: what
several processes launching on one GPU cost is not measured here (docs/gpu.md).
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

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from bench_launches import POLL_COST_ASKS, POLL_S, ceiling, children_cpu, expected_hashes, pin, replay_cpu  # noqa: E402
from bench_load import machine, start_server, stop_server  # noqa: E402
from bench_shell import cpu_by_group  # noqa: E402
from bench_sweep import request  # noqa: E402
from device_stand_in import DIR_ENV, LAUNCH_ENV, STATS_ENV, precompute  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def postgres_pids(postmaster: int) -> list[int]:
    """The PostgreSQL server's processes: the postmaster and its children (backends, writers)."""
    pids = [postmaster]
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == postmaster:
                pids.append(int(entry))
    return pids


def postgres_cpu(postmaster: int) -> float:
    """CPU seconds so far of the server's live processes (a backend that exited meanwhile is in
    the postmaster's children's time, which /proc adds once it is reaped)."""
    total = 0.0
    for pid in postgres_pids(postmaster):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12]) + (int(fields[13]) + int(fields[14]) if pid == postmaster else 0)) / TICK
    return total


def one_entry(args, cluster, count: int, folder: Path, expected: list[str], body: bytes, digest: str, lrs: list,
              cells: int, stand_in_rate: float, cores: list[int]) -> dict:
    from tests.pg import create_database

    url = create_database(cluster.url)
    postmaster = int(Path(cluster.data, "postmaster.pid").read_text().split()[0])
    serve = ["--batch-max", str(args.batch_max), "--workers", "1", "--queue-size", str(2 * args.batch_max),
             "--sweep-max-cells", str(cells), "--database-url", url]
    with tempfile.TemporaryDirectory() as tmp:
        servers = []
        try:
            for i in range(count):
                stats = Path(tmp) / f"stand-in-{i}.json"
                proc, port = start_server("cpu-fast", Path(tmp) / f"server-{i}.log", Path(tmp) / f"data-{i}",
                                          env={DIR_ENV: str(folder), LAUNCH_ENV: str(args.launch_ms),
                                               STATS_ENV: str(stats)},
                                          args=serve, launcher=[str(HERE / "device_stand_in.py")])
                servers.append((proc, port, stats))
            port0 = servers[0][1]
            status, _, data = request(port0, "PUT", f"/datasets/{digest}", body)
            assert status in (200, 201), data
            for _, port, _ in servers:  # warm each: its routes built, the dataset parsed, its worker warmed
                assert request(port, "GET", "/bench-warm-no-such-path")[0] == 404
                status, _, data = request(port, "POST", f"/tasks?dataset={digest}&learning_rate={lrs[0]}&seed=0")
                assert status == 200, data
                assert json.loads(data)["predictions_sha256"] == expected[0]
            for i, (proc, _, _) in enumerate(servers):
                pin(proc.pid, {cores[i]})
            for pid in postgres_pids(postmaster):
                try:
                    pin(pid, set(cores[:count]))
                except (FileNotFoundError, ProcessLookupError):
                    pass

            def sweep_done(sweep_id: str) -> bool:
                status, _, data = request(port0, "GET", "/sweeps?limit=1")
                row = json.loads(data)["sweeps"][0]
                return row["id"] == sweep_id and row["status"] in ("completed", "cancelled")

            def by_thread() -> dict[str, float]:
                """Every replica's CPU by thread group (and "children": their child processes')."""
                total: dict[str, float] = {"children": sum(children_cpu(p.pid) for p, _, _ in servers)}
                for p, _, _ in servers:
                    for group, seconds in cpu_by_group(p.pid).items():
                        total[group] = total.get(group, 0.0) + seconds
                return total

            def host_cpu(threads: dict[str, float]) -> float:  # (the replicas' own, with their children's)
                return threads["process"] + threads["children"]

            replay0 = sum(replay_cpu(s) for _, _, s in servers)
            threads0, pg0 = by_thread(), postgres_cpu(postmaster)
            own0 = host_cpu(threads0)
            w0 = time.perf_counter()
            definition = json.dumps({"dataset": digest, "grid": {"learning_rate": lrs},
                                     "seeds": {"start": 0, "count": args.seeds}}).encode()
            status, _, data = request(port0, "POST", "/sweeps", definition, "application/json")
            assert status == 202, data
            sweep_id = json.loads(data)["id"]
            polls = 1
            while not sweep_done(sweep_id):
                time.sleep(POLL_S)
                polls += 1
            wall = time.perf_counter() - w0
            time.sleep(0.3)  # (what follows the last answer: log lines, the leases' release)
            threads1, pg1 = by_thread(), postgres_cpu(postmaster)
            own1 = host_cpu(threads1)
            replay = sum(replay_cpu(s) for _, _, s in servers) - replay0
            p0 = cpu_by_group(servers[0][0].pid)["process"]
            for _ in range(POLL_COST_ASKS):
                sweep_done(sweep_id)
            poll_ms = (cpu_by_group(servers[0][0].pid)["process"] - p0) / POLL_COST_ASKS * 1000.0
            status, _, data = request(port0, "GET", f"/sweeps/{sweep_id}")
            state = json.loads(data)
            got = [row.get("predictions_sha256") for row in state["cells"]]
            assert got == expected[:cells], "a cell's predictions differ from the kept output's"
            ran = [sum(s[2] for s in json.loads(st.read_text())["spans"]) if st.exists() else 0
                   for _, _, st in servers]
            host = (own1 - own0 + pg1 - pg0 - replay) / cells * 1000.0
            return {"replicas": count, "cores": count, "cells": cells, "wall_s": round(wall, 3),
                    "server_cells_per_s": round(cells / wall, 2),
                    "host_cpu_ms_per_cell": round(host, 4),
                    "host_cpu_ms_per_cell_without_polls": round(host - polls * poll_ms / cells, 4),
                    "replicas_ms_per_cell": round((own1 - own0 - replay) / cells * 1000.0, 4),
                    "postgres_ms_per_cell": round((pg1 - pg0) / cells * 1000.0, 4),
                    "by_thread_ms_per_cell": {k: round((threads1[k] - threads0.get(k, 0.0)) / cells * 1000.0, 4)
                                              for k in threads1},  # (every replica's, the replay included)
                    "cells_launched_by_replica": ran, "polls": polls, "poll_cpu_ms": round(poll_ms, 3)}
        finally:
            for proc, _, _ in servers:
                stop_server(proc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", default="1,2,1,2", help="comma-separated replica counts, one core each")
    parser.add_argument("--lrs", type=int, default=10)
    parser.add_argument("--seeds", type=int, default=132)
    parser.add_argument("--batch-max", type=int, default=132)
    parser.add_argument("--launch-ms", type=float, default=1.0)
    parser.add_argument("--cache", default="/tmp/rev88-stand-in")
    parser.add_argument("--out", default=str(HERE / "results"))
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.replicas.split(",") if c.strip()]
    available = sorted(os.sched_getaffinity(0))
    if any(n < 1 or n > len(available) for n in counts):
        parser.error(f"--replicas: each entry between 1 and the {len(available)} cores this process may use")

    from learner.data import bundled_mnist_dir
    from learner.evaluate import dataset_seed
    from learner.taskio import make_task, task_to_npz_bytes
    from tests.pg import PgCluster, find_bindir

    bindir = find_bindir()
    if bindir is None:
        print("needs PostgreSQL server binaries (apt-get install postgresql)", file=sys.stderr)
        return 2
    lrs = [round(0.05 + 0.01 * i, 4) for i in range(args.lrs)]
    task, _ = make_task(bundled_mnist_dir(), dataset_seed(0))
    body = task_to_npz_bytes(task)
    digest = "sha256:" + hashlib.sha256(body).hexdigest()
    sweep_cells = [(body, {"learning_rate": lr, "seed": s}) for lr in lrs for s in range(args.seeds)]
    folder = Path(args.cache) / f"lrs{args.lrs}-seeds{args.seeds}-eval0"  # (bench_launches.py's, shared)
    precompute(folder, sweep_cells)
    expected = expected_hashes(folder, len(sweep_cells))
    stand_in_rate = args.batch_max / (args.launch_ms / 1000.0)
    cluster = PgCluster(bindir, fsync=True)
    cluster.start()
    runs = []
    try:
        for n in counts:
            os.sched_setaffinity(0, set(available[:n]))  # (the bench itself: on the measured cores too)
            try:
                runs.append(one_entry(args, cluster, n, folder, expected, body, digest, lrs, len(sweep_cells),
                                      stand_in_rate, available))
            finally:
                os.sched_setaffinity(0, set(available))
            r = runs[-1]
            print(r["replicas"], r["host_cpu_ms_per_cell_without_polls"], r["server_cells_per_s"],
                  r["cells_launched_by_replica"], file=sys.stderr)
    finally:
        cluster.stop()
    doc = {"machine": machine(), "batch_max": args.batch_max, "launch_ms": args.launch_ms, "runs": runs,
           "ceiling": ceiling(runs)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "replicas.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
