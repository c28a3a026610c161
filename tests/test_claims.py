"""The shared queue (app/tasks/feeder.py) on a real PostgreSQL ledger, one fault at a time.

One service in this process claims asynchronous tasks that "another replica" (a second ledger on
the same database) recorded, so every claim reads its stored input. Into each run one failure is
injected where it used to leave a lease held by nobody (issue #36): the stored inputs cannot be
read, a stored input cannot be parsed and its failure cannot be recorded, the queue refuses a
claim and giving it back fails too, a synchronous task's record cannot be written at first, an
attempt ends without its record. After each: no lease is held without a live attempt, nothing
is stuck, and the task ends as it should (run again elsewhere, or here, with the right answer).
Leases are long (20 s) and expired by the test through SQL when it needs one expired: nothing
here waits on a wall-clock window.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
import uuid

import httpx
import pytest

from app.errors import QueueFull
from app.ledger import LedgerUnavailable
from app.main import create_app
from app.settings import Settings
from learner.result import run_task
from learner.taskio import task_to_npz_bytes

from . import pg
from .gates import Gate, gated_engines
from .helpers import TIME_SCALE, small_task
from .server import inprocess_server, post_task, wait_for

psycopg = pg.require_psycopg()
from app.ledger.postgres import PostgresLedger  # noqa: E402

expire = pg.expire
pg_server, pg_url = pg.pg_server, pg.pg_url  # the fixtures (tests/pg.py)

TASK = small_task(60, 8, seed=11)
BODY = task_to_npz_bytes(TASK)
EXPECTED = run_task(TASK, None, "cpu").predictions_sha256


def record_elsewhere(other: PostgresLedger, body: bytes = BODY) -> str:
    """An asynchronous task another replica accepted: queued, its npz stored, claimable."""
    task_id = uuid.uuid4().hex
    other.create(task_id=task_id, kind="task", mode="async", backend="cpu", config={}, options={},
                 train_count=60, test_count=8, body_sha256=hashlib.sha256(body).hexdigest(), body_bytes=len(body),
                 input_hashes={}, body=body)
    return task_id


def row(url: str, task_id: str) -> dict:
    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute("SELECT status, lease_owner, claims, expiries, error FROM rev88_tasks WHERE id = %s",
                           (task_id,))
        status, owner, claims, expiries, error = cur.fetchone()
    return {"status": status, "owner": owner, "claims": claims, "expiries": expiries, "error": error}


def finished(url: str, task_id: str) -> dict:
    return wait_for(lambda: (r := row(url, task_id))["status"] in ("succeeded", "failed", "cancelled") and r,
                    timeout=60, what=f"task {task_id} to finish")


class Once:
    """Wraps a method so that its first ``times`` calls (matching ``when``) raise ``error``."""

    def __init__(self, real, error: Exception, times: int = 1, when=lambda *a, **kw: True) -> None:
        self.real, self.error, self.left, self.when, self.raised = real, error, times, when, 0
        self.calls: list[tuple] = []  # the arguments of the calls it raised for

    def __call__(self, *args, **kwargs):
        if self.left > 0 and self.when(*args, **kwargs):
            self.left -= 1
            self.raised += 1
            self.calls.append(args)
            raise self.error
        return self.real(*args, **kwargs)


@contextlib.contextmanager
def node(tmp_path, url: str, engines=None, **over):
    settings = Settings(**{"backend": "cpu", "workers": 1, "data_dir": str(tmp_path / "data"), "database_url": url,
                           "lease_s": 20.0, "lease_renew_s": 0.2, "claim_poll_s": 0.1, "db_timeout_s": 2.0,
                           "batch_max": 4, **over})
    app = create_app(settings, engines=engines)
    with inprocess_server(app) as server:
        yield server, app.state.service


@contextlib.contextmanager
def claims_held_back(service):
    """No claim while the test records tasks and arms its fault; then one look for work: the
    tasks recorded meanwhile are claimed together (up to batch_max)."""
    shared = service.runner.shared
    ready, shared.ready = shared.ready, lambda: False
    # a claim round already under way (the loop polls every claim_poll_s) could still claim what
    # the test records next: wait for a round that began after the hold, and so found nothing to do
    real, after = shared.claim_some, threading.Event()

    async def claim_some():
        queued = await real()
        after.set()
        return queued

    shared.claim_some = claim_some
    shared.wake()
    assert after.wait(30), "the feeder's claim loop did not come round"
    del shared.claim_some  # (the method again)
    try:
        yield
    finally:
        shared.ready = ready
        shared.wake()


def nothing_held(service) -> None:
    shared = service.runner.shared
    wait_for(lambda: not shared.live_attempts() and not service.ledger.held() and not service.runner.pending,
             timeout=30, what="no lease held without an attempt here")


@pytest.fixture
def other(pg_url):
    ledger = PostgresLedger(pg_url, owner="elsewhere")
    yield ledger
    ledger.close()


def test_stored_inputs_that_cannot_be_read_give_the_claims_back(tmp_path, pg_url, other, monkeypatch):
    with node(tmp_path, pg_url) as (server, service):
        with claims_held_back(service):
            ids = [record_elsewhere(other) for _ in range(3)]  # claimed together (batch_max 4)
            fault = Once(service.ledger.load_uploads, LedgerUnavailable("cannot read the upload: statement_timeout"))
            monkeypatch.setattr(service.ledger, "load_uploads", fault)
        for task_id in ids:
            done = finished(pg_url, task_id)
            assert done["status"] == "succeeded" and done["expiries"] == 0  # given back, not expired
        assert fault.raised == 1 and service.runner.shared.counters["released"] >= 3
        for task_id in ids:
            assert httpx.get(f"{server.url}/tasks/{task_id}").json()["predictions_sha256"] == EXPECTED
        nothing_held(service)


def test_an_unparseable_input_whose_failure_cannot_be_recorded_is_given_back_then_failed(tmp_path, pg_url, other,
                                                                                         monkeypatch):
    with node(tmp_path, pg_url) as (server, service):
        with claims_held_back(service):
            task_id = record_elsewhere(other, body=b"not an npz at all")
            fault = Once(service.ledger.finish, LedgerUnavailable("cannot record the result: connection failed"))
            monkeypatch.setattr(service.ledger, "finish", fault)
        done = finished(pg_url, task_id)
        assert fault.raised == 1
        assert done["status"] == "failed" and "could not run the task from its stored input" in done["error"]
        assert done["expiries"] == 0 and done["owner"] is None and done["claims"] == 2  # given back, claimed again
        nothing_held(service)


def test_a_claim_the_queue_refuses_and_that_cannot_be_given_back_expires_and_runs_again(tmp_path, pg_url, other,
                                                                                       monkeypatch):
    with node(tmp_path, pg_url) as (server, service):
        with claims_held_back(service):
            ids = [record_elsewhere(other) for _ in range(3)]
            refuse = Once(service.runner.queue, QueueFull("the queue is full (test)"))
            release = Once(service.ledger.release, LedgerUnavailable("cannot release: the database connection failed"))
            monkeypatch.setattr(service.runner, "queue", refuse)
            monkeypatch.setattr(service.ledger, "release", release)
        # the refused claim -- the task whose queueing raised, named by the fault itself (not by a
        # look at the database, where a claim still on its way to its attempt looks the same for a
        # moment) -- once its lease could not be given back: held in the database, by no attempt here
        wait_for(lambda: refuse.raised == 1 and release.raised == 1
                 and refuse.calls[0][0].task_id not in service.ledger.held(), timeout=30,
                 what="the refusal, the failed release, the lease forgotten here")
        [(acc, *_)] = refuse.calls
        stranded = acc.task_id
        assert stranded in ids and row(pg_url, stranded)["owner"] is not None
        assert stranded not in service.runner.shared.live_attempts()
        assert stranded not in service.runner.pending
        for task_id in ids:
            if task_id != stranded:  # the others ran
                assert finished(pg_url, task_id)["status"] == "succeeded"
        assert row(pg_url, stranded)["status"] == "queued"  # (not renewed, not run: waiting for its lease)
        expire(pg_url, stranded)  # what its lease does by itself after 20 s
        done = finished(pg_url, stranded)
        assert done["status"] == "succeeded" and done["expiries"] == 1
        nothing_held(service)


def test_a_synchronous_tasks_record_is_retried_and_never_failed_after_its_answer(tmp_path, pg_url, monkeypatch):
    with node(tmp_path, pg_url) as (server, service):
        fault = Once(service.ledger.finish, LedgerUnavailable("cannot record the result: connection failed"),
                     times=2)
        monkeypatch.setattr(service.ledger, "finish", fault)
        with server.client() as c:
            r = post_task(c, BODY, headers={"Idempotency-Key": "sync-retry-1"})
        assert r.status_code == 200 and "X-Ledger-Error" not in r.headers, r.text
        assert r.json()["predictions_sha256"] == EXPECTED and fault.raised == 2
        done = row(pg_url, r.json()["id"])
        assert done["status"] == "succeeded" and done["owner"] is None
        nothing_held(service)


def test_an_attempt_that_ends_unrecorded_stops_renewing_and_its_task_runs_again(tmp_path, pg_url, other,
                                                                              monkeypatch):
    with node(tmp_path, pg_url) as (server, service):
        with claims_held_back(service):
            task_id = record_elsewhere(other)
            service.runner.record_retry_s = 0.3
            fault = Once(service.ledger.finish, LedgerUnavailable("cannot record the result: connection failed"),
                         times=10**6, when=lambda tid, *a, **kw: tid == task_id)
            monkeypatch.setattr(service.ledger, "finish", fault)
        # its run ends, its record cannot be written: the attempt is over, its lease not renewed
        wait_for(lambda: fault.raised > 0 and task_id not in service.runner.shared.live_attempts()
                 and task_id not in service.runner.pending, timeout=30, what="the attempt to end unrecorded")
        assert row(pg_url, task_id)["owner"] == service.ledger.owner  # (held in the database, by nobody here)
        fault.left = 0  # the database answers again
        expire(pg_url, task_id)
        done = finished(pg_url, task_id)
        assert done["status"] == "succeeded" and done["expiries"] == 1
        assert httpx.get(f"{server.url}/tasks/{task_id}").json()["predictions_sha256"] == EXPECTED
        nothing_held(service)


def test_leases_are_renewed_while_request_traffic_holds_every_pooled_connection(tmp_path, pg_url, other):
    """Renewals have a thread and a connection of their own: with the only pooled connection held
    (request traffic), a running task's lease keeps being pushed ahead, and no reaper takes it."""
    gate = Gate()
    with node(tmp_path, pg_url, engines=gated_engines(gate), lease_s=2.0, db_pool_size=1) as (server, service):
        gate.hold()  # (after the warm-up, which runs a task too)
        task_id = record_elsewhere(other)
        wait_for(lambda: task_id in service.runner.shared.live_attempts() and row(pg_url, task_id)["status"] == "running",
                 timeout=30, what="the task running here")
        with service.ledger._pool.connection():  # every pooled connection busy, for longer than a lease
            first = lease_expires_at(pg_url, task_id)
            renewed = 0
            while lease_expires_at(pg_url, task_id) < first + 1.5 * 2.0:  # until pushed 1.5 leases ahead
                assert other.reap() == {"requeued": 0, "failed": 0, "cancelled": 0}  # never expired
                renewed += 1
                time.sleep(0.1)
                assert renewed < 300 * TIME_SCALE, "the lease was not renewed while the pool was busy"
        gate.release()
        done = finished(pg_url, task_id)
        assert done["status"] == "succeeded" and done["expiries"] == 0 and done["claims"] == 1
        nothing_held(service)


def lease_expires_at(url: str, task_id: str) -> float:
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute("SELECT lease_expires_at FROM rev88_tasks WHERE id = %s", (task_id,)).fetchone()[0]


def test_a_task_on_a_dataset_recorded_elsewhere_is_run_here_from_the_shared_dataset(tmp_path, pg_url, other):
    """Another replica stored the dataset and recorded a task on it (no copy of the npz): this one
    claims it and reads the dataset from the shared database."""
    from app.ledger.datasets_pg import PostgresDatasets
    from app.tasks.datasets import DatasetCatalog

    catalog = DatasetCatalog(PostgresDatasets(other, 1 << 30), 0)
    record, _ = catalog.put(BODY)
    task_id = uuid.uuid4().hex
    with node(tmp_path, pg_url) as (server, service):
        with claims_held_back(service):
            other.create(task_id=task_id, kind="task", mode="async", backend="cpu", config={},
                         options={"include_scores": False, "measure": None, "dataset": record.digest},
                         train_count=60, test_count=8, body_sha256=record.digest.split(":")[1], body_bytes=record.bytes,
                         input_hashes=record.input_hashes, body=None)
        done = finished(pg_url, task_id)
        assert done["status"] == "succeeded", done
        doc = httpx.get(f"{server.url}/tasks/{task_id}").json()
        assert doc["predictions_sha256"] == EXPECTED and doc["dataset"] == record.digest
        assert service.runner.shared.counters["from_stored_input"] == 1
        nothing_held(service)


def test_tasks_claimed_together_each_run_under_its_own_lease_on_its_own_input(tmp_path, pg_url, other, monkeypatch):
    """One claim takes three tasks with three inputs: one another replica held before (its lease
    expired and reaped: this attempt is its second, epoch 2) and two never claimed (epoch 1). Each
    attempt writes under its own lease -- none refused, none left to expire and run again -- and
    each answer is its own task's (its input read from the store by its own id)."""
    tasks = [small_task(60, 8, seed=21 + i) for i in range(3)]
    expected = [run_task(t, None, "cpu").predictions_sha256 for t in tasks]
    assert len(set(expected)) == 3
    with node(tmp_path, pg_url) as (server, service):
        claimed: list[list[str]] = []

        def claim(*args, real=service.ledger.claim):
            got = real(*args)
            claimed.append([c.record.id for c in got])
            return got

        with claims_held_back(service):
            ids = [record_elsewhere(other, task_to_npz_bytes(t)) for t in tasks]
            assert [c.record.id for c in other.claim(1)] == ids[:1]  # held elsewhere, whose replica then stops
            expire(pg_url, ids[0])
            wait_for(lambda: row(pg_url, ids[0])["owner"] is None, timeout=30, what="the expired lease reaped")
            monkeypatch.setattr(service.ledger, "claim", claim)
        for task_id, want, attempt in zip(ids, expected, (2, 1, 1)):
            done = finished(pg_url, task_id)
            assert done["status"] == "succeeded" and done["claims"] == attempt, (attempt, done)
            assert httpx.get(f"{server.url}/tasks/{task_id}").json()["predictions_sha256"] == want
        assert sorted(claimed[0]) == sorted(ids), claimed  # (one claim: the three attempts' leases differ)
        nothing_held(service)
