"""Slow uploads against a real ``rev88 serve``: do trickling connections deny service?

``--tricklers`` connections (1,500 by default) each send a POST /tasks's headers and a few bytes
of a 6.5 MB body, then one byte every ``--every`` seconds (10). Meanwhile one client sends a
normal small task every second and records its status and latency. The run ends once every
trickler has been answered (408) or reset, plus a few seconds. Reported:

    normal uploads during the trickle: statuses and latencies (the goal: 200, not 503)
    when the tricklers were closed, relative to the upload timeout (the goal: all with 408 or a
    reset, soon after the timeout), and the first normal upload after it (within 2 s)

The server runs with its defaults (REV88_UPLOAD_TIMEOUT_S 60 s) unless ``--upload-timeout`` is
given (a shorter rehearsal). Not a test: run it by hand,

    python bench/bench_slow_uploads.py [--tricklers 1500] [--upload-timeout 60] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import selectors
import socket
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from bench_load import Connection, build_request, start_server, stop_server  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tricklers", type=int, default=1500)
    parser.add_argument("--every", type=float, default=10.0, help="seconds between a trickler's bytes")
    parser.add_argument("--upload-timeout", type=float, default=None, help="REV88_UPLOAD_TIMEOUT_S (default: the server's)")
    parser.add_argument("--out", default=str(HERE / "results"))
    args = parser.parse_args(argv)
    import numpy as np

    from learner.taskio import task_to_npz_bytes, validate_task

    rng = np.random.Generator(np.random.PCG64(7))
    small = task_to_npz_bytes(validate_task(rng.random((50, 1, 9, 9), dtype=np.float32),
                                            (np.arange(50) % 10).astype(np.int64), rng.random((5, 1, 9, 9), dtype=np.float32)))
    timeout = args.upload_timeout if args.upload_timeout is not None else 60.0
    with tempfile.TemporaryDirectory() as tmp:
        flags = [] if args.upload_timeout is None else ["--upload-timeout", str(args.upload_timeout)]
        proc, port = start_server("cpu-fast", Path(tmp) / "server.log", Path(tmp) / "data", args=flags)
        sel = selectors.DefaultSelector()
        head = (b"POST /tasks HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/octet-stream\r\n"
                b"Content-Length: 6561000\r\n\r\nPK\x03\x04")
        socks, refused_connect = [], 0
        t0 = time.monotonic()
        for _ in range(args.tricklers):
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=10)
                s.sendall(head)
                s.setblocking(False)
                sel.register(s, selectors.EVENT_READ, {"opened": time.monotonic(), "got": b""})
                socks.append(s)
            except OSError:
                refused_connect += 1
        opened_s = time.monotonic() - t0
        normal, closed = [], []
        conn = Connection("127.0.0.1", port)
        raw = build_request("127.0.0.1", port, "POST", "/tasks", small)
        next_byte, next_normal = time.monotonic() + args.every, time.monotonic()
        end = time.monotonic() + timeout + 120
        while time.monotonic() < end:
            now = time.monotonic()
            if len(closed) == len(socks) and now - t0 > (closed[-1]["at_s"] if closed else 0) + 3:
                break  # every trickler answered or reset, and 3 s of normal uploads after
            if now >= next_normal:
                try:
                    status, _, _ = conn.request(raw)
                except OSError:
                    status, conn = -1, Connection("127.0.0.1", port)
                normal.append({"at_s": round(now - t0, 2), "status": status,
                               "ms": round((time.monotonic() - now) * 1000, 1)})
                next_normal = now + 1.0
            if now >= next_byte:
                for s in socks:
                    if s.fileno() != -1:
                        try:
                            s.send(b"\x00")
                        except OSError:
                            pass
                next_byte = now + args.every
            for key, _ in sel.select(timeout=0.05):
                s, info = key.fileobj, key.data
                try:
                    chunk = s.recv(65536)
                except (ConnectionResetError, OSError):
                    chunk = None
                if chunk:
                    info["got"] += chunk
                    continue
                sel.unregister(s)
                status = info["got"][9:12].decode() if info["got"].startswith(b"HTTP/1.1 ") else "reset"
                closed.append({"at_s": round(time.monotonic() - t0, 2), "status": status})
                s.close()
        stop_server(proc)
    statuses: dict[str, int] = {}
    for c in closed:
        statuses[c["status"]] = statuses.get(c["status"], 0) + 1
    last_closed = max((c["at_s"] for c in closed), default=None)
    after = [n for n in normal if last_closed is not None and n["at_s"] >= last_closed]
    during = [n for n in normal if last_closed is None or n["at_s"] < last_closed]
    doc = {
        "tricklers": args.tricklers, "opened": len(socks), "refused_at_connect": refused_connect,
        "opened_in_s": round(opened_s, 2), "upload_timeout_s": timeout,
        "tricklers_closed": len(closed), "trickler_answers": statuses,
        "first_closed_s": min((c["at_s"] for c in closed), default=None), "last_closed_s": last_closed,
        "normal_during": {s: sum(1 for n in during if n["status"] == s) for s in {n["status"] for n in during}},
        "normal_during_max_ms": max((n["ms"] for n in during), default=None),
        "first_normal_after_close": after[0] if after else None,
        "normal": normal,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "slow_uploads.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps({k: v for k, v in doc.items() if k != "normal"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
