"""Tenants (issue #33): keys made by the admin, stored only as hashes, with scopes; each tenant's
tasks are its own (another's id is 404 on every task route, lists show one's own, the admin sees
all); revocation, rotation with a grace period, expiry. On a real server, both stores."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from app.main import create_app
from app.settings import Settings
from learner.taskio import task_to_npz_bytes

from . import pg
from .helpers import small_task
from .server import inprocess_server, post_task, wait_for

pg_server, pg_url = pg.pg_server, pg.pg_url  # the fixtures (tests/pg.py)

ADMIN_KEY = "admin-key-for-tests"
BODY = task_to_npz_bytes(small_task(40, 6, seed=33))
ASYNC = {"Prefer": "respond-async"}


def serve(**settings):
    return inprocess_server(create_app(Settings(backend="cpu", workers=1, api_key=ADMIN_KEY, **settings)))


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def make_key(c: httpx.Client, name: str, **body) -> dict:
    r = c.post("/keys", json={"name": name, **body}, headers=bearer(ADMIN_KEY))
    assert r.status_code == 201, r.text
    return r.json()


def finished(c, task_id: str, key: str) -> dict:
    return wait_for(lambda: (d := c.get(f"/tasks/{task_id}", headers=bearer(key)).json())["status"]
                    in ("succeeded", "failed", "cancelled") and d, 60, what=f"task {task_id}")


def test_each_tenant_sees_only_its_own_tasks_and_the_admin_sees_all(store):
    with serve(**store) as server, server.client() as c:
        a, b = make_key(c, "alice"), make_key(c, "bob")
        assert a["key"].startswith("rev88_") and a["key"] != b["key"] and a["prefix"] == a["key"][:12]
        assert a["scopes"] == ["read", "write"]
        ta = post_task(c, BODY, headers={**ASYNC, **bearer(a["key"])}).json()["id"]
        tb = post_task(c, BODY, headers={**ASYNC, **bearer(b["key"])}).json()["id"]
        done = finished(c, ta, a["key"])
        assert done["status"] == "succeeded"
        finished(c, tb, b["key"])
        for path in (f"/tasks/{ta}", f"/tasks/{ta}/predictions.npy"):
            theirs = c.get(path, headers=bearer(b["key"]))
            assert theirs.status_code == 404 and ta in theirs.json()["error"], path  # as if it never existed
            assert c.get(path, headers=bearer(a["key"])).status_code == 200
            assert c.get(path, headers=bearer(ADMIN_KEY)).status_code == 200
        assert c.post(f"/tasks/{ta}/cancel", headers=bearer(b["key"])).status_code == 404
        assert c.get("/tasks/no-such-task", headers=bearer(b["key"])).json()["error"] == \
            c.get(f"/tasks/{ta}", headers=bearer(b["key"])).json()["error"].replace(ta, "no-such-task")
        listed = {k: [t["id"] for t in c.get("/tasks", headers=bearer(key)).json()["tasks"]]
                  for k, key in (("a", a["key"]), ("b", b["key"]), ("admin", ADMIN_KEY))}
        assert listed["a"] == [ta] and listed["b"] == [tb] and set(listed["admin"]) == {ta, tb}
        # one Idempotency-Key, two tenants: two tasks (a key is the tenant's own)
        ra = post_task(c, BODY, headers={**ASYNC, **bearer(a["key"]), "Idempotency-Key": "same"}).json()["id"]
        rb = post_task(c, BODY, headers={**ASYNC, **bearer(b["key"]), "Idempotency-Key": "same"}).json()["id"]
        again = post_task(c, BODY, headers={**ASYNC, **bearer(a["key"]), "Idempotency-Key": "same"})
        assert ra != rb and again.json()["id"] == ra
        sync = post_task(c, BODY, headers=bearer(b["key"]))  # a synchronous task is recorded as its tenant's too
        assert sync.status_code == 200
        wait_for(lambda: sync.json()["id"] in [t["id"] for t in c.get("/tasks", headers=bearer(b["key"])).json()["tasks"]],
                 30, what="the synchronous task listed")
        assert sync.json()["id"] not in [t["id"] for t in c.get("/tasks", headers=bearer(a["key"])).json()["tasks"]]


def test_scopes_revocation_rotation_and_expiry(tmp_path):
    with serve(data_dir=str(tmp_path / "d")) as server, server.client() as c:
        reader = make_key(c, "dashboard", scopes=["read"])
        writer = make_key(c, "robot")
        r = post_task(c, BODY, headers=bearer(reader["key"]))
        assert r.status_code == 403 and "lacks the write scope" in r.json()["error"]
        assert c.get("/tasks", headers=bearer(reader["key"])).status_code == 200
        for method, path in (("POST", "/keys"), ("GET", "/keys"), ("DELETE", f"/keys/{reader['id']}")):
            r = c.request(method, path, headers=bearer(writer["key"]), json={"name": "x"} if method == "POST" else None)
            assert r.status_code == 403 and "admin scope" in r.json()["error"], (method, path, r.text)
        me = c.get("/key", headers=bearer(writer["key"])).json()
        assert me["name"] == "robot" and me["admin"] is False and "key" not in me
        assert c.get("/key", headers=bearer(ADMIN_KEY)).json()["admin"] is True
        listed = c.get("/keys", headers=bearer(ADMIN_KEY)).json()["keys"]
        assert {k["name"] for k in listed} == {"dashboard", "robot"}
        assert all("key" not in k and "secret_sha256" not in k for k in listed)
        # rotation: the new secret works, the old one for its grace period
        rotated = c.post(f"/keys/{writer['id']}/rotate", json={"grace_seconds": 60}, headers=bearer(ADMIN_KEY)).json()
        assert rotated["key"] != writer["key"] and rotated["previous_secret_valid_until"] > time.time()
        for key in (rotated["key"], writer["key"]):
            assert c.get("/tasks", headers=bearer(key)).status_code == 200
        now = c.post(f"/keys/{writer['id']}/rotate", json={"grace_seconds": 0}, headers=bearer(ADMIN_KEY)).json()
        time.sleep(1.1)  # (a resolved key is trusted for up to a second)
        assert c.get("/tasks", headers=bearer(now["key"])).status_code == 200
        for old in (writer["key"], rotated["key"]):
            assert c.get("/tasks", headers=bearer(old)).status_code == 401
        # revocation: refused at once on this replica
        assert c.delete(f"/keys/{writer['id']}", headers=bearer(ADMIN_KEY)).json()["revoked_at"]
        r = c.get("/tasks", headers=bearer(now["key"]))
        assert r.status_code == 401 and "revoked" in r.json()["error"] and r.headers["www-authenticate"]
        r = c.post(f"/keys/{writer['id']}/rotate", headers=bearer(ADMIN_KEY))
        assert r.status_code == 403 and "revoked" in r.json()["error"]
        # expiry
        brief = make_key(c, "brief", expires_at=time.time() + 1.5)
        assert c.get("/tasks", headers=bearer(brief["key"])).status_code == 200
        time.sleep(2.7)
        r = c.get("/tasks", headers=bearer(brief["key"]))
        assert r.status_code == 401 and "expired" in r.json()["error"]
        # bad requests name the problem
        for body, words in (({"name": ""}, "name"), ({"name": "x", "scopes": ["root"]}, "scopes"),
                            ({"name": "x", "expires_at": 1.0}, "not in the future"), ({"nme": "x"}, "nme"),
                            ({"name": "x", "scopes": []}, "scopes")):
            r = c.post("/keys", json=body, headers=bearer(ADMIN_KEY))
            assert r.status_code == 422 and words in r.text, (body, r.text)
        assert c.delete("/keys/k-nope", headers=bearer(ADMIN_KEY)).status_code == 404
        for token in ("rev88_" + "x" * 43, "nonsense", "rev88_"):
            assert c.get("/tasks", headers=bearer(token)).status_code == 401


def test_no_secret_in_clear_under_the_data_dir_or_in_the_database(store, tmp_path):
    with serve(**store) as server, server.client() as c:
        secrets_ = [make_key(c, f"tenant-{i}")["key"] for i in range(3)]
        secrets_.append(c.post(f"/keys/{c.get('/keys', headers=bearer(ADMIN_KEY)).json()['keys'][0]['id']}/rotate",
                               headers=bearer(ADMIN_KEY)).json()["key"])
        for key in secrets_:
            assert c.get("/tasks", headers=bearer(key)).status_code == 200
        metrics = c.get("/metrics", headers=bearer(ADMIN_KEY)).text
    for path in Path(store["data_dir"]).rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert not any(s.encode() in data for s in secrets_), path
    assert not any(s in metrics for s in secrets_)
    if "database_url" in store:
        import psycopg

        with psycopg.connect(store["database_url"]) as conn:
            dump = "\n".join(str(row) for row in conn.execute("SELECT * FROM rev88_keys").fetchall())
        assert dump and not any(s in dump for s in secrets_)


def test_an_open_service_takes_no_keys(tmp_path):
    app = create_app(Settings(backend="cpu", workers=1, data_dir=str(tmp_path / "d")))
    with inprocess_server(app) as server, server.client() as c:
        r = c.post("/keys", json={"name": "x"})
        assert r.status_code == 409 and "REV88_API_KEY" in r.json()["error"]
        assert c.get("/key").json()["open"] is True
        assert post_task(c, BODY).status_code == 200  # open, as before


@pytest.mark.parametrize("scopes", [["read"], ["read", "write"]])
def test_the_client_and_rev88_keys(tmp_path, scopes, capsys):
    from rev88 import Client
    from rev88.cli import main

    with serve(data_dir=str(tmp_path / "d")) as server, Client(server.url, api_key=ADMIN_KEY) as admin:
        made = admin.create_key("carol", scopes=scopes)
        assert made["key"].startswith("rev88_") and made["scopes"] == scopes
        assert [k["name"] for k in admin.keys()] == ["carol"]
        with Client(server.url, api_key=made["key"]) as carol:
            assert carol.whoami()["name"] == "carol"
        assert main(["keys", "list", "--url", server.url, "--api-key", ADMIN_KEY]) == 0
        out = capsys.readouterr().out
        assert "carol" in out and made["key"] not in out and made["prefix"] in out
        assert main(["keys", "create", "dave", "--scopes", "read", "--url", server.url, "--api-key", ADMIN_KEY]) == 0
        dave = capsys.readouterr().out.strip().splitlines()[-1]
        assert dave.startswith("rev88_")
        dave_id = next(k["id"] for k in admin.keys() if k["name"] == "dave")
        assert main(["keys", "rotate", dave_id, "--grace", "0", "--url", server.url, "--api-key", ADMIN_KEY]) == 0
        new = capsys.readouterr().out.strip().splitlines()[-1]
        assert new.startswith("rev88_") and new != dave
        assert main(["keys", "revoke", dave_id, "--url", server.url, "--api-key", ADMIN_KEY]) == 0
        assert main(["keys", "list", "--url", server.url, "--api-key", made["key"]]) == 2  # not the admin: 403
        assert "admin scope" in capsys.readouterr().err


def test_datasets_sweeps_and_evaluations_are_their_tenants_own(store):
    """A dataset another tenant sent is 404 to HEAD and GET (no 'does this file exist' oracle):
    sending the same bytes makes it one's own too (201, as for new bytes), and deleting drops
    only one's own claim; a sweep or an evaluation of another tenant is 404 on every route."""
    from .helpers import npy_bytes

    digest = "sha256:" + __import__("hashlib").sha256(BODY).hexdigest()
    npz = {"Content-Type": "application/octet-stream"}
    with serve(**store) as server, server.client() as c:
        a, b = (make_key(c, n)["key"] for n in ("ann", "ben"))
        first = c.put(f"/datasets/{digest}", content=BODY, headers={**npz, **bearer(a)})
        assert first.status_code == 201
        for method in ("HEAD", "GET"):
            assert c.request(method, f"/datasets/{digest}", headers=bearer(b)).status_code == 404, method
            assert c.request(method, f"/datasets/{digest}", headers=bearer(a)).status_code == 200, method
        assert c.get("/datasets", headers=bearer(b)).json()["datasets"] == []
        assert [d["digest"] for d in c.get("/datasets", headers=bearer(a)).json()["datasets"]] == [digest]
        assert c.post("/tasks", params={"dataset": digest}, headers=bearer(b)).status_code == 404
        assert c.put(f"/datasets/{digest}/labels", content=npy_bytes(__import__("numpy").zeros(6, "int64")),
                     headers={**npz, **bearer(b)}).status_code == 404
        r = c.post("/sweeps", json={"dataset": digest, "seeds": [0, 1]}, headers=bearer(b))
        assert r.status_code == 404, r.text
        assert c.put(f"/datasets/{digest}", content=BODY, headers={**npz, **bearer(b)}).status_code == 201  # its own now
        assert c.put(f"/datasets/{digest}", content=BODY, headers={**npz, **bearer(b)}).status_code == 200
        sweep = c.post("/sweeps", json={"dataset": digest, "seeds": [0, 1]}, headers=bearer(a)).json()["id"]
        wait_for(lambda: c.get(f"/sweeps/{sweep}", headers=bearer(a)).json()["status"] == "completed", 120,
                 what="the sweep")
        for method, path in (("GET", f"/sweeps/{sweep}"), ("POST", f"/sweeps/{sweep}/cancel")):
            assert c.request(method, path, headers=bearer(b)).status_code == 404, path
        assert c.get("/sweeps", headers=bearer(b)).json()["sweeps"] == []
        assert [s["id"] for s in c.get("/sweeps", headers=bearer(ADMIN_KEY)).json()["sweeps"]] == [sweep]
        assert c.get(f"/datasets/{digest}", headers=bearer(b)).json()["sweeps"] == []
        assert c.get(f"/datasets/{digest}", headers=bearer(a)).json()["sweeps"] == [sweep]
        # deleting: b's claim goes, a keeps the dataset
        assert c.delete(f"/datasets/{digest}", headers=bearer(b)).status_code == 204
        assert c.get(f"/datasets/{digest}", headers=bearer(b)).status_code == 404
        assert c.get(f"/datasets/{digest}", headers=bearer(a)).status_code == 200
        ev = c.post("/evaluations", json={"draws": "9", "config": {"epochs": 1}}, headers=bearer(a)).json()["id"]
        doc = wait_for(lambda: (d := c.get(f"/evaluations/{ev}", headers=bearer(a)).json())["status"] == "completed"
                       and d, 120, what="the evaluation")
        for method, path in (("GET", f"/evaluations/{ev}"), ("GET", f"/evaluations/{ev}/accuracy.svg"),
                             ("POST", f"/evaluations/{ev}/cancel"), ("GET", f"/tasks/{doc['draws'][0]['task_id']}")):
            assert c.request(method, path, headers=bearer(b)).status_code == 404, path
        assert c.get(f"/datasets/{doc['draws'][0]['dataset']}", headers=bearer(a)).status_code == 200  # its draw
        assert c.get("/evaluations", headers=bearer(b)).json()["evaluations"] == []
        assert [e["id"] for e in c.get("/evaluations", headers=bearer(a)).json()["evaluations"]] == [ev]


def test_quotas_answer_429_with_the_rate_limit_headers(store):
    """rate_per_minute (write requests, a token bucket in the key's row, so across replicas) and
    max_queued (unfinished tasks and cells): over either, 429 with Retry-After, RateLimit-Policy
    and RateLimit, the error naming the limit and its value; 401 and 403 count against nobody."""
    from .gates import Gate, gated_engines

    gate = Gate()
    app = create_app(Settings(backend="cpu", workers=1, api_key=ADMIN_KEY, **store), engines=gated_engines(gate))
    with inprocess_server(app) as server, server.client() as c:
        limited = make_key(c, "limited", rate_per_minute=3)
        assert limited["limits"]["rate_per_minute"] == 3
        seen = []
        for _ in range(3):
            r = post_task(c, BODY, headers=bearer(limited["key"]))
            assert r.status_code == 200, r.text
            seen.append(r.headers["ratelimit"])
        assert r.headers["ratelimit-policy"] == '"write";q=3;w=60'
        assert [h.split(";")[1] for h in seen] == ["r=2", "r=1", "r=0"]
        over = post_task(c, BODY, headers=bearer(limited["key"]))
        assert over.status_code == 429 and "rate_per_minute of 3" in over.json()["error"]
        assert int(over.headers["retry-after"]) >= 1 and over.headers["ratelimit"].startswith('"write";r=0;t=')
        assert c.get("/tasks", headers=bearer(limited["key"])).status_code == 200  # reads are not counted
        reader = make_key(c, "reader", scopes=["read"], rate_per_minute=1)
        for _ in range(3):  # a 403 counts against nobody
            assert post_task(c, BODY, headers=bearer(reader["key"])).status_code == 403
        queued = make_key(c, "queued", max_queued=2)
        gate.hold()
        try:
            ids = [post_task(c, BODY, headers={**ASYNC, **bearer(queued["key"])}).json()["id"] for _ in range(2)]
            r = post_task(c, BODY, headers={**ASYNC, **bearer(queued["key"])})
            assert r.status_code == 429 and "max_queued 2" in r.json()["error"], r.text
            assert r.headers["ratelimit-policy"] == '"queued";q=2' and r.headers["retry-after"]
            digest = c.post("/datasets", content=BODY, headers={"Content-Type": "application/octet-stream",
                                                                **bearer(queued["key"])}).json()["digest"]
            r = c.post("/sweeps", json={"dataset": digest, "seeds": [0]}, headers=bearer(queued["key"]))
            assert r.status_code == 429 and "max_queued" in r.json()["error"]
            r = c.post("/tasks", params={"dataset": digest}, headers={**ASYNC, **bearer(queued["key"])})
            assert r.status_code == 429 and "max_queued 2" in r.json()["error"], r.text  # a task on a dataset too
            r = c.post("/evaluations", json={"draws": "0"}, headers=bearer(queued["key"]))
            assert r.status_code == 429 and "max_queued" in r.json()["error"]
            other = make_key(c, "other")  # another tenant is not held back by it
            assert post_task(c, BODY, headers={**ASYNC, **bearer(other["key"])}).status_code == 202
        finally:
            gate.release()
        for task_id in ids:
            finished(c, task_id, queued["key"])
        assert post_task(c, BODY, headers={**ASYNC, **bearer(queued["key"])}).status_code == 202
        # what a request adds counts: a sweep of four cells passes a max_queued of 3 with nothing unfinished
        sweeper = make_key(c, "sweeper", max_queued=3)
        digest = c.post("/datasets", content=BODY, headers={"Content-Type": "application/octet-stream",
                                                            **bearer(sweeper["key"])}).json()["digest"]
        r = c.post("/sweeps", json={"dataset": digest, "seeds": [0, 1, 2, 3]}, headers=bearer(sweeper["key"]))
        assert r.status_code == 429 and "has 0 unfinished" in r.json()["error"] and "4 more" in r.json()["error"], r.text
        r = c.post("/sweeps", json={"dataset": digest, "seeds": [0, 1, 2]}, headers=bearer(sweeper["key"]))
        assert r.status_code == 202, r.text
        # a synchronous task in flight counts too, though its record is written only once it has finished
        waiter = make_key(c, "waiter", max_queued=1)
        answers: list = []
        gate.hold()
        with server.client() as c2:
            held = threading.Thread(target=lambda: answers.append(post_task(c2, BODY, headers=bearer(waiter["key"]))),
                                    daemon=True)
            try:
                held.start()
                wait_for(lambda: _in_flight_of(c, "waiter"), 30, 0.02, "the synchronous task queued or running")
                r = post_task(c, BODY, headers={**ASYNC, **bearer(waiter["key"])})
                assert r.status_code == 429 and "max_queued 1" in r.json()["error"], r.text
            finally:
                gate.release()
                held.join(60)
        assert answers[0].status_code == 200, answers[0].text
        assert post_task(c, BODY, headers={**ASYNC, **bearer(waiter["key"])}).status_code == 202


def _in_flight_of(c: httpx.Client, tenant: str) -> int:
    row = c.get("/health", headers=bearer(ADMIN_KEY)).json()["admission"]["tenants"].get(tenant) or {}
    return row.get("queued", 0) + row.get("running", 0)


def test_fair_share_runs_a_small_tenant_between_a_floods_tasks():
    """One worker, tenant A's 12 jobs queued before tenant B's 2: B waits for at most a couple of
    A's, not all twelve (the least decayed device time per unit of weight goes next; FIFO within a
    tenant); with one tenant the queue stays FIFO."""
    import threading

    from app.runtime.executor import DeviceExecutor

    ex = DeviceExecutor(capacity=100, devices=["cpu:0"])
    hold, order = threading.Event(), []

    def job(name):
        def run():
            time.sleep(0.01)  # (device time to charge)
            order.append(name)
        return run

    ex.start()
    try:
        first = ex.submit(lambda: hold.wait(30), tenant="a")
        wait_for(lambda: ex.busy_workers() == 1, 10, what="the first job running")
        jobs = [ex.submit(job(f"a{i}"), tenant="a") for i in range(12)]
        jobs += [ex.submit(job(f"b{i}"), tenant="b") for i in range(2)]
        hold.set()
        for j in [first, *jobs]:
            j.future.result(30)
        assert [n for n in order if n.startswith("a")] == [f"a{i}" for i in range(12)]  # FIFO within a tenant
        assert order.index("b0") <= 1 and order.index("b1") <= 3, order
    finally:
        assert ex.stop(30)


def test_max_running_holds_a_tenant_to_its_share_of_the_workers():
    """Two workers, tenant a's key with max_running 1: while a's first job runs, its second waits
    although a worker is free -- and that worker runs tenant b's job instead (held jobs, not sleeps:
    what is observed is who runs, not how fast)."""
    import threading

    from app.runtime.executor import DeviceExecutor

    ex = DeviceExecutor(capacity=100, devices=["cpu:0", "cpu:1"])
    release = threading.Event()
    ex.start()
    try:
        a_jobs = [ex.submit(lambda: release.wait(30), tenant="a", max_running=1) for _ in range(3)]
        wait_for(lambda: ex.busy_workers() == 1, 10, 0.01, "a's first job running")
        b_job = ex.submit(lambda: ex.running_by_tenant(), tenant="b")
        seen_by_b = b_job.future.result(10)  # the free worker ran b's job, past a's held ones
        assert seen_by_b == {"a": 1, "b": 1} and ex.depth == 2
        release.set()
        for j in a_jobs:
            j.future.result(30)
        assert ex.stats.completed == 4
    finally:
        release.set()
        assert ex.stop(30)


def test_fair_share_on_a_real_server(tmp_path):
    """Through POST /tasks with two keys, one worker: B's two tasks, sent behind A's twelve, start
    after at most two of A's."""
    from .gates import Gate, gated_engines

    gate = Gate()
    app = create_app(Settings(backend="cpu", workers=1, api_key=ADMIN_KEY, queue_size=64,
                              data_dir=str(tmp_path / "d")), engines=gated_engines(gate))
    with inprocess_server(app) as server, server.client() as c:
        a, b = make_key(c, "flood")["key"], make_key(c, "small")["key"]
        gate.hold()
        try:
            ids_a = [post_task(c, BODY, headers={**ASYNC, **bearer(a)}).json()["id"] for _ in range(12)]
            ids_b = [post_task(c, BODY, headers={**ASYNC, **bearer(b)}).json()["id"] for _ in range(2)]
        finally:
            gate.release()
        for t in ids_a:
            finished(c, t, a)
        for t in ids_b:
            finished(c, t, b)
        listed = c.get("/tasks", params={"limit": 100}, headers=bearer(ADMIN_KEY)).json()["tasks"]
        started = {t["id"]: t["started_at"] for t in listed}
        order = sorted(ids_a + ids_b, key=started.get)
        assert max(order.index(t) for t in ids_b) <= 4, [("b" if t in ids_b else "a") for t in order]


def test_usage_per_tenant_and_day_and_the_metrics_series(store):
    with serve(**store) as server, server.client() as c:
        a, b = make_key(c, "usage-a")["key"], make_key(c, "usage-b")["key"]
        for key, count in ((a, 3), (b, 1)):
            for _ in range(count):
                assert post_task(c, BODY, headers=bearer(key)).status_code == 200
        post_task(c, BODY, headers=bearer(ADMIN_KEY))
        mine = wait_for(lambda: (u := c.get("/usage", headers=bearer(a)).json()["usage"]) and u[0]["tasks"] == 3 and u,
                        30, what="a's usage")
        (row,) = mine
        assert row["name"] == "usage-a" and row["succeeded"] == 3 and row["device_seconds"] > 0
        assert row["day"] == time.strftime("%Y-%m-%d", time.gmtime())
        every = c.get("/usage", headers=bearer(ADMIN_KEY)).json()["usage"]
        assert {(r["name"], r["tasks"]) for r in every} == {("usage-a", 3), ("usage-b", 1), ("admin", 1)}
        assert [r["name"] for r in c.get("/usage", headers=bearer(b)).json()["usage"]] == ["usage-b"]
        metrics = c.get("/metrics", headers=bearer(ADMIN_KEY)).text
        assert 'rev88_tenant_tasks_total{status="succeeded",tenant="usage-a"} 3.0' in metrics
        assert 'rev88_tenant_device_seconds_total{tenant="usage-b"}' in metrics
        assert c.get("/usage", params={"days": 0}, headers=bearer(a)).status_code == 422
