"""One Triton program trains one rev88 task end to end, then scores its queries.

Program ``t`` of a launch with grid ``(T,)`` owns task ``t``, whose data is row ``data_index[t]`` of
the launch's datasets (tasks of one dataset read one copy of it, resident on the device):

    reset      params <- initial, velocity <- 0                       (its own slice of P, V)
    for each epoch e, each minibatch of order perm[e] (short last batch included):
        for each CHUNK rows of the minibatch:                          (fused_parts.chunk_gradients)
            lift       h = [4*x - 0.5, 0];  L = h[:, :41], R = h[:, 41:]   (gathered by perm, on load)
            forward    L += alpha*relu(R) @ W[2b].T ;  R += alpha*relu(L) @ W[2b+1].T      b = 0..d-1
            head       s = L @ HL.T + R @ HR.T + bias ;  g = softmax(s)/B - onehot(y)/B
            backward   head grads, then for b = d-1..0 the reversible reconstruction of
                       model.ReversibleCore.backward: subtract each branch to recover the
                       block input, and take that branch's weight and input gradients
            (weight gradients are summed over the minibatch's rows in G, 16 rows at a time)
        update     v = momentum*v + g (+ weight_decay*p);  p = p - lr*v        (torch.optim.SGD)
    predict    plain forward of every query row, scores -> S[t]

The padded state layout, the products (``_mm``, ``PRECISION``) and why the padded lanes stay
exactly zero: learner/kernels/fused_parts.py, which holds the pieces this kernel and the split
variant (fused_rows.py, fused_update.py, fused_predict.py) share.

Where the state lives: parameters, velocity, the gradient sums and the staging scratch
are the program's own slices of global memory. Only one program (one SM) ever touches a
slice, so they are served from that SM's L1 and the L2. The batch activations L, R and
their gradients live in registers. ``tl.debug_barrier()`` orders the phases in which the
program's threads exchange data through memory (reset -> steps, staging -> products,
products -> next staging, backward -> update, update -> next step / predict).

The kernel must be launched with ``num_stages=1``: the software pipeliner would otherwise
be free to prefetch next-iteration loads across this iteration's stores.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fused_parts import (  # noqa: F401 - the layout is this module's public API too
    CLASS_PAD,
    CLASSES,
    H_SIZE,
    HALF,
    PIXELS,
    PRECISIONS,
    W_SIZE,
    WIDTH,
    check_precision,
    chunk_gradients,
    chunk_indices,
    data_rows,
    pack_state,
    predict_chunk,
    rows_layout,
    rows_size,
    scratch_size,
    sgd_update,
    state_size,
    unpack_state,
    unpack_states,
)


@triton.jit
def fused_train_kernel(
    train_ptr,  # (D, N, 81) float32 raw train pixels of the launch's D datasets
    labels_ptr,  # (D, N) int32
    perm_ptr,  # (T, E, N) int32: epoch e trains in the order perm[t, e]
    test_ptr,  # (D, M, 81) float32 raw query pixels
    init_ptr,  # (T, S) float32 padded initial parameters
    param_ptr,  # (T, S) float32 out: final parameters (padded)
    vel_ptr,  # (T, S) float32 out: final velocity (padded)
    grad_ptr,  # (T, S) float32 scratch: one minibatch's gradient sums
    scratch_ptr,  # (T, scratch_size(CHUNK)) float32 scratch: staged operands of the products
    scores_ptr,  # (T, M, 10) float32 out: query scores
    data_ptr,  # (T,) int32: the row d of train, labels and test that holds task t's dataset (tasks may share one)
    n_train,
    n_test,
    n_epochs,
    batch_size,
    alpha,
    lr,
    momentum,
    weight_decay,
    DEPTH: tl.constexpr,
    CHUNK: tl.constexpr,  # rows per forward/backward pass; a minibatch is ceil(B/CHUNK) passes
    HAS_WD: tl.constexpr,
    PRECISION: tl.constexpr,  # tl.dot's input_precision: "ieee" or "tf32x3"
):
    S: tl.constexpr = 2 * DEPTH * 4096 + 2 * 1024 + 16
    t = tl.program_id(0).to(tl.int64)
    d = tl.load(data_ptr + t).to(tl.int64)  # task t's dataset: only where its data is read changes
    train = train_ptr + d * n_train * 81
    labels = labels_ptr + d * n_train
    perm = perm_ptr + t * n_epochs * n_train
    test = test_ptr + d * n_test * 81
    P = param_ptr + t * S
    V = vel_ptr + t * S
    G = grad_ptr + t * S
    XA = scratch_ptr + t * (CHUNK * 144)  # (CHUNK, 64)
    XB = XA + CHUNK * 64  # (CHUNK, 64)
    XG = XB + CHUNK * 64  # (CHUNK, 16)
    scores = scores_ptr + t * n_test * 10
    r, j, c, w_off, h_off, cls_ok = chunk_indices(CHUNK)

    # ---- reset: params <- initial, velocity <- 0
    k = tl.arange(0, 1024)
    for off in range(0, S, 1024):
        m = off + k < S
        tl.store(P + off + k, tl.load(init_ptr + t * S + off + k, mask=m, other=0.0), mask=m)
        tl.store(V + off + k, tl.zeros([1024], dtype=tl.float32), mask=m)
    tl.debug_barrier()

    # (while loops where the length is known only at run time: fused_parts' docstring says why)
    steps_per_epoch = tl.cdiv(n_train, batch_size)
    n_steps = n_epochs * steps_per_epoch
    step = n_steps * 0
    while step < n_steps:
        epoch = step // steps_per_epoch
        start = (step - epoch * steps_per_epoch) * batch_size
        rows_in_batch = tl.minimum(batch_size, n_train - start)
        inv_b = tl.div_rn(1.0, rows_in_batch.to(tl.float32))  # mean cross-entropy
        order = perm + epoch * n_train + start
        c0 = rows_in_batch * 0
        while c0 < rows_in_batch:
            chunk_gradients(P, G, XA, XB, XG, train, labels, order, c0, rows_in_batch, inv_b, alpha, G, 0,
                            r, j, c, w_off, h_off, cls_ok, DEPTH, CHUNK, PRECISION, False)
            c0 += CHUNK

        # SGD-momentum on every parameter, from the minibatch's gradient sums
        # (elementwise over the flat state; padded lanes have p = v = g = 0 and keep 0)
        for off in range(0, S, 1024):
            m = off + k < S
            sgd_update(P + off + k, V + off + k, G + off + k, m, lr, momentum, weight_decay, HAS_WD)
        tl.debug_barrier()
        step += 1

    # ---- predict: plain forward of every query, scores of the 10 real classes
    q0 = n_test * 0
    while q0 < n_test:
        predict_chunk(P, XA, XB, test, scores, q0, n_test, alpha, r, j, c, cls_ok, DEPTH, CHUNK, PRECISION)
        q0 += CHUNK


def launch(
    train, labels, perms, test, init, params, velocity, grads, scratch, scores, *,
    n_train: int, n_test: int, n_epochs: int, batch_size: int,
    alpha: float, learning_rate: float, momentum: float, weight_decay: float,
    depth: int, chunk: int, num_warps: int, precision: str = "ieee", warmup: bool = False, data_index=None,
):
    """Launch (or with ``warmup`` only compile) one program per task: grid = (T,), T = len(data_index).
    ``data_index`` (T,) int32: the row of train, labels and test holding each task's dataset (a
    dataset resident on the device is shared by the tasks of a launch that use it); None: row t."""
    data_index = data_rows(data_index, train)
    grid = (int(data_index.shape[0]),)
    args = (train, labels, perms, test, init, params, velocity, grads, scratch, scores, data_index,
            n_train, n_test, n_epochs, batch_size, alpha, learning_rate, momentum, weight_decay)
    meta = dict(DEPTH=depth, CHUNK=chunk, HAS_WD=weight_decay != 0.0, PRECISION=check_precision(precision),
                num_warps=num_warps, num_stages=1, enable_fp_fusion=True)
    if warmup:
        return fused_train_kernel.warmup(*args, grid=grid, **meta)
    return fused_train_kernel[grid](*args, **meta)
