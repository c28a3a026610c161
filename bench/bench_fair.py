"""Fair share under a flood: each tenant's queue wait when one tenant floods the queue (issue #33).

Against real ``rev88 serve`` processes (``--backend``, cpu by default; REV88_API_KEY set, one
worker each): tenant "flood" sends ``--flood`` asynchronous draw-sized tasks, then tenant "small"
sends ``--small``; every task is waited for. With ``--database-url`` two replicas share that
PostgreSQL database (the flood through one, the small tenant through the other), else one
process with SQLite. Reported per tenant: queue waits (started_at - created_at, from the ledger),
the small tenant's positions in the start order, and what plain FIFO would have made it wait (the
flood's run time ahead of it). Not a test; run it by hand at a quiet moment:

    python bench/bench_fair.py [--flood 24] [--small 4] [--database-url postgresql://...] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
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

from bench_load import machine, start_server, stop_server, task_bytes  # noqa: E402

ADMIN = "bench-fair-admin"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flood", type=int, default=24)
    ap.add_argument("--small", type=int, default=4)
    ap.add_argument("--backend", default="cpu", help="default cpu: slow enough (0.5 s a task here) for a queue to form")
    ap.add_argument("--database-url", help="two replicas on this PostgreSQL database (else one process, SQLite)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    body, _ = task_bytes()
    admin = {"Authorization": f"Bearer {ADMIN}"}
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        env = {"REV88_API_KEY": ADMIN, "REV88_WORKERS": "1", "REV88_QUEUE_SIZE": str(args.flood + args.small + 8)}
        extra = ["--database-url", args.database_url] if args.database_url else []
        servers = [start_server(args.backend, tmp_path / f"s{i}.log", tmp_path / f"d{i}", env=env, args=extra)
                   for i in range(2 if args.database_url else 1)]
        urls = [f"http://127.0.0.1:{port}" for _, port in servers]
        try:
            with httpx.Client(timeout=600) as c:
                keys = {name: c.post(f"{urls[0]}/keys", json={"name": name}, headers=admin).json()["key"]
                        for name in ("flood", "small")}
                sent: dict[str, list[str]] = {"flood": [], "small": []}
                for name, count, url in (("flood", args.flood, urls[0]), ("small", args.small, urls[-1])):
                    for _ in range(count):
                        r = c.post(f"{url}/tasks", content=body, headers={
                            "Authorization": f"Bearer {keys[name]}", "Prefer": "respond-async",
                            "Content-Type": "application/octet-stream"})
                        r.raise_for_status()
                        sent[name].append(r.json()["id"])
                every = sent["flood"] + sent["small"]
                deadline = time.monotonic() + 1800
                while True:
                    listed = {t["id"]: t for t in c.get(f"{urls[0]}/tasks", params={"limit": 500},
                                                        headers=admin).json()["tasks"]}
                    if all(listed.get(t, {}).get("status") == "succeeded" for t in every):
                        break
                    if time.monotonic() > deadline:
                        raise SystemExit("the tasks did not finish in 30 minutes")
                    time.sleep(0.5)
        finally:
            for proc, _ in servers:
                stop_server(proc)
    order = sorted(every, key=lambda t: listed[t]["started_at"])
    waits = {name: [listed[t]["started_at"] - listed[t]["created_at"] for t in ids] for name, ids in sent.items()}
    run_s = statistics.mean(listed[t]["run_ms"] / 1000 for t in every)
    # plain FIFO: a small task would wait for every flood task not yet started when it arrived
    # (they were all queued before it), and for the small ones ahead of it
    fifo_small = [(sum(1 for f in sent["flood"] if listed[f]["started_at"] > listed[t]["created_at"]) + i)
                  * run_s / len(urls) for i, t in enumerate(sent["small"])]
    report = {
        "what": "queue wait per tenant under a flood, fair share on", "backend": args.backend,
        "replicas": len(urls), "flood": args.flood, "small": args.small, "machine": machine(),
        "mean_run_s": round(run_s, 4),
        "small_positions_in_start_order": [order.index(t) for t in sent["small"]],
        "wait_s": {name: {"mean": round(statistics.mean(w), 3), "max": round(max(w), 3)} for name, w in waits.items()},
        "small_wait_if_fifo_s": {"mean": round(statistics.mean(fifo_small), 3), "max": round(max(fifo_small), 3)},
    }
    report["small_wait_ratio_to_fifo"] = round(report["wait_s"]["small"]["mean"] / report["small_wait_if_fifo_s"]["mean"],
                                               3)
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = "fair-replicas.json" if args.database_url else "fair.json"
        (args.out / name).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
