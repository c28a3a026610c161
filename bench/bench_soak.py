"""Memory over a long run: N mixed tasks through one ``rev88 serve``, its RSS and data dir sampled.

A real ``rev88 serve`` (defaults but ``--backend``, cpu-fast by default, a fresh data dir and
``--retain-tasks``) is driven by ``--clients`` lean client processes (bench/bench_load.py's
keep-alive socket client, prebuilt requests) through ``--tasks`` tasks of this mix, in turn:

    sync_draw0       POST /tasks, the MNIST-medium draw 0 (10,000 / 10,000, ~6.6 MB)      -> 200
    sync_small       POST /tasks, 50 / 5 or 1,000 / 1,000 (synthetic), alternately         -> 200
    async_polled     POST /tasks, Prefer: respond-async, draw 0 -> 202; GET /tasks/{id} until succeeded
    refused          an npz carrying test_labels (-> 422), or a truncated one (-> 400), alternately
    async_cancelled  POST async draw 0 -> 202, POST /tasks/{id}/cancel at once (200, or 409 when it had
                     already finished), then GET /tasks/{id} until it is finished

(``MIX`` below: 10 tasks a turn, 3 sync draw 0, 4 small, 1 of each of the others.) Every
``--sample-every`` finished tasks the server's memory is read from /proc/PID/status (VmRSS,
RssAnon) and /proc/PID/smaps (the main heap, ``[heap]``; anonymous mappings: the thread arenas
and large mmapped blocks), with the data dir's size on disk and the server's CPU time
(/proc/PID/stat; per task over the interval). After the last task, one more sample once the
server has been idle for ``--idle-seconds``.

``--probe`` adds a small ``sitecustomize`` to the server (through PYTHONPATH; nothing in the
service changes) that writes, every second, glibc's ``mallinfo2()`` (bytes in use, bytes free
inside the heaps, bytes mmapped) and, when the server runs with ``PYTHONTRACEMALLOC=1``
(``--env PYTHONTRACEMALLOC=1``), the memory Python's objects hold: enough to tell a leak (in use
grows) from allocator retention (free grows). ``--env NAME=VALUE`` passes anything else, e.g.
``MALLOC_ARENA_MAX=2`` or ``MALLOC_MMAP_THRESHOLD_=1048576``, to compare allocator settings.

The goal it reports against (issue #21): over 20,000 mixed tasks, past the retention limit, RSS
after warm-up (the first ``--warmup`` tasks, 2,000) grows by at most 10 %: the largest RSS sampled
after warm-up against the RSS at the end of warm-up. Writes ``soak.json`` (every sample, the
settings, the machine) and ``soak.svg`` (RSS and data dir against tasks) to ``--out`` and prints a
markdown table. Not a test, and nothing here is a pass/fail exit code: run it by hand,

    python bench/bench_soak.py [--tasks 20000] [--retain-tasks 1000] [--sample-every 500] [--clients 3]
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

import bench_load  # noqa: E402
from bench_load import Connection, machine, stop_server, task_bytes, uptime  # noqa: E402

MIX = ("sync_draw0", "sync_small", "async_polled", "sync_small", "refused",
       "sync_draw0", "sync_small", "async_cancelled", "sync_draw0", "sync_small")
PAGE = os.sysconf("SC_PAGE_SIZE")
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")

# The probe: imported by the server at startup when it is on PYTHONPATH and REV88_SOAK_PROBE names a file.
PROBE = r'''
import os
if os.environ.get("REV88_SOAK_PROBE"):
    import ctypes, json, sys, threading, time, tracemalloc

    class _MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]

    def _probe(path=os.environ["REV88_SOAK_PROBE"]):
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        while True:
            m = libc.mallinfo2()
            row = {"t": time.time(), "heap_bytes": m.arena, "in_use_bytes": m.uordblks, "free_bytes": m.fordblks,
                   "mmapped_bytes": m.hblkhd, "mmapped_blocks": m.hblks, "free_chunks": m.ordblks,
                   "top_free_bytes": m.keepcost, "threads": threading.active_count()}
            if tracemalloc.is_tracing():
                row["traced_bytes"], row["traced_peak_bytes"] = tracemalloc.get_traced_memory()
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(row, f)
            os.replace(tmp, path)
            time.sleep(1.0)

    threading.Thread(target=_probe, name="soak-probe", daemon=True).start()
'''


# --------------------------------------------------------------------------- the requests


def bodies() -> dict[str, bytes]:
    import numpy as np

    from learner.taskio import task_to_npz_bytes, validate_task

    def synthetic(n: int, m: int) -> bytes:
        rng = np.random.Generator(np.random.PCG64(88 + n))
        task = validate_task(rng.random((n, 1, 9, 9), dtype=np.float32), (np.arange(n) % 10).astype(np.int64),
                             rng.random((m, 1, 9, 9), dtype=np.float32))
        return task_to_npz_bytes(task)

    draw0, what = task_bytes()
    small = synthetic(50, 5)
    rng = np.random.Generator(np.random.PCG64(7))
    buf = io.BytesIO()  # a valid task plus the queries' labels: refused (422), whatever its arrays
    np.savez(buf, train_images=rng.random((1000, 1, 9, 9), dtype=np.float32),
             train_labels=(np.arange(1000) % 10).astype(np.int64), test_images=rng.random((1000, 1, 9, 9), dtype=np.float32),
             test_labels=(np.arange(1000) % 10).astype(np.int64))
    return {"draw0": draw0, "draw0_what": what.encode(), "tiny": small, "1k": synthetic(1000, 1000),
            "labels": buf.getvalue(), "truncated": draw0[: len(draw0) // 3]}


def request(host: str, port: int, method: str, path: str, body: bytes = b"", headers: dict | None = None) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
    for k, v in (headers or {}).items():
        head += f"{k}: {v}\r\n"
    if body or method == "POST":
        head += f"Content-Type: application/octet-stream\r\nContent-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


class Soaker:
    """One client's requests, prebuilt; ``run(kind, n)`` does one task of the mix and says how it went."""

    def __init__(self, host: str, port: int, payloads: dict[str, bytes]) -> None:
        self.host, self.port = host, port
        self.conn = Connection(host, port)
        post = lambda body, **h: request(host, port, "POST", "/tasks", body, h)  # noqa: E731
        self.raw = {"draw0": post(payloads["draw0"]), "tiny": post(payloads["tiny"]), "1k": post(payloads["1k"]),
                    "labels": post(payloads["labels"]), "truncated": post(payloads["truncated"]),
                    "async": post(payloads["draw0"], Prefer="respond-async")}

    def _call(self, raw: bytes) -> tuple[int, dict, bytes]:
        for attempt in range(50):  # a 503 (queue full) is waited out, as rev88 submit does
            status, headers, body = self.conn.request(raw)
            if status != 503:
                return status, headers, body
            if "retry-after" not in headers:
                raise RuntimeError("503 without Retry-After")
            time.sleep(min(1.0, float(headers["retry-after"])) * (0.2 + 0.1 * attempt))
        return status, headers, body

    def _poll(self, task_id: str) -> str:
        raw = request(self.host, self.port, "GET", f"/tasks/{task_id}")
        delay = 0.01
        while True:
            status, _, body = self.conn.request(raw)
            if status != 200:
                raise RuntimeError(f"GET /tasks/{task_id}: {status} {body[:200]!r}")
            doc = json.loads(body)
            if doc["status"] in ("succeeded", "failed", "cancelled"):
                return doc["status"]
            time.sleep(delay)
            delay = min(0.2, delay * 1.5)

    def run(self, kind: str, n: int) -> str:
        if kind == "sync_draw0" or kind == "sync_small":
            raw = self.raw["draw0"] if kind == "sync_draw0" else self.raw["tiny" if n % 20 < 10 else "1k"]
            status, _, body = self._call(raw)
            return str(status)
        if kind == "refused":
            status, _, body = self._call(self.raw["labels" if n % 20 < 10 else "truncated"])
            return str(status)
        status, _, body = self._call(self.raw["async"])
        if status != 202:
            return f"async {status}"
        task_id = json.loads(body)["id"]
        if kind == "async_polled":
            return f"async {self._poll(task_id)}"
        status, _, _ = self.conn.request(request(self.host, self.port, "POST", f"/tasks/{task_id}/cancel"))
        return f"cancel {status}, {self._poll(task_id)}"


def _client(host, port, payloads, next_task, done, total, results) -> None:
    soaker = Soaker(host, port, payloads)
    outcomes: dict[str, int] = {}
    errors: list[str] = []
    while True:
        with next_task.get_lock():
            n = next_task.value
            next_task.value += 1
        if n >= total:
            break
        kind = MIX[n % len(MIX)]
        try:
            got = soaker.run(kind, n)
        except Exception as exc:  # noqa: BLE001 -- counted and reported; the soak goes on
            got = f"error {type(exc).__name__}"
            if len(errors) < 10:
                errors.append(f"{kind}: {exc!r}")
            soaker.conn.close()
            time.sleep(0.1)
        key = f"{kind}: {got}"
        outcomes[key] = outcomes.get(key, 0) + 1
        with done.get_lock():
            done.value += 1
    soaker.conn.close()
    results.put({"outcomes": outcomes, "errors": errors})


# --------------------------------------------------------------------------- the server and its memory


def start_server(backend: str, data_dir: Path, log_path: Path, retain_tasks: int | None, env_extra: dict[str, str],
                 probe_dir: Path | None) -> tuple[subprocess.Popen, int]:
    env = dict(env_extra)
    if retain_tasks is not None:
        env["REV88_RETAIN_TASKS"] = str(retain_tasks)
    if probe_dir is not None:
        (probe_dir / "sitecustomize.py").write_text(PROBE)
        env["PYTHONPATH"] = os.pathsep.join([str(probe_dir), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env["REV88_SOAK_PROBE"] = str(probe_dir / "probe.json")
    return bench_load.start_server(backend, log_path, data_dir, env=env)


def dir_bytes(path: Path) -> int:
    """Bytes on disk under ``path`` (allocated blocks, as du counts them)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:  # deleted meanwhile
                pass
    return total


def memory(pid: int) -> dict:
    """VmRSS, VmHWM, RssAnon (status) and the Rss of [heap] and of anonymous mappings (smaps), in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "Threads"):
            parts = value.split()
            out[key] = int(parts[0]) * (1024 if len(parts) > 1 else 1)
    heap = anon = 0
    kind = None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        first = line.split(None, 1)[0]
        if "-" in first and not first.endswith(":"):  # a mapping's header: address perms offset dev inode [path]
            parts = line.split()
            kind = "heap" if parts[-1] == "[heap]" else ("anon" if len(parts) == 5 else None)
        elif first == "Rss:" and kind is not None:
            kb = int(line.split()[1]) * 1024
            if kind == "heap":
                heap += kb
            else:
                anon += kb
    out["heap"], out["anon_mappings"] = heap, anon
    return out


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S


def sample(pid: int, tasks: int, t0: float, data_dir: Path, probe: Path | None) -> dict:
    row = {"tasks": tasks, "elapsed_s": round(time.monotonic() - t0, 1), "server_cpu_s": cpu_s(pid),
           **memory(pid), "data_dir_bytes": dir_bytes(data_dir)}
    if probe is not None:
        try:
            row["malloc"] = json.loads(probe.read_text())
        except (OSError, ValueError):
            pass
    return row


# --------------------------------------------------------------------------- output


def mb(v: float | None) -> str:
    return "" if v is None else f"{v / 2**20:.0f}"


def summarise(doc: dict) -> dict:
    rows = [r for r in doc["samples"] if not r.get("idle")]
    warm = next((r for r in rows if r["tasks"] >= doc["warmup"]), None)
    after = [r for r in rows if warm is not None and r["tasks"] > warm["tasks"]]
    out = {"warmup_tasks": warm["tasks"] if warm else None, "rss_at_warmup": warm["VmRSS"] if warm else None}
    if warm and after:
        peak = max(after, key=lambda r: r["VmRSS"])
        out.update(rss_final=after[-1]["VmRSS"], rss_max_after_warmup=peak["VmRSS"], at_task=peak["tasks"],
                   growth_final=after[-1]["VmRSS"] / warm["VmRSS"] - 1, growth_max=peak["VmRSS"] / warm["VmRSS"] - 1)
        out["goal_met"] = out["growth_max"] <= 0.10
        span = after[-1]["tasks"] - warm["tasks"]
        out["rss_mb_per_1000_tasks"] = (after[-1]["VmRSS"] - warm["VmRSS"]) / 2**20 / span * 1000
        out["server_cpu_ms_per_task_after_warmup"] = 1000 * (after[-1]["server_cpu_s"] - warm["server_cpu_s"]) / span
    return out


def table(doc: dict) -> str:
    probe = any("malloc" in r for r in doc["samples"])
    head = "| tasks | elapsed s | RSS MB | of it [heap] | anon maps | data dir MB | server CPU ms/task |"
    rule = "|---:|---:|---:|---:|---:|---:|---:|"
    if probe:
        head += " malloc in use MB | free in heaps MB | mmapped MB | traced MB |"
        rule += "---:|---:|---:|---:|"
    lines = [head, rule]
    prev = None
    for r in doc["samples"]:
        cpu = ""
        if prev is not None and r["tasks"] > prev["tasks"]:
            cpu = f"{1000 * (r['server_cpu_s'] - prev['server_cpu_s']) / (r['tasks'] - prev['tasks']):.1f}"
        label = f"{r['tasks']} (idle)" if r.get("idle") else str(r["tasks"])
        line = (f"| {label} | {r['elapsed_s']:.0f} | {mb(r['VmRSS'])} | {mb(r['heap'])} | {mb(r['anon_mappings'])} "
                f"| {r['data_dir_bytes'] / 2**20:.1f} | {cpu} |")
        if probe:
            m = r.get("malloc", {})
            line += (f" {mb(m.get('in_use_bytes'))} | {mb(m.get('free_bytes'))} | {mb(m.get('mmapped_bytes'))} "
                     f"| {mb(m.get('traced_bytes'))} |")
        lines.append(line)
        if not r.get("idle"):
            prev = r
    s = doc["summary"]
    if s.get("rss_final") is not None:
        lines += ["", f"RSS at warm-up ({s['warmup_tasks']} tasks) {mb(s['rss_at_warmup'])} MB; largest after it "
                  f"{mb(s['rss_max_after_warmup'])} MB (task {s['at_task']}, {100 * s['growth_max']:+.1f} %); at the end "
                  f"{mb(s['rss_final'])} MB ({100 * s['growth_final']:+.1f} %, {s['rss_mb_per_1000_tasks']:+.1f} MB per "
                  f"1,000 tasks); goal ≤ +10 %: {'met' if s['goal_met'] else 'NOT met'}; server CPU "
                  f"{s['server_cpu_ms_per_task_after_warmup']:.1f} ms per task after warm-up"]
    return "\n".join(lines)


def svg(doc: dict, compare: dict | None = None) -> str:
    """RSS (and its [heap] / anonymous parts) and the data dir's size against tasks, one panel each;
    ``compare``: another run's doc, its RSS and data dir drawn dashed beside this run's."""
    rows = [r for r in doc["samples"] if not r.get("idle")]
    other = [r for r in compare["samples"] if not r.get("idle")] if compare else []
    w, h, pad_l, pad_r, pad_t, pad_b, gap = 860, 400, 64, 20, 64, 50, 76
    panel_w = (w - pad_l - pad_r - gap) / 2
    xmax = max(r["tasks"] for r in rows + other) or 1

    def env_words(d: dict) -> str:
        return "env " + " ".join(f"{k}={v}" for k, v in d["env"].items()) if d["env"] else "no extra env"

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
           'font-family="sans-serif" font-size="12">', f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{pad_l}" y="22" font-size="15" font-weight="bold">rev88 serve over {doc["tasks"]:,} mixed tasks '
           f'({doc["clients"]} clients, retention {doc["retain_tasks"] or "default"}, backend {doc["backend"]})</text>',
           f'<text x="{pad_l}" y="40" fill="#555">{doc.get("label") or doc["malloc_line"] + "; " + env_words(doc)}'
           + (f' — dashed: {compare.get("label") or env_words(compare)}' if compare else "") + '</text>']

    def points(src: list[dict], key: str) -> list[tuple[float, float]]:
        return [(r["tasks"], r[key] / 2**20) for r in src]

    def panel(x0, title, series, ylabel, vline=None, hline=None):
        top, bottom = pad_t + 10, h - pad_b
        vals = [v for _, _, pts, _ in series for _, v in pts] + ([hline[1]] if hline else [])
        hi = max(vals) * 1.12 if vals and max(vals) > 0 else 1.0
        step = _nice_step(hi)

        def x(v):
            return x0 + v / xmax * panel_w

        def y(v):
            return bottom - v / hi * (bottom - top)

        out.append(f'<text x="{x0}" y="{top - 8}" font-weight="bold">{title}</text>')
        t = 0.0
        while t <= hi:
            out.append(f'<line x1="{x0:.1f}" y1="{y(t):.1f}" x2="{x0 + panel_w:.1f}" y2="{y(t):.1f}" stroke="#e5e5e5"/>')
            out.append(f'<text x="{x0 - 6:.1f}" y="{y(t) + 4:.1f}" text-anchor="end">{t:g}</text>')
            t += step
        xs = _nice_step(xmax * 1.2)
        t = 0.0
        while t <= xmax:
            out.append(f'<text x="{x(t):.1f}" y="{bottom + 16}" text-anchor="middle">{t:,.0f}</text>')
            t += xs
        if vline is not None:
            out.append(f'<line x1="{x(vline[1]):.1f}" y1="{top}" x2="{x(vline[1]):.1f}" y2="{bottom}" stroke="#999" '
                       f'stroke-dasharray="4 4"/><text x="{x(vline[1]) + 4:.1f}" y="{top + 12}" fill="#777">{vline[0]}</text>')
        if hline is not None:
            out.append(f'<line x1="{x0:.1f}" y1="{y(hline[1]):.1f}" x2="{x0 + panel_w:.1f}" y2="{y(hline[1]):.1f}" '
                       f'stroke="#b2182b" stroke-dasharray="6 4"/><text x="{x0 + panel_w - 4:.1f}" '
                       f'y="{y(hline[1]) - 5:.1f}" text-anchor="end" fill="#b2182b">{hline[0]}</text>')
        for _, colour, pts, dash in series:
            out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" {dash} points="'
                       + " ".join(f"{x(px):.1f},{y(py):.1f}" for px, py in pts) + '"/>')
        out.append(f'<rect x="{x0:.1f}" y="{top}" width="{panel_w:.1f}" height="{bottom - top}" fill="none" stroke="#444"/>')
        out.append(f'<text x="{x0 + panel_w / 2:.1f}" y="{h - 14}" text-anchor="middle">tasks finished</text>')
        mid = (top + bottom) / 2
        out.append(f'<text x="{x0 - 46:.1f}" y="{mid:.1f}" text-anchor="middle" '
                   f'transform="rotate(-90 {x0 - 46:.1f} {mid:.1f})">{ylabel}</text>')
        ly = top + 30  # the legend, top left (under the vertical line's label)
        for label, colour, _, dash in series:
            out.append(f'<line x1="{x0 + 10:.1f}" y1="{ly - 4}" x2="{x0 + 34:.1f}" y2="{ly - 4}" stroke="{colour}" '
                       f'stroke-width="2" {dash}/>')
            out.append(f'<text x="{x0 + 40:.1f}" y="{ly}">{label}</text>')
            ly += 16

    dashed = 'stroke-dasharray="6 3"'
    s = doc["summary"]
    goal = ("+10 % of RSS at warm-up", 1.1 * s["rss_at_warmup"] / 2**20) if s.get("rss_at_warmup") else None
    warm = (f"warm-up ({doc['warmup']:,})", doc["warmup"]) if doc["warmup"] <= xmax else None
    memory_series = [("RSS", "#2166ac", points(rows, "VmRSS"), ""),
                     ("[heap] (main arena)", "#d6604d", points(rows, "heap"), ""),
                     ("anonymous maps (thread arenas, mmaps)", "#5aae61", points(rows, "anon_mappings"), "")]
    disk_series = [("data dir", "#762a83", points(rows, "data_dir_bytes"), "")]
    if compare:
        memory_series.insert(1, ("RSS, compared run", "#888", points(other, "VmRSS"), dashed))
        disk_series.append(("data dir, compared run", "#888", points(other, "data_dir_bytes"), dashed))
    panel(pad_l, "server memory", memory_series, "MB", warm, goal)
    retain = doc["retain_tasks"]
    panel(pad_l + panel_w + gap, "data dir on disk", disk_series,
          "MB", (f"retention ({retain:,})", retain) if retain and retain <= xmax else None)
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
    parser.add_argument("--tasks", type=int, default=20_000, help="tasks in all (default 20,000)")
    parser.add_argument("--retain-tasks", type=int, default=1000,
                        help="the server's REV88_RETAIN_TASKS (default 1,000; 0: the server's own default)")
    parser.add_argument("--sample-every", type=int, default=500, help="sample memory every this many tasks")
    parser.add_argument("--warmup", type=int, default=2000, help="tasks before the RSS the goal is measured from")
    parser.add_argument("--clients", type=int, default=3, help="client processes (default 3)")
    parser.add_argument("--backend", default="cpu-fast")
    parser.add_argument("--idle-seconds", type=float, default=3.0, help="wait before the last (idle) sample")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="for the server (repeatable)")
    parser.add_argument("--probe", action="store_true", help="record mallinfo2 (and tracemalloc) in the server")
    parser.add_argument("--data-dir", help="keep the ledger here (default: a temporary folder, removed)")
    parser.add_argument("--out", default=str(HERE / "results"), help="folder for soak.json and soak.svg")
    parser.add_argument("--name", default="soak", help="file name stem of the outputs (default soak)")
    parser.add_argument("--label", help="this run's words in the plot (default: its malloc setting and env)")
    parser.add_argument("--compare", help="another run's soak.json: its RSS and data dir drawn dashed in the plot")
    parser.add_argument("--replot", metavar="SOAK_JSON", help="run nothing: the table and the plot of this soak.json "
                        "again (with --compare, --label; written to --out as --name)")
    args = parser.parse_args(argv)
    compare = json.loads(Path(args.compare).read_text()) if args.compare else None
    if args.replot:
        doc = json.loads(Path(args.replot).read_text())
        if args.label:
            doc["label"] = args.label
        return write(doc, Path(args.out), args.name, compare)
    env_extra = dict(item.split("=", 1) for item in args.env)
    out = Path(args.out)

    payloads = bodies()
    what = payloads.pop("draw0_what").decode()
    doc: dict = {"tasks": args.tasks, "clients": args.clients, "retain_tasks": args.retain_tasks or None,
                 "sample_every": args.sample_every, "warmup": args.warmup, "backend": args.backend, "env": env_extra,
                 "mix": list(MIX), "draw0": what, "machine": machine(), "uptime_before": uptime(), "samples": []}
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(args.data_dir) if args.data_dir else Path(tmp) / "data"
        log = Path(tmp) / "server.log"
        probe_dir = Path(tmp) / "probe" if args.probe else None
        if probe_dir:
            probe_dir.mkdir()
        proc, port = start_server(args.backend, data_dir, log, args.retain_tasks or None, env_extra, probe_dir)
        doc["startup_line"] = log.read_text().partition("\n")[0]
        doc["malloc_line"] = next((part for part in doc["startup_line"].rpartition("); API docs")[0].split("; ")
                                   if part.startswith("malloc")), "malloc: not reported")
        probe = probe_dir / "probe.json" if probe_dir else None
        try:
            t0 = time.monotonic()
            doc["samples"].append(sample(proc.pid, 0, t0, data_dir, probe))
            ctx = mp.get_context("fork")
            next_task, done, results = ctx.Value("q", 0), ctx.Value("q", 0), ctx.Queue()
            procs = [ctx.Process(target=_client, args=("127.0.0.1", port, payloads, next_task, done, args.tasks, results))
                     for _ in range(args.clients)]
            for p in procs:
                p.start()
            target = args.sample_every
            while True:
                n = done.value
                if n >= target or n >= args.tasks:
                    row = sample(proc.pid, n, t0, data_dir, probe)
                    doc["samples"].append(row)
                    print(f"{n} tasks, {row['elapsed_s']:.0f} s: RSS {mb(row['VmRSS'])} MB, data dir "
                          f"{row['data_dir_bytes'] / 2**20:.1f} MB", file=sys.stderr, flush=True)
                    if n >= args.tasks:
                        break
                    target = (n // args.sample_every + 1) * args.sample_every
                if proc.poll() is not None:
                    raise SystemExit(f"rev88 serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
                time.sleep(0.05)
            got = [results.get(timeout=600) for _ in procs]
            for p in procs:
                p.join()
            time.sleep(args.idle_seconds)
            doc["samples"].append({**sample(proc.pid, args.tasks, t0, data_dir, probe), "idle": True})
        finally:
            stop_server(proc)
            doc["server_log_tail"] = log.read_text()[-2000:]
    outcomes: dict[str, int] = {}
    for g in got:
        for k, v in g["outcomes"].items():
            outcomes[k] = outcomes.get(k, 0) + v
    doc["outcomes"] = dict(sorted(outcomes.items()))
    doc["errors"] = sorted({e for g in got for e in g["errors"]})[:20]
    doc["uptime_after"] = uptime()
    if args.label:
        doc["label"] = args.label
    return write(doc, out, args.name, compare)


def write(doc: dict, out: Path, name: str, compare: dict | None = None) -> int:
    """The summary and table into the doc; NAME.json and NAME.svg into ``out``; the table printed."""
    out.mkdir(parents=True, exist_ok=True)
    doc["summary"] = summarise(doc)
    doc["table"] = table(doc)
    (out / f"{name}.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / f"{name}.svg").write_text(svg(doc, compare))
    print(f"{doc['tasks']:,} tasks, {doc['clients']} clients, retention {doc['retain_tasks'] or 'default'}, backend "
          f"{doc['backend']}, {doc['machine']['cores']} cores; {doc['malloc_line']}; env {doc['env'] or 'none'}")
    print(doc["table"])
    print("outcomes: " + ", ".join(f"{k} x{v}" for k, v in doc["outcomes"].items()))
    if doc["errors"]:
        print("errors: " + "; ".join(doc["errors"]))
    print(f"wrote {out / (name + '.json')} and {out / (name + '.svg')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
