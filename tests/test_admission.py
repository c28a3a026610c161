"""Admission by tenant (issue #44): no tenant locks another out.

Asynchronous work (uploads, sweep and evaluation cells, recovered tasks) waits in the ledger and
is claimed into the device queue by fair share; a synchronous task is admitted against its
tenant's share of the device queue, taking back a fed task when the queue is full; nothing queues
past the device queue's capacity. First the executor's rules on their own, then real servers:
one process on SQLite and two replicas on PostgreSQL, with backends held at a gate so that the
order is observed, not timed."""

from __future__ import annotations

import json
import threading

import httpx
import numpy as np
import pytest

from app.errors import QueueFull, Requeued
from app.main import create_app
from app.runtime.executor import DeviceExecutor
from app.settings import Settings
from learner.hashing import array_sha256
from learner.taskio import task_to_npz_bytes

from . import pg
from .gates import FileGate, Gate, gated_engines
from .helpers import small_task
from .server import inprocess_server, post_task, wait_for

pg_server, pg_url = pg.pg_server, pg.pg_url  # the fixtures (tests/pg.py)

ADMIN_KEY = "admin-key-for-admission"
ASYNC = {"Prefer": "respond-async"}
TASK = small_task(24, 4, seed=44)
BODY = task_to_npz_bytes(TASK)
FINISHED = ("succeeded", "failed", "cancelled")


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# --------------------------------------------------------------------------- the executor's rules


def _hold(ex: DeviceExecutor, release: threading.Event):
    """One job holding the only worker, so that what follows waits in the queue."""
    job = ex.submit(lambda: release.wait(30), tenant="x", evictable=True)
    wait_for(lambda: ex.busy_workers() == 1, 10, what="the worker busy")
    return job


def test_shares_are_the_capacity_by_weight_among_the_tenants_waiting():
    ex = DeviceExecutor(capacity=8)
    assert ex.shares({"a": 1.0, "b": 1.0}) == {"a": 4, "b": 4}
    assert ex.shares({"a": 3.0, "b": 1.0}) == {"a": 6, "b": 2}
    assert ex.shares({t: 1.0 for t in "abcdefghij"})["a"] == 1  # at least one place each
    assert ex.shares({"a": 1.0, "b": 1.0, "c": 1.0}) == {"a": 2, "b": 2, "c": 2}  # never more than the queue
    assert ex.shares({}, "a", 1.0) == {"a": 8}  # a tenant alone: the whole queue


def test_a_synchronous_job_past_its_tenants_share_is_refused_however_empty_the_queue():
    ex = DeviceExecutor(capacity=8)
    release = threading.Event()
    ex.start()
    try:
        _hold(ex, release)
        for _ in range(4):
            ex.submit(lambda: None, tenant="a", others={"b": 1.0})
        with pytest.raises(QueueFull) as refused:
            ex.submit(lambda: None, tenant="a", others={"b": 1.0})
        assert "tenant 'a' holds 4 of its share of 4 place(s)" in refused.value.message
        assert refused.value.details["limit"] == "device_queue_share" and refused.value.details["value"] == 4
        with pytest.raises(QueueFull):
            ex.check_capacity("a", 1.0, {"b": 1.0})  # the check before the body says the same
        ex.submit(lambda: None, tenant="a")  # with nobody else waiting, its share is the queue
        assert ex.depth == 5 and ex.stats.refused_share == 2
    finally:
        release.set()
        assert ex.stop(30)


def test_a_full_queue_of_fed_jobs_makes_room_for_a_synchronous_one():
    """Fed jobs take free places only; a synchronous job under its share takes one back (the
    newest of the tenant furthest over its share), answered Requeued: it waits in the ledger."""
    ex = DeviceExecutor(capacity=4)
    release = threading.Event()
    ex.start()
    try:
        _hold(ex, release)
        fed = [ex.submit(lambda: None, tenant="a", evictable=True, label=f"a{i}") for i in range(3)]
        fed.append(ex.submit(lambda: None, tenant="c", evictable=True, label="c0"))
        with pytest.raises(QueueFull, match="the device queue is full"):
            ex.submit(lambda: None, tenant="a", evictable=True)  # fed work never takes a place back
        job = ex.submit(lambda: None, tenant="b", others={"a": 1.0})
        assert ex.depth == 4 and ex.stats.deepest == 4 and ex.stats.returned == 1
        assert isinstance(fed[2].future.exception(0), Requeued)  # a's newest: a is furthest over its share
        assert [f.future.done() for f in fed] == [False, False, True, False]
        release.set()
        job.future.result(30)
    finally:
        release.set()
        assert ex.stop(30)


def test_a_queue_full_of_synchronous_jobs_refuses_naming_the_queue_size():
    ex = DeviceExecutor(capacity=2)
    release = threading.Event()
    ex.start()
    try:
        _hold(ex, release)
        ex.submit(lambda: None, tenant="a")
        ex.submit(lambda: None, tenant="a")
        with pytest.raises(QueueFull) as refused:
            ex.submit(lambda: None, tenant="b")
        assert "all of them synchronous tasks admitted before" in refused.value.message
        assert "REV88_QUEUE_SIZE" in refused.value.message and refused.value.details["queued"] == 0
    finally:
        release.set()
        assert ex.stop(30)


# --------------------------------------------------------------------------- a real server


def _dataset(c: httpx.Client, key: str) -> str:
    digest = "sha256:" + __import__("hashlib").sha256(BODY).hexdigest()
    assert c.put(f"/datasets/{digest}", content=BODY, headers={"Content-Type": "application/octet-stream",
                                                                **bearer(key)}).status_code in (200, 201)
    return digest


def _small_in_queues(docs: list[dict]) -> int:
    """Tenant B's tasks in the device queues or running, over the replicas' /health documents."""
    rows = [d["admission"]["tenants"].get("small") or {} for d in docs]
    return sum(r.get("queued", 0) + r.get("running", 0) for r in rows)


def _flood_then_small_tenant(c: httpx.Client, gate, health, sync_clients) -> dict:
    """Tenant A: 50 asynchronous tasks and a 1,000-cell sweep; then tenant B: 2 asynchronous and 2
    synchronous tasks. ``health()``: every replica's /health document. Returns what the test checks."""
    admin = bearer(ADMIN_KEY)
    a = c.post("/keys", json={"name": "flood"}, headers=admin).json()["key"]
    b = c.post("/keys", json={"name": "small"}, headers=admin).json()["key"]
    digest = _dataset(c, a)
    gate.hold()
    try:
        ids_a = []
        for _ in range(50):
            r = post_task(c, BODY, headers={**ASYNC, **bearer(a)})
            assert r.status_code == 202, r.text
            ids_a.append(r.json()["id"])
        sweep = c.post("/sweeps", json={"dataset": digest, "grid": {"learning_rate": [0.1, 0.2, 0.3, 0.4, 0.5]},
                                        "seeds": list(range(200)), "config": {"epochs": 1}}, headers=bearer(a))
        assert sweep.status_code == 202, sweep.text
        wait_for(lambda: health()[0]["admission"]["backlog"]["tasks"] >= 1000, 60, 0.05, "the flood in the backlog")
        ids_b, sync_answers = [], []
        for _ in range(2):
            r = post_task(c, BODY, headers={**ASYNC, **bearer(b)})
            assert r.status_code == 202, r.text  # never a 503
            ids_b.append(r.json()["id"])

        def sync_task(client):
            sync_answers.append(post_task(client, BODY, headers=bearer(b)))

        threads = [threading.Thread(target=sync_task, args=(client,)) for client in sync_clients]
        for t in threads:
            t.start()
        wait_for(lambda: _small_in_queues(health()) >= 4, 30, 0.05, "B's four tasks in a device queue")
        doc = health()
    finally:
        gate.release()
    for t in threads:
        t.join(120)
    assert [r.status_code for r in sync_answers] == [200, 200], [r.text for r in sync_answers]
    ids_b += [r.json()["id"] for r in sync_answers]
    for task_id in ids_b:
        wait_for(lambda t=task_id: c.get(f"/tasks/{t}", headers=bearer(b)).json()["status"] in FINISHED, 120, 0.05,
                 f"B's task {task_id}")
    after = health()
    # the rest of the flood is not waited for
    c.post(f"/sweeps/{sweep.json()['id']}/cancel", headers=bearer(a))
    # every task that started: succeeded, still running, or stopped by the cancel (the flood's
    # thousand cells never started, most of them)
    listed = [t for status in ("succeeded", "running", "cancelled", "failed")
              for t in c.get("/tasks", params={"limit": 200, "status": status}, headers=admin).json()["tasks"]
              if t["started_at"] is not None]
    def read_started(ids) -> dict:
        """The start of each of ``ids`` (every task a replica answered), from the whole list, page by
        page (asked while the replicas are up)."""
        found, cursor = {}, None
        while True:
            page = c.get("/tasks", params={"limit": 500, **({"cursor": cursor} if cursor else {})},
                         headers=admin).json()
            found.update({t["id"]: t["started_at"] for t in page["tasks"] if t["id"] in ids})
            cursor = page["next_cursor"]
            if cursor is None or len(found) == len(ids):
                return found

    return {"ids_a": set(ids_a), "ids_b": ids_b, "listed": listed, "while_held": doc, "after": after,
            "sync": [r.json() for r in sync_answers], "started_of": read_started}


def _started_before_b(result) -> int:
    """How many of A's tasks started before B's last one did."""
    started = {t["id"]: t["started_at"] for t in result["listed"] if t["started_at"] is not None}
    last_b = max(started[t] for t in result["ids_b"])
    return sum(1 for t, at in started.items() if t not in result["ids_b"] and at < last_b)


def test_a_flood_never_refuses_or_starves_another_tenant_on_sqlite(tmp_path):
    gate = Gate()
    app = create_app(Settings(backend="cpu", workers=1, api_key=ADMIN_KEY, queue_size=8,
                              data_dir=str(tmp_path / "d")), engines=gated_engines(gate))
    with inprocess_server(app) as server, server.client() as c, server.client() as s1, server.client() as s2:
        result = _flood_then_small_tenant(c, gate, lambda: [c.get("/health", headers=bearer(ADMIN_KEY)).json()],
                                          [s1, s2])
    held = result["while_held"][0]["admission"]
    assert held["device_queue"]["deepest"] <= held["device_queue"]["capacity"] == 8
    assert held["tenants"]["flood"]["backlog"] >= 1000 and held["tenants"]["small"]["share"] == 4
    assert result["after"][0]["admission"]["device_queue"]["deepest"] <= 8  # never past it, first to last
    # B's four started before all but the first few of A's 1,050: from B's arrival on, fair share
    # (virtual time, app/runtime/fair_share.py) gives it every other start -- A's running task
    # and three of A's interleaved with B's four
    print("A tasks started before B's last:", _started_before_b(result))
    assert _started_before_b(result) <= 4, _started_before_b(result)
    expected = array_sha256(np.asarray(result["sync"][0]["predictions"], dtype=np.int64))
    assert result["sync"][0]["predictions_sha256"] == result["sync"][1]["predictions_sha256"] == expected


def test_an_upload_while_another_tenants_sweep_runs_is_accepted(tmp_path):
    """A plain upload, synchronous and asynchronous, while a 1,000-cell sweep waits: 200 and 202."""
    gate = Gate()
    app = create_app(Settings(backend="cpu", workers=1, api_key=ADMIN_KEY, queue_size=4,
                              data_dir=str(tmp_path / "d")), engines=gated_engines(gate))
    with inprocess_server(app) as server, server.client() as c:
        admin = bearer(ADMIN_KEY)
        a = c.post("/keys", json={"name": "sweeper"}, headers=admin).json()["key"]
        digest = _dataset(c, a)
        gate.hold()
        sweep = c.post("/sweeps", json={"dataset": digest, "grid": {"learning_rate": [0.1, 0.2, 0.3, 0.4]},
                                        "seeds": list(range(250)), "config": {"epochs": 1}}, headers=bearer(a))
        assert sweep.status_code == 202
        gate.release()
        wait_for(lambda: c.get(f"/sweeps/{sweep.json()['id']}", headers=bearer(a)).json()["counts"]["running"]
                 + c.get(f"/sweeps/{sweep.json()['id']}", headers=bearer(a)).json()["counts"]["succeeded"] > 0,
                 60, 0.05, "the sweep running")
        for headers in ({}, ASYNC, {}, ASYNC):
            r = post_task(c, BODY, headers={**headers, **admin})
            assert r.status_code in (200, 202), r.text
        health = c.get("/health", headers=admin).json()
        assert health["admission"]["device_queue"]["deepest"] <= 4
        c.post(f"/sweeps/{sweep.json()['id']}/cancel", headers=bearer(a))


def test_a_synchronous_upload_takes_a_claimed_cells_place_and_the_cell_runs_later(tmp_path):
    """The device queue full of claimed cells (REV88_QUEUE_SIZE 1, the worker held at a gate):
    another tenant's synchronous upload takes a cell's place back -- the cell waits in the ledger
    again -- and is answered; the cell taken back runs later and the sweep completes, every cell
    succeeded. (Claimed work may be taken back; an upload whose client waits may not.)"""
    gate = Gate()
    app = create_app(Settings(backend="cpu", workers=1, batch_max=1, api_key=ADMIN_KEY, queue_size=1,
                              data_dir=str(tmp_path / "d")), engines=gated_engines(gate))
    with inprocess_server(app) as server, server.client() as c, server.client() as s:
        admin = bearer(ADMIN_KEY)
        a = c.post("/keys", json={"name": "sweeper"}, headers=admin).json()["key"]
        digest = _dataset(c, a)
        answers: list[httpx.Response] = []
        upload = threading.Thread(target=lambda: answers.append(post_task(s, BODY, headers=admin)), daemon=True)
        gate.hold()
        try:
            sweep = c.post("/sweeps", json={"dataset": digest, "seeds": [0, 1, 2, 3], "config": {"epochs": 1}},
                           headers=bearer(a))
            assert sweep.status_code == 202, sweep.text
            wait_for(lambda: _in_flight(c) == 2, 30, 0.02, "a cell running and one claimed into the full queue")
            tenants = c.get("/health", headers=admin).json()["admission"]["tenants"]
            assert (tenants["sweeper"]["queued"], tenants["sweeper"]["synchronous"]) == (1, 0), tenants  # claimed
            upload.start()
            wait_for(lambda: answers or _queue(c)["returned_to_ledger"] >= 1, 30, 0.02,
                     "the upload queued (or answered)")
            queue = _queue(c)
            assert not answers, answers[0].text  # (not refused: it waits in the queue)
            assert queue["returned_to_ledger"] == 1 and queue["depth"] == 1, queue
            tenants = c.get("/health", headers=admin).json()["admission"]["tenants"]
            assert (tenants["admin"]["queued"], tenants["admin"]["synchronous"]) == (1, 1), tenants
            assert tenants["sweeper"]["queued"] == 0 and tenants["sweeper"]["backlog"] >= 3, tenants
        finally:
            gate.release()
            if upload.is_alive():
                upload.join(60)
        assert answers[0].status_code == 200, answers[0].text
        sweep_id = sweep.json()["id"]
        wait_for(lambda: c.get(f"/sweeps/{sweep_id}", headers=bearer(a)).json()["status"] == "completed", 60, 0.05,
                 "the sweep completed")
        assert c.get(f"/sweeps/{sweep_id}", headers=bearer(a)).json()["counts"]["succeeded"] == 4
        assert _queue(c)["deepest"] <= 1


def _queue(c) -> dict:
    return c.get("/health", headers=bearer(ADMIN_KEY)).json()["admission"]["device_queue"]


def _in_flight(c) -> int:
    doc = c.get("/health", headers=bearer(ADMIN_KEY)).json()
    return doc["admission"]["device_queue"]["depth"] + sum(w["busy"] for w in doc["queue"]["workers"])


def _backlog(c) -> dict:
    return c.get("/health", headers=bearer(ADMIN_KEY)).json()["admission"]["backlog"]


def test_the_backlog_limit_refuses_asynchronous_work_naming_it(tmp_path):
    """REV88_BACKLOG_SIZE 3: with the worker's two places taken, three asynchronous tasks wait in
    the ledger and the fourth is refused (503, naming the limit and the count); a sweep that alone
    would pass the limit is refused on an empty backlog, one that fits is accepted."""
    app = create_app(Settings(backend="cpu", workers=1, api_key=ADMIN_KEY, backlog_size=3,
                              data_dir=str(tmp_path / "d")), engines=gated_engines(gate := Gate()))
    with inprocess_server(app) as server, server.client() as c:
        admin = bearer(ADMIN_KEY)
        digest = _dataset(c, ADMIN_KEY)
        r = c.post("/sweeps", json={"dataset": digest, "seeds": [1, 2, 3, 4]}, headers=admin)
        assert r.status_code == 503 and "4 more would pass REV88_BACKLOG_SIZE 3" in r.json()["error"], r.text
        assert _backlog(c)["tasks"] == 0  # (nothing of it recorded)
        gate.hold()
        try:
            for _ in range(2):  # the one running (held) and the one claimed ahead: out of the backlog
                assert post_task(c, BODY, headers={**ASYNC, **admin}).status_code == 202
            wait_for(lambda: _in_flight(c) == 2, 30, 0.02, "two tasks claimed")
            for _ in range(3):
                assert post_task(c, BODY, headers={**ASYNC, **admin}).status_code == 202
            assert _backlog(c)["tasks"] == 3
            r = post_task(c, BODY, headers={**ASYNC, **admin})
            assert r.status_code == 503 and "3 asynchronous tasks waiting; 1 more would pass REV88_BACKLOG_SIZE 3" \
                in r.json()["error"], r.text
            assert r.headers["Retry-After"] and r.json()["limit"] == "REV88_BACKLOG_SIZE"
            r = c.post("/sweeps", json={"dataset": digest, "seeds": [1]}, headers=admin)
            assert r.status_code == 503 and "REV88_BACKLOG_SIZE" in r.json()["error"]
        finally:
            gate.release()
        wait_for(lambda: _backlog(c)["tasks"] == 0 and _in_flight(c) == 0, 60, 0.05, "the backlog drained")
        assert c.post("/sweeps", json={"dataset": digest, "seeds": [1, 2, 3]}, headers=admin).status_code == 202


def test_the_backlog_bytes_limit_refuses_uploads_not_cells_on_stored_datasets(tmp_path):
    """REV88_BACKLOG_BYTES bounds what waiting uploads keep on disk: once the waiting uploads hold
    it -- one upload of exactly its size -- the next asynchronous upload is refused (503 naming it);
    a sweep's cells and a task on a stored dataset keep no upload of their own and are still accepted."""
    app = create_app(Settings(backend="cpu", workers=1, api_key=ADMIN_KEY, backlog_bytes=len(BODY),
                              data_dir=str(tmp_path / "d")), engines=gated_engines(gate := Gate()))
    with inprocess_server(app) as server, server.client() as c:
        admin = bearer(ADMIN_KEY)
        digest = _dataset(c, ADMIN_KEY)
        gate.hold()
        try:
            for n in (1, 2):  # (each claimed before the next: the backlog holds no upload)
                assert post_task(c, BODY, headers={**ASYNC, **admin}).status_code == 202
                wait_for(lambda n=n: _in_flight(c) == n, 30, 0.02, f"{n} task(s) claimed")
            assert post_task(c, BODY, headers={**ASYNC, **admin}).status_code == 202  # the backlog held 0 bytes
            assert _backlog(c)["bytes"] == len(BODY)
            r = post_task(c, BODY, headers={**ASYNC, **admin})
            assert r.status_code == 503 and f"REV88_BACKLOG_BYTES {len(BODY)}" in r.json()["error"], r.text
            assert r.json()["limit"] == "REV88_BACKLOG_BYTES"
            r = c.post("/sweeps", json={"dataset": digest, "seeds": [1, 2]}, headers=admin)
            assert r.status_code == 202, r.text
            r = c.post("/tasks", params={"dataset": digest}, headers={**ASYNC, **admin})  # no upload kept either
            assert r.status_code == 202, r.text
        finally:
            gate.release()


def test_a_cancelled_waiting_task_leaves_the_backlog_and_never_reaches_the_device(tmp_path):
    gate = Gate()
    app = create_app(Settings(backend="cpu", workers=1, api_key=ADMIN_KEY, data_dir=str(tmp_path / "d")),
                     engines=gated_engines(gate))
    with inprocess_server(app) as server, server.client() as c:
        admin = bearer(ADMIN_KEY)
        gate.hold()
        try:
            for _ in range(2):
                assert post_task(c, BODY, headers={**ASYNC, **admin}).status_code == 202
            wait_for(lambda: _in_flight(c) == 2, 30, 0.02, "two tasks claimed")
            waiting = [post_task(c, BODY, headers={**ASYNC, **admin}).json()["id"] for _ in range(3)]
            assert (_backlog(c)["tasks"], _backlog(c)["bytes"]) == (3, 3 * len(BODY))
            r = c.post(f"/tasks/{waiting[1]}/cancel", headers=admin)
            assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
            # out of the backlog at once, not when a claim meets it: its upload's bytes too
            assert (_backlog(c)["tasks"], _backlog(c)["bytes"]) == (2, 2 * len(BODY))
        finally:
            gate.release()
        for task_id in waiting:
            wait_for(lambda t=task_id: c.get(f"/tasks/{t}", headers=admin).json()["status"] in FINISHED, 60, 0.05,
                     f"task {task_id}")
        cancelled = c.get(f"/tasks/{waiting[1]}", headers=admin).json()
        assert cancelled["status"] == "cancelled" and cancelled["started_at"] is None  # it never ran
        assert app.state.service.executor.stats.accepted == 1 + 2 + 2  # the warm-up and the four others: not it


# --------------------------------------------------------------------------- two replicas on PostgreSQL


def test_a_flood_never_refuses_or_starves_another_tenant_on_two_replicas(tmp_path, pg_url):
    from .test_replicas import replica

    gate = FileGate(tmp_path / "gate")
    env = {"REV88_API_KEY": ADMIN_KEY, "REV88_QUEUE_SIZE": "8"}
    with replica(tmp_path, pg_url, gate, "a", **env) as ra, replica(tmp_path, pg_url, gate, "b", **env) as rb, \
            ra.client() as c, rb.client() as s1, ra.client() as s2:
        def health():
            return [httpx.get(r.url + "/health", headers=bearer(ADMIN_KEY), timeout=10).json() for r in (ra, rb)]

        result = _flood_then_small_tenant(c, gate, health, [s1, s2])
        assert all(d["admission"]["device_queue"]["deepest"] <= 8 for d in health())
        ran = {name: {json.loads(line)["task_id"] for line in r.logs().splitlines()
                      if line.startswith("{") and '"msg": "task answered"' in line}
               for name, r in (("a", ra), ("b", rb))}
        started = result["started_of"](ran["a"] | ran["b"])
    # each replica divides its own starts fairly: from B's arrival on, a replica holding n of B's
    # tasks in its device queue starts A's running task, then B's and A's in turn (fair share by
    # virtual time: B back from idle enters at the current virtual time, ties go to the older
    # work) -- n of A's before B's last there, one more at most for a claim in flight. (Counted
    # per replica: the two run side by side, so how many of A's the other one starts meanwhile is
    # a matter of speed, not of fairness.)
    assert set(result["ids_b"]) <= ran["a"] | ran["b"]
    for name, ids in ran.items():
        mine = [t for t in result["ids_b"] if t in ids]
        if not mine:
            continue
        last = max(started[t] for t in mine)
        before = sum(1 for t in ids if t not in result["ids_b"] and started[t] < last)
        print(f"replica {name}: {len(mine)} of B's tasks, {before} of A's started before B's last there")
        assert before <= len(mine) + 1, (name, len(mine), before)
    print("A tasks started before B's last, both replicas:", _started_before_b(result))
    assert result["sync"][0]["predictions_sha256"] == result["sync"][1]["predictions_sha256"]



def test_the_backlog_settings_and_their_older_name():
    assert Settings.from_env({"REV88_BACKLOG_SIZE": "12"}).backlog_size == 12
    assert Settings.from_env({"REV88_SHARED_QUEUE_SIZE": "13"}).backlog_size == 13  # (its name before)
    assert Settings.from_env({"REV88_BACKLOG_BYTES": "99"}).backlog_bytes == 99
    from app.settings import SettingsError

    with pytest.raises(SettingsError, match="REV88_BACKLOG_SIZE must be >= 1"):
        Settings.from_env({"REV88_BACKLOG_SIZE": "0"})
