"""Graded evaluations (issue #32): the published draws graded on a real server, each count checked
against an independent scoring of the same predictions (the draw built here, the labels held
here), on both stores; the default config on ``cpu`` gives 98,208 / 110,000 with the published
per-draw counts; the labels reach no answer; bad requests are refused naming the problem."""

from __future__ import annotations

import io
import json
import sqlite3
import statistics
import time
from pathlib import Path

import numpy as np
import pytest

from app.http.middleware import is_open, prefers_html
from app.main import create_app
from app.settings import Settings
from app.tasks.evaluations import comparison_label, draw_set
from learner.config import Config
from learner.evaluate import InProcessRunner, dataset_seed, totals, wilson_interval
from learner.evaluate import evaluate as evaluate_in_process
from learner.hashing import array_sha256
from learner.taskio import make_task

from . import pg
from .conftest import MNIST_DIR
from .gates import Gate, gated_engines
from .server import inprocess_server, wait_for

pg_server, pg_url = pg.pg_server, pg.pg_url  # the fixtures (tests/pg.py)

# rev88 evaluate --draws 0-10 --backend cpu (docs/learner.md): draw 0's 8,887 is the published figure
PUBLISHED_COUNTS = [8887, 8916, 8947, 8904, 8992, 8979, 8911, 8922, 8950, 8877, 8923]
FINISHED = ("completed", "failed", "cancelled")


def serve(engines=None, **settings):
    app = create_app(Settings(backend="cpu", workers=1, **settings), engines=engines)
    return inprocess_server(app)


def finished(c, evaluation_id: str, timeout: float = 600) -> dict:
    return wait_for(lambda: (d := c.get(f"/evaluations/{evaluation_id}").json())["status"] in FINISHED and d,
                    timeout, interval=0.2, what=f"evaluation {evaluation_id}")


def independent_count(c, row: dict) -> tuple[int, np.ndarray]:
    """The draw's predictions as the server serves them, scored here against labels built here."""
    r = c.get(f"/tasks/{row['task_id']}/predictions.npy")
    assert r.status_code == 200
    preds = np.load(io.BytesIO(r.content))
    assert array_sha256(preds) == row["predictions_sha256"] == r.headers["x-predictions-sha256"]
    task, labels = make_task(MNIST_DIR, dataset_seed(row["draw"]))
    assert row["input_hashes"] == {name: array_sha256(a) for name, a in task.as_dict().items()}
    assert row["query_labels_sha256"] == array_sha256(labels)
    return int((preds == labels).sum()), labels


def assert_no_labels_in(texts: list[bytes], labels: list[np.ndarray]) -> None:
    """Neither the labels' .npy nor the labels as a JSON list appear in any answer."""
    for lab in labels:
        npy = io.BytesIO()
        np.save(npy, lab)
        as_list = json.dumps(lab.tolist()).encode()[1:-1]  # "7, 2, 1, ..." (any answer's list of them)
        compact = json.dumps(lab.tolist(), separators=(",", ":")).encode()[1:-1]
        for text in texts:
            assert npy.getvalue()[128:] not in text and as_list not in text and compact not in text


def test_the_default_config_on_cpu_gives_98208_with_the_published_counts(tmp_path):
    with serve(data_dir=str(tmp_path / "d")) as server, server.client() as c:
        r = c.post("/evaluations", json={"draws": "0-10", "name": "default"})
        assert r.status_code == 202, r.text
        evaluation_id = r.json()["id"]
        assert r.headers["location"] == f"/evaluations/{evaluation_id}" and r.json()["draws"] == list(range(11))
        doc = finished(c, evaluation_id)
        assert doc["status"] == "completed" and doc["counts"]["succeeded"] == 11
        assert [row["correct"] for row in doc["draws"]] == PUBLISHED_COUNTS
        t = doc["totals"]
        assert (t["correct"], t["total"], t["correct_over_total"]) == (98208, 110000, "98,208 / 110,000")
        assert t["mean_error_exact"] == "67/625" and f"{t['sd_accuracy_pp']:.2f}" == "0.36"
        assert {b["band_percent"]: b["met"] for b in t["error_bands"]} == {2: False, 3: False, 5: False, 8: False,
                                                                            12: True}
        assert t == totals(PUBLISHED_COUNTS, [10000] * 11)  # learner.evaluate's own figures
        assert doc["draws"][0]["predictions_sha256"] == \
            "37724115cb2d3242eb4a4f76d3a879ac92d729939320e5f6f2bd046bd631f200"  # the reference record's
        assert doc["config"] == Config().as_dict() and doc["config_changes"] == {}
        assert doc["backend"] == {"requested": "cpu", "used": ["cpu"]} and doc["versions"]["rev88"]
        labels, texts = [], [json.dumps(doc).encode()]
        for row in doc["draws"]:
            count, lab = independent_count(c, row)
            assert count == row["correct"] and row["accuracy"] == count / 10000
            assert row["dataset_seed"] == 2026091400 + row["draw"] and row["run_ms"] > 0
            labels.append(lab)
            texts += [c.get(f"/tasks/{row['task_id']}").content, c.get(f"/datasets/{row['dataset']}").content]
        assert doc["time"]["ms_per_task"] == pytest.approx(statistics.mean(r["run_ms"] for r in doc["draws"]))
        texts += [c.get("/evaluations").content, c.get(f"/evaluations/{evaluation_id}/accuracy.svg").content,
                  c.get("/tasks").content, c.get("/datasets").content]
        assert_no_labels_in(texts, labels)
        board = c.get("/evaluations", params={"sort": "accuracy"}).json()["evaluations"]
        assert [(e["id"], e["correct"], e["name"]) for e in board] == [(evaluation_id, 98208, "default")]
        # a second evaluation finds the draws stored (content-addressed: nothing stored twice)
        stored = c.get("/datasets").json()["datasets"]
        assert len(stored) == 11 and all(d["labels"]["attached"] for d in stored)


def test_counts_equal_an_independent_scoring_and_rev88_evaluate_in_process(store, tmp_path):
    """A config other than the default, on draws other than the first, on each store: every
    count equals this side's scoring of the served predictions, and the per-draw figures and
    totals equal learner.evaluate's in-process report for the same draws, config and backend."""
    config = {"epochs": 1, "learning_rate": 0.05, "seed": 5, "batch_size": 64}
    draws = [3, 7]
    with serve(**store) as server, server.client() as c:
        r = c.post("/evaluations", json={"draws": draws, "config": config, "name": "lr 0.05"})
        assert r.status_code == 202, r.text
        doc = finished(c, r.json()["id"])
        assert doc["status"] == "completed" and [row["draw"] for row in doc["draws"]] == draws
        for row in doc["draws"]:
            assert independent_count(c, row)[0] == row["correct"]
        assert doc["config_changes"] == config
        # a cancel of the finished evaluation is a 409 and changes nothing
        late = c.post(f"/evaluations/{r.json()['id']}/cancel")
        assert late.status_code == 409 and "already finished (completed)" in late.json()["error"], late.text
        kept = c.get(f"/evaluations/{r.json()['id']}").json()
        assert kept["status"] == "completed" and kept["cancelled_at"] is None and kept["draws"] == doc["draws"]
        again = c.post("/evaluations", json={"draws": draws, "config": config, "name": "lr 0.05"},
                       headers={"Idempotency-Key": "same"})
        replay = c.post("/evaluations", json={"draws": draws, "config": config, "name": "lr 0.05"},
                        headers={"Idempotency-Key": "same"})
        assert replay.json()["id"] == again.json()["id"] and replay.headers["idempotent-replayed"] == "true"
        second = finished(c, again.json()["id"])
        assert [r["predictions_sha256"] for r in second["draws"]] == [r["predictions_sha256"] for r in doc["draws"]]
        board = c.get("/evaluations", params={"sort": "accuracy", "limit": 1}).json()
        assert board["evaluations"][0]["correct"] == doc["totals"]["correct"] and board["next_cursor"]
        rest = c.get("/evaluations", params={"sort": "accuracy", "cursor": board["next_cursor"]}).json()
        assert {e["id"] for e in board["evaluations"] + rest["evaluations"]} == {doc["id"], second["id"]}
    local = evaluate_in_process(MNIST_DIR, draws, InProcessRunner(Config(**config), "cpu"), tmp_path / "local")
    keys = ("draw", "dataset_seed", "correct", "total", "accuracy", "input_hashes", "query_labels_sha256",
            "predictions_sha256")
    assert [{k: row[k] for k in keys} for row in doc["draws"]] == [{k: rec[k] for k in keys} for rec in local]
    assert doc["totals"] == totals([rec["correct"] for rec in local], [rec["total"] for rec in local])


def test_an_evaluation_over_seeds_runs_each_draw_at_each_seed_as_its_own_evaluation_would(tmp_path):
    """draws x seeds in one evaluation (issue #46's "11 draws with 12 seeds", small here): one row
    per draw and seed, draw-major, each counted right and hashed as a one-seed evaluation at that
    seed hashes it; the totals pool each draw's seeds, by_seed is each seed's own evaluation, the
    comparison names the seeds; the client sends seeds; the chart pools the seeds per draw."""
    config = {"epochs": 1, "batch_size": 64}
    with serve(data_dir=str(tmp_path / "d")) as server, server.client() as c:
        r = c.post("/evaluations", json={"draws": [3, 7], "seeds": {"start": 5, "count": 2}, "config": config,
                                         "backend": "cpu-fast"})
        assert r.status_code == 202, r.text
        doc = finished(c, r.json()["id"])
        assert doc["status"] == "completed", doc
        assert [(row["draw"], row["seed"]) for row in doc["draws"]] == [(3, 5), (3, 6), (7, 5), (7, 6)]
        assert doc["counts"]["succeeded"] == 4 and doc["definition"]["seeds"] == [5, 6]
        for row in doc["draws"]:
            assert independent_count(c, row)[0] == row["correct"]
        singles = {}
        for seed in (5, 6):
            one = c.post("/evaluations", json={"draws": [3, 7], "config": {**config, "seed": seed},
                                               "backend": "cpu-fast"}).json()["id"]
            singles[seed] = finished(c, one)
            assert [row["predictions_sha256"] for row in singles[seed]["draws"]] == [
                row["predictions_sha256"] for row in doc["draws"] if row["seed"] == seed]
        by_draw = {k: [row for row in doc["draws"] if row["draw"] == k] for k in (3, 7)}
        assert doc["totals"] == totals([sum(r["correct"] for r in rows) for rows in by_draw.values()],
                                       [sum(r["total"] for r in rows) for rows in by_draw.values()])
        assert doc["totals"]["draws"] == 2 and doc["seeds"]["runs"] == 4
        assert [(e["seed"], e["correct"], e["mean_accuracy"]) for e in doc["seeds"]["by_seed"]] == [
            (s, singles[s]["totals"]["correct"], singles[s]["totals"]["mean_accuracy"]) for s in (5, 6)]
        means = [singles[s]["totals"]["mean_accuracy"] for s in (5, 6)]
        assert doc["seeds"]["sd_across_seeds_pp"] == pytest.approx(statistics.stdev(means) * 100, abs=1e-12)
        assert doc["comparison"].endswith(" · draws 3,7 · seeds 5-6")
        assert doc["comparison"] != singles[5]["comparison"]
        rows = {row["id"]: row for row in c.get("/evaluations").json()["evaluations"]}
        assert rows[doc["id"]]["seed_set"] == "5-6" and rows[singles[5]["id"]]["seed_set"] is None
        chart = c.get(f"/evaluations/{doc['id']}/accuracy.svg")
        assert chart.status_code == 200 and chart.text.count('class="draw"') == 2  # (a point per draw)
        from rev88 import Client

        with Client(server.url) as client:
            got = client.evaluate([3], seeds=[6], backend="cpu-fast", **config)
        assert [(row["draw"], row["seed"], row["predictions_sha256"]) for row in got.document["draws"]] == [
            (3, 6, by_draw[3][1]["predictions_sha256"])]


def test_bad_requests_are_refused_naming_the_problem_and_record_nothing(tmp_path):
    from learner.budget import estimate

    max_work = 2 * estimate(10000, 10000, Config()).work  # epochs 1000 is over it: the budget applies to each draw
    cases = [
        ({"draws": "0-11"}, "draws", "11 outside the published draws 0..10"),
        ({"draws": [0, 0]}, "draws", "draw 0 more than once"),
        ({"draws": [-1]}, "draws", "not a draw number (0..10)"),
        ({"draws": "5-2"}, "draws", "runs backwards"),
        ({"draws": "x"}, "draws", "'x' is not a draw number"),
        ({"draws": []}, "draws", "non-empty list"),
        ({"draws": ""}, "draws", "empty"),
        ({"draws": 3}, "draws", "draws"),
        ({"draws": [True]}, "draws", "draws"),
        ({"config": {"depht": 2}}, "depht", "depht"),
        ({"config": {"learning_rate": -1}}, "learning_rate", "learning_rate"),
        ({"config": {"epochs": 10**9}}, "epochs", "epochs must be in [1, 1000]"),
        ({"config": {"epochs": 1000}}, None, "REV88_MAX_TASK_WORK"),
        ({"measure": "power"}, "measure", "measure"),
        ({"protocol": {"trials": 1}}, "protocol", "measure"),
        ({"measure": "energy", "protocol": {"trails": 1}}, "protocol", "trails"),
        ({"measure": "energy", "protocol": {"trials": 99}}, None, "trials must be in [1, 10]"),
        ({"name": "x" * 201}, "name", "name"),
        ({"drawz": "0"}, "drawz", "drawz"),
        ({"backend": "tpu"}, None, "tpu"),
        ({"seeds": []}, "seeds", "non-empty list"),
        ({"seeds": [1, 1]}, "seeds", "more than once"),
        ({"seeds": {"start": -1, "count": 2}}, "seeds", "start >= 0"),
        ({"seeds": {"start": 0}}, "seeds", "seeds"),
        ({"seeds": "0-3"}, "seeds", "seeds"),
        ({"seeds": [0, 1], "config": {"seed": 3}}, "seeds", "not both"),
        ({"draws": "0-10", "seeds": {"start": 0, "count": 100}}, "seeds", "REV88_SWEEP_MAX_CELLS"),
    ]
    with serve(data_dir=str(tmp_path / "d"), max_task_work=max_work, sweep_max_cells=1000) as server, \
            server.client() as c:
        for body, field, says in cases:
            r = c.post("/evaluations", json=body)
            assert r.status_code == 422, (body, r.status_code, r.text)
            error = r.json()
            assert says in error["error"] or says in json.dumps(error.get("details")), (body, error)
            if field is not None:
                named = error.get("field") == field or field in json.dumps(error.get("details"))
                assert named, (body, error)
        assert c.post("/evaluations", content=b"{", headers={"Content-Type": "application/json"}).status_code == 422
        r = c.post("/evaluations", json={"draws": "0"}, headers={"Idempotency-Key": "has space"})
        assert r.status_code == 422 and "Idempotency-Key" in r.json()["error"]
        for params, words in (({"sort": "speed"}, "sort"), ({"cursor": "bm9wZQ"}, "cursor"),
                              ({"limit": 0}, "limit")):
            r = c.get("/evaluations", params=params)
            assert r.status_code == 422 and words in r.text, (params, r.text)
        assert c.get("/evaluations/ev-nope").status_code == 404
        assert "no evaluation" in c.get("/evaluations/ev-nope").json()["error"]
        assert c.post("/evaluations/ev-nope/cancel").status_code == 404
        assert c.get("/evaluations").json() == {"evaluations": [], "next_cursor": None}
        assert c.get("/tasks").json()["tasks"] == []


def test_an_idempotency_key_replays_and_cancel_stops_the_rest(tmp_path):
    gate = Gate()
    with serve(engines=gated_engines(gate), data_dir=str(tmp_path / "d")) as server, server.client() as c:
        gate.hold()
        body = {"draws": "0-2", "config": {"epochs": 1}}
        first = c.post("/evaluations", json=body, headers={"Idempotency-Key": "ev-1"})
        again = c.post("/evaluations", json={**body, "draws": [0, 1, 2]}, headers={"Idempotency-Key": "ev-1"})
        assert first.status_code == again.status_code == 202, again.text
        assert again.json()["id"] == first.json()["id"] and again.headers["idempotent-replayed"] == "true"
        other = c.post("/evaluations", json={**body, "draws": "0-1"}, headers={"Idempotency-Key": "ev-1"})
        assert other.status_code == 409 and first.json()["id"] in other.json()["error"]
        evaluation_id = first.json()["id"]
        wait_for(lambda: c.get(f"/evaluations/{evaluation_id}").json()["counts"]["running"] == 1, 60,
                 what="a running draw")
        assert c.get(f"/evaluations/{evaluation_id}/accuracy.svg").status_code == 409  # no counts yet
        c.post(f"/evaluations/{evaluation_id}/cancel")
        gate.release()
        doc = finished(c, evaluation_id)
        assert doc["status"] == "cancelled" and doc["cancelled_at"] and doc["totals"] is None
        assert doc["counts"]["cancelled"] >= 2
        assert len(c.get("/tasks").json()["tasks"]) == 3  # the replay made no second set of draws
        (row,) = c.get("/evaluations").json()["evaluations"]
        assert row["status"] == "cancelled" and row["correct"] is None


def test_the_leaderboard_sorts_pages_and_the_client_and_cli_grade_on_the_server(tmp_path):
    from rev88 import Client
    from rev88.cli import main

    with serve(data_dir=str(tmp_path / "d")) as server, Client(server.url) as client:
        seen = []
        fast = client.evaluate("4", name="one epoch", epochs=1, progress=seen.append)
        slow = client.evaluate([4], name="two epochs")
        assert fast.status == slow.status == "completed" and seen[-1].finished
        assert fast.totals["correct"] != slow.totals["correct"]
        by_accuracy = [e["id"] for e in client.leaderboard("accuracy")["evaluations"]]
        best = max((fast, slow), key=lambda e: e.totals["mean_accuracy"])
        assert by_accuracy[0] == best.id and set(by_accuracy) == {fast.id, slow.id}
        by_time = client.leaderboard("time")["evaluations"]
        assert [e["ms_per_task"] for e in by_time] == sorted(e["ms_per_task"] for e in by_time)
        page = client.leaderboard("accuracy", limit=1)
        assert [e["id"] for e in page["evaluations"]] == by_accuracy[:1] and page["next_cursor"]
        rest = client.leaderboard("accuracy", limit=1, cursor=page["next_cursor"])
        assert [e["id"] for e in rest["evaluations"]] == by_accuracy[1:] and rest["next_cursor"] is None
        assert client.evaluation(fast.id).document == fast.document

        tasks_before = len(client.page(limit=500).tasks)
        out = tmp_path / "report"
        assert main(["evaluate", "--draws", "4", "--config", _config_file(tmp_path, {"epochs": 1}), "--backend",
                     "cpu", "--url", server.url, "--mnist-dir", str(MNIST_DIR), "--output", str(out)]) == 0
        summary = json.loads((out / "summary.json").read_text())
        assert summary["evaluation"]["id"] and summary["mode"] == "service"
        (d,) = summary["draws"]
        assert (d["correct"], d["predictions_sha256"]) == (fast.draws[0]["correct"], fast.draws[0]["predictions_sha256"])
        assert np.array_equal(np.load(out / "predictions" / "draw-04.npy"),
                              client.predictions(fast.draws[0]["task_id"]))
        assert (out / "accuracy.svg").exists() and "| 4 | 2026091404 |" in (out / "README.md").read_text()
        after = client.page(limit=500).tasks
        assert len(after) == tasks_before + 1  # one draw's task, from the evaluation (no upload)
        assert len(client.leaderboard("created")["evaluations"]) == 3


def test_rev88_evaluate_uploads_each_draw_where_the_service_has_no_evaluations():
    """An older service (no /evaluations: a 404 to the POST) is not an error: ServerEvaluation
    says so (None) and rev88 evaluate uploads each draw as before."""
    import httpx

    from rev88.cli.evaluate import ServerEvaluation

    asked = []

    def answer(request: httpx.Request) -> httpx.Response:
        asked.append((request.method, request.url.path))
        return httpx.Response(404, json={"detail": "Not Found"})

    runner = ServerEvaluation("http://old.example", Config(), None, transport=httpx.MockTransport(answer))
    assert runner.run(MNIST_DIR, [0], Path("/nonexistent"), None) is None
    assert asked == [("POST", "/evaluations")]


def _config_file(tmp_path: Path, config: dict) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_an_energy_evaluation_measures_each_draw_and_says_why_it_is_not_valid_here(tmp_path):
    """measure=energy: each draw also gets a measurement task; on this CPU machine there is no
    meter, so every draw's energy is unmeasured, the evaluation's energy not valid, and the
    leaderboard shows no mJ figure (what a GPU gives is not verified here)."""
    protocol = {"trials": 1, "target_seconds": 0.1, "settle_seconds": 0, "idle_seconds": 0,
                "reference_seconds": 0.1, "sham_seconds": 0.1}
    with serve(data_dir=str(tmp_path / "d")) as server, server.client() as c:
        r = c.post("/evaluations", json={"draws": "6", "config": {"epochs": 1}, "measure": "energy",
                                         "protocol": protocol})
        assert r.status_code == 202, r.text
        doc = finished(c, r.json()["id"])
        assert doc["status"] == "completed", doc
        (row,) = doc["draws"]
        energy = row["energy"]
        assert energy["status"] == "succeeded" and energy["predictions_match_task"] is True
        assert energy["valid"] is None and energy["mj_per_task"] is None and energy["ms_per_task"] > 0
        assert doc["energy"]["valid"] is False and doc["energy"]["mj_per_task"] is None
        (board,) = c.get("/evaluations", params={"sort": "energy"}).json()["evaluations"]
        assert board["mj_per_task"] is None and board["measure"] == "energy"
        assert doc["definition"]["protocol"]["trials"] == 1


def test_a_draws_energy_is_valid_only_when_its_gates_pass_and_its_predictions_hash_as_the_tasks():
    """The rule a GPU's measurement is graded by (app/tasks/evaluation_report.py), on plain records:
    every gate passed is not enough -- the measured run's predictions must hash as the draw's own
    task's did, or the joules are of another computation."""
    from types import SimpleNamespace

    from app.tasks.evaluation_report import energy_of

    def measured(valid):
        doc = {"valid": valid, "predictions_sha256": "a" * 64, "failed_gates": [] if valid else ["sham"],
               "figures": {"headline": {"net_mj_per_task": {"mean": 1.25, "sample_sd": 0.05}}},
               "timing": {"wall_ms_per_task": {"mean": 0.5}}}
        return SimpleNamespace(status="succeeded", answer={"measurement": doc, "energy_reason": None}, error=None)

    same = energy_of(measured(True), "a" * 64)
    assert same["valid"] is True and same["predictions_match_task"] is True and same["mj_per_task"] == 1.25
    other = energy_of(measured(True), "b" * 64)
    assert other["valid"] is False and other["predictions_match_task"] is False
    assert energy_of(measured(False), "a" * 64)["valid"] is False
    assert energy_of(measured(None), "a" * 64)["valid"] is None  # no meter: not measured, not invalid
    queued = energy_of(None, "a" * 64)
    assert queued == {"status": "queued", "valid": None, "mj_per_task": None}


def test_the_list_carries_each_evaluations_status_and_counts_read_without_answers(store):
    """GET /evaluations while draws wait: a row's status (queued, running) and counts equal its
    document's, on both ledgers; the list reads its ungraded rows' tasks in one status-only
    query (no answers) and grades an evaluation only once all its draws have finished."""
    gate = Gate()
    app = create_app(Settings(backend="cpu-fast", workers=1, **store), engines=gated_engines(gate))
    ledger = app.state.service.ledger
    asked: list[str] = []
    for name in ("statuses", "get_many"):
        real = getattr(ledger, name)
        setattr(ledger, name, lambda ids, *more, real=real, name=name: (asked.append(name), real(ids, *more))[1])
    with inprocess_server(app) as server, server.client() as c:
        gate.hold()
        try:
            first = c.post("/evaluations", json={"draws": "0-1", "config": {"epochs": 1}}).json()["id"]
            wait_for(lambda: c.get(f"/evaluations/{first}").json()["counts"]["running"] == 1, 60, what="a running draw")
            second = c.post("/evaluations", json={"draws": "2", "config": {"epochs": 1}}).json()["id"]
            asked.clear()
            rows = {r["id"]: r for r in c.get("/evaluations").json()["evaluations"]}
            assert asked == ["statuses"]  # one query for every ungraded row, no answer read
            assert rows[first]["status"] == "running" and rows[second]["status"] == "queued"
            assert rows[first]["counts"] == {"queued": 1, "running": 1, "succeeded": 0, "failed": 0, "cancelled": 0}
            for evaluation_id in (first, second):
                doc = c.get(f"/evaluations/{evaluation_id}").json()
                assert (rows[evaluation_id]["status"], rows[evaluation_id]["counts"]) == (doc["status"], doc["counts"])
        finally:
            gate.release()
        docs = [finished(c, i) for i in (first, second)]
        rows = {r["id"]: r for r in c.get("/evaluations").json()["evaluations"]}
        for doc in docs:
            assert doc["status"] == "completed"
            assert (rows[doc["id"]]["status"], rows[doc["id"]]["counts"]) == ("completed", doc["counts"])
        assert rows[first]["counts"]["succeeded"] == 2


def test_evaluations_over_other_draws_are_compared_apart(tmp_path):
    """Three evaluations over two draw sets, one device: the two over draws 0-1 share a
    comparison label, the one over draw 2 has its own (the leaderboard ranks within a label);
    a result recorded before the draws were part of the label reads with them."""
    with serve(data_dir=str(tmp_path / "d")) as server, server.client() as c:
        bodies = [{"draws": "0-1", "config": {"epochs": 1}}, {"draws": [0, 1], "config": {"epochs": 1, "depth": 1}},
                  {"draws": "2", "config": {"epochs": 1}}]
        ids = [c.post("/evaluations", json={**body, "backend": "cpu-fast"}).json()["id"] for body in bodies]
        docs = [finished(c, i) for i in ids]
        assert [d["status"] for d in docs] == ["completed"] * 3
        rows = {r["id"]: r for r in c.get("/evaluations", params={"sort": "accuracy"}).json()["evaluations"]}
        labels = [rows[i]["comparison"] for i in ids]
        assert labels == [d["comparison"] for d in docs]
        assert labels[0] == labels[1] != labels[2]
        assert labels[0].endswith(" · draws 0-1") and labels[2].endswith(" · draws 2") and labels[0].startswith("cpu · ")
        assert [rows[i]["draw_set"] for i in ids] == ["0-1", "0-1", "2"]
        other = insert_graded(tmp_path / "d", "ev-h200", 9990, 0.5)
        (row,) = [r for r in c.get("/evaluations").json()["evaluations"] if r["id"] == "ev-h200"]
        assert row["comparison"] == other == "NVIDIA H200 · rev88 0.1.0 · torch 2.13.0 · CUDA 13.0 · draws 0"


def test_an_evaluation_is_graded_after_a_restart(tmp_path):
    """Its draws are asynchronous tasks in the ledger: a restart runs them again and grades."""
    gate = Gate()
    data = str(tmp_path / "d")
    with serve(engines=gated_engines(gate), data_dir=data, drain_timeout_s=1.0) as server, server.client() as c:
        gate.hold()
        evaluation_id = c.post("/evaluations", json={"draws": "8", "config": {"epochs": 1}}).json()["id"]
        wait_for(lambda: c.get(f"/evaluations/{evaluation_id}").json()["counts"]["running"] == 1, 60, what="running")
    gate.release()
    with serve(data_dir=data) as server, server.client() as c:
        doc = finished(c, evaluation_id)
        assert doc["status"] == "completed"
        assert independent_count(c, doc["draws"][0])[0] == doc["draws"][0]["correct"]


def test_the_report_and_leaderboard_urls_are_pages_without_data(tmp_path):
    for path in ("/evaluations/ev-1/report", "/ui/evaluations", "/ui/evaluations/ev-1"):
        assert is_open(path), path
    assert is_open("/evaluations/ev-1", "GET", "text/html,application/xhtml+xml,*/*;q=0.8")
    for accept in (None, "application/json", "*/*", "application/json, text/html;q=0.5"):
        assert not is_open("/evaluations/ev-1", "GET", accept), accept
    assert not is_open("/evaluations/ev-1", "POST", "text/html") and not is_open("/evaluations", "GET", "text/html")
    assert not is_open("/evaluations/ev-1/accuracy.svg") and not is_open("/evaluations/../tasks/report")
    assert prefers_html("text/html") and not prefers_html("text/html;q=0, application/json")
    with serve(data_dir=str(tmp_path / "d"), api_key="k") as server, server.client() as c:
        r = c.get("/evaluations/ev-1", headers={"Accept": "text/html"}, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/evaluations/ev-1/report"
        page = c.get("/evaluations/ev-1/report")
        assert page.status_code == 200 and "evaluations.js" in page.text
        assert c.get("/evaluations/ev-1").status_code == 401 and c.get("/evaluations").status_code == 401


def test_rows_of_other_devices_versions_or_draws_are_labelled_apart():
    eleven = list(range(11))
    cpu = comparison_label("cpu", {"rev88": "0.1.0", "torch": "2.13.0+cpu", "cuda": None}, eleven)
    gpu = comparison_label("cuda:0", {"rev88": "0.1.0", "torch": "2.13.0", "cuda": "13.0", "gpu_name": "NVIDIA H200"},
                           eleven)
    newer = comparison_label("cpu", {"rev88": "0.2.0", "torch": "2.13.0+cpu", "cuda": None}, eleven)
    three = comparison_label("cpu", {"rev88": "0.1.0", "torch": "2.13.0+cpu", "cuda": None}, [0, 1, 2])
    assert len({cpu, gpu, newer, three}) == 4 and "NVIDIA H200" in gpu and "CUDA 13.0" in gpu and "0.2.0" in newer
    assert cpu.endswith("draws 0-10") and three.endswith("draws 0-2")
    assert [draw_set(d) for d in (eleven, [4], [0, 3, 4, 5], [7, 2, 3])] == ["0-10", "4", "0,3-5", "2-3,7"]
    lo, hi = wilson_interval(98208, 110000)
    assert lo < 98208 / 110000 < hi and 0.8909 < lo and hi < 0.8947


H200 = {"gpu_name": "NVIDIA H200", "rev88": "0.1.0", "torch": "2.13.0", "cuda": "13.0"}


def insert_graded(data_dir: Path, evaluation_id: str, correct: int, ms: float) -> str:
    """A graded evaluation of draw 0 on an H200, written into the server's own store (the
    leaderboard's grouping is what is tested; no such device is here to produce one), its result
    as one recorded before the draws were part of the comparison. Returns the label it is shown
    under (made from its device, versions and draws when read)."""
    result = {"draws": [], "totals": totals([correct], [10000]), "time": {"ms_per_task": ms}, "energy": None,
              "device": "cuda:0", "versions": H200, "comparison": "NVIDIA H200 · rev88 0.1.0 · torch 2.13.0 · CUDA 13.0",
              "backends_used": ["cuda"]}
    with sqlite3.connect(data_dir / "datasets.sqlite3") as conn:
        conn.execute("INSERT INTO evaluations (id, created_at, name, definition, cells, status, result, finished_at,"
                     " mean_accuracy, ms_per_task) VALUES (?, ?, ?, ?, '[]', 'completed', ?, ?, ?, ?)",
                     (evaluation_id, time.time(), "elsewhere", json.dumps({"draws": [0], "config": Config().as_dict(),
                                                                          "backend": "cuda", "measure": None}),
                      json.dumps(result), time.time(), correct / 10000, ms))
    return comparison_label("cuda:0", H200, [0])


def test_an_evaluation_cancelled_while_its_cells_are_being_recorded_runs_none_recorded_after_the_cancel(tmp_path):
    """As a sweep's (tests/test_sweeps.py): a cancel between two chunks of the cells stops the
    cells recorded after it too."""
    from .test_sweeps import _held_cell_records, _post_aside

    gate = Gate()
    app = create_app(Settings(backend="cpu", workers=1, data_dir=str(tmp_path / "d")), engines=gated_engines(gate))
    with inprocess_server(app) as server, server.client() as c:
        entered, go, _ = _held_cell_records(app.state.service)
        gate.hold()
        answer: dict = {}
        poster = _post_aside(server.url, "/evaluations", {"draws": "0-2", "seeds": {"start": 0, "count": 2},
                                                          "config": {"epochs": 1}}, answer, timeout=300)
        try:
            assert entered.wait(120)  # the second chunk is being written (launches of one: chunks of 2, 4)
            evaluation_id = c.get("/evaluations").json()["evaluations"][0]["id"]
            cancelled = c.post(f"/evaluations/{evaluation_id}/cancel")
            assert cancelled.status_code == 200, cancelled.text
        finally:
            go.set()
            poster.join(60)
        gate.release()
        assert answer["r"].status_code == 202
        doc = finished(c, evaluation_id)
        assert doc["status"] == "cancelled" and doc["counts"]["cancelled"] == 6, doc["counts"]


def test_an_evaluation_left_half_recorded_by_a_fault_can_be_cancelled_and_its_unrecorded_draws_never_run(tmp_path):
    """As a sweep's (tests/test_sweeps.py): after a fault between chunks, a cancel ends the
    evaluation, the draws never recorded read cancelled, and its key's replay records none."""
    from app.ledger import LedgerUnavailable

    from .test_sweeps import _held_cell_records

    app = create_app(Settings(backend="cpu", workers=1, data_dir=str(tmp_path / "d")))
    with inprocess_server(app) as server, server.client() as c:
        service = app.state.service
        _, go, real = _held_cell_records(service, fail=LedgerUnavailable("the disk is full (injected)"))
        go.set()
        body = {"draws": "0-2", "seeds": {"start": 0, "count": 2}, "config": {"epochs": 1}}
        assert c.post("/evaluations", json=body, headers={"Idempotency-Key": "half"}).status_code == 503
        service.runner.ledger.create_many = real
        evaluation_id = c.get("/evaluations").json()["evaluations"][0]["id"]
        wait_for(lambda: c.get(f"/evaluations/{evaluation_id}").json()["counts"]["succeeded"] == 2, 120,
                 what="the first chunk's draws")
        assert c.get(f"/evaluations/{evaluation_id}").json()["status"] == "running"  # (4 never recorded)
        assert c.post(f"/evaluations/{evaluation_id}/cancel").status_code == 200
        doc = finished(c, evaluation_id, timeout=60)
        assert doc["status"] == "cancelled" and doc["counts"]["succeeded"] == 2 and doc["counts"]["cancelled"] == 4
        again = c.post("/evaluations", json=body, headers={"Idempotency-Key": "half"})
        assert again.status_code == 202 and again.json()["id"] == evaluation_id
        assert len(c.get("/tasks").json()["tasks"]) == 2
        (row,) = c.get("/evaluations").json()["evaluations"]
        assert row["status"] == "cancelled"
