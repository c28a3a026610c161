"""Datasets (issue #31): a task npz stored once under its SHA-256, its scoring labels apart, and
tasks that name it instead of carrying it -- on a real server, with the SQLite store and with the
PostgreSQL one (tests/pg.py), and across a restart."""

from __future__ import annotations

import hashlib
import io
import zipfile

import numpy as np

from app.main import create_app
from app.settings import Settings
from learner.taskio import task_to_npz_bytes

from . import pg
from .gates import Gate, gated_engines
from .helpers import npy_bytes as npy
from .helpers import small_task
from .server import inprocess_server, post_task, wait_for

pg_server, pg_url = pg.pg_server, pg.pg_url  # the fixtures (tests/pg.py)

TASK = small_task(80, 12, seed=21)
BODY = task_to_npz_bytes(TASK)
DIGEST = "sha256:" + hashlib.sha256(BODY).hexdigest()
LABELS = np.random.default_rng(5).integers(0, 10, 12).astype(np.int64)
NPZ = {"Content-Type": "application/octet-stream"}
VARYING = ("id", "request_id", "timing", "dataset", "correct", "total", "accuracy")


def same(doc: dict) -> dict:
    """An answer less what differs from run to run (ids, times, the process's run count)."""
    out = {k: v for k, v in doc.items() if k not in VARYING}
    out["metadata"] = {k: v for k, v in out["metadata"].items() if not k.endswith("_seconds") and k != "run_count"}
    return out


def serve(**settings):
    return inprocess_server(create_app(Settings(backend="cpu", workers=1, **settings)))


def test_put_head_get_list_and_delete(store):
    with serve(**store) as server, server.client() as c:
        assert c.head(f"/datasets/{DIGEST}").status_code == 404
        r = c.put(f"/datasets/{DIGEST}", content=BODY, headers=NPZ)
        assert r.status_code == 201 and r.headers["location"] == f"/datasets/{DIGEST}", r.text
        doc = r.json()
        assert doc["digest"] == DIGEST and doc["bytes"] == len(BODY)
        assert (doc["train_count"], doc["test_count"]) == (80, 12)
        assert doc["input_hashes"] == TASK.input_hashes() and doc["labels"] == {"attached": False, "sha256": None}
        again = c.put(f"/datasets/{DIGEST}", content=BODY, headers=NPZ)
        assert again.status_code == 200 and again.json()["created_at"] == doc["created_at"]  # nothing written twice
        posted = c.post("/datasets", content=BODY, headers=NPZ)
        assert posted.status_code == 200 and posted.json()["digest"] == DIGEST
        assert c.head(f"/datasets/{DIGEST}").status_code == 200
        assert c.get(f"/datasets/{DIGEST}").json() == {**doc, "location": f"/datasets/{DIGEST}", "sweeps": []}
        other = task_to_npz_bytes(small_task(30, 4, seed=22))
        assert c.post("/datasets", content=other, headers=NPZ).status_code == 201
        page = c.get("/datasets", params={"limit": 1}).json()
        assert len(page["datasets"]) == 1 and page["next_cursor"]
        rest = c.get("/datasets", params={"limit": 5, "cursor": page["next_cursor"]}).json()
        assert {d["digest"] for d in page["datasets"] + rest["datasets"]} == {
            DIGEST, "sha256:" + hashlib.sha256(other).hexdigest()} and rest["next_cursor"] is None
        assert c.delete(f"/datasets/{DIGEST}").status_code == 204
        assert c.head(f"/datasets/{DIGEST}").status_code == 404 and c.get(f"/datasets/{DIGEST}").status_code == 404
        assert c.delete(f"/datasets/{DIGEST}").status_code == 404


def test_bad_datasets_are_refused_naming_the_problem(tmp_path):
    with serve(data_dir=str(tmp_path / "d")) as server, server.client() as c:
        wrong = "sha256:" + "0" * 64
        r = c.put(f"/datasets/{wrong}", content=BODY, headers=NPZ)
        assert r.status_code == 422 and "does not match" in r.json()["error"] and DIGEST in r.json()["error"]
        assert c.put("/datasets/md5:abc", content=BODY, headers=NPZ).status_code == 422
        assert c.get("/datasets/sha256:ABC").status_code == 422
        leaky = io.BytesIO()
        with zipfile.ZipFile(io.BytesIO(BODY)) as z, zipfile.ZipFile(leaky, "w") as out:
            for name in z.namelist():
                out.writestr(name, z.read(name))
            out.writestr("test_labels.npy", npy(LABELS))
        r = c.post("/datasets", content=leaky.getvalue(), headers=NPZ)
        assert r.status_code == 422 and "test_labels" in r.json()["error"], r.text  # as for a task
        assert c.post("/datasets", content=b"not a zip", headers=NPZ).status_code == 400
        assert c.post("/datasets", content=BODY, headers={"Content-Type": "text/plain"}).status_code == 415
        assert c.get("/datasets").json()["datasets"] == []  # nothing stored


def test_the_size_cap_refuses_what_does_not_fit(tmp_path):
    with serve(data_dir=str(tmp_path / "d"), dataset_bytes=len(BODY) + 100) as server, server.client() as c:
        assert c.post("/datasets", content=BODY, headers=NPZ).status_code == 201
        r = c.post("/datasets", content=task_to_npz_bytes(small_task(30, 4, seed=1)), headers=NPZ)
        assert r.status_code == 413 and "REV88_DATASET_BYTES" in r.json()["error"]


def test_a_task_on_a_dataset_answers_as_the_upload_and_counts_with_labels(store):
    with serve(**store) as server, server.client() as c:
        assert c.put(f"/datasets/{DIGEST}", content=BODY, headers=NPZ).status_code == 201
        uploaded = post_task(c, BODY, params={"epochs": 2}).json()
        named = c.post("/tasks", params={"dataset": DIGEST, "epochs": 2})
        assert named.status_code == 200, named.text
        doc = named.json()
        assert same(doc) == same(uploaded) and doc["dataset"] == DIGEST and "correct" not in doc
        # labels: checked, stored apart, never returned; the answer then counts
        for bad, says in ((npy(LABELS[:5]), "12 queries"), (npy(LABELS + 10), "0-9"),
                          (npy(LABELS.astype(np.float32)), "integers"), (npy(LABELS.reshape(3, 4)), "shape"),
                          (b"not npy", ".npy")):
            r = c.put(f"/datasets/{DIGEST}/labels", content=bad, headers=NPZ)
            assert r.status_code == 422 and says in r.json()["error"], (says, r.text)
        r = c.put(f"/datasets/{DIGEST}/labels", content=npy(LABELS), headers=NPZ)
        assert r.status_code == 201 and r.json()["labels"] == {"attached": True,
                                                               "sha256": hashlib.sha256(npy(LABELS)).hexdigest()}
        assert c.put(f"/datasets/{DIGEST}/labels", content=npy(LABELS), headers=NPZ).status_code == 200
        assert c.put(f"/datasets/{DIGEST}/labels", content=npy((LABELS + 1) % 10), headers=NPZ).status_code == 409
        scored = c.post("/tasks", params={"dataset": DIGEST, "epochs": 2}).json()
        correct = int((np.array(uploaded["predictions"]) == LABELS).sum())
        assert (scored["correct"], scored["total"]) == (correct, 12) and same(scored) == same(uploaded)
        # asynchronous and with an Idempotency-Key: the same answer, from its record
        accepted = c.post("/tasks", params={"dataset": DIGEST, "epochs": 2},
                          headers={"Prefer": "respond-async", "Idempotency-Key": "ds-1"})
        assert accepted.status_code == 202, accepted.text
        task_id = accepted.json()["id"]
        done = wait_for(lambda: (d := c.get(f"/tasks/{task_id}").json())["status"] == "succeeded" and d, 60)
        assert same(done) == {**same(uploaded), "status": "succeeded"} and done["correct"] == correct
        replay = c.post("/tasks", params={"dataset": DIGEST, "epochs": 2}, headers={"Idempotency-Key": "ds-1"})
        assert replay.json()["id"] == task_id and replay.headers["idempotent-replayed"] == "true"
        # replayed asynchronously too: the same task's 202, said to be a replay
        replay = c.post("/tasks", params={"dataset": DIGEST, "epochs": 2},
                        headers={"Prefer": "respond-async", "Idempotency-Key": "ds-1"})
        assert replay.status_code == 202 and replay.json()["id"] == task_id, replay.text
        assert replay.headers["idempotent-replayed"] == "true"
        assert "idempotent-replayed" not in accepted.headers
        listed = {t["id"]: t for t in c.get("/tasks", params={"limit": 50}).json()["tasks"]}
        assert listed[task_id]["body_sha256"] == DIGEST[7:]  # its input named by the dataset's digest
        # a dataset in use by an unfinished task cannot be deleted; refusals name the problem
        both = c.post("/tasks", params={"dataset": DIGEST}, content=BODY, headers=NPZ)
        assert both.status_code == 422 and both.json()["field"] == "dataset" and "not both" in both.json()["error"]
        chunked = c.post("/tasks", params={"dataset": DIGEST}, content=iter([BODY[:10], BODY[10:]]))
        assert chunked.status_code == 422 and chunked.json()["field"] == "dataset", chunked.text
        # Accept: the npz, as an upload's answer is (the same predictions, named by its headers)
        as_npz = c.post("/tasks", params={"dataset": DIGEST, "epochs": 2}, headers={"Accept": "application/x-npz"})
        assert as_npz.headers["content-type"] == "application/x-npz", as_npz.text
        with np.load(io.BytesIO(as_npz.content)) as z:
            assert z["predictions"].tolist() == uploaded["predictions"]
        assert as_npz.headers["x-predictions-sha256"] == uploaded["predictions_sha256"]
        unknown = c.post("/tasks", params={"dataset": "sha256:" + "1" * 64})
        assert unknown.status_code == 404 and "no dataset" in unknown.json()["error"]
        shown = c.get(f"/datasets/{DIGEST}").text + c.get("/datasets").text + c.get(f"/tasks/{task_id}").text
        assert "labels.npy" not in shown and '"labels":{"attached":true' in shown.replace(" ", "")


def test_datasets_survive_a_restart_and_an_unfinished_task_runs_from_them(tmp_path):
    """A stored dataset is durable; an asynchronous task on it left unfinished by a stop (the
    drain timed out while its run was held) runs at the next start from the stored dataset (the
    task keeps no copy of it), labels and all."""
    settings = Settings(backend="cpu", workers=1, data_dir=str(tmp_path / "d"), drain_timeout_s=1.0)
    gate = Gate()
    app = create_app(settings, engines=gated_engines(gate))
    with inprocess_server(app) as server, server.client() as c:
        assert c.put(f"/datasets/{DIGEST}", content=BODY, headers=NPZ).status_code == 201
        assert c.put(f"/datasets/{DIGEST}/labels", content=npy(LABELS), headers=NPZ).status_code == 201
        expected = post_task(c, BODY).json()
        gate.hold()
        accepted = c.post("/tasks", params={"dataset": DIGEST}, headers={"Prefer": "respond-async"})
        assert accepted.status_code == 202
        task_id = accepted.json()["id"]
        wait_for(lambda: app.state.service.executor.snapshot()["running"] is not None, 30, what="the held run")
        busy = c.delete(f"/datasets/{DIGEST}")
        assert busy.status_code == 409 and task_id in busy.json()["error"]  # in use by an unfinished task
    gate.release()
    with serve(data_dir=str(tmp_path / "d")) as server, server.client() as c:  # a new process's view
        assert c.get(f"/datasets/{DIGEST}").json()["labels"]["attached"] is True
        done = wait_for(lambda: (d := c.get(f"/tasks/{task_id}").json())["status"] == "succeeded" and d, 60,
                        what="the recovered task")
        assert same(done) == {**same(expected), "status": "succeeded"} and done["total"] == 12
        assert done["correct"] == int((np.array(expected["predictions"]) == LABELS).sum())


def test_the_client_stores_a_dataset_once_and_trains_on_it(tmp_path):
    import httpx

    from rev88 import Client, Dataset

    sent: list[tuple[str, str]] = []

    class Recording(httpx.HTTPTransport):
        def handle_request(self, request):
            sent.append((request.method, request.url.path))
            return super().handle_request(request)

    path = tmp_path / "task.npz"
    path.write_bytes(BODY)
    with serve(data_dir=str(tmp_path / "d")) as server, Client(server.url, transport=Recording()) as client:
        dataset = client.put_dataset(path)
        assert dataset == Dataset(DIGEST) and client.put_dataset(BODY) == dataset
        assert sent == [("HEAD", f"/datasets/{DIGEST}"), ("PUT", f"/datasets/{DIGEST}"),
                        ("HEAD", f"/datasets/{DIGEST}")]  # the second time: asked, not sent
        assert client.put_labels(dataset, LABELS)["labels"]["attached"] is True
        answer = client.run(dataset, epochs=2)
        upload = client.run(path, epochs=2)
        assert answer.predictions_sha256 == upload.predictions_sha256 and answer.document["dataset"] == DIGEST
        assert answer.document["correct"] == int((upload.predictions == LABELS).sum())
        task_id = client.submit(dataset, epochs=2)
        assert client.wait(task_id).predictions_sha256 == upload.predictions_sha256
        assert client.dataset(dataset)["test_count"] == 12


def test_rev88_dataset_put_and_submit_by_digest(tmp_path):
    import json as _json
    import subprocess
    import sys

    path, labels = tmp_path / "task.npz", tmp_path / "labels.npy"
    path.write_bytes(BODY)
    np.save(labels, LABELS)
    with serve(data_dir=str(tmp_path / "d")) as server:
        run = [sys.executable, "-m", "rev88"]
        put = subprocess.run([*run, "dataset", "put", str(path), "--labels", str(labels), "--url", server.url],
                             capture_output=True, text=True, timeout=120)
        assert put.returncode == 0 and put.stdout.strip() == DIGEST, put.stderr
        out = tmp_path / "answer.json"
        sub = subprocess.run([*run, "submit", DIGEST, "--url", server.url, "--output", str(out), "--no-progress"],
                             capture_output=True, text=True, timeout=120)
        assert sub.returncode == 0, sub.stderr
        doc = _json.loads(out.read_text())
        assert doc["dataset"] == DIGEST and doc["total"] == 12
        show = subprocess.run([*run, "dataset", "show", DIGEST, "--url", server.url], capture_output=True, text=True,
                              timeout=60)
        assert _json.loads(show.stdout)["labels"]["attached"] is True
        bad = subprocess.run([*run, "dataset", "show", "sha256:nope", "--url", server.url], capture_output=True,
                             text=True, timeout=60)
        assert bad.returncode == 2 and "sha256" in bad.stderr
