"""One launch is one SGD step of each task, its minibatch spread over several programs.

The latency variant of the fused backend (``variant="split"``): a lone task on
``fused_train.py``'s kernel runs on one SM while the GPU's others idle. Here program ``(p, t)``
of a launch with grid ``(NPROG, T)`` owns chunk ``p`` (rows ``p*CHUNK ..``) of task ``t``'s
minibatch, ``NPROG = ceil(batch_size / CHUNK)``; the host launches this kernel once per step
(the launch boundary is the barrier between steps), then once more to apply the last update,
then ``fused_predict.py``'s kernel over the queries.

Launch ``s`` (0 <= s <= n_steps), program ``(p, t)``:

    update   s = 0: W <- the state after 0 updates (the initial parameters, written by the host)
             s > 0: g = ((0 + part[s-1][0]) + part[s-1][1]) + ... over the 16-row slices of step
                    s-1's minibatch, in row order (the order in which fused_train.py's one program
                    sums them in G: fused_parts._grad_rows), then SGD-momentum from the state after
                    s-1 updates:  v = momentum*v + g (+ weight_decay*p);  p = p - lr*v  -> W (this
                    program's copy of the parameters its products read); program 0 also writes p
                    and v as the state after s updates
    chunk    s < n_steps, if the chunk has rows: fused_parts._chunk_gradients of rows
             order[start + p*CHUNK ..] with W, each 16-row slice's gradients -> part[s][slice]

Every program computes the same update from the same values in the same order, so the W of every
program equals the state program 0 writes, bit for bit, and equals what fused_train.py's one
program computes (fused_parts: one arithmetic for every variant): the two kernels give the same
bytes (tests/test_fused.py checks it in the interpreter, scripts/gpu_tune.py on a GPU).

Buffers by parity, so that no launch reads what it writes: ``state[t, s % 2]`` holds (params,
velocity) after s updates, ``part[t, s % 2, i]`` the gradients of step s's slice i (rows
16i .. 16i + 15 of its minibatch). Launch s reads parity (s-1) % 2 and writes parity s % 2.
The slices of a minibatch of B rows: ceil(B / 16), each a whole state (``state_size``): the
backend runs this variant only for B <= SPLIT_MAX_BATCH.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fused_parts import _chunk_gradients, _indices


@triton.jit(do_not_specialize=["step"])  # one compiled kernel for every step (no step == 1 variant)
def fused_step_kernel(
    train_ptr,  # (T, N, 81) float32 raw train pixels
    labels_ptr,  # (T, N) int32
    perm_ptr,  # (T, E, N) int32: epoch e trains in the order perm[t, e]
    state_ptr,  # (T, 2, 2, S) float32: [parity][params, velocity]; state[t, 0] = (initial, 0) from the host
    work_ptr,  # (T, NPROG, S) float32 scratch: each program's copy of the parameters
    part_ptr,  # (T, 2, ceil(B / 16), S) float32 scratch: [parity][slice] gradients of one step's 16-row slices
    scratch_ptr,  # (T, NPROG, scratch_size(CHUNK)) float32 scratch: staged operands of the products
    n_train,
    n_epochs,
    batch_size,
    step,  # this launch's step s (n_steps: only the last update)
    alpha,
    lr,
    momentum,
    weight_decay,
    DEPTH: tl.constexpr,
    CHUNK: tl.constexpr,
    NPROG: tl.constexpr,  # programs per task: ceil(batch_size / CHUNK)
    HAS_WD: tl.constexpr,
    PRECISION: tl.constexpr,
):
    S: tl.constexpr = 2 * DEPTH * 4096 + 2 * 1024 + 16
    p = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    train = train_ptr + t * n_train * 81
    labels = labels_ptr + t * n_train
    perm = perm_ptr + t * n_epochs * n_train
    now = state_ptr + t * (4 * S) + (step % 2) * (2 * S)  # (params, velocity) after `step` updates
    before = state_ptr + t * (4 * S) + ((step + 1) % 2) * (2 * S)  # ... after step - 1 updates
    W = work_ptr + (t * NPROG + p) * S
    XA = scratch_ptr + (t * NPROG + p) * (CHUNK * 144)
    XB = XA + CHUNK * 64
    XG = XB + CHUNK * 64
    steps_per_epoch = tl.cdiv(n_train, batch_size)
    n_steps = n_epochs * steps_per_epoch
    slices = tl.cdiv(batch_size, 16)  # 16-row slices of a whole minibatch: part's second dimension
    k = tl.arange(0, 1024)
    writes = tl.where(p == 0, S, 0)  # program 0 writes the state: offsets below S, the others none

    if step == 0:
        for off in range(0, S, 1024):
            m = off + k < S
            tl.store(W + off + k, tl.load(now + off + k, mask=m, other=0.0), mask=m)
    else:
        last = step - 1
        last_epoch = last // steps_per_epoch
        last_rows = tl.minimum(batch_size, n_train - (last - last_epoch * steps_per_epoch) * batch_size)
        n_slices = tl.cdiv(last_rows, 16)
        parts = part_ptr + (t * 2 + last % 2) * (slices * S)
        for off in range(0, S, 1024):
            m = off + k < S
            g = tl.zeros([1024], dtype=tl.float32)
            i = n_slices * 0
            while i < n_slices:
                g = g + tl.load(parts + i * S + off + k, mask=m, other=0.0)
                i += 1
            p_old = tl.load(before + off + k, mask=m, other=0.0)
            if HAS_WD:
                g = g + weight_decay * p_old
            v = tl.load(before + S + off + k, mask=m, other=0.0) * momentum + g
            p_new = p_old - lr * v
            tl.store(W + off + k, p_new, mask=m)
            tl.store(now + off + k, p_new, mask=off + k < writes)
            tl.store(now + S + off + k, v, mask=off + k < writes)
    tl.debug_barrier()  # W is written before the products read it

    if step < n_steps:
        epoch = step // steps_per_epoch
        start = (step - epoch * steps_per_epoch) * batch_size
        rows_in_batch = tl.minimum(batch_size, n_train - start)
        c0 = p * CHUNK
        if c0 < rows_in_batch:
            inv_b = tl.div_rn(1.0, rows_in_batch.to(tl.float32))  # mean cross-entropy
            order = perm + epoch * n_train + start
            G = part_ptr + (t * 2 + step % 2) * (slices * S)  # slice i of this step at G + i * S
            r, j, c, w_off, h_off, cls_ok = _indices(CHUNK)
            _chunk_gradients(W, G, XA, XB, XG, train, labels, order, c0, rows_in_batch, inv_b, S, alpha,
                             r, j, c, w_off, h_off, cls_ok, DEPTH, CHUNK, PRECISION, True)


SPLIT_MAX_BATCH = 1024  # the gradient slices take 2 * ceil(B / 16) states per task (= backends/fused.py's)


def programs_per_task(batch_size: int, chunk: int) -> int:
    return -(-batch_size // chunk)


def slices_per_step(batch_size: int) -> int:
    return -(-batch_size // 16)


def launch_step(
    train, labels, perms, state, work, parts, scratch, *, step: int, n_steps: int,
    n_train: int, n_epochs: int, batch_size: int, alpha: float, learning_rate: float, momentum: float,
    weight_decay: float, depth: int, chunk: int, num_warps: int, precision: str, warmup: bool = False,
):
    """Launch step ``step`` of every task (grid (NPROG, T)); ``step == n_steps``: the last update only."""
    nprog = programs_per_task(batch_size, chunk)
    grid = (nprog if step < n_steps else 1, int(train.shape[0]))
    args = (train, labels, perms, state, work, parts, scratch, n_train, n_epochs, batch_size, step,
            alpha, learning_rate, momentum, weight_decay)
    meta = dict(DEPTH=depth, CHUNK=chunk, NPROG=nprog, HAS_WD=weight_decay != 0.0, PRECISION=precision,
                num_warps=num_warps, num_stages=1, enable_fp_fusion=True)
    if warmup:
        return fused_step_kernel.warmup(*args, grid=grid, **meta)
    return fused_step_kernel[grid](*args, **meta)
