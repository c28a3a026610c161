"""Epoch permutations of many seeds at once (learner/permutations.py, learner/permutations.c): the
same arrays as numpy's ``Generator(PCG64(seed)).permutation``, epoch after epoch, whichever way
they are drawn; a C path that differs from numpy is never used."""

from __future__ import annotations

import numpy as np
import pytest

from learner import permutations
from learner.cancel import CancelToken, TaskCancelled

SEEDS = [0, 1, 2, 7, 88, 4242, 2**31 - 1, 2**32 + 5, 2**63 - 1]


def _extension():
    return pytest.importorskip("learner._permutations", reason="the C extension is not built here")


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 64, 1000, 10_000, 65_537])
def test_the_extension_draws_numpys_permutations_epoch_after_epoch(n):
    permute = _extension().permute
    generators = [np.random.PCG64(seed) for seed in SEEDS]
    want = [permutations.numpy_permutations(seed, 3, n) for seed in SEEDS]
    for epoch in range(3):  # (each generator goes on where its last call left it, as numpy's does)
        arrays = [np.full(n, -1, dtype=np.int64) for _ in SEEDS]
        permute(generators, arrays)
        for seed, got, expected in zip(SEEDS, arrays, want):
            assert np.array_equal(got, expected[epoch]), (seed, n, epoch)


def test_the_extension_leaves_a_generator_where_numpys_permutation_leaves_it():
    permute = _extension().permute
    ours, theirs = np.random.PCG64(31), np.random.PCG64(31)
    permute([ours], [np.empty(777, dtype=np.int64)])
    np.random.Generator(theirs).permutation(777)
    assert ours.state == theirs.state  # (the next draw of either, of any kind, is the same)


def test_the_extension_refuses_what_it_cannot_fill():
    permute = _extension().permute
    with pytest.raises(ValueError, match="2 bit generators but 1 outputs"):
        permute([np.random.PCG64(1), np.random.PCG64(2)], [np.empty(3, dtype=np.int64)])
    with pytest.raises(ValueError, match="not a native int64"):
        permute([np.random.PCG64(1)], [np.empty(3, dtype=np.int32)])
    with pytest.raises(ValueError, match="not a native int64"):
        permute([np.random.PCG64(1)], [np.empty(3, dtype=np.float64)])
    read_only = np.empty(3, dtype=np.int64)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        permute([np.random.PCG64(1)], [read_only])
    with pytest.raises(ValueError, match="not C-contiguous"):
        permute([np.random.PCG64(1)], [np.empty(6, dtype=np.int64)[::2]])  # not contiguous
    with pytest.raises(AttributeError):
        permute([object()], [np.empty(3, dtype=np.int64)])  # not a bit generator


@pytest.mark.parametrize("n, epochs", [(0, 1), (1, 1), (19, 3), (10_000, 2)])
def test_epoch_permutations_are_numpys_for_every_seed(n, epochs):
    got = permutations.epoch_permutations(SEEDS, epochs, n)
    assert len(got) == len(SEEDS)
    for seed, perms in zip(SEEDS, got):
        want = permutations.numpy_permutations(seed, epochs, n)
        assert len(perms) == epochs
        assert all(a.dtype == np.int64 and np.array_equal(a, b) for a, b in zip(perms, want)), seed
    # each array its own memory: a kept state must not hold its batch's buffer
    arrays = [a for perms in got for a in perms]
    assert all(a.base is None and a.flags.writeable for a in arrays)


def test_the_fast_way_is_used_where_it_is_built():
    _extension()
    permutations.fast.cache_clear()
    assert permutations.fast()


def test_a_c_path_that_differs_from_numpy_is_never_used(monkeypatch):
    """A build (or a numpy) whose draws differ: ``fast`` says no, and numpy draws them."""

    class Off:
        @staticmethod
        def permute(generators, arrays):
            for g, a in zip(generators, arrays):
                a[:] = np.random.Generator(g).permutation(len(a))[::-1]  # (numpy's reversed)

    monkeypatch.setattr(permutations, "_extension", lambda: Off)
    permutations.fast.cache_clear()
    try:
        assert not permutations.fast()
        got = permutations.epoch_permutations([5, 6], 2, 50)
        assert all(np.array_equal(a, b) for perms, seed in zip(got, [5, 6])
                   for a, b in zip(perms, permutations.numpy_permutations(seed, 2, 50)))
    finally:
        permutations.fast.cache_clear()


def test_rev88_fast_permutations_0_draws_with_numpy(monkeypatch):
    monkeypatch.setenv("REV88_FAST_PERMUTATIONS", "0")
    permutations.fast.cache_clear()
    try:
        assert not permutations.fast()
        got = permutations.epoch_permutations([3], 2, 40)[0]
        assert all(np.array_equal(a, b) for a, b in zip(got, permutations.numpy_permutations(3, 2, 40)))
    finally:
        permutations.fast.cache_clear()


def test_a_cancel_stops_between_epochs():
    token = CancelToken()
    token.cancel()
    with pytest.raises(TaskCancelled):
        permutations.epoch_permutations([1, 2], 2, 100, token)
