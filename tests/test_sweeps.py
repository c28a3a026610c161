"""Sweeps (issue #31): a grid × seeds over one stored dataset in one request, every cell a task
whose answer equals POST /tasks?dataset= with the cell's config; on a real server, both stores."""

from __future__ import annotations

import csv
import hashlib
import io

import numpy as np

from app.main import create_app
from app.settings import Settings
from learner.taskio import task_to_npz_bytes

from . import pg
from .gates import Gate, gated_engines
from .helpers import npy_bytes as npy
from .helpers import small_task
from .server import inprocess_server, wait_for

pg_server, pg_url = pg.pg_server, pg.pg_url  # the fixtures (tests/pg.py)

TASK = small_task(60, 10, seed=31)
BODY = task_to_npz_bytes(TASK)
DIGEST = "sha256:" + hashlib.sha256(BODY).hexdigest()
LABELS = np.random.default_rng(7).integers(0, 10, 10).astype(np.int64)
NPZ = {"Content-Type": "application/octet-stream"}


def serve(engines=None, **settings):
    return inprocess_server(create_app(Settings(backend="cpu", workers=1, **settings), engines=engines))


def completed(c, sweep_id: str, timeout: float = 120) -> dict:
    return wait_for(lambda: (d := c.get(f"/sweeps/{sweep_id}").json())["status"] in ("completed", "cancelled") and d,
                    timeout, what=f"sweep {sweep_id}")


def test_a_sweep_runs_every_cell_as_its_single_task_and_counts(store):
    with serve(**store) as server, server.client() as c:
        assert c.put(f"/datasets/{DIGEST}", content=BODY, headers=NPZ).status_code == 201
        assert c.put(f"/datasets/{DIGEST}/labels", content=npy(LABELS), headers=NPZ).status_code == 201
        r = c.post("/sweeps", json={"dataset": DIGEST, "config": {"batch_size": 16},
                                    "grid": {"epochs": [1, 2], "learning_rate": [0.05, 0.2]}, "seeds": [3, 4]})
        assert r.status_code == 202, r.text
        sweep_id = r.json()["id"]
        assert r.headers["location"] == f"/sweeps/{sweep_id}" and r.json()["cells"] == 8
        doc = completed(c, sweep_id)
        assert doc["status"] == "completed" and doc["counts"]["succeeded"] == 8
        configs = [(row["config"]["epochs"], row["config"]["learning_rate"], row["config"]["seed"]) for row in doc["cells"]]
        assert configs == [(e, lr, s) for e in (1, 2) for lr in (0.05, 0.2) for s in (3, 4)]  # grid order, seeds inner
        for row in doc["cells"]:
            cfg = row["config"]
            single = c.post("/tasks", params={"dataset": DIGEST, "epochs": cfg["epochs"], "batch_size": 16,
                                              "learning_rate": cfg["learning_rate"], "seed": cfg["seed"]}).json()
            assert row["predictions_sha256"] == single["predictions_sha256"]  # byte for byte
            assert (row["correct"], row["total"]) == (single["correct"], 10) and row["timing"]["run_ms"] > 0
            assert row["accuracy"] == single["accuracy"] == row["correct"] / 10
            task = c.get(f"/tasks/{row['task_id']}").json()  # every cell is a task in the ledger
            assert task["status"] == "succeeded" and task["dataset"] == DIGEST
        # each cell's record names its input, the dataset's npz, by its SHA-256 (the digest's)
        listed = {t["id"]: t for t in c.get("/tasks", params={"limit": 100}).json()["tasks"]}
        assert [listed[row["task_id"]]["body_sha256"] for row in doc["cells"]] == [DIGEST[7:]] * 8
        table = list(csv.DictReader(io.StringIO(c.get(f"/sweeps/{sweep_id}", params={"format": "csv"}).text)))
        assert [r["task_id"] for r in table] == [row["task_id"] for row in doc["cells"]]
        assert table[0]["epochs"] == "1" and table[0]["correct"] == str(doc["cells"][0]["correct"])
        listed = c.get("/sweeps").json()["sweeps"]
        assert [s["id"] for s in listed] == [sweep_id] and listed[0]["cells"] == 8
        assert c.get(f"/datasets/{DIGEST}").json()["sweeps"] == [sweep_id]
        assert str(LABELS.tolist()) not in c.get(f"/sweeps/{sweep_id}").text
        # a cancel of the finished sweep, or of one of its cells, is a 409 and changes nothing
        late = c.post(f"/sweeps/{sweep_id}/cancel")
        assert late.status_code == 409 and "already finished (completed)" in late.json()["error"], late.text
        cell = c.post(f"/tasks/{doc['cells'][0]['task_id']}/cancel")
        assert cell.status_code == 409 and "already finished (succeeded)" in cell.json()["error"], cell.text
        again = c.get(f"/sweeps/{sweep_id}").json()
        assert again["status"] == "completed" and again["counts"] == doc["counts"]
        assert again["cancelled_at"] is None
        assert c.get("/sweeps").json()["sweeps"][0]["status"] == "completed"


def test_an_empty_grid_runs_the_base_config_once_per_seed_and_one_failed_cell_fails_alone(tmp_path):
    with serve(data_dir=str(tmp_path / "d")) as server, server.client() as c:
        assert c.put(f"/datasets/{DIGEST}", content=BODY, headers=NPZ).status_code == 201
        r = c.post("/sweeps", json={"dataset": DIGEST, "seeds": {"start": 5, "count": 3}})
        doc = completed(c, r.json()["id"])
        assert [row["config"]["seed"] for row in doc["cells"]] == [5, 6, 7] and doc["counts"]["succeeded"] == 3
        r = c.post("/sweeps", json={"dataset": DIGEST, "grid": {"learning_rate": [0.1, 1e9]}, "seeds": [0]})
        doc = completed(c, r.json()["id"])
        assert doc["status"] == "completed" and doc["counts"] == {"queued": 0, "running": 0, "succeeded": 1,
                                                                  "failed": 1, "cancelled": 0}
        failed = [row for row in doc["cells"] if row["status"] == "failed"][0]
        assert failed["config"]["learning_rate"] == 1e9 and "diverged" in failed["error"]


def test_bad_sweeps_are_refused_naming_the_problem(tmp_path):
    with serve(data_dir=str(tmp_path / "d"), sweep_max_cells=6, sweep_max_work=100_000) as server, server.client() as c:
        assert c.put(f"/datasets/{DIGEST}", content=BODY, headers=NPZ).status_code == 201
        cases = [
            ({"dataset": "sha256:" + "2" * 64}, 404, "no dataset"),
            ({"dataset": "md5:x"}, 422, "dataset"),
            ({"dataset": DIGEST, "grid": {"depht": [2]}}, 422, "'depht' is not a config key"),
            ({"dataset": DIGEST, "grid": {"epochs": []}}, 422, "non-empty list"),
            ({"dataset": DIGEST, "grid": {"epochs": [1, 0]}}, 422, "epochs"),
            ({"dataset": DIGEST, "grid": {"seed": [1]}}, 422, "seeds"),
            ({"dataset": DIGEST, "config": {"epochs": 10**6}}, 422, "epochs"),
            ({"dataset": DIGEST, "seeds": [1, 1]}, 422, "more than once"),
            ({"dataset": DIGEST, "seeds": {"start": 0, "count": 7}}, 422, "REV88_SWEEP_MAX_CELLS"),
            ({"dataset": DIGEST, "grid": {"epochs": [200, 300]}, "seeds": [0, 1, 2]}, 422, "REV88_SWEEP_MAX_WORK"),
            ({"dataset": DIGEST, "colour": "blue"}, 422, "colour"),
        ]
        for body, status, says in cases:
            r = c.post("/sweeps", json=body)
            assert r.status_code == status and says in r.json()["error"], (body, r.status_code, r.text)
        assert c.get("/sweeps").json()["sweeps"] == []  # nothing recorded
        assert c.get("/tasks").json()["tasks"] == []


def test_an_idempotency_key_gives_the_same_sweep_and_cancel_stops_the_rest(tmp_path):
    gate = Gate()
    with serve(engines=gated_engines(gate), data_dir=str(tmp_path / "d")) as server, server.client() as c:
        assert c.put(f"/datasets/{DIGEST}", content=BODY, headers=NPZ).status_code == 201
        gate.hold()
        body = {"dataset": DIGEST, "grid": {"epochs": [1, 2]}, "seeds": [0, 1]}
        first = c.post("/sweeps", json=body, headers={"Idempotency-Key": "sweep-1"})
        again = c.post("/sweeps", json=body, headers={"Idempotency-Key": "sweep-1"})
        assert first.status_code == again.status_code == 202 and again.json()["id"] == first.json()["id"]
        assert again.headers["idempotent-replayed"] == "true"
        other = c.post("/sweeps", json={**body, "seeds": [9]}, headers={"Idempotency-Key": "sweep-1"})
        assert other.status_code == 409 and first.json()["id"] in other.json()["error"]
        sweep_id = first.json()["id"]
        wait_for(lambda: c.get(f"/sweeps/{sweep_id}").json()["counts"]["running"] == 1, 30, what="a running cell")
        doc = c.post(f"/sweeps/{sweep_id}/cancel").json()
        gate.release()
        doc = completed(c, sweep_id)
        assert doc["status"] == "cancelled" and doc["counts"]["cancelled"] == 4 and doc["cancelled_at"]
        assert len(c.get("/tasks").json()["tasks"]) == 4  # the replay made no second set of cells


def test_the_list_carries_each_sweeps_status_and_counts_read_without_answers(store):
    """GET /sweeps: every row's status and counts equal its document's (queued, running,
    cancelled, completed), on both ledgers; the page's cells are read in one status-only query
    (no answer read back), and a finished sweep's counts are not read again."""
    gate = Gate()
    app = create_app(Settings(backend="cpu", workers=1, **store), engines=gated_engines(gate))
    ledger = app.state.service.ledger
    asked: list[tuple[str, int]] = []
    for name in ("statuses", "get_many"):
        real = getattr(ledger, name)
        setattr(ledger, name, lambda ids, *more, real=real, name=name: (asked.append((name, len(ids))), real(ids, *more))[1])

    def listed() -> dict[str, dict]:
        asked.clear()
        rows = {s["id"]: s for s in c.get("/sweeps").json()["sweeps"]}
        assert [name for name, _ in asked] in ([], ["statuses"]), asked  # one query a page, no answers
        return rows

    with inprocess_server(app) as server, server.client() as c:
        assert c.put(f"/datasets/{DIGEST}", content=BODY, headers=NPZ).status_code == 201
        sweep = lambda body: c.post("/sweeps", json={"dataset": DIGEST, **body}).json()["id"]  # noqa: E731
        done = sweep({"seeds": [0, 1]})
        completed(c, done)
        gate.hold()
        try:
            held = sweep({"config": {"epochs": 2}, "seeds": [0]})  # (its one cell running, none queued)
            wait_for(lambda: c.get(f"/sweeps/{held}").json()["counts"]["running"] == 1, 30, what="a running cell")
            behind = sweep({"seeds": [5, 6]})
            stopped = sweep({"seeds": [7]})
            assert c.post(f"/sweeps/{stopped}/cancel").status_code == 200
            wait_for(lambda: c.get(f"/sweeps/{stopped}").json()["status"] == "cancelled", 30, what="the cancel")
            rows = listed()
            want = {done: "completed", held: "running", behind: "queued", stopped: "cancelled"}
            assert {i: rows[i]["status"] for i in want} == want
            for sweep_id in want:
                doc = c.get(f"/sweeps/{sweep_id}").json()
                assert (rows[sweep_id]["status"], rows[sweep_id]["counts"]) == (doc["status"], doc["counts"])
                assert rows[sweep_id]["cells"] == sum(doc["counts"].values()) == len(doc["cells"])
            assert rows[held]["counts"] == {"queued": 0, "running": 1, "succeeded": 0, "failed": 0, "cancelled": 0}
        finally:
            gate.release()
        for sweep_id in (held, behind):
            completed(c, sweep_id)
        rows = listed()
        assert {rows[i]["status"] for i in (done, held, behind)} == {"completed"}
        assert rows[behind]["counts"]["succeeded"] == 2 and rows[stopped]["counts"]["cancelled"] == 1
        app.state.service.sweeps._finished.clear()  # (as on a replica that ran none of them)
        assert listed() == rows and asked == []  # finished sweeps' counts are kept: nothing read


def test_the_client_and_rev88_sweep(tmp_path):
    import subprocess
    import sys

    from rev88 import Client

    path = tmp_path / "task.npz"
    path.write_bytes(BODY)
    with serve(data_dir=str(tmp_path / "d")) as server, Client(server.url) as client:
        dataset = client.put_dataset(path)
        client.put_labels(dataset, LABELS)
        sweep_id = client.sweep(dataset, grid={"epochs": [1, 2]}, seeds={"start": 0, "count": 2}, batch_size=32)
        seen = []
        result = client.wait_sweep(sweep_id, 120, progress=seen.append)
        assert result.status == "completed" and result.counts["succeeded"] == 4 and seen[-1].finished
        assert [(r["config"]["epochs"], r["config"]["seed"], r["config"]["batch_size"]) for r in result.rows] == [
            (1, 0, 32), (1, 1, 32), (2, 0, 32), (2, 1, 32)]
        assert all("correct" in r for r in result.rows)
        out = tmp_path / "table.csv"
        run = subprocess.run([sys.executable, "-m", "rev88", "sweep", dataset.digest, "--grid", "learning_rate=0.05,0.1",
                              "--seeds", "3-4", "--wait", "--output", str(out), "--url", server.url],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        assert "4 succeeded" in run.stdout and "sweep 4/4 cells (0 running, 0 failed) in " in run.stderr  # (not a tty: the summary)
        table = list(csv.DictReader(io.StringIO(out.read_text())))
        assert [(r["learning_rate"], r["seed"]) for r in table] == [("0.05", "3"), ("0.05", "4"), ("0.1", "3"),
                                                                     ("0.1", "4")]
        bad = subprocess.run([sys.executable, "-m", "rev88", "sweep", dataset.digest, "--grid", "depht=2",
                              "--url", server.url], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and "depht" in bad.stderr


def test_a_sweeps_cells_share_launches_on_a_backend_that_batches(tmp_path):
    """On a backend with run_many (tests/test_app_batching.py's LaunchRecorder: the real cpu
    backend, each launch's tasks run one by one and recorded), a sweep's cells of one shape and
    config but the seed are gathered into launches of up to batch_max, and each cell still equals
    its single task (run through the same backend outside any sweep)."""
    from learner.backends import get_backend

    from .test_app_batching import LaunchRecorder

    recorder = LaunchRecorder()
    engines = lambda name, device=None: recorder if name == "cpu" else get_backend(name, device)  # noqa: E731
    with serve(engines=engines, data_dir=str(tmp_path / "d"), batch_max=4, batch_wait_ms=200) as server, \
            server.client() as c:
        assert c.put(f"/datasets/{DIGEST}", content=BODY, headers=NPZ).status_code == 201
        recorder.launches.clear()
        r = c.post("/sweeps", json={"dataset": DIGEST, "seeds": {"start": 0, "count": 8}})
        doc = completed(c, r.json()["id"])
        assert doc["counts"]["succeeded"] == 8
        sizes = [len(seeds) for kind, _, seeds in recorder.launches if kind == "run_many"]
        assert sizes and max(sizes) > 1 and max(sizes) <= 4 and sum(len(s) for _, _, s in recorder.launches) == 8
        assert max(row["timing"]["tasks_in_launch"] for row in doc["cells"]) > 1
        for row in doc["cells"]:
            single = c.post("/tasks", params={"dataset": DIGEST, "seed": row["config"]["seed"]}).json()
            assert row["predictions_sha256"] == single["predictions_sha256"]


def test_a_poll_reads_no_answer_back_for_cells_this_process_recorded(tmp_path):
    """A finished cell's row is kept from the answer in hand when its outcome is recorded, so
    polls read only unfinished cells from the ledger; the kept rows equal rows read back."""
    app = create_app(Settings(backend="cpu", workers=1, data_dir=str(tmp_path / "data")))
    with inprocess_server(app) as server, server.client() as c:
        assert c.put(f"/datasets/{DIGEST}", content=BODY, headers=NPZ).status_code == 201
        assert c.put(f"/datasets/{DIGEST}/labels", content=npy(LABELS), headers=NPZ).status_code == 201
        sweep_id = c.post("/sweeps", json={"dataset": DIGEST, "grid": {"epochs": [1, 2]}, "seeds": [0, 1]}).json()["id"]
        service = app.state.service
        asked: list[list[str]] = []
        real = service.ledger.get_many
        service.ledger.get_many = lambda ids, *more: (asked.append(list(ids)), real(ids, *more))[1]
        doc = completed(c, sweep_id)
        assert doc["counts"]["succeeded"] == 4
        asked.clear()
        assert c.get(f"/sweeps/{sweep_id}").json() == doc
        assert asked == []  # every row from hand
        service.sweeps._finished.clear()  # (as on a replica that ran none of them)
        assert c.get(f"/sweeps/{sweep_id}").json() == doc
        assert sorted(asked[0]) == sorted(row["task_id"] for row in doc["cells"])


def _held_cell_records(service, *, fail: BaseException | None = None):
    """The ledger's ``create_many`` from its second call on (a sweep's later chunks of cells):
    held until ``go`` is set, then written (or, with ``fail``, refused with it). Returns (entered, go)."""
    import threading

    entered, go = threading.Event(), threading.Event()
    real, calls = service.runner.ledger.create_many, []

    def create_many(tasks, messages=None):
        calls.append(len(tasks))
        if len(calls) > 1:
            entered.set()
            assert go.wait(60), "the test never let the later chunk through"
            if fail is not None:
                raise fail
        return real(tasks, messages)

    service.runner.ledger.create_many = create_many
    return entered, go, real


def _post_through_a_ledger_fault(c, service, body: dict, key: str):
    """POST /sweeps with ``key`` while the ledger fails a later chunk's write (the first chunk is
    recorded); the ledger's own write back afterwards."""
    from app.ledger import LedgerUnavailable

    _, go, real = _held_cell_records(service, fail=LedgerUnavailable("the disk is full (injected)"))
    go.set()
    try:
        return c.post("/sweeps", json=body, headers={"Idempotency-Key": key})
    finally:
        service.runner.ledger.create_many = real


def _post_aside(url: str, path: str, body: dict | None, answers: dict, name: str = "r", timeout: float = 120):
    """POST ``body`` to ``path`` on a thread of its own (its answer in ``answers[name]``): the
    thread, started."""
    import threading

    import httpx

    def post():
        with httpx.Client(base_url=url, timeout=timeout) as other:
            answers[name] = other.post(path, json=body)

    thread = threading.Thread(target=post)
    thread.start()
    return thread


def test_a_large_sweeps_first_launches_run_while_its_other_cells_are_being_recorded(tmp_path):
    """A sweep's cells are recorded in chunks (the first launches' first): the first chunk's cells
    are claimed and answered while a later chunk is still being written, and the 202 comes once
    every cell is recorded."""


    app = create_app(Settings(backend="cpu", workers=1, batch_max=2, data_dir=str(tmp_path / "d")))
    with inprocess_server(app) as server, server.client() as c:
        assert c.put(f"/datasets/{DIGEST}", content=BODY, headers=NPZ).status_code == 201
        entered, go, _ = _held_cell_records(app.state.service)
        answer: dict = {}
        poster = _post_aside(server.url, "/sweeps", {"dataset": DIGEST, "seeds": {"start": 0, "count": 10}}, answer)
        try:
            assert entered.wait(60)  # the second chunk is being written
            done = wait_for(lambda: [t for t in c.get("/tasks").json()["tasks"] if t["status"] == "succeeded"], 60,
                            what="a cell of the first chunk answered")
            assert len(c.get("/tasks").json()["tasks"]) == 4  # the first chunk (launches of 2: two launches' worth)
            assert "r" not in answer and done  # no 202 before every cell is recorded
        finally:
            go.set()
            poster.join(60)
        r = answer["r"]
        assert r.status_code == 202, r.text
        doc = completed(c, r.json()["id"])
        assert doc["counts"]["succeeded"] == 10 and len(c.get("/tasks").json()["tasks"]) == 10


def test_a_fault_between_a_sweeps_chunks_loses_no_cell_its_keys_retry_records_the_rest(tmp_path):
    """The ledger fails while a sweep's later chunk of cells is written: a 503, the first chunk's
    cells run; the same Idempotency-Key's retry answers that sweep and records the cells it lacks,
    each once."""
    app = create_app(Settings(backend="cpu", workers=1, batch_max=2, data_dir=str(tmp_path / "d")))
    with inprocess_server(app) as server, server.client() as c:
        assert c.put(f"/datasets/{DIGEST}", content=BODY, headers=NPZ).status_code == 201
        service = app.state.service
        body = {"dataset": DIGEST, "grid": {"epochs": [1, 2]}, "seeds": {"start": 0, "count": 5}}
        refused = _post_through_a_ledger_fault(c, service, body, "chunks")
        assert refused.status_code == 503 and "disk is full" in refused.text
        again = c.post("/sweeps", json=body, headers={"Idempotency-Key": "chunks"})
        assert again.status_code == 202 and again.headers["idempotent-replayed"] == "true"
        doc = completed(c, again.json()["id"])
        assert doc["counts"]["succeeded"] == 10
        tasks = c.get("/tasks").json()["tasks"]
        assert sorted(t["id"] for t in tasks) == sorted(row["task_id"] for row in doc["cells"])  # each cell once


def test_a_sweep_cancelled_while_its_cells_are_being_recorded_runs_none_recorded_after_the_cancel(tmp_path):
    """A cancel that comes between two chunks of a sweep's cells (the sweep is in GET /sweeps
    already) stops the cells recorded after it too: none of them runs, and the sweep ends cancelled."""


    gate = Gate()
    app = create_app(Settings(backend="cpu", workers=1, batch_max=2, data_dir=str(tmp_path / "d")),
                     engines=gated_engines(gate))
    with inprocess_server(app) as server, server.client() as c:
        assert c.put(f"/datasets/{DIGEST}", content=BODY, headers=NPZ).status_code == 201
        entered, go, _ = _held_cell_records(app.state.service)
        gate.hold()
        answer: dict = {}
        poster = _post_aside(server.url, "/sweeps", {"dataset": DIGEST, "seeds": {"start": 0, "count": 10}}, answer)
        try:
            assert entered.wait(60)  # the second chunk is being written
            sweep_id = c.get("/sweeps").json()["sweeps"][0]["id"]
            cancelled = c.post(f"/sweeps/{sweep_id}/cancel")
            assert cancelled.status_code == 200, cancelled.text
        finally:
            go.set()
            poster.join(60)
        gate.release()
        assert answer["r"].status_code == 202
        doc = completed(c, sweep_id)
        assert doc["status"] == "cancelled" and doc["counts"]["cancelled"] == 10, doc["counts"]


def test_a_cancel_whose_mark_is_written_after_the_last_chunk_was_checked_still_stops_that_chunk(tmp_path):
    """The other order of the same race: the cancel reads the sweep before its last chunk is
    recorded, and marks it cancelled only after the recording has looked for a mark and found
    none. The cancel's list of unfinished cells holds the ones not yet recorded (a queued row
    each), and it cancels them after its mark, when they are recorded: it stops that chunk itself."""
    import threading

    gate = Gate()
    app = create_app(Settings(backend="cpu", workers=1, batch_max=2, data_dir=str(tmp_path / "d")),
                     engines=gated_engines(gate))
    with inprocess_server(app) as server, server.client() as c:
        assert c.put(f"/datasets/{DIGEST}", content=BODY, headers=NPZ).status_code == 201
        service = app.state.service
        entered, go, _ = _held_cell_records(service)
        store = service.sweeps.datasets.store
        marking, mark = threading.Event(), threading.Event()
        real_mark = store.cancel_sweep

        def cancel_sweep(sweep_id):
            marking.set()
            assert mark.wait(60), "the test never let the mark through"
            return real_mark(sweep_id)

        store.cancel_sweep = cancel_sweep
        gate.hold()
        answers: dict = {}
        poster = _post_aside(server.url, "/sweeps", {"dataset": DIGEST, "seeds": {"start": 0, "count": 10}}, answers,
                             "sweep")
        try:
            assert entered.wait(60)  # the second chunk is being written
            sweep_id = c.get("/sweeps").json()["sweeps"][0]["id"]
            canceller = _post_aside(server.url, f"/sweeps/{sweep_id}/cancel", None, answers, "cancel")
            assert marking.wait(60)  # the cancel has read the sweep (its later cells not recorded yet)
            go.set()
            poster.join(60)  # every chunk recorded, and no mark seen
            assert answers["sweep"].status_code == 202
        finally:
            go.set()
            mark.set()
            poster.join(60)
            canceller.join(60)
        assert answers["cancel"].status_code == 200, answers["cancel"].text
        gate.release()
        doc = completed(c, sweep_id)
        assert doc["status"] == "cancelled" and doc["counts"]["cancelled"] == 10, doc["counts"]


def test_a_sweep_left_half_recorded_by_a_fault_can_be_cancelled_and_its_unrecorded_cells_never_run(tmp_path):
    """A fault between chunks with no retry leaves cells the ledger never recorded (they read
    queued). A cancel ends the sweep: those cells read cancelled, in its document and in the list,
    and a later replay of its key records none of them."""
    app = create_app(Settings(backend="cpu", workers=1, batch_max=2, data_dir=str(tmp_path / "d")))
    with inprocess_server(app) as server, server.client() as c:
        assert c.put(f"/datasets/{DIGEST}", content=BODY, headers=NPZ).status_code == 201
        service = app.state.service
        body = {"dataset": DIGEST, "seeds": {"start": 0, "count": 10}}
        assert _post_through_a_ledger_fault(c, service, body, "half").status_code == 503
        (row,) = c.get("/sweeps").json()["sweeps"]
        recorded = wait_for(lambda: (d := c.get(f"/sweeps/{row['id']}").json())["counts"]["succeeded"] == 4 and d,
                            60, what="the first chunk's cells")
        assert recorded["status"] == "running" and recorded["counts"]["queued"] == 6  # (never recorded)
        assert c.post(f"/sweeps/{row['id']}/cancel").status_code == 200
        doc = c.get(f"/sweeps/{row['id']}").json()
        assert doc["status"] == "cancelled" and doc["counts"] == {"queued": 0, "running": 0, "succeeded": 4,
                                                                  "failed": 0, "cancelled": 6}
        assert {cell["error"] for cell in doc["cells"] if cell["status"] == "cancelled"} == {
            "cancelled before it was recorded"}
        assert c.get("/sweeps").json()["sweeps"][0]["status"] == "cancelled"
        again = c.post("/sweeps", json=body, headers={"Idempotency-Key": "half"})
        assert again.status_code == 202 and again.json()["id"] == row["id"]
        assert len(c.get("/tasks").json()["tasks"]) == 4 and c.get(f"/sweeps/{row['id']}").json() == doc
