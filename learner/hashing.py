"""Array hashes as the reference records name them: sha256 of C-contiguous
little-endian bytes.

torch is not imported here (the task reader hashes its arrays without it); a tensor
passed in is converted by its own methods."""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


# byte orders that read as little-endian here: "<", "|" (one byte, or none) and "=" where native is little
_LITTLE = "<|=" if sys.byteorder == "little" else "<|"


def to_numpy(a: np.ndarray | torch.Tensor) -> np.ndarray:
    if not isinstance(a, np.ndarray) and hasattr(a, "detach"):  # a torch.Tensor
        a = a.detach().cpu().numpy()
    return a


def array_sha256(a: np.ndarray | torch.Tensor) -> str:
    return bytes_sha256(_as_hashed(a))


def _as_hashed(a: np.ndarray | torch.Tensor) -> np.ndarray:
    """The array as the bytes its hash is of: C-contiguous, little-endian."""
    arr = to_numpy(a)
    if arr.flags.c_contiguous and arr.dtype.byteorder in _LITTLE:
        # already its own C-contiguous little-endian bytes (every array the learner makes): hashed
        # as they lie, without the four views below (a launch hashes ~25 small arrays per task)
        return arr
    arr = np.ascontiguousarray(arr.astype(arr.dtype.newbyteorder("<"), copy=False))
    # the array's own memory, read as bytes: the same bytes as arr.tobytes(), without the copy
    return arr.reshape(-1).view(np.uint8)


def named_sha256(names: list[str], arrays: list[np.ndarray | torch.Tensor]) -> dict[str, str]:
    return {name: array_sha256(a) for name, a in zip(names, arrays)}


def state_vector(arrays: list[np.ndarray | torch.Tensor]) -> np.ndarray:
    """All parameters flattened and concatenated in order (float32)."""
    return np.concatenate([to_numpy(a).reshape(-1) for a in arrays])


def bytes_sha256(data: bytes | memoryview | np.ndarray) -> str:
    """SHA-256 hex digest of a buffer, hashed by ``update`` and not the constructor: CPython's
    ``hashlib.sha256(data)`` holds the GIL while it hashes, ``update`` releases it for large
    buffers (measured: docs/performance.md). The service hashes megabytes per task beside its
    event loop and its other threads."""
    h = hashlib.sha256()
    h.update(data)
    return h.hexdigest()


# ---------------------------------------------------------------------------- many at once
def sha256_many(items: Sequence) -> list[str]:
    """``array_sha256`` of each item, in order; an item that is a list or tuple of arrays is
    hashed as ``state_vector`` of them (their concatenation, without making it). The same digests
    either way; how they are made is chosen for speed: many buffers of similar sizes go sixteen
    side by side through the AVX-512 rounds of ``learner/sha256_lanes.c`` where this CPU has them
    and they measured faster here than hashlib (``lanes_speedup``), the rest one by one."""
    hashed = [_concatenated(item) if isinstance(item, (list, tuple)) else _as_hashed(item) for item in items]
    sizes = [sum(p.nbytes for p in h) if isinstance(h, list) else h.nbytes for h in hashed]
    speedup = lanes_speedup()
    # the lanes run as long as their longest buffer: worth it only when that is a small part of all
    if speedup > 1.0 and len(hashed) >= 2 and max(sizes) * _LANES < sum(sizes) * speedup:
        order = sorted(range(len(hashed)), key=sizes.__getitem__, reverse=True)  # longest first: lanes balanced
        digests = _lanes().digests([hashed[i] for i in order])
        out = [""] * len(hashed)
        for i, digest in zip(order, digests):
            out[i] = digest
        return out
    return [_one_by_one(h) for h in hashed]


def _concatenated(arrays: Sequence) -> list[np.ndarray] | np.ndarray:
    """``state_vector(arrays)``'s bytes: the arrays as they are where they share a dtype (each
    hashed in turn), else the promoted concatenation itself."""
    parts = [to_numpy(a) for a in arrays]
    if len({p.dtype for p in parts}) <= 1:
        return [_as_hashed(p.reshape(-1)) for p in parts]
    return _as_hashed(state_vector(parts))


def _one_by_one(hashed: list[np.ndarray] | np.ndarray) -> str:
    if not isinstance(hashed, list):
        return bytes_sha256(hashed)
    h = hashlib.sha256()
    for part in hashed:
        h.update(part)
    return h.hexdigest()


_LANES = 16


def _lanes():
    from . import _sha256_lanes

    return _sha256_lanes


def _lanes_ready() -> bool:
    """The extension is built and this CPU runs its AVX-512 rounds."""
    try:
        return bool(_lanes().has_avx512())
    except ImportError:
        return False


@functools.cache
def lanes_speedup() -> float:
    """How many times hashlib's speed the sixteen lanes hash at on this machine (measured once per
    process, ~3 ms: the fastest of three rounds of 16 x 64 KB each way), 0.0 where they cannot run
    (no AVX-512, the extension not built) or ``REV88_SHA256_LANES=0``."""
    if os.environ.get("REV88_SHA256_LANES", "1") == "0" or not _lanes_ready():
        return 0.0
    lanes = _lanes()
    buffers = [np.random.default_rng(i).integers(0, 256, 1 << 16, dtype=np.uint8) for i in range(_LANES)]
    want = [bytes_sha256(b) for b in buffers]
    if lanes.digests(buffers) != want:  # (never: tests/test_hashing.py; but a wrong digest is never used)
        return 0.0
    best_lanes = best_one = float("inf")
    for _ in range(3):
        t0 = time.thread_time()
        lanes.digests(buffers)
        t1 = time.thread_time()
        for b in buffers:
            bytes_sha256(b)
        t2 = time.thread_time()
        best_lanes, best_one = min(best_lanes, t1 - t0), min(best_one, t2 - t1)
    return best_one / max(best_lanes, 1e-9)
