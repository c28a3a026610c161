"""Seed-derived state, computed once per (seed, shape) and kept: a task's initial parameters and its
epoch permutations, with their SHA-256s (issue #46).

Both are functions of the config's seed, depth and epochs and of the task's training count alone
(``learner.train.initial_arrays``, ``learner.train.epoch_permutations``), so the cells of a
sweep over learning rate x momentum x 10 seeds prepare 10 states, not one per cell. The cache is
an LRU bounded by bytes (``configure``; the service's REV88_SEED_CACHE_BYTES, default
``DEFAULT_BYTES``); a state larger than the whole bound is computed and not kept.

A state being computed in one thread is waited for, not computed again, by another that asks for
it (the service computes the states of queued tasks ahead of their launch, on a thread of its own,
in batches: ``prepare``; ``missing`` tells it which are neither kept nor under way).

Kept arrays are shared by every task that uses them: no backend may write into a ``Prepared``'s
``initial`` or ``permutations`` (none does: each copies them to its own buffers; a test runs every
CPU backend and checks the kept arrays' hashes afterwards).
"""

from __future__ import annotations

import collections
import dataclasses
import threading

import numpy as np

from . import permutations
from .cancel import CancelToken
from .config import Config
from .hashing import sha256_many
from .model import parameter_count

DEFAULT_BYTES = 256 << 20  # ~1,400 states of a 10k-row, 2-epoch task (180 KB each)


@dataclasses.dataclass(frozen=True)
class SeedState:
    initial: list[np.ndarray]  # float32, in parameter order
    permutations: list[np.ndarray]  # int64, one per epoch
    initial_sha256: dict[str, str]
    permutation_sha256: list[str]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.initial) + sum(p.nbytes for p in self.permutations)


class SeedStateCache:
    def __init__(self, max_bytes: int = DEFAULT_BYTES, compute=None) -> None:
        """``compute``: (initial_arrays, parameter_names), learner.train's
        (which binds the process's cache to them: this module imports nothing of it)."""
        self.compute = compute
        self.max_bytes = int(max_bytes)
        self._states: collections.OrderedDict[tuple, SeedState] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._computing: dict[tuple, threading.Event] = {}  # states under way, set when kept (or not)
        self.hits = self.misses = 0

    @staticmethod
    def key(config: Config, train_count: int) -> tuple:
        return (config.seed, config.depth, config.epochs, int(train_count))

    def get(self, config: Config, train_count: int, cancel: CancelToken | None = None) -> SeedState:
        """The state of ``config``'s seed for a task of ``train_count`` rows (computed on a miss)."""
        key = self.key(config, train_count)
        while True:
            with self._lock:
                state = self._hit(key)
                if state is not None:
                    return state
                under_way = self._computing.get(key)
                if under_way is None:
                    self._computing[key] = threading.Event()
                    break
            # another thread (or a seed-state process) computes it: wait for that one, then look again
            # (not kept: larger than the bound, or its process did not give it -- then computed here)
            under_way.wait()
        try:
            with self._lock:
                self.misses += 1
            state = self._compute(config, train_count, cancel)
            self._keep(key, state)
            return state
        finally:
            with self._lock:
                self._computing.pop(key).set()

    def _hit(self, key: tuple) -> SeedState | None:
        state = self._states.get(key)
        if state is not None:
            self._states.move_to_end(key)
            self.hits += 1
        return state

    def _compute(self, config: Config, train_count: int, cancel: CancelToken | None) -> SeedState:
        return compute_state(config, train_count, cancel, self.compute)

    def claim(self, config: Config, train_count: int) -> tuple | None:
        """Mark ``config``'s state under way, when it is neither kept nor under way, for a state
        computed elsewhere (learner/seed_processes.py): its key, which ``settle`` must be given
        (a ``get`` meanwhile waits for it); None when there is nothing to compute."""
        key = self.key(config, train_count)
        with self._lock:
            if key in self._states or key in self._computing:
                return None
            self._computing[key] = threading.Event()
            self.misses += 1
        return key

    def settle(self, key: tuple, state: SeedState | None) -> None:
        """A claimed state: kept (None: it was not computed, and a waiting ``get`` computes it)."""
        try:
            if state is not None:
                self._keep(key, state)
        finally:
            with self._lock:
                self._computing.pop(key).set()

    def prepare(self, wanted: list[tuple[Config, int]]) -> int:
        """Compute and keep, together (``compute_states``), the states of these (config, training
        count) pairs that are neither kept nor under way; each is under way meanwhile (a ``get``
        waits for it). Returns how many were computed. If the batch fails, none is kept and each
        waiting ``get`` computes its own (and meets the error itself)."""
        claimed = [(key, pair) for pair in wanted if (key := self.claim(*pair)) is not None]
        computed: list[SeedState | None] = [None] * len(claimed)
        try:
            if claimed:
                computed = list(compute_states([pair for _, pair in claimed], compute=self.compute))
        finally:
            for (key, _), state in zip(claimed, computed):
                self.settle(key, state)
        return len(claimed)

    def missing(self, config: Config, train_count: int) -> bool:
        """Whether ``config``'s state for ``train_count`` rows is neither kept nor being computed
        (what is worth computing ahead; it counts no hit or miss)."""
        key = self.key(config, train_count)
        with self._lock:
            return key not in self._states and key not in self._computing

    def _keep(self, key: tuple, state: SeedState) -> None:
        size = state.nbytes
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self._states:
                return
            self._states[key] = state
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, old = self._states.popitem(last=False)
                self._bytes -= old.nbytes

    def resize(self, max_bytes: int) -> None:
        with self._lock:
            self.max_bytes = int(max_bytes)
            while self._bytes > self.max_bytes and self._states:
                _, old = self._states.popitem(last=False)
                self._bytes -= old.nbytes

    def snapshot(self) -> dict:
        with self._lock:
            return {"states": len(self._states), "bytes": self._bytes, "max_bytes": self.max_bytes,
                    "hits": self.hits, "misses": self.misses}


def compute_state(config: Config, train_count: int, cancel: CancelToken | None = None,
                  compute: tuple | None = None) -> SeedState:
    """A state computed, not kept (a cache's miss)."""
    return compute_states([(config, train_count)], cancel, compute)[0]


def compute_states(wanted: list[tuple[Config, int]], cancel: CancelToken | None = None,
                   compute: tuple | None = None) -> list[SeedState]:
    """The states of (config, training count) pairs, computed together, not kept: with
    ``compute``'s functions (initial_arrays, parameter_names), or those learner.train binds
    to the process's cache when it is imported. The permutations of the pairs that share an epoch
    count and a training count are drawn in one call per epoch, and every array's SHA-256 is made
    in one ``sha256_many``: a batch lets go of the GIL and takes it back a few times, not a few
    dozen times per state (the prepare thread's batches, a seed-state process's)."""
    compute = compute or states.compute
    if compute is None:
        raise RuntimeError("no functions to compute a seed state with: import learner.train first")
    initial_arrays, parameter_names = compute
    initial = [initial_arrays(config) for config, _ in wanted]  # (each state's in memory of its own)
    orders: list[list[np.ndarray]] = [[] for _ in wanted]
    shapes: dict[tuple[int, int], list[int]] = {}
    for i, (config, rows) in enumerate(wanted):
        shapes.setdefault((config.epochs, int(rows)), []).append(i)
    for (epochs, rows), members in shapes.items():
        drawn = permutations.epoch_permutations([wanted[i][0].seed for i in members], epochs, rows, cancel)
        for i, perms in zip(members, drawn):
            orders[i] = perms
    digests = iter(sha256_many([a for arrays in initial for a in arrays] + [p for perms in orders for p in perms]))
    named = [dict(zip(parameter_names(config.depth), digests)) for config, _ in wanted]
    return [SeedState(arrays, perms, names, [next(digests) for _ in perms])
            for arrays, perms, names in zip(initial, orders, named)]


def estimate_bytes(config: Config, train_count: int) -> int:
    """A state's size before it is computed (``SeedState.nbytes`` after): its permutations (int64,
    one per epoch) and its float32 initial parameters."""
    return 8 * int(train_count) * int(config.epochs) + 4 * parameter_count(config.depth)


states = SeedStateCache()  # the process's: learner.train binds it to its functions and prepares with it


def configure(max_bytes: int) -> None:
    """Bound the process's seed-state cache to ``max_bytes`` (0: keep nothing)."""
    if max_bytes < 0:
        raise ValueError(f"the seed-state cache's bound must be >= 0 bytes, got {max_bytes}")
    states.resize(max_bytes)
