"""Array hashes as the reference records name them: sha256 of C-contiguous
little-endian bytes.

torch is not imported here (the task reader hashes its arrays without it); a tensor
passed in is converted by its own methods."""

from __future__ import annotations

import hashlib
import sys
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
    arr = to_numpy(a)
    if arr.flags.c_contiguous and arr.dtype.byteorder in _LITTLE:
        # already its own C-contiguous little-endian bytes (every array the learner makes): hashed
        # as they lie, without the four views below (a launch hashes ~25 small arrays per task)
        return bytes_sha256(arr)
    arr = np.ascontiguousarray(arr.astype(arr.dtype.newbyteorder("<"), copy=False))
    # the array's own memory, read as bytes: the same bytes as arr.tobytes(), without the copy
    return bytes_sha256(arr.reshape(-1).view(np.uint8))


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
