"""Throughput under load: the learner alone against the service, over a concurrency sweep.

In one run, for the MNIST-medium draw-0 task (10,000 train / 10,000 queries; a synthetic
task of the same shape when the MNIST files are absent), default config:

1. **learner alone** -- in one process per core, each looping for ``--seconds``: tasks/s summed
   over the processes, two ways. *load_task + run_task* (the fair baseline): the npz bytes in
   memory parsed, checked and hashed by ``learner.taskio.load_task`` into a fresh task, then
   ``learner.result.run_task`` -- what ``rev88 run`` does once the file is read. *run_task*: the
   learning and the result alone (the loaded task's hashes cached). Both measured before and
   after the service sweep (the machine's load drifts); the ratios use the mean of the two.
2. **service** -- a real ``rev88 serve`` process (uvicorn, default settings: one worker per
   core, backend ``--backend``, cpu-fast by default) on loopback, driven by closed-loop
   clients at each concurrency of the sweep (1, cores, 2 x cores, 4 x cores by default):
   tasks/s, p50/p99 latency, the answers' status codes, the server's and the clients' CPU
   time per task. Every answer's ``predictions_sha256`` is checked against the learner's,
   and one whole answer's hashes and metadata against ``run_task``'s.
3. **overload** (``--overload-clients``, 8 x cores by default) -- more clients than the
   queue holds: only 200 or 503 with ``Retry-After`` may come back (the clients wait the
   Retry-After they are given, as ``rev88 submit`` does).

The clients are deliberately cheap: each is a process holding one keep-alive socket that
sends a prebuilt HTTP/1.1 request (headers + the npz bytes, built once) with ``sendall`` and
reads the answer by its Content-Length; it parses nothing but the status line, the headers
and a few byte-level matches in the answer (``predictions_sha256``, ``timing.run_ms``). Their
cost is measured twice: CPU seconds per task (``time.process_time`` in each client, user +
system, which includes the kernel's copies of the 6.6 MB upload), and one client against
``GET /v2/health/live`` (the floor of a request through this client and the server's HTTP
stack). On a small machine the clients share the cores with the server: that cost is part
of what the service is measured under, and is reported, not subtracted.

Writes ``load.json`` (every figure, the load average before and after, the machine) and
``load.svg`` (tasks/s and p99 latency against concurrency) to ``--out``, and prints a
markdown table. Not a test, and nothing here is a pass/fail threshold: run it by hand,

    python bench/bench_load.py [--seconds 8] [--levels 1,2,4,8] [--out bench/results]
    python bench/bench_load.py --url http://127.0.0.1:8000 --server-pid PID   # a server already running
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
DRAW0_SEED = 2026091400
RUN_MS = re.compile(rb'"run_ms":([0-9.eE+-]+)')
SHA = re.compile(rb'"predictions_sha256":"([0-9a-f]{64})"')
HASH_KEYS = ("input_hashes", "epoch_permutation_sha256", "initial_parameter_sha256", "final_parameter_sha256",
             "final_velocity_sha256", "state_vector_sha256", "predictions_sha256", "scores_sha256", "config",
             "train_count", "test_count", "backend", "validation")


# --------------------------------------------------------------------------- the task


def task_bytes() -> tuple[bytes, str]:
    sys.path.insert(0, str(ROOT))
    import numpy as np

    from learner.data import bundled_mnist_dir
    from learner.taskio import make_task, task_to_npz_bytes, validate_task

    mnist = bundled_mnist_dir()
    if (mnist / "train-images.idx3-ubyte.gz").exists() or (mnist / "train-images.idx3-ubyte").exists():
        return task_to_npz_bytes(make_task(mnist, DRAW0_SEED)[0]), "MNIST-medium draw 0"
    rng = np.random.default_rng(0)
    task = validate_task(rng.random((10_000, 1, 9, 9), dtype=np.float32),
                         rng.integers(0, 10, 10_000).astype(np.int64),
                         rng.random((10_000, 1, 9, 9), dtype=np.float32))
    return task_to_npz_bytes(task), "synthetic 10k/10k (MNIST files not found)"


# --------------------------------------------------------------------------- learner alone


def _alone_process(path: str, backend: str, seconds: float, hash_inputs: bool, ready, go, results) -> None:
    sys.path.insert(0, str(ROOT))
    from learner.config import Config
    from learner.hashing import array_sha256
    from learner.result import run_task
    from learner.taskio import load_task

    body = Path(path).read_bytes()  # the npz in memory, as the service has it once received
    task = load_task(body)
    config = Config()
    first = run_task(task, config, backend)  # warm: the kernel, the validation cache
    ready.put(os.getpid())
    go.wait()
    times, cpu0 = [], time.process_time()
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end:
        t0 = time.perf_counter()
        if hash_inputs:  # the fair baseline: what rev88 run does once the file is in memory
            fresh = load_task(body)  # parse, checks and the input hashes, for a fresh task each time
            hashes = {name: array_sha256(arr) for name, arr in fresh.as_dict().items()}
            result = run_task(fresh, config, backend)
        else:  # the learning alone (the loaded task's hashes cached)
            result = run_task(task, config, backend)
        times.append(time.perf_counter() - t0)
        if result.predictions_sha256 != first.predictions_sha256:
            raise SystemExit("run_task changed its predictions between identical runs")
        if hash_inputs and hashes != result.metadata["input_hashes"]:
            raise SystemExit("the input hashes differ from the ones run_task reports")
    meta = {k: first.metadata[k] for k in HASH_KEYS if k in first.metadata}
    results.put({"tasks": len(times), "seconds": sum(times), "median_ms": 1000 * statistics.median(times),
                 "cpu_s": time.process_time() - cpu0, "meta": meta})


def learner_alone(path: str, backend: str, processes: int, seconds: float, hash_inputs: bool) -> dict:
    """(input hashes +) run_task in ``processes`` processes at once: tasks/s summed, median ms per task."""
    ctx = mp.get_context("spawn")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_alone_process, args=(path, backend, seconds, hash_inputs, ready, go, results))
             for _ in range(processes)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=300)
    go.set()
    got = [results.get(timeout=seconds + 300) for _ in procs]
    for p in procs:
        p.join()
    return {
        "processes": processes,
        "hash_inputs": hash_inputs,
        "tasks": sum(g["tasks"] for g in got),
        "tasks_per_s": sum(g["tasks"] / g["seconds"] for g in got),
        "run_task_median_ms": statistics.median(g["median_ms"] for g in got),
        "cpu_ms_per_task": 1000 * sum(g["cpu_s"] for g in got) / max(1, sum(g["tasks"] for g in got)),
        "meta": got[0]["meta"],
    }


# --------------------------------------------------------------------------- the lean client


class Connection:
    """One keep-alive HTTP/1.1 connection; requests are prebuilt bytes."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.sock: socket.socket | None = None
        self.buf = bytearray()

    def _connect(self) -> None:
        self.sock = socket.create_connection((self.host, self.port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray()

    def request(self, raw: bytes) -> tuple[int, dict[str, str], bytes]:
        if self.sock is None:
            self._connect()
        try:
            self.sock.sendall(raw)
            return self._response()
        except (ConnectionError, OSError):
            self.close()
            raise

    def _response(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buf:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError("server closed the connection")
            self.buf += chunk
        head, _, rest = bytes(self.buf).partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(headers.get("content-length", "0"))
        body = bytearray(rest)
        while len(body) < length:
            chunk = self.sock.recv(max(1 << 16, length - len(body)))
            if not chunk:
                raise ConnectionError("server closed the connection mid-answer")
            body += chunk
        self.buf = body[length:]
        if headers.get("connection", "").lower() == "close":
            self.close()
        return status, headers, bytes(body[:length])

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def build_request(host: str, port: int, method: str, path: str, body: bytes = b"") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
    if body:
        head += f"Content-Type: application/octet-stream\r\nContent-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


def _client_process(host, port, raw, expected, start_at, warm_s, stop_at, results) -> None:
    conn = Connection(host, port)
    rows, statuses, errors = [], {}, []
    now = time.monotonic()
    if start_at > now:
        time.sleep(start_at - now)
    cpu0 = cpu_window = None
    measure_from = start_at + warm_s
    while True:
        now = time.monotonic()
        if now >= stop_at:
            break
        if cpu_window is None and now >= measure_from:
            cpu_window = time.process_time()
        if cpu0 is None:
            cpu0 = time.process_time()
        t0 = time.monotonic()
        try:
            status, headers, body = conn.request(raw)
        except (ConnectionError, OSError) as exc:
            errors.append(repr(exc))
            statuses["connection error"] = statuses.get("connection error", 0) + 1
            time.sleep(0.05)
            continue
        t1 = time.monotonic()
        in_window = t0 >= measure_from and t1 <= stop_at
        if in_window:
            statuses[str(status)] = statuses.get(str(status), 0) + 1
        if status == 200:
            if expected is not None:
                m = SHA.search(body)
                if m is None or m.group(1).decode() != expected:
                    errors.append("predictions_sha256 differs from the learner's")
            if in_window:
                run = RUN_MS.search(body)
                rows.append((t1 - t0, float(run.group(1)) if run else None, t1))
        elif status == 503:
            retry = headers.get("retry-after")
            if retry is None:
                errors.append("503 without Retry-After")
            if in_window:
                statuses["503 with Retry-After"] = statuses.get("503 with Retry-After", 0) + (retry is not None)
            time.sleep(min(float(retry or 1), max(0.0, stop_at - time.monotonic())))
        else:
            errors.append(f"status {status}: {body[:200]!r}")
    cpu_end = time.process_time()
    conn.close()
    results.put({"rows": rows, "statuses": statuses, "errors": errors[:10],
                 "cpu_s": cpu_end - (cpu_window if cpu_window is not None else cpu_end),
                 "cpu_total_s": cpu_end - (cpu0 if cpu0 is not None else cpu_end)})


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between order statistics."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def proc_cpu_s(pid: int | None) -> float | None:
    """utime + stime of a process from /proc (None when unreadable)."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def drive(host: str, port: int, raw: bytes, clients: int, seconds: float, warm_s: float,
          expected: str | None, server_pid: int | None) -> dict:
    """``clients`` closed-loop client processes for warm_s + seconds; figures of the last ``seconds``."""
    ctx = mp.get_context("fork")  # the clients import nothing: a fork of this small parent is cheap
    results = ctx.Queue()
    start_at = time.monotonic() + 0.3 + 0.02 * clients
    stop_at = start_at + warm_s + seconds
    procs = [ctx.Process(target=_client_process, args=(host, port, raw, expected, start_at, warm_s, stop_at, results))
             for _ in range(clients)]
    for p in procs:
        p.start()
    time.sleep(max(0.0, start_at + warm_s - time.monotonic()))
    server0 = proc_cpu_s(server_pid)
    load0 = os.getloadavg()
    time.sleep(max(0.0, stop_at - time.monotonic()))
    server1 = proc_cpu_s(server_pid)
    got = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    rows = [r for g in got for r in g["rows"]]
    latencies = [r[0] * 1000 for r in rows]
    runs = [r[1] for r in rows if r[1] is not None]
    statuses: dict[str, int] = {}
    for g in got:
        for k, v in g["statuses"].items():
            statuses[k] = statuses.get(k, 0) + v
    tasks = len(rows)
    client_cpu = sum(g["cpu_s"] for g in got)
    return {
        "clients": clients,
        "seconds": seconds,
        "tasks": tasks,
        "tasks_per_s": tasks / seconds,
        "p50_ms": percentile(latencies, 50),
        "p99_ms": percentile(latencies, 99),
        "mean_ms": statistics.fmean(latencies) if latencies else None,
        "run_ms_median": statistics.median(runs) if runs else None,
        "overhead_ms_median": statistics.median(r[0] * 1000 - r[1] for r in rows if r[1] is not None) if runs else None,
        "statuses": statuses,
        "errors": sorted({e for g in got for e in g["errors"]})[:10],
        "client_cpu_ms_per_task": 1000 * client_cpu / tasks if tasks else None,
        "client_cpu_cores": client_cpu / seconds,
        "server_cpu_ms_per_task": (1000 * (server1 - server0) / tasks) if tasks and server0 is not None else None,
        "server_cpu_cores": ((server1 - server0) / seconds) if server0 is not None else None,
        "loadavg_1m_during": load0[0],
    }


def client_floor(host: str, port: int, seconds: float = 2.0) -> dict:
    """One lean client against GET /v2/health/live: latency and client CPU per request."""
    conn = Connection(host, port)
    raw = build_request(host, port, "GET", "/v2/health/live")
    conn.request(raw)
    lat, cpu0, t_end = [], time.process_time(), time.monotonic() + seconds
    while time.monotonic() < t_end:
        t0 = time.monotonic()
        status, _, _ = conn.request(raw)
        lat.append((time.monotonic() - t0) * 1000)
        if status != 200:
            raise SystemExit(f"/v2/health/live answered {status}")
    cpu = time.process_time() - cpu0
    conn.close()
    return {"requests": len(lat), "p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99),
            "client_cpu_ms_per_request": 1000 * cpu / len(lat)}


# --------------------------------------------------------------------------- the server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(backend: str, log_path: Path, data_dir: Path, root: Path = ROOT, *, env: dict[str, str] | None = None,
                 args: list[str] | None = None, launcher: list[str] | None = None) -> tuple[subprocess.Popen, int]:
    """``rev88 serve`` with its defaults (workers, queue, log level) but a fresh ledger in
    ``data_dir``, so that every run starts from an empty one; ``root``: the source tree; ``env``,
    ``args``: more environment variables and ``rev88 serve`` flags (the other benchmarks');
    ``launcher``: what runs the ``rev88`` command line instead of ``-m rev88`` (a script that
    wraps it, bench/batching_stand_in.py)."""
    port = free_port()
    env = {**os.environ, "REV88_DATA_DIR": str(data_dir), **(env or {})}
    if root != ROOT:
        env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [sys.executable, *(launcher or ["-m", "rev88"]), "serve", "--host", "127.0.0.1", "--port", str(port),
           "--backend", backend, *(args or [])]
    with open(log_path, "wb") as fh:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=fh, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    raw = build_request("127.0.0.1", port, "GET", "/v2/health/ready")
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"rev88 serve exited with {proc.returncode}:\n{log_path.read_text()}")
        try:
            conn = Connection("127.0.0.1", port)
            status, _, _ = conn.request(raw)
            conn.close()
            if status == 200:
                return proc, port
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"rev88 serve not ready after 300 s:\n{log_path.read_text()}")
        time.sleep(0.2)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def server_settings(host: str, port: int) -> dict:
    """What the server says about its workers and queue (GET /health)."""
    conn = Connection(host, port)
    status, _, body = conn.request(build_request(host, port, "GET", "/health"))
    conn.close()
    health = json.loads(body)
    queue = health.get("queue", {})
    return {"health_status": status, "backend": health.get("learner", {}).get("backend"),
            "workers": [w.get("device") for w in queue.get("workers", [])], "queue_capacity": queue.get("capacity"),
            "batch_max": queue.get("batch_max")}


def check_answer(host: str, port: int, raw: bytes, meta: dict) -> dict:
    """One whole answer: its hashes and metadata against run_task's, key by key."""
    conn = Connection(host, port)
    status, _, body = conn.request(raw)
    conn.close()
    if status != 200:
        raise SystemExit(f"the first task was answered {status}: {body[:300]!r}")
    answer = json.loads(body)
    differ = [k for k in meta if answer["metadata"].get(k) != meta[k]]
    if answer["predictions_sha256"] != meta["predictions_sha256"]:
        differ.append("predictions_sha256 (top level)")
    return {"keys_compared": list(meta), "differ": differ, "identical": not differ}


# --------------------------------------------------------------------------- output


def machine() -> dict:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": model, "cores": len(os.sched_getaffinity(0)), "python": platform.python_version(),
            "platform": platform.platform()}


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return " ".join(f"{x:.2f}" for x in os.getloadavg())


def table(doc: dict) -> str:
    procs = doc["alone"][0]["processes"]
    lines = [
        "| clients | tasks/s | ÷ load_task + run_task | ÷ run_task | p50 ms | p99 ms | e2e − run_ms (median) "
        "| server CPU ms/task | client CPU ms/task | statuses |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---|",
        f"| learner alone, load_task + run_task ({procs} proc.) | {doc['alone_tasks_per_s']:.1f} | 1.00 | | "
        f"{doc['hashes_run_task_median_ms']:.1f} | | | {doc['alone'][0]['cpu_ms_per_task']:.1f} | | |",
        f"| learner alone, run_task ({procs} proc.) | {doc['alone_run_task_tasks_per_s']:.1f} | | 1.00 | "
        f"{doc['run_task_median_ms']:.1f} | | | {doc['alone_run_task'][0]['cpu_ms_per_task']:.1f} | | |",
    ]
    for lv in doc["levels"]:
        def f(v, spec=".1f"):
            return "" if v is None else format(v, spec)
        st = ", ".join(f"{k}: {v}" for k, v in sorted(lv["statuses"].items()))
        lines.append(
            f"| {lv['clients']} | {lv['tasks_per_s']:.1f} | {lv['ratio']:.2f} | {lv['ratio_run_task']:.2f} "
            f"| {f(lv['p50_ms'])} | {f(lv['p99_ms'])} "
            f"| {f(lv['overhead_ms_median'])} | {f(lv['server_cpu_ms_per_task'])} | {f(lv['client_cpu_ms_per_task'], '.2f')} "
            f"| {st} |"
        )
    return "\n".join(lines)


def svg(doc: dict) -> str:
    """Two panels: tasks/s (service, learner alone) and p50/p99 latency, against clients."""
    levels = doc["levels"]
    xs = [lv["clients"] for lv in levels]
    w, h, pad_l, pad_r, pad_t, pad_b, gap = 820, 380, 60, 20, 60, 50, 70
    panel_w = (w - pad_l - pad_r - gap) / 2
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
           'font-family="sans-serif" font-size="12">', f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{pad_l}" y="22" font-size="15" font-weight="bold">rev88 service under load: '
           f'{doc["task"]}, backend {doc["backend"]}, {doc["machine"]["cores"]} cores</text>',
           f'<text x="{pad_l}" y="40" fill="#555">load average before {doc["loadavg_before"][0]:.2f}, after '
           f'{doc["loadavg_after"][0]:.2f}; clients on the same machine ({doc["seconds"]:g} s per level)</text>']

    def panel(x0: float, title: str, series: list[tuple[str, str, list[float | None], str]], hlines, ylabel: str):
        top, bottom = pad_t + 10, h - pad_b
        vals = [v for _, _, ys, _ in series for v in ys if v is not None] + [v for _, v, _ in hlines]
        hi = max(vals) * 1.15 if vals else 1.0
        step = _nice_step(hi)

        def y(v):
            return bottom - v / hi * (bottom - top)

        def x(i):
            return x0 + (i + 0.5) * panel_w / len(xs)

        out.append(f'<text x="{x0}" y="{top - 8}" font-weight="bold">{title}</text>')
        t = 0.0
        while t <= hi:
            out.append(f'<line x1="{x0:.1f}" y1="{y(t):.1f}" x2="{x0 + panel_w:.1f}" y2="{y(t):.1f}" stroke="#e5e5e5"/>')
            out.append(f'<text x="{x0 - 6:.1f}" y="{y(t) + 4:.1f}" text-anchor="end">{t:g}</text>')
            t += step
        for label, value, colour in hlines:
            out.append(f'<line x1="{x0:.1f}" y1="{y(value):.1f}" x2="{x0 + panel_w:.1f}" y2="{y(value):.1f}" '
                       f'stroke="{colour}" stroke-dasharray="6 4" stroke-width="1.5"/>')
            out.append(f'<text x="{x0 + panel_w - 4:.1f}" y="{y(value) - 5:.1f}" text-anchor="end" '
                       f'fill="{colour}">{label}</text>')
        for _label, colour, ys, dash in series:
            pts = [(x(i), y(v)) for i, v in enumerate(ys) if v is not None]
            out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" {dash} points="'
                       + " ".join(f"{px:.1f},{py:.1f}" for px, py in pts) + '"/>')
            for (px, py), v in zip(pts, [v for v in ys if v is not None]):
                out.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3.5" fill="{colour}"><title>{v:.1f}</title></circle>')
        for i, c in enumerate(xs):
            out.append(f'<text x="{x(i):.1f}" y="{bottom + 16}" text-anchor="middle">{c}</text>')
        out.append(f'<rect x="{x0:.1f}" y="{top}" width="{panel_w:.1f}" height="{bottom - top}" fill="none" stroke="#444"/>')
        out.append(f'<text x="{x0 + panel_w / 2:.1f}" y="{h - 14}" text-anchor="middle">concurrent clients</text>')
        mid = (top + bottom) / 2
        out.append(f'<text x="{x0 - 42:.1f}" y="{mid:.1f}" text-anchor="middle" '
                   f'transform="rotate(-90 {x0 - 42:.1f} {mid:.1f})">{ylabel}</text>')
        ly = top + 16
        for label, colour, _, dash in series:
            out.append(f'<line x1="{x0 + 10:.1f}" y1="{ly - 4}" x2="{x0 + 34:.1f}" y2="{ly - 4}" stroke="{colour}" '
                       f'stroke-width="2" {dash}/>')
            out.append(f'<text x="{x0 + 40:.1f}" y="{ly}">{label}</text>')
            ly += 16

    alone, bare = doc["alone_tasks_per_s"], doc["alone_run_task_tasks_per_s"]
    panel(pad_l, "throughput", [("service", "#2166ac", [lv["tasks_per_s"] for lv in levels], "")],
          [(f"alone: load_task + run_task {alone:.1f}/s", alone, "#1b7837"),
           (f"alone: run_task {bare:.1f}/s", bare, "#5aae61"), ("0.75 x load_task + run_task", 0.75 * alone, "#999")],
          "tasks / s")
    panel(pad_l + panel_w + gap, "latency",
          [("p99", "#b2182b", [lv["p99_ms"] for lv in levels], ""),
           ("p50", "#d6604d", [lv["p50_ms"] for lv in levels], 'stroke-dasharray="4 3"')], [], "ms")
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _nice_step(hi: float) -> float:
    raw = hi / 6
    mag = 10 ** len(str(int(raw))) / 10 if raw >= 1 else 1.0
    for m in (1, 2, 2.5, 5, 10):
        if raw <= m * mag:
            return m * mag
    return 10 * mag


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cores = len(os.sched_getaffinity(0))
    parser.add_argument("--seconds", type=float, default=8.0, help="measured seconds per level (default 8)")
    parser.add_argument("--warmup-seconds", type=float, default=1.0, help="unmeasured seconds before each level")
    parser.add_argument("--levels", default=f"1,{cores},{2 * cores},{4 * cores}", help="client counts (default 1,C,2C,4C)")
    parser.add_argument("--overload-clients", type=int, default=8 * cores, help="clients of the overload check (0: skip)")
    parser.add_argument("--overload-seconds", type=float, default=4.0)
    parser.add_argument("--backend", default="cpu-fast", help="the server's and the learner's backend (default cpu-fast)")
    parser.add_argument("--url", help="drive this running server instead of starting one (its settings are its own)")
    parser.add_argument("--server-pid", type=int, help="with --url: the server's pid, for its CPU time")
    parser.add_argument("--server-root", help="serve from this source tree instead (to compare two versions)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"), help="folder for load.json and load.svg")
    args = parser.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",") if x.strip()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    body, what = task_bytes()
    doc: dict = {"task": what, "npz_bytes": len(body), "backend": args.backend, "seconds": args.seconds,
                 "warmup_seconds": args.warmup_seconds, "machine": machine(), "uptime_before": uptime(),
                 "loadavg_before": os.getloadavg(), "client": "one process per client, one keep-alive socket, "
                 "prebuilt HTTP/1.1 request (sendall), answer read by Content-Length; byte-level checks only"}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "task.npz"
        path.write_bytes(body)
        print(f"learner alone: (hashes +) run_task in {cores} process(es), {args.seconds:g} s each ...", file=sys.stderr)
        alone = {h: [learner_alone(str(path), args.backend, cores, args.seconds, h)] for h in (True, False)}
        one = {h: learner_alone(str(path), args.backend, 1, min(args.seconds, 4.0), h) for h in (True, False)}
        meta = alone[False][0]["meta"]
        proc = None
        if args.url:
            parts = urlsplit(args.url)
            host, port, pid = parts.hostname, parts.port or 80, args.server_pid
        else:
            proc, port = start_server(args.backend, Path(tmp) / "server.log", Path(tmp) / "data",
                                      Path(args.server_root).resolve() if args.server_root else ROOT)
            host, pid = "127.0.0.1", proc.pid
        try:
            raw = build_request(host, port, "POST", "/tasks", body)
            doc["server"] = server_settings(host, port)
            doc["answer_check"] = check_answer(host, port, raw, meta)
            doc["client_floor_health_live"] = client_floor(host, port)
            doc["levels"] = []
            for clients in levels:
                print(f"service: {clients} client(s), {args.seconds:g} s ...", file=sys.stderr)
                doc["levels"].append(drive(host, port, raw, clients, args.seconds, args.warmup_seconds,
                                           meta["predictions_sha256"], pid))
            if args.overload_clients:
                print(f"overload: {args.overload_clients} clients, {args.overload_seconds:g} s ...", file=sys.stderr)
                doc["overload"] = drive(host, port, raw, args.overload_clients, args.overload_seconds, 0.5,
                                        meta["predictions_sha256"], pid)
        finally:
            if proc is not None:
                stop_server(proc)
                if proc.returncode != 0:  # its log says why
                    doc["server_log_tail"] = (Path(tmp) / "server.log").read_text()[-2000:]
        print("learner alone again ...", file=sys.stderr)
        for h in (True, False):
            alone[h].append(learner_alone(str(path), args.backend, cores, args.seconds, h))
    for a in alone[True] + alone[False]:
        a.pop("meta", None)
    # "alone": load_task + run_task, the baseline of "ratio"; "alone_run_task": run_task only ("ratio_run_task")
    doc["alone"], doc["alone_run_task"] = alone[True], alone[False]
    doc["alone_tasks_per_s"] = statistics.fmean(a["tasks_per_s"] for a in alone[True])
    doc["alone_run_task_tasks_per_s"] = statistics.fmean(a["tasks_per_s"] for a in alone[False])
    doc["hashes_run_task_median_ms"] = one[True]["run_task_median_ms"]
    doc["run_task_median_ms"] = one[False]["run_task_median_ms"]
    for lv in doc["levels"]:
        lv["ratio"] = lv["tasks_per_s"] / doc["alone_tasks_per_s"]
        lv["ratio_run_task"] = lv["tasks_per_s"] / doc["alone_run_task_tasks_per_s"]
        lv["overhead_vs_run_task_ms"] = None if lv["p50_ms"] is None else lv["p50_ms"] - doc["run_task_median_ms"]
        lv["overhead_vs_hashes_run_task_ms"] = (None if lv["p50_ms"] is None
                                               else lv["p50_ms"] - doc["hashes_run_task_median_ms"])
    doc["uptime_after"] = uptime()
    doc["loadavg_after"] = os.getloadavg()
    doc["table"] = table(doc)
    (out / "load.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "load.svg").write_text(svg(doc))
    print(f"{what}, backend {args.backend}, {cores} cores ({doc['machine']['cpu']}); "
          f"load average {doc['loadavg_before'][0]:.2f} before, {doc['loadavg_after'][0]:.2f} after")
    for label, runs, ms in (("load_task + run_task", alone[True], doc["hashes_run_task_median_ms"]),
                            ("run_task", alone[False], doc["run_task_median_ms"])):
        print(f"learner alone, {label}: {runs[0]['tasks_per_s']:.1f} and {runs[1]['tasks_per_s']:.1f} tasks/s "
              f"(before/after); one task {ms:.1f} ms median (1 process)")
    floor = doc["client_floor_health_live"]
    print(f"client floor (GET /v2/health/live): p50 {floor['p50_ms']:.2f} ms, client CPU "
          f"{floor['client_cpu_ms_per_request']:.3f} ms/request")
    print(f"answer check against run_task: {'identical' if doc['answer_check']['identical'] else doc['answer_check']['differ']}")
    print(doc["table"])
    if "overload" in doc:
        ov = doc["overload"]
        print(f"overload ({ov['clients']} clients): statuses {ov['statuses']}, errors {ov['errors'] or 'none'}")
    print(f"wrote {out / 'load.json'} and {out / 'load.svg'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
