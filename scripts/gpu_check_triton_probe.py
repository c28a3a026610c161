"""A 16-element Triton kernel for the toolchain pre-check (scripts/gpu_check_precheck.py).

A module of its own, imported only once TRITON_INTERPRET has its final value (the dry run sets it
before any import of triton), with the kernel at module level as in learner/kernels/fused_train.py:
the compiler resolves ``tl`` through the module's globals.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def add16(x_ptr, y_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, tl.load(x_ptr + i) * 2.0 + tl.load(y_ptr + i))
