"""What the shared ledger costs: PostgreSQL against SQLite, on this machine (issue #22).

1. Added latency of an asynchronous task, 202 -> succeeded. A real `rev88 serve` (cpu-fast, one
   worker) on each store in turn: SQLite in a temporary data dir, then PostgreSQL (a throwaway
   server from Debian's binaries, fsync on: as durable as SQLite's synchronous=FULL). Tasks are
   sent one after another (``Prefer: respond-async``) and polled (GET /tasks/{id} every 2 ms)
   until they have succeeded; per task:

       accept      POST sent -> 202 (the task and its npz durable in the ledger)
       to result   POST sent -> GET answers succeeded
       run         the learner's own run (timing.run_ms)
       added       to result - run: everything the service and its ledger add

   for a small task (200 train / 30 queries, 36 KB npz) and MNIST-medium draw 0 (10k/10k, 6.5 MB).

2. Claim/complete rate with a backend that does no work: the PostgreSQL ledger alone, N
   queued asynchronous tasks (1 KB inputs), W threads each claiming up to B tasks, marking them
   running in one transaction (as the ledger writer does) and finishing each (its answer stored,
   its input deleted, fenced by the lease): tasks per second, and per task the whole ledger
   cycle (create + claim + running + finish) from one thread, against SQLite's create +
   running + finish.

Not a test; run it by hand at a quiet moment:

    python bench/bench_ledger.py [--repeats 20] [--draw0-repeats 5] [--tasks 600] [--json out.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from learner.data import bundled_mnist_dir  # noqa: E402
from learner.taskio import make_task, task_to_npz_bytes  # noqa: E402
from tests.helpers import small_task  # noqa: E402
from tests.pg import PgCluster, create_database, find_bindir  # noqa: E402
from tests.server import post_task, running_server  # noqa: E402

ASYNC = {"Prefer": "respond-async"}
ANSWER = {"id": "x", "predictions": list(range(30)), "predictions_sha256": "ab" * 32, "timing": {"run_ms": 0.5}}


def median(values: list[float]) -> float:
    return round(statistics.median(values), 2)


def latency(env: dict[str, str], bodies: dict[str, tuple[bytes, int]]) -> dict:
    out = {}
    with tempfile.TemporaryDirectory() as tmp, running_server(Path(tmp), env=env) as srv, \
            srv.client(timeout=120) as c:
        for label, (body, repeats) in bodies.items():
            post_task(c, body)  # warm: first-run caches, prepared statements
            rows = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                r = post_task(c, body, headers=ASYNC)
                t_accept = time.perf_counter()
                assert r.status_code == 202, r.text
                task_id = r.json()["id"]
                while True:
                    doc = c.get(f"/tasks/{task_id}").json()
                    if doc["status"] in ("succeeded", "failed", "cancelled"):
                        break
                    time.sleep(0.002)
                t_done = time.perf_counter()
                assert doc["status"] == "succeeded", doc
                run_ms = doc["timing"]["run_ms"]
                total = (t_done - t0) * 1000
                rows.append({"accept_ms": (t_accept - t0) * 1000, "to_result_ms": total, "run_ms": run_ms,
                             "added_ms": total - run_ms})
            out[label] = {k: median([r[k] for r in rows]) for k in rows[0]} | {"n": len(rows)}
    return out


def claim_rate(url: str, tasks: int, threads: int, batch: int) -> dict:
    from app.ledger.postgres import PostgresLedger

    seeder = PostgresLedger(url, owner="seeder", pool_size=4)
    body = b"\0" * 1024
    sha = hashlib.sha256(body).hexdigest()
    for _ in range(tasks):
        seeder.create(task_id=uuid.uuid4().hex, kind="task", mode="async", backend="cpu", config={"seed": 1},
                      options={}, train_count=10, test_count=30, body_sha256=sha, body_bytes=len(body), body=body)
    ledgers = [PostgresLedger(url, owner=f"worker-{i}", pool_size=2) for i in range(threads)]
    done = [0] * threads

    def work(i: int) -> None:
        led = ledgers[i]
        while True:
            claims = led.claim(batch)
            if not claims:
                return
            led.mark_running_many([(c.record.id, "cpu:0", time.time()) for c in claims])
            for c in claims:
                led.finish(c.record.id, "succeeded", answer={**ANSWER, "id": c.record.id}, with_answer=False)
            done[i] += len(claims)

    t0 = time.perf_counter()
    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - t0
    assert sum(done) == tasks, done
    for led in [seeder, *ledgers]:
        led.close()
    return {"threads": threads, "batch": batch, "tasks": tasks, "seconds": round(elapsed, 3),
            "tasks_per_s": round(tasks / elapsed, 1)}


def cycle(ledger_factory, n: int, claim: bool) -> float:
    """ms per task of the whole ledger cycle of one asynchronous task, from one thread."""
    led = ledger_factory()
    body = b"\0" * 1024
    sha = hashlib.sha256(body).hexdigest()
    t0 = time.perf_counter()
    for _ in range(n):
        task_id = uuid.uuid4().hex
        led.create(task_id=task_id, kind="task", mode="async", backend="cpu", config={"seed": 1}, options={},
                   train_count=10, test_count=30, body_sha256=sha, body_bytes=len(body), body=body)
        if claim:
            led.claim(1)
        led.mark_running_many([(task_id, "cpu:0", time.time())])
        led.finish(task_id, "succeeded", answer={**ANSWER, "id": task_id}, with_answer=False)
    ms = (time.perf_counter() - t0) * 1000 / n
    led.close()
    return round(ms, 3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20, help="small tasks per store")
    ap.add_argument("--draw0-repeats", type=int, default=5, help="draw-0 tasks per store (0: skip)")
    ap.add_argument("--tasks", type=int, default=600, help="tasks per claim/complete run")
    ap.add_argument("--fsync", choices=("on", "off"), default="on", help="the PostgreSQL server's fsync")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    bindir = find_bindir()
    if bindir is None:
        print("needs PostgreSQL server binaries (apt-get install postgresql)", file=sys.stderr)
        return 2
    cluster = PgCluster(bindir, fsync=args.fsync == "on")
    cluster.start()
    results: dict = {"fsync": args.fsync}
    try:
        bodies = {"small 200/30": (task_to_npz_bytes(small_task(200, 30, seed=1)), args.repeats)}
        if args.draw0_repeats:
            task = make_task(bundled_mnist_dir(), 2026091400)[0]
            bodies["draw 0 10k/10k"] = (task_to_npz_bytes(task), args.draw0_repeats)
        base = {"REV88_BACKEND": "cpu-fast", "REV88_WORKERS": "1", "REV88_LOG_LEVEL": "warning"}
        results["latency"] = {
            "sqlite": latency(base, bodies),
            "postgres": latency({**base, "REV88_DATABASE_URL": create_database(cluster.url)}, bodies),
        }
        results["claim_complete"] = [claim_rate(create_database(cluster.url), args.tasks, t, b)
                                     for t, b in ((1, 1), (2, 1), (4, 1), (4, 8))]
        from app.ledger import Ledger
        from app.ledger.postgres import PostgresLedger

        url = create_database(cluster.url)
        with tempfile.TemporaryDirectory() as tmp:
            results["cycle_ms_per_task"] = {
                "sqlite (create, running, finish)": cycle(lambda: Ledger(Path(tmp) / "data"), 200, claim=False),
                "postgres (create, claim, running, finish)": cycle(lambda: PostgresLedger(url, owner="c"), 200,
                                                                   claim=True),
            }
    finally:
        cluster.destroy()
    print(json.dumps(results, indent=2))
    for label in results["latency"]["sqlite"]:
        s, p = results["latency"]["sqlite"][label], results["latency"]["postgres"][label]
        print(f"{label}: added latency 202->succeeded sqlite {s['added_ms']} ms, postgres {p['added_ms']} ms "
              f"(accept {s['accept_ms']} / {p['accept_ms']} ms, run {s['run_ms']} / {p['run_ms']} ms)")
    for row in results["claim_complete"]:
        print(f"claim/complete, {row['threads']} thread(s), batch {row['batch']}: {row['tasks_per_s']} tasks/s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
