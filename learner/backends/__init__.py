"""Backend registry: names -> constructors, and what ``auto`` picks.

Backends are created once per process and reused (the cuda backend caches
captured graphs per task shape and config).
"""

from __future__ import annotations

import threading

import torch

from .base import Backend, Prepared, RunOutput

NAMES = ("auto", "cpu", "cuda", "fused")
_instances: dict[str, Backend] = {}
_lock = threading.Lock()


class BackendUnavailable(RuntimeError):
    pass


def resolve(name: str) -> str:
    """Map ``auto`` to a concrete backend name; reject unknown names clearly."""
    if name not in NAMES:
        raise BackendUnavailable(f"unknown backend {name!r}; choose one of {', '.join(NAMES)}")
    if name == "auto":
        if not torch.cuda.is_available():
            return "cpu"
        from .fused import fused_ready  # fused once its self-check has passed in this process

        return "fused" if fused_ready() else "cuda"
    return name


def get_backend(name: str = "auto") -> Backend:
    concrete = resolve(name)
    with _lock:
        if concrete not in _instances:
            _instances[concrete] = _create(concrete)
        return _instances[concrete]


def loaded_backends() -> dict[str, Backend]:
    return dict(_instances)


def _create(name: str) -> Backend:
    if name == "cpu":
        from .cpu import CpuBackend

        return CpuBackend()
    if name == "cuda":
        if not torch.cuda.is_available():
            raise BackendUnavailable("backend 'cuda' needs a CUDA GPU and none is available here")
        from .cuda import GraphBackend

        return GraphBackend("cuda")
    if name == "fused":
        if not torch.cuda.is_available():
            raise BackendUnavailable("backend 'fused' needs a CUDA GPU and none is available here")
        from .fused import FusedBackend

        return FusedBackend("cuda")
    raise BackendUnavailable(f"unknown backend {name!r}")


__all__ = ["Backend", "BackendUnavailable", "NAMES", "Prepared", "RunOutput", "get_backend", "resolve"]
