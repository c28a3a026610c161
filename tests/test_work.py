"""A unit of work's life (app/tasks/work.py) on its own: every step only forward, one method each,
an illegal step said at once; its outcome taken once; what the ledger keeps of it."""

from __future__ import annotations

import threading

import pytest

from app.tasks.work import IllegalStep, State, Work
from learner.config import Config


def work(**fields) -> Work:
    return Work(task_id="t1", task=None, config=Config(), backend="cpu", **fields)


def test_a_recorded_unit_lives_every_state_in_order():
    w = work(mode="async")
    seen = [w.state]
    for step in (w.record, w.wait, w.queue, w.give_back, w.queue, w.start):
        step()
        seen.append(w.state)
    assert w.finish() is True
    seen.append(w.state)
    w.tell()
    seen.append(w.state)
    S = State
    assert seen == [S.ADMITTED, S.RECORDED, S.WAITING, S.QUEUED, S.WAITING, S.QUEUED, S.RUNNING, S.FINISHED, S.TOLD]
    assert w.over


def test_a_synchronous_task_goes_from_admitted_to_queued():
    w = work()
    w.queue()
    w.start()
    assert w.state is State.RUNNING and not w.over


@pytest.mark.parametrize("steps, illegal", [
    ((), "start"),              # not queued
    ((), "tell"),               # not finished
    ((), "give_back"),          # not queued
    (("record",), "record"),    # recorded once
    (("queue",), "wait"),       # queued: back to waiting only by give_back
    (("queue", "start"), "queue"),
    (("queue", "start"), "give_back"),  # running: too late to take back
    (("queue", "start", "finish"), "start"),
    (("queue", "start", "finish", "tell"), "tell"),
])
def test_an_illegal_step_raises_and_leaves_the_state_as_it_was(steps, illegal):
    w = work()
    for step in steps:
        getattr(w, step)()
    before = w.state
    with pytest.raises(IllegalStep, match=f"work t1: {illegal} from {before.value}"):
        getattr(w, illegal)()
    assert w.state is before


@pytest.mark.parametrize("steps", [(), ("queue",), ("queue", "start")])
def test_the_first_outcome_wins_and_a_late_one_is_refused_until_and_after_it_is_told(steps):
    w = work()
    for step in steps:
        getattr(w, step)()
    assert w.finish() is True
    assert w.finish() is False  # finished: a late outcome (a run ending after its timeout answered) is dropped
    w.tell()
    assert w.finish() is False and w.state is State.TOLD


def _race(w: Work, wins: list[bool], start: threading.Barrier) -> None:
    start.wait()
    wins.append(w.finish())


def test_outcomes_racing_from_many_threads_have_exactly_one_winner():
    for _ in range(50):
        w = work()
        w.queue()
        w.start()
        wins: list[bool] = []
        threads = [threading.Thread(target=_race, args=(w, wins, start)) for start in [threading.Barrier(8)] * 8]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(wins) == [False] * 7 + [True]


def test_what_the_ledger_keeps_of_it_is_what_a_claim_on_another_replica_needs():
    w = work(include_scores=True, dataset="sha256:" + "a" * 64, sweep="sw-1", evaluation=None, owner="k-1",
             webhook={"url": "http://127.0.0.1:9/h", "events": ["completed"]}, precision="ieee")
    assert w.options() == {"include_scores": True, "measure": None, "dataset": "sha256:" + "a" * 64,
                           "sweep": "sw-1", "owner": "k-1",
                           "webhook": {"url": "http://127.0.0.1:9/h", "events": ["completed"]}, "precision": "ieee"}
    assert work().options() == {"include_scores": False, "measure": None}  # (unset fields not written)
    assert work(measure={"trials": 1}).kind == "measure" and work().kind == "task"


def test_a_recorded_task_run_again_elsewhere_is_admitted_as_it_was():
    """What the ledger keeps (``options()``) and what a claim of it on another replica, or a
    restart, reads back (``Work.from_record``): the same unit, waiting, every option kept."""
    from types import SimpleNamespace

    first = work(mode="async", include_scores=True, measure={"trials": 2}, dataset="sha256:" + "b" * 64,
                 sweep="sw-2", evaluation="ev-3", owner="k-9", webhook={"url": "http://127.0.0.1:9/h", "events": []},
                 precision="tf32x3", body_bytes=1234, created_at=1_700_000_000.5)
    record = SimpleNamespace(id=first.task_id, backend=first.backend, options=first.options(),
                             body_bytes=first.body_bytes, created_at=first.created_at)
    again = Work.from_record(record, None, first.config, labels="the labels")
    assert again.state is State.WAITING and again.labels == "the labels" and again.config is first.config
    fields = ("task_id", "backend", "mode", "include_scores", "measure", "dataset", "sweep", "evaluation", "owner",
              "webhook", "precision", "body_bytes", "created_at", "kind")
    assert {f: getattr(again, f) for f in fields} == {f: getattr(first, f) for f in fields}
    assert again.options() == first.options()
