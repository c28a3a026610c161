"""A task's epoch orders: epoch e trains in the order of the e-th permutation drawn from one numpy
``Generator(PCG64(seed))`` -- of many seeds at once.

``numpy_permutations`` is the definition. ``epoch_permutations`` gives the same arrays; where
learner/permutations.c is built (the ``learner._permutations`` extension) and gives numpy's
arrays on this machine (checked once per process, ``fast``), each epoch of every seed is drawn in
one call that lets go of the GIL once, from numpy's own generators, instead of a few numpy calls
per seed that each let go of it and take it back: in a busy service each take-back waits behind
the other threads' Python (docs/performance.md). Without the extension, or where it differs from
this numpy, numpy draws them.
"""

from __future__ import annotations

import functools
import os

import numpy as np

from .cancel import CancelToken, check


def numpy_permutations(seed: int, epochs: int, n: int, cancel: CancelToken | None = None) -> list[np.ndarray]:
    """The definition: ``epochs`` permutations of ``n`` from one ``Generator(PCG64(seed))``, int64."""
    rng = np.random.Generator(np.random.PCG64(seed))
    out = []
    for _ in range(epochs):
        check(cancel, 0, 0)  # a long list (many epochs of a large task) can stop here too
        out.append(rng.permutation(n).astype(np.int64, copy=False))  # (int64 already where intp is: no copy)
    return out


def epoch_permutations(seeds: list[int], epochs: int, n: int,
                       cancel: CancelToken | None = None) -> list[list[np.ndarray]]:
    """``numpy_permutations(seed, epochs, n)`` of each seed, in order; each array its own memory."""
    if not fast():
        return [numpy_permutations(seed, epochs, n, cancel) for seed in seeds]
    permute = _extension().permute
    generators = [np.random.PCG64(seed) for seed in seeds]
    out: list[list[np.ndarray]] = [[] for _ in seeds]
    for _ in range(epochs):
        check(cancel, 0, 0)
        arrays = [np.empty(n, dtype=np.int64) for _ in seeds]
        permute(generators, arrays)  # (each generator goes on from where its last epoch left it)
        for kept, array in zip(out, arrays):
            kept.append(array)
    return out


def _extension():
    from . import _permutations

    return _permutations


@functools.cache
def fast() -> bool:
    """Whether ``epoch_permutations`` draws in one call: the extension is built, gives numpy's
    arrays here (a few seeds, lengths and epochs, against ``numpy_permutations``), and
    ``REV88_FAST_PERMUTATIONS`` is not ``0``."""
    if os.environ.get("REV88_FAST_PERMUTATIONS", "1") == "0":
        return False
    try:
        permute = _extension().permute
    except ImportError:
        return False
    seeds = [0, 1, 88, 2**40 + 7]
    for n, epochs in ((0, 1), (1, 2), (2, 3), (257, 2), (10_000, 2)):
        generators = [np.random.PCG64(seed) for seed in seeds]
        want = [numpy_permutations(seed, epochs, n) for seed in seeds]
        for epoch in range(epochs):
            arrays = [np.empty(n, dtype=np.int64) for _ in seeds]
            permute(generators, arrays)
            if not all(np.array_equal(a, w[epoch]) for a, w in zip(arrays, want)):
                return False
    return True
