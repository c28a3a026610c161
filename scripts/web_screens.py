"""Screenshots of the web pages, at a phone's size (390x844) and a desktop's (1280x900).

    python scripts/web_screens.py --out docs/screens/issue-56 --prefix after [--checkout DIR]

Starts a real ``rev88 serve`` (cpu-fast, no API key, a fresh ledger in a temporary folder) from
``--checkout`` (default: this one), fills it the way a new user would (one draw-0 task; a stored
dataset with its labels and a sweep of 2 learning rates x 2 batch sizes x 2 seeds on it; two
graded evaluations of the eleven draws, default and one epoch, and one of draws 0-1 whose group
has a single point), then saves full-page PNGs of ``/``, a task, the sweep, an evaluation report,
the leaderboard, an unknown sweep, an unknown task and an unknown route. With ``pngquant`` on
PATH (Debian's package) the PNGs are reduced to 256 colours (a few hundred KB each at most).

Needs Debian's chromium and the playwright package (the test extra). Serves on loopback only.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZES = {"phone": {"width": 390, "height": 844}, "desktop": {"width": 1280, "height": 900}}
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--no-first-run"]
DRAW0_SEED = 2026091400


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.2)


def start_server(checkout: Path, data: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    path = os.pathsep.join([str(checkout), *filter(None, [os.environ.get("PYTHONPATH")])])  # (the parent's kept)
    env = {**os.environ, "PYTHONPATH": path, "REV88_API_KEY": "", "REV88_BACKEND": "cpu-fast",
           "REV88_WORKERS": "2", "REV88_DATA_DIR": str(data)}
    log = open(data.parent / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "rev88", "serve", "--host", "127.0.0.1", "--port", str(port),
                             "--log-level", "warning"], cwd=checkout, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def ready():
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}): see {log.name}")
        try:
            return httpx.get(url + "/v2/health/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(ready, 180, "the server")
    return proc, url


def fill(url: str) -> dict[str, str]:
    """The server's content; returns the ids the pages show."""
    from learner.data import DATA_DIR
    from learner.taskio import make_task, task_to_npz_bytes

    task, labels = make_task(DATA_DIR / "mnist", DRAW0_SEED)
    body = task_to_npz_bytes(task)
    npz = {"Content-Type": "application/octet-stream"}
    with httpx.Client(base_url=url, timeout=600) as c:
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        c.put(f"/datasets/{digest}", content=body, headers=npz).raise_for_status()
        saved = io.BytesIO()
        np.save(saved, labels)
        c.put(f"/datasets/{digest}/labels", content=saved.getvalue(), headers=npz).raise_for_status()
        sweep = c.post("/sweeps", json={"dataset": digest, "name": "lr by batch", "config": {"epochs": 3},
                                        "grid": {"learning_rate": [0.05, 0.2], "batch_size": [32, 64]},
                                        "seeds": [0, 1]})
        sweep.raise_for_status()
        evaluations = []
        for name, draws, config in (("default", "0-10", {}), ("one epoch", "0-10", {"epochs": 1}),
                                    ("two draws", "0-1", {"epochs": 3})):
            made = c.post("/evaluations", json={"draws": draws, "config": config, "name": name})
            made.raise_for_status()
            evaluations.append(made.json()["id"])
        for ev in evaluations:
            wait_until(lambda ev=ev: c.get(f"/evaluations/{ev}").json()["status"] == "completed", 900, "an evaluation")
        wait_until(lambda: c.get(f"/sweeps/{sweep.json()['id']}").json()["status"] == "completed", 600, "the sweep")
        answer = c.post("/tasks", content=body, headers=npz)
        answer.raise_for_status()
    return {"task": answer.json()["id"], "sweep": sweep.json()["id"], "evaluation": evaluations[0]}


def pages(ids: dict[str, str]) -> list[tuple[str, str, str | None]]:
    """(name, path, a selector that is there once the page has loaded)."""
    return [
        ("index", "/", "#tasks-body tr"),
        ("task", f"/ui/tasks/{ids['task']}", "#task-status.status-succeeded"),
        ("sweep", f"/ui/sweeps/{ids['sweep']}", "#sweep-status.status-completed"),
        ("evaluation", f"/ui/evaluations/{ids['evaluation']}", "#accuracy-chart:not([hidden])"),
        ("leaderboard", "/ui/evaluations", ".board-group svg"),
        ("missing-sweep", "/ui/sweeps/sw-no-such-sweep", "body"),
        ("missing-task", "/ui/tasks/no-such-task", "body"),
        ("missing-route", "/no-such-page", "body"),
    ]


def shoot(url: str, ids: dict[str, str], out: Path, prefix: str) -> list[Path]:
    from playwright.sync_api import sync_playwright

    executable = os.environ.get("REV88_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    saved = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS, headless=True)
        try:
            for size, viewport in SIZES.items():
                context = browser.new_context(viewport=viewport, color_scheme="light")
                page = context.new_page()
                for name, path, ready in pages(ids):
                    page.goto(url + path)
                    page.wait_for_selector(ready, state="attached", timeout=60_000)
                    page.wait_for_load_state("networkidle")
                    page.wait_for_timeout(600)  # (the pages' charts drawn, their polls settled)
                    target = out / f"{prefix}-{name}-{size}.png"
                    page.screenshot(path=str(target), full_page=True)
                    saved.append(target)
                context.close()
        finally:
            browser.close()
    return saved


def shrink(paths: list[Path]) -> None:
    """Each PNG in 256 colours (pngquant, where installed: Debian's package of that name)."""
    pngquant = shutil.which("pngquant")
    if not pngquant:
        print("pngquant is not installed: the PNGs keep their full colours", file=sys.stderr)
        return
    for path in paths:
        subprocess.run([pngquant, "--force", "--skip-if-larger", "--strip", "--output", str(path), "256", str(path)],
                       check=False)  # (99: the result would not be smaller; the original stays)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the folder the PNGs go to")
    parser.add_argument("--prefix", required=True, help="each file's name starts with it (before, after)")
    parser.add_argument("--checkout", type=Path, default=ROOT, help="the checkout whose server is shown")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rev88-screens-") as tmp:
        proc, url = start_server(args.checkout.resolve(), Path(tmp) / "data")
        try:
            ids = fill(url)
            paths = shoot(url, ids, args.out, args.prefix)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    shrink(paths)
    for path in paths:
        print(f"{path}  {path.stat().st_size // 1024} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
