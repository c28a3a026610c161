"""The runner's one entry (app/tasks/submit.py): what it decides for each kind of work, on a
recording stand-in for the runner (the decisions alone; the real runner takes every one of these
paths in the server tests: test_app_tasks.py, test_launches.py, test_admission.py, test_claims.py).

    where a body is parsed    its job (late), the loop (small), the io pool (large)
    when it is recorded       now (async, a key, a webhook, cells) or at its end (plain sync)
    where it waits            the ledger (offered to the feeder), the device queue, or as a claim
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from app.errors import QueueFull
from app.tasks import submit as entry
from app.tasks.answers import Settled
from learner.budget import BudgetExceeded
from learner.config import make_config
from learner.taskio import task_to_npz_bytes

from .helpers import small_task

SMALL = task_to_npz_bytes(small_task(30, 5, seed=1))
LARGE = task_to_npz_bytes(small_task(3000, 300, seed=2))  # over PARSE_ON_LOOP_BYTES
LIMITS = {"max_work": 10**12, "max_bytes": 10**12}


def parse(body, **how):
    options = {"recorded_now": False, "asynchronous": False, "measure": False, "batching": True, "pool": None,
               **LIMITS, **how}
    return asyncio.run(entry.parse_upload(body, make_config({}), **options))


def test_the_sizes_are_on_either_side_of_the_loops_limit():
    assert len(SMALL) <= entry.PARSE_ON_LOOP_BYTES < len(LARGE)


def test_a_plain_synchronous_task_on_a_backend_that_does_not_batch_is_parsed_by_its_job():
    parsed = parse(SMALL, batching=False)
    assert parsed.task is None and parsed.late is not None and parsed.body_sha256 is None
    assert parsed.late().train_count == 30  # (its job's call: parsed and budget-checked there)


@pytest.mark.parametrize("how", [{"recorded_now": True}, {"measure": True}, {"batching": True}])
def test_anything_else_is_parsed_before_it_is_queued(how):
    parsed = parse(SMALL, **{"batching": False, **how})
    assert parsed.late is None and parsed.task.train_count == 30


def test_a_small_body_is_parsed_on_the_loop_and_a_large_one_on_the_io_pool(monkeypatch):
    where = []
    real = entry._parse

    def spy(*args):
        where.append(threading.get_ident())
        return real(*args)

    monkeypatch.setattr(entry, "_parse", spy)
    loop_thread = []

    async def both():
        loop_thread.append(threading.get_ident())
        for body in (SMALL, LARGE):
            await entry.parse_upload(body, make_config({}), recorded_now=False, asynchronous=False, measure=False,
                                     batching=True, pool=None, **LIMITS)

    asyncio.run(both())
    assert where[0] == loop_thread[0] and where[1] != loop_thread[0]


def test_the_body_is_hashed_only_when_the_task_is_recorded_before_it_runs():
    assert parse(SMALL).body_sha256 is None
    assert len(parse(SMALL, recorded_now=True).body_sha256) == 64


def test_the_budget_is_checked_where_the_body_is_parsed():
    with pytest.raises(BudgetExceeded) as refused:
        parse(SMALL, max_work=10)
    assert "work units" in str(refused.value)


class Recorder:
    """The runner's side of ``submit``: what it was asked to do, in order."""

    def __init__(self, created: bool = True, full: bool = False, launches_ahead: int = 8,
                 recorded: set[str] | None = None) -> None:
        self.calls: list[tuple] = []
        self.created, self.full = created, full
        self.feeder = self
        self.ledger = self
        self.io_pool = None
        self.launches_ahead = launches_ahead  # (the first chunk of cells recorded)
        self.recorded = recorded if recorded is not None else set()  # ids the ledger has (another request's)

    # the runner
    def record(self, acc, body_sha256, body_bytes, body, key):
        self.calls.append(("record", acc.name, body is not None, key))
        return f"record of {acc.name}", self.created

    def prepare_ahead(self, accs):
        self.calls.append(("prepare_ahead", [a.name for a in accs]))

    def record_many(self, accs, messages):
        if any(a.name in self.recorded for a in accs):
            self.calls.append(("refused", [a.name for a in accs]))
            raise ValueError("a task id is already in the ledger")  # (all of them or none)
        self.calls.append(("record_many", [a.name for a in accs], messages))
        self.recorded.update(a.name for a in accs)

    def queue(self, acc, fed=False):
        if self.full:
            raise QueueFull("the device queue is full")
        self.calls.append(("queue", acc.name, fed))

    def watch(self, acc):
        self.calls.append(("watch", acc.name))

    async def settle(self, acc, gone=None):
        self.calls.append(("settle", acc.name))
        return Settled(200, {"id": acc.name})

    # the feeder
    def offer(self, acc):
        self.calls.append(("offer", acc.name))

    # the ledger
    def statuses(self, task_ids):
        return {t: "queued" for t in task_ids if t in self.recorded}

    def finish(self, task_id, status, answer, error, epoch=None):
        self.calls.append(("finish", task_id, status, error["status"]))


class Work:
    def __init__(self, name: str, mode: str = "sync", deferred: bool = False) -> None:
        self.name = self.task_id = name
        self.mode, self.deferred = mode, deferred
        self.body_bytes, self.task, self.epoch = 10, None, None
        self.state = "admitted"

    def record(self) -> None:  # (app/tasks/work.py's step: in the ledger now)
        assert self.state == "admitted"
        self.state = "recorded"


def run(runner, work, **how):
    return asyncio.run(entry.submit(runner, work, **how))


def test_an_asynchronous_task_is_recorded_with_its_body_then_waits_in_the_ledger():
    r = Recorder()
    done = run(r, Work("a", "async"), body=b"npz", key="k")
    assert r.calls == [("record", "a", True, "k"), ("offer", "a")]
    assert done.record == "record of a" and done.created and done.settled is None


def test_a_plain_synchronous_task_is_queued_at_once_and_recorded_at_its_end():
    r = Recorder()
    done = run(r, Work("s", deferred=True), body=b"npz")
    assert r.calls == [("queue", "s", False), ("settle", "s")]
    assert done.record is None and done.settled.body == {"id": "s"}


def test_a_synchronous_task_with_a_key_is_recorded_first_without_its_body():
    r = Recorder()
    run(r, Work("k"), body=b"npz", key="key")
    assert r.calls == [("record", "k", False, "key"), ("queue", "k", False), ("settle", "k")]


def test_a_key_seen_before_answers_that_task_and_queues_nothing():
    r = Recorder(created=False)
    done = run(r, Work("again", "async"), body=b"npz", key="key")
    assert r.calls == [("record", "again", True, "key")] and not done.created


def test_a_recorded_synchronous_task_the_queue_refuses_is_recorded_failed_and_refused():
    r = Recorder(full=True)
    with pytest.raises(QueueFull):
        run(r, Work("f"), key="key")
    assert r.calls == [("record", "f", False, "key"), ("finish", "f", "failed", 503)]


def test_cells_are_recorded_together_then_each_waits_in_the_ledger():
    r = Recorder()
    run(r, [Work("c1", "async"), Work("c2", "async")], messages=[("m",)])
    # (their seed states begun first: computed while the ledger records them)
    assert r.calls == [("prepare_ahead", ["c1", "c2"]), ("record_many", ["c1", "c2"], [("m",)]),
                       ("offer", "c1"), ("offer", "c2")]


def test_a_large_batch_of_cells_is_recorded_in_growing_chunks_each_offered_before_the_next_is_written():
    r = Recorder(launches_ahead=2)
    cells = [Work(f"c{i}", "async") for i in range(9)]
    done = run(r, cells, messages=[("m",)])
    names = [c.name for c in cells]
    # the first launches' chunk first, then twice as many each time; the webhook's rows with the first
    assert r.calls == [("prepare_ahead", names),
                       ("record_many", names[:2], [("m",)]), *[("offer", n) for n in names[:2]],
                       ("record_many", names[2:6], None), *[("offer", n) for n in names[2:6]],
                       ("record_many", names[6:], None), *[("offer", n) for n in names[6:]]]
    assert all(c.state == "recorded" for c in cells) and done.created


def test_cells_another_request_recorded_meanwhile_are_left_to_it_and_the_rest_recorded_here():
    # the same Idempotency-Key's other request at once: it recorded c1 and c4 (with the webhook's rows)
    r = Recorder(launches_ahead=2, recorded={"c1", "c4"})
    cells = [Work(f"c{i}", "async") for i in range(6)]
    run(r, cells, messages=[("m",)])
    assert r.calls == [("prepare_ahead", [c.name for c in cells]),
                       ("refused", ["c0", "c1"]), ("record_many", ["c0"], None), ("offer", "c0"),
                       ("refused", ["c2", "c3", "c4", "c5"]), ("record_many", ["c2", "c3", "c5"], None),
                       *[("offer", n) for n in ("c2", "c3", "c5")]]
    assert [c.state for c in cells] == ["recorded", "admitted", "recorded", "recorded", "admitted", "recorded"]


def test_cells_all_recorded_by_another_request_are_not_offered_again():
    r = Recorder(launches_ahead=2, recorded={"c0", "c1", "c2"})
    done = run(r, [Work(f"c{i}", "async") for i in range(3)], messages=[("m",)])
    assert [c for c in r.calls if c[0] in ("record_many", "offer")] == [] and not done.created


def test_a_cell_the_ledger_refuses_for_another_reason_is_an_error():
    class Refusing(Recorder):
        def record_many(self, accs, messages):
            raise ValueError("task ... kind must be one of ...")

    with pytest.raises(ValueError, match="kind must be"):
        run(Refusing(), [Work("c0", "async")])


def test_a_claim_is_queued_as_the_feeders_and_watched_for_a_failure_before_its_launch():
    r = Recorder()
    run(r, Work("claimed", "async"), claimed=True)
    assert r.calls == [("queue", "claimed", True), ("watch", "claimed")]
