"""``rev88 submit`` and ``rev88 serve``: the client against the real service, the retry
logic against a small local HTTP server that answers 503 with Retry-After, and ``serve``
as a real process that starts, answers and drains on SIGTERM."""

from __future__ import annotations

import email.utils
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from rev88.cli import main as rev88
from rev88.cli import serve as serve_cli
from rev88.cli import tasks as commands
from tests.conftest import small_task
from tests.gates import FileGate
from tests.server import ROOT, free_port, running_server, wait_for

DRAW0_PREDICTIONS_SHA256 = "37724115cb2d3242eb4a4f76d3a879ac92d729939320e5f6f2bd046bd631f200"
API_KEY = "submit-test-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One real service (cpu backend, auth on) shared by this module's client tests."""
    tmp = tmp_path_factory.mktemp("submit-server")
    with running_server(tmp, env={"REV88_BACKEND": "cpu", "REV88_API_KEY": API_KEY}) as srv:
        yield srv


@pytest.fixture
def small_npz(tmp_path) -> Path:
    from learner.taskio import save_task

    path = tmp_path / "small.npz"
    save_task(path, small_task(19, 7, seed=3))
    return path


# --------------------------------------------------------------------------- real server


@pytest.mark.slow
def test_submit_draw0_scores_8887(server, draw0_npz, tmp_path, capsys):
    out = tmp_path / "result.json"
    code = rev88(["submit", str(draw0_npz), "--url", server.url, "--api-key", API_KEY, "--output", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    answer = json.loads(out.read_text())
    predictions = np.asarray(answer["predictions"], dtype=np.int64)
    labels = np.load(draw0_npz.with_name("labels.npy"))
    assert predictions.shape == (10_000,)
    assert int((predictions == labels).sum()) == 8_887
    assert answer["predictions_sha256"] == DRAW0_PREDICTIONS_SHA256
    assert answer["metadata"]["backend"] == "cpu"
    assert set(answer["timing"]) >= {"queue_wait_ms", "parse_ms", "run_ms", "total_ms"}
    # the progress line went to stderr (not a terminal here: one summary line), the summary to stdout
    assert "uploaded" in captured.err
    assert "10000 predictions" in captured.out and str(out) in captured.out


def test_submit_sends_config_and_include_scores(server, small_npz, tmp_path, capsys):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"batch_size": 8, "learning_rate": 0.05}))
    out = tmp_path / "r.json"
    code = rev88(["submit", str(small_npz), "--url", server.url + "/", "--api-key", API_KEY, "--config", str(cfg),
                  "--backend", "cpu", "--include-scores", "--no-progress", "--output", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.err == ""  # --no-progress
    answer = json.loads(out.read_text())
    assert answer["metadata"]["config"]["batch_size"] == 8
    assert answer["metadata"]["config"]["learning_rate"] == 0.05
    assert len(answer["predictions"]) == 7
    scores = np.asarray(answer["scores"], dtype=np.float32)
    assert scores.shape == (7, 10)
    assert answer["predictions"] == scores.argmax(axis=1).tolist()


def test_submit_task_with_query_labels_is_refused_with_the_servers_message(server, tmp_path, capsys):
    task = small_task(19, 7, seed=4)
    bad = tmp_path / "with-labels.npz"
    np.savez(bad, train_images=task.train_images, train_labels=task.train_labels,
             test_images=task.test_images, test_labels=np.zeros(7, dtype=np.int64))
    out = tmp_path / "never.json"
    code = rev88(["submit", str(bad), "--url", server.url, "--api-key", API_KEY, "--no-progress", "--output", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert "refused the task (422)" in err
    assert "test_labels" in err  # the server's own {"error"} message names the member
    assert not out.exists()


def test_submit_unknown_config_key_is_refused(server, small_npz, tmp_path, capsys):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"epochz": 3}))
    code = rev88(["submit", str(small_npz), "--url", server.url, "--api-key", API_KEY, "--config", str(cfg),
                  "--no-progress", "--output", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert code == 2
    assert "(422)" in err and "epochz" in err


def test_submit_without_the_key_is_unauthorized(server, small_npz, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("REV88_API_KEY", raising=False)
    code = rev88(["submit", str(small_npz), "--url", server.url, "--no-progress", "--output", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert code == 2
    assert "(401)" in err


def test_submit_reads_the_key_from_the_environment(server, small_npz, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("REV88_API_KEY", API_KEY)
    code = rev88(["submit", str(small_npz), "--url", server.url, "--no-progress", "--output", str(tmp_path / "r.json")])
    assert code == 0, capsys.readouterr().err


def test_submit_over_the_body_limit_gets_the_servers_413(draw0_npz, tmp_path, capsys):
    """The server refuses on Content-Length before reading; the client still reports its answer."""
    with running_server(tmp_path, env={"REV88_BACKEND": "cpu", "REV88_MAX_BODY_BYTES": "1000000"}) as srv:
        code = rev88(["submit", str(draw0_npz), "--url", srv.url, "--no-progress", "--output", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert code == 2
    assert "refused the task (413)" in err and "1000000" in err


def test_submit_no_server_is_a_connection_error(small_npz, tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    code = rev88(["submit", str(small_npz), "--url", url, "--no-progress", "--output", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert code == 1
    assert "cannot connect" in err and url in err


def test_submit_local_input_errors(small_npz, tmp_path, capsys):
    assert rev88(["submit", str(tmp_path / "missing.npz"), "--url", "http://127.0.0.1:1",
                  "--output", str(tmp_path / "r.json")]) == 2
    assert "task file not found" in capsys.readouterr().err
    bad_cfg = tmp_path / "cfg.json"
    bad_cfg.write_text("[1, 2]")
    assert rev88(["submit", str(small_npz), "--url", "http://127.0.0.1:1", "--config", str(bad_cfg),
                  "--output", str(tmp_path / "r.json")]) == 2
    assert "JSON object" in capsys.readouterr().err
    assert rev88(["submit", str(small_npz), "--url", "127.0.0.1:8000", "--output", str(tmp_path / "r.json")]) == 2
    assert "http://" in capsys.readouterr().err


# --------------------------------------------------------------------------- 503 + Retry-After


class Stub(http.server.ThreadingHTTPServer):
    """Answers POST /tasks from a script of (status, headers, body) and records each upload."""

    daemon_threads = True

    def __init__(self, script):
        self.script = list(script)
        self.received: list[tuple[str, int, dict[str, str]]] = []
        super().__init__(("127.0.0.1", 0), StubHandler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class StubHandler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server's naming)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.received.append((self.path, len(body), dict(self.headers)))
        status, headers, payload = self.server.script.pop(0) if len(self.server.script) > 1 else self.server.script[0]
        data = json.dumps(payload).encode()
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):  # keep test output clean
        pass


@pytest.fixture
def stub():
    servers = []

    def start(script):
        srv = Stub(script)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


@pytest.fixture
def waits(monkeypatch):
    recorded: list[float] = []
    monkeypatch.setattr(commands, "_sleep", recorded.append)
    return recorded


BUSY = {"error": "the device queue is full (8 waiting)"}
OK = {"id": "t-1", "predictions": [1, 2, 3], "predictions_sha256": "ab" * 32, "metadata": {"backend": "cpu"},
      "timing": {"run_ms": 1.0, "total_ms": 2.0}}


def test_503_is_retried_as_retry_after_asks(stub, waits, small_npz, tmp_path, capsys):
    soon = email.utils.formatdate(time.time() + 30, usegmt=True)
    srv = stub([(503, {"Retry-After": "3"}, BUSY), (503, {"Retry-After": soon}, BUSY), (200, {}, OK)])
    out = tmp_path / "r.json"
    code = rev88(["submit", str(small_npz), "--url", srv.url, "--api-key", "k", "--backend", "cpu",
                  "--output", str(out)])
    err = capsys.readouterr().err
    assert code == 0, err
    assert json.loads(out.read_text()) == OK
    assert waits[0] == 3.0
    assert 25.0 <= waits[1] <= 30.0  # an HTTP-date: seconds from now
    assert len(waits) == 2
    size = small_npz.stat().st_size
    assert [(path, n) for path, n, _ in srv.received] == [("/tasks?backend=cpu", size)] * 3  # whole file each time
    assert all(h["Authorization"] == "Bearer k" for _, _, h in srv.received)
    assert err.count("server busy (503: the device queue is full (8 waiting))") == 2


def test_retries_are_bounded_and_waits_capped(stub, waits, small_npz, tmp_path, capsys):
    srv = stub([(503, {"Retry-After": "3600"}, BUSY)])
    out = tmp_path / "r.json"
    code = rev88(["submit", str(small_npz), "--url", srv.url, "--retries", "2", "--max-wait", "7",
                  "--no-progress", "--output", str(out)])
    err = capsys.readouterr().err
    assert code == 1
    assert waits == [7.0, 7.0]
    assert len(srv.received) == 3
    assert "still busy after 2 retries" in err and "queue is full" in err
    assert not out.exists()


def test_503_without_retry_after_waits_the_default(stub, waits, small_npz, tmp_path):
    srv = stub([(503, {}, BUSY), (200, {}, OK)])
    assert rev88(["submit", str(small_npz), "--url", srv.url, "--no-progress", "--output", str(tmp_path / "r.json")]) == 0
    assert waits == [commands.DEFAULT_RETRY_WAIT_S]


def test_no_retries_when_asked_for_none(stub, waits, small_npz, tmp_path):
    srv = stub([(503, {"Retry-After": "1"}, BUSY), (200, {}, OK)])
    assert rev88(["submit", str(small_npz), "--url", srv.url, "--retries", "0", "--no-progress",
                  "--output", str(tmp_path / "r.json")]) == 1
    assert waits == [] and len(srv.received) == 1


def test_other_statuses(stub, waits, small_npz, tmp_path, capsys):
    srv = stub([(504, {}, {"error": "task timed out after 300 s"})])
    assert rev88(["submit", str(small_npz), "--url", srv.url, "--no-progress", "--output", str(tmp_path / "r.json")]) == 1
    assert "the server failed (504): task timed out after 300 s" in capsys.readouterr().err
    srv = stub([(413, {}, {"error": "body over the 1 MiB limit"})])
    assert rev88(["submit", str(small_npz), "--url", srv.url, "--no-progress", "--output", str(tmp_path / "r.json")]) == 2
    assert "refused the task (413): body over the 1 MiB limit" in capsys.readouterr().err
    assert waits == []


def test_retry_after_parsing():
    assert commands.retry_after_seconds("5") == 5.0
    assert commands.retry_after_seconds(" 0 ") == 0.0
    assert commands.retry_after_seconds("-3") == 0.0
    assert commands.retry_after_seconds(None) == commands.DEFAULT_RETRY_WAIT_S
    assert commands.retry_after_seconds("soon") == commands.DEFAULT_RETRY_WAIT_S
    assert commands.retry_after_seconds("nan") == commands.DEFAULT_RETRY_WAIT_S
    past = email.utils.formatdate(time.time() - 100, usegmt=True)
    assert commands.retry_after_seconds(past) == 0.0


# --------------------------------------------------------------------------- serve


def test_serve_flags_set_the_settings_variables():
    from app.settings import Settings

    args = commands.argparse.Namespace(host="0.0.0.0", port=9001, backend="cpu", queue_size=3, max_body_bytes=1234,
                                       task_timeout=12.5, drain_timeout=7.0, api_key="k", log_level="warning",
                                       threads=2)
    env: dict[str, str] = {"REV88_QUEUE_SIZE": "99", "REV88_LOG_LEVEL": "debug"}
    serve_cli.apply_serve_flags(args, env)
    s = Settings.from_env(env)
    assert (s.host, s.port, s.backend, s.queue_size, s.max_body_bytes) == ("0.0.0.0", 9001, "cpu", 3, 1234)
    assert (s.task_timeout_s, s.drain_timeout_s, s.api_key, s.log_level, s.threads) == (12.5, 7.0, "k", "warning", 2)
    # a flag not given leaves the environment's value
    env = {"REV88_QUEUE_SIZE": "5"}
    serve_cli.apply_serve_flags(commands.argparse.Namespace(queue_size=None), env)
    assert env == {"REV88_QUEUE_SIZE": "5"}


@pytest.fixture
def restore_environ():
    """`rev88 serve` run in-process writes its flags into os.environ: put it back after."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_serve_refuses_a_bad_worker_count(capsys, restore_environ):
    assert rev88(["serve", "--workers", "0"]) == 2
    assert "REV88_WORKERS must be >= 1" in capsys.readouterr().err


def test_serve_names_a_bad_setting(capsys, restore_environ):
    assert rev88(["serve", "--queue-size", "0"]) == 2
    assert "REV88_QUEUE_SIZE" in capsys.readouterr().err


def test_serve_names_an_unusable_backend(capsys, restore_environ):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is usable here")
    assert rev88(["serve", "--backend", "cuda"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_serve_process_finishes_a_running_task_on_sigterm(tmp_path):
    """`rev88 serve` as a real process: ready; SIGTERM while a task runs -> the task still
    gets its 200 answer, then the process exits 0."""
    port = free_port()
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("REV88_")}
    gate = FileGate(tmp_path / "hold")  # runs wait while this file exists: the task is surely running at SIGTERM
    cmd = [sys.executable, "-m", "tests.gates", str(gate.path), "serve", "--port", str(port), "--backend", "cpu",
           "--drain-timeout", "60", "--threads", "1", "--log-level", "info"]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(url + "/v2/health/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "serve not ready:\n" + log.read_text()
            time.sleep(0.1)
        from learner.taskio import task_to_npz_bytes

        body = task_to_npz_bytes(small_task(1_000, 2_000, seed=5))
        gate.hold()
        answers: list[httpx.Response] = []

        def post():
            answers.append(httpx.post(url + "/tasks", content=body,
                                      headers={"Content-Type": "application/octet-stream"}, timeout=120))

        poster = threading.Thread(target=post)
        poster.start()
        while "rev88_device_busy 1.0" not in httpx.get(url + "/metrics", timeout=5).text:
            assert poster.is_alive(), answers[0].text if answers else "no answer"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: "draining" in log.read_text(), 60, 0.02, "the drain to begin")
        gate.release()
        poster.join(timeout=120)
        assert answers and answers[0].status_code == 200, answers[0].text if answers else "no answer"
        assert len(answers[0].json()["predictions"]) == 2_000
        assert proc.wait(timeout=60) == 0, log.read_text()
        assert f"http://127.0.0.1:{port}" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
