"""Backend registry: names -> constructors, and what ``auto`` picks.

Backends are created once per process and reused (the cuda backend caches
captured graphs per task shape and config). Importing this module does not import torch (the
command line's ``--help`` reads ``NAMES``); choosing or creating a backend does.
"""

from __future__ import annotations

import threading

from .base import Backend, Prepared, RunOutput

NAMES = ("auto", "cpu", "cuda", "fused", "cpu-fast")
_instances: dict[str, Backend] = {}
_lock = threading.Lock()


class BackendUnavailable(RuntimeError):
    pass


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def resolve(name: str) -> str:
    """Map ``auto`` to a concrete backend name; reject unknown names clearly."""
    if name not in NAMES:
        raise BackendUnavailable(f"unknown backend {name!r}; choose one of {', '.join(NAMES)}")
    if name == "auto":
        if not _cuda_available():
            return _auto_cpu()
        from .fused import fused_ready  # fused once its self-check has passed in this process

        return "fused" if fused_ready() else "cuda"
    return name


def _auto_cpu() -> str:
    """cpu-fast once its self-check (cached, once per process) has passed, else cpu."""
    from .cpu_fast import cpu_fast_ready

    ok, _reason = cpu_fast_ready()
    return "cpu-fast" if ok else "cpu"


def get_backend(name: str = "auto", device: str | None = None) -> Backend:
    """The process's backend object for ``name``; GPU backends keep one per ``device``
    (``cuda:0``, ``cuda:1``, ...; None: the current CUDA device). CPU backends ignore it."""
    concrete = resolve(name)
    key = concrete
    if concrete in ("cuda", "fused") and device is not None and device.startswith("cuda:") and device != "cuda:0":
        key = f"{concrete}@{device}"
    with _lock:
        if key not in _instances:
            _instances[key] = _create(concrete, device)
        engine = _instances[key]
    if name == "auto" and concrete == "cpu" and not _cuda_available():
        from .cpu_fast import cpu_fast_ready

        # say in describe() why auto did not pick cpu-fast
        engine.notes["auto_fallback_reason"] = cpu_fast_ready()[1]
    return engine


def loaded_backends() -> dict[str, Backend]:
    return dict(_instances)


def _create(name: str, device: str | None = None) -> Backend:
    gpu = device if device is not None and device.startswith("cuda") else "cuda"
    if name == "cpu":
        from .cpu import CpuBackend

        return CpuBackend()
    if name == "cuda":
        if not _cuda_available():
            raise BackendUnavailable("backend 'cuda' needs a CUDA GPU and none is available here")
        from .cuda import GraphBackend

        return GraphBackend(gpu)
    if name == "fused":
        if not _cuda_available():
            raise BackendUnavailable("backend 'fused' needs a CUDA GPU and none is available here")
        from .fused import FusedBackend

        return FusedBackend(gpu)
    if name == "cpu-fast":
        from .cpu_fast import KERNEL_ERROR, CpuFastBackend, kernel_available

        if not kernel_available():
            raise BackendUnavailable(f"backend 'cpu-fast' is unavailable: {KERNEL_ERROR}")
        try:
            return CpuFastBackend()
        except ValueError as exc:  # a bad REV88_THREADS
            raise BackendUnavailable(f"backend 'cpu-fast': {exc}") from None
    raise BackendUnavailable(f"unknown backend {name!r}")


__all__ = ["Backend", "BackendUnavailable", "NAMES", "Prepared", "RunOutput", "get_backend", "resolve"]
