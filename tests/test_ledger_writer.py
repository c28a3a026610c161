"""app/ledger/writer.py with a real ledger file: a device worker's hand-over never waits for the
database, the running marks of a launch share one transaction, and a task's running mark is
always written before its result."""

from __future__ import annotations

import threading
import time

from app.ledger import FinishedTask, Ledger, Outcome
from app.ledger.writer import LedgerWriter

from .test_ledger import answer_for, create


def test_a_launchs_running_marks_share_one_transaction_and_come_before_the_results(tmp_path):
    ledger = Ledger(tmp_path / "data")
    writer = LedgerWriter(ledger)
    records = [create(ledger)[0] for _ in range(132)]  # a full H200 launch
    hold, holding = threading.Event(), threading.Event()
    writer.call(lambda: (holding.set(), hold.wait(30)))  # the writer busy (a slow disk, say)
    assert holding.wait(30)
    for r in records:  # the device worker's hand-over: returns while the writer cannot write
        writer.started(r.id, "cuda:0", time.time())
    assert all(ledger.get(r.id).status == "queued" for r in records)
    done = writer.call(ledger.finish, records[0].id, "succeeded", answer_for(records[0].id))
    hold.set()
    finished = done.result(30)
    assert writer.batches == 1  # 132 marks, one transaction
    assert finished.status == "succeeded" and finished.started_at is not None and finished.attempts == 1
    assert all(ledger.get(r.id).status == "running" and ledger.get(r.id).device == "cuda:0" for r in records[1:])
    assert writer.close(30)
    ledger.close()


def test_a_mark_for_a_task_finished_meanwhile_is_left_alone(tmp_path):
    ledger = Ledger(tmp_path / "data")
    writer = LedgerWriter(ledger)
    gone, _ = create(ledger)
    ledger.finish(gone.id, "cancelled", error={"status": 409, "error": "cancelled before it ran"})
    kept, _ = create(ledger)
    writer.started(gone.id, "cpu:0", time.time())
    writer.started(kept.id, "cpu:0", time.time())
    writer.started("no-such-task", "cpu:0", time.time())
    assert writer.close(30)
    assert ledger.get(gone.id).status == "cancelled" and ledger.get(gone.id).started_at is None
    assert ledger.get(kept.id).status == "running"
    assert ledger.mark_running_many([(gone.id, None, time.time()), ("no-such-task", None, time.time())]) == [
        gone.id, "no-such-task"]
    ledger.close()


def test_a_failing_call_reaches_its_caller_and_the_writer_goes_on(tmp_path):
    ledger = Ledger(tmp_path / "data")
    writer = LedgerWriter(ledger)
    failed = writer.call(ledger.finish, "no-such-task", "cancelled")
    try:
        failed.result(30)
        raise AssertionError("finishing an unknown task must raise")
    except KeyError:
        pass
    record, _ = create(ledger)
    assert writer.call(ledger.get, record.id).result(30).status == "queued"
    assert writer.close(30)
    ledger.close()


def finished_task(i: int, **kw) -> FinishedTask:
    return FinishedTask(task_id=f"sync-{i:04d}", kind="task", mode="sync", backend="cpu", config={"seed": i},
                        options={"include_scores": False, "measure": None}, train_count=10, test_count=2,
                        body_bytes=1234, created_at=time.time(), status="succeeded",
                        answer=answer_for(f"sync-{i:04d}"), input_hashes=lambda: {"train_images": "ab" * 32},
                        started_at=time.time(), device="cpu:0", **kw)


def test_finished_synchronous_tasks_share_one_group_commit(tmp_path):
    """Records handed over while the writer is busy are written together: one transaction."""
    ledger = Ledger(tmp_path / "data")
    writer = LedgerWriter(ledger)
    hold, holding = threading.Event(), threading.Event()
    writer.call(lambda: (holding.set(), hold.wait(30)))
    assert holding.wait(30)
    futures = [writer.finished(finished_task(i)) for i in range(50)]
    assert ledger.get("sync-0000") is None  # not written while the writer is held
    hold.set()
    assert [f.result(30) for f in futures] == [None] * 50
    assert writer.group_commits == 1
    record = ledger.get("sync-0007")
    assert record.status == "succeeded" and record.mode == "sync" and record.attempts == 1
    assert record.answer == answer_for("sync-0007") and record.input_hashes == {"train_images": "ab" * 32}
    assert record.device == "cpu:0" and record.finished_at >= record.started_at >= record.created_at
    assert ledger.counts()["tasks"]["succeeded"] == 50
    # the same id twice is refused (nothing of that batch is written), and every waiting caller hears it
    again = writer.finished(finished_task(7))
    try:
        again.result(30)
        raise AssertionError("an id already in the ledger must be refused")
    except ValueError as exc:
        assert "already in the ledger" in str(exc)
    assert writer.close(30)
    ledger.close()


def test_retention_applies_to_tasks_recorded_when_finished(tmp_path):
    ledger = Ledger(tmp_path / "data", retain_tasks=5)
    ledger.add_finished([finished_task(i) for i in range(12)])
    assert ledger.counts()["total"] == 5
    assert ledger.get("sync-0011") is not None  # the newest are kept
    ledger.close()


def test_a_group_commit_of_answered_tasks_does_not_wait_for_the_disk_but_the_rest_does(tmp_path):
    """The records of tasks whose clients hold their answers commit with synchronous = NORMAL (WAL:
    they survive the process, not the machine); every other write, and the connection after, stays FULL."""
    ledger = Ledger(tmp_path / "data")
    statements: list[str] = []
    ledger._conn.set_trace_callback(statements.append)
    ledger.add_finished([finished_task(1), finished_task(2)])
    assert statements[:2] == ["PRAGMA synchronous = NORMAL", "BEGIN IMMEDIATE"]
    assert statements.index("COMMIT") < statements.index("PRAGMA synchronous = FULL")
    statements.clear()
    record, _ = create(ledger)
    ledger.finish(record.id, "succeeded", answer_for(record.id))
    assert not any(s.startswith("PRAGMA synchronous") for s in statements)
    ledger._conn.set_trace_callback(None)
    assert ledger._conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    assert ledger.get("sync-0002").status == "succeeded"
    ledger.close()


def test_answered_records_wait_to_share_a_commit_until_a_read_or_the_stop_needs_them(tmp_path):
    ledger = Ledger(tmp_path / "data")
    writer = LedgerWriter(ledger)
    writer.linger_s = 60.0  # far longer than the test: only what arrives may end the wait
    assert writer.written() is None  # nothing handed over: a read need not wait
    futures = [writer.finished(finished_task(i)) for i in range(3)]
    time.sleep(0.3)
    assert ledger.get("sync-0000") is None and not any(f.done() for f in futures)  # waiting for company
    barrier = writer.written()
    assert barrier is not None
    barrier.result(10)  # a read's barrier: the commit is taken at once
    assert [f.result(0) for f in futures] == [None] * 3 and writer.group_commits == 1
    assert ledger.get("sync-0002").status == "succeeded" and writer.written() is None
    late = writer.finished(finished_task(3))
    t = time.monotonic()
    assert writer.close(30) and time.monotonic() - t < 10  # the stop writes it without the wait
    assert late.result(0) is None and ledger.get("sync-0003").status == "succeeded"
    ledger.close()


def test_a_record_someone_waits_for_does_not_linger(tmp_path):
    ledger = Ledger(tmp_path / "data")
    writer = LedgerWriter(ledger)
    writer.linger_s = 60.0
    t = time.monotonic()
    assert writer.finished(finished_task(5), linger=False).result(10) is None  # (a failed task's record)
    assert time.monotonic() - t < 10 and ledger.get("sync-0005").status == "succeeded"
    assert writer.close(30)
    ledger.close()


def test_asynchronous_outcomes_share_one_transaction_and_a_waited_one_does_not_linger(tmp_path):
    """Outcomes handed over together are written by one ``finish_many``; an outcome nobody
    waits on lingers for company (up to ``linger_s``), one a client waits on is written at once."""
    ledger = Ledger(tmp_path / "data")
    writer = LedgerWriter(ledger)
    records = [create(ledger, mode="async")[0] for _ in range(20)]
    calls = []
    real = ledger.finish_many
    ledger.finish_many = lambda outcomes: (calls.append(len(outcomes)), real(outcomes))[1]
    hold, holding = threading.Event(), threading.Event()
    writer.call(lambda: (holding.set(), hold.wait(30)))
    assert holding.wait(30)
    for r in records:
        writer.started(r.id, "cpu:0", time.time())
    futures = [writer.finish(Outcome(r.id, "succeeded", answer_for(r.id), with_answer=False)) for r in records]
    hold.set()
    assert all(f.result(30).status == "succeeded" for f in futures)
    assert calls == [20] and writer.batches == 1
    assert all(ledger.get(r.id).attempts == 1 for r in records)  # each marked running before its result
    # alone, a lingering outcome waits (a long linger: it is still unwritten when a waited one comes)
    writer.linger_s = 30.0
    late, now = create(ledger, mode="async")[0], create(ledger)[0]
    lingering = writer.finish(Outcome(late.id, "cancelled"))
    time.sleep(0.2)
    assert not lingering.done() and ledger.get(late.id).status == "queued"
    waited = writer.finish(Outcome(now.id, "cancelled"), linger=False)
    assert waited.result(5).status == "cancelled" and lingering.result(5).status == "cancelled"
    assert calls[-1] == 2
    # a refused outcome reaches its caller; the writer goes on
    refused = writer.finish(Outcome("no-such-task", "cancelled"), linger=False)
    try:
        refused.result(5)
        raise AssertionError("an unknown task's outcome must be refused")
    except KeyError:
        pass
    assert writer.close(30)
    ledger.close()
