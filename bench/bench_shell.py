"""What the HTTP shell costs beside the task it serves: server CPU per request, by thread.

In one run, against a real ``rev88 serve`` (defaults but ``--backend``, cpu-fast by default, and
a fresh ledger), one sequential keep-alive client (bench/bench_load.py's lean socket client)
sends, for each kind of request, ``--warm`` requests and then N measured ones:

    live      GET /v2/health/live
    tiny      POST /tasks, 50 train / 5 queries (synthetic, ~19 KB)
    1k        POST /tasks, 1,000 train / 1,000 queries (synthetic, ~0.65 MB)
    draw0     POST /tasks, the MNIST-medium draw 0 (10,000 / 10,000, ~6.6 MB)

The server's CPU time is read from /proc before and after each batch: the whole process
(/proc/PID/stat) and each thread (/proc/PID/task/*/stat, grouped by the OS thread names the
service gives them: ``main`` the event loop, ``rev88-w*`` the device workers, ``rev88-ledger``
the ledger writer, ``rev88-io`` the asyncio thread pool, ``rev88-recv`` the threads that read large
bodies from their sockets (app/http/body_reader.py), ``other`` the rest: ``rev88-log``, the
thread that formats and writes the log lines, anyio's pool, uvicorn). The same bodies are then run in this process as ``rev88 run`` does once the file is
in memory -- ``load_task(body)`` (parse, checks, input hashes) + ``run_task`` on the same
backend -- timed by ``time.process_time``. From these:

    fixed part     server CPU per tiny task - its in-process CPU
    per-MB part    ((draw0 server - in-process) - (tiny server - in-process)) / (draw0 MB - tiny MB)
    ratio          server CPU / in-process CPU, per size
    capacity       requests/s one process can take = 1 / event-loop CPU per request;
                   tasks/s per core = 1 / server CPU per task

``--batch-max N`` (N > 1) measures the batching path, the one every GPU deployment takes: the
server is the same ``rev88 serve`` with REV88_BATCH_MAX=N and its cpu-fast backend wrapped in a
stand-in with ``run_many`` (bench/batching_stand_in.py: the tasks of a launch run one by one), so
queued tasks of one shape are gathered into launches; ``--clients K`` sends from K keep-alive
connections at once (one sequential client gathers nothing: each launch holds one task). The
server's CPU is divided by every request sent.

CPU time, not wall time: on a shared machine it is far steadier. /proc counts in clock ticks
(10 ms), so each batch runs long enough for a few hundred ticks. Not a test, and nothing here is
a pass/fail threshold: run it by hand,

    python bench/bench_shell.py [--backend cpu-fast] [--out bench/results] [--scale 1.0]

It writes ``shell.json`` (every figure, the machine) to ``--out`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
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

from bench_load import Connection, build_request, machine, start_server, stop_server  # noqa: E402

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
GROUPS = ("main", "workers", "ledger", "io", "recv", "finish", "hash", "prepare", "to_thread", "other")
# request kind -> (train, queries, measured requests at --scale 1)
KINDS = {"live": (0, 0, 3000), "tiny": (50, 5, 1500), "1k": (1000, 1000, 300), "draw0": (10000, 10000, 150)}


def thread_group(pid: int, tid: int, comm: str) -> str:
    if tid == pid:
        return "main"
    if comm.startswith("rev88-w"):
        return "workers"
    if comm == "rev88-ledger":
        return "ledger"
    if comm.startswith("rev88-io"):
        return "io"
    if comm.startswith("rev88-recv"):
        return "recv"
    if comm.startswith("rev88-prepare"):  # seed-derived states computed ahead of their launch
        return "prepare"
    if comm.startswith("rev88-finish"):  # a launch's answers built and recorded (app/tasks/launches.py)
        return "finish"
    if comm.startswith("rev88-hash"):  # its cells' hashes
        return "hash"
    if comm.startswith("asyncio_"):  # asyncio.to_thread's default pool
        return "to_thread"
    return "other"


def _ticks(stat_text: str) -> int:
    fields = stat_text.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime (fields 14, 15 of stat)


def cpu_by_group(pid: int) -> dict[str, float]:
    """Seconds of CPU so far, per thread group and in all (the process's own counter)."""
    out = dict.fromkeys(GROUPS, 0.0)
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            ticks = _ticks(Path(f"/proc/{pid}/task/{tid}/stat").read_text())
        except OSError:  # the thread ended meanwhile (its ticks stay in the process total)
            continue
        out[thread_group(pid, int(tid), comm)] += ticks * TICK_S
    out["process"] = _ticks(Path(f"/proc/{pid}/stat").read_text()) * TICK_S
    return out


def bodies(draw0_bytes: bytes) -> dict[str, bytes]:
    import numpy as np

    from learner.taskio import task_to_npz_bytes, validate_task

    out = {"live": b""}
    for kind, (n, m, _) in KINDS.items():
        if kind in ("live", "draw0"):
            continue
        rng = np.random.Generator(np.random.PCG64(88 + n))
        task = validate_task(rng.random((n, 1, 9, 9), dtype=np.float32), (np.arange(n) % 10).astype(np.int64),
                             rng.random((m, 1, 9, 9), dtype=np.float32))
        out[kind] = task_to_npz_bytes(task)
    out["draw0"] = draw0_bytes
    return out


def in_process(body: bytes, backend: str, count: int) -> float:
    """CPU seconds per task of ``load_task(body)`` + ``run_task`` in this process (a fresh task each time)."""
    from learner.config import Config
    from learner.result import run_task
    from learner.taskio import load_task

    run_task(load_task(body), Config(), backend)  # warm: the backend object, caches
    t0 = time.process_time()
    for _ in range(count):
        run_task(load_task(body), Config(), backend)
    return (time.process_time() - t0) / count


def measure_server(pid: int, port: int, raw: bytes, warm: int, count: int, clients: int = 1) -> dict:
    """``count`` requests (``clients`` connections sending at once, ``count`` each), after ``warm``
    each: the server's CPU per request, by thread group."""
    import threading

    conns = [Connection("127.0.0.1", port) for _ in range(clients)]
    statuses: dict[int, int] = {}
    lock = threading.Lock()

    def send(conn, n: int) -> None:
        for _ in range(n):
            status, _, _ = conn.request(raw)
            with lock:
                statuses[status] = statuses.get(status, 0) + 1

    def all_send(n: int) -> None:
        threads = [threading.Thread(target=send, args=(c, n)) for c in conns]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    all_send(warm)
    statuses.clear()
    before, t0 = cpu_by_group(pid), time.perf_counter()
    all_send(count)
    wall = time.perf_counter() - t0
    time.sleep(0.3)  # let the ledger writer finish the last task's records
    after = cpu_by_group(pid)
    for conn in conns:
        conn.close()
    total = count * clients
    per = {k: round((after[k] - before[k]) / total * 1000.0, 3) for k in after}  # ms per request
    return {"requests": total, "clients": clients, "statuses": statuses, "wall_s": round(wall, 3), "cpu_ms": per}


def health_queue(port: int) -> dict:
    """The launches so far, from /health (how many tasks the batching path gathered per launch)."""
    conn = Connection("127.0.0.1", port)
    try:
        status, _, body = conn.request(build_request("127.0.0.1", port, "GET", "/health"))
    finally:
        conn.close()
    q = json.loads(body)["queue"]
    return {k: q.get(k) for k in ("launches", "batched", "largest_launch", "completed", "batch_max")}


def table(doc: dict) -> str:
    rows = ["| request | body | server CPU ms/req | event loop | workers | ledger | io pool | recv | other | in process "
            "| server − in process | ratio |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for kind, r in doc["requests"].items():
        c = r["cpu_ms"]
        inproc = r.get("in_process_ms")
        rows.append(
            f"| {kind} | {r['body_bytes'] / 1e6:.3f} MB | {c['process']:.2f} | {c['main']:.2f} | {c['workers']:.2f} "
            f"| {c['ledger']:.2f} | {c['io']:.2f} | {c.get('recv', 0.0):.2f} | {c['other']:.2f} | "
            + (f"{inproc:.2f} | {c['process'] - inproc:.2f} | {c['process'] / inproc:.2f}× |" if inproc else "— | — | — |"))
    d = doc["derived"]
    rows.append("")
    rows.append(f"fixed part {d['fixed_ms']:.2f} ms per task · per-MB part {d['per_mb_ms']:.2f} ms/MB · "
                f"event loop per tiny request {d['loop_ms_tiny']:.2f} ms (capacity ≈ {d['requests_per_s_tiny']:.0f} "
                f"tiny requests/s per process; {d['requests_per_s_draw0']:.0f} draw-0 requests/s) · draw 0 at "
                f"{d['draw0_ratio']:.2f}× its in-process CPU · {d['draw0_tasks_per_core_s']:.1f} draw-0 tasks/s per core")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="cpu-fast")
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every batch's request count")
    parser.add_argument("--warm", type=int, default=20)
    parser.add_argument("--batch-max", type=int, default=1, help="> 1: the batching path (a stand-in backend "
                        "with run_many, bench/batching_stand_in.py) with REV88_BATCH_MAX set to this")
    parser.add_argument("--clients", type=int, default=1, help="connections sending at once")
    parser.add_argument("--launcher", help="a script that runs the rev88 command line (to try a variant of the "
                        "server without changing it: it may set a module's constant first)")
    parser.add_argument("--only", default=",".join(KINDS), help="the request kinds to run, comma-separated "
                        "(the derived figures need tiny and draw0)")
    args = parser.parse_args(argv)
    only = [k.strip() for k in args.only.split(",") if k.strip()]
    unknown = sorted(set(only) - set(KINDS))
    if unknown:
        parser.error(f"--only: unknown kind(s) {', '.join(unknown)}; the kinds are {', '.join(KINDS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from bench_load import task_bytes

    draw0, what = task_bytes()
    payloads = {kind: body for kind, body in bodies(draw0).items() if kind in only}
    doc: dict = {"backend": args.backend, "draw0": what, "machine": machine(), "batch_max": args.batch_max,
                 "clients": args.clients, "requests": {}}
    launcher = [str(HERE / "batching_stand_in.py")] if args.batch_max > 1 else None
    if args.launcher:
        launcher = [args.launcher]
    with tempfile.TemporaryDirectory() as tmp:
        proc, port = start_server(args.backend, Path(tmp) / "server.log", Path(tmp) / "data", launcher=launcher,
                                  args=["--batch-max", str(args.batch_max)] if args.batch_max > 1 else None)
        try:
            for kind, body in payloads.items():
                count = max(5, int(KINDS[kind][2] * args.scale))
                raw = (build_request("127.0.0.1", port, "GET", "/v2/health/live") if kind == "live"
                       else build_request("127.0.0.1", port, "POST", "/tasks", body))
                r = measure_server(proc.pid, port, raw, args.warm, count, args.clients)
                r["body_bytes"] = len(body)
                if kind != "live":
                    r["queue"] = health_queue(port)
                doc["requests"][kind] = r
                print(f"{kind}: {r['cpu_ms']}", file=sys.stderr)
        finally:
            stop_server(proc)
    for kind, body in payloads.items():
        if kind != "live":
            count = max(5, int(KINDS[kind][2] * args.scale) // 2)
            doc["requests"][kind]["in_process_ms"] = round(in_process(body, args.backend, count) * 1000.0, 3)
    r = doc["requests"]
    if not {"tiny", "draw0"} <= set(r):
        print(json.dumps({k: v["cpu_ms"] | {"in_process": v.get("in_process_ms")} for k, v in r.items()}, indent=1))
        return 0
    fixed = r["tiny"]["cpu_ms"]["process"] - r["tiny"]["in_process_ms"]
    big = r["draw0"]["cpu_ms"]["process"] - r["draw0"]["in_process_ms"]
    mb = (r["draw0"]["body_bytes"] - r["tiny"]["body_bytes"]) / 1e6
    doc["derived"] = {
        "fixed_ms": round(fixed, 3),
        "per_mb_ms": round((big - fixed) / mb, 3),
        "loop_ms_tiny": r["tiny"]["cpu_ms"]["main"],
        "loop_ms_draw0": r["draw0"]["cpu_ms"]["main"],
        "requests_per_s_tiny": round(1000.0 / max(r["tiny"]["cpu_ms"]["main"], 1e-3), 1),
        "requests_per_s_draw0": round(1000.0 / max(r["draw0"]["cpu_ms"]["main"], 1e-3), 1),
        "draw0_ratio": round(r["draw0"]["cpu_ms"]["process"] / r["draw0"]["in_process_ms"], 3),
        "draw0_tasks_per_core_s": round(1000.0 / r["draw0"]["cpu_ms"]["process"], 2),
    }
    (out / "shell.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
