"""Launches, not cells (issue #46): a launch's cells are answered, hashed and recorded as single
tasks are -- on SQLite and on PostgreSQL -- and a kill -9 in the middle of a sweep loses none.

The backend batches on the CPU (tests/gates.py: the real cpu-fast backend with a ``run_many``
over its ``run``, held at a gate where the test needs the order), so the service takes the launch
path (app/tasks/launches.py): the finisher thread answers a launch's cells together and records
them in one transaction."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import signal
import sqlite3
import threading
import time

import pytest

from app.main import create_app
from app.settings import Settings
from learner.config import make_config
from learner.result import run_task
from learner.taskio import load_task, task_to_npz_bytes

from . import pg
from .gates import FileGate, Gate, gated_engines
from .helpers import small_task
from .server import inprocess_server, running_server, wait_for

pg_server, pg_url = pg.pg_server, pg.pg_url  # the fixtures (tests/pg.py)

BODY = task_to_npz_bytes(small_task(90, 12, seed=46))
DIGEST = "sha256:" + hashlib.sha256(BODY).hexdigest()
NPZ = {"Content-Type": "application/octet-stream"}
HASHES = ("predictions_sha256", "scores_sha256")
META = ("epoch_permutation_sha256", "initial_parameter_sha256", "final_parameter_sha256", "final_velocity_sha256",
        "state_vector_sha256", "input_hashes", "config", "precision", "train_count", "test_count")


def _sweep_then_singles(c, cells: int = 8) -> tuple[dict, list[dict], list[dict]]:
    assert c.put(f"/datasets/{DIGEST}", content=BODY, headers=NPZ).status_code == 201
    sweep = c.post("/sweeps", json={"dataset": DIGEST, "grid": {"learning_rate": [0.1, 0.2]},
                                    "seeds": {"start": 0, "count": cells // 2}}).json()["id"]
    doc = wait_for(lambda: (d := c.get(f"/sweeps/{sweep}").json())["status"] == "completed" and d, 180, 0.1,
                   "the sweep")
    records = [c.get(f"/tasks/{row['task_id']}").json() for row in doc["cells"]]
    singles = [c.post("/tasks", params={"dataset": DIGEST, **{k: str(v) for k, v in row["config"].items()}}).json()
               for row in doc["cells"]]
    return doc, records, singles


def _check_as_single_tasks(doc, records, singles) -> None:
    assert doc["counts"]["succeeded"] == len(records)
    assert max(r["timing"]["tasks_in_launch"] for r in records) > 1  # (cells did share launches)
    for row, record, single in zip(doc["cells"], records, singles):
        assert record["status"] == "succeeded"
        for key in HASHES:
            assert record[key] == single[key] == row.get(key, record[key]), key
        for key in META:
            assert record["metadata"][key] == single["metadata"][key], key
        assert record["predictions"] == single["predictions"]  # stored compactly, read back the same
        assert set(single) - {"timing", "request_id", "energy_reason"} <= set(record) | {"status"}
        task = load_task(BODY)
        expected = run_task(task, make_config(row["config"]), "cpu-fast")
        assert record["predictions_sha256"] == expected.predictions_sha256


class _Lines(logging.Handler):
    """The finisher's log records, kept (an in-process server logs in this process)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_launchs_cells_are_recorded_as_single_tasks_on_sqlite(tmp_path):
    app = create_app(Settings(backend="cpu-fast", workers=1, batch_max=4, batch_wait_ms=50,
                              data_dir=str(tmp_path / "d")), engines=gated_engines(Gate(), batching=True))
    lines, finisher_log = _Lines(), logging.getLogger("rev88.app.tasks.finisher")
    finisher_log.addHandler(lines)
    try:
        with inprocess_server(app) as server, server.client() as c:
            doc, records, singles = _sweep_then_singles(c)
            launches = app.state.service.runner.launches.counters
    finally:
        finisher_log.removeHandler(lines)
    _check_as_single_tasks(doc, records, singles)
    assert launches["cells_answered"] >= 8 and launches["ledger_transactions"] < 8  # answered together
    # the log: a launch of several, one line naming each of its tasks with its facts, in order; a
    # task run alone, its own line
    said = {}
    for rec in lines.records:
        if rec.getMessage() == "launch answered":
            assert rec.tasks == len(rec.task_ids) > 1 and rec.tasks_in_launch >= rec.tasks
            for i, task_id in enumerate(rec.task_ids):
                said[task_id] = {"run_ms": rec.run_ms[i], "total_ms": rec.total_ms[i],
                                 "queue_wait_ms": rec.queue_wait_ms[i], "tasks_in_launch": rec.tasks_in_launch,
                                 "train_count": rec.train_count[i], "mode": rec.modes[i]}
        elif rec.getMessage() == "task answered":
            assert rec.task_id not in said and rec.timing["tasks_in_launch"] == 1
            said[rec.task_id] = {**{k: rec.timing[k] for k in ("run_ms", "total_ms", "queue_wait_ms",
                                                                 "tasks_in_launch")},
                                 "train_count": rec.train_count, "mode": rec.mode}
    for record, mode in [(r, "async") for r in records] + [(s, "sync") for s in singles]:
        timing = record["timing"]
        assert said[record["id"]] == {**{k: timing[k] for k in ("run_ms", "total_ms", "queue_wait_ms",
                                                                  "tasks_in_launch")},
                                      "train_count": 90, "mode": mode}, record["id"]
    assert any(said[r["id"]]["tasks_in_launch"] > 1 for r in records)


def test_a_launchs_cells_are_recorded_as_single_tasks_on_postgresql(tmp_path, pg_url):
    app = create_app(Settings(backend="cpu-fast", workers=1, batch_max=4, batch_wait_ms=50, database_url=pg_url,
                              data_dir=str(tmp_path / "d"), claim_poll_s=0.1, lease_renew_s=0.2),
                     engines=gated_engines(Gate(), batching=True))
    with inprocess_server(app) as server, server.client() as c:
        doc, records, singles = _sweep_then_singles(c)
    _check_as_single_tasks(doc, records, singles)


def test_one_bad_cell_of_a_launch_fails_alone(tmp_path):
    """A cell whose training diverges (a learning rate that blows up) fails with its own error; the
    other cells of its launch succeed."""
    app = create_app(Settings(backend="cpu-fast", workers=1, batch_max=4, batch_wait_ms=200,
                              data_dir=str(tmp_path / "d")), engines=gated_engines(Gate(), batching=True))
    with inprocess_server(app) as server, server.client() as c:
        assert c.put(f"/datasets/{DIGEST}", content=BODY, headers=NPZ).status_code == 201
        sweep = c.post("/sweeps", json={"dataset": DIGEST, "grid": {"learning_rate": [0.1, 1e30]},
                                        "seeds": [0, 1]}).json()["id"]
        doc = wait_for(lambda: (d := c.get(f"/sweeps/{sweep}").json())["status"] == "completed" and d, 120, 0.1,
                       "the sweep")
    by_lr = {}
    for row in doc["cells"]:
        by_lr.setdefault(row["config"]["learning_rate"], []).append(row)
    assert all(r["status"] == "succeeded" for r in by_lr[0.1])
    assert all(r["status"] == "failed" and "diverged" in r["error"] for r in by_lr[1e30])


def test_a_kill_9_in_the_middle_of_a_sweep_loses_no_cell(tmp_path):
    data = tmp_path / "data"
    gate = FileGate(tmp_path / "hold")
    env = {"REV88_BACKEND": "cpu-fast", "REV88_WORKERS": "1", "REV88_BATCH_MAX": "4", "REV88_BATCH_WAIT_MS": "50",
           "REV88_DATA_DIR": str(data), "REV88_TEST_BATCHING": "1"}
    with running_server(tmp_path, env=env, gate=gate.path) as srv, srv.client() as c:
        assert c.put(f"/datasets/{DIGEST}", content=BODY, headers=NPZ).status_code == 201
        gate.hold()
        sweep = c.post("/sweeps", json={"dataset": DIGEST, "seeds": {"start": 0, "count": 12}}).json()["id"]
        # a launch on the device (held at the gate), the rest claimed or waiting in the ledger: kill
        wait_for(lambda: c.get(f"/sweeps/{sweep}").json()["counts"]["running"] > 0, 60, 0.05, "a launch running")
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait(30)
    gate.release()
    with sqlite3.connect(data / "ledger.sqlite3") as db:
        statuses = [row[0] for row in db.execute("SELECT status FROM tasks")]
    assert len(statuses) == 12 and "succeeded" not in statuses, statuses  # every cell recorded, none finished
    with running_server(tmp_path, env=env) as srv, srv.client() as c:
        doc = wait_for(lambda: (d := c.get(f"/sweeps/{sweep}").json())["status"] == "completed" and d, 180, 0.1,
                       "the sweep after the restart")
    assert doc["counts"]["succeeded"] == 12
    task = load_task(BODY)
    for row in doc["cells"]:
        assert row["predictions_sha256"] == run_task(task, make_config(row["config"]), "cpu-fast").predictions_sha256


@pytest.mark.parametrize("n", [1])
def test_a_cell_run_alone_on_a_backend_that_cannot_batch_takes_the_same_path(tmp_path, n):
    """batch_max > 1 but a backend without run_many: each cell runs alone, answered by the finisher."""
    app = create_app(Settings(backend="cpu-fast", workers=1, batch_max=4, data_dir=str(tmp_path / "d")),
                     engines=gated_engines(Gate(), batching=False))
    with inprocess_server(app) as server, server.client() as c:
        assert c.put(f"/datasets/{DIGEST}", content=BODY, headers=NPZ).status_code == 201
        sweep = c.post("/sweeps", json={"dataset": DIGEST, "seeds": [0, 1, 2]}).json()["id"]
        doc = wait_for(lambda: (d := c.get(f"/sweeps/{sweep}").json())["status"] == "completed" and d, 120, 0.1,
                       "the sweep")
    assert doc["counts"]["succeeded"] == 3 and {r["timing"]["tasks_in_launch"] for r in doc["cells"]} == {1}


ADMIN_KEY = "admin-key-for-tenants"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def _keyed_app(tmp_path, gate, batching: bool = True, **settings):
    """A service with keys (ADMIN_KEY the admin's) on one worker whose backend waits at ``gate``."""
    return create_app(Settings(backend="cpu-fast", workers=1, api_key=ADMIN_KEY, data_dir=str(tmp_path / "d"),
                               **settings), engines=gated_engines(gate, batching=batching))


def _hold_the_worker(c) -> None:
    """The admin's asynchronous task on the only worker, held at the gate: what follows waits."""
    held = c.post("/tasks", content=BODY, headers={**NPZ, **ADMIN, "Prefer": "respond-async"}).json()["id"]
    wait_for(lambda: c.get(f"/tasks/{held}", headers=ADMIN).json()["status"] == "running", 60, 0.05,
             "the admin's task on the device")


def test_a_cell_whose_tenants_key_was_revoked_while_it_waited_fails_alone(tmp_path):
    """Tenants A and B each sweep the same dataset; their cells wait behind a held launch; the
    admin revokes A's key. A's cells fail with the revocation named, without running; B's cells,
    gathered into the same launches, succeed with the answers single tasks get."""
    admin = ADMIN
    gate = Gate()
    app = _keyed_app(tmp_path, gate, batch_max=8, batch_wait_ms=100)
    with inprocess_server(app) as server, server.client() as c:
        made = {name: c.post("/keys", json={"name": name}, headers=admin).json() for name in ("a", "b")}
        who = {name: {"Authorization": f"Bearer {made[name]['key']}"} for name in made}
        for name in who:
            assert c.put(f"/datasets/{DIGEST}", content=BODY, headers={**NPZ, **who[name]}).status_code in (200, 201)
        gate.hold()
        _hold_the_worker(c)
        sweeps = {name: c.post("/sweeps", json={"dataset": DIGEST, "seeds": [0, 1, 2]}, headers=who[name]).json()["id"]
                  for name in who}
        assert c.delete(f"/keys/{made['a']['id']}", headers=admin).status_code == 200
        gate.release()
        docs = {name: wait_for(lambda s=sweep: (d := c.get(f"/sweeps/{s}", headers=admin).json())["status"]
                               == "completed" and d, 120, 0.1, f"sweep {sweep}") for name, sweep in sweeps.items()}
        records = {name: [c.get(f"/tasks/{row['task_id']}", headers=admin).json() for row in docs[name]["cells"]]
                   for name in docs}
    assert docs["b"]["counts"]["succeeded"] == 3
    task = load_task(BODY)
    for row, record in zip(docs["b"]["cells"], records["b"]):
        assert record["predictions_sha256"] == run_task(task, make_config(row["config"]), "cpu-fast").predictions_sha256
    assert docs["a"]["counts"]["failed"] == 3
    for row, record in zip(docs["a"]["cells"], records["a"]):
        assert row["status"] == "failed" and "key 'a'" in row["error"] and "was revoked" in row["error"], row
        assert record["error"]["status"] == 403 and record.get("predictions_sha256") is None


def test_a_cell_whose_tenants_key_expired_while_it_waited_still_runs(tmp_path):
    """An expiry ends new requests, not answers owed: cells sent before the key expired run."""
    admin = ADMIN
    gate = Gate()
    app = _keyed_app(tmp_path, gate, batch_max=8, batch_wait_ms=50)
    with inprocess_server(app) as server, server.client() as c:
        expires = time.time() + 6.0  # (room for the key's first two requests on a slow machine)
        made = c.post("/keys", json={"name": "brief", "expires_at": expires}, headers=admin).json()
        who = {"Authorization": f"Bearer {made['key']}"}
        assert c.put(f"/datasets/{DIGEST}", content=BODY, headers={**NPZ, **who}).status_code == 201
        gate.hold()
        posted = c.post("/sweeps", json={"dataset": DIGEST, "seeds": [0, 1]}, headers=who)
        assert posted.status_code == 202, posted.text
        sweep = posted.json()["id"]
        wait_for(lambda: time.time() > expires + 0.2, 15, 0.1, "the key's expiry")
        assert c.get("/key", headers=who).status_code == 401  # expired for requests
        gate.release()
        doc = wait_for(lambda: (d := c.get(f"/sweeps/{sweep}", headers=admin).json())["status"] == "completed" and d,
                       120, 0.1, "the sweep")
    assert doc["counts"]["succeeded"] == 2


def test_a_measurement_whose_tenants_key_was_revoked_while_it_waited_is_not_run(tmp_path):
    """The same for ?measure=energy, the other kind of job: refused as it reaches the worker."""
    admin = ADMIN
    gate = Gate()
    app = _keyed_app(tmp_path, gate, batching=False)
    with inprocess_server(app) as server, server.client() as c:
        made = c.post("/keys", json={"name": "gauge"}, headers=admin).json()
        gate.hold()
        _hold_the_worker(c)
        measure = c.post("/tasks", content=BODY, params={"measure": "energy", "trials": "1", "target_seconds": "0.1",
                                                         "settle_seconds": "0", "idle_seconds": "0"},
                         headers={**NPZ, "Authorization": f"Bearer {made['key']}", "Prefer": "respond-async"})
        assert measure.status_code == 202, measure.text
        assert c.delete(f"/keys/{made['id']}", headers=admin).status_code == 200
        gate.release()
        record = wait_for(lambda: (d := c.get(f"/tasks/{measure.json()['id']}", headers=admin).json())["status"]
                          in ("succeeded", "failed", "cancelled") and d, 120, 0.1, "the measurement")
    assert record["status"] == "failed", record
    assert record["error"]["status"] == 403 and "was revoked" in record["error"]["error"]


def test_queued_cells_seed_states_are_prepared_before_their_launch(tmp_path):
    """A sweep accepted while the worker is held: its cells' seed-derived states are computed
    while they wait (the prepare thread), so that their launch finds every one of them kept."""
    from learner import seed_state
    from learner.seed_state import states

    gate = Gate()
    app = create_app(Settings(backend="cpu-fast", workers=1, data_dir=str(tmp_path / "d"), batch_max=8,
                              batch_wait_ms=100), engines=gated_engines(gate))
    seeds = [460_046 + k for k in range(4)]  # (seeds no other test of this process uses: the cache is the process's)
    rows = load_task(BODY).train_count
    with inprocess_server(app) as server, server.client() as c:
        assert c.put(f"/datasets/{DIGEST}", content=BODY, headers=NPZ).status_code in (200, 201)
        gate.hold()
        held = c.post("/tasks", content=BODY, headers={**NPZ, "Prefer": "respond-async"}).json()["id"]
        wait_for(lambda: c.get(f"/tasks/{held}").json()["status"] == "running", 60, 0.05, "the held task")
        before = c.get("/health").json()["seed_cache"]
        assert all(states.missing(make_config({"seed": s}), rows) for s in seeds)
        sweep = c.post("/sweeps", json={"dataset": DIGEST, "grid": {"learning_rate": [0.1, 0.2]},
                                        "seeds": seeds}).json()["id"]
        # (``missing`` is False already while a state is under way: wait for the prepare thread's count,
        # which it takes once a state is kept)
        wait_for(lambda: c.get("/health").json()["seed_cache"]["prepared_ahead"] - before["prepared_ahead"]
                 >= len(seeds), 30, 0.02, "the queued cells' states, computed while the worker is held")
        assert not any(states.missing(make_config({"seed": s}), rows) for s in seeds)
        ahead = c.get("/health").json()["seed_cache"]
        assert ahead["prepared_ahead"] - before["prepared_ahead"] == len(seeds)  # one per seed, not per cell
        hits = states.snapshot()["hits"]
        gate.release()
        doc = wait_for(lambda: (d := c.get(f"/sweeps/{sweep}").json())["status"] == "completed" and d, 120, 0.1,
                       "the sweep")
        records = [c.get(f"/tasks/{row['task_id']}").json() for row in doc["cells"]]
    assert doc["counts"]["succeeded"] == 2 * len(seeds)
    assert states.snapshot()["hits"] - hits >= 2 * len(seeds)  # every cell's launch found its state kept
    for row, record in zip(doc["cells"], records):  # the states computed ahead are a fresh cache's
        fresh = seed_state.SeedStateCache(compute=states.compute).get(make_config(row["config"]), rows)
        assert record["metadata"]["initial_parameter_sha256"] == fresh.initial_sha256
        assert record["metadata"]["epoch_permutation_sha256"] == fresh.permutation_sha256


def test_a_sweeps_seed_states_are_prepared_while_it_is_recorded_each_time(tmp_path):
    """A sweep's first launches' seed-derived states are computed as soon as its request is checked,
    while the sweep is being recorded -- here, while another connection holds the datasets
    database's write lock, so that nothing is recorded yet -- one per distinct seed, and again for
    a second sweep (the prepare thread serves every request, not the first only)."""
    from learner.seed_state import states

    app = create_app(Settings(backend="cpu-fast", workers=1, data_dir=str(tmp_path / "d"), batch_max=8,
                              batch_wait_ms=20), engines=gated_engines(Gate()))
    rows = load_task(BODY).train_count
    with inprocess_server(app) as server, server.client() as c:
        assert c.put(f"/datasets/{DIGEST}", content=BODY, headers=NPZ).status_code in (200, 201)
        for first_seed in (460_100, 460_200):  # (seeds no other test of this process uses)
            seeds = [first_seed + k for k in range(4)]
            assert all(states.missing(make_config({"seed": s}), rows) for s in seeds)
            before = c.get("/health").json()["seed_cache"]["prepared_ahead"]
            lock = sqlite3.connect(tmp_path / "d" / "datasets.sqlite3", isolation_level=None)
            lock.execute("BEGIN IMMEDIATE")  # the sweep cannot be recorded until this ends
            posted = {}
            try:
                def post(seeds=seeds, posted=posted):
                    posted["r"] = c.post("/sweeps", json={"dataset": DIGEST, "grid": {"learning_rate": [0.1, 0.2]},
                                                          "seeds": seeds}, timeout=60)

                thread = threading.Thread(target=post, daemon=True)
                thread.start()
                wait_for(lambda seeds=seeds: not any(states.missing(make_config({"seed": s}), rows) for s in seeds),
                         3, 0.01, "every seed's state, prepared while the sweep waits to be recorded")
                assert "r" not in posted  # (not recorded yet)
            finally:
                lock.execute("ROLLBACK")
                lock.close()
            thread.join(60)
            assert posted["r"].status_code == 202, posted["r"].text
            sweep = posted["r"].json()["id"]
            wait_for(lambda s=sweep: c.get(f"/sweeps/{s}").json()["status"] == "completed", 120, 0.1, "the sweep")
            assert c.get("/health").json()["seed_cache"]["prepared_ahead"] - before == len(seeds)  # one per seed


class _Uninterruptible:
    """cpu-fast as a GPU launch behaves: ``run_many`` waits for its gate, then trains every task of
    the launch to the end -- a token cancelled meanwhile cannot stop a kernel that is running (the
    fused backend's launch); the service must drop that task's result after the launch."""

    def __init__(self, inner, gate: Gate) -> None:
        self.inner, self.gate, self.name, self.device = inner, gate, inner.name, inner.device
        self.entered = threading.Event()

    def describe(self) -> dict:
        return {**self.inner.describe(), "uninterruptible": True}

    def run(self, task, prepared):
        return self.inner.run(task, prepared)

    def run_many(self, tasks, prepareds):
        if len(tasks) > 1:
            self.entered.set()
            while not self.gate.is_open():
                time.sleep(0.005)
        return [self.inner.run(t, dataclasses.replace(p, cancel=None)) for t, p in zip(tasks, prepareds)]


def test_cells_whose_timeout_passes_while_their_launch_runs_are_answered_as_timeouts_not_as_stopped(tmp_path):
    """Two cells in one launch that cannot be interrupted, their REV88_TASK_TIMEOUT_S passing while
    it runs: each ends failed with a 504 that says so -- the launch could not be stopped, its result
    was discarded -- not that it was stopped on the device (it ran to the end)."""
    from learner.backends import get_backend

    gate, engines = Gate(), {}

    def engine(name, device=None):
        inner = get_backend(name, device)
        return engines.setdefault(inner.name, _Uninterruptible(inner, gate))

    app = create_app(Settings(backend="cpu-fast", workers=1, batch_max=8, batch_wait_ms=200, queue_size=16,
                              task_timeout_s=1.0, data_dir=str(tmp_path / "data")), engines=engine)
    with inprocess_server(app) as server, server.client() as c:
        assert c.put(f"/datasets/{DIGEST}", content=BODY, headers=NPZ).status_code in (200, 201)
        gate.hold()
        try:
            sweep = c.post("/sweeps", json={"dataset": DIGEST, "seeds": [1, 2]}).json()["id"]
            assert engines["cpu-fast"].entered.wait(60)
            ids = [row["task_id"] for row in c.get(f"/sweeps/{sweep}").json()["cells"]]
            pending = app.state.service.runner.pending
            wait_for(lambda: all(pending[t].cancel.cancelled for t in ids), 30, 0.02, "both cells' timeouts")
        finally:
            gate.release()
        doc = wait_for(lambda: (d := c.get(f"/sweeps/{sweep}").json())["status"] == "completed" and d, 60, 0.05,
                       "the sweep")
        records = [c.get(f"/tasks/{t}").json() for t in ids]
    assert doc["counts"]["failed"] == 2, doc["counts"]
    for record in records:
        error = record["error"]
        assert record["status"] == "failed" and error["status"] == 504 and error["where"] == "running", record
        assert "could not be stopped, its result is discarded" in error["error"], error
        assert "REV88_TASK_TIMEOUT_S" in error["error"], error


def test_a_task_cancelled_while_its_launch_runs_is_cancelled_and_the_others_keep_their_answers(tmp_path):
    """Four cells in one launch that cannot be interrupted; one of them -- not the first -- is
    cancelled while the launch runs: it ends cancelled (its result, trained to the end, dropped),
    and the three others succeed with their own answers."""
    from learner.backends import get_backend

    gate, engines = Gate(), {}

    def engine(name, device=None):
        inner = get_backend(name, device)
        return engines.setdefault(inner.name, _Uninterruptible(inner, gate))

    app = create_app(Settings(backend="cpu-fast", workers=1, batch_max=8, batch_wait_ms=200, queue_size=16,
                              data_dir=str(tmp_path / "data")), engines=engine)
    with inprocess_server(app) as server, server.client() as c:
        assert c.put(f"/datasets/{DIGEST}", content=BODY, headers=NPZ).status_code in (200, 201)
        gate.hold()
        try:
            sweep = c.post("/sweeps", json={"dataset": DIGEST, "seeds": [1, 2, 3, 4]}).json()["id"]
            assert engines["cpu-fast"].entered.wait(60)
            cells = wait_for(lambda: (rows := c.get(f"/sweeps/{sweep}").json()["cells"])
                             and all(row["status"] == "running" for row in rows) and rows, 30, 0.02,
                             "the four cells running in one launch")
            answer: dict = {}
            canceller = threading.Thread(target=lambda: answer.update(
                r=c.post(f"/tasks/{cells[2]['task_id']}/cancel", timeout=60)), daemon=True)
            canceller.start()
            wait_for(lambda: app.state.service.runner.pending[cells[2]["task_id"]].cancel.cancelled, 30, 0.01,
                     "the cancel to reach the running task")
        finally:
            gate.release()
        canceller.join(60)
        doc = wait_for(lambda: (d := c.get(f"/sweeps/{sweep}").json())["status"] in ("completed", "cancelled") and d,
                       120, 0.1, "the sweep")
        records = [c.get(f"/tasks/{row['task_id']}").json() for row in doc["cells"]]
        # each cell's outcome made once: the cancelled one's, whoever ended it first, is not made again
        counters = app.state.service.runner.finisher.counters
        assert (counters["cells_answered"], counters["cells_failed"]) == (3, 1), counters
    assert answer["r"].status_code == 200 and answer["r"].json()["status"] == "cancelled", answer["r"].text
    assert [r["status"] for r in records] == ["succeeded", "succeeded", "cancelled", "succeeded"], records
    for record, row in zip(records, doc["cells"]):
        if record["status"] == "succeeded":
            alone = run_task(load_task(BODY), make_config({"seed": row["config"]["seed"]}), "cpu-fast")
            assert [record[k] for k in HASHES] == [alone.predictions_sha256, alone.scores_sha256], row
            assert all(record["metadata"][k] == alone.metadata[k] for k in META), row
            assert record["timing"]["tasks_in_launch"] == 4


def test_the_device_runs_at_most_a_few_launches_ahead_of_the_finisher(tmp_path):
    """A launch's outputs are host memory until it is finished: with the finisher held, a worker
    runs UNFINISHED_MAX launches and then waits (not the whole sweep); released, every cell is
    answered as if nothing had waited."""
    from app.tasks.launches import UNFINISHED_MAX

    engines = gated_engines(Gate(), batching=True)
    app = create_app(Settings(backend="cpu-fast", workers=1, batch_max=2, batch_wait_ms=20,
                              data_dir=str(tmp_path / "d")), engines=engines)
    held = threading.Event()
    cells = 4 * UNFINISHED_MAX  # two a launch: twice as many launches as may wait
    with inprocess_server(app) as server, server.client() as c:
        finisher = app.state.service.runner.finisher
        real = finisher.launch

        def launch(*args, **kwargs):
            held.wait(120)
            return real(*args, **kwargs)

        finisher.launch = launch  # (the finisher's thread calls it for every launch: held there)
        device = engines("cpu-fast")
        before = device.entered  # (the service's warm-up ran a task of its own)

        def ran() -> int:
            return device.entered - before

        assert c.put(f"/datasets/{DIGEST}", content=BODY, headers=NPZ).status_code == 201
        sweep = c.post("/sweeps", json={"dataset": DIGEST, "grid": {"learning_rate": [0.1]},
                                        "seeds": {"start": 0, "count": cells}}).json()["id"]
        wait_for(lambda: ran() >= 2 * UNFINISHED_MAX, 60, 0.02, "the first launches")
        time.sleep(0.5)  # (a worker without the bound runs the rest of the sweep meanwhile: a few ms a launch)
        assert ran() == 2 * UNFINISHED_MAX
        held.set()
        doc = wait_for(lambda: (d := c.get(f"/sweeps/{sweep}").json())["status"] == "completed" and d, 120, 0.1,
                       "the sweep")
    assert doc["counts"]["succeeded"] == cells and ran() == cells


def test_the_finisher_answers_the_next_launches_while_the_last_ones_records_are_written(tmp_path):
    """The finisher thread hands a launch's records to the ledger writer and goes on to the next
    launch; nobody is told a cell's answer before its record is written (the writer's thread
    tells them then), and every cell is answered once the writes go through."""
    from app.tasks.launches import UNFINISHED_MAX

    app = create_app(Settings(backend="cpu-fast", workers=1, batch_max=2, batch_wait_ms=20,
                              data_dir=str(tmp_path / "d")), engines=gated_engines(Gate(), batching=True))
    held, writing = threading.Event(), threading.Event()
    cells = 2 * UNFINISHED_MAX
    with inprocess_server(app) as server, server.client() as c:
        service = app.state.service
        ledger = service.ledger_writer.ledger
        real = ledger.finish_many

        def finish_many(outcomes):
            writing.set()
            held.wait(120)
            return real(outcomes)

        ledger.finish_many = finish_many  # (the writer's thread records every launch's outcomes through it)
        told = []
        service.runner.finisher.recorded_hooks.append(lambda work, outcome: told.append(work.task_id))
        assert c.put(f"/datasets/{DIGEST}", content=BODY, headers=NPZ).status_code == 201
        sweep = c.post("/sweeps", json={"dataset": DIGEST, "grid": {"learning_rate": [0.1]},
                                        "seeds": {"start": 0, "count": cells}}).json()["id"]
        assert writing.wait(60), "the first launch's records"
        counters = service.runner.launches.counters
        wait_for(lambda: counters["launches"] >= UNFINISHED_MAX, 60, 0.02,
                 "the next launches answered while the first one's records wait")
        assert counters["cells_answered"] >= cells - 2 and told == []  # (answered, not told: nothing written)
        held.set()
        doc = wait_for(lambda: (d := c.get(f"/sweeps/{sweep}").json())["status"] == "completed" and d, 120, 0.1,
                       "the sweep")
    assert doc["counts"]["succeeded"] == cells and sorted(told) == sorted(r["task_id"] for r in doc["cells"])


def test_a_stop_while_a_launchs_records_are_being_written_keeps_them_on_postgresql(tmp_path, pg_url):
    """The service stops while a launch's records are still being written (held here): its stop
    waits for them before it gives the unfinished tasks' leases back, so the ledger keeps the
    cells succeeded (not queued again to run a second time)."""
    app = create_app(Settings(backend="cpu-fast", workers=1, batch_max=2, batch_wait_ms=20, database_url=pg_url,
                              data_dir=str(tmp_path / "d")), engines=gated_engines(Gate(), batching=True))
    held, writing = threading.Event(), threading.Event()
    with inprocess_server(app) as server, server.client() as c:
        ledger = app.state.service.ledger_writer.ledger
        real = ledger.finish_many

        def finish_many(outcomes):
            writing.set()
            held.wait(120)
            return real(outcomes)

        ledger.finish_many = finish_many
        assert c.put(f"/datasets/{DIGEST}", content=BODY, headers=NPZ).status_code == 201
        sweep = c.post("/sweeps", json={"dataset": DIGEST, "grid": {"learning_rate": [0.1]},
                                        "seeds": {"start": 0, "count": 2}}).json()["id"]
        assert writing.wait(60), "the launch's records"
        cells = [row["task_id"] for row in c.get(f"/sweeps/{sweep}").json()["cells"]]
        threading.Timer(0.5, held.set).start()  # (written while the server stops)
    psycopg = pg.require_psycopg()
    with psycopg.connect(pg_url) as conn:  # what the stop left in the ledger
        statuses = dict(conn.execute("SELECT id, status FROM rev88_tasks WHERE id = ANY(%s)", (cells,)).fetchall())
    assert statuses == dict.fromkeys(cells, "succeeded")


def test_a_claimed_task_pushed_out_of_the_offered_cache_while_its_batch_is_queued_still_runs(tmp_path):
    """A claim batch holds a task whose arrays the feeder no longer keeps (its upload is read back
    from the ledger) and one offered here. While that upload is read, new uploads are offered and
    push the cache past its bound: the offered task still runs, from the work it was offered (taken
    out of the cache with its claim), not failed for an input its claim never read back."""
    import asyncio

    from app.ledger.base import Claim

    app = create_app(Settings(backend="cpu-fast", workers=1, queue_size=2, data_dir=str(tmp_path / "d")))
    with inprocess_server(app) as server, server.client() as c:
        service = app.state.service
        feeder = service.runner.feeder

        async def no_claims():  # (the claims below are made by hand)
            return 0

        feeder.claim_some = no_claims
        body = task_to_npz_bytes(small_task(40, 6, seed=3))
        ids = [c.post("/tasks", content=body, headers={**NPZ, "Prefer": "respond-async"}).json()["id"] for _ in range(2)]
        first, offered = ids
        assert feeder._take_offered(first) is not None and offered in feeder.offered  # (as if pushed out earlier)
        reading, read = threading.Event(), threading.Event()
        real = feeder.ledger.load_uploads

        def load_uploads(task_ids):
            reading.set()
            assert read.wait(60)
            return real(task_ids)

        feeder.ledger.load_uploads = load_uploads
        queued = asyncio.run_coroutine_threadsafe(
            feeder._queue_claims([Claim(service.ledger.get(t), None) for t in (first, offered)]), feeder._loop)
        assert reading.wait(60)
        more = [c.post("/tasks", content=body, headers={**NPZ, "Prefer": "respond-async"}).json()["id"] for _ in range(2)]
        assert offered not in feeder.offered and all(t in feeder.offered for t in more)  # (pushed out)
        read.set()
        assert queued.result(60) == 2
        for task_id in (first, offered):
            doc = wait_for(lambda t=task_id: (d := c.get(f"/tasks/{t}").json())["status"] not in ("queued", "running")
                           and d, 60, 0.05, "the claimed tasks")
            assert doc["status"] == "succeeded", doc
