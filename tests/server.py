"""A real uvicorn server on a free loopback port, in a child process, for tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from app.http.protocol import protocol_class

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


# the body protocol rev88 serve runs uvicorn with (app/http/protocol.py), so every server test uses it
PROTOCOL = "app.http.protocol:BufferedHttpToolsProtocol" if protocol_class() is not None else "auto"


@contextlib.contextmanager
def running_server(tmp_path: Path, env: dict[str, str] | None = None, ready: bool = True, timeout: float = 120,
                   gate: Path | None = None):
    """Start ``rev88 serve``'s app under uvicorn; wait for live (and ready); stop it after.

    With ``gate`` (a file path), every backend run waits while that file exists
    (``tests.gates.FileGate``; the server is ``tests.gates:create_app``)."""
    port = free_port()
    log = tmp_path / f"server-{port}.log"
    child_env = {**os.environ, "REV88_HOST": "127.0.0.1", "REV88_PORT": str(port),
                 "REV88_DATA_DIR": str(tmp_path / f"data-{port}"), **(env or {})}
    factory = "app.main:create_app"
    if gate is not None:
        child_env["REV88_TEST_GATE_FILE"] = str(gate)
        factory = "tests.gates:create_app"
    cmd = [sys.executable, "-m", "uvicorn", "--factory", factory, "--http", PROTOCOL,
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


NPZ = {"Content-Type": "application/octet-stream"}


def post_task(client: httpx.Client, body: bytes, params: dict | None = None, headers: dict | None = None,
              **kw) -> httpx.Response:
    """POST /tasks with ``body`` as the raw npz."""
    return client.post("/tasks", content=body, params=params or {}, headers={**NPZ, **(headers or {})}, **kw)


def wait_for(predicate, timeout: float = 120, interval: float = 0.05, what: str = "condition"):
    """Poll ``predicate`` until it returns a truthy value (returned), or fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def running_job(server: Server):
    """The job now holding the device, as /health reports it (None when idle)."""
    return httpx.get(server.url + "/health", timeout=10).json()["queue"]["running"]


class InProcessServer:
    """uvicorn serving an app object in a thread of this process, on a free loopback port.
    Lets a test reach the app's state (``app.state.service``) while real HTTP drives it."""

    def __init__(self, app, server, thread, url):
        self.app, self.server, self.thread, self.url = app, server, thread, url

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 120), **kw)


@contextlib.contextmanager
def inprocess_server(app, ready: bool = True, timeout: float = 120, http=None, ws="auto"):
    """``http``: uvicorn's HTTP protocol (default ``protocol_class()``: the one ``rev88 serve`` runs);
    ``ws``: its WebSocket protocol (uvicorn's ``--ws``: a name, or a class)."""
    import uvicorn

    if http is None:
        http = protocol_class() or "auto"

    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on", http=http, ws=ws)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        path = "/v2/health/ready" if ready else "/v2/health/live"

        def up():
            service = getattr(app.state, "service", None)
            if service is not None and service.state == "failed":
                raise RuntimeError(f"in-process server failed its start-up: {service.failure}")
            try:
                return httpx.get(url + path, timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, timeout, 0.1, f"in-process server {path}")
        yield InProcessServer(app, server, thread, url)
    finally:
        server.should_exit = True
        thread.join(60)
