"""The queries of trained tasks, spread over many programs: program ``(q, t)`` of a launch with
grid ``(ceil(M / CHUNK), T)`` scores queries ``q*CHUNK ..`` of task ``t`` with its trained
parameters (a plain forward: fused_parts.predict_chunk, the code fused_train.py's one program
runs over all of its queries). Each query's score depends only on the parameters and that query,
so the scores are the same bytes as the one program's. Used by the split variant (fused_rows.py,
fused_update.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fused_parts import chunk_indices, data_rows, predict_chunk


@triton.jit
def fused_predict_kernel(
    test_ptr,  # (D, M, 81) float32 raw query pixels of the launch's D datasets
    param_ptr,  # task t's padded parameters at param_ptr + t * param_stride
    scratch_ptr,  # (T, ceil(M / CHUNK), scratch_size(CHUNK)) float32 scratch
    scores_ptr,  # (T, M, 10) float32 out: query scores
    data_ptr,  # (T,) int32: the row of test that holds task t's dataset
    n_test,
    param_stride,
    alpha,
    DEPTH: tl.constexpr,
    CHUNK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    q = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    XA = scratch_ptr + (t * tl.num_programs(0) + q) * (CHUNK * 144)
    XB = XA + CHUNK * 64
    d = tl.load(data_ptr + t).to(tl.int64)  # task t's dataset
    r, j, c, w_off, h_off, cls_ok = chunk_indices(CHUNK)
    predict_chunk(param_ptr + t * param_stride, XA, XB, test_ptr + d * n_test * 81, scores_ptr + t * n_test * 10,
                   q * CHUNK, n_test, alpha, r, j, c, cls_ok, DEPTH, CHUNK, PRECISION)


def query_programs(n_test: int, chunk: int) -> int:
    return -(-n_test // chunk)


def launch_predict(test, params, scratch, scores, *, param_stride: int, n_test: int, alpha: float, depth: int,
                   chunk: int, num_warps: int, precision: str, warmup: bool = False, data_index=None):
    """Score every query of every task: grid (ceil(M / CHUNK), T), T = len(data_index)
    (fused_train.launch says what ``data_index`` is)."""
    data_index = data_rows(data_index, test)
    grid = (query_programs(n_test, chunk), int(data_index.shape[0]))
    args = (test, params, scratch, scores, data_index, n_test, param_stride, alpha)
    meta = dict(DEPTH=depth, CHUNK=chunk, PRECISION=precision, num_warps=num_warps, num_stages=1,
                enable_fp_fusion=True)
    if warmup:
        return fused_predict_kernel.warmup(*args, grid=grid, **meta)
    return fused_predict_kernel[grid](*args, **meta)
