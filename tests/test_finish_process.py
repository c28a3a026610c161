"""A launch finished in a process of its own (app/tasks/finish_process.py, REV88_FINISH_PROCESS)
gives the answers the in-thread finishing gives, byte for byte, paired with their tasks: every
kind of outcome of a launch (device predictions or not, a diverged run, a cancel, a task that
failed before the launch), a real service's sweep, and a child that dies."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib

import numpy as np
import pytest

from app.ledger.rows import encode_answer
from app.settings import Settings
from app.tasks.answers import task_answer
from app.tasks.device import DeviceOutcome, Launch, finish_launch
from app.tasks.finish_process import FinishProcess
from learner.backends import get_backend
from learner.cancel import CancelToken
from learner.config import make_config
from learner.taskio import task_to_npz_bytes
from learner.train import prepare

from .helpers import small_task

TIMING = {"run_ms": 1.0, "tasks_in_launch": 6}


def _launch(seeds: list[int], *, known: set[int] = frozenset(), diverged: set[int] = frozenset(),
            cancelled: set[int] = frozenset(), failed: set[int] = frozenset(), bad: set[int] = frozenset()) -> Launch:
    """A launch of small tasks run for real on cpu-fast, one per seed; ``known``: seeds whose
    output carries its predictions (as a GPU's); ``diverged``: a NaN put in its scores;
    ``cancelled``: its token cancelled after the run; ``failed``: an error instead of a run;
    ``bad``: predictions of the wrong dtype from its backend."""
    engine = get_backend("cpu-fast")
    items, runs = [], []
    for k, seed in enumerate(seeds):
        task = small_task(40 + k, 9, seed=seed)
        config = make_config({"seed": seed, "epochs": 2})
        cancel = CancelToken()
        items.append((task, config, cancel))
        if seed in failed:
            runs.append(ValueError(f"task of seed {seed} failed before the launch"))
            continue
        prepared = prepare(task, config, cancel)
        out = engine.run(task, prepared)
        if seed in known:
            out = dataclasses.replace(out, predictions=out.scores.argmax(axis=1).astype(np.int64))
        if seed in bad:
            out = dataclasses.replace(out, predictions=out.scores.argmax(axis=1).astype(np.int32))
        if seed in diverged:
            out.scores[0, 3] = np.nan
        if seed in cancelled:
            cancel.cancel("stopped by its client")
        runs.append((task, config, prepared, out, 0.001 * (k + 1)))
    return Launch(items, engine, runs, None, "no meter here", 0.01)


def _same(here: list, there: list) -> None:
    assert len(here) == len(there)
    for a, b in zip(here, there):
        assert type(a) is type(b), (a, b)
        if not isinstance(a, DeviceOutcome):
            assert str(a) == str(b)
            continue
        ra, rb = a.result, b.result
        assert rb.predictions.dtype == np.int64 and np.array_equal(ra.predictions, rb.predictions)
        assert rb.metadata["run_count"] != ra.metadata["run_count"]  # (each counts its own results)
        rb.metadata["run_count"] = ra.metadata["run_count"]
        assert list(ra.metadata) == list(rb.metadata) and ra.metadata == rb.metadata
        assert (encode_answer(task_answer("t", None, a, TIMING, False))
                == encode_answer(task_answer("t", None, b, TIMING, False)))


@pytest.fixture(scope="module")
def finisher():
    process = FinishProcess()
    yield process
    process.close()


def test_every_outcome_of_a_launch_is_the_same_as_finished_in_the_thread(finisher):
    seeds = [11, 12, 13, 14, 15, 16, 17]
    pool = concurrent.futures.ThreadPoolExecutor(2)
    launch = _launch(seeds, known={12}, diverged={13}, cancelled={14}, failed={15}, bad={17})
    here, there = finish_launch(launch, pool), finisher.finish(launch, pool)
    _same(here, there)
    kinds = [type(o).__name__ for o in there]
    assert kinds == ["DeviceOutcome", "DeviceOutcome", "TrainingDivergedError", "TaskCancelled", "ValueError",
                     "DeviceOutcome", "ValueError"]
    assert "predictions must be int64" in str(there[6])
    assert finisher.broken is None and finisher.counters["finished_here"] == 1  # (the bad predictions)
    # each answer is its own task's: its seed in its config, its inputs' hashes
    for seed, outcome, (task, *_rest) in zip(seeds, there, launch.items):
        if isinstance(outcome, DeviceOutcome):
            assert outcome.result.metadata["config"]["seed"] == seed
            assert outcome.result.metadata["input_hashes"] == task.input_hashes()


def test_a_launch_of_one_or_of_mixed_shapes_is_finished_in_the_thread(finisher):
    before = dict(finisher.counters)
    pool = concurrent.futures.ThreadPoolExecutor(2)
    one = _launch([21])
    _same(finish_launch(one, pool), finisher.finish(one, pool))
    assert finisher.counters == before


def test_a_child_that_dies_is_said_and_the_launches_are_finished_here(caplog):
    process = FinishProcess()
    try:
        process._proc.kill()
        process._proc.join(10)
        pool = concurrent.futures.ThreadPoolExecutor(2)
        with caplog.at_level("ERROR", logger="rev88.app.tasks.finish_process"):
            launch = _launch([31, 32])
            there = process.finish(launch, pool)
        assert process.broken is not None and "finishing process failed" in caplog.text
        _same(finish_launch(launch, pool), there)
        later = _launch([33, 34])
        _same(finish_launch(later, pool), process.finish(later, pool))
    finally:
        process.close()


def test_a_service_with_a_finish_process_pairs_every_cell_with_its_answer(tmp_path):
    """A real server (cpu-fast, launches of 8) with REV88_FINISH_PROCESS: a sweep's cells, held on
    the device until all are queued, run in launches finished in the child; each cell's record is
    what the task alone gives."""
    from app.main import create_app

    from .gates import Gate, gated_engines
    from .server import inprocess_server, wait_for
    from .test_pairing import _assert_alone

    body = task_to_npz_bytes(small_task(90, 12, seed=54))
    digest = "sha256:" + hashlib.sha256(body).hexdigest()
    gate = Gate()
    app = create_app(Settings(backend="cpu-fast", workers=1, batch_max=8, batch_wait_ms=100, queue_size=16,
                              finish_process=True, data_dir=str(tmp_path / "data")),
                     engines=gated_engines(gate, batching=True))
    with inprocess_server(app) as server, server.client() as c:
        assert c.put(f"/datasets/{digest}", content=body,
                     headers={"Content-Type": "application/octet-stream"}).status_code in (200, 201)
        gate.hold()
        try:
            held = c.post("/tasks", content=body, headers={"Content-Type": "application/octet-stream",
                                                           "Prefer": "respond-async"}).json()["id"]
            wait_for(lambda: c.get(f"/tasks/{held}").json()["status"] == "running", 60, 0.05, "a task held")
            sweep = c.post("/sweeps", json={"dataset": digest, "seeds": [0, 1, 2, 3, 4, 5, 6, 7]}).json()["id"]
            wait_for(lambda: c.get("/health").json()["admission"]["device_queue"]["depth"] == 8, 60, 0.02,
                     "the cells queued behind the held task")
        finally:
            gate.release()
        doc = wait_for(lambda: (d := c.get(f"/sweeps/{sweep}").json())["status"] == "completed" and d, 120, 0.1,
                       "the sweep")
        records = [c.get(f"/tasks/{row['task_id']}").json() for row in doc["cells"]]
        counters = dict(app.state.service.finish_process.counters)
    assert counters["launches"] >= 1 and counters["tasks"] >= 8, counters
    for row, record in zip(doc["cells"], records):
        assert record["status"] == "succeeded", record
        _assert_alone(record, row["config"]["seed"], f"the cell of seed {row['config']['seed']}")
