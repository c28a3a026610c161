"""Bounded work, measured on a real server (issue #13): peak memory and how fast a stop frees a device.

    python bench/bench_bounded.py [--out bench/results/bounded.json]

1. Peak resident memory (VmHWM of the server process) after warm-up, then after the worst task
   the default limits admit (60,000 training images x 10,000 queries x 100 epochs x depth 4,
   cpu-fast), then after a burst of abuse: every refused kind of request, and as many
   concurrent 10k-row uploads as the queue and upload admission allow, twice over.
2. Stop latency: an asynchronous long task (10,000 rows x 1,000 epochs) is started on each CPU
   backend; once it runs, POST /tasks/{id}/cancel; the figure is the time from the cancel
   request to the moment /health shows the worker idle again (median of --repeats).

Each part runs its own `rev88 serve` process (tests/server.py). Numbers depend on the machine;
they are figures for docs/performance.md and the closing note, not pass/fail limits.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from learner.taskio import task_to_npz_bytes  # noqa: E402
from tests.conftest import small_task  # noqa: E402
from tests.server import post_task, running_server, wait_for  # noqa: E402

MIB = 1024 * 1024


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def memory(folder: Path) -> dict:
    out: dict = {}
    worst = task_to_npz_bytes(small_task(60_000, 10_000, seed=1))
    ten_k = task_to_npz_bytes(small_task(10_000, 10_000, seed=2))
    with running_server(folder, env={"REV88_BACKEND": "cpu-fast"}) as srv, srv.client(timeout=900) as c:
        out["after_warmup_mib"] = peak_rss(srv.proc.pid) / MIB
        t0 = time.perf_counter()
        r = post_task(c, worst, params={"epochs": "100", "depth": "4"})
        assert r.status_code == 200, r.text
        out["worst_admitted"] = {"train": 60_000, "queries": 10_000, "epochs": 100, "depth": 4,
                                 "seconds": round(time.perf_counter() - t0, 2),
                                 "peak_rss_mib": round(peak_rss(srv.proc.pid) / MIB, 1)}
    with running_server(folder, env={"REV88_BACKEND": "cpu-fast"}) as srv:
        base = peak_rss(srv.proc.pid)
        refused = [({"depth": "100000"}, ten_k), ({"epochs": "100000"}, ten_k), ({"seed": str(2**70)}, ten_k),
                   ({"epochs": "1000", "batch_size": "1"}, ten_k)]
        codes: dict[str, int] = {}
        with srv.client() as c:
            for params, body in refused * 5:
                code = post_task(c, body, params=params).status_code
                codes[str(code)] = codes.get(str(code), 0) + 1
        out["refused"] = {"requests": sum(codes.values()), "codes": codes,
                          "peak_rss_growth_mib": round((peak_rss(srv.proc.pid) - base) / MIB, 1)}

        def send(_):
            with srv.client(timeout=900) as c:
                return post_task(c, ten_k, params={"epochs": "20"}).status_code

        clients = 48
        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            burst = list(pool.map(send, range(clients * 2)))
        out["burst"] = {"clients": clients, "requests": len(burst),
                        "codes": {str(k): burst.count(k) for k in sorted(set(burst))},
                        "peak_rss_mib": round(peak_rss(srv.proc.pid) / MIB, 1)}
    return out


def stop_latency(folder: Path, backend: str, repeats: int) -> dict:
    body = task_to_npz_bytes(small_task(10_000, 1_000, seed=3))
    times = []
    with running_server(folder, env={"REV88_BACKEND": backend, "REV88_WORKERS": "1"}) as srv, srv.client() as c:
        for _ in range(repeats):
            task_id = post_task(c, body, params={"epochs": "1000"}, headers={"Prefer": "respond-async"}).json()["id"]
            wait_for(lambda t=task_id: c.get(f"/tasks/{t}").json()["status"] == "running", 120, 0.01, "running")
            time.sleep(0.3)  # well inside its training
            t0 = time.perf_counter()
            c.post(f"/tasks/{task_id}/cancel")
            wait_for(lambda: c.get("/health").json()["queue"]["running"] is None, 120, 0.002, "idle")
            times.append((time.perf_counter() - t0) * 1000)
            assert c.get(f"/tasks/{task_id}").json()["status"] == "cancelled"
    return {"backend": backend, "repeats": repeats, "median_ms": round(statistics.median(times), 1),
            "min_ms": round(min(times), 1), "max_ms": round(max(times), 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "bounded.json")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        report = {"memory": memory(folder),
                  "stop": [stop_latency(folder, b, args.repeats) for b in ("cpu-fast", "cpu")]}
    report["load_average"] = Path("/proc/loadavg").read_text().split()[:3]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
