"""A cancel that races its task's completion: the task finished first, so the cancel cancelled
nothing and is a 409 (as for any finished task), never a 200 carrying a succeeded document."""

from __future__ import annotations

import threading

from app.main import create_app
from app.settings import Settings
from learner.result import run_task
from learner.taskio import task_to_npz_bytes

from .helpers import small_task
from .server import inprocess_server, post_task, wait_for


def test_a_cancel_that_loses_the_race_is_409(tmp_path):
    """The window made deterministic: the task has finished on the device, but its result is not
    in the ledger yet (the ledger's finish is held), so the cancel finds it unfinished and asks
    the executor to stop it -- too late. Then the result is recorded, and the cancel says so."""
    app = create_app(Settings(backend="cpu", workers=1, data_dir=str(tmp_path / "data")))
    service = app.state.service
    recorded, withdrawn = threading.Event(), []
    # (the ledger writer records outcomes with finish_many: holding finish alone held nothing,
    # and the test passed only while the writer's 20 ms linger outlasted the status check)
    real_finish, real_withdraw = service.ledger.finish_many, service.executor.withdraw

    def held_finish(*args, **kwargs):
        assert recorded.wait(60), "the cancel never reached the executor"
        return real_finish(*args, **kwargs)

    def watched_withdraw(job, why, reason):
        withdrawn.append(real_withdraw(job, why, reason))
        recorded.set()  # only now may the result reach the ledger
        return withdrawn[-1]

    task = small_task()
    with inprocess_server(app) as server, server.client() as c:
        service.ledger.finish_many, service.executor.withdraw = held_finish, watched_withdraw
        accepted = post_task(c, task_to_npz_bytes(task), headers={"Prefer": "respond-async"})
        assert accepted.status_code == 202, accepted.text
        task_id = accepted.json()["id"]
        # (it waits in the ledger until the feeder claims it into the device queue)
        acc = wait_for(lambda: (a := service.runner.pending.get(task_id)) is not None and a.job is not None and a,
                       60, 0.01, "the task claimed")
        job = acc.job
        wait_for(job.future.done, 60, 0.01, "the task's run")
        assert c.get(f"/tasks/{task_id}").json()["status"] in ("queued", "running")  # not recorded yet
        cancel = c.post(f"/tasks/{task_id}/cancel")
        assert withdrawn == [False]  # the executor had nothing left to stop
        assert cancel.status_code == 409, cancel.text
        assert cancel.json()["task_status"] == "succeeded"
        assert "before the cancel took effect" in cancel.json()["error"]
        done = c.get(f"/tasks/{task_id}").json()
        assert done["status"] == "succeeded"
        assert done["predictions_sha256"] == run_task(task, None, "cpu").predictions_sha256
        again = c.post(f"/tasks/{task_id}/cancel")  # once finished, as before: 409
        assert again.status_code == 409 and again.json()["task_status"] == "succeeded"
        assert "already finished" in again.json()["error"]
