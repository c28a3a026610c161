"""Which devices the service's workers own, and the queue and batch defaults that fit them.

The rule (docs/configuration.md, "Workers, queue and batching"):

* **CPU backends** (cpu, cpu-fast): one worker per core this process may use
  (``os.sched_getaffinity``), devices ``cpu:0 .. cpu:N-1``, each running one task at a time on
  one thread. No CPU backend batches, so ``batch_max`` defaults to 1; the queue holds
  ``max(8, 4 × workers)`` tasks.
* **GPU backends** (cuda, fused): one worker per visible GPU, devices ``cuda:0 .. cuda:N-1``,
  each with its own backend objects (graph cache, compiled kernel) and energy meter.
  ``batch_max`` defaults to the GPU's streaming-multiprocessor count (the fused kernel trains
  one task per program, one program per SM), and the queue holds ``2 × batch_max × workers``
  tasks, so that a full launch can wait for each worker while another runs.

``REV88_WORKERS``, ``REV88_QUEUE_SIZE`` and ``REV88_BATCH_MAX`` override each default; an
explicit setting is always honoured (only a worker count above the GPUs there are is refused).
"""

from __future__ import annotations

import dataclasses
import os

GPU_BACKENDS = ("cuda", "fused")
MIN_QUEUE = 8


def usable_cores() -> int:
    """Cores this process may use: its CPU affinity, capped by a cgroup v2 CPU quota (a
    container's or pod's CPU limit) when one is set."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_limit()
    return max(1, min(cores, quota) if quota else cores)


def cgroup_cpu_limit(path: str = "/sys/fs/cgroup/cpu.max") -> int | None:
    """ceil(quota / period) from cgroup v2's cpu.max ("max 100000" means no limit)."""
    try:
        quota, period = open(path).read().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return max(1, -(-int(quota) // int(period)))
    except (ValueError, ZeroDivisionError):
        return None


def visible_gpus() -> list[int]:
    """Streaming-multiprocessor count of each visible CUDA device ([] without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_properties(i).multi_processor_count for i in range(torch.cuda.device_count())]


@dataclasses.dataclass(frozen=True)
class Plan:
    devices: list[str]
    queue_size: int
    batch_max: int
    rule: str  # how the defaults were derived, for /health

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class PlanError(ValueError):
    pass


def plan(backend: str, workers: int | None = None, queue_size: int | None = None, batch_max: int | None = None,
         cores: int | None = None, gpus: list[int] | None = None) -> Plan:
    """The workers' devices and the queue/batch sizes for ``backend`` (a concrete name)."""
    if backend in GPU_BACKENDS:
        sms = visible_gpus() if gpus is None else gpus
        if not sms:
            raise PlanError(f"backend {backend!r} needs a CUDA GPU and none is visible")
        n = len(sms) if workers is None else workers
        if n > len(sms):
            raise PlanError(f"REV88_WORKERS={n} but only {len(sms)} GPU(s) are visible (one worker per GPU)")
        batch = min(sms[:n]) if batch_max is None else batch_max
        queue = max(MIN_QUEUE, 2 * batch * n) if queue_size is None else queue_size
        rule = (f"{n} worker(s), one per GPU; batch_max = SM count ({min(sms[:n])})" if batch_max is None
                else f"{n} worker(s), one per GPU; batch_max set")
        rule += "; queue = 2 x batch_max x workers" if queue_size is None else "; queue set"
        return Plan([f"cuda:{i}" for i in range(n)], queue, batch, rule)
    cores = usable_cores() if cores is None else cores
    n = cores if workers is None else workers
    batch = 1 if batch_max is None else batch_max
    queue = max(MIN_QUEUE, 4 * n) if queue_size is None else queue_size
    rule = f"{n} worker(s), " + ("one per usable core" if workers is None else "REV88_WORKERS")
    rule += "; batch_max 1 (no CPU backend batches)" if batch_max is None else "; batch_max set"
    rule += f"; queue = max({MIN_QUEUE}, 4 x workers)" if queue_size is None else "; queue set"
    return Plan([f"cpu:{i}" for i in range(n)], queue, batch, rule)


def engine_device(backend: str, worker_device: str) -> str:
    """The device a backend object runs on for a worker: the worker's GPU, or the CPU."""
    return worker_device if backend in GPU_BACKENDS and worker_device.startswith("cuda") else "cpu"
