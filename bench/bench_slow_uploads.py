"""Slow uploads against a real ``rev88 serve``: do trickling connections deny service?

``--tricklers`` connections (1,500 by default) each send a POST /tasks's headers and a few bytes
of a 6.5 MB body, then one byte every ``--every`` seconds (10); ``--headers-only`` more (64) each
send headers declaring the largest body (REV88_MAX_BODY_BYTES, 64 MiB) and two bytes, then
nothing (the upload budget holds nine such bodies: reserved at their declared size, nine would
lock every upload out). Meanwhile one client sends a normal small task every second, and another
the draw-0 task (6.5 MB) every ``--large-every`` seconds (4), recording statuses and latencies.
The run ends once every trickler and holder has been answered (408) or reset, plus a few
seconds. Reported:

    normal uploads during the trickle, small and large: statuses and latencies (the goal: every
    one 200, none 503)
    when the tricklers and holders were closed, relative to their upload deadlines (the goal: all
    with 408 or a reset, soon after), and the first normal upload after it

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


def send_retrying(conn: Connection, raw: bytes, port: int) -> tuple[int, Connection, bool]:
    """(status, the connection to use next, whether it was sent again): a kept-alive connection the
    server closed as idle (REV88_KEEPALIVE_S) just as the request went out fails before any answer;
    like any HTTP client, send it once more on a new connection. -1: that failed too."""
    try:
        return conn.request(raw)[0], conn, False
    except OSError:
        conn = Connection("127.0.0.1", port)
    try:
        return conn.request(raw)[0], conn, True
    except OSError:
        return -1, Connection("127.0.0.1", port), True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tricklers", type=int, default=1500)
    parser.add_argument("--every", type=float, default=10.0, help="seconds between a trickler's bytes")
    parser.add_argument("--headers-only", type=int, default=64,
                        help="connections that declare the largest body and send two bytes of it")
    parser.add_argument("--large-every", type=float, default=4.0, help="seconds between draw-0 uploads (0: none; under REV88_KEEPALIVE_S, 5)")
    parser.add_argument("--upload-timeout", type=float, default=None, help="REV88_UPLOAD_TIMEOUT_S (default: the server's)")
    parser.add_argument("--out", default=str(HERE / "results"))
    args = parser.parse_args(argv)
    import numpy as np

    from learner.taskio import task_to_npz_bytes, validate_task

    rng = np.random.Generator(np.random.PCG64(7))
    small = task_to_npz_bytes(validate_task(rng.random((50, 1, 9, 9), dtype=np.float32),
                                            (np.arange(50) % 10).astype(np.int64), rng.random((5, 1, 9, 9), dtype=np.float32)))
    from bench_load import task_bytes

    large, _ = task_bytes()
    timeout = args.upload_timeout if args.upload_timeout is not None else 60.0
    max_body = 64 * 1024 * 1024  # rev88 serve's default REV88_MAX_BODY_BYTES
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
        holder_head = (b"POST /tasks HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/octet-stream\r\n"
                       b"Content-Length: %d\r\n\r\nPK" % max_body)
        holders = 0
        for _ in range(args.headers_only):
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=10)
                s.sendall(holder_head)
                s.setblocking(False)
                sel.register(s, selectors.EVENT_READ, {"opened": time.monotonic(), "got": b"", "kind": "holder"})
                socks.append(s)
                holders += 1
            except OSError:
                refused_connect += 1
        opened_s = time.monotonic() - t0
        normal, closed = [], []
        conn, big_conn = Connection("127.0.0.1", port), Connection("127.0.0.1", port)
        raw = build_request("127.0.0.1", port, "POST", "/tasks", small)
        big_raw = build_request("127.0.0.1", port, "POST", "/tasks", large)
        next_byte, next_normal, next_large = time.monotonic() + args.every, time.monotonic(), time.monotonic() + 0.5
        end = time.monotonic() + timeout + max_body / (1 << 20) + 120
        while time.monotonic() < end:
            now = time.monotonic()
            if len(closed) == len(socks) and now - t0 > (closed[-1]["at_s"] if closed else 0) + 3:
                break  # every trickler answered or reset, and 3 s of normal uploads after
            if now >= next_normal:
                status, conn, retried = send_retrying(conn, raw, port)
                normal.append({"at_s": round(now - t0, 2), "status": status, "kind": "small", "retried": retried,
                               "ms": round((time.monotonic() - now) * 1000, 1)})
                next_normal = now + 1.0
            if args.large_every and now >= next_large:
                status, big_conn, retried = send_retrying(big_conn, big_raw, port)
                normal.append({"at_s": round(now - t0, 2), "status": status, "kind": "large", "retried": retried,
                               "ms": round((time.monotonic() - now) * 1000, 1)})
                next_large = now + args.large_every
            if now >= next_byte:
                for s in socks:
                    if s.fileno() != -1 and sel.get_key(s).data.get("kind") != "holder":
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
                closed.append({"at_s": round(time.monotonic() - t0, 2), "status": status,
                               "kind": info.get("kind", "trickler")})
                s.close()
        stop_server(proc)
    statuses: dict[str, dict[str, int]] = {}
    for c in closed:
        by = statuses.setdefault(c["kind"], {})
        by[c["status"]] = by.get(c["status"], 0) + 1
    last_closed = max((c["at_s"] for c in closed), default=None)
    after = [n for n in normal if last_closed is not None and n["at_s"] >= last_closed]
    during = [n for n in normal if last_closed is None or n["at_s"] < last_closed]
    doc = {
        "tricklers": args.tricklers, "headers_only": holders, "opened": len(socks),
        "refused_at_connect": refused_connect, "opened_in_s": round(opened_s, 2), "upload_timeout_s": timeout,
        "closed": len(closed), "answers": statuses,
        "first_closed_s": {k: min((c["at_s"] for c in closed if c["kind"] == k), default=None)
                           for k in ("trickler", "holder")},
        "last_closed_s": last_closed,
        "normal_during": {k: {s: sum(1 for n in during if n["status"] == s and n["kind"] == k)
                              for s in {n["status"] for n in during if n["kind"] == k}} for k in ("small", "large")},
        "normal_during_max_ms": {k: max((n["ms"] for n in during if n["kind"] == k), default=None)
                                 for k in ("small", "large")},
        "first_normal_after_close": after[0] if after else None,
        "normal_sent_again": sum(1 for n in normal if n.get("retried")),
        "normal": normal,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "slow_uploads.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps({k: v for k, v in doc.items() if k != "normal"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
