"""Datasets resident on a device (issue #46): a task's train images, labels and query images, converted
and copied to the device once and kept for the launches that use them.

A sweep's or an evaluation's cells share a few datasets; each launch used to copy every task's
images to the device, task by task. Here a dataset is staged once per device -- train images as
(N, 81) float32 raw pixels, labels as (N,) int32, query images as (M, 81) float32, the values the
fused kernels read (the lift ``4x - 0.5`` stays in the kernel) -- and kept, keyed by the task's
input hashes (``TaskArrays.input_hashes()``: the SHA-256 of each array), so equal data is one copy
whichever request brought it. The launch then gives each task the row of its dataset
(``learner/kernels/fused_parts.data_rows``).

The kept datasets are an LRU bounded by bytes per device (``configure``; the service's
REV88_DEVICE_DATASET_BYTES, default ``DEFAULT_BYTES``). A launch holds the datasets it uses until it
ends, so one evicted meanwhile (by the launch itself, or on another device's thread: the bound is
per device) is only freed after it; a later launch that needs it again stages it again -- never an
error. A dataset larger than the whole bound is staged for its launch and not kept; a bound of 0
keeps nothing (every launch stages its datasets, as before this module).
"""

from __future__ import annotations

import collections
import dataclasses
import threading

import numpy as np
import torch

from ..taskio import TaskArrays

DEFAULT_BYTES = 2 << 30  # ~330 datasets of 10k train + 10k query images (6.5 MB each) per device


@dataclasses.dataclass(frozen=True)
class Resident:
    """One dataset on one device: what the fused kernels read."""

    train: torch.Tensor  # (N, 81) float32 raw pixels
    labels: torch.Tensor  # (N,) int32
    test: torch.Tensor  # (M, 81) float32 raw pixels

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.train, self.labels, self.test))


def stage(task: TaskArrays, device: torch.device) -> Resident:
    """Copy ``task``'s data to ``device`` in the kernels' layout (a copy of its own on the CPU as well:
    nothing kept aliases the task's arrays)."""
    n, m = task.train_count, task.test_count
    return Resident(
        train=torch.from_numpy(task.train_images.reshape(n, 81)).to(device, copy=True),
        labels=torch.from_numpy(task.train_labels.astype(np.int32)).to(device, copy=True),
        test=torch.from_numpy(task.test_images.reshape(m, 81)).to(device, copy=True),
    )


def dataset_key(task: TaskArrays) -> tuple[str, str, str]:
    """The dataset's identity: the SHA-256 of its train images, train labels and query images (computed
    once per task and kept by the task)."""
    h = task.input_hashes()
    return h["train_images"], h["train_labels"], h["test_images"]


class DeviceDatasets:
    """The datasets kept on each device, least recently used out first, at most ``max_bytes`` per device."""

    def __init__(self, max_bytes: int = DEFAULT_BYTES) -> None:
        self.max_bytes = int(max_bytes)
        self._kept: dict[str, collections.OrderedDict[tuple, Resident]] = {}
        self._bytes: dict[str, int] = {}
        self._counts: dict[str, dict[str, int]] = {}
        self._lock = threading.Lock()

    def get(self, task: TaskArrays, device: torch.device, key: tuple | None = None) -> tuple[Resident, bool]:
        """``task``'s dataset on ``device`` and whether it was staged by this call (False: it was kept).
        ``key``: its ``dataset_key``, when the caller has it already."""
        key = dataset_key(task) if key is None else key
        where = str(device)
        with self._lock:
            kept = self._kept.setdefault(where, collections.OrderedDict())
            counts = self._count(where)
            resident = kept.get(key)
            if resident is not None:
                kept.move_to_end(key)
                counts["hits"] += 1
                return resident, False
            counts["stagings"] += 1
        resident = stage(task, device)  # outside the lock: a copy to the device takes a while
        self._keep(where, key, resident)
        return resident, True

    def _count(self, where: str) -> dict[str, int]:
        return self._counts.setdefault(where, {"hits": 0, "stagings": 0, "evictions": 0, "not_kept": 0})

    def _keep(self, where: str, key: tuple, resident: Resident) -> None:
        size = resident.nbytes
        with self._lock:
            counts = self._count(where)
            if size > self.max_bytes:
                counts["not_kept"] += 1
                return
            kept = self._kept.setdefault(where, collections.OrderedDict())
            if key in kept:  # another thread staged it meanwhile: one copy is kept
                return
            kept[key] = resident
            self._bytes[where] = self._bytes.get(where, 0) + size
            self._evict(where)

    def _evict(self, where: str) -> None:
        kept = self._kept.get(where)
        while kept and self._bytes[where] > self.max_bytes:
            _, old = kept.popitem(last=False)
            self._bytes[where] -= old.nbytes
            self._counts[where]["evictions"] += 1

    def resize(self, max_bytes: int) -> None:
        with self._lock:
            self.max_bytes = int(max_bytes)
            for where in list(self._kept):
                self._evict(where)

    def clear(self) -> None:
        """Drop every kept dataset (the counters stay)."""
        with self._lock:
            self._kept.clear()
            self._bytes.clear()

    def snapshot(self, device: torch.device | str) -> dict:
        """What is kept on ``device``: datasets, bytes, the bound, hits, stagings, evictions and the
        datasets staged but not kept (larger than the bound)."""
        where = str(device)
        with self._lock:
            return {"datasets": len(self._kept.get(where, ())), "bytes": self._bytes.get(where, 0),
                    "max_bytes": self.max_bytes, **self._count(where)}


datasets = DeviceDatasets()  # the process's: the fused backend stages its launches' datasets here


def configure(max_bytes: int) -> None:
    """Bound the datasets kept on each device to ``max_bytes`` (0: keep none; every launch stages its own)."""
    if max_bytes < 0:
        raise ValueError(f"the device-resident datasets' bound must be >= 0 bytes, got {max_bytes}")
    datasets.resize(max_bytes)
