"""``rev88 submit --async``, ``rev88 tasks``, ``rev88 task ID`` and ``rev88 cancel ID`` against a
real service (cpu-fast backend, auth on); cancels of a queued and a running task against a
server whose runs are held at a file gate (tests/gates.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from learner.hashing import array_sha256
from learner.taskio import save_task
from rev88.cli import main as rev88
from rev88.cli import tasks as commands
from tests.conftest import small_task
from tests.gates import FileGate
from tests.server import free_port, running_server, wait_for

API_KEY = "cli-tasks-test-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli-tasks-server")
    with running_server(tmp, env={"REV88_BACKEND": "cpu-fast", "REV88_API_KEY": API_KEY}) as srv:
        yield srv


def _npz(path: Path, seed: int, n: int = 19, m: int = 7) -> Path:
    save_task(path, small_task(n, m, seed=seed))
    return path


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = rev88(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def submit_async(capsys, url: str, path: Path, *extra: str) -> str:
    code, out, err = cli(capsys, "submit", str(path), "--url", url, "--api-key", API_KEY, "--async",
                         "--no-progress", *extra)
    assert code == 0, err
    return out.strip().splitlines()[-1]


# --------------------------------------------------------------------------- the real server


def test_async_submit_then_wait_writes_the_answer_and_its_predictions(server, tmp_path, capsys):
    task = _npz(tmp_path / "t.npz", seed=11)
    accepted = tmp_path / "accepted.json"
    code, out, err = cli(capsys, "submit", str(task), "--url", server.url, "--api-key", API_KEY, "--async",
                         "--no-progress", "--output", str(accepted))
    assert code == 0, err
    task_id = out.strip().splitlines()[-1]
    assert task_id and " " not in task_id  # the last line is the id alone
    assert f"{server.url}/tasks/{task_id}" in out  # the Location, absolute
    summary = json.loads(accepted.read_text())
    assert summary["id"] == task_id and summary["status"] in ("queued", "running", "succeeded")

    result = tmp_path / "out" / "result.json"
    code, out, err = cli(capsys, "task", task_id, "--url", server.url, "--api-key", API_KEY, "--wait",
                         "--timeout", "120", "--output", str(result))
    assert code == 0, err
    assert f"task {task_id} succeeded" in out and str(result) in out
    answer = json.loads(result.read_text())
    assert answer["status"] == "succeeded" and answer["id"] == task_id and len(answer["predictions"]) == 7
    npy = tmp_path / "out" / "result.predictions.npy"
    predictions = np.load(npy)
    assert predictions.dtype == np.int64 and predictions.tolist() == answer["predictions"]

    # the same task answered synchronously: the same predictions, hash for hash
    sync = tmp_path / "sync.json"
    code, out, err = cli(capsys, "submit", str(task), "--url", server.url, "--api-key", API_KEY,
                         "--no-progress", "--output", str(sync))
    assert code == 0, err
    assert array_sha256(predictions) == json.loads(sync.read_text())["predictions_sha256"]
    assert answer["predictions_sha256"] == json.loads(sync.read_text())["predictions_sha256"]

    # without --wait: found -> 0 and one line; the table lists it
    code, out, err = cli(capsys, "task", task_id, "--url", server.url, "--api-key", API_KEY)
    assert code == 0, err
    assert len(out.strip().splitlines()) == 1 and "succeeded" in out and "7 queries" in out
    code, out, err = cli(capsys, "tasks", "--url", server.url, "--api-key", API_KEY)
    assert code == 0, err
    header, *rows = out.strip().splitlines()
    assert header.split()[:2] == ["id", "status"]
    row = next(r for r in rows if r.startswith(task_id))
    assert "succeeded" in row and "19/7" in row and "cpu-fast" in row and answer["predictions_sha256"][:12] in row


def test_tasks_status_filter_json_and_every_page(server, tmp_path, capsys):
    ids = [submit_async(capsys, server.url, _npz(tmp_path / f"p{i}.npz", seed=20 + i)) for i in range(3)]
    for task_id in ids:
        assert cli(capsys, "task", task_id, "--url", server.url, "--api-key", API_KEY, "--wait")[0] == 0

    code, out, err = cli(capsys, "tasks", "--url", server.url, "--api-key", API_KEY, "--json", "--limit", "500")
    assert code == 0, err
    listed = json.loads(out)
    assert isinstance(listed, list) and {t["id"] for t in listed} >= set(ids)
    created = [t["created_at"] for t in listed]
    assert created == sorted(created, reverse=True)  # newest first
    assert [t["id"] for t in listed if t["id"] in ids] == ids[::-1]

    code, out, err = cli(capsys, "tasks", "--url", server.url, "--api-key", API_KEY, "--json", "--status", "succeeded")
    assert code == 0 and {t["id"] for t in json.loads(out)} >= set(ids)
    assert all(t["status"] == "succeeded" for t in json.loads(out))
    code, out, err = cli(capsys, "tasks", "--url", server.url, "--api-key", API_KEY, "--status", "queued")
    assert code == 0 and out.strip() == "no tasks queued"

    # one page of one: the rest is announced on stderr; --all follows every cursor
    code, out, err = cli(capsys, "tasks", "--url", server.url, "--api-key", API_KEY, "--limit", "1", "--json")
    assert code == 0 and len(json.loads(out)) == 1 and "more tasks: --all, or --cursor " in err
    cursor = err.strip().rsplit(" ", 1)[-1]
    code, out, _ = cli(capsys, "tasks", "--url", server.url, "--api-key", API_KEY, "--limit", "1", "--json",
                       "--cursor", cursor)
    assert code == 0 and json.loads(out)[0]["id"] == listed[1]["id"]
    code, out, err = cli(capsys, "tasks", "--url", server.url, "--api-key", API_KEY, "--limit", "1", "--all",
                         "--json")
    assert code == 0 and err == ""
    assert [t["id"] for t in json.loads(out)] == [t["id"] for t in listed]
    code, out, _ = cli(capsys, "tasks", "--url", server.url, "--api-key", API_KEY, "--limit", "1", "--all")
    assert code == 0 and len(out.strip().splitlines()) == len(listed) + 1  # the header and one row each


def test_cancel_of_a_finished_task_names_its_status(server, tmp_path, capsys):
    task_id = submit_async(capsys, server.url, _npz(tmp_path / "c.npz", seed=31))
    assert cli(capsys, "task", task_id, "--url", server.url, "--api-key", API_KEY, "--wait")[0] == 0
    code, out, err = cli(capsys, "cancel", task_id, "--url", server.url, "--api-key", API_KEY)
    assert code == 2
    assert "(409)" in err and "already finished (succeeded)" in err


def test_unknown_id_is_2(server, tmp_path, capsys):
    for argv in (["task", "no-such-task"], ["task", "no-such-task", "--wait"], ["cancel", "no-such-task"],
                 ["task", "no-such-task", "--output", str(tmp_path / "x.json")]):
        code, out, err = cli(capsys, *argv, "--url", server.url, "--api-key", API_KEY)
        assert code == 2, argv
        assert "(404)" in err and "no-such-task" in err
    assert not (tmp_path / "x.json").exists()


def test_idempotency_key_gives_the_same_task(server, tmp_path, capsys):
    task = _npz(tmp_path / "i.npz", seed=41)
    first = submit_async(capsys, server.url, task, "--idempotency-key", "cli-key-1")
    assert submit_async(capsys, server.url, task, "--idempotency-key", "cli-key-1") == first
    # synchronously with the same key: that task's answer (waited for if still running), not a second run
    out_json = tmp_path / "r.json"
    code, out, err = cli(capsys, "submit", str(task), "--url", server.url, "--api-key", API_KEY, "--no-progress",
                         "--idempotency-key", "cli-key-1", "--output", str(out_json))
    assert code == 0, err
    assert json.loads(out_json.read_text())["id"] == first
    # another file with that key is refused
    code, out, err = cli(capsys, "submit", str(_npz(tmp_path / "j.npz", seed=42)), "--url", server.url,
                         "--api-key", API_KEY, "--async", "--no-progress", "--idempotency-key", "cli-key-1")
    assert code == 2 and "(409)" in err
    code, out, err = cli(capsys, "submit", str(task), "--url", server.url, "--api-key", API_KEY, "--async",
                         "--no-progress", "--idempotency-key", "has a space")
    assert code == 2 and "Idempotency-Key" in err


def test_without_the_key_every_command_is_refused(server, capsys, monkeypatch):
    monkeypatch.delenv("REV88_API_KEY", raising=False)
    for argv in (["tasks"], ["task", "x"], ["cancel", "x"]):
        code, out, err = cli(capsys, *argv, "--url", server.url)
        assert code == 2 and "(401)" in err, argv
    monkeypatch.setenv("REV88_API_KEY", API_KEY)
    assert cli(capsys, "tasks", "--url", server.url)[0] == 0  # the default comes from the environment


# --------------------------------------------------------------------------- local failures


def test_bad_url_and_no_server(tmp_path, capsys):
    for argv in (["tasks"], ["task", "x"], ["cancel", "x"]):
        code, out, err = cli(capsys, *argv, "--url", "127.0.0.1:8000")
        assert code == 2 and "--url must start with http:// or https://" in err, argv
        url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        code, out, err = cli(capsys, *argv, "--url", url)
        assert code == 1 and "cannot connect" in err and url in err, argv


def test_local_input_errors(tmp_path, capsys):
    task = _npz(tmp_path / "t.npz", seed=1)
    code, _, err = cli(capsys, "submit", str(task), "--url", "http://127.0.0.1:1", "--no-progress")
    assert code == 2 and "--output is required" in err
    code, _, err = cli(capsys, "tasks", "--url", "http://127.0.0.1:1", "--limit", "0")
    assert code == 2 and "--limit" in err
    code, _, err = cli(capsys, "task", "x", "--url", "http://127.0.0.1:1", "--timeout", "0")
    assert code == 2 and "--timeout" in err
    with pytest.raises(SystemExit) as exc:  # argparse: not a status
        rev88(["tasks", "--url", "http://127.0.0.1:1", "--status", "done"])
    assert exc.value.code == 2


def test_statuses_match_the_ledgers():
    from app.ledger.store import STATUSES

    assert commands.TASK_STATUSES == STATUSES


def test_table_formatting():
    rows = [{"id": "a1", "status": "succeeded", "created_at": 0, "train_count": 19, "test_count": 7,
             "backend": "cpu", "run_ms": 12.345, "predictions_sha256": "ab" * 32},
            {"id": "b2", "status": "queued", "created_at": 1.5, "train_count": 19, "test_count": 7,
             "backend": None, "run_ms": None, "predictions_sha256": None}]
    lines = commands.format_table(rows).splitlines()
    assert lines[0].split("  ")[0] == "id"
    assert "1970-01-01T00:00:00Z" in lines[1] and "12.3" in lines[1] and "abababababab…" in lines[1]
    assert lines[2].startswith("b2  queued") and lines[2].endswith("-")


# --------------------------------------------------------------------------- held runs: cancel


def _status(capsys, url: str, task_id: str) -> str:
    code, out, err = cli(capsys, "task", task_id, "--url", url)
    assert code == 0, err
    return out.split()[2]


def test_cancel_of_a_running_and_a_queued_task(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("REV88_API_KEY", raising=False)
    gate = FileGate(tmp_path / "hold")
    env = {"REV88_BACKEND": "cpu-fast", "REV88_WORKERS": "1"}
    try:
        with running_server(tmp_path, env=env, gate=gate.path) as srv:  # ready after its warm-up run
            gate.hold()
            running = submit_async(capsys, srv.url, _npz(tmp_path / "r.npz", seed=51))
            wait_for(lambda: _status(capsys, srv.url, running) == "running", 60, 0.05, "the first task to run")
            queued = submit_async(capsys, srv.url, _npz(tmp_path / "q.npz", seed=52))
            assert _status(capsys, srv.url, queued) == "queued"

            # --wait gives up at --timeout with 1; the task goes on
            code, out, err = cli(capsys, "task", running, "--url", srv.url, "--wait", "--timeout", "0.3")
            assert code == 1 and "still running after 0.3 s" in err

            code, out, err = cli(capsys, "tasks", "--url", srv.url, "--status", "queued")
            assert code == 0 and queued in out and running not in out

            code, out, err = cli(capsys, "cancel", queued, "--url", srv.url)
            assert code == 0, err
            assert out.startswith(f"task {queued} cancelled")
            code, out, err = cli(capsys, "cancel", running, "--url", srv.url)
            assert code == 0, err
            assert out.startswith(f"task {running} cancelled")

            # a cancelled task: found (0) without --wait, 1 with it; its status document is written
            doc = tmp_path / "cancelled.json"
            assert cli(capsys, "task", running, "--url", srv.url)[0] == 0
            code, out, err = cli(capsys, "task", running, "--url", srv.url, "--wait", "--output", str(doc))
            assert code == 1 and "cancelled" in out
            written = json.loads(doc.read_text())
            assert written["status"] == "cancelled" and written["error"]
            assert not (tmp_path / "cancelled.predictions.npy").exists()
            code, out, err = cli(capsys, "cancel", queued, "--url", srv.url)
            assert code == 2 and "already finished (cancelled)" in err
    finally:
        gate.release()
