"""What a webhook costs (issue #34): the server's CPU time per task with and without one, and the
latency from a task's end to its message's arrival.

Against one real ``rev88 serve`` (``--backend``, cpu-fast by default, SQLite or ``--database-url``):
``--tasks`` small asynchronous tasks without a webhook, then as many with ``webhook=`` (completed)
to a receiver on 127.0.0.2 (allowed with ``REV88_WEBHOOK_ALLOW_CIDRS=127.0.0.2/32``; nothing leaves
loopback), each round waited for until every task has finished (and every message arrived). The
server's CPU time (utime + stime of the process, /proc/PID/stat) over each round is the cost;
the ratio of the two rounds is the figure, and the latency is the receiver's arrival time minus
the task's ``finished_at`` (same machine, same clock). Not a test; run it at a quiet moment:

    python bench/bench_webhooks.py [--tasks 100] [--backend cpu-fast] [--database-url ...] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from bench_load import machine, start_server, stop_server  # noqa: E402


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def small_task() -> bytes:
    import numpy as np

    from learner.taskio import task_to_npz_bytes, validate_task

    rng = np.random.default_rng(34)
    return task_to_npz_bytes(validate_task(rng.random((200, 1, 9, 9), dtype=np.float32),
                                           rng.integers(0, 10, 200).astype(np.int64),
                                           rng.random((50, 1, 9, 9), dtype=np.float32)))


def one_round(c: httpx.Client, body: bytes, count: int, pid: int, webhook: str | None, receiver) -> dict:
    params = {"webhook": webhook} if webhook else {}
    headers = {"Content-Type": "application/octet-stream", "Prefer": "respond-async"}
    before = len(receiver.requests)
    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    ids = []
    for _ in range(count):
        r = c.post("/tasks", content=body, params=params, headers=headers)
        r.raise_for_status()
        ids.append(r.json()["id"])
    docs = {}
    for task_id in ids:
        while True:
            d = c.get(f"/tasks/{task_id}").json()
            if d["status"] in ("succeeded", "failed", "cancelled"):
                docs[task_id] = d
                break
            time.sleep(0.02)
    if webhook:
        receiver.wait_for(before + count, timeout=120)
    wall, cpu = time.monotonic() - t0, cpu_seconds(pid) - cpu0
    out = {"tasks": count, "wall_s": round(wall, 3), "server_cpu_s": round(cpu, 3),
           "server_cpu_ms_per_task": round(cpu / count * 1000, 3)}
    if webhook:
        listed = {t["id"]: t for t in c.get("/tasks", params={"limit": 500}).json()["tasks"]}
        latencies = []
        for q in receiver.requests[before:]:
            task_id = json.loads(q.body)["data"]["id"]
            latencies.append((q.at - listed[task_id]["finished_at"]) * 1000)
        latencies.sort()
        out["latency_ms"] = {"median": round(statistics.median(latencies), 1),
                             "p95": round(latencies[int(0.95 * (len(latencies) - 1))], 1),
                             "max": round(latencies[-1], 1)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=100)
    ap.add_argument("--backend", default="cpu-fast")
    ap.add_argument("--database-url", default=None)
    ap.add_argument("--draw0", action="store_true", help="MNIST-medium draw 0 (10k/10k) instead of a 200/50 task")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--py-spy", type=Path, default=None, help="profile the server during the webhook round "
                    "(py-spy record, flame graph SVG)")
    args = ap.parse_args()
    from tests.receivers import Receiver

    if args.draw0:
        from bench_load import task_bytes

        body = task_bytes()[0]
    else:
        body = small_task()
    env = {"REV88_WEBHOOK_ALLOW_CIDRS": "127.0.0.2/32", "REV88_LOG_LEVEL": "warning"}
    if args.database_url:
        env["REV88_DATABASE_URL"] = args.database_url
    with tempfile.TemporaryDirectory() as tmp, Receiver("127.0.0.2") as receiver:
        proc, port = start_server(args.backend, Path(tmp) / "server.log", Path(tmp) / "data", env=env)
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
                one_round(c, body, 10, proc.pid, None, receiver)  # warm-up
                plain = one_round(c, body, args.tasks, proc.pid, None, receiver)
                spy = None
                if args.py_spy:
                    import subprocess

                    spy = subprocess.Popen(["py-spy", "record", "--pid", str(proc.pid), "--rate", "200", "--threads",
                                            "--format", "raw", "--output", str(args.py_spy)],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    time.sleep(1.0)
                hooked = one_round(c, body, args.tasks, proc.pid, receiver.url, receiver)
                if spy is not None:
                    spy.send_signal(2)
                    spy.wait(30)
        finally:
            stop_server(proc)
    result = {"machine": machine(), "backend": args.backend, "task": "draw 0 (10k/10k)" if args.draw0 else "200/50",
              "ledger": "postgresql" if args.database_url else "sqlite", "without_webhook": plain,
              "with_webhook": hooked,
              "cpu_ratio_with_over_without": round(hooked["server_cpu_s"] / plain["server_cpu_s"], 3)}
    print(json.dumps(result, indent=2))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"webhooks-{result['ledger']}{'-draw0' if args.draw0 else ''}.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
