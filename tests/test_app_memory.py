"""Refused requests allocate nothing large: the server's peak resident memory (VmHWM, read from
/proc) hardly moves while it refuses over-bound configs and over-budget tasks; and a finished
task's work is freed at once."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest

from app.main import create_app
from app.settings import Settings
from learner.taskio import task_to_npz_bytes

from .gates import Gate, gated_engines
from .helpers import small_task
from .server import inprocess_server, post_task, running_server, wait_for

MIB = 1024 * 1024


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/<pid>/status")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_refused_requests_allocate_nothing_large(tmp_path):
    env = {"REV88_BACKEND": "cpu-fast", "REV88_WORKERS": "1", "REV88_MAX_TASK_WORK": "1000000"}
    small = task_to_npz_bytes(small_task(64, 16, seed=1))
    big = task_to_npz_bytes(small_task(20_000, 100, seed=2))  # 6.5 MB: parsed, then over the work budget
    with running_server(tmp_path, env=env) as server, server.client() as c:
        assert post_task(c, small).status_code == 200  # everything a task touches is loaded now
        before = peak_rss(server.proc.pid)
        refused = [
            ({"depth": "100000"}, small, 422),        # config bound: refused before the body is read
            ({"epochs": "100000"}, small, 422),
            ({"seed": str(2**80)}, small, 422),
            ({"batch_size": str(2**40)}, small, 422),
            ({"epochs": "1000"}, big, 422),           # 2 x 1000 x (20,000 + 32 x 157) work units > 1,000,000
            ({"depth": "64", "epochs": "1000"}, big, 422),
        ]
        for _ in range(3):
            for params, body, status in refused:
                r = post_task(c, body, params=params)
                assert r.status_code == status, (params, r.text)
        grown = peak_rss(server.proc.pid) - before
    # 18 refusals, two thirds of them of a 6.5 MB task: the peak grows by at most a few copies
    # of that body, never by what the refused work would have needed (hundreds of MB to GBs)
    assert grown < 96 * MIB, f"peak RSS grew by {grown / MIB:.1f} MiB while refusing"


def test_a_finished_asynchronous_tasks_work_is_freed_at_once(tmp_path):
    """Once an asynchronous task's outcome is recorded nothing in the server holds its work (its
    arrays, megabytes for a real upload): not its timeout's timer on the event loop (due only after
    REV88_TASK_TIMEOUT_S), not its job -- nor the idle worker that ran it, until its next launch."""
    gate = Gate()
    app = create_app(Settings(backend="cpu", workers=1, data_dir=str(tmp_path / "d")), engines=gated_engines(gate))
    runner = app.state.service.runner
    with inprocess_server(app) as server, server.client() as c:
        gate.hold()
        try:
            r = post_task(c, task_to_npz_bytes(small_task(64, 16, seed=3)), headers={"Prefer": "respond-async"})
            assert r.status_code == 202, r.text
            task_id = r.json()["id"]
            ref = weakref.ref(wait_for(lambda: runner.pending.get(task_id), 30, 0.01, "the task claimed"))
        finally:
            gate.release()
        wait_for(lambda: c.get(f"/tasks/{task_id}").json()["status"] == "succeeded", 30, 0.05, "the task")

        def freed() -> bool:
            gc.collect()
            return ref() is None

        wait_for(freed, 10, 0.05, "its work freed")
