"""Seed-derived states computed in processes of their own (REV88_SEED_PROCESSES, issue #55): the
same bytes and hashes as this process computes, a state under way waited for, a child that dies
or errs loses no state (its launches compute them), and a service that computes a sweep's states
there answers as one that does not."""

from __future__ import annotations

import hashlib
import signal
import threading
import time

import numpy as np
import pytest

from app.main import create_app
from app.settings import Settings, SettingsError
from learner.config import make_config
from learner.seed_processes import SeedProcesses, SeedProcessGone
from learner.seed_state import SeedStateCache, compute_state, states
from learner.taskio import load_task, task_to_npz_bytes
from learner.train import initial_arrays, parameter_names

from .gates import Gate, gated_engines
from .helpers import small_task
from .server import inprocess_server, wait_for

COMPUTE = (initial_arrays, parameter_names)
BODY = task_to_npz_bytes(small_task(70, 9, seed=55))
DIGEST = "sha256:" + hashlib.sha256(BODY).hexdigest()
NPZ = {"Content-Type": "application/octet-stream"}


def _same(a, b) -> bool:
    arrays = list(zip(a.initial, b.initial)) + list(zip(a.permutations, b.permutations))
    return (len(a.initial), len(a.permutations)) == (len(b.initial), len(b.permutations)) and all(
        x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes() for x, y in arrays) and (
        a.initial_sha256 == b.initial_sha256 and a.permutation_sha256 == b.permutation_sha256)


@pytest.fixture(scope="module")
def pool():
    processes = SeedProcesses(1)
    processes.start()
    assert processes.wait_ready(120) == 1
    yield processes
    processes.close()


def test_a_seed_process_computes_the_bytes_and_hashes_this_process_computes(pool):
    wanted = [(make_config({"seed": 3}), 10_000), (make_config({"seed": 4, "epochs": 3}), 57),
              (make_config({"seed": 2**31 + 5, "depth": 1}), 1), (make_config({"seed": 3, "depth": 3}), 640)]
    process = pool.take()
    try:
        got = process.states(wanted)
    finally:
        pool.give(process)
    assert len(got) == len(wanted)
    for state, (config, rows) in zip(got, wanted):
        assert _same(state, compute_state(config, rows)), (config, rows)
        assert [p.shape for p in state.permutations] == [(rows,)] * config.epochs
    assert pool.snapshot() == {"processes": 1, "ready": 1, "states": len(wanted)}
    # each state in memory of its own, no larger than its arrays and their alignment: the cache's
    # bound counts what it keeps (a view on the batch's buffer would keep the whole batch alive)
    owners = [{id(_owner(a)) for a in state.initial + state.permutations} for state in got]
    assert all(len(o) == 1 for o in owners) and len(set.union(*owners)) == len(got)
    for state in got:
        assert len(_owner(state.permutations[0])) < state.nbytes + 64 * (len(state.initial) + len(state.permutations))


def _owner(array):
    """The object whose memory an array views (through its bases and a memoryview's object)."""
    while isinstance(array, (np.ndarray, memoryview)):
        array = array.base if isinstance(array, np.ndarray) else array.obj
    return array


def test_a_batchs_error_is_raised_and_the_process_serves_the_next(pool):
    process = pool.take()
    try:
        with pytest.raises(AttributeError):  # (the child's own error: None has no seed)
            process.states([(make_config({"seed": 1}), 10), (None, 10)])
        assert not process.gone and _same(process.states([(make_config({"seed": 9}), 12)])[0],
                                          compute_state(make_config({"seed": 9}), 12))
    finally:
        pool.give(process)


def test_a_process_that_died_is_said_gone_and_not_lent_again():
    processes = SeedProcesses(1)
    processes.start()
    assert processes.wait_ready(120) == 1
    process = processes.take()
    process.process.kill()
    process.process.wait()
    with pytest.raises(SeedProcessGone):
        process.states([(make_config({"seed": 1}), 10)])
    processes.give(process)
    assert process.gone and processes.take() is None and processes.snapshot()["ready"] == 0
    processes.close()


def test_an_answer_of_another_count_of_states_is_never_paired_by_guess():
    class Says2(list):  # (iterates as one pair, counts two: the child answers one state for "two")
        def __len__(self):
            return 2

    processes = SeedProcesses(1)
    processes.start()
    assert processes.wait_ready(120) == 1
    process = processes.take()
    try:
        with pytest.raises(SeedProcessGone, match="answered 1 states for 2"):
            process.states(Says2([(make_config({"seed": 1}), 10)]))
        assert process.gone and process.process.wait(30) is not None
    finally:
        processes.close()


def test_a_hung_process_is_given_up_after_its_batch_timeout_and_ended():
    processes = SeedProcesses(1, batch_timeout_s=0.5)
    processes.start()
    assert processes.wait_ready(120) == 1
    process = processes.take()
    process.process.send_signal(signal.SIGSTOP)  # (alive, and never answers)
    try:
        t0 = time.monotonic()
        with pytest.raises(SeedProcessGone):
            process.states([(make_config({"seed": 1}), 10)])
        assert time.monotonic() - t0 < 30 and process.gone
        assert process.process.wait(30) is not None  # ended, not left behind
    finally:
        process.process.kill()
        processes.close()


def test_a_state_claimed_for_a_process_is_waited_for_and_one_never_given_is_computed():
    cache = SeedStateCache(compute=COMPUTE)
    config = make_config({"seed": 123})
    key = cache.claim(config, 40)
    assert key is not None and cache.claim(config, 40) is None and not cache.missing(config, 40)
    got = {}
    waiter = threading.Thread(target=lambda: got.setdefault("state", cache.get(config, 40)))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive()  # (waits for the claimed state, does not compute it)
    state = compute_state(config, 40)
    cache.settle(key, state)
    waiter.join(30)
    assert got["state"] is state and cache.get(config, 40) is state
    # a claimed state the process did not give (None): whoever waits computes it
    other = make_config({"seed": 124})
    key = cache.claim(other, 40)
    waiter = threading.Thread(target=lambda: got.setdefault("other", cache.get(other, 40)))
    waiter.start()
    cache.settle(key, None)
    waiter.join(30)
    assert _same(got["other"], compute_state(other, 40)) and cache.claim(other, 40) is None  # (kept now)


@pytest.mark.parametrize("value", ["-1", "65", "two"])
def test_a_bad_seed_process_count_is_refused_naming_the_variable(value):
    with pytest.raises(SettingsError, match="REV88_SEED_PROCESSES"):
        Settings.from_env({"REV88_SEED_PROCESSES": value})


def _sweep_over_fresh_seeds(c, seeds: list[int]) -> dict:
    r = c.post("/sweeps", json={"dataset": DIGEST, "grid": {"learning_rate": [0.1, 0.2]}, "seeds": seeds})
    assert r.status_code == 202, r.text
    return wait_for(lambda: (d := c.get(f"/sweeps/{r.json()['id']}").json())["status"] == "completed" and d,
                    120, 0.05, "the sweep")


def test_a_service_computes_a_sweeps_states_in_its_seed_process_and_answers_the_same(tmp_path):
    """REV88_SEED_PROCESSES=1: ready before the service is, a held sweep's states computed there
    (``prepared_apart``), kept arrays byte-equal to this process's, every cell's hashes a fresh
    in-process cache's; then the child killed: the next sweep's states are computed here, and it
    completes."""
    gate = Gate()
    app = create_app(Settings(backend="cpu-fast", workers=1, data_dir=str(tmp_path / "d"), batch_max=8,
                              batch_wait_ms=50, seed_processes=1), engines=gated_engines(gate))
    rows = load_task(BODY).train_count
    seeds = [550_100 + k for k in range(12)]  # (seeds no other test of this process uses: the cache is the process's)
    with inprocess_server(app) as server, server.client() as c:
        health = c.get("/health").json()["seed_cache"]
        assert health["processes"] == 1 and health["prepared_apart"] == 0
        assert c.put(f"/datasets/{DIGEST}", content=BODY, headers=NPZ).status_code in (200, 201)
        gate.hold()
        doc: dict = {}
        poster = threading.Thread(target=lambda: doc.update(_sweep_over_fresh_seeds(c, seeds)), daemon=True)
        poster.start()
        wait_for(lambda: c.get("/health").json()["seed_cache"]["prepared_apart"] >= len(seeds), 60, 0.02,
                 "the held sweep's states, computed by the seed process")
        for s in seeds:
            kept = states.get(make_config({"seed": s}), rows)
            assert _same(kept, SeedStateCache(compute=COMPUTE).get(make_config({"seed": s}), rows))
        gate.release()
        poster.join(120)
        assert doc["counts"]["succeeded"] == 2 * len(seeds)
        for row in doc["cells"]:
            record = c.get(f"/tasks/{row['task_id']}").json()
            fresh = SeedStateCache(compute=COMPUTE).get(make_config(row["config"]), rows)
            assert record["metadata"]["initial_parameter_sha256"] == fresh.initial_sha256
            assert record["metadata"]["epoch_permutation_sha256"] == fresh.permutation_sha256
            single = c.post("/tasks", params={"dataset": DIGEST, "seed": row["config"]["seed"],
                                              "learning_rate": row["config"]["learning_rate"]}).json()
            assert row["predictions_sha256"] == single["predictions_sha256"]
        # the child killed: nothing waits on it, the next sweep's states are this process's
        apart = c.get("/health").json()["seed_cache"]["prepared_apart"]
        child = app.state.service.seed_processes.processes[0].process
        child.kill()
        child.wait()
        later = [550_200 + k for k in range(6)]
        again = _sweep_over_fresh_seeds(c, later)
        assert again["counts"]["succeeded"] == 2 * len(later)
        health = c.get("/health").json()["seed_cache"]
        assert health["prepared_apart"] == apart and health["processes"] == 0
        for row in again["cells"]:
            fresh = SeedStateCache(compute=COMPUTE).get(make_config(row["config"]), rows)
            assert c.get(f"/tasks/{row['task_id']}").json()["metadata"]["epoch_permutation_sha256"] == \
                fresh.permutation_sha256
