"""Seed-derived state computed once per (seed, shape) and kept (issue #46): the same arrays and
hashes as computing them afresh, an LRU bound by bytes, and no backend writes into the kept arrays."""

from __future__ import annotations

import numpy as np
import pytest

from learner.config import make_config
from learner.hashing import array_sha256, named_sha256
from learner.result import run_task
from learner.seed_state import SeedStateCache, compute_states, states
from learner.train import epoch_permutations, initial_arrays, initial_parameters, parameter_names, prepare

from .helpers import small_task

COMPUTE = (initial_arrays, parameter_names)


def test_a_kept_state_equals_one_computed_afresh():
    cache = SeedStateCache(compute=COMPUTE)
    config = make_config({"seed": 77, "epochs": 3})
    state = cache.get(config, 50)
    fresh_initial = [p.numpy() for p in initial_parameters(config)]
    fresh_perms = epoch_permutations(config, 50)
    assert all(np.array_equal(a, b) for a, b in zip(state.initial, fresh_initial))
    assert all(np.array_equal(a, b) for a, b in zip(state.permutations, fresh_perms))
    assert state.initial_sha256 == named_sha256(parameter_names(config.depth), fresh_initial)
    assert state.permutation_sha256 == [array_sha256(p) for p in fresh_perms]
    # another learning rate, the same seed and shape: the same state, kept
    assert cache.get(make_config({"seed": 77, "epochs": 3, "learning_rate": 0.3}), 50) is state
    assert (cache.hits, cache.misses) == (1, 1)
    assert cache.get(make_config({"seed": 77, "epochs": 2}), 50) is not state  # epochs differ
    assert cache.get(config, 51) is not state  # the training count differs


def test_the_cache_is_bounded_by_bytes():
    one = SeedStateCache(compute=COMPUTE).get(make_config({"seed": 1}), 1000).nbytes
    cache = SeedStateCache(max_bytes=3 * one, compute=COMPUTE)
    for seed in range(5):
        cache.get(make_config({"seed": seed}), 1000)
    snap = cache.snapshot()
    assert snap["states"] == 3 and snap["bytes"] <= 3 * one
    first = cache.get(make_config({"seed": 4}), 1000)
    assert cache.get(make_config({"seed": 4}), 1000) is first  # the newest kept
    tiny = SeedStateCache(max_bytes=10, compute=COMPUTE)
    tiny.get(make_config({"seed": 1}), 1000)
    assert tiny.snapshot()["states"] == 0  # larger than the whole bound: computed, not kept
    with pytest.raises(ValueError, match=">= 0 bytes"):
        from learner.seed_state import configure

        configure(-1)


def test_a_large_insert_evicts_as_many_states_as_it_takes_to_stay_within_the_bound():
    """The bound holds after every insert, however much larger the new state is than the ones it
    pushes out (issue #54: one eviction per insert left the cache over its bound)."""
    one = SeedStateCache(compute=COMPUTE).get(make_config({"seed": 1}), 1000).nbytes
    large = SeedStateCache(compute=COMPUTE).get(make_config({"seed": 1}), 5000).nbytes
    assert 2 * one < large <= 3 * one  # (it takes at least two small states' room)
    cache = SeedStateCache(max_bytes=3 * one, compute=COMPUTE)
    for seed in range(3):
        cache.get(make_config({"seed": seed}), 1000)
    assert cache.snapshot()["states"] == 3
    kept = cache.get(make_config({"seed": 9}), 5000)
    snap = cache.snapshot()
    assert snap["bytes"] <= snap["max_bytes"] == 3 * one, snap
    assert snap["states"] == 1 and cache.get(make_config({"seed": 9}), 5000) is kept  # the newest stays
    cache.resize(one)  # a smaller bound: as many out as it takes
    assert cache.snapshot()["bytes"] <= one


def _fresh(config, rows):
    """A state's arrays and hashes from learner.train's functions, one at a time."""
    initial = [p.numpy() for p in initial_parameters(config)]
    perms = epoch_permutations(config, rows)
    return initial, perms, named_sha256(parameter_names(config.depth), initial), [array_sha256(p) for p in perms]


def test_states_computed_together_are_each_the_state_computed_alone():
    """A batch of mixed shapes (seeds, epochs, depths, training counts), in its own order: each
    state has its own arrays and its own hashes, as computed one at a time."""
    wanted = [(make_config({"seed": 5, "epochs": 2}), 40), (make_config({"seed": 6, "epochs": 3}), 40),
              (make_config({"seed": 5, "epochs": 2}), 41), (make_config({"seed": 7, "depth": 3}), 40),
              (make_config({"seed": 8, "epochs": 1, "depth": 1}), 17), (make_config({"seed": 9, "epochs": 2}), 40)]
    got = compute_states(wanted, compute=COMPUTE)
    assert len(got) == len(wanted)
    for state, (config, rows) in zip(got, wanted):
        initial, perms, initial_sha, perm_sha = _fresh(config, rows)
        assert len(state.initial) == len(initial) and len(state.permutations) == config.epochs
        assert all(np.array_equal(a, b) for a, b in zip(state.initial, initial))
        assert all(np.array_equal(a, b) for a, b in zip(state.permutations, perms))
        assert (state.initial_sha256, state.permutation_sha256) == (initial_sha, perm_sha), config


def test_a_batch_prepared_is_kept_and_what_is_kept_is_not_computed_again():
    cache = SeedStateCache(compute=COMPUTE)
    kept = cache.get(make_config({"seed": 21}), 30)
    wanted = [(make_config({"seed": s}), 30) for s in (20, 21, 22)] + [(make_config({"seed": 20}), 31)]
    assert cache.prepare(wanted) == 3  # (seed 21's is kept already)
    assert not any(cache.missing(*pair) for pair in wanted)
    assert cache.get(make_config({"seed": 21}), 30) is kept
    for config, rows in wanted:
        state = cache.get(config, rows)
        assert (state.initial_sha256, state.permutation_sha256) == _fresh(config, rows)[2:]
    assert cache.prepare(wanted) == 0

    def failing(config):
        raise RuntimeError("no state")

    broken = SeedStateCache(compute=(failing, parameter_names))
    with pytest.raises(RuntimeError, match="no state"):
        broken.prepare(wanted)
    assert all(broken.missing(*pair) for pair in wanted)  # none kept, none left under way


@pytest.mark.parametrize("backend", ["cpu", "cpu-fast"])
def test_no_backend_writes_into_the_kept_arrays(backend):
    task = small_task(40, 6, seed=46)
    config = make_config({"seed": 4646, "epochs": 2})
    state = states.get(config, task.train_count)
    before = [array_sha256(a) for a in state.initial + state.permutations]
    result = run_task(task, config, backend)
    assert [array_sha256(a) for a in state.initial + state.permutations] == before
    prepared = prepare(task, config)
    assert prepared.initial is state.initial and prepared.permutation_sha256 == state.permutation_sha256
    assert result.metadata["epoch_permutation_sha256"] == state.permutation_sha256
    assert result.metadata["initial_parameter_sha256"] == state.initial_sha256


def test_a_state_under_way_is_waited_for_not_computed_twice():
    """Two threads ask for the same state at once: one computes it, the other waits and gets the
    same object; ``missing`` says False while it is under way; a failed computation leaves the
    key free for the next asker."""
    import threading

    started, go, calls = threading.Event(), threading.Event(), []

    def slow_initial(config):
        calls.append(config.seed)
        started.set()
        assert go.wait(30)
        return initial_arrays(config)

    cache = SeedStateCache(compute=(slow_initial, parameter_names))
    config = make_config({"seed": 4601})
    got = {}
    # daemon threads, and ``go`` set whatever happens: a broken cache fails this test, it never
    # keeps pytest from exiting
    first = threading.Thread(target=lambda: got.setdefault("first", cache.get(config, 30)), daemon=True)
    second = threading.Thread(target=lambda: got.setdefault("second", cache.get(config, 30)), daemon=True)
    try:
        first.start()
        assert started.wait(30)
        assert not cache.missing(config, 30)  # under way
        second.start()
        second.join(0.2)
        assert second.is_alive() and "second" not in got  # waiting for the first, not computing
    finally:
        go.set()
        first.join(30)
        second.join(30)
    assert not first.is_alive() and not second.is_alive()
    assert got["first"] is got["second"] and calls == [4601]
    assert (cache.hits, cache.misses) == (1, 1)

    def failing(config):
        raise RuntimeError("no state")

    broken = SeedStateCache(compute=(failing, parameter_names))
    with pytest.raises(RuntimeError, match="no state"):
        broken.get(config, 30)
    assert broken.missing(config, 30)  # free again
    broken.compute = COMPUTE
    assert broken.get(config, 30).initial_sha256 == cache.get(config, 30).initial_sha256
