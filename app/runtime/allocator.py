"""glibc malloc settings for ``rev88 serve``: reuse freed memory instead of handing it back.

Every task allocates the same few large blocks (the body, its arrays, the learner's
buffers: megabytes each) and frees them when it is answered. With glibc's defaults a block
over the mmap threshold (128 KiB, raised only after such a block is freed) is a fresh
``mmap`` each time, and free memory at the top of the heap over the trim threshold is
returned to the kernel; the next task then page-faults every page in again (a 6.5 MB copy:
about 1,600 faults). The server CPU per draw-0 task this saves: docs/performance.md, "Throughput".

``tune()`` raises both thresholds once, at startup: blocks up to ``MMAP_THRESHOLD`` come from
the heap and stay there for the next task, and the heap keeps up to ``TRIM_THRESHOLD`` of free
memory at its top. The price is resident memory that stays at its working-set peak between
tasks instead of falling back: RSS follows the most memory ever freed at once. That is bounded
only while a task's buffers are freed when it is answered. Measured over 20,000 mixed tasks
(``bench/bench_soak.py``, docs/performance.md "Memory over a long run"): the heaps keep a steady
amount free between tasks and RSS stays flat. Before 9bd019e and 6a428e1 each task's arrays (and a
large request's body) sat in a reference cycle until the cyclic GC's next full pass, which freed
gigabytes at once, every few thousand tasks, and the heaps kept all of it (RSS doubled: the same
page); ``tests/test_memory_soak.py`` keeps tasks and requests out of cycles.

An operator's own ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` (glibc's environment
tunables) win: with either set, nothing is changed. Other C libraries (musl) are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Mapping

M_TRIM_THRESHOLD = -1  # <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's own ceiling for its dynamic threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 128 << 20
OPERATOR_TUNABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")  # and glibc.malloc.* in GLIBC_TUNABLES


def tune(environ: Mapping[str, str] | None = None) -> str:
    """Apply the thresholds; returns what was done, in words (for the startup line)."""
    env = os.environ if environ is None else environ
    given = [name for name in OPERATOR_TUNABLES if env.get(name)]
    if "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
        given.append("GLIBC_TUNABLES")
    if given:
        return f"malloc left to {', '.join(given)}"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        version = libc.gnu_get_libc_version
    except (OSError, AttributeError):
        return "malloc defaults (not glibc)"
    version.restype = ctypes.c_char_p
    done = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not done:
        return f"malloc defaults (glibc {version().decode()} refused mallopt)"
    return f"malloc keeps freed memory (mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim {TRIM_THRESHOLD >> 20} MiB)"
