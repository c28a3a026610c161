"""Many replicas, one ledger (issue #22): real `rev88 serve` processes sharing a real PostgreSQL
database (tests/pg.py). Asynchronous tasks accepted by one replica are read, listed, downloaded
and cancelled through another; a task running on one is cancelled through the other; a replica
killed with leased tasks has every one finished by the other once the leases expire; one
Idempotency-Key sent to both at once makes one task; a database restart mid-load is 503s, then
recovery, with no accepted task lost; a stalled holder's late result is refused.

Each replica is the real command line (``python -m tests.gates GATE serve ...``: `rev88 serve`
with its backends held while the gate file exists, tests/gates.py), with short leases so that
expiries take a second or two, not ten."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from learner.config import make_config
from learner.evaluate import dataset_seed
from learner.hashing import array_sha256
from learner.result import run_task
from learner.taskio import make_task, task_to_npz_bytes

from . import pg
from .gates import FileGate
from .helpers import TIME_SCALE, small_task
from .server import ROOT, free_port, post_task, wait_for

pg.require_psycopg()

pg_server, pg_url, pg_cluster = pg.pg_server, pg.pg_url, pg.pg_cluster  # the fixtures (tests/pg.py)

ASYNC = {"Prefer": "respond-async"}
LEASE_S = 1.5
FINISHED = ("succeeded", "failed", "cancelled")


class Replica:
    def __init__(self, proc: subprocess.Popen, url: str, log: Path) -> None:
        self.proc, self.url, self.log = proc, url, log

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 60), **kw)

    def logs(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def running(self) -> dict | None:
        return self.health()["queue"]["running"]


@contextlib.contextmanager
def replica(tmp_path: Path, database_url: str, gate: FileGate, name: str, workers: int = 1, **env: str):
    """A real `rev88 serve` on the shared database; SIGTERM (then SIGKILL) after."""
    port = free_port()
    log = tmp_path / f"replica-{name}-{port}.log"
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("REV88_")}
    child_env.update({"XDG_DATA_HOME": str(tmp_path / f"xdg-{name}"), "REV88_LOG_LEVEL": "info", **env})
    cmd = [sys.executable, "-m", "tests.gates", str(gate.path), "serve", "--port", str(port),
           "--backend", "cpu-fast", "--workers", str(workers), "--database-url", database_url,
           "--lease", str(LEASE_S), "--lease-renew", "0.3", "--claim-poll", "0.2", "--db-timeout", "2",
           "--data-dir", str(tmp_path / f"data-{name}")]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env, stdout=fh, stderr=subprocess.STDOUT)
    rep = Replica(proc, f"http://127.0.0.1:{port}", log)
    try:
        def ready():
            if proc.poll() is not None:
                raise RuntimeError(f"replica {name} exited with {proc.returncode}:\n{rep.logs()}")
            try:
                return httpx.get(rep.url + "/v2/health/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        t_start = time.monotonic()
        wait_for(ready, 120, 0.1, f"replica {name} ready")
        print(f"replica {name} ready in {time.monotonic() - t_start:.2f} s")
        yield rep
    finally:
        if proc.poll() is None:
            t_stop = time.monotonic()
            proc.send_signal(signal.SIGCONT)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
                print(f"replica {name} stopped in {time.monotonic() - t_stop:.2f} s")
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def finished(client: httpx.Client, task_id: str, timeout: float = 60) -> dict:
    def done():
        r = client.get(f"/tasks/{task_id}")
        return r.json() if r.status_code == 200 and r.json()["status"] in FINISHED else None

    return wait_for(done, timeout, 0.05, f"task {task_id} to finish")


@pytest.fixture
def gate(tmp_path):
    g = FileGate(tmp_path / "hold")
    yield g
    g.release()


def test_async_on_a_status_list_predictions_and_cancel_on_b(tmp_path, pg_url, gate):
    task = small_task(300, 40, seed=7)
    body = task_to_npz_bytes(task)
    expected = run_task(task, None, "cpu-fast").predictions_sha256
    with replica(tmp_path, pg_url, gate, "a") as a, replica(tmp_path, pg_url, gate, "b") as b, \
            a.client() as ca, b.client() as cb:
        r = post_task(ca, body, headers=ASYNC)
        assert r.status_code == 202, r.text
        task_id = r.json()["id"]
        doc = finished(cb, task_id)
        assert doc["status"] == "succeeded" and doc["predictions_sha256"] == expected
        listed = cb.get("/tasks", params={"limit": 10}).json()["tasks"]
        assert [t["id"] for t in listed] == [task_id]
        npy = cb.get(f"/tasks/{task_id}/predictions.npy")
        assert npy.status_code == 200 and array_sha256(np.load(io.BytesIO(npy.content))) == expected
        npz = cb.get(f"/tasks/{task_id}", headers={"Accept": "application/x-npz"})
        assert npz.headers["content-type"] == "application/x-npz"
        again = cb.post(f"/tasks/{task_id}/cancel")
        assert again.status_code == 409 and "already finished (succeeded)" in again.json()["error"]
        missing = cb.get("/tasks/0123456789abcdef")
        assert missing.status_code == 404 and "shared ledger" in missing.json()["error"]
        # keyset paging over the shared table, tasks accepted by both
        ids = [task_id]
        for i in range(5):
            client = ca if i % 2 else cb
            ids.append(post_task(client, task_to_npz_bytes(small_task(30, 5, seed=100 + i)), headers=ASYNC).json()["id"])
        for i in ids:
            finished(ca, i)
        seen, cursor = [], None
        while True:
            page = ca.get("/tasks", params={"limit": 2, **({"cursor": cursor} if cursor else {})}).json()
            seen += [t["id"] for t in page["tasks"]]
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert seen == ids[::-1]
        health = cb.get("/health").json()["ledger"]
        assert health["engine"] == "postgresql" and health["ok"] and health["tasks"]["succeeded"] == 6
        assert "rev88_shared_queue_depth" in cb.get("/metrics").text


def test_a_task_running_on_one_replica_is_cancelled_through_the_other(tmp_path, pg_url, gate):
    body = task_to_npz_bytes(small_task(100, 10, seed=8))
    with replica(tmp_path, pg_url, gate, "a") as a, replica(tmp_path, pg_url, gate, "b") as b, \
            a.client() as ca, b.client() as cb:
        gate.hold()
        task_id = post_task(ca, body, headers=ASYNC).json()["id"]
        holder = wait_for(lambda: next((r for r in (a, b) if (r.running() or {}).get("id") == task_id), None),
                          30, 0.05, "the task running on a replica")
        other = cb if holder is a else ca
        t0 = time.monotonic()
        r = other.post(f"/tasks/{task_id}/cancel")
        took = time.monotonic() - t0
        assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
        assert "stopped on the device" in r.json()["error"]["error"]
        print(f"cancel through the other replica answered cancelled in {took * 1000:.0f} ms")
        assert took < 1.5 * TIME_SCALE, f"the cancel took {took:.2f} s"
        assert holder.running() is None  # stopped there, not left running
        gate.release()
        assert finished(ca, task_id)["status"] == "cancelled"
        # a queued (unclaimed) task is cancelled at once by any replica
        gate.hold()
        blocker = post_task(ca, body, headers=ASYNC).json()["id"]
        wait_for(lambda: any((r.running() or {}).get("id") == blocker for r in (a, b)), 30, 0.05, "blocker running")
        second = post_task(ca, body, headers=ASYNC).json()["id"]
        wait_for(lambda: sum(1 for r in (a, b) if r.running()) == 2, 30, 0.05, "both replicas busy")
        third = post_task(ca, body, headers=ASYNC).json()["id"]
        assert cb.get(f"/tasks/{third}").json()["status"] == "queued"
        q = cb.post(f"/tasks/{third}/cancel")
        assert q.status_code == 200 and q.json()["status"] == "cancelled" and q.json()["started_at"] is None
        gate.release()
        for i in (blocker, second):
            assert finished(cb, i)["status"] == "succeeded"


def test_kill_9_of_a_replica_holding_leases_the_other_finishes_every_task(tmp_path, pg_url, gate):
    tasks = [small_task(150, 20, seed=60 + i) for i in range(4)]
    configs = [make_config({"epochs": 1 + i % 2}) for i in range(4)]
    with replica(tmp_path, pg_url, gate, "a", workers=2) as a, a.client() as ca:
        gate.hold()  # after a's warm-up: nothing finishes before the kill
        ids = [post_task(ca, task_to_npz_bytes(t), params={"epochs": str(c.epochs)}, headers=ASYNC).json()["id"]
               for t, c in zip(tasks, configs)]
        wait_for(lambda: a.health()["ledger"]["shared_queue"]["leases_held"] == 2, 30, 0.05, "a holding two leases")
        held = [t for t in ca.get("/tasks", params={"status": "running"}).json()["tasks"]]
        assert len(held) == 2
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait(30)
    t_killed = time.monotonic()
    gate.release()
    with replica(tmp_path, pg_url, gate, "b", workers=1) as b, b.client() as cb:
        docs = [finished(cb, i, timeout=60) for i in ids]
        took = time.monotonic() - t_killed
        for doc, task, config in zip(docs, tasks, configs):
            assert doc["status"] == "succeeded", doc
            assert doc["predictions_sha256"] == run_task(task, config, "cpu-fast").predictions_sha256
        listed = {t["id"]: t for t in cb.get("/tasks", params={"limit": 50}).json()["tasks"]}
        assert sorted(listed[t["id"]]["attempts"] for t in held) == [2, 2]  # ran on a, then on b
        counters = b.health()["ledger"]["shared_queue"]
        assert counters["reaped_requeued"] >= 2 and counters["claimed"] == 4
    assert took < 30


def test_one_idempotency_key_sent_to_both_at_once_makes_one_task(tmp_path, pg_url, gate):
    body = task_to_npz_bytes(small_task(60, 8, seed=9))
    with replica(tmp_path, pg_url, gate, "a") as a, replica(tmp_path, pg_url, gate, "b") as b:
        answers: list[httpx.Response] = []
        lock = threading.Lock()
        start = threading.Barrier(6)

        def send(rep, headers):
            with rep.client() as c:
                start.wait()
                r = post_task(c, body, headers=headers)
                with lock:
                    answers.append(r)

        threads = [threading.Thread(target=send, args=(rep, {**ASYNC, "Idempotency-Key": "once"}))
                   for rep in (a, b, a, b, a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert [r.status_code for r in answers] == [202] * 6
        assert len({r.json()["id"] for r in answers}) == 1
        with a.client() as ca:
            task_id = answers[0].json()["id"]
            assert finished(ca, task_id)["status"] == "succeeded"
            assert [t["id"] for t in ca.get("/tasks").json()["tasks"]] == [task_id]
            # a synchronous replay through the other replica gets that task's answer
            with b.client() as cb:
                sync = post_task(cb, body, headers={"Idempotency-Key": "once"})
            assert sync.status_code == 200 and sync.json()["id"] == task_id
            assert sync.headers.get("idempotent-replayed") == "true"


def test_a_database_restart_mid_load_is_503s_then_recovery_and_nothing_accepted_is_lost(tmp_path, pg_cluster, gate):
    url = pg.create_database(pg_cluster.url)
    bodies = [task_to_npz_bytes(small_task(40, 6, seed=300 + i)) for i in range(4)]
    accepted: list[str] = []
    refused: list[httpx.Response] = []
    stop = threading.Event()
    with replica(tmp_path, url, gate, "a") as a, replica(tmp_path, url, gate, "b") as b:
        def load(rep):
            i = 0
            with rep.client(timeout=30) as c:
                while not stop.is_set():
                    try:
                        r = post_task(c, bodies[i % len(bodies)], headers=ASYNC)
                    except httpx.HTTPError:
                        continue
                    i += 1
                    if r.status_code == 202:
                        accepted.append(r.json()["id"])
                    elif r.status_code == 503:
                        refused.append(r)
                        time.sleep(0.05)
                    else:
                        raise AssertionError(r.text)
                    time.sleep(0.02)

        threads = [threading.Thread(target=load, args=(rep,), daemon=True) for rep in (a, b)]
        for t in threads:
            t.start()
        wait_for(lambda: len(accepted) >= 10, 60, 0.05, "load before the restart")
        before = len(accepted)
        pg_cluster.stop()
        wait_for(lambda: len(refused) >= 4, 30, 0.05, "503s while the database is down")
        down = a.health()["ledger"]
        time.sleep(1.0)
        pg_cluster.start()
        wait_for(lambda: len(accepted) >= before + 10, 60, 0.05, "202s again after the restart")
        stop.set()
        for t in threads:
            t.join(30)
        for r in refused[:4]:
            assert "Retry-After" in r.headers
            assert "task ledger" in r.json()["error"] and ("database" in r.json()["error"])
        assert down["ok"] is False and down["engine"] == "postgresql"
        with a.client() as ca:
            docs = [finished(ca, i, timeout=90) for i in accepted]
        assert {d["status"] for d in docs} == {"succeeded"}, [d for d in docs if d["status"] != "succeeded"][:2]
        expected = {run_task(small_task(40, 6, seed=300 + i), None, "cpu-fast").predictions_sha256 for i in range(4)}
        assert {d["predictions_sha256"] for d in docs} <= expected
        assert a.health()["ledger"]["ok"] and b.health()["ledger"]["ok"]


def test_a_stalled_lease_holders_late_result_is_refused(tmp_path, pg_url, gate):
    """a stalls (SIGSTOP) mid-run; its lease expires; b claims the task and runs it (held at its
    own gate); a wakes up and finishes first: its result is refused while b holds the lease, and
    b's result is the one recorded."""
    task = small_task(120, 12, seed=10)
    body = task_to_npz_bytes(task)
    gate_b = FileGate(tmp_path / "hold-b")
    with replica(tmp_path, pg_url, gate, "a") as a, a.client() as ca:
        gate.hold()
        task_id = post_task(ca, body, headers=ASYNC).json()["id"]
        wait_for(lambda: (a.running() or {}).get("id") == task_id, 30, 0.05, "the task running on a")
        try:
            with replica(tmp_path, pg_url, gate_b, "b") as b, b.client() as cb:
                gate_b.hold()  # b's runs wait (after its warm-up)
                a.proc.send_signal(signal.SIGSTOP)  # a stalls holding the lease (a long GC pause, a frozen VM)
                gate.release()  # a's run can finish once a runs again
                wait_for(lambda: (b.running() or {}).get("id") == task_id, 30, 0.05, "b running it after the expiry")
                a.proc.send_signal(signal.SIGCONT)  # a wakes up and finishes its run while b holds the lease
                wait_for(lambda: "refused by the ledger: lease lost" in a.logs(), 30, 0.1, "a's late result refused")
                assert cb.get(f"/tasks/{task_id}").json()["status"] == "running"  # a wrote nothing
                gate_b.release()
                doc = finished(cb, task_id, timeout=60)
                assert doc["status"] == "succeeded"
                assert doc["predictions_sha256"] == run_task(task, None, "cpu-fast").predictions_sha256
                [summary] = cb.get("/tasks").json()["tasks"]
                assert summary["attempts"] == 2  # started on a, then on b
        finally:
            a.proc.send_signal(signal.SIGCONT)
            gate_b.release()


def test_an_unreachable_database_stops_rev88_serve_naming_it(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("REV88_")}
    url = f"postgresql://rev88:secret@127.0.0.1:{free_port()}/rev88"
    proc = subprocess.run(
        [sys.executable, "-m", "rev88", "serve", "--port", str(port), "--backend", "cpu-fast",
         "--database-url", url, "--db-timeout", "1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "cannot connect to the task ledger's database" in proc.stderr and "--database-url" in proc.stderr
    assert "secret" not in proc.stderr and "rev88:***@127.0.0.1" in proc.stderr



def test_one_evaluation_from_one_key_sent_to_both_its_draws_run_on_both_and_one_grade(tmp_path, pg_url, gate):
    """An evaluation sent with one Idempotency-Key to both replicas at once is one evaluation (no
    request refused); its draws are claimed by whichever replica is free; it is graded once (the
    first result recorded wins) and both replicas answer the same document, its counts this
    side's own scoring of the served predictions."""
    request = {"draws": "0-3", "config": {"epochs": 1}, "name": "two replicas"}
    with replica(tmp_path, pg_url, gate, "a") as a, replica(tmp_path, pg_url, gate, "b") as b:
        answers: list[httpx.Response] = []
        lock = threading.Lock()
        start = threading.Barrier(4)

        def send(rep):
            with rep.client(timeout=120) as c:
                start.wait()
                r = c.post("/evaluations", json=request, headers={"Idempotency-Key": "graded-once"})
                with lock:
                    answers.append(r)

        threads = [threading.Thread(target=send, args=(rep,)) for rep in (a, b, a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [r.status_code for r in answers] == [202] * 4, [r.text for r in answers]
        (evaluation_id,) = {r.json()["id"] for r in answers}
        with a.client() as ca, b.client() as cb:
            doc = wait_for(lambda: (d := cb.get(f"/evaluations/{evaluation_id}").json())["status"] == "completed"
                           and d, 120, 0.1, "the evaluation")
            assert ca.get(f"/evaluations/{evaluation_id}").json() == doc  # one result, read by both
            assert len(ca.get("/tasks", params={"limit": 100}).json()["tasks"]) == 4
            assert [row["correct"] for row in doc["draws"]] == [
                int((np.load(io.BytesIO(ca.get(f"/tasks/{row['task_id']}/predictions.npy").content))
                     == make_task(None, dataset_seed(row["draw"]))[1]).sum()) for row in doc["draws"]]
            (row,) = cb.get("/evaluations").json()["evaluations"]
            assert row["correct"] == doc["totals"]["correct"] and row["status"] == "completed"


def test_keys_hold_on_every_replica_revocation_and_the_rate_limit(tmp_path, pg_url, gate):
    """A key made through one replica works on the other; its rate limit is one bucket for both;
    revoked through one, the other refuses it within a second (its cache of resolved keys)."""
    admin = {"Authorization": "Bearer replica-admin"}
    env = {"REV88_API_KEY": "replica-admin"}
    body = task_to_npz_bytes(small_task(30, 4, seed=5))
    with replica(tmp_path, pg_url, gate, "a", **env) as a, replica(tmp_path, pg_url, gate, "b", **env) as b, \
            a.client() as ca, b.client() as cb:
        made = ca.post("/keys", json={"name": "shared", "rate_per_minute": 2}, headers=admin)
        assert made.status_code == 201, made.text
        key = {"Authorization": f"Bearer {made.json()['key']}"}
        assert post_task(ca, body, headers=key).status_code == 200
        assert post_task(cb, body, headers=key).status_code == 200
        third = post_task(ca, body, headers=key)
        assert third.status_code == 429 and third.headers["ratelimit-policy"] == '"write";q=2;w=60'  # one bucket
        assert cb.get("/tasks", headers=key).status_code == 200
        assert ca.delete(f"/keys/{made.json()['id']}", headers=admin).status_code == 200
        assert ca.get("/tasks", headers=key).status_code == 401  # at once where it was revoked
        wait_for(lambda: cb.get("/tasks", headers=key).status_code == 401, 3, 0.1, "replica b refusing it")
        r = cb.get("/tasks", headers=key)
        assert "revoked" in r.json()["error"]


def test_fair_share_across_replicas_through_the_claim_query(tmp_path, pg_url, gate):
    """Two replicas of one worker each: tenant B's 2 tasks, sent behind tenant A's 12 (through the
    other replica), are claimed after at most a few of A's -- the claim orders tenants by their
    decayed device time, on every replica. (A device queue of 2 -- one running, one claimed ahead --
    so that the claims decide: with the default 8 a replica may have claimed seven of A's before
    B's arrive, and B's then start after those, a wait bounded by the device queue, not the claim.)"""
    admin = {"Authorization": "Bearer replica-admin"}
    env = {"REV88_API_KEY": "replica-admin", "REV88_QUEUE_SIZE": "2"}
    body = task_to_npz_bytes(small_task(300, 40, seed=6))
    with replica(tmp_path, pg_url, gate, "a", **env) as a, replica(tmp_path, pg_url, gate, "b", **env) as b, \
            a.client(headers=admin) as ca, b.client(headers=admin) as cb:
        ka = {"Authorization": f"Bearer {ca.post('/keys', json={'name': 'flood'}, headers=admin).json()['key']}"}
        kb = {"Authorization": f"Bearer {ca.post('/keys', json={'name': 'small'}, headers=admin).json()['key']}"}
        gate.hold()
        try:
            ids_a = [post_task(ca, body, headers={**ASYNC, **ka}).json()["id"] for _ in range(12)]
            wait_for(lambda: a.running() is not None and b.running() is not None, 30, 0.05, "both replicas busy")
            ids_b = [post_task(cb, body, headers={**ASYNC, **kb}).json()["id"] for _ in range(2)]
        finally:
            gate.release()
        for t in ids_a:
            finished(ca, t)
        for t in ids_b:
            finished(cb, t)
        listed = ca.get("/tasks", params={"limit": 100}, headers=admin).json()["tasks"]
        started = {t["id"]: t["started_at"] for t in listed}
        order = sorted(ids_a + ids_b, key=started.get)
        assert max(order.index(t) for t in ids_b) <= 5, ["b" if t in ids_b else "a" for t in order]
