"""The split variant, its first half: one launch per SGD step runs a minibatch's rows over programs.

A lone task on fused_train.py's kernel runs on one SM while the GPU's others idle. The split
variant spreads each step of a task over several programs, two launches a step (the launch
boundary is the barrier), then scores the queries over many programs:

    for each step s:
        fused_rows.py     grid (NPROG, T), NPROG = ceil(B / CHUNK): program (p, t) lifts rows
                          order[start + p*CHUNK ..] of task t's minibatch s, runs them forward and
                          back with the parameters as they are (fused_parts.chunk_gradients, ROWS
                          true) and keeps, at rows p*CHUNK.. of task t's row blocks, the operands of
                          every weight gradient: each branch's a = alpha*relu(input) and gradient g,
                          the head's g, left and right (fused_parts.rows_layout)
        fused_update.py   grid (2*DEPTH + 1, T): program (q, t) sums weight q's gradient (q = 2*DEPTH:
                          the head's and the bias's) over the minibatch's rows with the very function
                          the one-program kernel runs over its chunks (fused_parts.grad_rows, one
                          accumulator down the rows), then applies SGD-momentum to that weight
    fused_predict.py      the queries

Every product, sum and update is the one-program kernel's, in its order: the two variants give a
task the same bytes (tests/test_fused.py checks it in the interpreter; scripts/gpu_tune.py checks
it on a GPU before a row may pair them). No buffer is read and written in the same launch: the
rows phase reads the parameters and writes the row blocks; the update reads the row blocks and
writes the parameters, velocity and gradient sums.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fused_parts import chunk_gradients, chunk_indices, data_rows

SPLIT_MAX_BATCH = 4096  # the row blocks take rows_size(depth, B) floats per task (= backends/fused.py's)


@triton.jit(do_not_specialize=["step"])  # one compiled kernel for every step (no step == 1 variant)
def fused_rows_kernel(
    train_ptr,  # (D, N, 81) float32 raw train pixels of the launch's D datasets
    labels_ptr,  # (D, N) int32
    perm_ptr,  # (T, E, N) int32: epoch e trains in the order perm[t, e]
    param_ptr,  # (T, S) float32: the parameters before step `step`'s update
    rows_ptr,  # (T, rows_size(DEPTH, bpad)) float32 out: the kept operands (fused_parts.rows_layout)
    scratch_ptr,  # (T, NPROG, scratch_size(CHUNK)) float32 scratch: staged operands of the products
    data_ptr,  # (T,) int32: the row of train and labels that holds task t's dataset
    n_train,
    n_epochs,
    batch_size,
    step,
    bpad,  # rows of each row block: NPROG * CHUNK
    alpha,
    DEPTH: tl.constexpr,
    CHUNK: tl.constexpr,
    NPROG: tl.constexpr,  # programs per task: ceil(batch_size / CHUNK)
    PRECISION: tl.constexpr,
):
    S: tl.constexpr = 2 * DEPTH * 4096 + 2 * 1024 + 16
    p = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    steps_per_epoch = tl.cdiv(n_train, batch_size)
    epoch = step // steps_per_epoch
    start = (step - epoch * steps_per_epoch) * batch_size
    rows_in_batch = tl.minimum(batch_size, n_train - start)
    c0 = p * CHUNK
    if c0 < rows_in_batch:
        XA = scratch_ptr + (t * NPROG + p) * (CHUNK * 144)
        inv_b = tl.div_rn(1.0, rows_in_batch.to(tl.float32))  # mean cross-entropy
        order = perm_ptr + t * n_epochs * n_train + epoch * n_train + start
        R = rows_ptr + t * ((4 * DEPTH * 64 + 144) * bpad)
        r, j, c, w_off, h_off, cls_ok = chunk_indices(CHUNK)
        d = tl.load(data_ptr + t).to(tl.int64)  # task t's dataset
        chunk_gradients(param_ptr + t * S, R, XA, XA + CHUNK * 64, XA + CHUNK * 128, train_ptr + d * n_train * 81,
                        labels_ptr + d * n_train, order, c0, rows_in_batch, inv_b, alpha, R, bpad,
                        r, j, c, w_off, h_off, cls_ok, DEPTH, CHUNK, PRECISION, True)


def programs_per_task(batch_size: int, chunk: int) -> int:
    return -(-batch_size // chunk)


def launch_rows(train, labels, perms, params, rows, scratch, *, step: int, n_train: int, n_epochs: int,
                batch_size: int, alpha: float, depth: int, chunk: int, num_warps: int, precision: str,
                warmup: bool = False, data_index=None):
    """Step ``step``'s rows of every task: grid (ceil(B / CHUNK), T), T = len(data_index)
    (fused_train.launch says what ``data_index`` is)."""
    data_index = data_rows(data_index, train)
    nprog = programs_per_task(batch_size, chunk)
    grid = (nprog, int(data_index.shape[0]))
    args = (train, labels, perms, params, rows, scratch, data_index, n_train, n_epochs, batch_size, step,
            nprog * chunk, alpha)
    meta = dict(DEPTH=depth, CHUNK=chunk, NPROG=nprog, PRECISION=precision, num_warps=num_warps, num_stages=1,
                enable_fp_fusion=True)
    if warmup:
        return fused_rows_kernel.warmup(*args, grid=grid, **meta)
    return fused_rows_kernel[grid](*args, **meta)
