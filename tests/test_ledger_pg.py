"""The PostgreSQL ledger's own behaviour against a real server (tests/pg.py): migrations under an
advisory lock, inputs kept apart, claims with SKIP LOCKED, leases renewed, expired and reaped,
results fenced by owner and epoch, cancel requests and their notifications, retention across
replicas, and the database going away and coming back. (What both stores share is
tests/test_ledger.py, run against each.)"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
import uuid

import pytest

from . import pg  # noqa: E402

psycopg = pg.require_psycopg()

from app.ledger import LeaseLost, LedgerError, LedgerUnavailable  # noqa: E402
from app.ledger.postgres import CHANNEL_CANCEL, SCHEMA_VERSION, PostgresLedger, load_migrations, redact  # noqa: E402
from app.ledger.store import AlreadyFinished  # noqa: E402

from .helpers import TIME_SCALE  # noqa: E402
from .pg import create_database, expire  # noqa: E402

pg_server, pg_url, pg_cluster = pg.pg_server, pg.pg_url, pg.pg_cluster  # the fixtures (tests/pg.py)


def new_id() -> str:
    return uuid.uuid4().hex


def add(ledger, mode="async", body=b"npz" * 100, key=None, task_id=None):
    body = body if mode == "async" else None
    record, _ = ledger.create(
        task_id=task_id or new_id(), kind="task", mode=mode, backend="cpu", config={"seed": 1}, options={},
        train_count=10, test_count=5, body_sha256=hashlib.sha256(body or b"").hexdigest(),
        body_bytes=len(body) if body is not None else 7, body=body, idempotency_key=key)
    return record


def answer(task_id: str) -> dict:
    return {"id": task_id, "predictions": [1, 2, 3], "predictions_sha256": "ab" * 32, "timing": {"run_ms": 1.0}}


def open_ledger(url, owner, **kw) -> PostgresLedger:
    return PostgresLedger(url, owner=owner, **kw)


@pytest.fixture
def two(pg_url):
    """Two replicas' ledgers on one database. Leases are long: a test that needs one expired
    expires it through SQL (``expire``), as a replica that stopped renewing leaves it."""
    a = open_ledger(pg_url, "replica-a", lease_s=30, lease_attempts=3)
    b = open_ledger(pg_url, "replica-b", lease_s=30, lease_attempts=3)
    yield a, b
    a.close()
    b.close()


def raw(url: str):
    return psycopg.connect(url, autocommit=True)


# --------------------------------------------------------------------------- schema


def test_replicas_starting_together_migrate_once(pg_url):
    ledgers, errors = [], []

    def start(i):
        try:
            ledgers.append(open_ledger(pg_url, f"r{i}"))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(ledgers) == 6
    with raw(pg_url) as conn:
        rows = conn.execute("SELECT version, name FROM rev88_schema ORDER BY version").fetchall()
    assert rows == [(v, n) for v, n, _ in load_migrations()] and rows[-1][0] == SCHEMA_VERSION
    for led in ledgers:
        assert led.schema_version == SCHEMA_VERSION and led.counts()["schema_version"] == SCHEMA_VERSION
        led.close()


def test_a_newer_schema_is_a_clear_startup_error(pg_url):
    open_ledger(pg_url, "a").close()
    with raw(pg_url) as conn:
        conn.execute("INSERT INTO rev88_schema (version, name) VALUES (%s, 'from_the_future')", (SCHEMA_VERSION + 3,))
    with pytest.raises(LedgerError) as info:
        open_ledger(pg_url, "a")
    message = str(info.value)
    assert f"schema version {SCHEMA_VERSION + 3}" in message and f"this code's {SCHEMA_VERSION}" in message
    assert redact(pg_url) in message


def test_a_migration_recorded_under_another_name_is_refused(pg_url):
    open_ledger(pg_url, "a").close()
    with raw(pg_url) as conn:
        conn.execute("UPDATE rev88_schema SET name = 'something_else' WHERE version = 1")
    with pytest.raises(LedgerError, match="recorded migration 1 as 'something_else'"):
        open_ledger(pg_url, "a")


def test_migration_files_are_numbered_without_gaps(tmp_path):
    (tmp_path / "0001_a.sql").write_text("SELECT 1;")
    (tmp_path / "0003_c.sql").write_text("SELECT 1;")
    with pytest.raises(LedgerError, match="without gaps"):
        load_migrations(tmp_path)
    (tmp_path / "2_bad.sql").write_text("SELECT 1;")
    with pytest.raises(LedgerError, match="NNNN_name.sql"):
        load_migrations(tmp_path)


def test_an_unreachable_database_is_a_clear_startup_error():
    from .pg import free_port

    url = f"postgresql://rev88:secret@127.0.0.1:{free_port()}/rev88"
    t0 = time.monotonic()
    with pytest.raises(LedgerError) as info:
        PostgresLedger(url, timeout_s=1.0)
    message = str(info.value)
    assert "secret" not in message and "rev88:***@127.0.0.1" in message
    assert "refused" in message.lower() or "connect" in message.lower()
    assert time.monotonic() - t0 < 15


# --------------------------------------------------------------------------- inputs apart


def test_lists_and_reads_never_touch_the_inputs_table(pg_url):
    led = open_ledger(pg_url, "a")
    queued = add(led, body=b"x" * 200_000)
    done = add(led)
    led.finish(done.id, "succeeded", answer=answer(done.id))
    with raw(pg_url) as locker:
        locker.execute("BEGIN")
        locker.execute("LOCK TABLE rev88_task_inputs IN ACCESS EXCLUSIVE MODE")  # any read of it would wait
        t0 = time.monotonic()
        page, _ = led.list(limit=10)
        assert {r.id for r in page} == {queued.id, done.id}
        assert led.get(queued.id).status == "queued" and led.get(done.id).answer == answer(done.id)
        assert [r.id for r in led.unfinished()] == [queued.id]
        assert led.queue_depth()["queued"] == 1
        assert time.monotonic() - t0 < 2 * TIME_SCALE  # (none of it waited for the lock)
        locker.execute("ROLLBACK")
    assert led.load_upload(queued.id) == b"x" * 200_000
    led.close()


# --------------------------------------------------------------------------- claims


def test_concurrent_claims_take_each_task_exactly_once(pg_url):
    seeder = open_ledger(pg_url, "seeder")
    ids = {add(seeder).id for _ in range(60)}
    replicas = [open_ledger(pg_url, f"replica-{i}") for i in range(4)]
    taken: list[tuple[str, str]] = []
    lock = threading.Lock()
    start = threading.Barrier(8)  # every worker's first claim at once (else, on a loaded machine, the
    # first thread started may take all 60 before the others have begun: a test of the scheduler)

    def worker(led):
        start.wait(30)
        while True:
            got = led.claim(3)
            if not got:
                return
            with lock:
                taken.extend((c.record.id, led.owner) for c in got)

    threads = [threading.Thread(target=worker, args=(r,)) for r in replicas for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(t for t, _ in taken) == sorted(ids)  # every one, none twice
    assert len({o for _, o in taken}) > 1  # shared among replicas
    with raw(pg_url) as conn:
        assert conn.execute("SELECT count(*) FROM rev88_tasks WHERE claims = 1 AND lease_owner IS NOT NULL"
                            ).fetchone()[0] == 60
    for led in [seeder, *replicas]:
        led.close()


def test_claim_takes_the_oldest_queued_async_tasks_only(two):
    a, b = two
    first = add(a)
    add(a, mode="sync")  # run where it arrived: never claimed
    second = add(a)
    [c1] = b.claim(1)
    assert c1.record.id == first.id and c1.epoch == 1
    [c2] = b.claim(5)
    assert c2.record.id == second.id
    assert b.claim(5) == [] and sorted(b.held()) == sorted([first.id, second.id])


# --------------------------------------------------------------------------- leases, fencing, reaping


def test_a_renewed_lease_outlives_its_period(two):
    a, b = two
    task = add(a)
    [claim] = a.claim(1)

    def expires_at() -> float:
        with raw(a.url) as conn:
            return conn.execute("SELECT lease_expires_at FROM rev88_tasks WHERE id = %s", (task.id,)).fetchone()[0]

    for _ in range(3):
        expire(a.url, task.id)  # about to expire: the renewal pushes it a whole lease ahead
        renewal = a.renew()
        assert renewal.held == [task.id] and renewal.lost == []
        with raw(a.url) as conn:
            now = conn.execute("SELECT EXTRACT(EPOCH FROM clock_timestamp())").fetchone()[0]
        assert expires_at() > float(now) + 25
        assert b.reap() == {"requeued": 0, "failed": 0, "cancelled": 0}
    a.mark_running(task.id, "cpu:0")
    done = a.finish(task.id, "succeeded", answer=answer(task.id))
    assert done.status == "succeeded" and a.held() == []


def test_a_stale_lease_holders_late_result_is_refused(two):
    a, b = two
    task = add(a, body=b"the body")
    [claim_a] = a.claim(1)
    a.mark_running(task.id, "cpu:0")
    expire(a.url, task.id)  # a stops renewing (a stalled process)
    assert b.reap()["requeued"] == 1
    assert b.get(task.id).status == "queued"
    [claim_b] = b.claim(1)
    assert claim_b.epoch == claim_a.epoch + 1
    b.mark_running(task.id, "cpu:1")
    with pytest.raises(LeaseLost, match="has passed to replica-b"):
        a.finish(task.id, "succeeded", answer={**answer(task.id), "from": "a"})
    with pytest.raises(LeaseLost):
        a.mark_running(task.id)  # nor can it take the task back while b's lease is live
    assert a.renew().lost == [] and task.id not in a.held()  # already dropped
    done = b.finish(task.id, "succeeded", answer={**answer(task.id), "from": "b"})
    assert done.answer["from"] == "b" and done.attempts == 2 and done.device == "cpu:1"
    assert b.load_uploads([task.id]) == {}  # the input went with the finish


def test_a_lost_lease_is_reported_by_renewal(two):
    a, b = two
    task = add(a)
    a.claim(1)
    expire(a.url, task.id)
    b.reap()
    b.claim(1)
    renewal = a.renew()
    assert renewal.lost == [task.id] and renewal.held == []
    assert b.renew().held == [task.id]


def test_attempts_are_bounded_then_failed_with_the_reason(pg_url):
    a = open_ledger(pg_url, "a", lease_s=30, lease_attempts=2)
    task = add(a)
    a.claim(1)
    expire(pg_url, task.id)
    assert a.reap() == {"requeued": 1, "failed": 0, "cancelled": 0}
    a.claim(1)
    expire(pg_url, task.id)
    assert a.reap() == {"requeued": 0, "failed": 1, "cancelled": 0}
    record = a.get(task.id)
    assert record.status == "failed" and record.error["status"] == 500
    assert "lease expired 2 times" in record.error["error"] and "REV88_LEASE_ATTEMPTS" in record.error["error"]
    assert a.load_uploads([task.id]) == {} and a.claim(1) == []
    a.close()


def test_a_synchronous_task_of_a_replica_that_died_is_failed(two):
    a, b = two
    task = add(a, mode="sync", key="sync-key")
    assert a.held() == [task.id]
    a.mark_running(task.id)
    expire(a.url, task.id)  # a died
    assert b.reap()["failed"] == 1
    record = b.get(task.id)
    assert record.status == "failed" and "replica-a stopped while running this synchronous task" in record.error["error"]


def test_a_drained_replica_releases_its_claims_without_an_expiry(two):
    a, b = two
    task = add(a)
    a.claim(1)
    assert a.release([task.id]) == [task.id] and a.held() == []
    [claim] = b.claim(1)
    assert claim.record.id == task.id
    with raw(a.url) as conn:
        assert conn.execute("SELECT expiries, claims FROM rev88_tasks WHERE id = %s", (task.id,)).fetchone() == (0, 2)


def test_mark_running_takes_a_free_or_expired_lease_but_never_a_live_one(two):
    a, b = two
    task = add(a)
    b.mark_running(task.id, "cpu:0")  # free: taken
    with pytest.raises(LeaseLost, match="replica-b holds its lease"):
        a.mark_running(task.id)
    with pytest.raises(LeaseLost):
        a.finish(task.id, "cancelled")
    expire(a.url, task.id)
    a.mark_running(task.id, "cpu:9")  # expired: taken over
    assert a.get(task.id).attempts == 2
    with pytest.raises(LeaseLost):
        b.finish(task.id, "succeeded", answer=answer(task.id))
    assert a.finish(task.id, "succeeded", answer=answer(task.id)).device == "cpu:9"


# --------------------------------------------------------------------------- cancel requests


def test_cancel_of_an_unclaimed_task_is_immediate(two):
    a, b = two
    task = add(a)
    outcome, record = b.request_cancel(task.id)
    assert outcome == "cancelled" and record.status == "cancelled" and record.error["error"] == "cancelled before it ran"
    assert a.claim(1) == [] and a.load_uploads([task.id]) == {}
    with pytest.raises(AlreadyFinished):
        b.request_cancel(task.id)
    with pytest.raises(KeyError):
        b.request_cancel("no-such-task")


def test_cancel_of_a_held_task_reaches_its_holder_by_notification_and_renewal(two):
    a, b = two
    task = add(a)
    a.claim(1)
    notes, stop = [], threading.Event()
    connected = threading.Event()

    def on_notify(channel, payload):
        if channel == "connected":
            connected.set()
        else:
            notes.append((channel, payload, time.monotonic()))

    listener = threading.Thread(target=a.listen, args=(on_notify, stop), daemon=True)
    listener.start()
    assert connected.wait(10)
    t0 = time.monotonic()
    assert b.request_cancel(task.id) == ("requested", None)
    deadline = time.monotonic() + 5
    while not any(c == CHANNEL_CANCEL for c, _, _ in notes) and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    listener.join(5)
    [(channel, payload, at)] = [n for n in notes if n[0] == CHANNEL_CANCEL]
    assert payload == task.id and at >= t0  # by notification (the poll above waited up to 5 s)
    assert a.renew().cancel == [task.id]
    assert a.finish(task.id, "cancelled", error={"status": 409, "error": "stopped"}).status == "cancelled"


def test_a_cancel_requested_of_a_dead_holder_is_recorded_by_the_reaper(two):
    a, b = two
    task = add(a)
    a.claim(1)
    assert b.request_cancel(task.id)[0] == "requested"
    expire(a.url, task.id)
    assert b.reap()["cancelled"] == 1
    record = b.get(task.id)
    assert record.status == "cancelled" and "replica-a" in record.error["error"]


# --------------------------------------------------------------------------- idempotency, retention


def test_one_idempotency_key_from_many_replicas_makes_one_task(pg_url):
    replicas = [open_ledger(pg_url, f"r{i}") for i in range(4)]
    body = b"same body" * 1000
    results, errors = [], []

    def send(led):
        try:
            results.append(led.create(
                task_id=new_id(), kind="task", mode="async", backend="cpu", config={}, options={}, train_count=1,
                test_count=1, body_sha256=hashlib.sha256(body).hexdigest(), body_bytes=len(body), body=body,
                idempotency_key="one-key"))
        except Exception as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=send, args=(r,)) for r in replicas for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and sum(created for _, created in results) == 1
    assert len({r.id for r, _ in results}) == 1
    assert replicas[0].counts()["upload_files"] == 1
    for led in replicas:
        led.close()


def test_retention_across_replicas_keeps_the_newest(pg_url):
    a = open_ledger(pg_url, "a", retain_tasks=4)
    b = open_ledger(pg_url, "b", retain_tasks=4)
    finished = []
    for i in range(10):
        led = a if i % 2 else b
        t = add(led)
        led.mark_running(t.id)
        led.finish(t.id, "succeeded", answer=answer(t.id))
        finished.append(t.id)
    waiting = add(a)
    a._retain(keep=None, force=True)  # what RETENTION_CHECK_S would do a few seconds later
    kept = [i for i in finished if a.get(i) is not None]
    assert kept == finished[-4:] and a.get(waiting.id).status == "queued"
    a.close()
    b.close()


# --------------------------------------------------------------------------- the database away and back


def test_a_database_restart_is_503_then_recovers_by_itself(pg_cluster):
    url = create_database(pg_cluster.url)
    led = PostgresLedger(url, timeout_s=1.0, owner="a")
    task = add(led)
    pg_cluster.stop()
    t0 = time.monotonic()
    with pytest.raises(LedgerUnavailable) as info:
        led.get(task.id)
    assert time.monotonic() - t0 < 6
    message = str(info.value)
    assert "cannot read task" in message and redact(url) in message
    with pytest.raises(LedgerUnavailable):
        add(led)
    pg_cluster.start()
    deadline = time.monotonic() + 30
    while True:
        try:
            record = led.get(task.id)
            break
        except LedgerUnavailable:
            assert time.monotonic() < deadline, "the ledger did not recover"
            time.sleep(0.2)
    assert record.status == "queued" and led.load_upload(task.id) == b"npz" * 100  # nothing accepted lost
    assert add(led).status == "queued"
    led.close()


def test_a_slow_database_is_503_within_the_timeout(pg_url):
    led = PostgresLedger(pg_url, timeout_s=0.5, owner="a")
    task = add(led)
    with raw(pg_url) as blocker:
        blocker.execute("BEGIN")
        blocker.execute("SELECT 1 FROM rev88_tasks WHERE id = %s FOR UPDATE", (task.id,))
        t0 = time.monotonic()
        with pytest.raises(LedgerUnavailable, match="lock_timeout|statement_timeout"):
            led.finish(task.id, "cancelled")
        assert time.monotonic() - t0 < 3
        blocker.execute("ROLLBACK")
    assert led.finish(task.id, "cancelled").status == "cancelled"
    led.close()


def test_the_pool_says_when_every_connection_is_in_use(pg_url):
    led = PostgresLedger(pg_url, pool_size=1, timeout_s=0.5, owner="a")
    with led._pool.connection():
        with pytest.raises(LedgerUnavailable, match="all 1 connections in use"):
            led.get("anything")
    assert led.get("anything") is None
    led.close()


# --------------------------------------------------------------------------- faults (issue #36)


def test_the_fence_is_by_attempt_even_when_the_same_replica_reaps_and_claims_again(pg_url):
    """An attempt's writes carry its lease's epoch: once that lease was reaped (here by the
    replica's own reaper) and the task claimed again, the first attempt's renewal and results are
    refused, although the owner is the same."""
    a = open_ledger(pg_url, "one-owner", lease_s=30)
    try:
        task = add(a)
        [first] = a.claim(1)
        a.mark_running(task.id, "cpu:0", epoch=first.epoch)
        expire(pg_url, task.id)
        assert a.reap()["requeued"] == 1
        [second] = a.claim(1)
        assert second.epoch == first.epoch + 1
        assert a.renew({task.id: first.epoch}).lost == [task.id]
        with pytest.raises(LeaseLost, match=f"epoch {first.epoch}"):
            a.mark_running(task.id, "cpu:0", epoch=first.epoch)
        with pytest.raises(LeaseLost, match=f"epoch {first.epoch}"):
            a.finish(task.id, "succeeded", answer={**answer(task.id), "from": "first"}, epoch=first.epoch)
        assert a.renew({task.id: second.epoch}).held == [task.id]
        done = a.finish(task.id, "succeeded", answer={**answer(task.id), "from": "second"}, epoch=second.epoch)
        assert done.answer["from"] == "second"
    finally:
        a.close()


def test_finish_many_fences_each_outcome_by_its_attempt(pg_url):
    """The production write path (the ledger writer's finish_many): a stale attempt's outcome --
    the same replica reaped the task and claimed it again -- is refused with LeaseLost, beside an
    outcome of the current attempt and one of another task, which are written (issue #44: a
    finish_many that dropped the epoch survived the whole suite before)."""
    from app.ledger.store import Outcome

    a = open_ledger(pg_url, "one-owner", lease_s=30)
    try:
        task, other = add(a), add(a)
        claims = {c.record.id: c for c in a.claim(2)}
        first, theirs = claims[task.id], claims[other.id]
        expire(pg_url, task.id)
        assert a.reap()["requeued"] == 1
        [second] = a.claim(1)
        assert second.epoch == first.epoch + 1
        stale, fine = a.finish_many([
            Outcome(task.id, "succeeded", {**answer(task.id), "from": "first"}, epoch=first.epoch),
            Outcome(other.id, "succeeded", {**answer(other.id), "from": "other"}, epoch=theirs.epoch)])
        assert isinstance(stale, LeaseLost) and f"epoch {first.epoch}" in str(stale)
        assert fine.status == "succeeded" and fine.answer["from"] == "other"
        assert a.get(task.id).status in ("queued", "running")  # nothing written for the stale attempt
        [current] = a.finish_many([Outcome(task.id, "succeeded", {**answer(task.id), "from": "second"},
                                           epoch=second.epoch)])
        assert current.status == "succeeded" and a.get(task.id).answer["from"] == "second"
    finally:
        a.close()


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipeline", "libpq-without-pipeline"])
def test_a_launchs_outcomes_are_one_transaction_and_each_refusal_its_own(pg_url, pipeline, monkeypatch):
    """A launch's attempts are written in one transaction (one commit for the launch, its
    statements sent together where libpq can), each statement fenced by its own lease: a stale
    attempt (LeaseLost), a finished task (AlreadyFinished) and an outcome without its answer
    (ValueError) are those outcomes' results, and every other outcome is written, its input
    deleted and its lease no longer held here."""
    from app.ledger.store import Outcome

    if not pipeline:
        monkeypatch.setattr(psycopg.Pipeline, "is_supported", lambda: False)

    a = open_ledger(pg_url, "one-owner", lease_s=30)
    try:
        tasks = [add(a) for _ in range(5)]
        claims = {c.record.id: c for c in a.claim(5)}
        ok1, stale, finished, bogus, ok2 = tasks
        expire(pg_url, stale.id)
        assert a.reap()["requeued"] == 1
        [again] = a.claim(1)
        assert again.record.id == stale.id
        a.finish(finished.id, "cancelled", epoch=claims[finished.id].epoch)
        results = a.finish_many([
            Outcome(ok1.id, "succeeded", answer(ok1.id), epoch=claims[ok1.id].epoch),
            Outcome(stale.id, "succeeded", answer(stale.id), epoch=claims[stale.id].epoch),
            Outcome(finished.id, "succeeded", answer(finished.id), epoch=claims[finished.id].epoch),
            Outcome(bogus.id, "succeeded", None, epoch=claims[bogus.id].epoch),  # no answer
            Outcome(ok2.id, "failed", None, {"status": 422, "error": "diverged"}, epoch=claims[ok2.id].epoch,
                    want_record=False)])  # (a launch's cells: True once written, no record read back)
        assert results[0].status == "succeeded" and results[0].answer == answer(ok1.id)
        assert isinstance(results[1], LeaseLost) and a.get(stale.id).status in ("queued", "running")
        assert isinstance(results[2], AlreadyFinished) and a.get(finished.id).status == "cancelled"
        assert isinstance(results[3], ValueError) and a.get(bogus.id).status in ("queued", "running")
        assert results[4] is True and a.get(ok2.id).error["error"] == "diverged"
        assert a.get(ok1.id).answer == answer(ok1.id)
        held = set(a.held())
        assert ok1.id not in held and ok2.id not in held and bogus.id in held and stale.id in held
        with psycopg.connect(pg_url, autocommit=True) as conn:
            inputs = {r[0] for r in conn.execute("SELECT task_id FROM rev88_task_inputs").fetchall()}
        assert ok1.id not in inputs and ok2.id not in inputs and bogus.id in inputs
    finally:
        a.close()


def test_two_ledgers_of_one_owner_fence_each_others_attempts(pg_url):
    """The same owner on two ledger objects (a restarted replica that kept its name): claim,
    expire, reap, claim again: the first attempt's renewal and write are both refused."""
    a = open_ledger(pg_url, "same-owner", lease_s=30)
    b = open_ledger(pg_url, "same-owner", lease_s=30)
    try:
        task = add(a)
        [first] = a.claim(1)
        expire(pg_url, task.id)
        assert b.reap()["requeued"] == 1
        [second] = b.claim(1)
        assert a.renew().lost == [task.id]  # (a's own bookkeeping: the lease it held is gone)
        assert a.renew({task.id: first.epoch}).lost == [task.id]
        with pytest.raises(LeaseLost):
            a.finish(task.id, "succeeded", answer=answer(task.id), epoch=first.epoch)
        assert b.finish(task.id, "succeeded", answer=answer(task.id), epoch=second.epoch).status == "succeeded"
    finally:
        a.close()
        b.close()


def test_only_live_attempts_are_renewed(pg_url):
    a = open_ledger(pg_url, "a", lease_s=30)
    try:
        t1, t2 = add(a), add(a)
        c1, c2 = a.claim(2)
        renewal = a.renew({c1.record.id: c1.epoch})  # c2 never became an attempt here
        assert renewal.held == [c1.record.id] and c2.record.id not in a.held()
        expire(pg_url, c1.record.id)
        expire(pg_url, c2.record.id)
        a.renew({c1.record.id: c1.epoch})  # the live one: its lease pushed again
        assert a.reap()["requeued"] == 1
        assert a.get(c2.record.id).status == "queued" and a.get(c1.record.id).status == "queued"
        with raw(pg_url) as conn:
            owners = dict(conn.execute("SELECT id, lease_owner FROM rev88_tasks WHERE id = ANY(%s)",
                                       ([t1.id, t2.id],)).fetchall())
        assert owners[c1.record.id] == "a" and owners[c2.record.id] is None
    finally:
        a.close()


@pytest.fixture
def commit_then_drop(monkeypatch):
    """Arm it (``drop.arm(before=False)``) and the next transaction's COMMIT is sent (or, with
    ``before``, not) and then its connection is reported lost, as when the network fails at that
    moment."""

    class Drop:
        armed = None

        def arm(self, before: bool = False) -> None:
            self.armed = "before" if before else "after"

    drop = Drop()
    real_exit = psycopg.Transaction.__exit__

    def exit_then_drop(self, exc_type, exc, tb):
        when, drop.armed = drop.armed, None
        if when is None or exc_type is not None:
            return real_exit(self, exc_type, exc, tb)
        if when == "after":
            real_exit(self, None, None, None)  # committed
        else:
            self._conn.rollback()
        raise psycopg.OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(psycopg.Transaction, "__exit__", exit_then_drop)
    return drop


def test_a_create_whose_commit_went_through_before_the_connection_was_lost_is_recorded(pg_url, commit_then_drop):
    a = open_ledger(pg_url, "a")
    try:
        commit_then_drop.arm()
        record = add(a, body=b"committed")  # no LedgerUnavailable: it was recorded
        with raw(pg_url) as conn:
            assert conn.execute("SELECT count(*) FROM rev88_tasks").fetchone()[0] == 1
        assert a.get(record.id).status == "queued" and a.load_uploads([record.id]) == {record.id: b"committed"}
        commit_then_drop.arm(before=True)  # lost before its COMMIT: not recorded, and a 503 says so
        with pytest.raises(LedgerUnavailable) as lost:
            add(a)
        assert not lost.value.outcome_unknown
        with raw(pg_url) as conn:
            assert conn.execute("SELECT count(*) FROM rev88_tasks").fetchone()[0] == 1
    finally:
        a.close()


def test_a_create_whose_row_cannot_be_read_back_says_the_outcome_is_unknown(pg_url, commit_then_drop, monkeypatch):
    a = open_ledger(pg_url, "a")
    try:
        real_conn = a._conn

        def conn(doing, transaction=True):
            if doing.startswith("read back"):
                raise LedgerUnavailable(f"cannot {doing}: the database connection failed")
            return real_conn(doing, transaction)

        monkeypatch.setattr(a, "_conn", conn)
        commit_then_drop.arm()
        with pytest.raises(LedgerUnavailable, match="unknown") as unknown:
            add(a)
        assert unknown.value.outcome_unknown and "Idempotency-Key" in str(unknown.value)
    finally:
        a.close()


def test_reads_after_every_backend_was_terminated_are_tried_again_on_a_fresh_connection(pg_url):
    a = open_ledger(pg_url, "a", pool_size=3)
    try:
        tasks = [add(a) for _ in range(3)]
        with contextlib.ExitStack() as stack:  # three pooled connections, all idle in the pool
            conns = [stack.enter_context(a._pool.connection()) for _ in range(3)]
            assert len(conns) == 3
        with raw(pg_url) as conn:
            killed = conn.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                                  " WHERE application_name = 'rev88' AND pid <> pg_backend_pid()").fetchone()[0]
        assert killed >= 3
        for task in tasks:  # each read on a dead pooled connection first: tried again, answered
            assert a.get(task.id).id == task.id
        assert len(a.list()[0]) == 3 and a.counts()["total"] == 3
    finally:
        a.close()


def test_connection_options_bound_a_vanished_server_and_refuse_a_standby(pg_url):
    a = open_ledger(pg_url, "a", timeout_s=3)
    try:
        options = a._options()
        assert options["tcp_user_timeout"] == 3000 and options["target_session_attrs"] == "read-write"
        sep = "&" if "?" in pg_url else "?"
        b = open_ledger(pg_url + f"{sep}target_session_attrs=any&tcp_user_timeout=700", "b")
        try:
            assert "target_session_attrs" not in b._options() and "tcp_user_timeout" not in b._options()
        finally:
            b.close()
    finally:
        a.close()


def test_renewals_hold_while_every_pooled_connection_is_busy(pg_url):
    """Lease upkeep has a connection of its own: with the pool's only connection held by request
    traffic, a renewal still goes through, within a quarter lease."""
    a = open_ledger(pg_url, "a", pool_size=1, timeout_s=2, lease_s=4)
    try:
        task = add(a)
        [claim] = a.claim(1)
        with a._pool.connection():  # the pool is exhausted
            with pytest.raises(LedgerUnavailable, match="REV88_DB_POOL_SIZE"):
                a.get(task.id)
            t0 = time.monotonic()
            assert a.renew({task.id: claim.epoch}).held == [task.id]
            assert time.monotonic() - t0 < a.upkeep_timeout_s
    finally:
        a.close()
