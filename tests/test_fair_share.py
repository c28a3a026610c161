"""Fair share between tenants by virtual time (issue #54): every tenant's share of the device's
starts is its weight's share while all of them have work waiting, for any number of tenants,
whatever their key ids; a tenant that arrives late is served within its share at once (no
credit hoarded while it was idle, no debt either).

Behaviour, not internals: through a real server (POST /keys with weights, PUT /datasets, POST
/sweeps; a gated real backend holds the device while the backlogs build), the starts read back
from each tenant's own GET /tasks. ``FairShare`` itself (plain data) is checked at the end.
"""

from __future__ import annotations

import hashlib

import httpx
import pytest

from app.main import create_app
from app.runtime.fair_share import FairShare, Waiting
from app.settings import Settings
from learner.taskio import task_to_npz_bytes

from . import pg
from .gates import Gate, gated_engines
from .helpers import small_task
from .server import inprocess_server, wait_for

pg_server, pg_url = pg.pg_server, pg.pg_url  # the fixtures (tests/pg.py)

ADMIN_KEY = "admin-key-for-fair-share"
BODY = task_to_npz_bytes(small_task(24, 4, seed=54))
DIGEST = "sha256:" + hashlib.sha256(BODY).hexdigest()
FINISHED = ("succeeded", "failed", "cancelled")
TOLERANCE = 0.05  # the bar: each share within ±0.05 of its weight's share


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _keys(c: httpx.Client, weights: list[float]) -> list[dict]:
    """One key per weight, returned in the order their work is posted below: the highest key id
    first. Were ties (or anything) decided by key id, the tenant posted first -- its work the
    oldest -- would sort last and lose every tie."""
    keys = []
    for i, weight in enumerate(weights):
        r = c.post("/keys", json={"name": f"t{i}", "weight": weight}, headers=bearer(ADMIN_KEY))
        assert r.status_code == 201, r.text
        keys.append({**r.json(), "weight": weight})
    return sorted(keys, key=lambda k: k["id"], reverse=True)


def _sweep(c: httpx.Client, key: str, seeds: list[int], epochs: int = 1) -> str:
    r = c.put(f"/datasets/{DIGEST}", content=BODY,
              headers={"Content-Type": "application/octet-stream", **bearer(key)})
    assert r.status_code in (200, 201), r.text
    r = c.post("/sweeps", json={"dataset": DIGEST, "seeds": seeds, "config": {"epochs": epochs}},
               headers=bearer(key))
    assert r.status_code == 202, r.text
    return r.json()["id"]


def _starts(c: httpx.Client, keys: list[dict], total: int) -> list[tuple[float, int]]:
    """(started_at, tenant index) of every task, once all ``total`` have finished, oldest first."""
    def listed():
        out = []
        for i, key in enumerate(keys):
            tasks = c.get("/tasks", params={"limit": 500}, headers=bearer(key["key"])).json()["tasks"]
            out += [(t, i) for t in tasks]
        return out

    rows = wait_for(lambda: (r := listed()) and len(r) == total and all(t["status"] in FINISHED for t, _ in r) and r,
                    180, 0.1, f"all {total} tasks finished")
    assert all(t["status"] == "succeeded" for t, _ in rows), [t for t, _ in rows if t["status"] != "succeeded"]
    return sorted((t["started_at"], i) for t, i in rows)


def _fill_the_device(c: httpx.Client, queue_size: int, batch_max: int) -> None:
    """The admin's work on the held device and claimed ahead of it, as far as the feeder claims
    (a launch running and one more: app/tasks/feeder.py), with more of it still waiting in the
    ledger, before the tenants' backlogs are posted: so that the feeder claims nothing more until
    the device is released, and every tenant's first cell is then claimed by fair share among all of
    them -- not by which sweep happened to be recorded first while the feeder had room (the first
    tenant's first two launches, else: a head start that virtual time does not take back)."""
    _sweep(c, ADMIN_KEY, list(range(1000, 1000 + queue_size + 2 * batch_max)))

    def claimed_ahead() -> bool:
        admin = c.get("/health", headers=bearer(ADMIN_KEY)).json()["admission"]["tenants"].get("admin") or {}
        return admin.get("running") == batch_max and admin.get("queued", 0) >= batch_max and admin.get("backlog", 0) > 0

    wait_for(claimed_ahead, 30, 0.02, "the admin's launch running, one more claimed, the rest waiting")


def _shares_while_all_wait(starts: list[tuple[float, int]], tenants: int) -> tuple[list[float], int]:
    """Each tenant's share of the starts up to the one before the first tenant runs out of work
    (while every tenant still has work waiting), and how many starts that is."""
    last = {}
    for n, (_, i) in enumerate(starts):
        last[i] = n
    window = starts[:min(last.values())]
    return [sum(1 for _, i in window if i == t) / len(window) for t in range(tenants)], len(window)


WEIGHTS = [(1, 1), (1, 1, 1), (1, 1, 1, 1, 1), (2, 1, 1), (3, 1, 1), (3, 1, 1, 1, 1)]


# (weights, REV88_QUEUE_SIZE): with a device queue of 8 the queue's own order decides much; with 2
# (one running, one claimed ahead) the feeder's claims decide alone
# (weights, REV88_QUEUE_SIZE, REV88_BATCH_MAX): with a device queue of 8 the queue's own order
# decides much; with 2 (one running, one claimed ahead) the feeder's claims decide alone; with
# launches of 4 (the default device queue: two launches) the feeder claims several tenants at once
CASES = [(w, 8, 1) for w in WEIGHTS] + [((2, 1, 1), 2, 1), ((3, 1, 1, 1, 1), 2, 1), ((3, 1, 1, 1, 1), 8, 4), ((2, 1, 1), 16, 4), ((3, 1, 1, 1, 1), 4, 4), ((3, 1, 1, 1, 1), 8, 8)]


@pytest.mark.parametrize("weights, queue_size, batch_max", CASES,
                         ids=[f"{'-'.join(map(str, w))}-q{q}-b{b}" for w, q, b in CASES])
def test_each_tenants_share_of_the_starts_is_its_weights_share(tmp_path, weights, queue_size, batch_max):
    """N tenants, each with a deep backlog (a sweep of 36 cells) posted while the device is held:
    over the starts while all still have work waiting, each tenant's share is within ±0.05 of
    weight / total weight."""
    gate = Gate()
    app = create_app(Settings(backend="cpu-fast" if batch_max > 1 else "cpu", workers=1, api_key=ADMIN_KEY,
                              queue_size=queue_size, batch_max=batch_max, data_dir=str(tmp_path / "d")),
                     engines=gated_engines(gate, batching=batch_max > 1))
    per_tenant = 36
    with inprocess_server(app) as server, server.client() as c:
        keys = _keys(c, list(weights))
        gate.hold()
        try:
            _fill_the_device(c, queue_size, batch_max)
            for key in keys:
                _sweep(c, key["key"], list(range(per_tenant)))
        finally:
            gate.release()
        starts = _starts(c, keys, per_tenant * len(keys))
    shares, window = _shares_while_all_wait(starts, len(keys))
    expected = [k["weight"] / sum(weights) for k in keys]
    print(f"weights {weights}, queue {queue_size}, launches of {batch_max}: shares {[round(s, 3) for s in shares]} over {window} starts (expected "
          f"{[round(e, 3) for e in expected]})")
    assert window >= per_tenant, window
    for share, want in zip(shares, expected):
        assert abs(share - want) <= TOLERANCE, (shares, expected, window)


def test_a_tenant_arriving_late_is_served_within_its_share_at_once(tmp_path):
    """Tenants A and B have been served for a while; C's work arrives: from then on C gets its
    third of the starts -- at once (no wait behind A's and B's backlogs) and no more (no credit
    for the time it was idle)."""
    gate = Gate()
    app = create_app(Settings(backend="cpu", workers=1, api_key=ADMIN_KEY, queue_size=8,
                              data_dir=str(tmp_path / "d")), engines=gated_engines(gate))
    with inprocess_server(app) as server, server.client() as c:
        keys = _keys(c, [1, 1, 1])
        late, a, b = keys  # (the late one has the highest key id: an id tie-break would starve it)
        gate.hold()
        try:
            # (backlogs long enough that, however many of them run while this test looks, plenty of both
            # are still waiting when C arrives: the window below counts only while every tenant waits)
            _sweep(c, a["key"], list(range(150)))
            _sweep(c, b["key"], list(range(150)))
        finally:
            gate.release()
        wait_for(lambda: sum(1 for k in (a, b) for t in c.get("/tasks", params={"limit": 500}, headers=bearer(
            k["key"])).json()["tasks"] if t["status"] == "succeeded") >= 30, 120, 0.05, "30 of A's and B's done")
        gate.hold()
        try:
            _sweep(c, late["key"], list(range(30)))
            arrived = wait_for(lambda: c.get("/tasks", params={"limit": 1}, headers=bearer(late["key"])).json()[
                "tasks"][0]["created_at"], 10, what="C's cells")
        finally:
            gate.release()
        starts = _starts(c, keys, 330)
    after = [(at, i) for at, i in starts if at >= arrived]
    shares, window = _shares_while_all_wait(after, 3)
    first_c = next(n for n, (_, i) in enumerate(after) if i == 0)
    print(f"after C arrived: shares {[round(s, 3) for s in shares]} over {window} starts; C's first start: "
          f"#{first_c}")
    # at once: before the work already in the device queue (REV88_QUEUE_SIZE 8) is through, not after
    # A's and B's backlogs
    assert first_c < 8, first_c
    assert window >= 20, window
    for share in shares:
        assert abs(share - 1 / 3) <= TOLERANCE + 1 / window, shares


def test_one_claim_of_several_picks_each_tenant_by_its_weight(tmp_path):
    """One claim that fills several places of the device queue at once (launches of 8, a queue of
    16) picks the tenants by their weights (3 : 1), not in equal numbers: the device queue's own
    order cannot give a tenant more than was claimed for it."""
    gate = Gate()
    app = create_app(Settings(backend="cpu-fast", workers=1, api_key=ADMIN_KEY, queue_size=16, batch_max=8,
                              data_dir=str(tmp_path / "d")), engines=gated_engines(gate, batching=True))
    service = app.state.service
    with inprocess_server(app) as server, server.client() as c:
        heavy, light = sorted(_keys(c, [3, 1]), key=lambda k: -k["weight"])
        feeder = service.runner.feeder
        real_claim_some = feeder.claim_some

        async def no_claims():  # (the plan is read below, before any claim changes it)
            return 0

        feeder.claim_some = no_claims
        try:
            _sweep(c, light["key"], list(range(24)))  # (the light tenant's work the oldest)
            _sweep(c, heavy["key"], list(range(24)))
            limit, picks = feeder.plan()
        finally:
            feeder.claim_some = real_claim_some
            feeder.wake()
        counts = dict(picks)
        assert limit == 16 and sum(counts.values()) == 16, (limit, picks)
        assert counts == {heavy["id"]: 12, light["id"]: 4}, picks
        _starts(c, [heavy, light], 48)  # (and all of it still runs)


def test_fair_share_holds_with_a_shared_ledger(tmp_path, pg_url):
    """The same rule with PostgreSQL's claims: three tenants, weights 2, 1, 1."""
    gate = Gate()
    app = create_app(Settings(backend="cpu", workers=1, api_key=ADMIN_KEY, queue_size=8,
                              data_dir=str(tmp_path / "d"), database_url=pg_url, lease_renew_s=0.2,
                              claim_poll_s=0.1), engines=gated_engines(gate))
    weights = (2, 1, 1)
    with inprocess_server(app) as server, server.client() as c:
        keys = _keys(c, list(weights))
        gate.hold()
        try:
            for key in keys:
                _sweep(c, key["key"], list(range(36)))
        finally:
            gate.release()
        starts = _starts(c, keys, 36 * 3)
    shares, window = _shares_while_all_wait(starts, 3)
    print(f"PostgreSQL, weights {weights}: shares {[round(s, 3) for s in shares]} over {window} starts")
    for share, want in zip(shares, [k["weight"] / 4 for k in keys]):
        assert abs(share - want) <= TOLERANCE, shares


def test_three_tenants_longest_waits_stay_within_twice_each_other_across_replicas(tmp_path, pg_url):
    """Two real replicas (child processes) on one PostgreSQL, three tenants' sweeps posted while the
    device is held: every tenant's longest cell wait (start - creation) is within twice any
    other's (issue #54: the tenant whose key id sorted last waited 5x longer)."""
    from .gates import FileGate
    from .test_replicas import replica

    gate = FileGate(tmp_path / "gate")
    env = {"REV88_API_KEY": ADMIN_KEY, "REV88_QUEUE_SIZE": "4"}
    with replica(tmp_path, pg_url, gate, "a", **env) as ra, replica(tmp_path, pg_url, gate, "b", **env) as rb, \
            httpx.Client(base_url=ra.url, timeout=60) as c:
        keys = _keys(c, [1, 1, 1])
        gate.hold()
        try:
            for key in keys:
                _sweep(c, key["key"], list(range(40)), epochs=20)  # (cells long enough for waits to tell)
        finally:
            gate.release()
        rows = {}
        for i, key in enumerate(keys):
            rows[i] = wait_for(lambda k=key: (t := c.get("/tasks", params={"limit": 500}, headers=bearer(k["key"])).json()[
                "tasks"]) and len(t) == 40 and all(x["status"] in FINISHED for x in t) and t, 180, 0.2,
                f"tenant {i}'s cells")
        assert httpx.get(rb.url + "/v2/health/ready").status_code == 200
    longest = [max(t["started_at"] - t["created_at"] for t in rows[i]) for i in range(3)]
    starts = sorted((t["started_at"], i) for i in rows for t in rows[i])
    shares, window = _shares_while_all_wait(starts, 3)
    print(f"longest cell waits {[round(w, 3) for w in longest]} s; shares {[round(s, 3) for s in shares]} over "
          f"{window} starts")
    assert max(longest) <= 2 * min(longest), longest
    assert all(abs(share - 1 / 3) <= TOLERANCE for share in shares), shares


# --------------------------------------------------------------------------- the rule itself


def test_the_rule_serves_the_least_served_for_its_weight_ties_to_the_longest_waiting():
    fair = FairShare()
    waiting = {"a": Waiting(1.0, since=3.0, count=100), "b": Waiting(1.0, since=1.0, count=100),
               "c": Waiting(2.0, since=2.0, count=100)}
    picks = fair.order(8, waiting)
    assert picks[:3] == ["b", "c", "a"]  # all at zero: the longest waiting first, never by name
    assert picks.count("c") == 4 and picks.count("a") == picks.count("b") == 2  # weight 2: half
    assert fair.order(5, {"z": Waiting(1.0, 0.0, 2), "b": Waiting(1.0, 1.0, 9)}) == ["z", "b", "z", "b", "b"]
    assert fair.order(3, {}) == []


def test_an_idle_tenant_reenters_at_the_current_virtual_time_a_backlogged_one_keeps_its_place():
    fair = FairShare()
    fair.waiting({"busy", "behind"})
    for _ in range(50):
        fair.began(fair.enter("busy", 1.0, 1.0))
        fair.done("busy")
    start = fair.enter("new", 1.0, 1.0)
    assert start == fair.now == 49.0  # neither credit for its idle time nor a wait behind "busy"'s past
    # "behind" has had work waiting in the ledger all along, none of it claimed yet: it keeps its
    # place (served first until it has caught up), whatever the device began meanwhile
    assert fair.next_start("behind") == 0.0
    assert fair.order(3, {"behind": Waiting(1.0, 0.0, 9), "busy": Waiting(1.0, 0.0, 9)}) == ["behind"] * 3
    fair.waiting({"busy"})  # ... once it has none left waiting (and none in the device queue), it is idle
    assert fair.next_start("behind") == 49.0
    fair.waiting({"busy", "behind"})  # back from idle: at the current virtual time
    assert fair.next_start("behind") == 49.0
    # work taken back before it ran gives its charge back
    tag = fair.enter("new", 1.0, 1.0)
    fair.leave("new", tag, 1.0, 1.0)
    assert fair.next_start("new") == tag


def test_virtual_time_never_moves_back_when_a_backlogged_tenant_behind_it_begins():
    """A tenant that kept work waiting runs at a tag behind the current virtual time (it keeps its
    place); the device beginning that work must not move virtual time back -- a tenant back from
    idle would then re-enter with credit for the time it was away."""
    fair = FairShare()
    fair.waiting({"busy", "behind"})
    for _ in range(10):
        fair.began(fair.enter("busy", 1.0, 1.0))
        fair.done("busy")
    assert fair.now == 9.0
    behind = fair.enter("behind", 1.0, 1.0)
    assert behind == 0.0
    fair.began(behind)  # (its work begins: behind now)
    assert fair.now == 9.0
    fair.waiting({"busy", "behind", "back"})
    assert fair.next_start("back") == 9.0  # no credit for its idle time


def test_the_device_queue_runs_equal_tags_oldest_first_whatever_the_tenants_names():
    """Two tenants' first jobs enter at the same virtual time: the one queued first runs first,
    though its tenant's name sorts last; then they alternate."""
    import threading

    from app.runtime.executor import DeviceExecutor

    ex = DeviceExecutor(capacity=100, devices=["cpu:0"])
    hold, order = threading.Event(), []
    ex.start()
    try:
        first = ex.submit(lambda: hold.wait(30), tenant="m")
        wait_for(lambda: ex.busy_workers() == 1, 10, what="the first job running")
        jobs = [ex.submit(lambda n=n: order.append(n), tenant=n[0], cost=1.0) for n in ("z1", "a1", "z2", "a2")]
        hold.set()
        for job in [first, *jobs]:
            job.future.result(30)
        assert order == ["z1", "a1", "z2", "a2"], order
    finally:
        assert ex.stop(30)
