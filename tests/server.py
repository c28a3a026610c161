"""A real uvicorn server on a free loopback port, in a child process, for tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, proc: subprocess.Popen, url: str, log: Path):
        self.proc, self.url, self.log = proc, url, log

    def logs(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 120), **kw)


@contextlib.contextmanager
def running_server(tmp_path: Path, env: dict[str, str] | None = None, ready: bool = True, timeout: float = 120):
    """Start ``rev88 serve``'s app under uvicorn; wait for live (and ready); stop it after."""
    port = free_port()
    log = tmp_path / f"server-{port}.log"
    child_env = {**os.environ, "REV88_HOST": "127.0.0.1", "REV88_PORT": str(port), **(env or {})}
    cmd = [sys.executable, "-m", "uvicorn", "--factory", "app.main:create_app",
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env, stdout=fh, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    server = Server(proc, url, log)
    try:
        deadline = time.monotonic() + timeout
        path = "/v2/health/ready" if ready else "/v2/health/live"
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{server.logs()}")
            try:
                if httpx.get(url + path, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not {'ready' if ready else 'live'} after {timeout}s:\n{server.logs()}")
            time.sleep(0.1)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
