"""The task ledger against both stores: a real SQLite file in tmp_path, and a real PostgreSQL
database (tests/pg.py: a throwaway server, or REV88_TEST_DATABASE_URL) -- round trips, uploads,
paging, idempotency, restarts, a real SIGKILL, retention. The ``store`` fixture runs a test on
each; the tests that take ``tmp_path`` alone (corrupt / newer / full database files, the upload
folder) are the SQLite store's own. PostgreSQL's own (migrations, claims, leases) are in
tests/test_ledger_pg.py."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest

from app.ledger import store as ledger_mod
from app.ledger.store import (
    FINISHED,
    SCHEMA_VERSION,
    STATUSES,
    AlreadyFinished,
    IdempotencyConflict,
    Ledger,
    LedgerError,
    LedgerUnavailable,
)

from .helpers import child_pythonpath
from .pg import pg_server  # noqa: F401 - the fixture the postgres store runs on

ROOT = Path(__file__).resolve().parents[1]
CONFIG = {"epochs": 2, "batch_size": 128, "learning_rate": 0.1, "momentum": 0.9, "seed": 11}


def new_id() -> str:
    return uuid.uuid4().hex


def create(ledger: Ledger, *, body: bytes | None = None, key: str | None = None, mode: str | None = None,
           options: dict | None = None, task_id: str | None = None, **extra):
    body_bytes = len(body) if body is not None else 1234
    sha = hashlib.sha256(body).hexdigest() if body is not None else "ab" * 32
    return ledger.create(
        task_id=task_id or new_id(), kind=extra.pop("kind", "task"),
        mode=mode or ("async" if body is not None else "sync"), backend=extra.pop("backend", "cpu"),
        config=extra.pop("config", CONFIG), options={"include_scores": False} if options is None else options,
        train_count=extra.pop("train_count", 100), test_count=extra.pop("test_count", 50),
        body_sha256=extra.pop("body_sha256", sha), body_bytes=body_bytes,
        input_hashes=extra.pop("input_hashes", {"train_images_sha256": "cd" * 32}),
        body=body, idempotency_key=key, **extra,
    )


def answer_for(task_id: str, n: int = 50, seed: int = 0) -> dict:
    predictions = np.random.default_rng(seed).integers(0, 10, n).tolist()
    return {
        "id": task_id,
        "request_id": "req-1",
        "predictions": predictions,
        "predictions_sha256": hashlib.sha256(np.asarray(predictions, np.int64).tobytes()).hexdigest(),
        "scores_sha256": "ef" * 32,
        "metadata": {"backend": "cpu", "device": "cpu", "train_count": 100, "test_count": n,
                     "training_prediction_seconds": 0.45, "versions": {"torch": "2.13.0"}},
        "timing": {"receive_ms": 1.0, "parse_ms": 2.0, "queue_wait_ms": 0.5, "run_ms": 450.125,
                   "run_clock": "perf_counter", "total_ms": 460.0},
        "energy": {"gross_j": 3.5, "idle_adjusted_j": 1.1, "method": "nvml-total-energy-counter-delta"},
        "device": "cpu",
        "versions": {"torch": "2.13.0"},
    }


class SqliteStore:
    """Ledgers in folders of tmp_path: ``open(name)`` opens (or reopens) the one named."""

    name = "sqlite"

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path

    def open(self, name: str = "data", **kw) -> Ledger:
        return Ledger(self.tmp_path / name, **kw)

    def location(self, name: str = "data") -> str:
        return str(self.tmp_path / name)

    def uploads(self, ledger) -> list[str]:
        """The task ids with a stored upload (every file in the uploads folder counts)."""
        return sorted(p.name.removesuffix(".npz") for p in ledger.uploads_dir.iterdir())

    def close(self) -> None:
        pass


class PostgresStore:
    """Ledgers in databases of a real PostgreSQL server: one database per name, created on first
    use; every ledger opened is the same replica ("test-replica"), as a restarted process is."""

    name = "postgres"

    def __init__(self, server) -> None:
        self.server = server
        self.urls: dict[str, str] = {}

    def location(self, name: str = "data") -> str:
        if name not in self.urls:
            self.urls[name] = self.server.new_database()
        return self.urls[name]

    def open(self, name: str = "data", **kw):
        from app.ledger.postgres import PostgresLedger

        return PostgresLedger(self.location(name), owner="test-replica", **kw)

    def uploads(self, ledger) -> list[str]:
        with ledger._conn("list the stored inputs", transaction=False) as conn:
            return sorted(r[0] for r in conn.execute("SELECT task_id FROM rev88_task_inputs").fetchall())

    def close(self) -> None:
        for url in self.urls.values():
            self.server.drop(url)


@pytest.fixture(params=["sqlite", "postgres"])
def store(request, tmp_path):
    """Each test that takes it runs once per store (the postgres one skips, saying why, without a server)."""
    st = SqliteStore(tmp_path) if request.param == "sqlite" else PostgresStore(request.getfixturevalue("pg_server"))
    yield st
    st.close()


@pytest.fixture
def ledger(store):
    led = store.open()
    yield led
    led.close()


@pytest.fixture
def sqlite_ledger(tmp_path):
    """For the SQLite store's own tests (its files and folders)."""
    led = Ledger(tmp_path / "data")
    yield led
    led.close()


def store_error(store, message: str) -> Exception:
    """The error the store's database driver raises, as its ledger would meet it."""
    if store.name == "sqlite":
        return sqlite3.OperationalError(message)
    import psycopg

    return psycopg.OperationalError(message)


def test_fresh_database_is_wal_at_the_current_schema(tmp_path):
    led = Ledger(tmp_path / "data")
    assert led.path == tmp_path / "data" / "ledger.sqlite3" and led.path.is_file()
    assert (tmp_path / "data" / "uploads").is_dir()
    counts = led.counts()
    assert counts["schema_version"] == SCHEMA_VERSION
    assert counts["tasks"] == {s: 0 for s in STATUSES} and counts["total"] == 0
    led.close()
    with sqlite3.connect(led.path) as raw:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_round_trip_create_running_finish(ledger):
    record, created = create(ledger, train_count=100, test_count=50)
    assert created and record.status == "queued" and record.mode == "sync" and record.kind == "task"
    assert record.started_at is None and record.finished_at is None and record.answer is None
    assert record.config == CONFIG and record.options == {"include_scores": False}
    assert record.input_hashes == {"train_images_sha256": "cd" * 32}
    assert ledger.get(record.id) == record

    ledger.mark_running(record.id, device="cpu")
    running = ledger.get(record.id)
    assert running.status == "running" and running.device == "cpu" and running.attempts == 1
    assert running.started_at >= running.created_at

    answer = answer_for(record.id)
    done = ledger.finish(record.id, "succeeded", answer=answer)
    assert done.status == "succeeded" and done.finished_at >= done.started_at
    assert done.answer == answer and done.error is None
    assert done.predictions_sha256 == answer["predictions_sha256"]
    assert done.run_ms == 450.125 and done.energy_j == 3.5
    assert ledger.get(record.id) == done

    summary = done.summary()
    assert "answer" not in summary and "predictions" not in summary and "error" not in summary
    assert json.loads(json.dumps(summary)) == summary
    assert summary["status"] == "succeeded" and summary["predictions_sha256"] == answer["predictions_sha256"]
    document = json.loads(json.dumps(done.document()))
    assert document["answer"] == answer and document["error"] is None and document["id"] == record.id

    with pytest.raises(AlreadyFinished) as info:
        ledger.finish(record.id, "cancelled")
    assert info.value.record.status == "succeeded"
    with pytest.raises(AlreadyFinished):
        ledger.mark_running(record.id)
    with pytest.raises(KeyError):
        ledger.mark_running("no-such-task")
    with pytest.raises(KeyError):
        ledger.finish("no-such-task", "cancelled")
    assert ledger.get("no-such-task") is None


def test_failed_and_cancelled_keep_their_error(ledger):
    failed, _ = create(ledger)
    cancelled, _ = create(ledger)
    ledger.mark_running(failed.id)
    error = {"status": 422, "error": "training diverged at step 3"}
    record = ledger.finish(failed.id, "failed", error=error)
    assert record.error == error and record.answer is None and record.predictions_sha256 is None
    record = ledger.finish(cancelled.id, "cancelled", error={"status": 499, "error": "client went away"})
    assert record.status == "cancelled" and record.started_at is None
    assert ledger.get(cancelled.id).document()["error"]["status"] == 499
    with pytest.raises(ValueError):
        ledger.finish(new_id(), "running")
    bogus, _ = create(ledger)
    with pytest.raises(ValueError):
        ledger.finish(bogus.id, "succeeded")  # no answer
    with pytest.raises(ValueError):
        ledger.finish(bogus.id, "failed")  # no error
    assert ledger.get(bogus.id).status == "queued"


def test_finish_many_writes_each_outcome_and_names_each_refusal(ledger):
    """One call, several outcomes: the good ones written (their records returned), each bad one
    answered with the exception ``finish`` gives it alone, without undoing the others."""
    from app.ledger import AlreadyFinished, Outcome

    good = [create(ledger)[0] for _ in range(3)]
    done, _ = create(ledger)
    ledger.finish(done.id, "cancelled")
    bogus, _ = create(ledger)
    ledger.mark_running(good[0].id)
    outcomes = [Outcome(good[0].id, "succeeded", answer_for(good[0].id), with_answer=False),
                Outcome("no-such-task", "cancelled"),
                Outcome(good[1].id, "failed", error={"status": 422, "error": "diverged"}),
                Outcome(done.id, "succeeded", answer_for(done.id)),
                Outcome(bogus.id, "succeeded"),  # no answer
                Outcome(good[2].id, "succeeded", answer_for(good[2].id, seed=2),
                        input_hashes=lambda: {"train_images_sha256": "12" * 32})]
    results = ledger.finish_many(outcomes)
    assert len(results) == len(outcomes)
    assert results[0].status == "succeeded" and results[0].answer is None and results[0].attempts == 1
    assert isinstance(results[1], KeyError)
    assert results[2].status == "failed" and results[2].error["error"] == "diverged"
    assert isinstance(results[3], AlreadyFinished)
    assert isinstance(results[4], ValueError) and ledger.get(bogus.id).status == "queued"
    assert results[5].answer == answer_for(good[2].id, seed=2)
    assert results[5].input_hashes == {"train_images_sha256": "12" * 32}
    assert ledger.get(good[0].id).answer == answer_for(good[0].id)
    assert ledger.get(done.id).status == "cancelled"
    assert ledger.finish_many([]) == []


def test_async_body_is_stored_then_deleted_on_finish(store, ledger):
    body = os.urandom(100_000)
    record, created = create(ledger, body=body)
    assert created and record.mode == "async" and record.body_bytes == len(body)
    assert ledger.load_upload(record.id) == body and store.uploads(ledger) == [record.id]
    if store.name == "sqlite":
        upload = ledger.upload_path(record.id)
        assert upload.read_bytes() == body
        assert not list(upload.parent.glob("*.tmp"))
    assert ledger.counts()["upload_files"] == 1 and ledger.counts()["upload_bytes"] == len(body)
    ledger.mark_running(record.id, device="cuda:0")
    ledger.finish(record.id, "succeeded", answer=answer_for(record.id))
    assert store.uploads(ledger) == []
    with pytest.raises(LedgerError, match=str(ledger.upload_path(record.id)) if store.name == "sqlite"
                       else f"upload of task {record.id} is missing"):
        ledger.load_upload(record.id)
    assert ledger.counts()["upload_files"] == 0
    with pytest.raises(ValueError, match="body_bytes"):
        ledger.create(task_id=new_id(), kind="task", mode="async", backend="cpu", config={}, options={},
                      train_count=1, test_count=1, body_sha256="0" * 64, body_bytes=3, body=b"four")


def test_list_newest_first_pages_and_status_filter(ledger):
    ids = []
    for i in range(23):
        record, _ = create(ledger)
        ids.append(record.id)
        if i % 3 == 0:
            ledger.finish(record.id, "succeeded", answer=answer_for(record.id))
        elif i % 3 == 1:
            ledger.mark_running(record.id)
    everything = [ledger.get(i) for i in ids]
    expected = [r.id for r in sorted(everything, key=lambda r: (r.created_at, r.id), reverse=True)]

    seen, cursor, pages = [], None, 0
    while True:
        page, cursor = ledger.list(limit=5, cursor=cursor)
        pages += 1
        assert all(r.answer is None for r in page)
        seen += [r.id for r in page]
        if cursor is None:
            break
    assert seen == expected and pages == 5

    exact, cursor = ledger.list(limit=23)
    assert [r.id for r in exact] == expected and cursor is None
    first, cursor = ledger.list(limit=22)
    assert len(first) == 22 and cursor is not None
    last, end = ledger.list(limit=22, cursor=cursor)
    assert [r.id for r in last] == expected[22:] and end is None

    succeeded, cursor = ledger.list(limit=3, status="succeeded")
    more, end = ledger.list(limit=3, cursor=cursor, status="succeeded")
    rest, none = ledger.list(limit=3, cursor=end, status="succeeded")
    got = [r.id for r in succeeded + more + rest]
    assert got == [i for i in expected if ledger.get(i).status == "succeeded"] and len(got) == 8
    assert none is None
    assert all(r.status == "succeeded" and r.predictions_sha256 for r in succeeded)
    running, _ = ledger.list(status="running")
    assert len(running) == 8 and {r.status for r in running} == {"running"}
    assert ledger.list(status="failed") == ([], None)

    with pytest.raises(ValueError, match="cursor"):
        ledger.list(cursor="not a cursor!")
    with pytest.raises(ValueError, match="cursor"):
        ledger.list(cursor="WzEsMiwzXQ")  # valid base64 JSON, wrong shape
    with pytest.raises(ValueError, match="status"):
        ledger.list(status="done")
    with pytest.raises(ValueError, match="limit"):
        ledger.list(limit=0)


def test_idempotent_create(store, ledger):
    body = b"npz bytes " * 100
    first, created = create(ledger, body=body, key="key-1")
    assert created
    again, created_again = create(ledger, body=body, key="key-1")
    assert not created_again and again.id == first.id
    assert store.uploads(ledger) == [first.id]  # the repeat stored no upload

    with pytest.raises(IdempotencyConflict) as info:
        create(ledger, body=b"another body", key="key-1")
    assert info.value.key == "key-1" and info.value.task_id == first.id
    with pytest.raises(IdempotencyConflict):
        create(ledger, body=body, key="key-1", options={"include_scores": True})
    with pytest.raises(IdempotencyConflict):
        create(ledger, body=body, key="key-1", backend="cpu-fast")
    with pytest.raises(IdempotencyConflict):
        create(ledger, body=body, key="key-1", config={**CONFIG, "seed": 12})
    assert store.uploads(ledger) == [first.id]

    # Still the same task once it has finished; key order in dicts does not matter.
    ledger.finish(first.id, "succeeded", answer=answer_for(first.id))
    done, created = create(ledger, body=body, key="key-1", config=dict(reversed(list(CONFIG.items()))))
    assert not created and done.status == "succeeded" and done.answer is not None
    other, created = create(ledger, body=body, key="key-2")
    assert created and other.id != first.id
    assert ledger.counts()["total"] == 2

    with pytest.raises(ValueError, match="already in the ledger"):
        create(ledger, task_id=first.id)


def test_idempotent_create_from_many_threads_makes_one_task(store, ledger):
    body = os.urandom(50_000)
    results, errors = [], []

    def worker():
        try:
            results.append(create(ledger, body=body, key="shared"))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sum(created for _, created in results) == 1
    assert len({record.id for record, _ in results}) == 1
    assert store.uploads(ledger) == [results[0][0].id]


def test_many_threads_create_run_and_finish(ledger):
    errors = []

    def worker(n):
        try:
            for i in range(15):
                record, _ = create(ledger, body=os.urandom(2000) if i % 2 else None)
                ledger.mark_running(record.id, device=f"worker-{n}")
                ledger.finish(record.id, "succeeded", answer=answer_for(record.id, seed=i))
                assert ledger.get(record.id).status == "succeeded"
                ledger.list(limit=7)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert ledger.counts()["tasks"]["succeeded"] == 90 and ledger.counts()["upload_files"] == 0


def test_failed_retention_does_not_fail_the_finish(store, ledger, monkeypatch, caplog):
    def full(conn, keep):
        raise store_error(store, "database or disk is full")

    monkeypatch.setattr(ledger, "_apply_retention", full)
    monkeypatch.setattr(ledger, "retain_tasks", 0)  # over the limit: retention must run (within it, none opens)
    record, _ = create(ledger)
    with caplog.at_level("WARNING", logger="rev88.app.ledger"):
        done = ledger.finish(record.id, "succeeded", answer=answer_for(record.id))
    assert done.status == "succeeded" and ledger.get(record.id).answer is not None
    assert "retention skipped" in caplog.text and "database or disk is full" in caplog.text


def test_reopen_after_close_keeps_everything(store):
    led = store.open()
    done, _ = create(led, key="k")
    answer = answer_for(done.id, n=1000, seed=3)
    led.mark_running(done.id, device="cpu")
    done = led.finish(done.id, "succeeded", answer=answer)
    waiting, _ = create(led, body=b"payload")
    before = led.counts()
    led.close()
    with pytest.raises(LedgerUnavailable, match="closed"):
        led.get(done.id)

    led = store.open()
    assert led.get(done.id) == done and led.get(done.id).answer == answer
    assert led.get(waiting.id).status == "queued" and led.load_upload(waiting.id) == b"payload"
    after = led.counts()
    assert {k: after[k] for k in ("tasks", "answer_bytes", "schema_version")} == \
        {k: before[k] for k in ("tasks", "answer_bytes", "schema_version")}
    assert create(led, key="k")[0].id == done.id  # idempotency survives the restart
    led.close()


def test_unfinished_after_a_simulated_crash(store):
    led = store.open()
    queued, _ = create(led, body=b"first")
    running, _ = create(led, body=b"second")
    finished, _ = create(led, body=b"third")
    sync, _ = create(led)
    led.mark_running(running.id, device="cuda:0")
    led.finish(finished.id, "failed", error={"status": 422, "error": "bad labels"})
    led.mark_running(sync.id)
    del led  # no close, no finish: the process "died"

    led = store.open()
    left = led.unfinished()
    assert [r.id for r in left] == [queued.id, running.id, sync.id]  # oldest first
    assert [r.status for r in left] == ["queued", "running", "running"]
    assert led.load_upload(queued.id) == b"first" and led.load_upload(running.id) == b"second"
    assert finished.id not in store.uploads(led)
    # Re-run after the restart: running again counts a second attempt.
    led.mark_running(running.id, device="cuda:1")
    again = led.get(running.id)
    assert again.attempts == 2 and again.device == "cuda:1"
    led.close()


CHILD = r"""
import hashlib, sys
from app.ledger import Ledger
if sys.argv[1].startswith("postgresql://"):
    from app.ledger.postgres import PostgresLedger
    led = PostgresLedger(sys.argv[1], owner="child")
else:
    led = Ledger(sys.argv[1])
body = bytes(range(256)) * 4096
record, created = led.create(
    task_id=sys.argv[2], kind="task", mode="async", backend="cpu", config={"seed": 11},
    options={"include_scores": True}, train_count=10, test_count=5,
    body_sha256=hashlib.sha256(body).hexdigest(), body_bytes=len(body), body=body, idempotency_key="crash")
print("created", record.id, flush=True)
sys.stdin.read()  # wait to be killed
"""


def test_sigkill_right_after_create_loses_nothing(store):
    task_id = new_id()
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, store.location(), task_id], cwd=ROOT, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": child_pythonpath(ROOT)},
    )
    try:
        line = child.stdout.readline()
        assert line.split() == ["created", task_id], child.stderr.read()
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL

    led = store.open()
    [record] = led.unfinished()
    body = bytes(range(256)) * 4096
    assert record.id == task_id and record.status == "queued" and record.options == {"include_scores": True}
    assert record.body_sha256 == hashlib.sha256(body).hexdigest()
    assert led.load_upload(task_id) == body
    assert store.uploads(led) == [task_id]  # no temp file either
    led.close()


def test_retention_deletes_the_oldest_finished_first(store):
    led = store.open(retain_tasks=3)
    queued, _ = create(led, body=b"waits")
    running, _ = create(led)
    led.mark_running(running.id)
    finished = []
    for i in range(6):
        record, _ = create(led)
        led.finish(record.id, "succeeded", answer=answer_for(record.id, seed=i))
        finished.append(record.id)
    assert [led.get(i) is not None for i in finished] == [False, False, False, True, True, True]
    assert led.get(queued.id).status == "queued" and led.get(running.id).status == "running"
    assert led.load_upload(queued.id) == b"waits"
    counts = led.counts()
    assert counts["tasks"]["succeeded"] == 3 and counts["total"] == 5
    # The order is by finishing: an old task that finishes last is the newest finished.
    led.finish(queued.id, "cancelled")
    assert led.get(queued.id) is not None and led.get(finished[3]) is None
    led.close()

    # A lower limit at the next start applies at open.
    led = store.open(retain_tasks=1)
    assert led.counts()["tasks"] == {"queued": 0, "running": 1, "succeeded": 0, "failed": 0, "cancelled": 1}
    assert led.get(queued.id) is not None
    led.close()


def test_retention_by_stored_bytes_keeps_the_task_just_finished(store):
    led = store.open(retain_bytes=10_000)
    ids = []
    for i in range(4):
        record, _ = create(led)
        done = led.finish(record.id, "succeeded", answer=answer_for(record.id, n=5000, seed=i))
        assert done.answer_bytes > 2_000
        ids.append(record.id)
    stored = led.counts()["answer_bytes"]
    assert stored <= 10_000
    assert led.get(ids[-1]) is not None and led.get(ids[0]) is None
    # A single answer over the whole budget is still kept until the next finish.
    tiny = store.open("tiny", retain_bytes=100)
    big, _ = create(tiny)
    tiny.finish(big.id, "succeeded", answer=answer_for(big.id, n=5000))
    assert tiny.get(big.id).answer is not None
    nxt, _ = create(tiny)
    tiny.finish(nxt.id, "failed", error={"status": 500, "error": "boom"})
    assert tiny.get(big.id) is None and tiny.get(nxt.id) is not None
    tiny.close()
    led.close()


def test_a_10k_answer_is_stored_compressed(ledger):
    record, _ = create(ledger, test_count=10_000)
    answer = answer_for(record.id, n=10_000)
    json_bytes = len(json.dumps(answer).encode())
    done = ledger.finish(record.id, "succeeded", answer=answer)
    counts = ledger.counts()
    print(f"10k-prediction answer: {json_bytes} bytes of JSON, {done.answer_bytes} stored (zlib)")
    assert counts["answer_json_bytes"] <= json_bytes and counts["answer_bytes"] == done.answer_bytes
    assert done.answer_bytes < json_bytes / 3
    assert ledger.get(record.id).answer == answer


def test_garbage_database_file_is_a_clear_error(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "ledger.sqlite3").write_bytes(b"this is not sqlite at all " * 400)
    with pytest.raises(LedgerError) as info:
        Ledger(data)
    message = str(info.value)
    assert str(data / "ledger.sqlite3") in message and "file is not a database" in message
    assert "corrupt" in message


def test_malformed_database_is_a_clear_error(tmp_path):
    data = tmp_path / "data"
    led = Ledger(data)
    for i in range(200):
        record, _ = create(led)
        led.finish(record.id, "succeeded", answer=answer_for(record.id, n=200, seed=i))
    led.close()
    path = data / "ledger.sqlite3"
    raw = bytearray(path.read_bytes())
    page = 4096
    assert len(raw) > 6 * page
    for offset in range(page, len(raw), page):  # keep the header page, scribble over every other page
        raw[offset:offset + 64] = b"\xa5" * 64
    path.write_bytes(bytes(raw))
    with pytest.raises(LedgerError) as info:
        Ledger(data)
    message = str(info.value)
    assert str(path) in message
    assert "malformed" in message or "quick_check" in message


def test_newer_schema_is_refused_naming_both_versions(tmp_path):
    data = tmp_path / "data"
    Ledger(data).close()
    with sqlite3.connect(data / "ledger.sqlite3") as raw:
        raw.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 5}")
    with pytest.raises(LedgerError) as info:
        Ledger(data)
    message = str(info.value)
    assert f"schema version {SCHEMA_VERSION + 5}" in message and f"this code's {SCHEMA_VERSION}" in message
    assert str(data / "ledger.sqlite3") in message


def test_migrations_apply_in_order_in_a_transaction(tmp_path, monkeypatch):
    data = tmp_path / "data"
    Ledger(data).close()
    extra = (SCHEMA_VERSION + 1, "ALTER TABLE tasks ADD COLUMN note TEXT;\nCREATE INDEX tasks_note ON tasks (note);")
    broken = (SCHEMA_VERSION + 2, "ALTER TABLE tasks ADD COLUMN other TEXT;\nTHIS IS NOT SQL;")
    monkeypatch.setattr(ledger_mod, "MIGRATIONS", [*ledger_mod.MIGRATIONS, extra, broken])
    monkeypatch.setattr(ledger_mod, "SCHEMA_VERSION", SCHEMA_VERSION + 2)
    with pytest.raises(LedgerError):
        Ledger(data)
    with sqlite3.connect(data / "ledger.sqlite3") as raw:
        # The good migration is committed; the broken one rolled back whole (no "other" column).
        assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION + 1
        columns = {row[1] for row in raw.execute("PRAGMA table_info(tasks)")}
        assert "note" in columns and "other" not in columns


def test_a_version_1_ledger_is_migrated_with_its_rows(tmp_path):
    """A ledger as version 1 left it (its migration's own SQL, rows written in its columns) opens
    migrated to the latest version, every row and index kept. Built with SQL rather than today's
    code, so that a column added later (app/task_row.py plus a migration) leaves this test alone."""
    from app.ledger.rows import encode_answer

    data = tmp_path / "data"
    data.mkdir()
    (data / "uploads").mkdir()
    done_id, queued_id = new_id(), new_id()
    blob, json_bytes, _ = encode_answer(answer_for(done_id))
    with sqlite3.connect(data / "ledger.sqlite3") as raw:
        for statement in ledger_mod._split_sql(dict(ledger_mod.MIGRATIONS)[1]):
            raw.execute(statement)
        raw.execute("PRAGMA user_version = 1")
        columns = ("id, status, kind, mode, created_at, finished_at, attempts, backend, config, options, train_count,"
                   " test_count, body_sha256, body_bytes, has_upload, idempotency_key, answer, answer_codec,"
                   " answer_bytes, answer_json_bytes")
        raw.execute(f"INSERT INTO tasks ({columns}) VALUES (?, 'succeeded', 'task', 'sync', 1.0, 2.0, 1, 'cpu',"
                    " '{}', '{}', 100, 50, ?, 1234, 0, NULL, ?, 'zlib+json', ?, ?)",
                    (done_id, "ab" * 32, blob, len(blob), json_bytes))
        raw.execute(f"INSERT INTO tasks ({columns}) VALUES (?, 'queued', 'task', 'async', 3.0, NULL, 0, 'cpu', '{{}}',"
                    " '{}', 100, 50, ?, 9, 1, 'k1', NULL, NULL, 0, 0)",
                    (queued_id, hashlib.sha256(b"an upload").hexdigest()))
        with pytest.raises(sqlite3.IntegrityError):  # version 1: every row needs its body hash
            raw.execute("UPDATE tasks SET body_sha256 = NULL WHERE id = ?", (done_id,))
    (data / "uploads" / f"{queued_id}.npz").write_bytes(b"an upload")
    new = Ledger(data)  # version 2: the table rebuilt, every row and index kept; 3: the webhook outbox; ...
    with sqlite3.connect(data / "ledger.sqlite3") as raw:
        assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == len(ledger_mod.MIGRATIONS)
        indexes = {row[0] for row in raw.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
        assert {"tasks_newest", "tasks_status_newest", "tasks_finished"} <= indexes
        tables = {row[0] for row in raw.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        assert {"webhook_messages", "webhook_attempts", "webhook_secrets", "webhook_stopped"} <= tables
    assert new.get(done_id).answer == answer_for(done_id)
    assert new.get(queued_id).body_sha256 == hashlib.sha256(b"an upload").hexdigest()
    assert [r.id for r in new.unfinished()] == [queued_id]
    assert new.load_upload(queued_id) == b"an upload"
    unhashed, _ = create(new, body_sha256=None)
    assert new.get(unhashed.id).body_sha256 is None


def test_an_unhashed_body_is_refused_where_its_hash_is_needed(store):
    ledger = store.open()
    with pytest.raises(ValueError, match="body_sha256"):
        create(ledger, body_sha256=None, key="needs-a-hash")
    with pytest.raises(ValueError, match="body_sha256"):
        create(ledger, body=b"stored", body_sha256=None)


def test_full_database_is_ledger_unavailable_on_write(tmp_path):
    data = tmp_path / "data"
    Ledger(data).close()
    size = (data / "ledger.sqlite3").stat().st_size
    led = Ledger(data, max_db_bytes=size)  # no room to grow: every new page fails as a full disk would
    with pytest.raises(LedgerUnavailable) as info:
        for _ in range(50):
            create(led, config={"padding": "x" * 3000})
    message = str(info.value)
    assert "database or disk is full" in message and str(data) in message
    assert led.counts()["total"] < 50  # reads still work
    led.close()

    # Room for the row, not for a large answer: the finish fails loudly and the task stays running.
    led = Ledger(data, max_db_bytes=size + 8 * 4096)
    record, _ = create(led)
    led.mark_running(record.id)
    big = answer_for(record.id, n=200_000)
    with pytest.raises(LedgerUnavailable, match="database or disk is full"):
        led.finish(record.id, "succeeded", answer=big)
    assert led.get(record.id).status == "running"
    led.close()


def test_upload_write_failure_is_ledger_unavailable_and_records_nothing(sqlite_ledger, monkeypatch):
    ledger = sqlite_ledger

    def no_space(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ledger_mod.os, "fsync", no_space)
    with pytest.raises(LedgerUnavailable) as info:
        create(ledger, body=b"x" * 1000)
    assert "no space left" in str(info.value) and str(ledger.data_dir) in str(info.value)
    monkeypatch.undo()
    assert ledger.counts()["total"] == 0 and list(ledger.uploads_dir.iterdir()) == []


def test_uploads_folder_gone_at_run_time_is_ledger_unavailable(sqlite_ledger):
    ledger = sqlite_ledger
    ledger.uploads_dir.rmdir()
    ledger.uploads_dir.write_bytes(b"a regular file where the folder was")
    with pytest.raises(LedgerUnavailable, match="cannot store the upload"):
        create(ledger, body=b"x")
    assert ledger.counts()["total"] == 0


def test_data_dir_that_cannot_be_created_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(LedgerError, match="cannot create the ledger folder .*a-file/data"):
        Ledger(blocker / "data")


def test_orphans_are_cleaned_at_open(tmp_path):
    data = tmp_path / "data"
    led = Ledger(data)
    kept, _ = create(led, body=b"keep me")
    gone, _ = create(led, body=b"finished")
    led.finish(gone.id, "cancelled")
    led.close()
    (data / "uploads" / f"{gone.id}.npz").write_bytes(b"left by a crash between commit and unlink")
    (data / "uploads" / "abc.npz.123.456.tmp").write_bytes(b"half-written")
    (data / "uploads" / f"{new_id()}.npz").write_bytes(b"never committed")
    led = Ledger(data)
    assert [p.name for p in led.uploads_dir.iterdir()] == [f"{kept.id}.npz"]
    led.close()


def test_statuses_and_finished_are_as_documented():
    assert STATUSES == ("queued", "running", "succeeded", "failed", "cancelled")
    assert FINISHED == ("succeeded", "failed", "cancelled")


def test_the_embedded_claims_check_each_task_against_the_ledger_and_follow_the_picks(tmp_path):
    """SQLite's claims (app/ledger/local_claims.py): a task finished in the ledger while it waited in
    the index -- by any path, a cancel included -- is never claimed, and leaves the index; each
    tenant's oldest tasks are taken as many as picked, then the oldest of any tenant."""
    from app.ledger.local_claims import LocalClaims

    ledger = Ledger(tmp_path / "data")
    claims = LocalClaims(ledger)
    made = {}
    for i, owner in enumerate(["a", "a", "a", "b", "b", None]):
        record, _ = create(ledger, mode="async", options={"include_scores": False, **({"owner": owner} if owner else {})})
        made[record.id] = owner
        claims.add(record.id, owner, 1000.0 + i)
    ids = list(made)
    ledger.finish(ids[0], "cancelled", error={"status": 409, "error": "cancelled before it ran"})  # (not discarded)
    got = claims.claim(3, [("b", 1), ("a", 1)])
    assert [c.task_id for c in got] == [ids[1], ids[3]]  # a's oldest unfinished and b's oldest; not the cancelled
    assert len(claims) == 3  # the cancelled one left the index
    assert claims.waiting() == {"a": (1, 1002.0), "b": (1, 1004.0), "": (1, 1005.0)}
    rest = claims.claim(5, [("", 1)])
    assert [c.task_id for c in rest] == [ids[2], ids[4], ids[5]]  # the pick, then the oldest of any tenant
    assert claims.claim(5) == [] and len(claims) == 0
    ledger.close()


def test_the_embedded_claims_lose_nothing_when_the_ledger_cannot_be_read_and_release_only_unfinished_work(tmp_path):
    """A claim whose check against the ledger fails (the database away) raises, and every task it
    took waits again, in its place; tasks released back (taken out of the device queue, a failed
    queueing) wait again only if the ledger still has them unfinished."""
    from app.ledger import LedgerUnavailable
    from app.ledger.local_claims import LocalClaims

    ledger = Ledger(tmp_path / "data")
    claims = LocalClaims(ledger)
    ids = []
    for i, owner in enumerate(["a", "b", "a"]):
        record, _ = create(ledger, mode="async", options={"include_scores": False, "owner": owner})
        ids.append(record.id)
        claims.add(record.id, owner, 1000.0 + i, 100)
    before = (len(claims), claims.waiting(), claims.waiting_bytes())
    real = ledger.statuses
    ledger.statuses = lambda *a, **k: (_ for _ in ()).throw(LedgerUnavailable("the database is away"))
    with pytest.raises(LedgerUnavailable):
        claims.claim(2, [("a", 2)])
    ledger.statuses = real
    assert (len(claims), claims.waiting(), claims.waiting_bytes()) == before  # nothing lost
    got = claims.claim(3)
    assert [c.task_id for c in got] == ids and len(claims) == 0
    ledger.finish(ids[1], "cancelled", error={"status": 409, "error": "cancelled"})
    assert claims.release(ids) == [ids[0], ids[2]]  # the cancelled one does not wait again
    assert {t: n for t, (n, _) in claims.waiting().items()} == {"a": 2} and len(claims) == 2
    ledger.close()
