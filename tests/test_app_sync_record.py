"""A synchronous task without an Idempotency-Key is answered before its one record is committed
(its client holds the answer; the record goes to the ledger writer's next group commit). Until
the ledger has it, the task stays in the runner's ``pending`` and reads as finished: GET shows
the answer the client got, a cancel is a 409; once committed, the ledger's record is the same."""

from __future__ import annotations

import threading

from app.main import create_app
from app.settings import Settings
from learner.result import run_task
from learner.taskio import task_to_npz_bytes

from .helpers import small_task
from .server import inprocess_server, post_task, wait_for


def test_a_synchronous_answer_does_not_wait_for_its_record_and_reads_finished_meanwhile(tmp_path):
    app = create_app(Settings(backend="cpu", workers=1, data_dir=str(tmp_path / "data")))
    service = app.state.service
    release, held = threading.Event(), threading.Event()
    real_add = service.ledger.add_finished

    def held_add(tasks):
        held.set()
        assert release.wait(60), "never released"
        return real_add(tasks)

    task = small_task(40, 9, seed=5)
    want = run_task(task, None, "cpu")
    with inprocess_server(app) as server, server.client() as c:
        service.ledger.add_finished = held_add
        try:
            r = post_task(c, task_to_npz_bytes(task))  # answered while its record is held
            assert r.status_code == 200, r.text
            answer = r.json()
            task_id = answer["id"]
            assert answer["predictions_sha256"] == want.predictions_sha256
            assert held.wait(10) and task_id in service.runner.pending  # not in the ledger yet
            assert service.ledger.get(task_id) is None

            meanwhile = c.get(f"/tasks/{task_id}")
            assert meanwhile.status_code == 200, meanwhile.text
            doc = meanwhile.json()
            assert doc["status"] == "succeeded" and doc["predictions"] == answer["predictions"]
            assert doc["predictions_sha256"] == answer["predictions_sha256"] and doc["timing"] == answer["timing"]
            cancel = c.post(f"/tasks/{task_id}/cancel")
            assert cancel.status_code == 409 and cancel.json()["task_status"] == "succeeded", cancel.text
        finally:
            release.set()
        wait_for(lambda: task_id not in service.runner.pending, 30, 0.01, "the record committed")
        stored = c.get(f"/tasks/{task_id}").json()
        assert stored == doc  # the ledger's record: the same document
        assert [t["id"] for t in c.get("/tasks").json()["tasks"]] == [task_id]


def test_synchronous_tasks_wake_no_claim_while_nothing_waits_in_the_ledger(tmp_path):
    """SQLite's index of waiting work is exact: while it is empty, a synchronous task's end does not
    wake the claimer and the feeder's plan claims nothing (each wake was a claim through asyncio's
    thread pool per task); an asynchronous task still wakes it, is claimed, and is answered."""
    app = create_app(Settings(backend="cpu", workers=1, data_dir=str(tmp_path / "data")))
    service = app.state.service
    task = small_task(40, 9, seed=6)
    want = run_task(task, None, "cpu").predictions_sha256
    with inprocess_server(app) as server, server.client() as c:
        feeder = service.runner.feeder
        real_claim_some, rounds = feeder.claim_some, []

        async def counted_claim_some():
            rounds.append(len(feeder.ledger))
            return await real_claim_some()

        feeder.claim_some = counted_claim_some
        assert len(feeder.ledger) == 0 and feeder.free_slots() > 0
        assert feeder.plan() is None  # free places, but nothing waits: nothing to claim
        for _ in range(4):
            r = post_task(c, task_to_npz_bytes(task))
            assert r.status_code == 200, r.text
            assert r.json()["predictions_sha256"] == want
        wait_for(lambda: not service.runner.pending, 30, 0.01, "the records written")
        assert rounds == []  # no task's end woke the claimer
        accepted = post_task(c, task_to_npz_bytes(task), headers={"Prefer": "respond-async"})
        assert accepted.status_code == 202, accepted.text
        task_id = accepted.json()["id"]
        done = wait_for(lambda: (d := c.get(f"/tasks/{task_id}").json())["status"] == "succeeded" and d, 60, 0.02,
                        "the asynchronous task answered")
        assert done["predictions_sha256"] == want
        assert rounds and rounds[0] >= 1  # its offer woke the claimer, with it waiting in the index
