"""The split variant, its second half: each weight's gradient summed over the minibatch, and its update.

Program ``(q, t)`` of a launch with grid ``(2*DEPTH + 1, T)`` owns weight q of task t (q = 2*DEPTH:
the head's two halves and its bias). It sums the gradient over the minibatch's rows from the
operands fused_rows.py kept (fused_parts.rows_layout), with fused_parts.grad_rows and bias_rows
-- the functions the one-program kernel runs over its chunks, here over all of the minibatch's
rows at once: the same accumulator down the same rows, so the same bytes -- into G, then applies
SGD-momentum (fused_parts.sgd_update, the one program's) to that weight's parameters:

    v = momentum*v + g (+ weight_decay*p);  p = p - lr*v        (torch.optim.SGD)

Each program reads and writes only its own weight's parameters, velocity and gradient sums.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fused_parts import bias_rows, grad_rows, sgd_update


@triton.jit(do_not_specialize=["step"])
def fused_update_kernel(
    param_ptr,  # (T, S) float32: parameters, updated in place
    vel_ptr,  # (T, S) float32: velocity, updated in place
    grad_ptr,  # (T, S) float32 scratch: the minibatch's gradient sums
    rows_ptr,  # (T, rows_size(DEPTH, bpad)) float32: fused_rows.py's kept operands
    n_train,
    batch_size,
    step,
    bpad,
    lr,
    momentum,
    weight_decay,
    DEPTH: tl.constexpr,
    HAS_WD: tl.constexpr,
    PRECISION: tl.constexpr,
):
    S: tl.constexpr = 2 * DEPTH * 4096 + 2 * 1024 + 16
    HEAD: tl.constexpr = 2 * DEPTH * 4096
    q = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    steps_per_epoch = tl.cdiv(n_train, batch_size)
    start = (step - (step // steps_per_epoch) * steps_per_epoch) * batch_size
    rows_in_batch = tl.minimum(batch_size, n_train - start)
    k_rows = tl.cdiv(rows_in_batch, 16) * 16  # the 16-row slices the one program's chunks sum
    P = param_ptr + t * S
    V = vel_ptr + t * S
    G = grad_ptr + t * S
    R = rows_ptr + t * ((4 * DEPTH * 64 + 144) * bpad)
    RH = R + (4 * DEPTH) * bpad * 64  # the head's g (bpad, 16), then left and right (bpad, 64)
    j = tl.arange(0, 64)
    c = tl.arange(0, 16)
    if q < 2 * DEPTH:  # dW[q] = g.T @ a over the rows: A = g (a_sm 1, a_sk 64), B = a
        grad_rows(G + q * 4096, j[:, None] * 64 + j[None, :], R + (2 * q + 1) * bpad * 64, 1, 64,
                   R + (2 * q) * bpad * 64, 64, 1, k_rows, 0, 64, 64, PRECISION)
        lo = q * 4096
        hi = lo + 4096
    else:  # dHL = g.T @ left, dHR = g.T @ right, dbias = sum(g)
        h_off = c[:, None] * 64 + j[None, :]
        grad_rows(G + HEAD, h_off, RH, 1, 16, RH + bpad * 16, 64, 1, k_rows, 0, 16, 64, PRECISION)
        grad_rows(G + HEAD + 1024, h_off, RH, 1, 16, RH + bpad * 80, 64, 1, k_rows, 0, 16, 64, PRECISION)
        bias_rows(G + HEAD + 2048, RH, k_rows, 0)
        lo = HEAD
        hi = S
    tl.debug_barrier()  # the gradient sums are written before the update reads them
    k = tl.arange(0, 1024)
    for off in range(0, 4096, 1024):  # a weight is 4096 entries, the head 2 * 1024 + 16
        idx = lo + off + k
        sgd_update(P + idx, V + idx, G + idx, idx < hi, lr, momentum, weight_decay, HAS_WD)


def launch_update(params, velocity, grads, rows, *, step: int, bpad: int, n_train: int, batch_size: int,
                  learning_rate: float, momentum: float, weight_decay: float, depth: int, num_warps: int,
                  precision: str, warmup: bool = False):
    """Step ``step``'s update of every task: grid (2 * depth + 1, T)."""
    grid = (2 * depth + 1, int(params.shape[0]))
    args = (params, velocity, grads, rows, n_train, batch_size, step, bpad, learning_rate, momentum, weight_decay)
    meta = dict(DEPTH=depth, HAS_WD=weight_decay != 0.0, PRECISION=precision, num_warps=num_warps, num_stages=1,
                enable_fp_fusion=True)
    if warmup:
        return fused_update_kernel.warmup(*args, grid=grid, **meta)
    return fused_update_kernel[grid](*args, **meta)
