"""Every answer paired with its own task (issue #54): the worst bug this service can have is a
correct answer handed to the wrong task. These tests mix, in one launch and in one ledger
transaction, everything that is numbered, sliced or looked up by position, and compare every
answer with ``run_task`` alone, hash by hash and key by key.

- one launch holding tenants' cells of distinct seeds, two synchronous tasks (one recorded when it
  finishes, one with an Idempotency-Key: recorded before it runs) and a revoked key's cell that is
  refused as the launch is gathered (so the tasks that ran are not the launch's items);
- one ledger writer transaction holding a launch's outcomes between single outcomes;
- two launches of one shape on the fused backend (Triton's interpreter), the first's outputs read
  again after the second: tests/test_fused.py (``test_a_launchs_outputs_outlive_the_next_launch``).
"""

from __future__ import annotations

import hashlib
import threading

import httpx

from app.ledger import Ledger, Outcome
from app.ledger.writer import LedgerWriter
from app.main import create_app
from app.settings import Settings
from learner.config import make_config
from learner.result import run_task
from learner.taskio import load_task, task_to_npz_bytes

from . import pg
from .gates import Gate, gated_engines
from .helpers import small_task
from .server import inprocess_server, wait_for
from .test_ledger import answer_for, create

pg_server, pg_url = pg.pg_server, pg.pg_url  # the fixtures (tests/pg.py)

BODY = task_to_npz_bytes(small_task(90, 12, seed=54))
DIGEST = "sha256:" + hashlib.sha256(BODY).hexdigest()
NPZ = {"Content-Type": "application/octet-stream"}
ADMIN_KEY = "admin-key-for-pairing"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
HASHES = ("predictions_sha256", "scores_sha256")
META = ("epoch_permutation_sha256", "initial_parameter_sha256", "final_parameter_sha256", "final_velocity_sha256",
        "state_vector_sha256", "input_hashes", "config", "precision", "train_count", "test_count")


def _alone(seed: int) -> dict:
    """The answer's figures of the task run alone, in process (cpu-fast: the service's backend)."""
    result = run_task(load_task(BODY), make_config({"seed": seed}), "cpu-fast")
    return {"predictions_sha256": result.predictions_sha256, "scores_sha256": result.scores_sha256,
            "metadata": result.metadata, "predictions": result.predictions.tolist()}


def _assert_alone(answer: dict, seed: int, what: str) -> None:
    alone = _alone(seed)
    for key in HASHES:
        assert answer[key] == alone[key], (what, key)
    for key in META:
        assert answer["metadata"][key] == alone["metadata"][key], (what, key)
    assert answer["predictions"] == alone["predictions"], what


def test_a_launch_mixing_tenants_seeds_synchronous_tasks_and_a_refused_cell_pairs_every_answer(store):
    gate = Gate()
    app = create_app(Settings(backend="cpu-fast", workers=1, api_key=ADMIN_KEY, batch_max=8, batch_wait_ms=100,
                              queue_size=16, **store), engines=gated_engines(gate, batching=True))
    with inprocess_server(app) as server, server.client() as c, server.client() as s1, server.client() as s2:
        keys = {n: c.post("/keys", json={"name": n}, headers=ADMIN).json() for n in ("revoked", "b", "c")}
        who = {n: {"Authorization": f"Bearer {k['key']}"} for n, k in keys.items()}
        for n in who:
            assert c.put(f"/datasets/{DIGEST}", content=BODY, headers={**NPZ, **who[n]}).status_code in (200, 201)
        gate.hold()
        answers: dict[int, httpx.Response] = {}
        try:
            held = c.post("/tasks", content=BODY, headers={**NPZ, **ADMIN, "Prefer": "respond-async"}).json()["id"]
            wait_for(lambda: c.get(f"/tasks/{held}", headers=ADMIN).json()["status"] == "running", 60, 0.05,
                     "the admin's task held on the device")

            def depth() -> int:
                return c.get("/health", headers=ADMIN).json()["admission"]["device_queue"]["depth"]

            # first in the device queue: the cell whose key is revoked before the launch
            revoked = c.post("/sweeps", json={"dataset": DIGEST, "seeds": [0]}, headers=who["revoked"]).json()["id"]
            wait_for(lambda: depth() == 1, 30, 0.02, "the revoked tenant's cell queued")

            def sync(client: httpx.Client, seed: int, headers: dict) -> None:
                answers[seed] = client.post("/tasks", params={"dataset": DIGEST, "seed": seed},
                                            headers={**ADMIN, **headers}, timeout=120)

            threads = [threading.Thread(target=sync, args=(s1, 5, {})),
                       threading.Thread(target=sync, args=(s2, 7, {"Idempotency-Key": "pairing-7"}))]
            for t in threads:
                t.start()
            wait_for(lambda: depth() == 3, 30, 0.02, "the two synchronous tasks queued")
            sweeps = {"b": c.post("/sweeps", json={"dataset": DIGEST, "seeds": [1, 2, 3]}, headers=who["b"]).json()["id"],
                      "c": c.post("/sweeps", json={"dataset": DIGEST, "seeds": [4, 6]}, headers=who["c"]).json()["id"]}
            wait_for(lambda: depth() == 8, 30, 0.02, "every cell queued behind the held task")
            assert c.delete(f"/keys/{keys['revoked']['id']}", headers=ADMIN).status_code == 200
        finally:
            gate.release()
        for t in threads:
            t.join(120)
        docs = {n: wait_for(lambda s=s: (d := c.get(f"/sweeps/{s}", headers=ADMIN).json())["status"] == "completed"
                            and d, 120, 0.1, f"sweep {s}") for n, s in {**sweeps, "revoked": revoked}.items()}
        records = {n: [c.get(f"/tasks/{row['task_id']}", headers=ADMIN).json() for row in doc["cells"]]
                   for n, doc in docs.items()}
        launch = app.state.service.executor.stats.largest_launch
        # the task recorded before it ran (Idempotency-Key) reads back as its client was answered
        key7 = c.get(f"/tasks/{answers[7].json()['id']}", headers=ADMIN).json()

    assert launch == 8  # the revoked cell, the two synchronous tasks and five cells: one launch
    [refused] = records["revoked"]
    assert refused["status"] == "failed" and refused["error"]["status"] == 403, refused
    for seed, r in answers.items():
        assert r.status_code == 200, r.text
        _assert_alone(r.json(), seed, f"synchronous task of seed {seed}")
        assert r.json()["timing"]["tasks_in_launch"] > 1
    for n in ("b", "c"):
        for row, record in zip(docs[n]["cells"], records[n]):
            assert record["status"] == "succeeded", record
            _assert_alone(record, row["config"]["seed"], f"tenant {n}'s cell of seed {row['config']['seed']}")
            assert row["predictions_sha256"] == record["predictions_sha256"]
            assert record["timing"]["tasks_in_launch"] == 7  # (the refused cell did not run)
    assert key7["predictions_sha256"] == answers[7].json()["predictions_sha256"]


def test_one_writer_transaction_of_a_launchs_outcomes_among_single_outcomes_pairs_each(tmp_path):
    """Single outcomes before and after a launch's, all in one transaction (the writer held while
    they are handed over): each caller gets its own task's record."""
    ledger = Ledger(tmp_path / "data")
    writer = LedgerWriter(ledger)
    try:
        records = [create(ledger)[0] for _ in range(6)]
        hold, holding = threading.Event(), threading.Event()
        writer.call(lambda: (holding.set(), hold.wait(30)))  # the writer busy: what follows shares one write
        assert holding.wait(30)

        def outcome(r, want_record=True):
            return Outcome(r.id, "succeeded", answer_for(r.id), want_record=want_record)

        first = writer.finish(outcome(records[0]))
        launch = writer.finish_launch([outcome(r) for r in records[1:4]])
        middle = writer.finish(outcome(records[4]))
        cells = writer.finish_launch([outcome(records[5], want_record=False)])
        writes: list[int] = []
        finish_many = ledger.finish_many
        ledger.finish_many = lambda outcomes: (writes.append(len(outcomes)), finish_many(outcomes))[1]
        hold.set()
        assert first.result(30).id == records[0].id
        assert [r.id for r in launch.result(30)] == [r.id for r in records[1:4]]
        assert middle.result(30).id == records[4].id
        assert cells.result(30) == [True]
        assert writes == [6]  # (they did share one transaction)
        for r in records:
            got = ledger.get(r.id)
            assert got.status == "succeeded" and got.answer == answer_for(r.id)
    finally:
        writer.close(30)
        ledger.close()


def _finished_behind_its_back(store: dict, task_id: str) -> None:
    """The task recorded cancelled in the ledger by another hand than this process's (another
    replica's cancel, a restart's leftovers): its run here goes on, and its outcome is refused."""
    if "database_url" in store:
        import psycopg

        with psycopg.connect(store["database_url"], autocommit=True) as conn:
            conn.execute("UPDATE rev88_tasks SET status = 'cancelled', finished_at = EXTRACT(EPOCH FROM "
                         "clock_timestamp()) WHERE id = %s", (task_id,))
        return
    import sqlite3
    import time
    from pathlib import Path

    with sqlite3.connect(Path(store["data_dir"]) / "ledger.sqlite3") as db:
        db.execute("UPDATE tasks SET status = 'cancelled', finished_at = ? WHERE id = ?", (time.time(), task_id))


def test_a_launch_whose_ledger_refuses_one_outcome_tells_each_cell_its_own(store):
    """One launch of four cells, the first finished in the ledger meanwhile by another hand:
    the ledger refuses that outcome alone. The sweep then shows that cell as the ledger has it
    (cancelled), not as this process ran it, and each other cell with its own answer -- a refusal
    told to the wrong cell would show the refused cell succeeded and keep another's answer out."""
    gate = Gate()
    if "database_url" in store:  # (no renewal before the launch: it would see the cancel and drop the cell from it)
        store = {**store, "lease_s": 120.0, "lease_renew_s": 60.0}
    app = create_app(Settings(backend="cpu-fast", workers=1, api_key=ADMIN_KEY, batch_max=8, batch_wait_ms=100,
                              queue_size=16, **store), engines=gated_engines(gate, batching=True))
    with inprocess_server(app) as server, server.client() as c:
        assert c.put(f"/datasets/{DIGEST}", content=BODY, headers={**NPZ, **ADMIN}).status_code in (200, 201)
        gate.hold()
        try:
            held = c.post("/tasks", content=BODY, headers={**NPZ, **ADMIN, "Prefer": "respond-async"}).json()["id"]
            wait_for(lambda: c.get(f"/tasks/{held}", headers=ADMIN).json()["status"] == "running", 60, 0.05,
                     "a task held on the device")
            sweep = c.post("/sweeps", json={"dataset": DIGEST, "seeds": [1, 2, 3, 4]}, headers=ADMIN).json()["id"]
            wait_for(lambda: c.get("/health", headers=ADMIN).json()["admission"]["device_queue"]["depth"] == 4,
                     30, 0.02, "the sweep's cells queued behind the held task")
            cells = c.get(f"/sweeps/{sweep}", headers=ADMIN).json()["cells"]
            _finished_behind_its_back(store, cells[0]["task_id"])
        finally:
            gate.release()
        doc = wait_for(lambda: (d := c.get(f"/sweeps/{sweep}", headers=ADMIN).json())["status"] == "completed"
                       and d, 120, 0.1, "the sweep")
        records = [c.get(f"/tasks/{row['task_id']}", headers=ADMIN).json() for row in doc["cells"]]
        launch = app.state.service.executor.stats.largest_launch
    assert launch == 4  # (the four cells, one launch: the refused outcome was one of its transaction's)
    assert [row["status"] for row in doc["cells"]] == ["cancelled", "succeeded", "succeeded", "succeeded"], doc["cells"]
    assert records[0]["status"] == "cancelled" and "predictions_sha256" not in doc["cells"][0]
    for i in (1, 2, 3):
        row, record = doc["cells"][i], records[i]
        assert record["status"] == "succeeded", record
        _assert_alone(record, row["config"]["seed"], f"the cell of seed {row['config']['seed']}")
        assert row["predictions_sha256"] == record["predictions_sha256"]


def test_a_launchs_digests_are_each_runs_own_across_its_hash_groups():
    """A launch larger than one group of the hash pool's calls (``DIGEST_GROUP`` runs each), with
    runs that raised among those that ran: every task's hashes are those of its own outputs."""
    import concurrent.futures
    from types import SimpleNamespace

    import numpy as np

    from app.tasks.device import DIGEST_GROUP, Launch, finish_launch
    from learner.backends.base import RunOutput
    from learner.hashing import array_sha256, state_vector

    shapes = [(41, 41)] * 4 + [(10, 82), (10,)]
    runs: list = []
    for i in range(2 * DIGEST_GROUP + 5):
        if i % 7 == 3:
            runs.append(RuntimeError(f"run {i} refused"))
            continue
        rng = np.random.default_rng(i)
        out = RunOutput(final_parameters=[rng.random(s, dtype=np.float32) for s in shapes],
                        final_velocity=[rng.random(s, dtype=np.float32) for s in shapes],
                        scores=rng.random((50, 10), dtype=np.float32), training_prediction_seconds=0.001,
                        preparation_seconds=0.0)
        task = SimpleNamespace(train_count=5, test_count=50, input_hashes=dict)
        prepared = SimpleNamespace(cancel=None, permutation_sha256=[], initial_sha256={})
        runs.append((task, make_config({"seed": i}), prepared, out, 0.0))
    launch = Launch([(None, None)] * len(runs), SimpleNamespace(name="stand-in", device="cpu"), runs, None,
                    "no meter", 0.001)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        outcomes = finish_launch(launch, pool)
    for i, (run, outcome) in enumerate(zip(runs, outcomes, strict=True)):
        if isinstance(run, BaseException):
            assert outcome is run
            continue
        out, meta = run[3], outcome.result.metadata
        assert meta["scores_sha256"] == array_sha256(out.scores), i
        assert meta["predictions_sha256"] == array_sha256(out.scores.argmax(axis=1).astype(np.int64)), i
        assert list(meta["final_parameter_sha256"].values()) == [array_sha256(p) for p in out.final_parameters], i
        assert list(meta["final_velocity_sha256"].values()) == [array_sha256(v) for v in out.final_velocity], i
        assert meta["state_vector_sha256"] == array_sha256(state_vector(out.final_parameters)), i
        assert meta["tasks_in_launch"] == sum(isinstance(r, tuple) for r in runs)
