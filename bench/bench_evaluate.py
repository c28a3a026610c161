"""What grading the published draws costs, graded on the server against uploaded draw by draw.

In one run, against a real ``rev88 serve`` (defaults but ``--backend``, cpu-fast by default, a
fresh data dir), ``rev88 evaluate --url`` twice over the same draws and config:

    uploads   ``--uploads``: each draw built here and sent as its own POST /tasks (the way before
              issue #32)
    graded    one POST /evaluations: the server builds the draws from its MNIST files, runs and
              scores them; this side fetches each draw's predictions and checks every figure
              against the draws it builds itself

For each: the client's CPU (time.process_time of this process, which runs the command), the
server's CPU (/proc/PID/stat) from the command's start to its end, the bytes the client sent
in request bodies (counted by an httpx event hook), and the wall time. The second mode runs
first on a fresh server too, so the server's one-time build of the draws is in its figure;
``--repeat`` runs it again with the draws stored. Both reports must agree draw for draw.
Not a test; run it by hand at a quiet moment:

    python bench/bench_evaluate.py [--draws 0-10] [--backend cpu-fast] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from bench_load import machine, start_server, stop_server  # noqa: E402
from bench_shell import cpu_by_group  # noqa: E402


def run_mode(url: str, pid: int, draws: str, out: Path, uploads: bool) -> dict:
    import httpx

    from rev88.cli import main

    sent = {"bytes": 0, "requests": 0}
    original = httpx.Client.send

    def counting_send(self, request, **kw):  # every request the command makes, its body's size
        sent["requests"] += 1
        sent["bytes"] += len(request.read()) if request.stream is not None else 0
        return original(self, request, **kw)

    httpx.Client.send = counting_send
    try:
        server0, client0, wall0 = cpu_by_group(pid)["process"], time.process_time(), time.perf_counter()
        code = main(["evaluate", "--draws", draws, "--url", url, "--output", str(out), "--overwrite",
                     *(["--uploads"] if uploads else [])])
        wall, client = time.perf_counter() - wall0, time.process_time() - client0
        server = cpu_by_group(pid)["process"] - server0
    finally:
        httpx.Client.send = original
    if code != 0:
        raise SystemExit(f"rev88 evaluate exited {code}")
    summary = json.loads((out / "summary.json").read_text())
    return {"client_cpu_s": round(client, 3), "server_cpu_s": round(server, 3), "wall_s": round(wall, 3),
            "request_bytes": sent["bytes"], "requests": sent["requests"], "summary": summary}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draws", default="0-10")
    ap.add_argument("--backend", default="cpu-fast")
    ap.add_argument("--repeat", action="store_true", help="grade a second time, the draws stored")
    ap.add_argument("--out", type=Path, help="write evaluate.json into this folder")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        proc, port = start_server(args.backend, tmp_path / "server.log", tmp_path / "data")
        url = f"http://127.0.0.1:{port}"
        try:
            modes = {"graded": run_mode(url, proc.pid, args.draws, tmp_path / "graded", uploads=False),
                     "uploads": run_mode(url, proc.pid, args.draws, tmp_path / "uploads", uploads=True)}
            if args.repeat:
                modes["graded_again"] = run_mode(url, proc.pid, args.draws, tmp_path / "again", uploads=False)
        finally:
            stop_server(proc)
    keys = ("draw", "correct", "predictions_sha256", "input_hashes", "query_labels_sha256")
    rows = {name: [{k: d[k] for k in keys} for d in m["summary"]["draws"]] for name, m in modes.items()}
    assert all(r == rows["uploads"] for r in rows.values()), "the two ways disagree"
    totals = modes["graded"]["summary"]["totals"]
    report = {
        "what": "rev88 evaluate --url: one POST /evaluations (graded) against one POST /tasks per draw (uploads)",
        "draws": args.draws, "backend": args.backend, "correct": totals["correct_over_total"],
        "machine": machine(),
        "modes": {name: {k: v for k, v in m.items() if k != "summary"} for name, m in modes.items()},
        "ratios": {
            "client_cpu graded/uploads": round(modes["graded"]["client_cpu_s"] / modes["uploads"]["client_cpu_s"], 3),
            "server_cpu graded/uploads": round(modes["graded"]["server_cpu_s"] / modes["uploads"]["server_cpu_s"], 3),
            "request_bytes graded/uploads": round(modes["graded"]["request_bytes"] / modes["uploads"]["request_bytes"],
                                                  6),
        },
    }
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "evaluate.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
