"""Threads named for the operating system too, so ``top -H``, ``/proc/PID/task/*/comm`` and the shell
benchmark (bench/bench_shell.py) can tell the service's threads apart. Linux only (prctl
PR_SET_NAME, 15 bytes at most); elsewhere, or if prctl fails, nothing happens."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading

_PR_SET_NAME = 15
_libc = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError:
        _libc = None


def name_os_thread(name: str | None = None) -> None:
    """Give the calling thread's OS thread ``name`` (default: its Python name), cut to 15 bytes."""
    if _libc is None:
        return
    raw = (name or threading.current_thread().name).encode("utf-8", "replace")[:15]
    try:
        _libc.prctl(_PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0)
    except (OSError, AttributeError):
        pass
